"""Random token walks over a grammar's masks (helpers for test_bounded_walks.py, importable by a measuring script).

A walk is a noise model: at each step it picks a token the GrammarConstraint allows, uniformly at random (seeded),
so anything valid in its output is the grammar's doing. A uniform pick inside an open string has ~260k allowed
tokens of which a handful close the string, so a purely uniform walk writes strings of thousands of tokens; the
walks therefore carry an explicit closing bias: with probability `p_close` the pick is uniform among the allowed
*closers* only (tokens spelled with nothing but `"`, `}`, `]` and `:` (which ends a bare Gemma key), the `<|"|>`,
`<tool_call|>`, `<|tool_response>` specials and the end tokens). Closers never continue a number or whitespace, so number and whitespace bounds are
the grammar's own; `anti_close=True` turns the bias around (closers only when nothing else is allowed), which
terminates only where the grammar itself bounds everything.
"""

from __future__ import annotations

import numpy as np

TOOL_CALL, END_CALL, TOOL_RESPONSE, STR_TOK, TURN_END, EOS = 48, 49, 50, 52, 106, 1


def closer_mask(tokenizer) -> np.ndarray:
    """bool [V]: the closers described in the module docstring."""
    out = np.zeros(tokenizer.vocab_size, dtype=bool)
    for i in range(tokenizer.vocab_size):
        b = tokenizer.token_bytes(i)
        if b and all(c in b'"}]:' for c in b) and i not in tokenizer.special_ids:
            out[i] = True
    out[[STR_TOK, END_CALL, TOOL_RESPONSE, EOS, TURN_END]] = True
    return out


def walk(constraint, closers: np.ndarray, seed: int, *, budget: int = 256, p_close: float = 0.2,
         anti_close: bool = False) -> tuple[list[int], bool]:
    """Random walk until the grammar is done (or an end token is picked) or `budget` tokens were taken.

    Returns (token ids without a final end token, whether the walk ended within the budget)."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while len(ids) < budget:
        if constraint.is_done():
            return ids, True
        allowed = np.flatnonzero(constraint.allowed_mask())
        assert allowed.size, f"no token allowed after {len(ids)} tokens"
        closing = allowed[closers[allowed]]
        if anti_close:
            other = allowed[~closers[allowed]]
            pool = other if other.size else closing
        else:
            pool = closing if closing.size and rng.random() < p_close else allowed
        tok = int(rng.choice(pool))
        if tok in (EOS, TURN_END):
            return ids, True
        constraint.advance(tok)
        ids.append(tok)
    return ids, constraint.is_done()


def text_of(tokenizer, ids: list[int]) -> str:
    """Strict UTF-8 (a grammar must only ever produce whole characters); special tokens as their text."""
    return b"".join(tokenizer.token_bytes(i) for i in ids).decode("utf-8")


def whitespace_outside_strings(text: str) -> list[int]:
    """Offsets of whitespace characters outside JSON strings."""
    out, in_str, esc = [], False, False
    for i, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in " \t\r\n":
            out.append(i)
    return out
