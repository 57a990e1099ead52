"""The CPU-only forms chosen for speed compute what the plain forms compute: `dense_matmul_cpu` (one-row fusion and
native bf16 GEMM behind `quant.linear`), w4a16's "bf16" chunked GEMM, the decode attention defaults, and the engine's
in-step greedy argmax (against the sampler on the full logits)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemmajax
from gemmajax.engine.llm_engine import EngineConfig, LLMEngine
from gemmajax.engine.sample_batch import plain_greedy
from gemmajax.engine.sampling_params import SamplingParams
from gemmajax.quant import linear, quantize
from gemmajax.quant.int4_matmul import int4_matmul_ref, int4_matmul_xla
from gemmajax.quant.ops import dense_matmul, dense_matmul_cpu

bf16, f32 = jnp.bfloat16, jnp.float32


def _rand(shape, dtype, seed, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def _ref(x, w) -> np.ndarray:
    """x @ w.T in float64 from the (already rounded) operands."""
    return np.asarray(x.astype(f32), np.float64) @ np.asarray(w.astype(f32), np.float64).T


def _close(y, ref, rtol):
    y = np.asarray(y.astype(f32), np.float64)
    err = np.abs(y - ref)
    bound = rtol * np.abs(ref) + rtol * 1e-2 * np.abs(ref).max()
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


# ------------------------------------------------------------------------------------------------ plain weights
@pytest.mark.parametrize("dtype,rtol", [(bf16, 2.0 ** -8), (f32, 1e-5)])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("form", ["auto", "vector", "gemm"])
def test_dense_cpu_forms_match_reference(dtype, rtol, m, form):
    x, w = _rand((m, 96), dtype, 0), _rand((200, 96), dtype, 1, 0.1)
    y = jax.jit(dense_matmul_cpu, static_argnames="form")(x, w, form=form)
    assert y.shape == (m, 200) and y.dtype == dtype
    _close(y, _ref(x, w), rtol)  # one rounding of a float32 sum: within one ulp of the exact product
    _close(jax.jit(dense_matmul)(x, w), _ref(x, w), rtol)  # the accelerators' form agrees with the same reference


def test_linear_takes_the_cpu_form_with_leading_dims():
    x, w = _rand((2, 3, 64), bf16, 2), _rand((48, 64), bf16, 3, 0.1)
    y = jax.jit(linear)(x, w)
    assert y.shape == (2, 3, 48) and y.dtype == bf16
    want = jax.jit(dense_matmul_cpu)(x.reshape(6, 64), w).reshape(2, 3, 48)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="form must be"):
        dense_matmul_cpu(x, w, form="rows")


def _entry(fn, *args) -> str:
    """The ENTRY computation of fn's compiled CPU program (fusion bodies and branches are listed before it)."""
    txt = jax.jit(fn).lower(*args).compile().as_text()
    return txt[txt.index("ENTRY"):]


@pytest.mark.parametrize("m", [1, 16])
def test_cpu_forms_make_no_float32_copy_of_a_bf16_weight(m):
    """The point of the forms: XLA:CPU turns `jnp.dot(x_bf16, w.T)` into a float32 copy of the weight per call
    (the old code: 10-40x slower); the chosen forms read the bf16 weight directly."""
    x, w = _rand((1, m, 256), bf16, 4), _rand((4096, 256), bf16, 5, 0.1)
    copy = re.compile(r"= f32\[4096,256\]")
    assert not copy.search(_entry(linear, x, w)), "linear materialized a float32 copy of the weight"
    if m > 1:  # the check can fail: the plain form at several rows does copy
        assert copy.search(_entry(dense_matmul, x, w))


# ------------------------------------------------------------------------------------------------ w4a16
@pytest.mark.parametrize("n", [200, 8192])  # one GEMM / a loop over two 4,096-row chunks
def test_int4_bf16_form_matches_reference(n):
    w = quantize(_rand((n, 128), bf16, 6, 0.05), "int4")
    x = _rand((5, 128), f32, 7)
    y = jax.jit(lambda x, w: int4_matmul_xla(x, w, form="bf16"))(x, w)
    ref = jax.jit(int4_matmul_ref)(x, w)  # the same exact products, summed in another order
    assert y.shape == ref.shape == (5, n)
    _close(y, np.asarray(ref, np.float64), 1e-5)


def test_int4_auto_form_by_rows():
    w = quantize(_rand((256, 64), bf16, 8, 0.05), "int4")
    for m, form in ((4, "rows"), (16, "bf16")):
        x = _rand((m, 64), f32, 9)
        auto = jax.jit(lambda x, w: int4_matmul_xla(x, w))(x, w)
        want = jax.jit(lambda x, w, f=form: int4_matmul_xla(x, w, form=f))(x, w)
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(want))


# ------------------------------------------------------------------------------------------------ decode attention
def test_decode_attention_default_blocks_match_explicit_blocks():
    """Decode rows use 128-token KV blocks by default and an all-decode step skips the prefill machinery: the same
    result as 256-token blocks (and as a mixed step's decode rows)."""
    from gemmajax.kv import alloc_pages, make_ragged_meta, ragged_paged_attention
    n, nk, h, ps = 4, 1, 32, 8
    kv_lens = [300, 5, 129]
    tables, at = [], 1
    for kv in kv_lens:
        c = -(-kv // ps)
        tables.append(list(range(at, at + c)))
        at += c
    pages = _rand(alloc_pages(at, ps, nk, h, "float32").shape, f32, 10)
    q, kn = _rand((3, n, h), f32, 11), _rand((3, nk, h), f32, 12)
    meta = make_ragged_meta([1, 1, 1], kv_lens, tables, max_num_seqs=4, pages_per_seq=64)
    run = jax.jit(ragged_paged_attention, static_argnames=("sm_scale", "sliding_window", "block_kv"))
    for window in (None, 100):
        out, _ = run(q, kn, kn, pages, meta, sm_scale=h ** -0.5, sliding_window=window)
        want, _ = run(q, kn, kn, pages, meta, sm_scale=h ** -0.5, sliding_window=window, block_kv=256)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
        assert np.abs(np.asarray(out)).max() > 0


# ------------------------------------------------------------------------------------------------ greedy in the step
@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from tests.golden.hf_models import build_hf, save_text_checkpoint
    m, cfg = build_hf("gemma3", seed=5)
    return gemmajax.load_model(save_text_checkpoint(m, cfg, str(tmp_path_factory.mktemp("g3"))), dtype="float32")


def _generate(model, tok, prompts, params):
    eng = LLMEngine(model.config, model.weights, tok, EngineConfig(
        max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, page_size=8, kv_dtype="float32",
        token_buckets=(8, 32), seq_buckets=(4,), kv_cache_memory=1 << 22))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    done = {}
    while len(done) < len(prompts):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return [done[f"r{i}"].token_ids for i in range(len(prompts))]


def test_in_step_greedy_equals_the_sampler(tiny_gemma3, gemma4_tokenizer):
    """Plain greedy requests take the in-step argmax; asking for logprobs sends the same step through the sampler.
    Both must pick the same tokens."""
    rng = np.random.default_rng(13)
    v = tiny_gemma3.config.vocab_size
    prompts = [rng.integers(3, v, size=n).tolist() for n in (5, 11, 3)]
    fast = _generate(tiny_gemma3, gemma4_tokenizer, prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    slow = _generate(tiny_gemma3, gemma4_tokenizer, prompts, SamplingParams(max_tokens=6, ignore_eos=True,
                                                                             logprobs=0))
    assert fast == slow
    assert all(len(t) == 6 for t in fast) and len({tuple(t) for t in fast}) > 1


def test_plain_greedy_rule():
    class Seq:
        def __init__(self, banned=(), **kw):
            self.params = SamplingParams(**kw)
            self._banned = list(banned)

        def banned_token_ids(self, eos):
            return self._banned

    assert plain_greedy([Seq(), Seq(max_tokens=3)], [None, None])
    assert plain_greedy([], [])
    assert not plain_greedy([Seq(), Seq(temperature=0.7)], [None, None])
    assert not plain_greedy([Seq(logprobs=0)], [None])
    assert not plain_greedy([Seq(repetition_penalty=1.2)], [None])
    assert not plain_greedy([Seq()], [object()])  # a grammar
    assert not plain_greedy([Seq(banned=[1])], [None])  # stop ids below min_tokens
