"""w8a8: Pallas kernel (TPU interpret mode, pltpu.InterpretParams: uninitialized VMEM reads as NaN) against the jnp
reference, the XLA forms against the reference, and the quantization error against a float matmul."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from gemmajax.quant import int8_matmul, int8_matmul_ref, quantize
from gemmajax.quant.int8_matmul import int8_matmul_pallas, int8_matmul_xla, quantize_activations

INTERPRET = pltpu.InterpretParams()


def _data(m, k, n, seed=0, xdtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), xdtype)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32)
    return x, w, quantize(w, "int8")


@pytest.fixture(scope="module")
def odd():
    """in 640 x out 1000: out is not a multiple of 128 (one full-width block)."""
    return _data(16, 640, 1000)


@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_kernel_equals_reference_decode(odd, m):
    x, _, q = odd
    ref = int8_matmul_ref(x[:m], q)
    out = int8_matmul_pallas(x[:m], q, interpret=INTERPRET)
    assert out.shape == (m, 1000) and out.dtype == x.dtype
    # same integers, int32 accumulation, same scaling order: bit-identical
    assert np.array_equal(np.asarray(out), np.asarray(ref))


def test_kernel_equals_reference_prefill_bf16():
    x, _, q = _data(512, 640, 1000, seed=1, xdtype=jnp.bfloat16)
    out = int8_matmul_pallas(x, q, interpret=INTERPRET)
    assert out.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(out), np.asarray(int8_matmul_ref(x, q)))


def test_kernel_multi_block_grid():
    """Several M, N and K blocks: the int32 accumulator must start at zero (interpret mode fills scratch with
    NaN/garbage) and carry across K steps; M padding rows must not leak."""
    x, _, q = _data(40, 1024, 384, seed=2)
    out = int8_matmul_pallas(x, q, interpret=INTERPRET, blocks=(32, 128, 256))  # grid (2, 3, 4), M padded to 64
    assert np.array_equal(np.asarray(out), np.asarray(int8_matmul_ref(x, q)))


def test_padded_output_rows_are_cut():
    """out 5000 > 4096 and not a multiple of 128: stored padded to 5120 rows, results cut back to 5000."""
    x, _, q = _data(2, 256, 5000, seed=3)
    assert q.padded_out == 5120
    out = int8_matmul_pallas(x, q, interpret=INTERPRET)
    assert out.shape == (2, 5000)
    assert np.array_equal(np.asarray(out), np.asarray(int8_matmul_ref(x, q)))


@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("form", ["vector", "int", "auto"])
def test_xla_forms_match_reference(odd, m, form):
    x, _, q = odd
    out = jax.jit(lambda x, q: int8_matmul_xla(x, q, form=form))(x[:m], q)
    ref = int8_matmul_ref(x[:m], q)
    # "vector" accumulates the integers in f32 (exact below 2**24; here |sum| <= 640 * 127 * 127 ~ 1.0e7)
    assert np.array_equal(np.asarray(out), np.asarray(ref))


def test_dispatch_impls(odd):
    x, _, q = odd
    ref = np.asarray(int8_matmul_ref(x[:3], q))
    for impl in ("auto", "xla", "pallas_interpret"):
        assert np.array_equal(np.asarray(jax.jit(lambda x, q, i=impl: int8_matmul(x, q, i))(x[:3], q)), ref), impl
    with pytest.raises(ValueError, match="impl"):
        int8_matmul(x, q, "cuda")


def test_error_vs_float_matmul_within_derived_bound():
    """|xq*sx . wq*sw - x.w| per output is at most sum_k |x_k| |dw_k| + |dx_k| |w_k| + |dx_k dw_k| with
    |dw| <= sw/2 = max|w_n|/254 and |dx| <= sx/2 = max|x_m|/254 (round to nearest), i.e.
    bound[m, n] = sum|x_m| * aw_n / 254 + ax_m * sum|w_n| / 254 + K * ax_m * aw_n / 254**2.
    For Gaussian data the typical relative error is sqrt(2 * (3.2 / 127)**2 / 12) ~ 1 %: allow 2 %."""
    x, w, q = _data(16, 640, 1000, seed=4)
    y = int8_matmul_ref(x, q)
    yf = jnp.dot(x, w.T, precision="highest")
    ax, aw = jnp.max(jnp.abs(x), 1)[:, None], jnp.max(jnp.abs(w), 1)[None, :]
    sx, sw = jnp.sum(jnp.abs(x), 1)[:, None], jnp.sum(jnp.abs(w), 1)[None, :]
    bound = sx * aw / 254 + ax * sw / 254 + 640 * ax * aw / 254**2
    err = jnp.abs(y - yf)
    assert bool(jnp.all(err <= bound * (1 + 1e-4) + 1e-6))
    rel = float(jnp.linalg.norm(y - yf) / jnp.linalg.norm(yf))
    assert 1e-3 < rel < 0.02, rel


def test_activation_quantization():
    x = jnp.asarray([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [-127.0, 63.5, 1.0]])
    xq, xs = quantize_activations(x)
    assert np.array_equal(np.asarray(xs[:, 0]), np.float32([0.0, 2.0 / 127, 1.0]))
    assert np.array_equal(np.asarray(xq), np.int8([[0, 0, 0], [64, -127, 32], [-127, 64, 1]]))  # 63.5 -> 64 (even)
