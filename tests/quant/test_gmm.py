"""The grouped expert matmul (gemmajax.quant.gmm) against its references, on the CPU.

- gmm_ref itself against an oracle that shares no code with it: row by row, the row's expert dequantized and a
  float32 dot (int8: with the activations' own int8 levels);
- the Pallas kernel in TPU interpret mode and the XLA forms against gmm_ref: uneven groups, empty experts, one row,
  every row in one expert, groups spanning row tiles / several N and K blocks, NaN-filled padding rows past the
  groups' end (they must come out as zeros and leak nowhere), int8 per token and per 128 columns, int4, bf16 and
  float32 activations (float32 must stay float32: "a16" is the model's dtype). The unrouted experts' scales are NaN
  in every case, so a path that multiplies by an expert no row is routed to fails;
- the work items the kernel's index maps follow (hand-computed), and the CPU program's temporaries: no stack is
  dequantized or copied.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from gemmajax.quant import QuantArray, dequantize, gmm, gmm_ref, quantize
from gemmajax.quant.gmm import gmm_pallas, gmm_xla, group_metadata
from gemmajax.quant.int8_matmul import quantize_activations

E, N, K = 6, 256, 256
# rows per expert (sum <= M; rows past the sum are NaN padding)
CASES = {
    "uneven+empty": ([10, 0, 25, 1, 0, 30], 70),
    "one-row": ([0, 0, 1, 0, 0, 0], 1),
    "all-in-one": ([0, 0, 0, 0, 64, 0], 64),
    "spanning-tiles": ([40, 3, 0, 33, 0, 20], 100),
}
KINDS = [("int8", 0), ("int8", 128), ("int4", 0)]


def _weights(kind: str, ag: int, sizes, seed: int = 0, shape=(E, N, K)) -> QuantArray:
    """A stack quantized from random weights, the scales of the experts no row is routed to set to NaN."""
    w = jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * 0.05, jnp.float32)
    q = quantize(w, kind, act_group=ag) if kind == "int8" else quantize(w, kind)
    unrouted = np.asarray(sizes) == 0
    scale = np.array(q.scale.astype(jnp.float32))
    scale[unrouted] = np.nan
    return QuantArray(q.values, jnp.asarray(scale, q.scale.dtype), q.kind, q.shape, q.group, q.dtype, q.act_group)


def _x(m: int, total: int, dtype, seed: int = 1, k: int = K) -> jax.Array:
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    x[total:] = np.nan  # padding rows past the groups' end
    return jnp.asarray(x, dtype)


def _check_close(y, ref, total, dtype, what):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    assert y.shape == ref.shape, (what, y.shape, ref.shape)
    assert np.isfinite(y).all(), f"{what}: NaN / inf in the output (padding rows or unrouted experts leaked)"
    assert np.all(y[total:] == 0), f"{what}: rows past the groups' end must be 0"
    # float32: accumulation order only; bf16: one rounding of the output (the kernels sum in float32 like the ref)
    tol = 1e-5 if dtype == jnp.float32 else 8e-3
    err = np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err <= tol, f"{what}: max |y - ref| = {err:.2e} of max |ref| (tolerance {tol})"


@pytest.mark.parametrize("kind,ag", KINDS)
def test_reference_is_each_row_times_its_dequantized_expert(kind, ag):
    """Oracle without gmm code: row r of expert e is dot(row, dequantize(w[e]).T) in float32 (int8: the row's own
    int8 levels times its scales, as w8a8 multiplies)."""
    sizes, m = CASES["uneven+empty"]
    total = sum(sizes)
    q = _weights(kind, ag, sizes)
    x = _x(m, total, jnp.float32)
    y = np.asarray(gmm_ref(x, q, jnp.asarray(sizes, jnp.int32)))
    want = np.zeros((m, N), np.float32)
    r = 0
    for e, s in enumerate(sizes):
        if not s:
            continue
        wd = np.asarray(dequantize(q[e], jnp.float32), np.float64)
        xr = x[r:r + s]
        if kind == "int8":
            xq, xs = quantize_activations(xr, ag)
            xr = np.asarray(xq, np.float64).reshape(s, -1, ag or K) * np.asarray(xs, np.float64)[..., None]
        want[r:r + s] = np.asarray(xr, np.float64).reshape(s, K) @ wd.T
        r += s
    assert np.isfinite(y).all() and np.all(y[total:] == 0)
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()


# every case in float32; bf16 (the serving dtype) on the two cases with several groups per tile
PALLAS_CASES = [(c, jnp.float32) for c in CASES] + [(c, jnp.bfloat16) for c in ("uneven+empty", "spanning-tiles")]


@pytest.mark.parametrize("case,dtype", PALLAS_CASES, ids=[f"{c}-{'f32' if d == jnp.float32 else 'bf16'}"
                                                          for c, d in PALLAS_CASES])
@pytest.mark.parametrize("kind,ag", KINDS)
def test_pallas_kernel_matches_reference(kind, ag, case, dtype):
    """The kernel in TPU interpret mode, its default blocks (one row tile up to 128 rows) and small ones (row tiles
    of 32, two N blocks, and two K blocks where K allows: int8 128 columns, int4 a half of 128 bytes is 4 groups,
    so K stays one block there)."""
    sizes, m = CASES[case]
    total = sum(sizes)
    q = _weights(kind, ag, sizes)
    x = _x(m, total, dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    ref = gmm_ref(x, q, gs)
    for blocks in (None, (32, 128, 128)):
        y = gmm_pallas(x, q, gs, interpret=pltpu.InterpretParams(), blocks=blocks)
        assert y.dtype == dtype
        _check_close(y, ref, total, dtype, f"pallas {kind}/{ag} {case} blocks {blocks}")


def test_pallas_int4_several_k_blocks():
    """int4 with K split in blocks (K 1024: halves of 512 bytes in blocks of 256 = 8 groups) and N in two blocks."""
    sizes, m = [5, 0, 60, 1, 0, 34], 100
    q = _weights("int4", 0, sizes, shape=(E, N, 1024))
    x = _x(m, sum(sizes), jnp.float32, k=1024)
    gs = jnp.asarray(sizes, jnp.int32)
    y = gmm_pallas(x, q, gs, interpret=pltpu.InterpretParams(), blocks=(32, 128, 256))
    _check_close(y, gmm_ref(x, q, gs), sum(sizes), jnp.float32, "int4 nk=2")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows_per_item", [1, 8, None])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind,ag", KINDS)
def test_xla_forms_match_reference(kind, ag, case, rows_per_item, dtype):
    """The CPU forms: one item per row (unrolled up to 32 rows, a loop beyond), items of 8 rows, and the auto choice."""
    sizes, m = CASES[case]
    total = sum(sizes)
    q = _weights(kind, ag, sizes)
    x = _x(m, total, dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    y = jax.jit(lambda x, q, gs: gmm_xla(x, q, gs, rows_per_item=rows_per_item))(x, q, gs)
    assert y.dtype == dtype
    _check_close(y, gmm_ref(x, q, gs), total, dtype, f"xla {kind}/{ag} {case} rows_per_item {rows_per_item}")


def test_float32_activations_are_not_rounded():
    """w4a16 with float32 activations multiplies the float32 values: rounding them to bf16 first moves the result
    by ~1e-3 relative, 100x the tolerance; every path must agree with the float32 reference instead."""
    sizes, m = CASES["uneven+empty"]
    q = _weights("int4", 0, sizes)
    x = _x(m, sum(sizes), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    ref = np.asarray(gmm_ref(x, q, gs))
    rounded = np.asarray(gmm_ref(x.astype(jnp.bfloat16).astype(jnp.float32), q, gs))
    scale = np.abs(ref).max()
    assert np.nanmax(np.abs(rounded - ref)) > 1e-4 * scale  # the check below can tell the two apart
    for y in (gmm_pallas(x, q, gs, interpret=pltpu.InterpretParams()), jax.jit(gmm)(x, q, gs)):
        assert y.dtype == jnp.float32
        assert np.nanmax(np.abs(np.asarray(y) - ref)) <= 1e-5 * scale


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_plain_stacks(case, dtype):
    """bf16 / float32 experts through gmm (the CPU's item loop) equal the reference; NaN in unrouted experts and
    padding rows leak nowhere."""
    sizes, m = CASES[case]
    total = sum(sizes)
    w = np.random.default_rng(3).standard_normal((E, N, K)).astype(np.float32) * 0.05
    w[np.asarray(sizes) == 0] = np.nan
    w = jnp.asarray(w, dtype)
    x = _x(m, total, dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    y = jax.jit(gmm)(x, w, gs)
    assert y.dtype == dtype
    _check_close(y, gmm_ref(x, w, gs), total, dtype, f"plain {dtype} {case}")


def test_work_items_name_only_routed_experts():
    """Hand-computed items for sizes [3, 0, 40, 0, 5] in 64 padded rows, tiles of 32: expert 0 in tile 0; expert 2
    in tiles 0 and 1; expert 4 in tile 1; the padding rows 48..63 (tile 1) as group E = 5; then two unused slots
    (2 tiles + 5 experts = 7) repeating the last item. Weight blocks: the item's own expert, or the last routed
    one (4, already in VMEM) for padding and unused slots: experts 1 and 3 are never named."""
    meta = group_metadata(jnp.asarray([3, 0, 40, 0, 5], jnp.int32), 64, 32)
    assert meta.offsets.tolist() == [0, 3, 3, 43, 43, 48, 64]
    assert meta.num_items.tolist() == [5]
    assert meta.gids.tolist() == [0, 2, 2, 4, 5, 5, 5]
    assert meta.mids.tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert meta.wgids.tolist() == [0, 2, 2, 4, 4, 4, 4]


def test_work_items_without_padding_or_rows():
    """No padding rows: no padding item. No rows at all: only the padding group (every tile stored as zeros)."""
    meta = group_metadata(jnp.asarray([32, 0, 32], jnp.int32), 64, 32)
    assert meta.num_items.tolist() == [2] and meta.gids.tolist()[:2] == [0, 2] and meta.mids.tolist()[:2] == [0, 1]
    empty = group_metadata(jnp.asarray([0, 0, 0], jnp.int32), 64, 32)
    assert empty.num_items.tolist() == [2] and empty.gids.tolist()[:2] == [3, 3] and empty.mids.tolist()[:2] == [0, 1]


@pytest.mark.parametrize("kind", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("m", [8, 256])
def test_cpu_program_holds_no_stack(kind, m):
    """The compiled CPU program's temporaries do not grow with the number of experts (8 -> 64 experts of
    [512, 1024]: a copy of any stack-sized leaf, e.g. the int4 scales widened or bitcast whole outside the loop
    (XLA:CPU's float normalization), adds >= 0.5 MiB) and stay below one expert's float32 copy plus the
    activations."""
    n, k = 512, 1024

    def temps(e):
        if kind == "bf16":
            w = jax.ShapeDtypeStruct((e, n, k), jnp.bfloat16)
        else:
            w = QuantArray.abstract((e, n, k), kind, act_group=128 if kind == "int8" else 0)
        x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        gs = jax.ShapeDtypeStruct((e,), jnp.int32)
        return jax.jit(gmm).lower(x, w, gs).compile().memory_analysis().temp_size_in_bytes

    few, many = temps(8), temps(64)
    assert many - few <= 64 << 10, (f"{kind} M={m}: temporaries {few / 2**20:.2f} MiB at 8 experts, "
                                    f"{many / 2**20:.2f} at 64")
    bound = n * k * 4 + 4 * m * max(n, k) * 4
    assert many <= bound, f"{kind} M={m}: temporaries {many / 2**20:.2f} MiB > {bound / 2**20:.2f} MiB"


def test_errors_name_the_problem():
    q = quantize(jnp.zeros((E, N, K)), "int8")
    with pytest.raises(ValueError, match=r"group_sizes must be \[E\] = \[6\]"):
        gmm(jnp.zeros((4, K)), q, jnp.zeros((5,), jnp.int32))
    with pytest.raises(ValueError, match=r"x has 128 features, the experts \(6, 256, 256\) expect 256"):
        gmm(jnp.zeros((4, 128)), q, jnp.zeros((E,), jnp.int32))
    with pytest.raises(ValueError, match=r"expert stack \[E, N, K\], got shape \(256, 256\)"):
        gmm(jnp.zeros((4, K)), q[0], jnp.zeros((E,), jnp.int32))
    with pytest.raises(ValueError, match="impl 'pallas' takes int8 / int4 QuantArray experts"):
        gmm(jnp.zeros((4, K)), jnp.zeros((E, N, K)), jnp.zeros((E,), jnp.int32), impl="pallas")
    with pytest.raises(ValueError, match=r"blocks \(16, 128, 128\) do not tile"):
        gmm_pallas(jnp.zeros((4, K)), q, jnp.zeros((E,), jnp.int32), blocks=(16, 128, 128))
