"""ThoughtTracker.safe_to_look_ahead against brute force: every continuation of the next tokens."""
import copy
import itertools

import pytest

from gemmajax.engine.thinking import ThoughtTracker

OPEN, CLOSE, OTHER = 1, 2, 3


def _forcing_possible(t: ThoughtTracker, n: int) -> bool:
    """Some choice of the next n - 1 tokens makes one of tokens 2..n need forcing (must_close before it)."""
    for toks in itertools.product((OPEN, CLOSE, OTHER), repeat=n - 1):
        u = copy.deepcopy(t)
        for tok in toks:
            u.advance(tok)
            if u.must_close():
                return True
    return False


@pytest.mark.parametrize("budget", [None, 0, 1, 2, 3, 5])
def test_safe_to_look_ahead_matches_every_continuation(budget):
    checked = 0
    for in_thought, count, n in itertools.product((False, True), range(6), range(2, 8)):
        if not in_thought and count:
            continue   # count is 0 outside a thought
        t = ThoughtTracker(OPEN, CLOSE, budget, in_thought)
        t.count = count
        if t.must_close():
            continue   # the first token would be forced itself: no lookahead is planned from here
        assert t.safe_to_look_ahead(n) == (not _forcing_possible(t, n)), (budget, in_thought, count, n)
        checked += 1
    assert checked >= 6
