"""w8a8: Pallas kernel (TPU interpret mode, pltpu.InterpretParams: uninitialized VMEM reads as NaN) against the jnp
reference, the XLA forms against the reference, and the quantization error against a float matmul; the same with
activation groups (act_group), compared within a derived float32 summation-order bound."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from gemmajax.quant import QuantArray, abstract_quant, int8_matmul, int8_matmul_ref, quantize
from gemmajax.quant.int8_matmul import int8_matmul_pallas, int8_matmul_xla, quantize_activations
from gemmajax.quant.quantize import default_act_group

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


# --- activation groups (w.act_group = G: one activation scale per token per G input columns) ------------------------
def _grouped(m, k, n, g, seed=0, xdtype=jnp.float32, outliers=False):
    x, w, q = _data(m, k, n, seed, xdtype)
    if outliers:  # two large channels (both within the first 128 columns), as Gemma's activations have
        x = x.at[:, 3].multiply(60.0).at[:, 70].multiply(-40.0)
    return x, w, dataclasses.replace(q, act_group=g)


def _order_bound(x, q, roundings):
    """What two summation orders of the same scaled products may differ by in float32: roundings * 2**-24 * S with
    S[m, n] = w_scale[n] * sum_k |xq[m, k]| x_scale[m, g(k)] |wq[n, k]| (float64), which bounds every partial sum
    (Higham's gamma_n with n = roundings)."""
    xq, xs = quantize_activations(x.reshape(-1, x.shape[-1]), q.act_group)
    g = q.act_group or x.shape[-1]
    xd = np.abs(np.asarray(xq, np.float64)) * np.repeat(np.asarray(xs, np.float64), g, axis=1)
    s = xd @ np.abs(np.asarray(q.values, np.float64)).T * np.asarray(q.scale, np.float64)[None, :]
    return roundings * 2.0**-24 * s[:, : q.out_features]


def _assert_close(out, ref, bound):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all() and out.shape == ref.shape
    err = np.abs(out - ref)
    assert np.all(err <= bound), (float(err.max()), float(bound[np.unravel_index(np.argmax(err - bound), err.shape)]))


def test_group_activation_quantization():
    x = jnp.asarray([[1.0, -2.0, 0.5, 0.25, 0.0, 0.0, 8.0, 1.0],
                     [127.0, 1.0, 1.0, 1.0, -0.5, 0.25, 0.5, 0.5]])
    xq, xs = quantize_activations(x, 4)  # two groups of 4 columns per token
    assert xs.shape == (2, 2) and xq.shape == (2, 8)
    assert np.array_equal(np.asarray(xs), np.float32([[2.0, 8.0], [127.0, 0.5]]) / np.float32(127))
    assert np.array_equal(np.asarray(xq), np.int8([[64, -127, 32, 16, 0, 0, 127, 16],
                                                   [127, 1, 1, 1, -127, 64, 127, 127]]))
    xq0, xs0 = quantize_activations(x)  # group 0: one scale per token, as before
    assert xs0.shape == (2, 1) and np.array_equal(np.asarray(quantize_activations(x, 8)[0]), np.asarray(xq0))
    with pytest.raises(ValueError, match="group 3"):
        quantize_activations(x, 3)


def test_group_reference_is_the_definition():
    """int8_matmul_ref against the formula written out in numpy (float64 over exact integers)."""
    x, _, q = _grouped(3, 256, 130, 64, seed=5, outliers=True)
    xq, xs = (np.asarray(a) for a in quantize_activations(x, 64))
    wq = np.asarray(q.values).astype(np.int64)
    parts = np.stack([xq[:, g * 64:(g + 1) * 64].astype(np.int64) @ wq[:, g * 64:(g + 1) * 64].T for g in range(4)])
    want = np.asarray(q.scale, np.float64) * np.einsum("gmn,mg->mn", parts.astype(np.float64), xs)
    ref = int8_matmul_ref(x, q)
    _assert_close(ref, want, _order_bound(x, q, 4 + 2))


@pytest.mark.parametrize("m,k,n,g", [(1, 640, 1000, 128), (8, 512, 200, 64), (16, 256, 136, 32), (3, 512, 256, 256)])
def test_group_kernel_matches_reference(m, k, n, g):
    """Odd out sizes (one full-width block), several G (sub-blocks of 32 / 64 lanes too)."""
    x, _, q = _grouped(m, k, n, g, seed=m + g, outliers=True)
    out = int8_matmul_pallas(x, q, interpret=INTERPRET)
    ref = int8_matmul_ref(x, q)
    assert out.shape == (m, n) and out.dtype == x.dtype
    bound = _order_bound(x, q, 2 * (k // g + 2))
    _assert_close(out, ref, bound)
    # the comparison can fail: per-token scales (act_group 0) on the same data land far outside it
    per_token = int8_matmul_ref(x, dataclasses.replace(q, act_group=0))
    assert np.mean(np.abs(np.asarray(per_token) - np.asarray(ref)) > bound) > 0.5


def test_group_kernel_prefill_bf16():
    x, _, q = _grouped(512, 640, 1000, 128, seed=7, xdtype=jnp.bfloat16, outliers=True)
    out = int8_matmul_pallas(x, q, interpret=INTERPRET)
    ref = int8_matmul_ref(x, q)
    assert out.dtype == jnp.bfloat16
    # float32 values within the order bound may round to neighbouring bf16 numbers: one bf16 ulp (<= 2**-7 |v|)
    bound = _order_bound(x, q, 2 * (640 // 128 + 2)) + 2.0**-7 * np.abs(np.asarray(ref, np.float64))
    _assert_close(out, ref, bound)


def test_group_kernel_multi_block_grid():
    """Grid (2, 3, 4) with two groups per K block: the float32 accumulator starts at zero on every (i, j) tile
    (interpret mode fills scratch with NaN), the group scales follow the K block, M padding does not leak."""
    x, _, q = _grouped(40, 1024, 384, 128, seed=2, outliers=True)
    out = int8_matmul_pallas(x, q, interpret=INTERPRET, blocks=(32, 128, 256))
    _assert_close(out, int8_matmul_ref(x, q), _order_bound(x, q, 2 * (1024 // 128 + 2)))
    with pytest.raises(ValueError, match="act_group 256"):  # tk 128 cannot hold a whole group of 256
        int8_matmul_pallas(x, dataclasses.replace(q, act_group=256), interpret=INTERPRET, blocks=(32, 128, 128))


@pytest.mark.parametrize("m,form,g", [(1, "vector", 128), (1, "vector", 32), (7, "int", 128), (7, "int", 32),
                                      (7, "batch", 64), (1, "auto", 128), (7, "auto", 128)])
def test_group_xla_forms_match_reference(m, form, g):
    x, _, q = _grouped(m, 640, 1000, g, seed=11, outliers=True)
    out = jax.jit(lambda x, q: int8_matmul_xla(x, q, form=form))(x, q)
    ref = int8_matmul_ref(x, q)
    # "vector" multiplies dequantized activations: each product and the K-term float32 sum round
    vector = form == "vector" or (form == "auto" and m == 1)
    _assert_close(out, ref, _order_bound(x, q, (640 + 640 // g + 5) if vector else 2 * (640 // g + 2)))


@pytest.mark.parametrize("m", [64, 70])
def test_wide_form_without_groups_is_exact(m):
    """No act_group: "wide" multiplies the int8 levels in bf16 (exact) and sums in float32 (exact below 2**24:
    |sum| <= 640 * 127 * 127 ~ 1.0e7), then scales as the reference does: the same bits."""
    x, _, q = _data(m, 640, 1000, seed=21, xdtype=jnp.bfloat16)
    out = jax.jit(lambda x, q: int8_matmul_xla(x, q, form="wide"))(x, q)
    assert out.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(out), np.asarray(int8_matmul_ref(x, q)))


@pytest.mark.parametrize("m,k,n", [(64, 640, 1000), (96, 1024, 384), (64, 4096, 256)])
def test_wide_form_with_groups_within_its_rounding(m, k, n):
    """act_group 128, bf16 x with outlier channels: "wide" rounds each dequantized activation xq * x_scale to bf16
    (at most 2**-8 relative) before one GEMM, so before the output's rounding it differs from the reference's
    integers by at most 2**-8 * S (S as in _order_bound: w_scale * sum |xq| x_scale |wq|), and both round to bf16
    at the end (one bf16 step: at most 2**-7 * |ref|)."""
    x, _, q = _grouped(m, k, n, 128, seed=m + k, xdtype=jnp.bfloat16, outliers=True)
    out = jax.jit(lambda x, q: int8_matmul_xla(x, q, form="wide"))(x, q)
    ref = int8_matmul_ref(x, q)
    s = _order_bound(x, q, 1) * 2.0**24
    _assert_close(out, ref, 2.0**-8 * s * 1.01 + 2.0**-7 * np.abs(np.asarray(ref, np.float64)))
    # and the bound is not vacuous: a typical output's bound is a small fraction of it (S grows as K, |y| as
    # sqrt(K)), so a dropped group or a wrong scale fails
    assert float(np.median(2.0**-8 * s / np.maximum(np.abs(np.asarray(ref, np.float64)), 1e-3))) < 0.3


def _eqns(jaxpr):
    """Every equation of a jaxpr, those of nested jaxprs (jit, loops, conditionals) included, outer first."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def _dot_operand_dtypes(f, *args) -> list[str]:
    """The operand dtypes of every dot_general in f's jaxpr, nested ones included (e.g. ["bfloat16,bfloat16"])."""
    return [",".join(str(v.aval.dtype) for v in e.invars) for e in _eqns(jax.make_jaxpr(f)(*args).jaxpr)
            if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("g", [0, 128])
def test_wide_form_in_float32_without_bf16_hardware(g):
    """bf16_dot=False (a CPU without bf16 hardware, int8_matmul_cpu): "wide" multiplies float32 levels by float32
    activations (the levels without groups: exact, the reference's bits; with groups xq * x_scale unrounded, as
    "vector": each product and the K-term float32 sum round), where bf16_dot=True multiplies bf16 ones."""
    x, _, q = _grouped(16, 640, 1000, g, seed=31 + g, xdtype=jnp.bfloat16, outliers=True)
    f32 = lambda x, q: int8_matmul_xla(x, q, form="wide", bf16_dot=False)
    b16 = lambda x, q: int8_matmul_xla(x, q, form="wide", bf16_dot=True)
    assert _dot_operand_dtypes(f32, x, q) == ["float32,float32"]
    assert _dot_operand_dtypes(b16, x, q) == ["bfloat16,bfloat16"]
    out, ref = jax.jit(f32)(x, q), int8_matmul_ref(x, q)
    assert out.dtype == jnp.bfloat16
    if not g:
        assert np.array_equal(np.asarray(out), np.asarray(ref))
        return
    # before the output's rounding within the "vector" form's bound; both outputs round to bf16 once (2**-7 |ref|)
    ref64 = np.abs(np.asarray(ref, np.float64))
    _assert_close(out, ref, _order_bound(x, q, 640 + 640 // g + 5) + 2.0**-7 * ref64)
    # and nearer the reference than the bf16 form (which rounds every activation to 8 bits)
    same_f32, same_b16 = (float(np.mean(np.asarray(y) == np.asarray(ref))) for y in (out, jax.jit(b16)(x, q)))
    assert same_f32 > 0.95 and same_f32 > same_b16, (same_f32, same_b16)


def _dot_out_shapes(f, *args) -> list[tuple]:
    return [tuple(e.outvars[0].aval.shape) for e in _eqns(jax.make_jaxpr(f)(*args).jaxpr)
            if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("m", [2, 16, 128, 129])
def test_float32_wide_form_puts_the_weight_on_the_left_up_to_128_rows(m):
    """bf16_dot=False "wide": up to LHS_MAX_M rows the float32 levels are the GEMM's left operand (W . x^T, its
    [N, M] product transposed back), beyond it and with bf16 hardware the activations are (x . W^T); on exact data
    (levels and activations that make every product and float32 sum exact) the same bits as the reference, and the
    compiled program keeps the [N, M] product (the barrier: XLA otherwise folds the transpose into x . W^T)."""
    import re

    from gemmajax.quant.int8_matmul import LHS_MAX_M
    assert LHS_MAX_M == 128
    rng = np.random.default_rng(m)
    n, k = 384, 256
    wi, xi = rng.integers(-127, 128, (n, k)), rng.integers(-127, 128, (m, k))
    wi[:, 0], xi[:, ::128] = 127, 127  # every row's and every activation group's maximum 127: scales 1/127 and 1
    q = quantize(jnp.asarray(wi / 127.0, jnp.float32), "int8", act_group=128)
    x = jnp.asarray(xi, jnp.bfloat16)
    f32 = lambda x, q: int8_matmul_xla(x, q, form="wide", bf16_dot=False)
    b16 = lambda x, q: int8_matmul_xla(x, q, form="wide", bf16_dot=True)
    assert _dot_out_shapes(f32, x, q) == [(n, m) if m <= 128 else (m, n)]
    assert _dot_out_shapes(b16, x, q) == [(m, n)]
    np.testing.assert_array_equal(np.asarray(jax.jit(f32)(x, q)), np.asarray(int8_matmul_ref(x, q)))
    if m <= 128:
        txt = jax.jit(f32).lower(x, q).compile().as_text()
        assert re.search(rf"= f32\[{n},{m}\]\S* (?:dot|fusion)\(", txt), "the left-operand product was folded back"


@pytest.mark.parametrize("flag", ["0", "1"])
def test_cpu_int8_matmul_follows_the_cpus_bf16_hardware(monkeypatch, flag):
    """int8_matmul on the CPU (impl "auto" and "xla") takes "wide" in bf16 only where the CPU has bf16 hardware
    (cpu_features.native_bf16_dot, here forced by GEMMAJAX_CPU_BF16_DOT): the bits of the matching bf16_dot. It is
    read when traced, and JAX reuses a platform_dependent branch's trace for the same shapes, so each flag gets its
    own row count."""
    monkeypatch.setenv("GEMMAJAX_CPU_BF16_DOT", flag)
    x, _, q = _grouped(16 + int(flag), 640, 256, 128, seed=5, xdtype=jnp.bfloat16, outliers=True)
    want = {b: np.asarray(jax.jit(lambda x, q, b=b: int8_matmul_xla(x, q, form="wide", bf16_dot=b))(x, q))
            for b in (False, True)}
    assert not np.array_equal(want[False], want[True])
    for impl in ("auto", "xla"):
        got = np.asarray(jax.jit(lambda x, q, i=impl: int8_matmul(x, q, i))(x, q))
        assert np.array_equal(got, want[flag == "1"]), impl


@pytest.mark.parametrize("m,n,g,dt,want", [
    (2, 256, 128, jnp.bfloat16, "wide"), (16, 256, 128, jnp.bfloat16, "wide"),   # small grouped weight: from 2 rows
    (16, 8192, 128, jnp.bfloat16, "int"),    # its bf16 copy (10.5 MB) over WIDE_SMALL_MAX_BYTES: the group loop
    (16, 256, 0, jnp.bfloat16, "int"), (63, 256, 0, jnp.bfloat16, "int"),       # no groups: one int8 GEMM ...
    (64, 256, 0, jnp.bfloat16, "wide"), (69, 8192, 128, jnp.bfloat16, "wide"),  # ... until WIDE_MIN_ROWS, any size
    (16, 256, 128, jnp.float32, "int"), (64, 256, 0, jnp.float32, "int")])      # float32 x: never "wide"
def test_auto_form_by_rows_size_and_dtype(m, n, g, dt, want):
    """w8a8 on several rows: auto gives exactly the bits of the form it should pick (int8_matmul.wide_pays; one row:
    the next test). With groups the two forms round differently, so the comparison tells them apart; without, both
    give the same bits (exact levels and sums), and the program tells them apart."""
    from gemmajax.quant.int8_matmul import WIDE_MIN_ROWS, WIDE_SMALL_MAX_BYTES, wide_pays
    assert 2 * 256 * 640 <= WIDE_SMALL_MAX_BYTES < 2 * 8192 * 640 and WIDE_MIN_ROWS == 64  # the cases' premises
    if dt == jnp.bfloat16:
        assert wide_pays(m, n, 640, g) == (want == "wide")
    x, _, q = _grouped(m, 640, n, g, seed=m + n, xdtype=dt, outliers=True)
    got = {f: np.asarray(jax.jit(lambda x, q, f=f: int8_matmul_xla(x, q, form=f))(x, q).astype(jnp.float32))
           for f in ("auto", "int", "wide")}
    other = "int" if want == "wide" else "wide"
    assert np.array_equal(got["auto"], got[want]), (m, n, g, dt)
    if g:
        assert not np.array_equal(got["auto"], got[other]), (m, n, g, dt)
    # the bits cannot tell the forms apart without groups: the program can ("int" is an int8 x int8 -> int32 dot)
    jaxpr = str(jax.make_jaxpr(lambda x, q: int8_matmul_xla(x, q))(x, q))
    assert ("preferred_element_type=int32" in jaxpr) == (want == "int"), (m, n, g, dt)


@pytest.mark.parametrize("m,n,g,want", [
    (2, 256, 128, "wide"), (16, 256, 128, "wide"),  # a small grouped weight: its float32 copy is 655 KB
    (16, 4096, 128, "wide"),  # float32 copy 10.5 MB (Gemma 3 270M's gate and up joined): under the float32 limit
    (16, 6144, 128, "int"),   # float32 copy 15.7 MB, over WIDE_SMALL_MAX_F32_BYTES (its bf16 copy, 7.9 MB, is under)
    (64, 8192, 128, "wide"),  # from WIDE_MIN_ROWS any grouped weight
    (64, 256, 0, "int"), (128, 256, 0, "int")])     # no groups: one int8 GEMM at any row count
def test_auto_form_without_bf16_hardware(m, n, g, want):
    """bf16_dot=False: auto is the form wide_pays picks, "wide" only for a grouped weight, its
    small-weight limit counting the float32 copy (the bf16 rule would take "wide" for the 6144-row weight)."""
    from gemmajax.quant.int8_matmul import WIDE_SMALL_MAX_F32_BYTES, wide_pays
    assert 4 * 4096 * 640 <= WIDE_SMALL_MAX_F32_BYTES < 4 * 6144 * 640  # the cases' premise
    assert wide_pays(m, n, 640, g, bf16_dot=False) == (want == "wide")
    if (m, n) == (16, 6144):
        assert wide_pays(m, n, 640, g, bf16_dot=True)
    x, _, q = _grouped(m, 640, n, g, seed=m + n + 1, xdtype=jnp.bfloat16, outliers=True)
    got = {f: np.asarray(jax.jit(lambda x, q, f=f: int8_matmul_xla(x, q, form=f, bf16_dot=False))(x, q)
                         .astype(jnp.float32)) for f in ("auto", want)}
    assert np.array_equal(got["auto"], got[want]), (m, n, g)
    # float32 "wide" is near enough the integers that the bf16 outputs can coincide: the program tells them apart
    dots = _dot_operand_dtypes(lambda x, q: int8_matmul_xla(x, q, bf16_dot=False), x, q)
    assert dots == (["float32,float32"] if want == "wide" else ["int8,int8"]), (m, n, g, dots)


def test_group_auto_form_by_width():
    """One row: the dequantized-activation "vector" fusion up to in 3072, the group loop ("int") beyond it, where
    XLA:CPU's one-row fusion stops streaming (int8_matmul.py); both agree with the reference."""
    for k, loop in ((640, False), (4096, True)):
        x, _, q = _grouped(1, k, 64, 128, seed=k, outliers=True)
        f = jax.jit(lambda x, q: int8_matmul_xla(x, q))
        assert ("while" in f.lower(x, q).as_text()) == loop, k
        _assert_close(f(x, q), int8_matmul_ref(x, q), _order_bound(x, q, k + k // 128 + 5))


def test_group_dispatch_impls():
    x, _, q = _grouped(3, 640, 1000, 128, seed=12, outliers=True)
    ref = int8_matmul_ref(x, q)
    for impl in ("auto", "xla"):  # "pallas_interpret" runs the kernel tested above
        _assert_close(jax.jit(lambda x, q, i=impl: int8_matmul(x, q, i))(x, q), ref,
                      _order_bound(x, q, 2 * (640 // 128 + 2)))


def test_groups_cut_the_error_of_outlier_activations():
    """With outlier channels, the per-group result is far closer to the float matmul than the per-token one, and
    within the derived bound: per output, sum_g sum_{k in g} |x_k| aw_n / 254 + ax_g |w_nk| / 254 + ax_g aw_n / 254**2
    (ax_g = max |x| over the token's group g, aw_n = max |w_n|; round to nearest)."""
    x, w, q = _grouped(16, 640, 1000, 128, seed=13, outliers=True)
    yf = np.asarray(jnp.dot(x, w.T, precision="highest"), np.float64)
    err_g = np.abs(np.asarray(int8_matmul_ref(x, q), np.float64) - yf)
    err_t = np.abs(np.asarray(int8_matmul_ref(x, dataclasses.replace(q, act_group=0)), np.float64) - yf)
    xa, wa = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64))
    ax = np.repeat(xa.reshape(16, 5, 128).max(-1), 128, axis=1)  # [M, K]: the max of each column's group
    aw = wa.max(1)[None, :]
    bound = xa.sum(1)[:, None] * aw / 254 + ax @ wa.T / 254 + ax.sum(1)[:, None] * aw / 254**2
    assert np.all(err_g <= bound * (1 + 1e-4) + 1e-6)
    # rounding errors scale with the step: per token every column gets the outliers' coarse step, per group only
    # the 128 columns of their group, so the error norm should shrink to about sqrt(128 / 640) = 0.45 of it
    assert np.linalg.norm(err_g) < 0.6 * np.linalg.norm(err_t), (np.linalg.norm(err_g), np.linalg.norm(err_t))


def test_act_group_metadata():
    w = _data(1, 640, 64)[1]
    q = quantize(w, "int8", act_group=128)
    assert q.act_group == 128 and np.array_equal(np.asarray(q.values), np.asarray(quantize(w, "int8").values))
    assert quantize(w, "int8").act_group == 0  # the default: one scale per token, as before
    a = QuantArray.abstract((64, 640), "int8", act_group=128)
    assert a == abstract_quant((64, 640), "int8", act_group=128) and a.act_group == 128
    # static metadata: part of the tree structure, kept by jit and by indexing expert stacks
    assert jax.tree.structure(q) != jax.tree.structure(quantize(w, "int8"))
    assert jax.jit(lambda q: q)(q).act_group == 128
    assert quantize(jnp.stack([w, w]), "int8", act_group=64)[1].act_group == 64
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(w, "int8", act_group=48)
    with pytest.raises(ValueError, match="does not divide"):
        quantize(w, "int8", act_group=96)  # 640 = 6 * 96 + 64
    with pytest.raises(ValueError, match="int8"):
        quantize(w, "int4", act_group=128)


def test_w8a8_loading_default():
    """Projections get G = 128 where it divides `in` (else per token); tables stay per token."""
    from gemmajax.quant.loading import Quantizer

    assert default_act_group(640) == 128 and default_act_group(2112) == 0 and default_act_group(64) == 0
    qz = Quantizer("w8a8+emb8")
    assert qz("model.layers.0.mlp.down_proj.weight", jnp.ones((8, 256))).act_group == 128
    assert qz("model.layers.0.mlp.down_proj.weight", jnp.ones((8, 320))).act_group == 0
    assert qz("embed_tokens.weight", jnp.ones((30, 256))).act_group == 0
    assert Quantizer("w4a16")("model.layers.0.mlp.up_proj.weight", jnp.ones((8, 256))).act_group == 0


def test_loader_pads_unaligned_int8_rows_to_128_columns():
    """w8a8 loading pads a projection whose `in` is not a multiple of 128 (26B-A4B's down_proj, 2112) with zero
    columns to the next multiple: the same integer products (the reference and the kernel on the padded weight give
    the reference's bits on the unpadded one; the XLA form gives the same bits on both), the same activation scales
    (act_group from the real width), and aligned rows keep their width."""
    from gemmajax.quant.loading import make_quantizer

    rng = np.random.default_rng(5)
    qz = make_quantizer("w8a8")
    w = jnp.asarray(rng.standard_normal((96, 200)) * 0.05, jnp.float32)
    padded = qz("model.layers.0.mlp.down_proj.weight", w)
    plain = quantize(w, "int8", act_group=default_act_group(200))
    assert padded.padded_in == 256 and padded.in_features == 200 and padded.act_group == plain.act_group == 0
    assert np.array_equal(np.asarray(padded.values[:, :200]), np.asarray(plain.values))
    assert not np.any(np.asarray(padded.values[:, 200:]))
    for m in (1, 7):
        x = jnp.asarray(rng.standard_normal((m, 200)), jnp.float32)
        want = np.asarray(int8_matmul_ref(x, plain))
        assert np.array_equal(np.asarray(int8_matmul_ref(x, padded)), want)
        assert np.array_equal(np.asarray(int8_matmul_pallas(x, padded, interpret=pltpu.InterpretParams())), want)
        assert np.array_equal(np.asarray(int8_matmul_xla(x, padded)), np.asarray(int8_matmul_xla(x, plain)))
    aligned = qz("model.layers.0.self_attn.q_proj.weight", w[:, :128])
    assert aligned.padded_in == 128 and aligned.act_group == 128
