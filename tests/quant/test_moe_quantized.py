"""Quantized MoE experts end to end on the tiny 26B-A4B-like model (tests/golden/hf_models.py "26b": 8 experts,
top-2, a dense MLP and the experts in every layer), float32 loads.

- placement: w8a8 / w4a16 / qat-w4a16 make the expert stacks QuantArrays [E, out, in] of their kind, `in` padded to
  whole 128-byte lanes, routers and scales untouched;
- exactness: w4a16 (weights only) equals the plain float32 model built from the dequantized weights; every scheme
  equals its own weights run through the jnp references (gmm_ref, int8 / int4 matmul refs) instead of the CPU forms,
  and through the Pallas kernels in TPU interpret mode;
- QAT: experts on a Q4_0 grid (Google's -qat-q4_0-unquantized exports) repack bit-exactly, and qat-w4a16 float32
  logits equal the unquantized float32 model's.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gemmajax
from gemmajax.model import gemma
from gemmajax.model.loader import Model
from gemmajax.quant import QuantArray, dequantize, gmm, gmm_ref, int4_matmul_ref, int8_matmul_ref
from tests.golden.hf_models import build_hf, save_text_checkpoint
from tests.quant.test_load_quantized import _on_q4_grid

QUANTS = ["w8a8", "w4a16", "w4a16+emb4"]


def _is_q(x) -> bool:
    return isinstance(x, QuantArray)


def _leaves(model):
    return jax.tree_util.tree_leaves(model.weights, is_leaf=_is_q)


def _rel_max(out, want) -> float:
    return float(np.abs(out - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    m, cfg = build_hf("26b", seed=5)
    return save_text_checkpoint(m, cfg, str(tmp_path_factory.mktemp("moe")))


@pytest.fixture(scope="module")
def ids():
    x = np.random.default_rng(0).integers(3, 512, size=(2, 20))
    x[:, 0] = 2
    return x


@pytest.fixture(scope="module")
def base(ckpt):
    return gemmajax.load_model(ckpt, dtype="float32")


@pytest.fixture(scope="module")
def models(ckpt):
    return {q: gemmajax.load_model(ckpt, dtype="float32", quant=q) for q in QUANTS}


@pytest.mark.parametrize("quant", QUANTS)
def test_experts_are_quantized_in_place(models, base, quant):
    cfg = models[quant].config
    kind = "int8" if quant.startswith("w8") else "int4"
    for lw, bw in zip(models[quant].weights.layers, base.weights.layers):
        for name in ("gate_up_proj", "down_proj"):
            q = getattr(lw.moe, name)
            assert _is_q(q) and q.kind == kind and q.shape == getattr(bw.moe, name).shape, (name, q)
            assert q.padded_in % (128 if kind == "int8" else 256) == 0, q  # whole lanes (loading.EXPERT_PAD_IN)
        assert not _is_q(lw.moe.router_proj) and not _is_q(lw.moe.per_expert_scale)
    assert cfg.num_experts == 8 and cfg.top_k_experts == 2


def _dequantized_model(model, base):
    leaves = [dequantize(q, jnp.float32) if _is_q(q) else f
              for f, q in zip(jax.tree_util.tree_leaves(base.weights), _leaves(model))]
    tree = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(base.weights), leaves)
    return Model(model.config, tree, "float32")


@pytest.mark.parametrize("quant", ["w4a16", "w4a16+emb4"])
def test_w4a16_moe_is_the_float32_model_of_its_dequantized_weights(models, base, ids, quant):
    """Weights-only quantization keeps float32 activations, so the quantized model (experts through gmm's CPU loop)
    is the plain float32 model (experts through gmm's plain path) on dequantize(q): 1e-5 of max |logit|."""
    model = models[quant]
    want = _dequantized_model(model, base).logits(ids)
    err = _rel_max(model.logits(ids), want)
    assert err <= 1e-5, f"{quant}: max |logit - dequantized model's| = {err:.2e} of max |logit|"


def _logits_with(model, ids, monkeypatch, experts) -> np.ndarray:
    """The model's forward with `linear` replaced by the jnp references and `gmm` by `experts`, in a fresh jit.
    Returns logits [B, T, V]; asserts the expert stacks really went through `experts` as QuantArrays."""
    calls = []

    def ref_linear(x, w, impl="auto"):
        if not _is_q(w):
            return jnp.dot(x, w.T.astype(x.dtype), precision=lax.Precision.HIGHEST)
        return (int8_matmul_ref if w.kind == "int8" else int4_matmul_ref)(x, w)

    def counted(x, w, gs, impl="auto"):
        calls.append(_is_q(w))
        return experts(x, w, gs)

    monkeypatch.setattr(gemma, "linear", ref_linear)
    monkeypatch.setattr(gemma, "gmm", counted)
    fwd = jax.jit(lambda w, i, cfg=model.config: gemma.full_logits.__wrapped__(w, cfg, i))
    out = np.asarray(fwd(model.weights, jnp.asarray(ids, jnp.int32)))
    monkeypatch.undo()
    assert len(calls) == 2 * model.config.num_layers and all(calls), calls
    return out


# w8a8's int8 rounding of activations is discontinuous (one float32 ulp upstream can move a level): a moved level
# shows at the positions downstream of it, so w8a8 gets 1e-2 at its worst position (measured 5.2e-3 with XLA:CPU's
# 512-bit vectors, gemmajax's default on AVX-512; 2.3e-7 with 256-bit ones) and 1e-5 at the median position
# (measured 1.3e-7 with either; a wrong expert, scale or routing weight is wrong at every position)
@pytest.mark.parametrize("quant", QUANTS)
def test_quantized_moe_computes_its_reference(models, ids, quant, monkeypatch):
    """The serving dispatch (experts: gmm's CPU loop; projections: the CPU forms) == the jnp references on the same
    quantized weights (experts: gmm_ref, expert by expert through the 2-D references), through the whole model."""
    model = models[quant]
    want = _logits_with(model, ids, monkeypatch, gmm_ref)
    got = np.asarray(model.logits(ids))
    err = _rel_max(got, want)
    if not quant.startswith("w8"):
        assert err <= 1e-5, f"{quant}: {err:.2e} of max |logit|"
        return
    per_pos = np.abs(got - want).max(axis=-1) / np.abs(want).max()  # [B, T]
    assert err <= 1e-2 and np.median(per_pos) <= 1e-5, (quant, err, np.sort(per_pos.ravel())[-5:])


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["w8a8", "w4a16"])
def test_quantized_moe_through_the_pallas_kernel(models, ids, quant, monkeypatch):
    """The same forward with the experts through the Pallas kernel in TPU interpret mode (the TPU program's expert
    path) equals the references. 40-90 s."""
    model = models[quant]
    short = ids[:, :12]  # 48 expert rows per layer: three row tiles of the kernel's 32
    got = _logits_with(model, short, monkeypatch, functools.partial(gmm, impl="pallas_interpret"))
    err = _rel_max(got, _logits_with(model, short, monkeypatch, gmm_ref))
    assert err <= (1e-3 if quant.startswith("w8") else 1e-5), f"{quant}: {err:.2e} of max |logit|"


def test_qat_experts_repack_exactly(tmp_path, ids):
    """Experts on a Q4_0 grid (with every other projection): qat-w4a16 packs all of them, dequantizing gives the
    checkpoint's values bit for bit (experts included), and the float32 logits equal the unquantized float32 model's
    to float32 accumulation (1e-5 of max |logit|; a16 = the model's dtype)."""
    m, cfg = build_hf("26b", seed=7)
    on_grid = _on_q4_grid(m, seed=1)
    path = save_text_checkpoint(m, cfg, str(tmp_path / "qat"))
    plain = gemmajax.load_model(path, dtype="float32")
    model = gemmajax.load_model(path, dtype="float32", quant="qat-w4a16")
    packed = [x for x in _leaves(model) if _is_q(x)]
    assert len(packed) == on_grid, (len(packed), on_grid)
    experts = 0
    for a, b in zip(jax.tree_util.tree_leaves(plain.weights), _leaves(model)):
        if _is_q(b):
            assert np.array_equal(np.asarray(dequantize(b, jnp.float32)), np.asarray(a)), b
            experts += b.ndim == 3
    assert experts == 2 * model.config.num_layers  # gate_up and down in every layer
    err = _rel_max(model.logits(ids), plain.logits(ids))
    assert err <= 1e-5, f"qat-w4a16 float32 differs from float32 by {err:.2e} of max |logit|"
