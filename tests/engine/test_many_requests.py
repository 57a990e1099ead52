"""Hundreds of mixed requests through `LLM.generate` on a tiny random E2B-like model (KV sharing, sliding window 8,
pages of 8; BLOCK_GAIN weights, so outputs move from token to token): greedy, then greedy mixed with seeded sampling,
stop token ids, stop strings, EOS, max_tokens from 1 to 20, prompts from 1 to 40 tokens, 16 sequences at a time with
a 64-token budget (so they queue and prefills are chunked).

Checked: every request ends where its output says it must: at its first stop token / EOS or at max_tokens, and a
request with stop strings exactly where the same request without them first completes one, its text cut right
before it (after it with include_stop_str_in_output); stop strings whose characters come from 2-3 tokens; the engine
with async scheduling (decode step N+1 dispatched before step N's tokens are read) gives exactly the outputs of the
engine without it; greedy requests equal the cache-free reference; every page is free at the end."""
import dataclasses

import numpy as np
import pytest

import gemmajax
from gemmajax.engine.sampling_params import SamplingParams
from tests.engine.test_engine_e2e import cache_free_greedy
from tests.golden.hf_models import E2B_SMALL, VARIANTS, build_hf_config, save_text_checkpoint

N_REQUESTS = 240


@pytest.fixture(scope="module")
def llm(tmp_path_factory, gemma4_tokenizer):
    # outputs that move (BLOCK_GAIN)
    m, cfg = build_hf_config(dict(VARIANTS["e2b"], **E2B_SMALL, family="gemma4"), seed=11)
    path = save_text_checkpoint(m, cfg, str(tmp_path_factory.mktemp("e2b")))
    llm = gemmajax.LLM(path, dtype="float32", kv_dtype="float32", max_model_len=64, max_num_seqs=16,
                       max_num_batched_tokens=64, page_size=8, kv_cache_memory=1 << 24, tokenizer=gemma4_tokenizer)
    llm.engine.t_buckets, llm.engine.s_buckets = (16, 64), (16,)  # few shapes: few compiles
    return llm


def _requests(tok):
    rng = np.random.default_rng(7)
    prompts, params = [], []
    for i in range(N_REQUESTS):
        prompts.append(list(map(int, rng.integers(3, 512, size=int(rng.integers(1, 41))))))
        kw = dict(max_tokens=int(rng.integers(1, 21)))
        if i >= 160 and i % 3 == 1:  # the first 160 are all greedy (async scheduling takes only such steps)
            kw.update(temperature=0.9, top_p=0.9, top_k=50, seed=1000 + i)
        if i % 7 == 2:
            kw.update(stop_token_ids=[int(t) for t in rng.integers(3, 512, size=80)])
        if i % 9 == 3:
            kw.update(stop=[" ", "\n"])
        if i % 2 == 0:
            kw.update(ignore_eos=True)
        params.append(SamplingParams(**kw))
    return prompts, params


def _stream(tok, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """The text streamed after each token (what the engine checks stop strings on)."""
    from gemmajax.tools.detokenizer import IncrementalDetokenizer
    det, text, out = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens), "", []
    for t in ids:
        text += det.push(t)
        out.append(text)
    return out


def _first_stop(stream: list[str], stops: list[str]) -> tuple[int, int, str] | None:
    """(tokens up to and including the one that first completes a stop string, where the earliest occurrence in
    that text starts, which stop string; the first listed among equal starts), or None."""
    for k, text in enumerate(stream, 1):
        hits = [(text.find(s), j, s) for j, s in enumerate(stops) if s in text]
        if hits:
            i, _, s = min(hits)
            return k, i, s
    return None


def _check_reason(out, p: SamplingParams, eos: tuple[int, ...], tok, untruncated=None):
    """`out` ended as its tokens say: at the first stop token id / EOS (unless ignore_eos) or at max_tokens; a request
    with stop strings ends exactly where `untruncated` (the same request run without them) first completes one,
    its text cut right before that occurrence (right after it with include_stop_str_in_output)."""
    ids = out.token_ids
    n = len(ids)
    assert 1 <= n <= p.max_tokens, (n, p)
    stop_ids = set(p.stop_token_ids or []) | (set() if p.ignore_eos else set(eos))
    assert not stop_ids & set(ids[:-1]), (ids, p)  # nothing before the last token could have stopped it
    if p.stop:
        assert untruncated is not None
        cut = _first_stop(_stream(tok, untruncated.token_ids, p.skip_special_tokens), p.stop)
        if cut is not None and not (cut[0] == len(untruncated.token_ids) and untruncated.finish_reason == "stop"):
            k, i, s = cut
            end = i + len(s) if p.include_stop_str_in_output else i
            text = _stream(tok, untruncated.token_ids[:k], p.skip_special_tokens)[-1][:end]
            want = (untruncated.token_ids[:k], text, "stop", s)
            assert (ids, out.text, out.finish_reason, out.stop_reason) == want, (out, untruncated, p)
            return
        if cut is None:  # no stop string anywhere: the same output as without them
            assert (ids, out.text, out.finish_reason) == (untruncated.token_ids, untruncated.text,
                                                          untruncated.finish_reason), (out, untruncated, p)
            return
        # the last token both is a stop token and completes a stop string: either reason is right
        assert ids == untruncated.token_ids and out.finish_reason == "stop", (out, untruncated, p)
        return
    if out.finish_reason == "length":
        assert n == p.max_tokens and ids[-1] not in stop_ids, (ids, p)
    else:
        assert out.finish_reason == "stop" and ids[-1] in stop_ids, (out.finish_reason, ids, p)
        assert out.stop_reason == (ids[-1] if ids[-1] in (p.stop_token_ids or []) else None), (out.stop_reason, p)


def test_hundreds_of_mixed_requests(llm, gemma4_tokenizer):
    eng = llm.engine
    prompts, params = _requests(gemma4_tokenizer)
    eng.config = dataclasses.replace(eng.config, async_scheduling=True)
    la0, ms0 = eng.stats_counters["lookahead_steps"], eng.stats_counters["multi_steps"]
    outs = llm.generate(prompts, params)
    assert eng.stats_counters["lookahead_steps"] > la0  # the async path ran
    assert eng.config.num_scheduler_steps > 1 and eng.stats_counters["multi_steps"] > ms0   # with programs of steps
    assert not eng.has_unfinished()
    bm = eng.block_manager
    for g in bm.groups:
        assert bm.num_free_pages(g.name) == g.num_pages - 1, g

    assert len(outs) == N_REQUESTS
    with_stop = [i for i, p in enumerate(params) if p.stop]
    untruncated = dict(zip(with_stop, llm.generate([prompts[i] for i in with_stop],
                                                   [dataclasses.replace(params[i], stop=None) for i in with_stop])))
    for i, (o, p) in enumerate(zip(outs, params)):
        _check_reason(o, p, eng.eos_token_ids, gemma4_tokenizer, untruncated.get(i))
    reasons = {o.finish_reason for o in outs}
    assert reasons == {"stop", "length"}, reasons  # both kinds occur in this mix
    assert any(isinstance(o.stop_reason, str) for o in outs)   # a stop string ended some
    assert any(isinstance(o.stop_reason, int) for o in outs)   # a stop token id ended some

    eng.config = dataclasses.replace(eng.config, async_scheduling=False)
    sync = llm.generate(prompts, params)
    eng.config = dataclasses.replace(eng.config, async_scheduling=True)
    for i, (a, b) in enumerate(zip(outs, sync)):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), i

    # greedy requests without stops against the cache-free reference (a sample of them: it is slow)
    plain = [i for i, p in enumerate(params) if p.temperature == 0 and p.ignore_eos and not p.stop
             and not p.stop_token_ids][:24]
    assert len(plain) >= 20
    for i in plain:
        assert outs[i].token_ids == cache_free_greedy(llm.model, prompts[i], params[i].max_tokens), i


@pytest.fixture(scope="module")
def spanning(llm, gemma4_tokenizer):
    """Greedy continuations (16 tokens, no stops) and, for each, the first stop string whose characters come from 2
    or 3 consecutive tokens (the last character of one token's text, any whole middle one, the first character of
    the last; no U+FFFD from an invalid byte) that first occurs there. Entries: (prompt, untruncated output, span,
    stop, later, k, start): the stop string is completed by token k (1-based) and starts at `start` of the text;
    `later` is [a string that first occurs after it] or []."""
    tok = gemma4_tokenizer
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(3, 512, size=int(rng.integers(3, 30))))) for _ in range(24)]
    free = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    cases = []
    for p, o in zip(prompts, free):
        stream = _stream(tok, o.token_ids)
        pieces = [b[len(a):] for a, b in zip([""] + stream, stream)]
        for span in (2, 3):
            for k in range(len(pieces) - span):  # the stop string's characters come from tokens k .. k + span - 1
                ps = pieces[k:k + span]
                stop = ps[0][-1:] + "".join(ps[1:-1]) + ps[-1][:1]
                start = len(stream[k]) - 1
                if all(ps) and "\ufffd" not in stop and stream[-1].find(stop) == start:
                    tail = stream[-1][-2:]
                    later = [tail] if stream[-1].find(tail) >= start + len(stop) else []
                    cases.append((p, o, span, stop, later, k + span, start))
                    break
    assert sum(c[2] == 2 for c in cases) >= 4 and sum(c[2] == 3 for c in cases) >= 4, cases
    assert sum(bool(c[4]) for c in cases) >= 2, cases
    return cases


def _check_spanning(llm, tok, cases, include: bool, max_tokens=None):
    params = [SamplingParams(max_tokens=max_tokens(k) if max_tokens else 16, ignore_eos=True, stop=later + [stop],
                             include_stop_str_in_output=include) for (_, _, _, stop, later, k, _) in cases]
    outs = llm.generate([c[0] for c in cases], params)
    bad = []
    for (_, o, span, stop, later, k, start), sp, out in zip(cases, params, outs):
        want = _stream(tok, o.token_ids[:k])[-1][:start + (len(stop) if include else 0)]
        got = (out.token_ids, out.text, out.finish_reason, out.stop_reason)
        if got != (o.token_ids[:k], want, "stop", stop):
            bad.append(f"stop {stop!r} (from {span} tokens, later {later}): got {got[2:]} {got[1]!r} after "
                       f"{len(got[0])} tokens, want 'stop' {want!r} after {k}")
        else:
            _check_reason(out, sp, llm.engine.eos_token_ids, tok, o)
    assert not bad, "\n".join(bad)


def test_stop_strings_spanning_tokens_end_at_the_completing_token(llm, gemma4_tokenizer, spanning):
    """With include_stop_str_in_output, a stop string whose characters come from 2 or 3 tokens ends the request at
    the token that completes it, the text running right up to its end; a listed stop string that only occurs later
    changes nothing."""
    _check_spanning(llm, gemma4_tokenizer, spanning, include=True)


def test_stop_string_spanning_tokens_is_cut_before_it(llm, gemma4_tokenizer, spanning):
    """Without include_stop_str_in_output the text ends right before the stop string, also when its first characters
    came from tokens streamed before the one that completes it (they must be held back, as vLLM does, until the
    string is known not to be a stop string)."""
    _check_spanning(llm, gemma4_tokenizer, spanning, include=False)


def test_stop_string_completed_by_the_last_allowed_token(llm, gemma4_tokenizer, spanning):
    """max_tokens ends the request on the very token that completes a stop string: the stop string still counts
    (vLLM: finish_reason "stop", stop_reason the string, text cut), as it would one token earlier."""
    _check_spanning(llm, gemma4_tokenizer, spanning, include=True, max_tokens=lambda k: k)


def test_streamed_text_never_holds_a_stop_string(llm, gemma4_tokenizer, spanning):
    """Step by step through the engine: each request's streamed deltas join to its final text, every cumulative
    text is a prefix of the final one (nothing streamed is taken back), and no streamed text ever holds the stop
    string, cut out or not (its first characters are held back until it is known not to be one)."""
    eng = llm.engine
    for j, (p, _, _, stop, _, _, _) in enumerate(spanning):
        eng.add_request(f"s{j}", p, SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop]))
    deltas, texts, final = {}, {}, {}
    while eng.has_unfinished():
        for o in eng.step():
            if not o.finished:   # held back: at most the longest stop string - 1 characters of the decoded text
                stop = spanning[int(o.request_id[1:])][3]
                assert len(o.text) >= len(_stream(gemma4_tokenizer, o.token_ids)[-1]) - (len(stop) - 1), o
            deltas.setdefault(o.request_id, []).append(o.delta_text)
            texts.setdefault(o.request_id, []).append(o.text)
            if o.finished:
                final[o.request_id] = o
    for j, (_, _, _, stop, _, _, _) in enumerate(spanning):
        rid = f"s{j}"
        out = final[rid]
        assert out.finish_reason == "stop" and out.stop_reason == stop, out
        assert "".join(deltas[rid]) == out.text, (deltas[rid], out.text)
        assert all(out.text.startswith(t) and stop not in t for t in texts[rid]), (texts[rid], stop)


def test_a_lookahead_step_whose_sequences_all_stopped_is_dropped(llm):
    """Every request stops on its first token (each token id is a stop id), after the engine planned and dispatched
    their next decode step: that step's result is discarded and the engine is idle, not waiting on it."""
    eng = llm.engine
    la0 = eng.stats_counters["lookahead_steps"]
    p = SamplingParams(max_tokens=5, stop_token_ids=list(range(llm.config.vocab_size)))
    outs = llm.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], p)
    assert [len(o.token_ids) for o in outs] == [1, 1, 1] and {o.finish_reason for o in outs} == {"stop"}
    assert eng.stats_counters["lookahead_steps"] > la0
    assert not eng.has_unfinished() and eng._inflight is None


def test_default_buckets_follow_the_backend(llm):
    """Without explicit buckets an engine on XLA:CPU compiles for the dense token ladder, sequences by powers of 2."""
    import jax
    from gemmajax.engine.llm_engine import EngineConfig, LLMEngine
    assert jax.default_backend() == "cpu"
    eng = LLMEngine(llm.config, llm.model.weights, llm.tokenizer, EngineConfig(
        max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, page_size=8, kv_dtype="float32",
        kv_cache_memory=3 << 20))
    assert eng.t_buckets == (16, 24, 32, 48, 64) and eng.s_buckets == (1, 2, 4, 8)


@pytest.mark.parametrize("steps", [1, 4])
def test_precompile_covers_every_step_shape(llm, steps):
    """After `precompile()`, serving a mix of prompt lengths, batch sizes and sampling compiles no model step, and
    the padding steps it ran wrote nothing (greedy outputs still equal the cache-free reference). With
    num_scheduler_steps > 1 the decode-only greedy shapes are the decode-steps program's."""
    from gemmajax.engine.llm_engine import EngineConfig, LLMEngine
    from gemmajax.engine.runner import compiled_decode_steps, compiled_step
    eng = LLMEngine(llm.config, llm.model.weights, llm.tokenizer, EngineConfig(
        max_model_len=64 + 8 * steps, max_num_seqs=8, max_num_batched_tokens=32, page_size=8, kv_dtype="float32",
        kv_cache_memory=3 << 20, token_buckets=(16, 32), seq_buckets=(2, 8),  # a spec of its own: cold caches
        num_scheduler_steps=steps))
    assert eng.step_shapes() == [(2, 2, True), (8, 8, True), (16, 2, False), (16, 8, False), (32, 2, False),
                                 (32, 8, False)]
    greedy_fn, logits_fn = compiled_step(eng.spec, True), compiled_step(eng.spec, False)
    multi_fn = compiled_decode_steps(eng.spec, steps)
    # (greedy steps, decode-steps programs): the 2 decode-only shapes twice each, with host token ids and with a
    # lookahead's (on the device)
    compiled = (8, 0) if steps == 1 else (4, 4)

    def sizes():
        return greedy_fn._cache_size(), multi_fn._cache_size(), logits_fn._cache_size()
    assert sizes() == (0, 0, 0)
    eng.precompile()
    assert sizes() == (*compiled, 6)
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(3, 512, size=n))) for n in (1, 5, 17, 30, 3, 9, 24, 2, 12, 40)]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, **({"temperature": 0.7, "seed": i} if i % 3 == 2
                                                                  else {})) for i in range(len(prompts))]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"p{i}", p, sp)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert len(done) == len(prompts)
    assert sizes() == (*compiled, 6)
    for i in (1, 7):   # greedy alone: programs of several decode steps (steps > 1)
        eng.add_request(f"g{i}", prompts[i], SamplingParams(max_tokens=12, ignore_eos=True))
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert sizes() == (*compiled, 6)
    assert (eng.stats_counters["multi_steps"] > 0) == (steps > 1)
    for i in (1, 7):
        assert done[f"g{i}"].token_ids == cache_free_greedy(llm.model, prompts[i], 12), i
    for i in (0, 3, 6):
        assert done[f"p{i}"].token_ids == cache_free_greedy(llm.model, prompts[i], 10), i
