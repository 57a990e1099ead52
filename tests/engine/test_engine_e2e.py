"""The serving engine end to end on tiny random models: continuous batching, chunked prefill, preemption and
prefix caching must give exactly the tokens of a plain greedy decode over a contiguous cache."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemmajax
from gemmajax.engine.llm_engine import EngineConfig, LLMEngine
from gemmajax.engine.sampling_params import SamplingParams
from gemmajax.model import gemma
from tests.golden.hf_models import build_hf, save_text_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for v in ("e2b", "gemma3", "26b"):
        m, cfg = build_hf(v, seed=3)
        out[v] = gemmajax.load_model(save_text_checkpoint(m, cfg, str(tmp_path_factory.mktemp(v))), dtype="float32")
    return out


def greedy_reference(model, prompt, n):
    step = jax.jit(gemma.forward_dense, static_argnames=("cfg",))
    cache = gemma.init_dense_cache(model.config, 1, len(prompt) + n, jnp.float32)
    logits, cache = step(model.weights, model.config, jnp.asarray([prompt]), cache)
    out = []
    for _ in range(n):
        t = int(np.argmax(np.asarray(logits[0, -1])))
        out.append(t)
        logits, cache = step(model.weights, model.config, jnp.asarray([[t]]), cache)
    return out


def run_engine(model, tok, prompts, n, **cfg):
    cfg.setdefault("token_buckets", (8, cfg["max_num_batched_tokens"]))  # few buckets: few compiles
    cfg.setdefault("seq_buckets", (cfg["max_num_seqs"],))
    eng = LLMEngine(model.config, model.weights, tok, EngineConfig(kv_dtype="float32", **cfg))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    done = {}
    steps = 0
    while len(done) < len(prompts):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        assert steps < 2000
    return [done[f"r{i}"] for i in range(len(prompts))], eng


def _prompts(seed, lens):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, 512, size=L))) for L in lens]


@pytest.mark.parametrize("variant", ["e2b", "gemma3", "26b"])
def test_engine_matches_greedy_reference(models, variant, gemma4_tokenizer):
    model = models[variant]
    prompts = _prompts(1, [5, 19, 1, 33, 12])
    outs, eng = run_engine(model, gemma4_tokenizer, prompts, 12, page_size=8, max_num_batched_tokens=16, max_num_seqs=4,
                           max_model_len=64, kv_cache_memory=1 << 24)
    for p, o in zip(prompts, outs):
        assert o.finish_reason == "length" and len(o.token_ids) == 12
        assert o.token_ids == greedy_reference(model, p, 12), p
    # everything returned to the pools
    bm = eng.block_manager
    assert all(bm.num_free_pages(g.name) == g.num_pages - 1 for g in bm.groups) or bm.enable_prefix_caching


def test_preemption_and_prefix_cache_keep_results_exact(models, gemma4_tokenizer):
    model = models["e2b"]
    base = _prompts(2, [24])[0]
    prompts = [base + p for p in _prompts(3, [3, 9, 17, 2])] + [base]
    want = [greedy_reference(model, p, 10) for p in prompts]
    # a pool with room for about two of the five at once forces preemption by recompute
    outs, eng = run_engine(model, gemma4_tokenizer, prompts, 10, page_size=8, max_num_batched_tokens=32,
                           max_num_seqs=5, max_model_len=64, kv_cache_memory=150_000)
    assert eng.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == want
    outs2, eng2 = run_engine(model, gemma4_tokenizer, prompts, 10, page_size=8, max_num_batched_tokens=64, max_num_seqs=5,
                             max_model_len=64, kv_cache_memory=1 << 24)
    assert [o.token_ids for o in outs2] == want
    assert eng2.scheduler.num_prefix_cache_hit_tokens > 0
