"""Hundreds of mixed requests through `LLM.generate` on a tiny random E2B-like model (KV sharing, sliding window 8,
pages of 8): greedy, then greedy mixed with seeded sampling, stop token ids, stop strings, EOS, max_tokens from 1 to 20, prompts from
1 to 40 tokens, 16 sequences at a time with a 64-token budget (so they queue and prefills are chunked).

Checked: every request ends with a reason its output justifies; the engine with async scheduling (decode step N+1
dispatched before step N's tokens are read) gives exactly the outputs of the engine without it; greedy requests
equal the cache-free reference; every page is free at the end."""
import dataclasses

import numpy as np
import pytest

import gemmajax
from gemmajax.engine.sampling_params import SamplingParams
from tests.engine.test_engine_e2e import cache_free_greedy
from tests.golden.hf_models import build_hf, save_text_checkpoint

N_REQUESTS = 240


@pytest.fixture(scope="module")
def llm(tmp_path_factory, gemma4_tokenizer):
    m, cfg = build_hf("e2b", seed=11)
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


def _check_reason(out, p: SamplingParams, eos: tuple[int, ...]):
    n = len(out.token_ids)
    assert 1 <= n <= p.max_tokens, (n, p)
    if out.finish_reason == "length":
        assert n == p.max_tokens
    else:
        assert out.finish_reason == "stop", out.finish_reason
        last = out.token_ids[-1]
        by_token = last in (p.stop_token_ids or []) or (not p.ignore_eos and last in eos)
        by_string = bool(p.stop) and any(s in out.text or s in out.stop_reason for s in p.stop
                                         if isinstance(out.stop_reason, str))
        assert by_token or by_string, (out.token_ids, out.text, out.stop_reason, p)


def test_hundreds_of_mixed_requests(llm, gemma4_tokenizer):
    eng = llm.engine
    prompts, params = _requests(gemma4_tokenizer)
    eng.config = dataclasses.replace(eng.config, async_scheduling=True)
    la0 = eng.stats_counters["lookahead_steps"]
    outs = llm.generate(prompts, params)
    assert eng.stats_counters["lookahead_steps"] > la0  # the async path ran
    assert not eng.has_unfinished()
    bm = eng.block_manager
    for g in bm.groups:
        assert bm.num_free_pages(g.name) == g.num_pages - 1, g

    assert len(outs) == N_REQUESTS
    for o, p in zip(outs, params):
        _check_reason(o, p, eng.eos_token_ids)
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


def test_precompile_covers_every_step_shape(llm):
    """After `precompile()`, serving a mix of prompt lengths, batch sizes and sampling compiles no model step, and
    the padding steps it ran wrote nothing (greedy outputs still equal the cache-free reference)."""
    from gemmajax.engine.llm_engine import EngineConfig, LLMEngine
    from gemmajax.engine.runner import compiled_step
    eng = LLMEngine(llm.config, llm.model.weights, llm.tokenizer, EngineConfig(
        max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, page_size=8, kv_dtype="float32",
        kv_cache_memory=3 << 20, token_buckets=(16, 32), seq_buckets=(2, 8)))  # a spec of its own: cold caches
    assert eng.step_shapes() == [(2, 2, True), (8, 8, True), (16, 2, False), (16, 8, False), (32, 2, False),
                                 (32, 8, False)]
    greedy_fn, logits_fn = compiled_step(eng.spec, True), compiled_step(eng.spec, False)
    assert greedy_fn._cache_size() == logits_fn._cache_size() == 0
    eng.precompile()
    assert greedy_fn._cache_size() == logits_fn._cache_size() == 6
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
    assert greedy_fn._cache_size() == logits_fn._cache_size() == 6
    for i in (0, 3, 6):
        assert done[f"p{i}"].token_ids == cache_free_greedy(llm.model, prompts[i], 10), i
