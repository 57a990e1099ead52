"""Quantization at load time, end to end through the model: every scheme loads, puts QuantArrays exactly where it
should, and gives logits close to the unquantized model (bounds measured here, with margin)."""
import jax
import numpy as np
import pytest

import gemmajax
from gemmajax.quant.array import QuantArray
from tests.golden.hf_models import build_hf, save_text_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    m, cfg = build_hf("e2b", seed=5)
    return save_text_checkpoint(m, cfg, str(tmp_path_factory.mktemp("q")))


@pytest.fixture(scope="module")
def ids():
    x = np.random.default_rng(0).integers(3, 512, size=(2, 20))
    x[:, 0] = 2
    return x


@pytest.fixture(scope="module")
def ref(ckpt, ids):
    return gemmajax.load_model(ckpt, dtype="float32").logits(ids)


def _leaves(model):
    return jax.tree_util.tree_leaves(model.weights, is_leaf=lambda x: isinstance(x, QuantArray))


# Bounds on mean |logit diff| / max |logit| and on top-1 agreement with the float model. Measured on this tiny
# random 64-wide model (which amplifies quantization noise far more than a trained one): w8a8 0.012 / 95%,
# w8a8+emb8 0.014 / 95%, w4a16 0.095 / 65%, w4a16+emb4 0.114 / 53%.
@pytest.mark.parametrize("quant,bound,agree", [("w8a8", 0.03, 0.85), ("w8a8+emb8", 0.035, 0.85),
                                               ("w4a16", 0.2, 0.4), ("w4a16+emb4", 0.25, 0.35)])
def test_quantized_logits_close(ckpt, ids, ref, quant, bound, agree):
    model = gemmajax.load_model(ckpt, dtype="float32", quant=quant)
    q = [x for x in _leaves(model) if isinstance(x, QuantArray)]
    kind = "int8" if quant.startswith("w8") else "int4"
    lw = model.weights.layers[0]
    assert isinstance(lw.attn.q_proj, QuantArray) and lw.attn.q_proj.kind == kind
    assert isinstance(lw.mlp.down_proj, QuantArray) and isinstance(lw.ple_gate, QuantArray)
    assert isinstance(model.weights.ple_model_proj, QuantArray)
    assert not isinstance(lw.input_norm, QuantArray) and not isinstance(lw.layer_scalar, QuantArray)
    assert isinstance(model.weights.embed, QuantArray) == ("+emb" in quant)
    assert isinstance(model.weights.ple_table, QuantArray) == ("+emb" in quant)
    assert len(q) > 10
    out = model.logits(ids)
    err = np.abs(out - ref).mean() / np.abs(ref).max()
    assert err <= bound, err
    assert (out.argmax(-1) == ref.argmax(-1)).mean() >= agree


def test_qat_repack_is_exact_through_the_model(tmp_path, ids):
    """A checkpoint whose projections lie on a 4-bit grid per group of 32 (as Google's -qat-q4_0-unquantized):
    qat-w4a16 packs every projection, and dequantizing gives back the bf16 weights bit for bit."""
    import torch
    m, cfg = build_hf("gemma3", seed=7)
    rng = np.random.default_rng(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("proj.weight"):
                out, inp = p.shape
                scale = torch.tensor(rng.uniform(0.01, 0.05, (out, inp // 32, 1)), dtype=torch.bfloat16)
                lv = torch.tensor(rng.integers(-8, 8, (out, inp // 32, 32)), dtype=torch.bfloat16)
                p.copy_((lv * scale).to(torch.bfloat16).reshape(out, inp).float())
    path = save_text_checkpoint(m, cfg, str(tmp_path / "qat"))
    plain = gemmajax.load_model(path, dtype="bfloat16")
    model = gemmajax.load_model(path, dtype="bfloat16", quant="qat-w4a16")
    from gemmajax.quant.quantize import dequantize
    n = 0
    for a, b in zip(jax.tree_util.tree_leaves(plain.weights),
                    jax.tree_util.tree_leaves(model.weights, is_leaf=lambda x: isinstance(x, QuantArray))):
        if isinstance(b, QuantArray):
            n += 1
            assert np.array_equal(np.asarray(dequantize(b, a.dtype)), np.asarray(a))
    assert n == 6 * 7  # q, k, v, o, gate, up, down in each of the 6 layers
    out, want = model.logits(ids), plain.logits(ids)
    assert np.abs(out - want).max() <= 0.02 * np.abs(want).max()
