"""Exact QAT q4_0 repack: synthetic QAT-like tensors come back bit for bit; off-grid tensors are kept and reported."""
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from gemmajax.quant import RepackReport, dequantize, int4_matmul_ref, repack_qat
from gemmajax.quant.qat import recover_groups

BF16 = ml_dtypes.bfloat16


def _qat_tensor(shape, seed, scale_precision="bf16", group=32):
    """bf16(level * step) per group of 32 along the last axis, like Google's -qat-q4_0-unquantized weights.

    Rows of groups of several kinds: full range -8..7, only a few levels, all zero, negative only (peak at -8),
    positive only (peak at 7 < 8: the textbook step amax/8 would re-grid these), a single non-zero value, and
    tiny / large steps. Steps are random floats (bf16-rounded when scale_precision == "bf16")."""
    rng = np.random.default_rng(seed)
    *lead, out, inp = shape
    n = int(np.prod(lead, dtype=int)) * out * inp // group
    step = np.exp(rng.uniform(np.log(1e-4), np.log(5e-2), n)).astype(np.float32)
    step[rng.random(n) < 0.02] *= 1e-30  # a few tiny steps (products near bf16's smallest normals)
    step[rng.random(n) < 0.02] *= 1e3
    if scale_precision == "bf16":
        step = step.astype(BF16).astype(np.float32)
    lv = rng.integers(-8, 8, (n, group))
    kind = rng.integers(0, 7, n)
    few = rng.choice([-3, 0, 2, 5], (n, group))
    lv = np.where((kind == 1)[:, None], few, lv)
    lv = np.where((kind == 2)[:, None], 0, lv)
    lv = np.where((kind == 3)[:, None], -rng.integers(0, 9, (n, group)), lv)
    lv = np.where((kind == 4)[:, None], rng.integers(0, 8, (n, group)), lv)
    single = np.zeros((n, group), int)
    single[np.arange(n), rng.integers(0, group, n)] = rng.choice([-8, -1, 3, 7], n)
    lv = np.where((kind == 5)[:, None], single, lv)
    w = (lv.astype(np.float32) * step[:, None]).astype(BF16)
    return w.reshape(shape), kind


def _bits(a):
    return np.asarray(a).astype(BF16).view(np.uint16)


@pytest.mark.parametrize("scale_precision", ["bf16", "f32"])
def test_repack_is_bit_exact(scale_precision):
    w, kind = _qat_tensor((96, 640), seed=1, scale_precision=scale_precision)
    assert set(np.unique(kind)) == set(range(7))  # every kind of group is present
    rep = RepackReport()
    q = repack_qat(w, report=rep, name="w")
    assert q is not None and q.kind == "int4" and q.shape == (96, 640) and q.group == 32
    assert q.scale.dtype == (jnp.bfloat16 if scale_precision == "bf16" else jnp.float32)
    assert np.array_equal(_bits(dequantize(q, jnp.bfloat16)), _bits(w))
    assert (rep.packed, rep.kept, rep.off_grid_groups, rep.groups) == (1, 0, 0, 96 * 20)
    assert rep.values == rep.bit_identical == 96 * 640
    assert rep.f32_scale_tensors == (0 if scale_precision == "bf16" else 1)


def test_repack_experts_and_padding():
    """Leading dims (experts [E, out, in]) and an `in` that is a multiple of 32 but not of 64 (padded)."""
    w, _ = _qat_tensor((3, 40, 160), seed=2)
    q = repack_qat(w)
    assert q.shape == (3, 40, 160) and q.padded_in == 192
    assert np.array_equal(_bits(dequantize(q)), _bits(w))
    assert np.array_equal(_bits(dequantize(q[1])), _bits(w[1]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_repacked_weight_multiplies_exactly_like_the_qat_weight(dtype):
    """x [4, 512] in a bf16 or a float32 model times the repacked weight: bit for bit the product with the QAT
    weight itself in that dtype (float32 x is not rounded to bf16)."""
    w, _ = _qat_tensor((256, 512), seed=3)
    q = repack_qat(w)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((4, 512)), dtype)
    dense = jnp.dot(x, jnp.asarray(w).astype(dtype).T, preferred_element_type=jnp.float32, precision="highest")
    assert np.array_equal(np.asarray(int4_matmul_ref(x, q), np.float32), np.asarray(dense.astype(dtype), np.float32))


def test_peak_below_level_8_keeps_its_values():
    """A group whose largest level is 7 (or 3): amax / 8 is the wrong step; the search finds the right one."""
    step = np.float32(0.0123)
    g = (np.array([[7, -5, 3, 0] * 8, [3, 1, -2, 0] * 8], np.float32) * step).astype(BF16).astype(np.float32)
    levels, s, ok, _ = recover_groups(g)
    assert ok.all()
    assert np.array_equal((levels.astype(np.float32) * s[:, None]).astype(BF16).astype(np.float32), g)
    # the naive step re-grids the first group: its values change
    naive = np.clip(np.rint(g[0] / (np.abs(g[0]).max() / 8)), -8, 7) * (np.abs(g[0]).max() / 8)
    assert not np.array_equal(naive.astype(BF16).astype(np.float32), g[0])


def test_off_grid_tensor_is_kept_and_reported():
    w, _ = _qat_tensor((64, 256), seed=5)
    w = np.array(w)
    w[10, 37] = (np.float32(w[10, 37]) + np.float32(0.37) * np.abs(np.float32(w[10, 32:64])).max()).astype(BF16)
    rep = RepackReport()
    assert repack_qat(w, report=rep, name="layers.3.mlp.down_proj") is None
    assert (rep.packed, rep.kept, rep.off_grid_groups) == (0, 1, 1)
    assert "layers.3.mlp.down_proj" in rep.kept_names[0] and "1 off-grid" in rep.kept_names[0]
    # plain random bf16 weights are off the grid almost everywhere
    rnd = np.random.default_rng(6).standard_normal((32, 128)).astype(BF16)
    assert repack_qat(rnd, report=rep, name="random") is None
    assert rep.kept == 2 and rep.off_grid_groups > 100
    assert "2 kept" in rep.summary()


def test_in_not_multiple_of_group_is_kept():
    rep = RepackReport()
    assert repack_qat(np.zeros((4, 48), BF16), report=rep, name="odd") is None
    assert rep.kept == 1 and "multiple of the group" in rep.kept_names[0]
