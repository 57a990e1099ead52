"""gemma.fuse_projections: the CPU engine's q / k / v and gate / up projections joined along `out` (one matmul each
where there were two or three). The joined weight must hold the same numbers, a matmul by it must give each part's
outputs bit for bit (every CPU form, at one row and at many), the standard tree must come back from it, and the
engine must give the same tokens and logprobs with it as without. Weights, row counts and model cases are drawn at
random (seeded) from the space."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemmajax
from gemmajax.engine.llm_engine import EngineConfig, LLMEngine
from gemmajax.model.gemma import fuse_projections, unfuse_projections
from gemmajax.quant import dequantize, linear, quantize
from gemmajax.quant.array import QuantArray, concat_out, int4_to_words, split_out
from tests.engine.engine_run import assert_same_mixed_batch, small_engine_mixed_batch
from tests.engine.test_layer_stack import QUANTS, _model, _same_layers
from tests.golden.hf_models import VARIANTS

bf16, f32 = jnp.bfloat16, jnp.float32
KINDS = ("bf16", "float32", "int8", "int8_g128", "int4", "int4_words", "int4_f32_scales")


def _weight(kind: str, out: int, inp: int, seed: int):
    w = jnp.asarray(np.random.default_rng(seed).standard_normal((out, inp)) * 0.05, f32)
    if kind in ("bf16", "float32"):
        return w.astype(bf16 if kind == "bf16" else f32)
    if kind.startswith("int8"):
        return quantize(w.astype(bf16), "int8", act_group=128 if kind == "int8_g128" else 0)
    q = quantize(w.astype(bf16), "int4", 32, scale_dtype=f32 if kind == "int4_f32_scales" else None)
    return int4_to_words(q) if kind == "int4_words" else q


def _draws(seed: int):
    """Every kind at one row and at 16, plus more row counts; widths, part sizes and x's dtype drawn at random."""
    rng = np.random.default_rng(seed)
    for kind, m in [(k, m) for k in KINDS for m in (1, 16)] + [(KINDS[rng.integers(len(KINDS))], int(m))
                                                                for m in (2, 5, 64, 130)]:
        inp = int(rng.choice([256, 384, 640]))
        outs = [int(32 * rng.integers(1, 40)) for _ in range(int(rng.integers(2, 4)))]
        x_dtype = f32 if kind == "float32" else jnp.dtype(rng.choice([bf16, f32]))
        yield kind, inp, outs, m, x_dtype, int(rng.integers(1 << 30))


@pytest.mark.parametrize("kind,inp,outs,m,x_dtype,seed", list(_draws(20261207)))
def test_matmul_by_the_joined_weight_gives_each_parts_outputs(kind, inp, outs, m, x_dtype, seed):
    """Bit for bit at one row (the one-row fusions compute each output alone); from two rows the GEMMs may sum a
    float32 output in another order for another width, so within float32 rounding of the sum of |terms| (and one
    rounding of the 16-bit output)."""
    parts = [_weight(kind, o, inp, seed + i) for i, o in enumerate(outs)]
    joined = concat_out(parts)
    assert joined is not None and joined.shape == (sum(outs), inp)
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((m, inp)), x_dtype)
    f = jax.jit(linear)
    y = np.asarray(f(x, joined).astype(f32), np.float64)
    want = np.concatenate([np.asarray(f(x, p).astype(f32), np.float64) for p in parts], axis=1)
    if m == 1:
        np.testing.assert_array_equal(y, want)
    else:
        wd = np.concatenate([np.asarray((dequantize(p) if isinstance(p, QuantArray) else p).astype(f32), np.float64)
                             for p in parts])
        size = np.abs(np.asarray(x.astype(f32), np.float64)) @ np.abs(wd).T
        ulp = 2.0 ** -8 * np.abs(want) if x_dtype == bf16 else 0
        err = np.abs(y - want)
        assert (err <= 1e-6 * size + ulp).all(), (err - ulp).max()
    back = split_out(joined, outs)
    for p, b in zip(parts, back):
        assert type(p) is type(b) and p.shape == b.shape
        if isinstance(p, QuantArray):
            assert dataclasses.replace(p, values=None, scale=None) == dataclasses.replace(b, values=None, scale=None)
            np.testing.assert_array_equal(np.asarray(p.values), np.asarray(b.values))
            np.testing.assert_array_equal(np.asarray(p.scale), np.asarray(b.scale))
        else:
            assert p.dtype == b.dtype and np.array_equal(np.asarray(p), np.asarray(b))


def test_weights_that_differ_are_not_joined():
    a, b = _weight("int8", 64, 256, 1), _weight("int8", 96, 256, 2)
    assert concat_out([a, b]) is not None
    mismatched = [
        [a, _weight("int8_g128", 96, 256, 2)],                       # act_group
        [a, _weight("int8", 96, 384, 2)],                            # in
        [a, _weight("bf16", 96, 256, 2)],                            # a plain array beside a QuantArray
        [_weight("bf16", 64, 256, 1), _weight("float32", 96, 256, 2)],  # dtypes
        [_weight("int4", 64, 256, 1), _weight("int4_words", 96, 256, 2)],  # layouts
        [_weight("int4", 64, 256, 1), _weight("int4_f32_scales", 96, 256, 2)],  # scale dtypes
        [_weight("int4", 64, 256, 1), dataclasses.replace(_weight("int4", 96, 256, 2), short_scales=False)],
        [a, dataclasses.replace(b, shape=(95, 256))],                # padded rows
        [_weight("int8", 4000, 256, 3), _weight("int8", 200, 256, 4)],  # 4200 rows: the layout pads that size
        [a],                                                         # nothing to join
        [a, None],
    ]
    for parts in mismatched:
        assert concat_out(parts) is None, parts
    with pytest.raises(ValueError, match=r"add up to 150, the weight has 160 rows"):
        split_out(concat_out([a, b]), [50, 100])


FUSE_SPACE = [(v, q, d) for v in (*sorted(VARIANTS), "gemma3") for q in QUANTS for d in ("float32", "bfloat16")]
FUSE_CASES = [FUSE_SPACE[i] for i in np.random.default_rng(20261207).choice(len(FUSE_SPACE), size=3, replace=False)] \
    + [("e2b", "w4a16+emb8", "bfloat16")]   # KV-shared layers, a double-wide MLP


@pytest.mark.parametrize("variant,quant,dtype", FUSE_CASES)
def test_fused_tree_holds_the_same_weights(tmp_path_factory, variant, quant, dtype):
    model = _model(tmp_path_factory, variant, quant, dtype)
    w, cfg = model.weights, model.config
    fused = fuse_projections(w)
    for s, lw, lf in zip(cfg.layers, w.layers, fused.layers):
        a, af = lw.attn, lf.attn
        if s.owns_kv:   # joined: q, k and (unless K = V) v, in that order
            parts = [a.q_proj, a.k_proj] + ([] if s.k_eq_v else [a.v_proj])
            assert af.q_proj is af.k_proj is af.v_proj is None
            assert af.qkv_proj.shape == (sum(p.shape[0] for p in parts), cfg.hidden_size)
        else:           # a KV-shared layer's lone q_proj stays as it is
            assert af.qkv_proj is None and af.q_proj is a.q_proj
        assert lf.mlp.gate_proj is lf.mlp.up_proj is None
        assert lf.mlp.gate_up_proj.shape == (2 * lw.mlp.gate_proj.shape[0], cfg.hidden_size)
        assert lf.mlp.down_proj is lw.mlp.down_proj and af.o_proj is a.o_proj
    assert len(jax.tree.leaves(fused)) < len(jax.tree.leaves(w))
    _same_layers(unfuse_projections(fused, cfg).layers, w.layers)
    again = fuse_projections(fused)   # idempotent: nothing left to join
    assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(fused)))


def _run(model, tok, fuse: bool):
    eng, out = small_engine_mixed_batch(model, tok, 11, fuse_projections=fuse)
    lw = eng.runner.weights.layers[0]
    assert (lw.mlp.gate_up_proj is not None) == fuse and (lw.mlp.gate_proj is None) == fuse
    return out


_RNG = np.random.default_rng(20261208)
FUSE_VARIANTS = (*sorted(VARIANTS), "gemma3")
# one draw per weight kind of the layers (plain, int8, int4; the table's kind drawn too), the variant and dtype drawn;
# the int4 one from the KV-sharing variants (layers with a lone q_proj beside joined ones)
ENGINE_CASES = [(vs[_RNG.integers(len(vs))], qs[_RNG.integers(len(qs))], ("float32", "bfloat16")[_RNG.integers(2)])
                for vs, qs in ((FUSE_VARIANTS, ("none",)), (FUSE_VARIANTS, ("w8a8", "w8a8+emb4", "w8a8+emb8")),
                               (("e2b", "e4b"), ("w4a16", "w4a16+emb8")))]


@pytest.mark.parametrize("variant,quant,dtype", ENGINE_CASES)
def test_engine_outputs_equal_with_projections_apart(tmp_path_factory, gemma4_tokenizer, variant, quant, dtype):
    """A batch mixing prefill chunks and decodes, greedy and sampled, with logprobs: the same tokens, and the same
    logprobs (the full logits' log-softmax), fused (the CPU default) as apart. A float32 GEMM may sum in another
    order for another width (test above), and these random models amplify such last-bit differences: the e2b case,
    w4a16 float32, 19 tokens through `Model.logits`, moved its logits (up to 24) by 4.9e-4 fused against apart, and
    by up to 1.4e-4 between the same fused weights at 1, 2, 5 and 19 rows. Hence 5e-3 for float32 and, as
    tests/engine/test_last_rows.py takes for bf16, 2e-2; a wrong split moves them by whole units."""
    model = _model(tmp_path_factory, variant, quant, dtype)
    tol = 5e-3 if dtype == "float32" else 2e-2
    apart = _run(model, gemma4_tokenizer, False)
    fused = _run(model, gemma4_tokenizer, True)
    assert_same_mixed_batch(apart, fused, atol=tol)


def test_fusing_with_a_parallel_plan_is_refused(tmp_path_factory, gemma4_tokenizer):
    model = _model(tmp_path_factory, "gemma3", "w8a8", "float32")
    with pytest.raises(ValueError, match="fuse_projections=True with a parallel plan"):
        LLMEngine(model.config, model.weights, gemma4_tokenizer, EngineConfig(
            max_model_len=64, max_num_seqs=2, kv_cache_memory=1 << 22, fuse_projections=True, parallel=object()))


def test_llm_serves_fused_projections_and_shows_them_apart(tmp_path_factory, gemma4_tokenizer):
    """On XLA:CPU `LLM`'s engine holds the joined weights, and `llm.model.weights` splits them back: the standard
    tree, leaf for leaf a fresh load's (tests/engine/test_layer_stack.py holds the rest of that tree)."""
    path = _model_path(tmp_path_factory)
    llm = gemmajax.LLM(path, quant="w4a16", dtype="bfloat16", tokenizer=gemma4_tokenizer, max_model_len=64,
                       max_num_seqs=2, kv_cache_memory=1 << 22)
    fresh = gemmajax.load_model(path, dtype="bfloat16", quant="w4a16")
    eng = llm.model.engine_weights.layers[0]
    assert eng.attn.qkv_proj is not None and eng.mlp.gate_up_proj is not None and eng.attn.q_proj is None
    _same_layers(llm.model.weights.layers, fresh.weights.layers)


def _model_path(tmp_path_factory):
    from tests.golden.hf_models import GEMMA3, build_hf_config, save_text_checkpoint
    m, cfg = build_hf_config(dict(GEMMA3, family="gemma3"), seed=6)
    return save_text_checkpoint(m, cfg, str(tmp_path_factory.mktemp("fused")))
