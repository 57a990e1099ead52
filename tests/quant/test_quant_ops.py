"""linear / take_rows dispatch: dense arrays unchanged, every QuantArray kind and impl, tied LM heads."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmajax.quant import dequantize, int4_matmul_ref, int8_matmul_ref, linear, quantize, quantize_table, take_rows
from gemmajax.quant.int8_matmul import quantize_activations


def _rand(shape, seed, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def _rel(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(b)))


def test_dense_linear_unchanged():
    """Plain weights: x @ w.T in x's dtype. The CPU may pick another dot form (summation order), so equality is to
    float32 rounding, far below any layout or transposition mistake."""
    x, w = _rand((2, 3, 64), 0), _rand((32, 64), 1, jnp.bfloat16)
    y = linear(x, w)
    assert y.shape == (2, 3, 32) and y.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("impl", ["auto", "xla", "pallas_interpret"])
def test_linear_quantized_matches_reference(kind, impl):
    x, w = _rand((2, 3, 640), 2), _rand((1000, 640), 3, scale=0.05)
    q = quantize(w, kind)
    y = jax.jit(lambda x, q: linear(x, q, impl=impl))(x, q)
    ref = (int8_matmul_ref if kind == "int8" else int4_matmul_ref)(x, q)
    assert y.shape == (2, 3, 1000) and y.dtype == x.dtype
    assert _rel(y, ref) < 1e-5


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_linear_rejects_stacked_quantized_weights(kind):
    """The model multiplies expert stacks through ragged_dot on dequantized weights (gemma.moe_block), never through
    `linear`; a stacked QuantArray [E, out, in] is an error naming its shape, not a silent per-slice loop."""
    q = quantize(_rand((3, 256, 128), 4, scale=0.1), kind)
    with pytest.raises(ValueError, match=r"2-D .*\(3, 256, 128\)"):
        linear(_rand((3, 5, 128), 5), q)


def test_linear_rejects_unknown_impl():
    with pytest.raises(ValueError, match="impl"):
        linear(_rand((1, 64), 6), quantize(_rand((64, 64), 7), "int8"), impl="cuda")


@pytest.mark.parametrize("bits", [8, 4])
def test_tied_head_on_packed_table(bits):
    """linear(x, table_q) (the tied LM head) equals the product with the dequantized table, and the jitted CPU
    program never materializes a dequantized [V, D] table: it reads the packed one."""
    vocab, d = 8192, 640
    table = _rand((vocab, d), 8, jnp.bfloat16, scale=0.05)
    tq = quantize_table(table, bits)
    dense = dequantize(tq, jnp.float32)
    for m in (1, 4):
        x = _rand((m, d), 9 + m)
        y = jax.jit(lambda x, t: linear(x, t, impl="xla"))(x, tq)
        if bits == 8:  # w8a8 also quantizes the activations: compare with the dequantized activations
            xq, xs = quantize_activations(x)
            ref = jnp.dot(xq.astype(jnp.float32) * xs, dense.T, precision="highest")
        else:  # w4a16: float32 activations (unrounded: a float32 model) times the dequantized table
            ref = jnp.dot(x, dense.T, precision="highest")
        assert y.shape == (m, vocab) and _rel(y, ref) < 1e-5
        compiled = jax.jit(lambda x, t: linear(x, t, impl="xla")).lower(x, tq).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        # no whole dequantized table: int4 from two rows dequantizes 2,048-row tiles (5.2 MB in float32 here), so
        # the bound is half the 21 MB of a float32 [V, D] copy
        assert temp < vocab * d * 4 // 2, (m, temp, tq.nbytes)
    ids = jnp.asarray([0, 8191, 17])
    assert np.array_equal(np.asarray(take_rows(tq, ids, jnp.float32)), np.asarray(dense[ids]))
