"""The serving engine end to end on tiny random models. Continuous batching, chunked prefill, preemption, prefix
caching and aborts (also of a request in a dispatched lookahead step) must change nothing: greedy float32 outputs
equal each prompt run alone and a cache-free reference (argmax of `model.logits` over the growing sequence).
Low-precision KV pages are held to transformers with its cache rounded alike in tests/engine/test_vs_hf.py."""
import jax.numpy as jnp
import numpy as np
import pytest

import gemmajax
from gemmajax.engine.llm_engine import EngineConfig, LLMEngine
from gemmajax.engine.sampling_params import SamplingParams
from gemmajax.model import gemma
from tests.golden.hf_models import GEMMA3, VARIANTS, build_hf_config, save_text_checkpoint

REF_LEN = 64  # the cache-free reference runs every prefix padded to this length (causal: padding is harmless)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """E2B-like (KV sharing, PLE), Gemma 3 and 26B-like (MoE, K=V) with BLOCK_GAIN weights: their greedy outputs
    move from token to token (at gain 1 they repeat one token, which no cache bug would change)."""
    out = {}
    for v in ("e2b", "gemma3", "26b"):
        text = dict(GEMMA3, family="gemma3") if v == "gemma3" else dict(VARIANTS[v], family="gemma4")
        m, cfg = build_hf_config(text, seed=3)
        out[v] = gemmajax.load_model(save_text_checkpoint(m, cfg, str(tmp_path_factory.mktemp(v))), dtype="float32")
    return out


def cache_free_greedy(model, prompt, n):
    """argmax of model.logits over the growing sequence, no cache at all."""
    seq = list(prompt)
    for _ in range(n):
        ids = np.zeros((1, REF_LEN), np.int32)
        ids[0, :len(seq)] = seq
        logits = np.asarray(gemma.full_logits(model.weights, model.config, jnp.asarray(ids)))  # one compile
        seq.append(int(np.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt):]


def run_engine(model, tok, prompts, n, abort=(), **cfg):
    cfg.setdefault("token_buckets", (8, cfg["max_num_batched_tokens"]))  # few buckets: few compiles
    cfg.setdefault("seq_buckets", (cfg["max_num_seqs"],))
    cfg.setdefault("kv_dtype", "float32")
    eng = LLMEngine(model.config, model.weights, tok, EngineConfig(**cfg))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    done, steps = {}, 0
    while len(done) < len(prompts):
        if steps == 3:
            for i in abort:
                eng.abort_request(f"r{i}")
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        assert steps < 2000
    assert not eng.has_unfinished()
    bm = eng.block_manager  # every page is free again (prefix-cached pages stay findable but are free)
    for g in bm.groups:
        assert bm.num_free_pages(g.name) == g.num_pages - 1, g
    return [done[f"r{i}"] for i in range(len(prompts))], eng


def _prompts(seed, lens):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, 512, size=L))) for L in lens]


@pytest.mark.parametrize("variant", ["e2b", "gemma3", "26b"])
def test_continuous_batching_changes_nothing(models, variant, gemma4_tokenizer):
    """Mixed lengths crossing the window (8) and page (8) boundaries, more prompts than max_num_seqs so they
    queue, a 16-token budget so prefills are chunked."""
    model = models[variant]
    prompts = _prompts(1, [5, 19, 1, 33, 12, 8, 26])
    outs, _ = run_engine(model, gemma4_tokenizer, prompts, 12, page_size=8, max_num_batched_tokens=16,
                         max_num_seqs=3, max_model_len=64, kv_cache_memory=1 << 24)
    for p, o in zip(prompts, outs):
        assert o.finish_reason == "length" and len(o.token_ids) == 12
        assert o.token_ids == cache_free_greedy(model, p, 12), p
    if variant == "e2b":  # and each prompt run alone gives the same
        for p, o in zip(prompts[:2], outs[:2]):
            alone, _ = run_engine(model, gemma4_tokenizer, [p], 12, page_size=8, max_num_batched_tokens=16,
                                  max_num_seqs=3, max_model_len=64, kv_cache_memory=1 << 24)
            assert alone[0].token_ids == o.token_ids


def test_preemption_and_prefix_cache_keep_results_exact(models, gemma4_tokenizer):
    model = models["e2b"]
    base = _prompts(2, [24])[0]
    prompts = [base + p for p in _prompts(3, [3, 9, 17, 2])] + [base]
    want = [cache_free_greedy(model, p, 10) for p in prompts]
    # a pool with room for about two of the five at once forces preemption by recompute
    outs, eng = run_engine(model, gemma4_tokenizer, prompts, 10, page_size=8, max_num_batched_tokens=32,
                           max_num_seqs=5, max_model_len=64, kv_cache_memory=150_000)
    assert eng.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == want
    outs2, eng2 = run_engine(model, gemma4_tokenizer, prompts, 10, page_size=8, max_num_batched_tokens=64,
                             max_num_seqs=5, max_model_len=64, kv_cache_memory=1 << 24)
    assert [o.token_ids for o in outs2] == want
    assert eng2.scheduler.num_prefix_cache_hit_tokens > 0


def test_abort_frees_pages_and_spares_the_others(models, gemma4_tokenizer):
    model = models["gemma3"]
    prompts = _prompts(4, [20, 7, 30, 11])
    outs, _ = run_engine(model, gemma4_tokenizer, prompts, 16, abort=(1, 2), page_size=8,
                         max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64, kv_cache_memory=1 << 24)
    assert [o.finish_reason for o in outs] == ["length", "abort", "abort", "length"]
    assert outs[0].token_ids == cache_free_greedy(model, prompts[0], 16)
    assert outs[3].token_ids == cache_free_greedy(model, prompts[3], 16)


def test_abort_during_a_lookahead_step(models, gemma4_tokenizer):
    """Abort a request right after a step that dispatched a lookahead step holding it (its next decode step is on
    the device, its token not read yet): the other requests finish with the tokens they get without the abort, the
    aborted one ends "abort" with a prefix of its own tokens, nothing is left in flight and every page is free."""
    model = models["e2b"]
    prompts = _prompts(6, [13, 4, 22, 9])
    kw = dict(page_size=8, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64, kv_cache_memory=1 << 24,
              async_scheduling=True, token_buckets=(8, 32), seq_buckets=(4,))
    ref, _ = run_engine(model, gemma4_tokenizer, prompts, 16, **kw)
    eng = LLMEngine(model.config, model.weights, gemma4_tokenizer, EngineConfig(**kw))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    done, aborted_at, late = {}, None, []
    for _ in range(2000):
        if not eng.has_unfinished():
            break
        before = eng.stats_counters["lookahead_steps"]
        for o in eng.step():
            if o.request_id in done:
                late.append(o)  # nothing may follow a request's final output
            if o.finished:
                done[o.request_id] = o
        inflight = eng._inflight  # the lookahead step this step dispatched (its tokens are read by the next step)
        if (aborted_at is None and eng.stats_counters["lookahead_steps"] > before and inflight is not None
                and len(eng.scheduler.get("r1").output_token_ids) >= 3
                and any(s.seq.request_id == "r1" for s in inflight.scheduled)):
            aborted_at = len(eng.scheduler.get("r1").output_token_ids)
            eng.abort_request("r1")
    assert aborted_at is not None, "no lookahead step held r1"
    assert not late, late
    assert not eng.has_unfinished() and eng._inflight is None
    bm = eng.block_manager
    for g in bm.groups:
        assert bm.num_free_pages(g.name) == g.num_pages - 1, g
    assert done["r1"].finish_reason == "abort"
    assert done["r1"].token_ids == ref[1].token_ids[:len(done["r1"].token_ids)]
    assert aborted_at <= len(done["r1"].token_ids) < 16
    for i in (0, 2, 3):
        assert (done[f"r{i}"].finish_reason, done[f"r{i}"].token_ids) == ("length", ref[i].token_ids), i
