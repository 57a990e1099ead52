"""Scheduler: budgets, chunking, decode-first order, preemption by recompute, abort, impossible requests and
stop conditions. The end-to-end loops run a fake model that writes token ids into per-group page stores and
checks that every query reads exactly its visible history through the page tables (full and sliding groups,
prefix-cache hits included), then "samples" a pseudo-random token that is a function of that history, so a
run with preemptions must produce the same tokens as a run without."""

import hashlib
import random
import types

import numpy as np
import pytest

from gemmajax.config import FULL, SLIDING
from gemmajax.engine.block_manager import BlockManager, KVGroupSpec
from gemmajax.engine.runner import seq_pages, step_pages
from gemmajax.engine.sampling_params import SamplingParams
from gemmajax.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from gemmajax.engine.sequence import Sequence, SequenceStatus

VOCAB = 50


def next_token(history):
    return hashlib.blake2b(np.asarray(history, np.int64).tobytes(), digest_size=4).digest()[0] % VOCAB


class FakeModel:
    def __init__(self, bm):
        self.bm = bm
        self.store = [np.full((g.num_pages, g.page_size), -1) for g in bm.groups]

    def write(self, seq, pos, token):
        """The K/V of `token` at position `pos`, in every group (its page must exist and be the sequence's own)."""
        for g, spec in enumerate(self.bm.groups):
            page = seq.page_tables[g][pos // spec.page_size]
            assert page != 0, f"{seq}: position {pos} has no page in group {spec.name}"
            assert self.bm.ref_count(g, page) == 1, f"{seq}: writes into shared page {page}"
            self.store[g][page, pos % spec.page_size] = token

    def check_reads(self, seq, q, history):
        """Query `q` reads exactly history[j] at every key j it sees, in every group."""
        for g, spec in enumerate(self.bm.groups):
            lo = 0 if spec.window is None else max(0, q - spec.window + 1)
            for j in range(lo, q + 1):
                page = seq.page_tables[g][j // spec.page_size]
                assert page != 0 and self.store[g][page, j % spec.page_size] == history[j], (
                    f"{seq}: query {q} reads a wrong key at {j} in group {spec.name}")

    def step(self, out):
        for seq, n in out.scheduled:  # every write of the step first, as the kernel does
            c = seq.num_computed_tokens
            for pos in range(c, c + n):
                self.write(seq, pos, seq.token_ids[pos])
        sampled = {}
        for seq, n in out.scheduled:
            c = seq.num_computed_tokens
            for q in range(c, c + n):
                self.check_reads(seq, q, seq.token_ids)
            if c + n == seq.num_tokens:
                sampled[seq.seq_id] = next_token(seq.token_ids)
        return sampled


def assert_refcounts(bm, live):
    for g, spec in enumerate(bm.groups):
        counts = np.zeros(spec.num_pages, int)
        for s in live:
            for p in (s.page_tables[g] if s.page_tables else []):
                counts[p] += p != 0
        np.testing.assert_array_equal([bm.ref_count(g, p) for p in range(spec.num_pages)], counts)


def run_to_completion(sched, model, max_steps=5000):
    cfg = sched.config
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs and sched.num_running <= cfg.max_num_seqs
        assert len({s.seq_id for s, _ in out.scheduled}) == len(out.scheduled)
        sizes = [n for _, n in out.scheduled]
        assert sizes == sorted(sizes, key=lambda n: n != 1), "decodes must come first"
        sched.update_after_step(out, model.step(out))
        assert_refcounts(sched.block_manager, sched.running + list(sched.waiting))
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def workload(seed=0, n=14):
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(16)]
    reqs = []
    for i in range(n):
        length = rng.randrange(5, 41)
        prompt = (shared + [rng.randrange(VOCAB) for _ in range(length)])[:length] if i % 2 else \
            [rng.randrange(VOCAB) for _ in range(length)]
        reqs.append((f"req{i}", prompt, SamplingParams(max_tokens=rng.randrange(5, 31), ignore_eos=True)))
    return reqs


def make(full_pages, sliding_pages, prefix=True, **cfg):
    bm = BlockManager([KVGroupSpec("full", full_pages, 4), KVGroupSpec("sliding", sliding_pages, 4, window=8)],
                      enable_prefix_caching=prefix)
    config = SchedulerConfig(**{"max_num_seqs": 6, "max_num_batched_tokens": 32, "max_model_len": 80,
                                "eos_token_ids": (0,), **cfg})
    return Scheduler(config, bm), bm


def run_workload(full_pages, sliding_pages, prefix=True, seed=0):
    sched, bm = make(full_pages, sliding_pages, prefix)
    seqs = [Sequence(rid, p, sp) for rid, p, sp in workload(seed)]
    for s in seqs:
        sched.add(s)
    run_to_completion(sched, FakeModel(bm))
    for s in seqs:
        assert s.status == SequenceStatus.FINISHED_LENGTH and s.finish_reason == "length"
        assert s.num_output_tokens == s.params.max_tokens
    for g in range(2):
        assert bm.num_free_pages(g) == bm.num_usable_pages(g)
    return {s.request_id: s.output_token_ids for s in seqs}, sched


@pytest.mark.parametrize("prefix", [True, False])
def test_preemption_loses_nothing_and_changes_nothing(prefix):
    reference, ref_sched = run_workload(1000, 1000, prefix=prefix)
    assert ref_sched.num_preemptions == 0
    tiny, sched = run_workload(19, 13, prefix=prefix)  # a 70-token request needs 18 full pages of the 18 + 1
    assert sched.num_preemptions > 0
    assert tiny == reference
    if prefix:
        assert ref_sched.num_prefix_cache_hit_tokens > 0


def test_budget_max_num_seqs_and_fifo():
    sched, _ = make(1000, 1000, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [Sequence(f"r{i}", list(range(100 + 30 * i, 130 + 30 * i))) for i in range(10)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("r0", 30), ("r1", 30), ("r2", 4)]
    assert [e.samples for e in out.scheduled] == [True, True, False]
    sched.update_after_step(out, {seqs[0].seq_id: 1, seqs[1].seq_id: 2})
    out = sched.schedule()  # 2 decodes, r2's remaining 26, r3 whole; 6 tokens left but 4 running already
    assert [(s.request_id, n) for s, n in out.scheduled] == [("r0", 1), ("r1", 1), ("r2", 26), ("r3", 30)]
    assert out.num_decodes == 2 and sched.num_running == 4 and sched.num_waiting == 6


def test_chunked_prefill_splits_exactly():
    sched, _ = make(1000, 1000, max_num_batched_tokens=32, max_model_len=200)
    s = Sequence("a", list(range(100)), SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add(s)
    chunks = []
    while sched.has_unfinished():
        out = sched.schedule()
        chunks.append(out.scheduled[0].num_new_tokens)
        sched.update_after_step(out, {s.seq_id: 7} if out.scheduled[0].samples else {})
    assert chunks == [32, 32, 32, 4, 1, 1]
    assert s.output_token_ids == [7, 7, 7]

    sched, _ = make(1000, 1000, max_num_batched_tokens=32, max_model_len=200, long_prefill_token_threshold=20)
    t = Sequence("b", list(range(100)), SamplingParams(max_tokens=1))
    u = Sequence("c", list(range(200, 210)), SamplingParams(max_tokens=1))
    sched.add(t)
    sched.add(u)
    out = sched.schedule()
    assert [(x.request_id, n) for x, n in out.scheduled] == [("b", 20), ("c", 10)]


def test_decodes_first_then_partial_prefills_then_new():
    sched, _ = make(1000, 1000, max_num_batched_tokens=16, max_model_len=200)
    a = Sequence("a", [1, 2, 3])
    b = Sequence("b", list(range(40)))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(x.request_id, n) for x, n in out.scheduled] == [("a", 3), ("b", 13)]
    sched.update_after_step(out, {a.seq_id: 5})
    c = Sequence("c", [9, 9])
    sched.add(c)
    out = sched.schedule()
    assert [(x.request_id, n) for x, n in out.scheduled] == [("a", 1), ("b", 15)]  # no budget left for c
    sched.update_after_step(out, {a.seq_id: 6})
    out = sched.schedule()
    assert [(x.request_id, n) for x, n in out.scheduled] == [("a", 1), ("b", 12), ("c", 2)]


def test_chunking_off_rejects_or_waits():
    sched, _ = make(1000, 1000, max_num_batched_tokens=16, enable_chunked_prefill=False)
    too_long = Sequence("x", list(range(17)))
    sched.add(too_long)
    assert too_long.finish_reason == "error" and "chunked prefill" in too_long.error
    a, b = Sequence("a", list(range(10))), Sequence("b", list(range(10)))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(x.request_id, n) for x, n in out.scheduled] == [("a", 10)]  # b does not fit whole: it waits
    assert out.finished == [too_long]


def test_preempted_goes_to_front_with_output_kept():
    # One group of 4 usable pages of 4 tokens: a (8 tokens) and b (7) fit, then b's growth does not.
    bm = BlockManager([KVGroupSpec("full", 5, 4)], enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16), bm)
    a = Sequence("a", list(range(8)), SamplingParams(max_tokens=8, ignore_eos=True))
    b = Sequence("b", list(range(7)), SamplingParams(max_tokens=8, ignore_eos=True))
    c = Sequence("c", [1, 2])
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [(x.request_id, n) for x, n in out.scheduled] == [("a", 8), ("b", 7)]  # c: no pages
    sched.update_after_step(out, {a.seq_id: 11, b.seq_id: 12})
    out = sched.schedule()  # a needs page 3 for position 8: the newest (b) is preempted
    assert [(x.request_id, n) for x, n in out.scheduled] == [("a", 1)]
    assert out.preempted == [b] and list(sched.waiting) == [b, c]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.output_token_ids == [12]
    assert b.page_tables == [] and bm.num_free_pages(0) == 1
    sched.abort("a")
    out = sched.schedule()
    assert [(x.request_id, n) for x, n in out.scheduled] == [("b", 8), ("c", 2)]  # recompute includes output


def test_abort_frees_pages_at_once():
    sched, bm = make(1000, 1000, max_num_batched_tokens=64)
    a = Sequence("a", list(range(30)))
    b = Sequence("b", list(range(5)))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert bm.num_free_pages(0) < bm.num_usable_pages(0)
    assert sched.abort("a") is a
    assert a.status == SequenceStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert a.page_tables == [] and sched.num_running == 1
    assert sched.abort("a") is None and sched.abort("nope") is None
    sched.update_after_step(out, {a.seq_id: 1, b.seq_id: 2})  # a was aborted mid-step: ignored
    assert a.num_output_tokens == 0 and b.output_token_ids == [2]
    assert sched.abort("b") is b
    for g in range(2):
        assert bm.num_free_pages(g) == bm.num_usable_pages(g)
    assert not sched.has_unfinished()
    w = Sequence("w", [1])
    sched.add(w)
    assert sched.abort("w") is w and sched.num_waiting == 0


def test_impossible_requests_finish_with_error():
    sched, _ = make(19, 13, max_model_len=80)
    long_prompt = Sequence("long", list(range(81)))
    sched.add(long_prompt)
    assert long_prompt.status == SequenceStatus.FINISHED_ERROR and long_prompt.finish_reason == "error"
    assert "81 tokens" in long_prompt.error and "max_model_len=80" in long_prompt.error
    big = Sequence("big", list(range(60)), SamplingParams(max_tokens=20))  # 79 KV tokens: 20 full pages > 18
    sched.add(big)
    assert big.finish_reason == "error" and "'full'" in big.error and "pool has 18" in big.error
    ok = Sequence("ok", list(range(60)), SamplingParams(max_tokens=13))  # 72 KV tokens: 18 pages
    sched.add(ok)
    assert ok.status == SequenceStatus.WAITING
    out = sched.schedule()
    assert out.finished == [long_prompt, big] and sched.schedule().finished == []
    with pytest.raises(ValueError, match="already queued"):
        sched.add(Sequence("ok", [1]))


def test_stop_conditions():
    sched, _ = make(1000, 1000, max_model_len=12, eos_token_ids=(0,))

    def drive(seq, tokens):
        sched.add(seq)
        for t in tokens:
            if seq.is_finished:
                break
            out = sched.schedule()
            sched.update_after_step(out, {seq.seq_id: t})
        return seq

    s = drive(Sequence("eos", [5, 6]), [4, 0, 4])
    assert (s.finish_reason, s.stop_reason, s.output_token_ids) == ("stop", None, [4, 0])
    s = drive(Sequence("min", [5, 6], SamplingParams(min_tokens=2)), [0, 0, 0, 4])
    assert (s.finish_reason, s.output_token_ids) == ("stop", [0, 0, 0])
    s = drive(Sequence("ids", [5], SamplingParams(stop_token_ids=[7])), [3, 7, 3])
    assert (s.finish_reason, s.stop_reason, s.status) == ("stop", 7, SequenceStatus.FINISHED_STOPPED)
    s = drive(Sequence("ign", [5], SamplingParams(ignore_eos=True, max_tokens=3)), [0, 0, 0, 0])
    assert (s.finish_reason, s.output_token_ids) == ("length", [0, 0, 0])
    s = drive(Sequence("len", list(range(1, 10)), SamplingParams(max_tokens=64)), [1] * 10)
    assert (s.finish_reason, s.num_tokens) == ("length", 12)  # max_model_len
    s = Sequence("str", [5], SamplingParams(stop=["ab"]))
    drive(s, [3])
    sched.finish(s, "stop", "ab")  # what the runner does on a stop string
    assert (s.finish_reason, s.stop_reason, sched.has_unfinished()) == ("stop", "ab", False)
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish(Sequence("z", [1]), "done")


def test_banned_ids_below_min_tokens():
    s = Sequence("a", [1], SamplingParams(min_tokens=2, stop_token_ids=[9]))
    assert s.banned_token_ids((0, 1)) == [9, 0, 1]
    s.append_token(3)
    s.append_token(3)
    assert s.banned_token_ids((0, 1)) == []
    t = Sequence("b", [1], SamplingParams(min_tokens=1, ignore_eos=True))
    assert t.banned_token_ids((0,)) == []


def test_update_requires_sampled_token():
    sched, _ = make(1000, 1000)
    s = Sequence("a", [1, 2])
    sched.add(s)
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update_after_step(out, {})


def run_with_lookahead(sched, model, max_steps=5000):
    """The engine's async loop: while step N is 'on the device', schedule_lookahead plans N+1 (pages allocated
    before N's token is known); N+1 then runs after N's update, as the device runs them in order. Entries of
    sequences that finished on N's token are computed and discarded (skipped here)."""
    pending, steps, ahead_steps = None, 0, 0
    while pending is not None or sched.has_unfinished():
        cur = pending if pending is not None else sched.schedule().scheduled
        pending = sched.schedule_lookahead(cur)
        ahead_steps += pending is not None
        live = [s for s in cur if s.seq.status == SequenceStatus.RUNNING]
        sched.update_after_step(cur, model.step(SchedulerOutput(live, [], [])))
        assert_refcounts(sched.block_manager, sched.running + list(sched.waiting))
        steps += 1
        assert steps < max_steps, "no progress"
    return ahead_steps


@pytest.mark.parametrize("pages", [(1000, 1000), (19, 13)])
def test_lookahead_changes_nothing(pages):
    reference, _ = run_workload(1000, 1000)
    sched, bm = make(*pages)
    seqs = [Sequence(rid, p, sp) for rid, p, sp in workload(0)]
    for s in seqs:
        sched.add(s)
    assert run_with_lookahead(sched, FakeModel(bm)) > 10
    assert {s.request_id: s.output_token_ids for s in seqs} == reference
    if pages == (19, 13):
        assert sched.num_preemptions > 0
    for g in range(2):
        assert bm.num_free_pages(g) == bm.num_usable_pages(g)


def test_lookahead_only_in_the_steady_decode_state():
    sched, bm = make(1000, 1000, max_num_seqs=2)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    b = Sequence("b", [4, 5, 6, 7, 8], SamplingParams(max_tokens=1, ignore_eos=True))
    c = Sequence("c", [9] * 40, SamplingParams(max_tokens=5, ignore_eos=True))
    for s in (a, b):
        sched.add(s)
    out = sched.schedule()
    # b stops by length on this step's token: only a goes ahead, at position 3, its page for it allocated
    ahead = sched.schedule_lookahead(out.scheduled)
    assert [(s.seq.request_id, s.num_new_tokens) for s in ahead] == [("a", 1)]
    assert len(a.page_tables[0]) == 1 and a.num_computed_tokens == 0   # positions 0..3 fit one page of 4
    sched.update_after_step(out, {a.seq_id: 11, b.seq_id: 12})
    assert b.finish_reason == "length"
    sched.update_after_step(ahead, {a.seq_id: 13})
    assert a.output_token_ids == [11, 13] and a.num_computed_tokens == 4
    # a waiting request with room to be admitted, or a partial prefill not in the batch: nothing ahead
    sched.add(c)
    out = sched.schedule()                  # a decodes, c's first 31-token chunk
    assert sched.schedule_lookahead(out.scheduled) is None   # c's chunk samples nothing
    sched.update_after_step(out, {a.seq_id: 14})
    assert a.finish_reason == "length"
    sched.add(Sequence("d", [1, 2], SamplingParams(max_tokens=4, ignore_eos=True)))
    out = sched.schedule()                  # c's last 9 tokens; d admitted
    assert sched.schedule_lookahead([s for s in out.scheduled if s.seq is c]) is None  # d is running, not in it


def decode_steps(model, entries, k):
    """A decode-steps program of k steps on the fake model (runner.model_decode_steps): each sequence's step i
    writes the K/V of its token at position num_computed_tokens + i (its predecessor's sample from step i - 1),
    checks what that query reads, and samples the next token from the history so far. Returns seq_id -> k tokens
    (the scheduler's `steps` list)."""
    sampled = {}
    for seq, n in entries:
        assert n == 1 and seq.num_computed_tokens == seq.num_tokens - 1, seq
        hist = list(seq.token_ids)
        for q in range(seq.num_computed_tokens, seq.num_computed_tokens + k):
            model.write(seq, q, hist[q])
            model.check_reads(seq, q, hist)
            hist.append(next_token(hist))
        sampled[seq.seq_id] = hist[seq.num_tokens:]
    return sampled


def run_with_decode_steps(sched, model, k_max, max_iters=5000):
    """The engine's async loop with decode-steps programs: while a program of prev_steps steps is 'on the device'
    (its tokens not appended yet), schedule_ahead plans the next one, up to k_max steps, its pages allocated
    ahead; it runs after prev's update (the device runs them in order), on the sequences still running. Returns
    the number of steps of each program planned ahead, and how many of them pages shortened (fewer steps than
    max_tokens / max_model_len and k_max allow)."""
    pending, iters, planned, short = None, 0, [], 0
    while pending is not None or sched.has_unfinished():
        cur, cur_steps = pending if pending is not None else (sched.schedule().scheduled, 1)
        room = [min(s.seq.params.max_tokens - s.seq.num_output_tokens,
                    sched.config.max_model_len - s.seq.num_tokens) - cur_steps
                for s in cur if s.seq.status == SequenceStatus.RUNNING]
        pending = sched.schedule_ahead(cur, cur_steps, k_max)
        if pending is not None:
            k = pending[1]
            assert 1 <= k <= k_max
            planned.append(k)
            short += k < min(k_max, *[r for r in room if r > 0])
            for seq, _ in pending[0]:   # no program samples past max_tokens or max_model_len
                assert seq.num_output_tokens + cur_steps + k <= seq.params.max_tokens, (seq, cur_steps, k)
                assert seq.num_tokens + cur_steps + k <= sched.config.max_model_len, (seq, cur_steps, k)
        live = [s for s in cur if s.seq.status == SequenceStatus.RUNNING]
        sampled = decode_steps(model, live, cur_steps) if cur_steps > 1 else \
            model.step(SchedulerOutput(live, [], []))
        sched.update_after_step(cur, sampled, steps=cur_steps)
        assert_refcounts(sched.block_manager, sched.running + list(sched.waiting))
        iters += 1
        assert iters < max_iters, "no progress"
    return planned, short


def _eos_workload(seed, max_model_len):
    """workload(seed), every third request stopping on EOS (id 0, about 1 token in 50), lengths capped so that
    some requests end at max_model_len."""
    reqs = []
    for i, (rid, prompt, sp) in enumerate(workload(seed)):
        reqs.append((rid, prompt, SamplingParams(max_tokens=sp.max_tokens + 20, ignore_eos=i % 3 != 0)))
    return [Sequence(rid, p, sp) for rid, p, sp in reqs], {"max_model_len": max_model_len}


@pytest.mark.parametrize("pages, k_max, max_model_len, seed, max_num_seqs, min_short", [
    ((1000, 1000), 8, 80, 0, 6, 0), ((1000, 1000), 3, 48, 1, 6, 0), ((19, 13), 8, 80, 2, 6, 0),
    ((19, 13), 5, 48, 3, 6, 0), ((19, 13), 8, 48, 4, 2, 10), ((16, 12), 8, 48, 2, 3, 3)])
def test_decode_steps_change_nothing(pages, k_max, max_model_len, seed, max_num_seqs, min_short):
    """Programs of several decode steps planned ahead give every request the tokens and finish reason of plain
    one-step scheduling: stops on EOS inside a program drop the tokens after it, no program runs past
    max_tokens or max_model_len, prefix-cache hits and preemption (tight pools) included, and programs that the
    pages shorten (the last two cases, at least min_short of them); pages all return."""
    seqs, cfg = _eos_workload(seed, max_model_len)
    cfg["max_num_seqs"] = max_num_seqs
    sched, bm = make(*pages, **cfg)
    for s in seqs:
        sched.add(s)
    run_to_completion(sched, FakeModel(bm))
    reference = {s.request_id: (s.output_token_ids, s.finish_reason) for s in seqs}
    reasons = [r for _, r in reference.values()]
    # (a request longer than a tight pool can hold ends "error" either way)
    assert {"stop", "length"} <= set(reasons) and reasons.count("error") <= 3, reasons
    assert max_model_len == 80 or any(len(s.token_ids) == max_model_len for s in seqs)  # some end there

    seqs, cfg = _eos_workload(seed, max_model_len)
    cfg["max_num_seqs"] = max_num_seqs
    sched, bm = make(*pages, **cfg)
    for s in seqs:
        sched.add(s)
    planned, short = run_with_decode_steps(sched, FakeModel(bm), k_max)
    assert {s.request_id: (s.output_token_ids, s.finish_reason) for s in seqs} == reference
    assert max(planned) == k_max and len(set(planned)) > 1, planned   # full programs and shortened ones
    assert short >= min_short, (short, planned)
    if pages == (19, 13):
        assert sched.num_preemptions > 0
    for g in range(2):
        assert bm.num_free_pages(g) == bm.num_usable_pages(g)


def test_schedule_ahead_plans_steps_within_every_limit():
    """k is the most steps no sequence goes past max_tokens / max_model_len in (after prev's own tokens), capped at
    max_steps; each sequence gets pages through its k-th position; out of pages for k steps it plans the most steps
    that the pages cover."""
    sched, _ = make(1000, 1000, max_num_seqs=2, max_model_len=40)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    b = Sequence("b", [4, 5, 6, 7, 8], SamplingParams(max_tokens=7, ignore_eos=True))
    for s in (a, b):
        sched.add(s)
    out = sched.schedule()
    # prev samples 1 token: b then has 6 to go, a 19; k = min(8, 6)
    entries, k = sched.schedule_ahead(out.scheduled, 1, 8)
    assert [(s.seq.request_id, s.num_new_tokens) for s in entries] == [("a", 1), ("b", 1)] and k == 6
    # a computes positions 3..8 (pages of 4: 3 pages, 2 would end at 7), b positions 5..10 (3 pages)
    assert [len(a.page_tables[0]), len(b.page_tables[0])] == [3, 3]
    sched.update_after_step(out, {a.seq_id: 10, b.seq_id: 11})
    # prev of 6 steps in flight: b stops by length within them, a (7 of 20 then) goes on at position 3 + 1 + 6 - 1
    # for 8 steps: positions up to 16, 5 pages (4 would end at 15)
    entries2, k2 = sched.schedule_ahead(entries, 6, 8)
    assert [s.seq.request_id for s in entries2] == ["a"] and k2 == 8
    assert len(a.page_tables[0]) == 5
    # max_model_len caps k too: 40 - (num_tokens + prev_steps)
    c = Sequence("c", list(range(30)), SamplingParams(max_tokens=100, ignore_eos=True))
    sched2, _ = make(1000, 1000, max_model_len=40)
    sched2.add(c)
    out = sched2.schedule()
    assert sched2.schedule_ahead(out.scheduled, 1, 16)[1] == 40 - 31
    # a pool without pages for k = 4 steps of both: k falls to 1, and no page is taken for the steps not planned
    sched3, bm3 = make(4, 1000, max_model_len=40)   # 3 usable full pages of 4 positions
    d, e = (Sequence(r, [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)) for r in "de")
    sched3.add(d)
    sched3.add(e)
    out = sched3.schedule()
    assert [len(d.page_tables[0]), len(e.page_tables[0]), bm3.num_free_pages(0)] == [1, 1, 1]
    ahead = sched3.schedule_ahead(out.scheduled, 1, 8)
    assert ahead[1] == 1
    assert [len(d.page_tables[0]), len(e.page_tables[0]), bm3.num_free_pages(0)] == [1, 1, 1]
    with pytest.raises(ValueError, match="must be >= 1"):
        sched3.schedule_ahead(out.scheduled, 1, 0)
    # one token earlier in the page: 4 steps need a second page each (one is free), 2 steps do not: k is 2, not 1
    sched4, bm4 = make(4, 1000, max_model_len=40)
    f, g = (Sequence(r, [1, 2], SamplingParams(max_tokens=5, ignore_eos=True)) for r in "fg")
    sched4.add(f)
    sched4.add(g)
    out4 = sched4.schedule()
    assert [len(f.page_tables[0]), len(g.page_tables[0]), bm4.num_free_pages(0)] == [1, 1, 1]
    assert sched4.schedule_ahead(out4.scheduled, 1, 8)[1] == 2
    assert [len(f.page_tables[0]), len(g.page_tables[0]), bm4.num_free_pages(0)] == [1, 1, 1]
    # a later sequence's one step must not lose its page to an earlier one's attempt at more steps: c needs the
    # free page for even one step (its last token sits at position 4, the start of a page), a only for 2 or more
    sched5, bm5 = make(4, 1000, max_model_len=40)
    a5 = Sequence("a5", [1, 2, 3], SamplingParams(max_tokens=9, ignore_eos=True))
    c5 = Sequence("c5", [4, 5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    sched5.add(a5)
    sched5.add(c5)
    out5 = sched5.schedule()
    assert [len(a5.page_tables[0]), len(c5.page_tables[0]), bm5.num_free_pages(0)] == [1, 1, 1]
    entries5, k5 = sched5.schedule_ahead(out5.scheduled, 1, 8)
    assert k5 == 1 and [s.seq.request_id for s in entries5] == ["a5", "c5"]
    assert [len(a5.page_tables[0]), len(c5.page_tables[0]), bm5.num_free_pages(0)] == [1, 2, 0]
    # more tokens than the step's decode steps (or a verification's drafts) is refused
    sched3.update_after_step(out, {d.seq_id: 7, e.seq_id: 8})
    with pytest.raises(ValueError, match="3 new tokens .* a step of 2 decode steps"):
        sched3.update_after_step(ahead[0], {d.seq_id: [1] * 3, e.seq_id: [1] * 2}, steps=2)


def _plan_sizes(window, page, seqs, batched, max_len):
    """Pages per group as the engine's plan_pages gives them at full budget, from its own helpers."""
    cfg = types.SimpleNamespace(layers=[types.SimpleNamespace(kind=SLIDING, window=window),
                                        types.SimpleNamespace(kind=FULL, window=None)])
    full = 1 + seqs * seq_pages(cfg, FULL, max_len, page)
    sliding_own = 1 + seqs * seq_pages(cfg, SLIDING, max_len, page)
    return full, sliding_own, step_pages(cfg, SLIDING, max_len, batched, page)


@pytest.mark.parametrize("seed", range(8))
def test_planned_pools_hold_max_num_seqs_without_preemption(seed):
    """plan_pages' sliding pool (every sequence's window, one step's chunk shared) holds max_num_seqs full-length
    sequences at once through chunked prefill and decode, with and without lookahead and a drafter's wider window
    (+2): no preemption, every request to its full length."""
    rng = random.Random(seed)
    window, page = rng.choice([8, 12, 16, 33]), rng.choice([4, 8])
    seqs, batched, max_len = rng.randrange(2, 7), rng.choice([16, 24, 32]), rng.choice([64, 80])
    full, sliding_own, chunk = _plan_sizes(window, page, seqs, batched, max_len)
    for reach, lookahead in ((0, False), (2, True)):
        bm = BlockManager([KVGroupSpec("full", full, page),
                           KVGroupSpec("sliding", sliding_own + chunk, page, window=window + reach)])
        sched = Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=batched, max_model_len=max_len,
                                          eos_token_ids=(0,)), bm)
        reqs = []
        for i in range(seqs):   # short prompts too: decodes and prefill chunks share steps
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(2, max_len - 4))]
            reqs.append(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=max_len - len(prompt), ignore_eos=True)))
            sched.add(reqs[-1])
        (run_with_lookahead if lookahead else run_to_completion)(sched, FakeModel(bm))
        assert all(s.num_output_tokens == s.params.max_tokens for s in reqs)
        assert sched.num_preemptions == 0, (window, page, seqs, batched, max_len, reach, lookahead)


def test_plan_pages_by_hand():
    """plan_pages for E2B (12 sliding layers K=1 H=256 window 512, 3 full layers K=1 H=512; bf16, pages of 32):
    a sequence holds ceil(514 / 32) + 2 = 19 sliding and 8192 / 32 + 1 = 257 full pages, the step's 512-token chunk
    17 sliding pages once; budgets of 4 (the cap), 2.5 and 0.5 sequences' worth (the last shrinks in proportion)."""
    from gemmajax.config import ModelConfig
    from gemmajax.engine.runner import plan_pages
    cfg = ModelConfig.preset("e2b")
    kw = dict(page_size=32, kv_dtype="bf16", max_model_len=8192, max_num_seqs=4, max_num_batched_tokens=512)
    sliding_page, full_page = 12 * 2 * 32 * 256 * 2, 3 * 2 * 32 * 512 * 2
    fixed = (1 + 17) * sliding_page + full_page
    per_seq = 19 * sliding_page + 257 * full_page
    assert plan_pages(cfg, kv_cache_memory=1 << 40, **kw) == (1 + 17 + 4 * 19, 1 + 4 * 257)
    assert plan_pages(cfg, kv_cache_memory=fixed + int(2.5 * per_seq), **kw) == (18 + 47, 1 + 642)
    need = (1 + 17 + 4 * 19, 1 + 4 * 257)
    small = fixed + int(0.5 * per_seq)
    frac = small / (need[0] * sliding_page + need[1] * full_page)
    assert plan_pages(cfg, kv_cache_memory=small, **kw) == (int(need[0] * frac), int(need[1] * frac))
