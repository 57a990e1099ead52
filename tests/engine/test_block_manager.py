"""BlockManager: page accounting, all-or-nothing allocation, sliding-window release and prefix caching, each
against page tables computed by hand (free queue starts as 1, 2, 3, ...; page 0 is the null page)."""

import numpy as np
import pytest

from gemmajax.engine.block_manager import BlockManager, KVGroupSpec
from gemmajax.engine.sequence import Sequence


def make_seq(tokens, rid="r"):
    return Sequence(rid, list(tokens))


def step(bm, seq, n):
    """What the scheduler does around one model step of n tokens."""
    assert bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_pages(seq)
    bm.release_out_of_window(seq)


def refcounts_from_tables(bm, seqs, g):
    counts = np.zeros(bm.groups[g].num_pages, int)
    for s in seqs:
        for p in (s.page_tables[g] if s.page_tables else []):
            if p:
                counts[p] += 1
    return counts


def assert_consistent(bm, live):
    for g in range(len(bm.groups)):
        expect = refcounts_from_tables(bm, live, g)
        got = np.array([bm.ref_count(g, p) for p in range(bm.groups[g].num_pages)])
        np.testing.assert_array_equal(got, expect)
        assert bm.num_free_pages(g) == int((expect[1:] == 0).sum())


def test_allocation_accounting_and_free():
    bm = BlockManager([KVGroupSpec("full", num_pages=11, page_size=4)], enable_prefix_caching=False)
    a = make_seq(range(10))
    assert bm.allocate(a, 10)
    assert a.page_tables == [[1, 2, 3]]
    assert bm.num_free_pages("full") == 7
    a.num_computed_tokens = 10
    a.append_token(99)
    a.append_token(98)
    assert bm.allocate(a, 2)  # positions 10, 11: still page 2
    assert a.page_tables == [[1, 2, 3]]
    a.num_computed_tokens = 12
    a.append_token(97)
    assert bm.allocate(a, 1)  # position 12 opens page 3
    assert a.page_tables == [[1, 2, 3, 4]]
    assert bm.usage() == pytest.approx(4 / 10)
    np.testing.assert_array_equal(bm.page_table_array([a, make_seq([1])], "full", 6),
                                  [[1, 2, 3, 4, 0, 0], [0, 0, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match="max_pages=3"):
        bm.page_table_array([a], 0, 3)
    bm.free(a)
    assert bm.num_free_pages(0) == 10 and bm.usage() == 0.0
    assert a.page_tables == []


def test_allocate_is_all_or_nothing():
    bm = BlockManager([KVGroupSpec("full", 9, 4), KVGroupSpec("sliding", 3, 4, window=4)], enable_prefix_caching=False)
    a = make_seq(range(40))
    assert bm.allocate(a, 8)  # full: 2 pages; sliding: positions [0, 8) -> 2 pages
    assert a.page_tables == [[1, 2], [1, 2]]
    a.num_computed_tokens = 8
    bm.release_out_of_window(a)  # next query 8 sees [5, 8]: page 0 released
    assert a.page_tables == [[1, 2], [0, 2]]
    before = ([list(t) for t in a.page_tables], bm.num_free_pages(0), bm.num_free_pages(1))
    assert not bm.allocate(a, 12)  # sliding would need pages 2, 3, 4 with only 1 free
    assert ([list(t) for t in a.page_tables], bm.num_free_pages(0), bm.num_free_pages(1)) == before
    assert bm.allocate(a, 4)  # positions [8, 12): one new page in each group
    assert a.page_tables == [[1, 2, 3], [0, 2, 1]]
    assert bm.num_free_pages(1) == 0
    with pytest.raises(ValueError, match="has 40 tokens"):
        bm.allocate(a, 100)


def test_sliding_release_one_token_at_a_time():
    # W = 8, page 4: a query at q sees [q-7, q]; after computing c tokens, pages wholly before c-7 go back.
    # Released pages are unhashed (caching off) and go to the front of the free queue, so they come back next.
    bm = BlockManager([KVGroupSpec("sliding", 8, 4, window=8)], enable_prefix_caching=False)
    s = make_seq(range(100, 131))
    expected = {
        1: [1], 4: [1], 5: [1, 2], 9: [1, 2, 3], 10: [1, 2, 3],
        11: [0, 2, 3],  # next query 11 sees [4, 11]: page 0 released
        13: [0, 2, 3, 1],  # position 12 opens page 3, reusing physical page 1
        15: [0, 0, 3, 1],
        17: [0, 0, 3, 1, 2],
        19: [0, 0, 0, 1, 2],
        21: [0, 0, 0, 1, 2, 3],
        30: [0, 0, 0, 0, 0, 3, 1, 2],  # page i is taken at c = 4i and released at c = 4i + 11
    }
    held = []
    for c in range(30):
        step(bm, s, 1)
        held.append(sum(p != 0 for p in s.page_tables[0]))
        if c + 1 in expected:
            assert s.page_tables[0] == expected[c + 1], c + 1
    assert max(held) == 3 and bm.num_free_pages(0) == 7 - held[-1]
    bm.free(s)
    assert bm.num_free_pages(0) == 7


def test_sliding_release_in_chunks():
    bm = BlockManager([KVGroupSpec("sliding", 10, 4, window=8)], enable_prefix_caching=False)
    s = make_seq(range(40))
    step(bm, s, 10)  # positions 0..9 -> pages 0, 1, 2; next query 10 sees [3, 10]: nothing released
    assert s.page_tables[0] == [1, 2, 3]
    step(bm, s, 10)  # positions [10, 20): pages 3, 4; the chunk's queries still saw page 0 (query 10 -> [3, 10])
    # next query 20 sees [13, 20]: pages 0, 1, 2 released, in that order, each to the front of the queue.
    assert s.page_tables[0] == [0, 0, 0, 4, 5]
    assert bm.num_free_pages(0) == 7
    assert bm.allocate(s, 10)  # positions [20, 30): pages 5, 6, 7 take the queue's front: 3, 2, 1
    assert s.page_tables[0] == [0, 0, 0, 4, 5, 3, 2, 1]


def test_prefix_hit_refcounts_and_last_token_rule():
    bm = BlockManager([KVGroupSpec("full", 20, 4)])
    prompt = list(range(50, 64))  # 14 tokens
    a = make_seq(prompt, "a")
    assert bm.match_prefix(a) == 0
    step(bm, a, 14)
    assert a.page_tables == [[1, 2, 3, 4]]  # pages 0..2 full and hashed, page 3 half full

    b = make_seq(prompt[:12] + [7, 7, 7], "b")
    assert bm.match_prefix(b) == 12
    assert b.page_tables == [[1, 2, 3]] and b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert [bm.ref_count(0, p) for p in (1, 2, 3, 4)] == [2, 2, 2, 1]
    assert bm.allocate(b, 3)
    assert b.page_tables == [[1, 2, 3, 5]]

    c = make_seq(prompt[:12], "c")  # exactly the cached 12 tokens: the last one must still run
    assert bm.match_prefix(c) == 8
    d = make_seq([1] + prompt[1:14], "d")  # differs in the first token: the chain misses
    assert bm.match_prefix(d) == 0
    assert_consistent(bm, [a, b, c, d])
    with pytest.raises(ValueError, match="no pages"):
        bm.match_prefix(c)

    for s in (a, b, c, d):
        bm.free(s)
    assert bm.num_free_pages(0) == 19
    e = make_seq(prompt[:12] + [1], "e")  # freed pages keep their hash
    assert bm.match_prefix(e) == 12 and e.page_tables == [[1, 2, 3]]


def test_prefix_cache_lru_eviction():
    bm = BlockManager([KVGroupSpec("full", 9, 4)])  # 8 usable pages
    prompt = list(range(12))
    a = make_seq(prompt, "a")
    step(bm, a, 12)
    assert a.page_tables == [[1, 2, 3]]
    bm.free(a)  # queue: 4 5 6 7 8 | 3 2 1 (the prefix tail is evicted before its head)
    d = make_seq(range(1000, 1024), "d")
    assert bm.allocate(d, 24)
    assert d.page_tables == [[4, 5, 6, 7, 8, 3]]  # evicted page 3 (a's third page)
    a2 = make_seq(prompt + [5], "a2")
    assert bm.match_prefix(a2) == 8 and a2.page_tables == [[1, 2]]

    # Unhashed pages go to the front when freed, so they are reused before cached ones.
    bm.free(d)  # d's pages are not hashed (num_computed_tokens is 0)
    e = make_seq(range(2000, 2004), "e")
    assert bm.allocate(e, 4) and e.page_tables[0] == [4]


def test_sliding_window_prefix_usability():
    # Full group and sliding group (W = 8), page 4. A prefix of L tokens is usable when the full group has
    # pages [0, L/4) and the sliding group every page meeting [L-7, L).
    bm = BlockManager([KVGroupSpec("full", 40, 4), KVGroupSpec("sliding", 10, 4, window=8)])
    prompt = list(range(300, 330))
    a = make_seq(prompt, "a")
    step(bm, a, 28)  # sliding: pages 0..6 -> 1..7; next query 28 sees [21, 28]: pages 0..4 released
    assert a.page_tables[1] == [0, 0, 0, 0, 0, 6, 7]
    # sliding queue: 8 9 | 1 2 3 4 5 (released in order, hashed -> back of the queue)

    b = make_seq(prompt[:24] + [1], "b")
    assert bm.match_prefix(b) == 24  # needs sliding pages 4, 5 ([17, 24)): 5 cached-free, 6 held by a
    assert b.page_tables[1] == [0, 0, 0, 0, 5, 6]
    assert b.page_tables[0] == a.page_tables[0][:6]
    bm.free(b)  # sliding queue: 8 9 1 2 3 4 5

    c = make_seq(prompt[:16] + [2], "c")
    assert bm.match_prefix(c) == 16  # sliding pages 2, 3 ([9, 16)) -> physical 3, 4, off the queue
    assert c.page_tables[1] == [0, 0, 3, 4]
    e = make_seq(range(900, 920), "e")
    assert bm.allocate(e, 20)  # 5 sliding pages: 8 9 1 2 5 -> evicts a's sliding pages 0, 1, 4
    assert e.page_tables[1] == [8, 9, 1, 2, 5]

    b = make_seq(prompt[:24] + [1], "b2")
    # L=24 needs sliding 4, 5 (4 evicted); L=20 needs 3, 4 (no); L=16 needs 2, 3 (held by c): usable.
    assert bm.match_prefix(b) == 16
    assert b.page_tables[1] == [0, 0, 3, 4]
    assert bm.ref_count(1, 3) == 2 and bm.ref_count(1, 4) == 2
    assert b.page_tables[0] == a.page_tables[0][:4]
    assert_consistent(bm, [a, b, c, e])
    for s in (a, b, c, e):
        bm.free(s)
    assert bm.num_free_pages(0) == 39 and bm.num_free_pages(1) == 9


def test_mixed_page_sizes_align_prefix():
    # Page sizes 4 and 6: a cached prefix must end on a multiple of 12.
    bm = BlockManager([KVGroupSpec("a", 20, 4), KVGroupSpec("b", 20, 6)])
    prompt = list(range(30))
    s = make_seq(prompt)
    step(bm, s, 30)
    t = make_seq(prompt[:26] + [0])
    assert bm.match_prefix(t) == 24
    assert [len(x) for x in t.page_tables] == [6, 4]


def test_group_spec_validation():
    with pytest.raises(ValueError, match="num_pages must be >= 2"):
        KVGroupSpec("x", 1, 4)
    with pytest.raises(ValueError, match="unique"):
        BlockManager([KVGroupSpec("x", 4, 4), KVGroupSpec("x", 4, 4)])
    with pytest.raises(KeyError, match="no KV group named 'y'"):
        BlockManager([KVGroupSpec("x", 4, 4)]).num_free_pages("y")


def test_sliding_prefix_needs_only_what_the_next_query_sees():
    # W = 5, page 4: the first computed query, at position L = 12, sees keys [8, 12], so of the cached prefix
    # only page 2 ([8, 12)) is needed, not page 1 (position 7 is out of the window).
    bm = BlockManager([KVGroupSpec("sliding", 6, 4, window=5)])
    prompt = list(range(20))
    a = make_seq(prompt, "a")
    step(bm, a, 16)  # pages 0..3 -> 1..4; next query 16 sees [12, 16]: pages 0..2 released
    assert a.page_tables[0] == [0, 0, 0, 4]
    bm.free(a)  # queue: 5 | 1 2 3 | 4
    e = make_seq(range(100, 108), "e")
    assert bm.allocate(e, 8) and e.page_tables[0] == [5, 1]  # evicts a's page 0 ...
    assert bm.allocate(e, 0)
    f = make_seq(range(200, 204), "f")
    assert bm.allocate(f, 4) and f.page_tables[0] == [2]  # ... and page 1
    b = make_seq(prompt[:12] + [1], "b")
    assert bm.match_prefix(b) == 12
    assert b.page_tables[0] == [0, 0, 3]
