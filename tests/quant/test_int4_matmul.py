"""w4a16: Pallas kernel (TPU interpret mode, pltpu.InterpretParams: uninitialized VMEM reads as NaN) against
dequantize-then-matmul, bit-exact where the arithmetic is exact, and the XLA forms against the reference."""
import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from gemmajax.quant import QuantArray, dequantize, int4_matmul, int4_matmul_ref, quantize
from gemmajax.quant.array import pack_int4, padded_out
from gemmajax.quant.int4_matmul import int4_matmul_gpu, int4_matmul_pallas, int4_matmul_xla

INTERPRET = pltpu.InterpretParams()


def _data(m, k, n, seed=0, xdtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), xdtype)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32)
    return x, quantize(w, "int4")


def _exact_case(m, k, n, seed=0):
    """Integer activations in -4..4 and power-of-two scales: every product and partial sum is exact in f32, so
    any summation order gives the same bits and the kernel must equal dequantize-then-matmul exactly."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.integers(-4, 5, (m, k)), jnp.bfloat16)
    levels = jnp.asarray(rng.integers(-8, 8, (n, k)), jnp.int8)
    scale = jnp.asarray(2.0 ** rng.integers(-6, 0, (n, k // 32)), jnp.bfloat16)
    return x, QuantArray(pack_int4(levels), scale, "int4", (n, k), 32, jnp.bfloat16)


def _rel(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("m", [1, 5, 16])
def test_kernel_exact_vs_dequantize_then_matmul(m):
    x, q = _exact_case(m, 640, 1000, seed=m)
    ref = jnp.dot(x.astype(jnp.float32), dequantize(q, jnp.float32).T, precision="highest")
    out = int4_matmul_pallas(x.astype(jnp.float32), q, interpret=INTERPRET)
    assert out.shape == (m, 1000)
    assert np.array_equal(np.asarray(out), np.asarray(ref))
    assert np.array_equal(np.asarray(int4_matmul_ref(x.astype(jnp.float32), q)), np.asarray(ref))


def test_kernel_multi_block_exact():
    """Grid (3, 3, 2): the f32 accumulator must start at zero and carry across K steps, the transposed scales
    must be sliced per K step, and the M padding rows (NaN here) must not leak into real rows."""
    x, q = _exact_case(48, 1024, 384, seed=7)
    ref = jnp.dot(x.astype(jnp.float32), dequantize(q, jnp.float32).T, precision="highest")
    out = int4_matmul_pallas(x.astype(jnp.float32), q, interpret=INTERPRET, blocks=(16, 128, 256))
    assert np.array_equal(np.asarray(out), np.asarray(ref))
    # NaN rows appended to x: the real rows are unchanged
    xn = jnp.concatenate([x.astype(jnp.float32), jnp.full((16, 1024), jnp.nan)], 0)
    outn = int4_matmul_pallas(xn, q, interpret=INTERPRET, blocks=(16, 128, 256))
    assert np.array_equal(np.asarray(outn[:48]), np.asarray(ref)) and bool(jnp.all(jnp.isnan(outn[48:])))


@pytest.mark.parametrize("m", [1, 16])
def test_kernel_vs_reference_random(m):
    x, q = _data(m, 640, 1000, seed=10 + m)
    out = int4_matmul_pallas(x, q, interpret=INTERPRET)
    # same bf16 products, f32 sums in another order: a few f32 ulps of the largest partial sums
    assert _rel(out, int4_matmul_ref(x, q)) < 1e-5


def test_kernel_prefill_bf16():
    x, q = _data(512, 640, 1000, seed=20, xdtype=jnp.bfloat16)
    out = int4_matmul_pallas(x, q, interpret=INTERPRET)
    assert out.dtype == jnp.bfloat16 and out.shape == (512, 1000)
    ref = int4_matmul_ref(x, q)
    assert _rel(out, ref) < 2**-8  # both rounded to bf16 once at the end
    assert float(jnp.mean((out == ref).astype(jnp.float32))) > 0.9


def test_padded_in_and_out():
    """in 100 -> 128 padded columns (zero levels, zero activations); out 5000 -> 5120 rows cut back."""
    x, q = _data(3, 100, 5000, seed=21)
    assert q.padded_in == 128 and q.padded_out == 5120
    out = int4_matmul_pallas(x, q, interpret=INTERPRET)
    assert out.shape == (3, 5000) and _rel(out, int4_matmul_ref(x, q)) < 1e-5


@pytest.mark.parametrize("m", [1, 5])
def test_xla_forms_match_reference(m):
    x, q = _data(m, 640, 1000, seed=30 + m)
    ref = int4_matmul_ref(x, q)
    for form in ("rows", "tiles", "auto"):
        assert _rel(jax.jit(lambda x, q, f=form: int4_matmul_xla(x, q, form=f))(x, q), ref) < 1e-5, form
    assert _rel(jax.jit(int4_matmul_gpu)(x, q), ref) < 1e-5


@pytest.mark.parametrize("xdtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
def test_xla_forms_exact(m, xdtype):
    """Integer activations and power-of-two scales: every product and sum is exact, so each CPU form must give the
    reference's bits whatever its order of summation (a wrong nibble, scale group or half fails)."""
    xe, qe = _exact_case(m, 640, 1000, seed=40 + m)
    xe = xe.astype(xdtype)
    exact = np.asarray(int4_matmul_ref(xe, qe).astype(jnp.float32))
    for form in ("rows", "tiles", "auto"):
        y = jax.jit(lambda x, q, f=form: int4_matmul_xla(x, q, form=f))(xe, qe)
        assert y.dtype == xdtype and np.array_equal(np.asarray(y.astype(jnp.float32)), exact), form


def test_split_rounds_every_level_and_mantissa_like_dequantize():
    """The CPU forms' dequantization (_half_weight: Veltkamp's split for bf16 scales, integer rounding for float32
    ones), jitted for the CPU, against dequantize() (f32 product, then bf16 with ties to even), bit for bit: every
    level -8..7 times every bf16 mantissa, at exponents 2**-60..2**60 and both signs of the scale. Ties are common
    here (e.g. 3 x an odd mantissa), so a rounding that breaks them the wrong way fails, as does an XLA rewrite of
    t - (t - q * s) into q * s."""
    from gemmajax.quant.int4_matmul import _half_weight
    mant = np.arange(128, dtype=np.uint32) << 16
    exps = np.array([67, 100, 120, 127, 130, 150, 187], np.uint32) << 23  # 2**-60 .. 2**60
    sbits = (exps[:, None] | mant[None, :]).reshape(-1)
    sbits = np.concatenate([sbits, sbits | np.uint32(1 << 31)])  # negative scales too
    scales_f32 = sbits.view(np.float32)
    s_bf16 = jnp.asarray(scales_f32, jnp.bfloat16)  # exact: the low 16 bits are zero
    n = scales_f32.size
    levels = np.tile(np.arange(-8, 8, dtype=np.int32), (n, 2))  # [n, 32]: one group of each level twice
    v = jnp.asarray((levels + 8).astype(np.uint8))
    for sc in (s_bf16[:, None], jnp.asarray(scales_f32 * np.float32(1 + 2.0**-20))[:, None]):  # bf16 / f32 scales
        got = np.asarray(jax.jit(_half_weight, static_argnums=2)(v, sc, 32))
        want = (levels.astype(np.float32) * np.asarray(sc, np.float32)).astype(jnp.bfloat16).astype(np.float32)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"scale dtype {sc.dtype}"


def test_short_scales_form_equals_the_rounding_form():
    """QuantArray.short_scales lets the CPU forms skip the bf16 rounding (_half_weight short=True: one multiply-add
    on the biased nibble). Bit for bit the same weights as the rounding path (and as dequantize()'s
    bf16(level * scale)) for every level -8..7, every 5-significant-bit mantissa, exponents 2**-100..2**100,
    both signs, bf16 and float32 scales (and a zero scale)."""
    from gemmajax.quant.int4_matmul import _half_weight
    mant = np.arange(16, dtype=np.uint32) << 19
    exps = np.array([27, 60, 100, 127, 150, 200, 227], np.uint32) << 23  # 2**-100 .. 2**100
    sbits = (exps[:, None] | mant[None, :]).reshape(-1)
    sbits = np.concatenate([sbits, sbits | np.uint32(1 << 31), [0]]).astype(np.uint32)  # negative scales, zero
    scales = sbits.view(np.float32)
    levels = np.tile(np.arange(-8, 8, dtype=np.int32), (scales.size, 2))
    v = jnp.asarray((levels + 8).astype(np.uint8))
    want = (levels.astype(np.float32) * scales[:, None]).astype(jnp.bfloat16).astype(np.float32)
    for sc in (jnp.asarray(scales, jnp.bfloat16)[:, None], jnp.asarray(scales)[:, None]):
        fast = np.asarray(jax.jit(_half_weight, static_argnums=(2, 3))(v, sc, 32, True))
        slow = np.asarray(jax.jit(_half_weight, static_argnums=(2, 3))(v, sc, 32, False))
        nz = want != 0  # a zero scale gives +0 for every level here, -0 for negative levels there: the same sums
        assert np.array_equal(fast, want) and np.array_equal(fast[nz].view(np.uint32), want[nz].view(np.uint32))
        assert np.array_equal(slow.view(np.uint32), want.view(np.uint32)), f"scale dtype {sc.dtype}"


@pytest.mark.parametrize("short", [True, False])
def test_cpu_forms_equal_the_reference_with_and_without_short_scales(short):
    """quantize()'s weights are short_scales; QAT repacks and older checkpoints are not: both kinds through every CPU
    form (one row, 3 rows, 16 rows; bf16 and float32 x) give the reference's values."""
    x, q = _data(16, 640, 1536, seed=61, xdtype=jnp.bfloat16)
    assert q.short_scales
    q = q if short else dataclasses.replace(q, short_scales=False)
    for xd in (jnp.bfloat16, jnp.float32):
        xx = x.astype(xd)
        ref = np.asarray(int4_matmul_ref(xx, q).astype(jnp.float32))
        for form in ("rows", "tiles"):
            for m in (1, 3, 16):
                y = jax.jit(lambda a, w, f=form: int4_matmul_xla(a, w, form=f))(xx[:m], q)
                np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), ref[:m], rtol=8e-3 if xd == jnp.bfloat16
                                           else 1e-5, atol=4e-3 if xd == jnp.bfloat16 else 1e-4, err_msg=form)


@pytest.mark.parametrize("xdtype", [jnp.float32, jnp.bfloat16])
def test_tiles_loop_and_tail(xdtype):
    """n = 2 tiles of 2,048 rows + a tail of 384 (the loop, its in-place writes and the tail after it), m = 16."""
    x, q = _data(16, 256, 2 * 2048 + 384, seed=60, xdtype=xdtype)
    y = jax.jit(lambda x, q: int4_matmul_xla(x, q, form="tiles"))(x, q)
    assert y.shape == (16, 4480) and y.dtype == xdtype
    xd, wd = np.asarray(x.astype(jnp.float32), np.float64), np.asarray(dequantize(q, jnp.float32), np.float64)
    want, size = xd @ wd.T, np.abs(xd) @ np.abs(wd).T
    err = np.abs(np.asarray(y.astype(jnp.float32), np.float64) - want)
    # float32: accumulation only; bf16: the one rounding of the output (2**-8 relative) on top
    bound = 1e-5 * size if xdtype == jnp.float32 else 2.0**-8 * np.abs(want) + 1e-5 * size
    assert (err <= bound).all(), (err / bound).max()


@pytest.mark.parametrize("xdtype", [jnp.float32, jnp.bfloat16])
def test_tiles_concurrent_iterations_and_tail_exact(xdtype):
    """Two loop iterations of 4 concurrent 2,048-row tiles (bf16 x; float32 x: four of 2), then a whole tile and a
    partial one after the loop (n = 2 x 8,192 + 2,048 + 300), the bf16 output carried as uint16 bits: exact
    arithmetic, so the reference's bits in every row (a tile written to the wrong place, a dropped tail or a double
    rounding fails), and the same bits at 4, 2 and 1 tiles per iteration."""
    from gemmajax.quant.int4_matmul import _finish, _pad_x, _tiles
    xe, qe = _exact_case(3, 256, 2 * 8192 + 2048 + 300, seed=61)
    xe = xe.astype(xdtype)
    exact = np.asarray(int4_matmul_ref(xe, qe).astype(jnp.float32))
    y = jax.jit(lambda x, q: int4_matmul_xla(x, q, form="tiles"))(xe, qe)
    assert y.dtype == xdtype and np.array_equal(np.asarray(y.astype(jnp.float32)), exact)
    for conc in (None, 4, 2, 1):  # the dtype's default, then each count
        got = jax.jit(lambda x, q, c=conc: _finish(_tiles(_pad_x(x, q), q, 2048, c, x.dtype), x, q))(xe, qe)
        assert np.array_equal(np.asarray(got.astype(jnp.float32)), exact), conc


def _loop_dots(f, *args) -> int:
    """The dot_generals inside the body of f's one loop (the tiles form's fori_loop: a scan or a while), found at any
    depth."""
    from tests.quant.test_int8_matmul import _eqns
    loops = [e for e in _eqns(jax.make_jaxpr(f)(*args).jaxpr) if e.primitive.name in ("while", "scan")]
    assert len(loops) == 1, loops
    body = loops[0].params.get("body_jaxpr") or loops[0].params["jaxpr"]
    return sum(e.primitive.name == "dot_general" for e in body.jaxpr.eqns)


@pytest.mark.parametrize("m", [2, 16, 128, 129])
def test_tiles_without_bf16_hardware_are_float32_and_the_gemms_left_operand(m):
    """bf16_dot=False (int4_matmul_cpu on a CPU without bf16 hardware): the tiles form, and "auto" from 2 rows,
    multiplies float32 tiles by float32 activations (bf16 x widened), 2 tiles per loop iteration, each tile the GEMM's
    left operand (W . x^T) up to LHS_MAX_M rows and its right one above; bf16_dot=True keeps x . W^T, in bf16 for
    bf16 x (4 tiles per iteration) and float32 for float32 x (2); "dense" is "tiles", and "bf16" keeps bf16 tiles
    and x . W^T either way. n: 4 iterations of 2 tiles, or 2 of 4, then a whole tile and a partial one; and a weight
    of one tile (no loop). Every way gives the reference's bits on exact data (the same products), in x's dtype, and
    random data within the bf16 forms' tolerance."""
    from gemmajax.quant.int4_matmul import LHS_MAX_M
    from tests.quant.test_int8_matmul import _eqns
    assert LHS_MAX_M == 128  # the cases' premise: 128 rows are W . x^T, 129 are not

    def dots(f, *args):  # (operand dtypes, whether the weight tile is the left operand) of every dot_general
        out = set()
        for e in _eqns(jax.make_jaxpr(f)(*args).jaxpr):
            if e.primitive.name == "dot_general":
                a, b = (v.aval for v in e.invars)
                assert m in (a.shape[0], b.shape[0]) and a.shape[0] != b.shape[0], (a.shape, b.shape)
                out.add((f"{a.dtype},{b.dtype}", b.shape[0] == m))
        return out

    # n: the loop with a tail (above), and one tile (n // 2048 <= 1: no loop), the path of every Gemma 3 270M layer
    for n in (2 * 8192 + 2048 + 300, 1000):
        xe0, qe = _exact_case(m, 256, n, seed=70 + m)
        for xd in (jnp.bfloat16, jnp.float32):
            xe = xe0.astype(xd)
            exact = np.asarray(int4_matmul_ref(xe, qe).astype(jnp.float32))
            for form in ("tiles", "auto", "dense", "bf16"):
                for bf16_dot in (False, True):
                    if form == "bf16" and xd == jnp.float32:
                        continue  # bf16 tiles of float32 x: refused (test_bf16_form_refuses_float32_activations)
                    f = lambda x, q, fo=form, b=bf16_dot: int4_matmul_xla(x, q, form=fo, bf16_dot=b)
                    f32 = form != "bf16" and (xd == jnp.float32 or not bf16_dot)  # "bf16" keeps bf16 tiles
                    lhs = form != "bf16" and not bf16_dot and m <= 128
                    want = {("float32,float32" if f32 else "bfloat16,bfloat16", lhs)}
                    assert dots(f, xe, qe) == want, (n, xd, form, bf16_dot)
                    y = jax.jit(f)(xe, qe)
                    assert y.dtype == xd and np.array_equal(np.asarray(y.astype(jnp.float32)), exact), (n, xd, form)
                    if n > 2048:  # tiles per loop iteration: 2 float32, 4 bf16 (two dots each, one per nibble half)
                        assert _loop_dots(f, xe, qe) == (4 if f32 else 8), (xd, form, bf16_dot)
    x, q = _data(m, 640, 1536, seed=m, xdtype=jnp.bfloat16)
    ref = np.asarray(int4_matmul_ref(x, q).astype(jnp.float32))
    y = jax.jit(lambda x, q: int4_matmul_xla(x, q, bf16_dot=False))(x, q)
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), ref, rtol=8e-3, atol=4e-3)


@pytest.mark.parametrize("flag", ["0", "1"])
def test_cpu_int4_matmul_follows_the_cpus_bf16_hardware(monkeypatch, flag):
    """int4_matmul on the CPU (impl "auto" and "xla", and the expert loop's one-expert matmul) takes bf16 tiles at
    16 rows only where the CPU has bf16 hardware (cpu_features.native_bf16_dot, here forced by
    GEMMAJAX_CPU_BF16_DOT): the program the CPU compiles has float32 dots without it. Read when traced, and JAX
    reuses a platform_dependent branch's trace for the same shapes, so each flag gets its own row count."""
    import re

    from gemmajax.quant.gmm import _matmul_cpu
    monkeypatch.setenv("GEMMAJAX_CPU_BF16_DOT", flag)
    m = 16 + int(flag)
    x, q = _data(m, 256, 3 * 2048 + 64, seed=9, xdtype=jnp.bfloat16)  # the tiles' loop and a tail
    ref = np.asarray(int4_matmul_ref(x, q).astype(jnp.float32))
    for name, f in (("auto", lambda x, q: int4_matmul(x, q, "auto")), ("xla", lambda x, q: int4_matmul(x, q, "xla")),
                    ("expert", _matmul_cpu)):
        hlo = jax.jit(f).lower(x, q).as_text()
        dots = re.findall(r"dot_general[^\n]*?: \(tensor<[0-9x]+x(bf16|f32)>, tensor<[0-9x]+x(bf16|f32)>\)", hlo)
        assert dots and set(dots) == {("bf16", "bf16") if flag == "1" else ("f32", "f32")}, (name, set(dots))
        y = np.asarray(jax.jit(f)(x, q).astype(jnp.float32))
        np.testing.assert_allclose(y, ref, rtol=8e-3, atol=4e-3, err_msg=name)


@pytest.mark.parametrize("concurrent", [1, 2, 3, 4])
def test_tiles_every_split_of_loop_and_tail(concurrent):
    """Small tiles (64 rows) so every case is cheap: n = 2 loop iterations' rows plus 0..3 whole tiles plus 0 or a
    partial tile, and one of 3 iterations, each exact against the reference (bf16 outputs through the uint16 carry and
    float32 ones, alternately)."""
    from gemmajax.quant.int4_matmul import _finish, _pad_x, _tiles
    tile = 64
    cases = [(2, k, r) for k in range(4) for r in (0, 17)] + [(3, 1, 5)]
    for i, (it, k, r) in enumerate(cases):
        n = it * tile * concurrent + k * tile + r
        xe, qe = _exact_case(2, 64, n, seed=n)
        x = xe.astype(jnp.bfloat16 if i % 2 == 0 else jnp.float32)
        got = jax.jit(lambda x, q: _finish(_tiles(_pad_x(x, q), q, tile, concurrent, x.dtype), x, q))(x, qe)
        want = np.asarray(int4_matmul_ref(x, qe).astype(jnp.float32))
        assert got.dtype == x.dtype and np.array_equal(np.asarray(got.astype(jnp.float32)), want), (n, x.dtype)


@pytest.mark.parametrize("inp", [640, 100])
@pytest.mark.parametrize("form", ["rows", "tiles"])
def test_table_padding_columns_are_never_read(inp, form):
    """A vocabulary table pads in to a multiple of 256 (quantize_table): in 640 -> 768, whose high half holds 256
    real columns and 128 of padding; in 100 -> 256, whose high half is all padding. The CPU forms skip those groups:
    their scales are set to NaN here, so any form that multiplies them (even by zero activations) returns NaN, while
    the reference (which cuts dequantize() to the real columns) does not."""
    from gemmajax.quant import quantize_table
    rng = np.random.default_rng(61)
    q = quantize_table(jnp.asarray(rng.standard_normal((300, inp)) * 0.05, jnp.bfloat16), 4)
    g2 = q.scale.shape[1] // 2
    live_hi = max(-(-inp // 32) * 32 - q.padded_in // 2, 0) // 32
    q = dataclasses.replace(q, scale=q.scale.at[:, g2 + live_hi:].set(jnp.nan))
    for m in (1, 3):
        x = jnp.asarray(rng.standard_normal((m, inp)), jnp.bfloat16)
        y = jax.jit(lambda x, q: int4_matmul_xla(x, q, form=form))(x, q)
        ref = int4_matmul_ref(x, q)
        assert bool(jnp.all(jnp.isfinite(ref))) and bool(jnp.all(jnp.isfinite(y))), f"m={m}: padding was read"
        assert _rel(y, ref) < 2**-8, m


_F32_PATHS = {
    "ref": int4_matmul_ref,
    "auto": lambda x, q: int4_matmul(x, q, "auto"),
    "xla": lambda x, q: int4_matmul(x, q, "xla"),
    "pallas_interpret": lambda x, q: int4_matmul(x, q, "pallas_interpret"),
    "xla rows": lambda x, q: int4_matmul_xla(x, q, form="rows"),
    "xla tiles": lambda x, q: int4_matmul_xla(x, q, form="tiles"),
    "xla dense": lambda x, q: int4_matmul_xla(x, q, form="dense"),
    "gpu form": int4_matmul_gpu,
}


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("path", list(_F32_PATHS))
def test_float32_activations_are_not_rounded(path, m):
    """"a16" means the model's dtype: float32 x times the dequantized weight in float32, x never rounded to bf16.

    x [m, 640] f32, w [1000, 640] int4 -> y [m, 1000]. The float64 product of x and dequantize(w, f32) is the
    oracle; each output may differ from it by float32 accumulation only, bounded by 1e-5 of sum_k |x_k w_k| (the
    measured error is ~1e-7 of it). Rounding x to bf16 (the old code) is off by ~1e-4 of it (2^-9 per term)."""
    x, q = _data(m, 640, 1000, seed=70 + m)
    fn = _F32_PATHS[path]
    y = jax.jit(fn)(x, q)
    assert y.shape == (m, 1000) and y.dtype == jnp.float32
    xd, wd = np.asarray(x, np.float64), np.asarray(dequantize(q, jnp.float32), np.float64)
    want, size = xd @ wd.T, np.abs(xd) @ np.abs(wd).T
    err = np.abs(np.asarray(y, np.float64) - want)
    assert (err <= 1e-5 * size).all(), (f"{path}, m={m}: worst error {(err / size).max():.2e} of sum |x w| "
                                        f"(float32 accumulation gives ~1e-7)")


def test_bf16_form_refuses_float32_activations():
    x, q = _data(16, 640, 1000, seed=80)
    with pytest.raises(ValueError, match="'bf16' multiplies bf16 activations, x is float32"):
        int4_matmul_xla(x, q, form="bf16")


def test_dispatch_impls():
    x, q = _data(3, 640, 1000, seed=50)
    ref = int4_matmul_ref(x, q)
    for impl in ("auto", "xla", "pallas_interpret"):
        assert _rel(jax.jit(lambda x, q, i=impl: int4_matmul(x, q, i))(x, q), ref) < 1e-5, impl
    with pytest.raises(ValueError, match="impl"):
        int4_matmul(x, q, "triton")
    with pytest.raises(ValueError, match="features"):
        int4_matmul(x[:, :600], q)


def test_quantization_error_vs_float():
    """RTN int4 (step amax/7 per group of 32): each weight is within half a step, so for Gaussian weights the
    relative error of the product is about (amax/7)/sqrt(12)/sigma ~ 2.3/7/3.46 ~ 9 %; allow 12 %."""
    rng = np.random.default_rng(60)
    x = jnp.asarray(rng.standard_normal((16, 640)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((1000, 640)), jnp.float32)
    y = int4_matmul_ref(x, quantize(w, "int4"))
    yf = jnp.dot(x, w.T, precision="highest")
    rel = float(jnp.linalg.norm(y - yf) / jnp.linalg.norm(yf))
    assert 0.03 < rel < 0.12, rel


def _legal(n: int, half: int, blocks) -> None:
    tm, tn, tkp, mp = blocks
    assert n % tn == 0 and (tn % 128 == 0 or tn == n), (n, half, blocks)
    assert half % tkp == 0 and (tkp == half or (tkp % 128 == 0 and (tkp // 32) % 8 == 0)), (n, half, blocks)
    assert tm % 16 == 0 and mp % tm == 0


def test_default_blocks_are_legal_and_bounded():
    """int4_blocks over the published models' projections and 200 random shapes (seeded), decode and prefill rows,
    bf16 and float32 activations: every block tiles the weight by the kernel's rules; the block stays within
    _INT4_BLOCK_BYTES wherever a legal block that small exists (tn 128, or a K split when n is one block); the
    kernel's VMEM estimate stays within _INT4_VMEM_BUDGET unless no smaller legal tn or tkp exists; a half-row of at
    most _INT4_MAX_TKP bytes is taken whole when nothing forced a split."""
    mod = importlib.import_module("gemmajax.quant.int4_matmul")  # the package exports a function of that name
    rng = np.random.default_rng(0)
    shapes = [(12288, 768), (1536, 6144), (2048, 768), (2112, 1408), (2816, 1056), (4096, 1408), (262144, 768),
              (262144, 1408), (5376, 10752), (21504, 2688), (1000, 4096), (1000, 320), (2100, 2048), (2100, 1056)]
    shapes += [(int(rng.integers(1, 200)) * int(rng.choice([8, 128])), int(rng.integers(1, 96)) * 128)
               for _ in range(200)]
    for n, half in shapes:
        n = padded_out(n)  # the stored rows the kernel tiles (large unaligned `out` is padded to 128)
        for m, xb in ((1, 2), (16, 2), (16, 4), (300, 2), (300, 4)):
            b = mod.int4_blocks(m, n, half, 32, xb, xb, 2)
            _legal(n, half, b)
            tm, tn, tkp, _ = b
            vmem = mod._int4_vmem(tm, tn, tkp, 2 * half // 32, xb, xb, 2, half // tkp)
            smaller_k = [t for t in range(128, tkp, 128) if half % t == 0 and (t // 32) % 8 == 0]
            smaller_n = [t for t in range(128, tn, 128) if n % t == 0] if n % 128 == 0 else []
            assert vmem <= mod._INT4_VMEM_BUDGET or not (smaller_k or smaller_n), (n, half, m, xb, b, vmem)
            shrunk = mod._int4_vmem(tm, tn, half, 2 * half // 32, xb, xb, 2, 1) > mod._INT4_VMEM_BUDGET
            if half <= mod._INT4_MAX_TKP and (n % 128 == 0 or n * half <= mod._INT4_BLOCK_BYTES) and not shrunk:
                assert tkp == half, (n, half, b)
            if n % 128 == 0:
                assert tn * tkp <= mod._INT4_BLOCK_BYTES or tn == 128, (n, half, b)
                assert tn <= mod._INT4_MAX_TN
            elif tkp != half:  # the K split of a one-block n
                assert n * tkp <= mod._INT4_BLOCK_BYTES, (n, half, b)
            # the kernel takes them as an explicit override too (its own validation), traced abstractly
            x = jax.ShapeDtypeStruct((m, 2 * half), jnp.bfloat16)
            w = jax.eval_shape(lambda n=n, half=half: quantize(jnp.zeros((n, 2 * half), jnp.float32), "int4"))
            out = jax.eval_shape(lambda x, w, b=b: int4_matmul_pallas(x, w, blocks=b[:3]), x, w)
            assert out.shape == (m, n)


@pytest.mark.parametrize("n,k", [(8192, 1024), (1000, 8192)])
def test_kernel_exact_at_the_default_large_blocks(n, k):
    """The default blocks at shapes where they are large: two 4,096-row N blocks over a whole 512-byte half-row;
    and an unaligned n (one N block) whose 4,096-byte half-row is split in two K blocks to bound the block."""
    from gemmajax.quant.int4_matmul import int4_blocks

    tm, tn, tkp, _ = int4_blocks(16, n, k // 2, 32)
    assert (n // tn, (k // 2) // tkp) == ((2, 1) if n == 8192 else (1, 2))
    x, q = _exact_case(16, k, n, seed=3)
    ref = jnp.dot(x.astype(jnp.float32), dequantize(q, jnp.float32).T, precision="highest")
    out = int4_matmul_pallas(x.astype(jnp.float32), q, interpret=INTERPRET)
    assert np.array_equal(np.asarray(out), np.asarray(ref))
