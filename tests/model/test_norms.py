"""RMSNorm on XLA:CPU: a row's bits must not depend on how many rows are normalized with it (a reduce's did, from
4,096 elements on; speculative verification then left plain decoding's tokens after fp8 rounding), and the
fixed-order sum it uses must be a sum."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmajax.model.gemma import fixed_order_sum, rms_norm


@pytest.mark.parametrize("width", [1, 2, 3, 5, 7, 64, 96, 640, 2048, 2560])
def test_fixed_order_sum_is_the_sum(width):
    x = np.random.default_rng(width).standard_normal((6, width)).astype(np.float32) * 3
    got = np.asarray(jax.jit(fixed_order_sum)(x))
    assert got.shape == (6, 1)
    want = x.astype(np.float64).sum(-1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(width))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads, h", [(4, 32), (4, 64), (2, 128), (4, 256), (1, 640), (1, 1536)])
def test_rms_norm_rows_do_not_depend_on_the_row_count(dtype, heads, h):
    """[1, T, heads, H] as the model normalizes q / k heads (and [1, T, 1, D] the residual stream): the first rows'
    bits are those of T = 3, for T from 1 to 384, and the values are HF's RMSNorm (float64 oracle)."""
    rng = np.random.default_rng(h)
    x = jnp.asarray(rng.standard_normal((1, 384, heads, h)) * 3, dtype)
    w = jnp.asarray(rng.standard_normal(h), jnp.float32)
    f = jax.jit(lambda a: rms_norm(a, w, 1e-6))
    ref = np.asarray(f(x[:, :3]).astype(jnp.float32))
    for t in (1, 2, 4, 8, 16, 24, 48, 128, 384):
        got = np.asarray(f(x[:, :t]).astype(jnp.float32))
        n = min(t, 3)
        np.testing.assert_array_equal(got[:, :n], ref[:, :n], err_msg=f"T={t}")
    xf = np.asarray(x[:, :3].astype(jnp.float32), np.float64)
    want = xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-6) * np.asarray(w, np.float64)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(ref, want, rtol=tol, atol=tol)
