"""w4a16 matmul: int4 weights in groups along `in` (bf16/f32 scale per group), activations unquantized in the model's
dtype ("a16": bf16 models multiply in bf16, float32 models in float32), f32 accumulation.

Design choices: the weight stays in the row-major half-split layout of array.py (byte j of a row holds columns j
and j + in_p/2), so the kernel multiplies the two halves of x by the low and high nibbles: no lane interleave.
On TPU the group scale runs along lanes, which the VPU handles badly; the kernel therefore transposes each
unpacked tile in VMEM (XLU) so that groups run along sublanes, where the scale is a cheap sublane broadcast
(static LLO bundle counts per 256 x 1024 weights on v5e: 679 this way, 5,929 with a lane-wise repeat, 504 for a
K-major copy of the weight that gathers and the CPU could not use). Projection, not measurement: the decode step
(16 x 512 x 768-byte tiles) is 2.4 static bundles per 1,024 weights on v5e and v6e, against 0.6 cycles to stream
their 512 bytes from v5e HBM: int4 is VPU-bound near 25 % of HBM bandwidth, like the 33 % the anchors measured for
vLLM-TPU's W4A16 (int8 w8a8: 0.45-0.53 bundles per 1,024 weights, under its 1.2 cycles of HBM: bandwidth-bound).
Every path multiplies the activations in their compute dtype (`_compute_dtype`: bf16 for bf16 x, float32 otherwise,
never rounded) by the weight bf16(level * scale) (array.py: the stored weight is that bf16 number, exact in both
dtypes) and accumulates in f32, so all paths compute the same products and a float32 model with exactly repacked
QAT weights gives the unquantized float32 model's logits.

CPU forms (bench/kernels_matmul.py, same run and caveats as the int8 table: load 7.5-8, ms, min of round-robin calls):

| in x out     | M  | "rows"   | "shared" | "dense"  | int8 w8a8 (its chosen form) |
|--------------|----|----------|----------|----------|-----------------------------|
| 640 x 2048   | 1  | **0.29** | -        | 0.64     | 0.10                        |
| 640 x 2048   | 16 | 2.15     | 1.47     | **1.12** | 0.46                        |
| 1536 x 6144  | 1  | **1.45** | -        | 57.2     | 0.54                        |
| 1536 x 6144  | 16 | **28.0** | 96.8     | 70.7     | 1.78                        |
| 640 x 262144 | 1  | **108**  | -        | 663      | 27.2                        |
| 640 x 262144 | 16 | 785      | -        | **575**  | 229                         |

and rows / dense at 1536 x 6144 for M = 32, 64, 128: 64 / 58, 115 / 74, 221 / 96. "rows" is one matrix-vector pass
per row, `dot(x_lo, W_lo.T) + dot(x_hi, W_hi.T)` with unpack, scale and bf16 rounding fused into each dot (the two
dots kept apart by an optimization barrier, else XLA fuses the add into the second one and materializes its
weight); "shared" dequantizes once to float32 and runs the rows on that copy; "dense" runs one GEMM per 8,192-row
float32 chunk. The bf16 rounding of each weight (exactness) costs about 1.6x in the one-row form; int4 on the CPU
is a memory format, w8a8 is the fast one.

Since then, "bf16": a loop over 4,096-row chunks, each dequantized to bf16 (exact) for a native bf16 x bf16 -> f32
GEMM (YNNPACK), so no float32 copy and a chunk still in cache. Measured by bench/kernels.py's method (2 shared
cores, load 5.5-6.5, ms, min of 5 round-robin calls; rows in parentheses extrapolated from M = 4):

| in x out     | M  | "rows"    | "dense" | "bf16"    |
|--------------|----|-----------|---------|-----------|
| 640 x 2048   | 4  | **0.88**  | 1.29    | 1.04      |
| 640 x 2048   | 8  | 1.74      | **1.09**| 1.12      |
| 640 x 2048   | 16 | 3.30      | 2.02    | **1.81**  |
| 2048 x 640   | 16 | 2.94      | 1.78    | **1.26**  |
| 640 x 262144 | 4  | **124**   | 316     | 262       |
| 640 x 262144 | 8  | (~240)    | 361     | 276       |
| 640 x 262144 | 16 | (~480)    | 377     | **276**   |

"auto": rows up to 4 rows, or up to 8 rows of a weight of 2 MiB packed or more; else "bf16" (bf16 activations)
or "dense" (float32 activations: not measured for speed; the only float32 GEMM form, exact float32 products).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gemmajax.quant.array import QuantArray
from gemmajax.quant.int8_matmul import materialize
from gemmajax.quant.quantize import dequantize

_ROW_LOOP_MAX_M = 4  # CPU: up to this many rows, M one-row fusions beat dequantize-to-bf16 + GEMM ...
_ROW_LOOP_MAX_M_BIG = 8  # ... and up to this many on weights of 2 MiB packed or more (measured crossovers)
_ROW_LOOP_MIN_BYTES = 2 << 20


def _check(x: jax.Array, w: QuantArray) -> None:
    if not isinstance(w, QuantArray) or w.kind != "int4" or w.ndim != 2:
        raise ValueError(f"int4 matmul needs a 2-D int4 QuantArray [out, in], got {w!r}")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"int4 matmul: x has {x.shape[-1]} features, weight {w.shape} expects {w.in_features}")


def _compute_dtype(x: jax.Array) -> jnp.dtype:
    """The dtype activations and dequantized weights multiply in: bf16 for bf16 x (the fast native products),
    float32 for anything else (float32 models keep float32 activations; other floats widen exactly)."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(x.dtype) == jnp.bfloat16 else jnp.dtype(jnp.float32)


def _precision(cd: jnp.dtype):
    """HIGHEST for float32 products (accelerators would otherwise run float32 dots in bf16 / TF32 passes)."""
    return lax.Precision.HIGHEST if cd == jnp.float32 else None


def _pad_x(x2: jax.Array, w: QuantArray) -> jax.Array:
    """x [M, in] -> [M, in_p] in the compute dtype (zero columns for the padded groups)."""
    xb = x2.astype(_compute_dtype(x2))
    return jnp.pad(xb, ((0, 0), (0, w.padded_in - w.in_features))) if w.padded_in != w.in_features else xb


def _finish(y: jax.Array, x: jax.Array, w: QuantArray) -> jax.Array:
    return y[:, : w.out_features].reshape(*x.shape[:-1], w.out_features).astype(x.dtype)


# --- reference ------------------------------------------------------------------------------------------------------
def int4_matmul_ref(x: jax.Array, w: QuantArray) -> jax.Array:
    """w4a16 reference: dot(x, dequantize(w).T) in the compute dtype (bf16 for bf16 x, else float32: x is never
    rounded) with f32 accumulation. x [..., in] -> [..., out] in x.dtype."""
    _check(x, w)
    cd = _compute_dtype(x)
    x2 = x.reshape(-1, x.shape[-1]).astype(cd)
    y = jnp.dot(x2, dequantize(w, cd).T, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    return y.reshape(*x.shape[:-1], w.out_features).astype(x.dtype)


# --- Pallas TPU kernel ----------------------------------------------------------------------------------------------
def _dequant_t(wt: jax.Array, s: jax.Array, group: int, cd) -> jax.Array:
    """Levels (int32 [tkp, tn], biased 0..15) and scales (f32 [tkp // group, tn]) -> weights^T [tkp, tn] in the
    compute dtype cd, holding bf16(level * scale)."""
    tkp, tn = wt.shape
    q = (wt - 8).astype(jnp.float32).reshape(tkp // group, group, tn)
    wb = (q * s[:, None, :]).reshape(tkp, tn).astype(jnp.bfloat16)
    return wb if cd == jnp.bfloat16 else wb.astype(cd)


def _int4_kernel(xl_ref, xh_ref, w_ref, s_ref, o_ref, st_ref, *acc, nk: int, group: int):
    """One (i, j, k) step.

    xl / xh [tm, tkp] bf16 or f32 (the compute dtype): columns k*tkp.. of the low / high half of x; w [tn, tkp]
    uint8; s [tn, G] scales of the whole rows (fetched once per j); o [tm, tn]; st [2, G/2, tn] f32 scratch: the
    scales transposed.
    """
    k = pl.program_id(2)
    g2 = st_ref.shape[1]

    @pl.when(k == 0)
    def _():
        s = s_ref[...].astype(jnp.float32)
        st_ref[0] = s[:, :g2].T
        st_ref[1] = s[:, g2:].T

    tkp = w_ref.shape[1]
    gk = tkp // group
    if nk == 1:
        s_lo, s_hi = st_ref[0], st_ref[1]
    else:
        start = pl.multiple_of(k * gk, gk)
        s_lo, s_hi = st_ref[0, pl.ds(start, gk), :], st_ref[1, pl.ds(start, gk), :]
    cd = jnp.dtype(xl_ref.dtype)
    wt = w_ref[...].astype(jnp.int32).T  # [tkp, tn]: groups now run along sublanes
    lo = _dequant_t(wt & 15, s_lo, group, cd)
    hi = _dequant_t(wt >> 4, s_hi, group, cd)
    prec = _precision(cd)
    part = (jnp.dot(xl_ref[...], lo, preferred_element_type=jnp.float32, precision=prec)
            + jnp.dot(xh_ref[...], hi, preferred_element_type=jnp.float32, precision=prec))
    if nk == 1:
        o_ref[...] = part.astype(o_ref.dtype)
        return
    (acc_ref,) = acc

    @pl.when(k == 0)
    def _():
        acc_ref[...] = part

    @pl.when(k > 0)
    def _():
        acc_ref[...] += part

    @pl.when(k == nk - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def int4_blocks(m: int, n: int, half: int, group: int) -> tuple[int, int, int, int]:
    """(tm, tn, tkp, m_padded) for x [m, 2*half] against w [n, half] bytes. tkp (bytes per half) is a multiple
    of 128 that divides `half` and holds a multiple of 8 groups, or the whole half."""
    if m <= 256:
        mp = -(-m // 16) * 16
        tm = mp
    else:
        tm = 256
        mp = -(-m // tm) * tm
    tn = next((t for t in (512, 256, 128) if n % t == 0), n)  # v5e bundles per 1024 weights: 2.36 / 2.55 / 3.14
    tkp = next((t for t in range(1024, 127, -128) if half % t == 0 and (t // group) % 8 == 0), half)
    return tm, tn, tkp, mp


def int4_matmul_pallas(x: jax.Array, w: QuantArray, *, interpret=False, blocks=None) -> jax.Array:
    """Pallas TPU w4a16. x [..., in] float, w int4 QuantArray [out, in] -> [..., out] in x.dtype. bf16 x multiplies
    in bf16 (the serving case), any other x in float32 (a float32 model: unrounded activations, HIGHEST precision).

    interpret: False | True | pltpu.InterpretParams(...). blocks: optional (tm, tn, tkp) override.
    """
    _check(x, w)
    x2 = _pad_x(x.reshape(-1, x.shape[-1]), w)
    m = x2.shape[0]
    n, half, group = w.padded_out, w.padded_in // 2, w.group
    g = w.padded_in // group
    tm, tn, tkp, mp = int4_blocks(m, n, half, group)
    if blocks is not None:
        tm, tn, tkp = blocks
        mp = -(-m // tm) * tm
        if (n % tn or half % tkp or tm % 16 or (tn % 128 and tn != n) or (tkp % 128 and tkp != half)
                or (tkp != half and (tkp // group) % 8)):
            raise ValueError(f"int4_matmul_pallas: blocks {blocks} do not tile x [{m}, {2 * half}] @ w [{n}, {half} "
                             f"bytes].T (tm % 16; tn | {n}, tn % 128; tkp | {half}, tkp % 128 with a multiple of 8 "
                             f"groups; or the whole dimension)")
    if mp != m:
        x2 = jnp.pad(x2, ((0, mp - m), (0, 0)))
    nk = half // tkp
    if tkp % 128 == 0:  # both halves are blocks of the one x array
        xs = (x2, x2)
        x_specs = [pl.BlockSpec((tm, tkp), lambda i, j, k: (i, k)),
                   pl.BlockSpec((tm, tkp), lambda i, j, k: (i, k + nk))]
    else:  # a half that is not lane-aligned: split x (a copy of the activations only)
        xs = (x2[:, :half], x2[:, half:])
        x_specs = [pl.BlockSpec((tm, tkp), lambda i, j, k: (i, k))] * 2
    out_dtype = x.dtype
    ob = jnp.dtype(out_dtype).itemsize
    sb = jnp.dtype(w.scale.dtype).itemsize
    xb = jnp.dtype(x2.dtype).itemsize
    vmem = (2 * (2 * tm * tkp * xb + tn * tkp + tn * g * sb + tm * tn * ob) + g * tn * 4
            + (tm * tn * 4 if nk > 1 else 0) + 6 * tkp * tn * 4)  # + int32 / f32 temporaries of the dequant
    y = pl.pallas_call(
        functools.partial(_int4_kernel, nk=nk, group=group),
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid=(mp // tm, n // tn, nk),
        in_specs=x_specs + [
            pl.BlockSpec((tn, tkp), lambda i, j, k: (j, k)),
            pl.BlockSpec((tn, g), lambda i, j, k: (j, 0)),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((2, g // 2, tn), jnp.float32)]
        + ([pltpu.VMEM((tm, tn), jnp.float32)] if nk > 1 else []),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=int(min(max(2 * vmem, 32 << 20), 100 << 20))),
        cost_estimate=pl.CostEstimate(flops=2 * mp * n * 2 * half, transcendentals=0,
                                      bytes_accessed=n * half + n * g * sb + (n // tn) * mp * 2 * half * xb
                                      + mp * n * ob),
        interpret=interpret,
        name="int4_matmul",
    )(*xs, w.values, w.scale)
    return _finish(y[:m], x, w)


# --- XLA paths ------------------------------------------------------------------------------------------------------
def _round_bf16(v: jax.Array) -> jax.Array:
    """Round finite float32 to the nearest bf16 (ties to even), staying float32: the same bits as
    v.astype(bf16).astype(f32), in four integer ops that XLA:CPU runs 1.2x faster inside the dot fusion."""
    b = lax.bitcast_convert_type(v, jnp.uint32)
    b = (b + jnp.uint32(0x7FFF) + ((b >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(b, jnp.float32)


def _half_weight(v: jax.Array, s: jax.Array, group: int) -> jax.Array:
    """Biased nibbles uint8 [N, H] and their scales [N, H // group] -> float32 [N, H] holding bf16(level * s)."""
    n, h = v.shape
    q = v.astype(jnp.float32) - 8.0
    return _round_bf16((q.reshape(n, h // group, group) * s.astype(jnp.float32)[:, :, None]).reshape(n, h))


def _one_row(x1: jax.Array, w: QuantArray, separate: bool) -> jax.Array:
    """x1 f32 [1, in_p] (bf16 values for a bf16 model) -> f32 [1, N] in two fused matrix-vector dots over the packed
    weight.

    separate: give this row its own copy of the weight's inputs; without it XLA merges the identical weight
    transforms of several rows (CSE) and materializes one float32 copy of the weight for all of them."""
    half, g2 = w.padded_in // 2, w.scale.shape[-1] // 2
    v, s = w.values, w.scale
    if separate:
        x1, v, s = lax.optimization_barrier((x1, v, s))
    lo = jnp.dot(x1[:, :half], _half_weight(v & 15, s[:, :g2], w.group).T)
    hi = jnp.dot(x1[:, half:], _half_weight(v >> 4, s[:, g2:], w.group).T)
    lo, hi = lax.optimization_barrier((lo, hi))  # keep the add out of the second dot's fusion
    return lo + hi


def _dense_weight(w: QuantArray) -> jax.Array:
    """float32 [N, in_p] holding bf16(level * scale) (the whole weight, materialized)."""
    g2 = w.scale.shape[-1] // 2
    return jnp.concatenate([_half_weight(w.values & 15, w.scale[:, :g2], w.group),
                            _half_weight(w.values >> 4, w.scale[:, g2:], w.group)], axis=1)


_DENSE_CHUNK = 8192  # rows of the weight dequantized at a time by the "dense" form (bounds its f32 copy)
_BF16_CHUNK = 4096  # rows per bf16 chunk of the "bf16" form: 5 MiB at in 640, so a chunk is still in cache for its GEMM
_NT = (((1,), (1,)), ((), ()))  # contract x[M, K] with w[N, K] over K


def _bf16_weight(v: jax.Array, s: jax.Array, group: int) -> jax.Array:
    """Packed rows uint8 [n, in_p / 2] and their scales -> bf16 [n, in_p] (exact: every int4 weight is a bf16
    number)."""
    g2 = s.shape[-1] // 2
    return jnp.concatenate([_half_weight(v & 15, s[:, :g2], group),
                            _half_weight(v >> 4, s[:, g2:], group)], axis=1).astype(jnp.bfloat16)


def _bf16_chunks(xb: jax.Array, w: QuantArray) -> jax.Array:
    """xb bf16 [M, in_p] -> f32 [M, N]: chunks of rows dequantized to bf16 and multiplied by a native bf16 x bf16 ->
    f32 GEMM (XLA:CPU hands it to YNNPACK): the reference's products exactly, summed in another order. A loop over
    row chunks keeps each bf16 chunk in cache (unrolled chunks were fused into one whole-table copy)."""
    n = w.padded_out
    if n <= _BF16_CHUNK or n % _BF16_CHUNK:
        return lax.dot_general(xb, _bf16_weight(w.values, w.scale, w.group), _NT, preferred_element_type=jnp.float32)
    c = n // _BF16_CHUNK

    def chunk(i, yt):
        v = lax.dynamic_slice_in_dim(w.values, i * _BF16_CHUNK, _BF16_CHUNK, 0)
        sc = lax.dynamic_slice_in_dim(w.scale, i * _BF16_CHUNK, _BF16_CHUNK, 0)
        part = lax.dot_general(_bf16_weight(v, sc, w.group), xb, _NT, preferred_element_type=jnp.float32)  # [C, M]
        return lax.dynamic_update_slice_in_dim(yt, part, i * _BF16_CHUNK, 0)

    yt = lax.fori_loop(0, c, chunk, jnp.zeros((n, xb.shape[0]), jnp.float32))
    return yt.T


def int4_matmul_xla(x: jax.Array, w: QuantArray, *, form: str = "auto") -> jax.Array:
    """XLA w4a16 (CPU). x [..., in], w int4 QuantArray [out, in] -> [..., out] in x.dtype. form:
      "rows"   one fused matrix-vector pass per row of x, reading the packed weight (no copy of it);
      "shared" one float32 copy of the weight, then a matrix-vector pass per row;
      "dense"  float32 copies of 8,192-row chunks of the weight, one GEMM each;
      "bf16"   bf16 copies of 4,096-row chunks (exact), one native bf16 GEMM (YNNPACK) each: bf16 x only;
      "auto"   "rows" up to 4 rows, or up to 8 rows of a weight of 2 MiB packed or more; else "bf16" for bf16 x,
               "dense" for float32 x (measured crossovers; module docstring).
    The float32 forms ("rows", "shared", "dense") multiply float32 copies of the activations (bf16 values for bf16
    x, x itself otherwise) by the bf16-valued weight: the reference's products for either dtype.
    """
    _check(x, w)
    xb = _pad_x(x.reshape(-1, x.shape[-1]), w)
    m = xb.shape[0]
    act16 = xb.dtype == jnp.bfloat16
    if form == "auto":
        rows_max = _ROW_LOOP_MAX_M_BIG if w.values.size >= _ROW_LOOP_MIN_BYTES else _ROW_LOOP_MAX_M
        form = "rows" if m <= rows_max else "bf16" if act16 else "dense"
    if form == "bf16":
        if not act16:
            raise ValueError(f"int4_matmul_xla: form 'bf16' multiplies bf16 activations, x is {x.dtype} (rounding it "
                             f"would change the float32 model's products); use 'dense' or 'auto'")
        return _finish(_bf16_chunks(xb, w), x, w)
    x2 = materialize(xb.astype(jnp.float32))
    if form == "rows":
        y = jnp.concatenate([_one_row(x2[i:i + 1], w, separate=m > 1) for i in range(m)], axis=0)
    elif form == "shared":
        wd = lax.optimization_barrier(_dense_weight(w))
        y = jnp.concatenate([jnp.dot(x2[i:i + 1], wd.T) for i in range(m)], axis=0)
    elif form == "dense":
        n = w.padded_out
        if n > _DENSE_CHUNK and n % _DENSE_CHUNK == 0:
            c = n // _DENSE_CHUNK
            parts = lax.map(lambda vs: jnp.dot(x2, _dense_weight(dataclasses.replace(
                w, values=vs[0], scale=vs[1], shape=(_DENSE_CHUNK, w.in_features))).T,
                precision=lax.Precision.HIGHEST),
                (w.values.reshape(c, _DENSE_CHUNK, -1), w.scale.reshape(c, _DENSE_CHUNK, -1)))
            y = jnp.moveaxis(parts, 0, 1).reshape(m, n)
        else:
            y = jnp.dot(x2, _dense_weight(w).T, precision=lax.Precision.HIGHEST)
    else:
        raise ValueError(f"int4_matmul_xla: form must be 'auto', 'rows', 'shared', 'dense' or 'bf16', got {form!r}")
    return _finish(y, x, w)


def int4_matmul_gpu(x: jax.Array, w: QuantArray) -> jax.Array:
    """XLA w4a16 for GPUs: dequantize to the compute dtype (fused by XLA) and one GEMM with f32 accumulation (bf16 x
    bf16 for bf16 x; float32 at HIGHEST precision, not TF32, for float32 x)."""
    _check(x, w)
    x2 = _pad_x(x.reshape(-1, x.shape[-1]), w)
    cd = jnp.dtype(x2.dtype)
    y = jnp.dot(x2, _dense_weight(w).astype(cd).T, preferred_element_type=jnp.float32, precision=_precision(cd))
    return _finish(y, x, w)


def int4_matmul(x: jax.Array, w: QuantArray, impl: str = "auto") -> jax.Array:
    """w4a16 y = x @ w.T. x [..., in], w int4 QuantArray [out, in] -> [..., out] in x.dtype.

    impl: "auto" (decided at lowering time: Pallas for TPU, the GPU form for CUDA/ROCm, the CPU forms otherwise)
    | "xla" | "pallas" | "pallas_interpret".
    """
    if impl == "auto":
        return lax.platform_dependent(x, w, tpu=int4_matmul_pallas, cuda=int4_matmul_gpu, rocm=int4_matmul_gpu,
                                      default=int4_matmul_xla)
    if impl == "xla":
        return lax.platform_dependent(x, w, cuda=int4_matmul_gpu, rocm=int4_matmul_gpu, default=int4_matmul_xla)
    if impl == "pallas":
        return int4_matmul_pallas(x, w)
    if impl == "pallas_interpret":
        return int4_matmul_pallas(x, w, interpret=pltpu.InterpretParams())
    raise ValueError(f"int4_matmul: impl must be 'auto', 'xla', 'pallas' or 'pallas_interpret', got {impl!r}")
