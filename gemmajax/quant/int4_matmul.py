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

Short scales (QuantArray.short_scales, what quantize() gives since 2026-12-05): level * scale is exact in bf16, so
the forms skip the rounding (nibble * s - 8 s, one multiply-add). 2-core AMD EPYC, jax 0.10.2, load 0.5, min of 10-150
alternating calls, ms exact / short (bf16 weight beside it): LM head 262,144 x 640 1 row 11.5 / 9.7 (10.8), 16 rows
38.6 / 35.3 (41.3); 640 x 2048 1 row 0.087 / 0.075 (0.054); 640 x 1024 0.066 / 0.053 (0.041). A lone layer weight
stays in cache for bf16, so it wins there; the whole step (weights from memory) is what bench/compare_cpu.py judges.

"auto": rows up to 4 rows, or up to 8 rows of a weight of 2 MiB packed or more; else "bf16" (bf16 activations)
or "dense" (float32 activations: not measured for speed; the only float32 GEMM form, exact float32 products).

Since 2026-12-06 "auto" is "rows" for one row and "tiles" (the bf16 / dense forms above, one function) from two; on a
CPU without bf16 hardware (int4_matmul_cpu) activations of either dtype take float32 tiles, two per loop iteration,
each tile the GEMM's left operand (W . x^T) up to 128 rows (Zen 3, min ms: the 16-row head 60.3 this way, 87.6 with
x . W^T float32 tiles, the form before, 108.7 with bf16 tiles; 126 layer GEMMs at 16 rows 21.8 against 32.6; figures
by _F32_CONCURRENT and LHS_MAX_M; docs/cpu_notes_2026-12-06.md).

Since 2026-12-07 the engine gives a CPU's dense int4 weights the word layout (array.py: uint32, nibble i of word d is
column 8d + i; LLMEngine via int4_words_tree). "rows" is then one dot over the live columns whose loop broadcasts a
word to the 8 lanes of a vector and shifts lane i by 4i (per 8 weights: a broadcast load, a variable shift, a mask,
a convert, the scale's multiply-add and the product's), where the bytes take a shift, a mask and a byte-to-dword
widening per 8 weights in each of two dots (two horizontal sums per row). The tiles form dequantizes each tile in
natural order the same way, one GEMM per tile. Measured on the 2-core Zen 3 (AVX2), Gemma 3 270M's 126 layer GEMMs
chained and the 640 x 262,144 head, bytes against words, min ms of 12-15 alternating calls, load 1.6 from the
measurement itself (not quiet): 1 row layers 9.19 / 7.52, head 13.65 / 11.34 (bf16 9.31, 12.31); 16 rows layers
41.5 / 35.3, head 65.9 / 56.0 (bf16 52.5, 78.5). Two things XLA does to the tiles loop cost it 2-2.5x, and the code
undoes them: it hoists the lane shifts out of the loop as an array, which the dequantization then reads per element
in scalar code with a range check per shift (the shifts are given a data dependence XLA keeps and LLVM folds:
u + min(u, 0)); and it folds the transpose of a lone W . x^T product back into x . W^T, so YNNPACK repacks every
tile (an optimization barrier keeps the product's order; the byte form's two products meet in an add first).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gemmajax.cpu_features import native_bf16_dot
from gemmajax.quant.array import WORD, QuantArray, int4_to_halves
from gemmajax.quant.int8_matmul import LHS_MAX_M, after, after_init, materialize
from gemmajax.quant.quantize import dequantize

_ROW_LOOP_MAX_M = 1  # CPU: "rows" for one row only; from 2 rows the dequantized tiles cost no more (measured)


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


# Bytes of a weight block (tn x tkp): large blocks, whole rows where they fit. Measured on a TPU v5e at M = 16
# (bench/device_tpu_tiles.py, docs/device_tpu_v5e_tiles_2026-12-04.log): the kernel is VPU-bound near 200 GB/s and
# larger blocks shave the per-step cost, e.g. E2B gate / up [12288 x 1536] 179 GB/s at the old (512, 768) blocks,
# 198 at (4096, 768); down [1536 x 12288] 194 at (512, 1024), 220 at (512, 6144); 26B-A4B q [4096 x 2816] 192 at
# (512, 1408), 198-201 at (2048-4096, 1408). 3 MiB keeps the kernel's float32 dequantization temporaries (six of
# the block's size, 4 bytes each) within the 100 MiB VMEM limit it asks for.
_INT4_BLOCK_BYTES = 3 << 20
_INT4_MAX_TKP = 8192
_INT4_MAX_TN = 4096
# The default blocks keep the kernel's VMEM estimate (_int4_vmem) within this, under the 100 MiB the kernel asks for;
# blocks measured on the chip at M = 16 estimate up to 80.3 MiB ((16, 512, 6144), E2B down_proj's best).
_INT4_VMEM_BUDGET = 84 << 20


def _int4_vmem(tm: int, tn: int, tkp: int, groups: int, xb: int, ob: int, sb: int, nk: int) -> int:
    """VMEM bytes of one int4_matmul_pallas grid step: double-buffered x halves, weight, scales and output blocks,
    the transposed scales, the accumulator (nk > 1) and the dequantization's int32 / float32 temporaries."""
    return (2 * (2 * tm * tkp * xb + tn * tkp + tn * groups * sb + tm * tn * ob) + groups * tn * 4
            + (tm * tn * 4 if nk > 1 else 0) + 6 * tkp * tn * 4)


def _largest_tkp(half: int, group: int, limit: int) -> int | None:
    """The largest K block of a half-row, at most `limit` bytes, that the kernel can split by: a multiple of 128
    dividing `half` holding a multiple of 8 groups; None when there is none."""
    return next((t for t in range(limit // 128 * 128, 127, -128) if half % t == 0 and (t // group) % 8 == 0), None)


def _largest_tn(n: int, limit: int) -> int | None:
    """The largest multiple of 128 dividing n, at most `limit`; None when there is none."""
    return next((t for t in range(limit // 128 * 128, 127, -128) if n % t == 0), None)


def int4_blocks(m: int, n: int, half: int, group: int, xb: int = 2, ob: int = 2, sb: int = 2
                ) -> tuple[int, int, int, int]:
    """(tm, tn, tkp, m_padded) for x [m, 2*half] against w [n, half] bytes (xb / ob / sb: bytes of an activation,
    an output, a scale). tkp (bytes per half): the whole half up to _INT4_MAX_TKP, else the largest multiple of 128
    dividing it with a multiple of 8 groups; tn: the largest multiple of 128 dividing n within _INT4_MAX_TN and
    _INT4_BLOCK_BYTES // tkp (at least 128), or the whole n when 128 does not divide it (then tkp shrinks, where it
    can, until the block is within _INT4_BLOCK_BYTES). Then, while the step's VMEM (_int4_vmem: large row tiles of
    prefill, float32 activations) exceeds _INT4_VMEM_BUDGET, the larger of tkp / tn steps down to its next legal
    size."""
    if m <= 256:
        mp = -(-m // 16) * 16
        tm = mp
    else:
        tm = 256
        mp = -(-m // tm) * tm
    tkp = half if half <= _INT4_MAX_TKP else (_largest_tkp(half, group, _INT4_MAX_TKP) or half)
    tn = _largest_tn(n, max(128, min(_INT4_MAX_TN, _INT4_BLOCK_BYTES // tkp))) or n
    if tn == n and n * tkp > _INT4_BLOCK_BYTES:  # n not a multiple of 128 (one N block): split K instead
        tkp = _largest_tkp(half, group, _INT4_BLOCK_BYTES // n) or tkp
    groups = 2 * half // group
    while _int4_vmem(tm, tn, tkp, groups, xb, ob, sb, half // tkp) > _INT4_VMEM_BUDGET:
        k2 = _largest_tkp(half, group, tkp - 1)
        n2 = _largest_tn(n, tn - 1) if n % 128 == 0 else None
        if k2 is not None and (tkp >= tn or n2 is None):
            tkp = k2
        elif n2 is not None:
            tn = n2
        else:
            break
    return tm, tn, tkp, mp


def int4_matmul_pallas(x: jax.Array, w: QuantArray, *, interpret=False, blocks=None) -> jax.Array:
    """Pallas TPU w4a16. x [..., in] float, w int4 QuantArray [out, in] -> [..., out] in x.dtype. bf16 x multiplies
    in bf16 (the serving case), any other x in float32 (a float32 model: unrounded activations, HIGHEST precision).

    interpret: False | True | pltpu.InterpretParams(...). blocks: optional (tm, tn, tkp) override. A weight in the
    CPU word layout is repacked into half-split bytes first (traced by lax.platform_dependent on every platform).
    """
    _check(x, w)
    w = int4_to_halves(w)
    x2 = _pad_x(x.reshape(-1, x.shape[-1]), w)
    m = x2.shape[0]
    n, half, group = w.padded_out, w.padded_in // 2, w.group
    g = w.padded_in // group
    out_dtype = x.dtype
    ob = jnp.dtype(out_dtype).itemsize
    sb = jnp.dtype(w.scale.dtype).itemsize
    xb = jnp.dtype(x2.dtype).itemsize
    tm, tn, tkp, mp = int4_blocks(m, n, half, group, xb, ob, sb)
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
    vmem = _int4_vmem(tm, tn, tkp, g, xb, ob, sb, nk)
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
    v.astype(bf16).astype(f32), in integer ops (for float32 scales, whose products are already rounded once)."""
    b = lax.bitcast_convert_type(v, jnp.uint32)
    b = (b + jnp.uint32(0x7FFF) + ((b >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(b, jnp.float32)


_SPLIT = 65537.0  # 2**16 + 1: Veltkamp's splitter for 24 - 16 = 8 significant bits (bf16)


def _split_bf16(q: jax.Array, s: jax.Array) -> jax.Array:
    """bf16(q * s) as float32, for levels q (float32 integers in -8..7) and bf16 scales s (as float32), in three
    float ops per weight: q * s is exact (at most 12 significant bits), t = q * (s * (2**16 + 1)) (s * (2**16 + 1)
    exact, once per group), and t - (t - q * s) is q * s rounded to 8 significant bits (Veltkamp's split), to nearest
    with ties to even: checked for every level and every bf16 mantissa (tests/quant/test_int4_matmul.py). XLA:CPU
    contracts t - q * s into one FMA, which gives the same bits because q * s is exact. It replaces a multiply and
    five integer ops per weight in the inner loops of the CPU forms (module docstring)."""
    t = q * (s * _SPLIT)
    return t - (t - q * s)


def _levels(v: jax.Array) -> jax.Array:
    """Biased nibbles (uint8, 0..15) -> their levels v - 8 as float32, through the bits of 2**23 + v (a widening and
    an or, then one subtraction: XLA:CPU's uint8 -> float32 convert costs more in the tile loops)."""
    b = lax.bitcast_convert_type(v.astype(jnp.uint32) | jnp.uint32(0x4B000000), jnp.float32)
    return b - jnp.float32(2.0 ** 23 + 8.0)


def _half_weight(v: jax.Array, s: jax.Array, group: int, short: bool = False) -> jax.Array:
    """Biased nibbles uint8 [N, H] and their scales [N, H // group] -> float32 [N, H] holding bf16(level * s).

    short (QuantArray.short_scales): level * s is already a bf16 number, so no rounding: the nibble converted and
    one multiply-add, nibble * s - 8 * s (each product exact, the sum exact: it is level * s). Else the rounding:
    Veltkamp's split for bf16 scales, integer rounding for float32 ones."""
    n, h = v.shape
    return _scaled(v.reshape(n, h // group, group), s, s.astype(jnp.float32)[:, :, None], short).reshape(n, h)


def _scaled(nib: jax.Array, s: jax.Array, sf: jax.Array, short: bool) -> jax.Array:
    """Biased nibbles (any unsigned int dtype) and their scales sf (float32, broadcastable to nib; s: the stored
    scales, for their dtype) -> float32 bf16(level * s) (_half_weight)."""
    if short:
        return nib.astype(jnp.int32).astype(jnp.float32) * sf + (-8.0 * sf)
    q = _levels(nib)
    return _split_bf16(q, sf) if s.dtype == jnp.bfloat16 else _round_bf16(q * sf)


def _live_cols(w: QuantArray) -> int:
    """The input columns that hold real ones, rounded up to whole groups (the padding after them is skipped)."""
    return -(-w.in_features // w.group) * w.group


def _live(w: QuantArray) -> tuple[int, int]:
    """Columns of the low and the high half that hold real input columns (whole groups): a table padded from in 640
    to in_p 768 (quantize_table: 128-byte rows) has halves of 384 whose high half holds 256 real columns and 128 of
    zero padding, which the CPU forms skip (17 % of the LM head's work)."""
    h, live = w.padded_in // 2, _live_cols(w)
    return min(live, h), max(live - h, 0)


def _halves(v: jax.Array, s: jax.Array, group: int, live: tuple[int, int], short: bool = False
            ) -> tuple[jax.Array, jax.Array | None]:
    """Packed rows uint8 [N, H] and scales [N, 2H // group] -> the float32 weights of the low nibbles' first live[0]
    columns and the high nibbles' first live[1] ([N, live[i]]; None for an empty half). Two arrays, never one
    [N, 2H]: a concatenate in an XLA:CPU loop fusion is emitted element by element (a 640-wide dequantization ran
    35x slower with one)."""
    g2 = s.shape[-1] // 2
    lo = _half_weight(v[:, :live[0]] & 15, s[:, :live[0] // group], group, short)
    hi = _half_weight(v[:, :live[1]] >> 4, s[:, g2:g2 + live[1] // group], group, short) if live[1] else None
    return lo, hi




def _words_weight(v: jax.Array, s: jax.Array, group: int, cols: int, short: bool = False) -> jax.Array:
    """Rows of words uint32 [N, in_p / 8] (the CPU word layout) and their scales [N, in_p / group] -> float32
    [N, cols] holding bf16(level * s) for the first `cols` columns (whole groups). Shaped [N, groups, words, 8] so
    that XLA:CPU's dot loop broadcasts each word to a vector's 8 lanes and shifts lane i by 4i (one variable shift
    and a mask per 8 weights, no byte widening), the group's scale fixed over its 32 columns (module docstring).
    The lanes get min(u, 0) (zero) added: without a dependence on the words, XLA hoists the shifts out of the tiles
    loop as a u32[8] array, and the dequantization then reads it per element in scalar code, with a branch for
    shifts of 32 or more (the 16-row LM head 2.5x slower); XLA keeps the minimum, LLVM folds it."""
    n, a = v.shape[0], cols // group
    u = v[:, :cols // WORD].reshape(n, a, group // WORD, 1)
    lane = lax.iota(jnp.uint32, WORD) + jnp.minimum(u, jnp.uint32(0))  # + 0, to stay in the loop
    nib = (u >> (lane << 2)) & jnp.uint32(15)
    return _scaled(nib, s, s[:, :a].astype(jnp.float32)[:, :, None, None], short).reshape(n, cols)


def _as_bf16(w: jax.Array) -> jax.Array:
    """float32 holding bf16 values -> those bf16 (the high halves: exact; XLA's convert would round again, in nine
    instructions per vector)."""
    return lax.bitcast_convert_type((lax.bitcast_convert_type(w, jnp.uint32) >> 16).astype(jnp.uint16), jnp.bfloat16)


def _dense_weight(w: QuantArray) -> jax.Array:
    """float32 [N, in_p] holding bf16(level * scale) (the whole weight, materialized: the GPU form)."""
    g2 = w.scale.shape[-1] // 2
    return jnp.concatenate([_half_weight(w.values & 15, w.scale[:, :g2], w.group),
                            _half_weight(w.values >> 4, w.scale[:, g2:], w.group)], axis=1)


def _one_row(x1: jax.Array, w: QuantArray, separate: bool) -> jax.Array:
    """x1 f32 [1, in_p] (bf16 values for a bf16 model) -> f32 [1, N] in two fused matrix-vector dots over the packed
    weight, one per nibble (XLA:CPU's one-row loop fusion: unpack, scale, round and multiply-add per weight, no copy);
    one dot over the live columns for a weight in words (_words_weight).

    separate: give this row its own copy of the weight's inputs; without it XLA merges the identical weight
    transforms of several rows (CSE) and materializes one float32 copy of the weight for all of them."""
    v, s = w.values, w.scale
    if separate:
        x1, v, s = lax.optimization_barrier((x1, v, s))
    if w.words:  # one dot over the live columns in their own order
        cols = _live_cols(w)
        return jnp.dot(x1[:, :cols], _words_weight(v, s, w.group, cols, w.short_scales).T)
    h, (l0, l1) = w.padded_in // 2, _live(w)
    lo, hi = _halves(v, s, w.group, (l0, l1), w.short_scales)
    y = jnp.dot(x1[:, :l0], lo.T)
    if hi is None:
        return y
    y, y_hi = lax.optimization_barrier((y, jnp.dot(x1[:, h:h + l1], hi.T)))  # keep the add out of the dots' fusions
    return y + y_hi


_TILE = 2048  # weight rows per tile of the GEMM forms: a bf16 tile of in 640 is 2.6 MB, dequantized into cache
_NT = (((1,), (1,)), ((), ()))  # contract x[M, K] with w[N, K] over K


def _tile_product(x2: jax.Array, v: jax.Array, s: jax.Array, group: int, live: tuple[int, int] | int,
                  short: bool = False, lhs: bool = False) -> jax.Array:
    """x2 [M, in_p] (bf16 or float32) times one tile of packed rows v [C, in_p / 2] (scales s) -> f32 [M, C]: the
    tile's two halves dequantized (bf16(level * scale), in x2's dtype: exact) and one GEMM per half, XLA:CPU's
    YNNPACK GEMM (native bf16 x bf16 -> f32 for bf16 x; float32 at HIGHEST for float32 x). lhs: the tile as the
    GEMM's left operand (W . x^T -> [C, M], transposed back): the same products and sums, no packing of the tile.
    Words (v uint32, the CPU word layout; live: its live columns): one GEMM over them."""
    prec = None if x2.dtype == jnp.bfloat16 else lax.Precision.HIGHEST

    def gemm(xs, wh):
        wh = _as_bf16(wh) if x2.dtype == jnp.bfloat16 else wh
        a, b = (wh, xs) if lhs else (xs, wh)
        return lax.dot_general(a, b, _NT, precision=prec, preferred_element_type=jnp.float32)

    if v.dtype == jnp.uint32:
        y = gemm(x2[:, :live], _words_weight(v, s, group, live, short))
        # the barrier keeps XLA from folding the transpose into the dot (x . W^T: YNNPACK then repacks the tile)
        return lax.optimization_barrier(y).T if lhs else y
    h = v.shape[1]
    lo, hi = _halves(v, s, group, live, short)
    y = gemm(x2[:, :live[0]], lo)
    y = y if hi is None else y + gemm(x2[:, h:h + live[1]], hi)
    return y.T if lhs else y


_CONCURRENT = 4  # tiles per loop iteration of the GEMM forms: independent chains XLA:CPU's runtime overlaps
# float32 tiles: 2 per iteration, the same bytes in cache as 4 bf16 ones. Measured on a 2-core AMD EPYC Zen 3 (AVX2,
# no bf16 hardware; jax 0.10.2, load 0.4-1.4, min / median of 15-20 alternating calls, ms): the 640 x 262,144 head,
# bf16 x, float32 tiles by 2 / by 4 / bf16 tiles by 4 (today's bf16 form) / a plain bf16 weight: 16 rows 69.0 / 84.8
# / 87.3 / 79.0 (medians 78.0 / 98.3 / 99.5 / 83.8), 64 rows 213 / 232 / 273 / 249, 256 rows 792 / 811 / 1137 / 991.
_F32_CONCURRENT = 2
# A CPU without bf16 hardware (cpu_features.native_bf16_dot false: int4_matmul_cpu) multiplies float32 tiles (bf16
# activations widened: the same products, bf16 values are exact in float32), and up to this many rows with the tile
# as the GEMM's left operand (W . x^T, then the small [C, M] product transposed): XLA:CPU's YNNPACK GEMM then reads
# the tile as it is, where x . W^T first transposes every tile into its packed layout (perf: 21 % of a w4a16
# 16-stream step in `ynn::transpose_x32`). Measured on a 2-core AMD EPYC Zen 3 (AVX2; jax 0.10.2; load 1.2-1.9 from
# the measurements themselves, min / median ms of round-robin calls, 2026-12-06): Gemma 3 270M's 126 int4 layer
# GEMMs chained (each its own buffer) at 2 / 8 / 16 / 32 / 64 / 128 / 256 rows, x . W^T float32 tiles from 16 rows
# and bf16 below (the form until now) against W . x^T float32: 17.1 / 28.5 / 32.6 / 48.6 / 74.4 / 132.3 / 230.6
# against 13.7 / 14.1 / 21.8 / 40.9 / 67.6 / 127.2 / 242.4; the 640 x 262,144 head, bf16 tiles by 4 / float32 by 2
# / float32 W . x^T by 2: 2 rows 59.9 / 58.4 / 37.5, 8 rows 74.8 / 73.5 / 42.7, 16 rows 108.7 / 87.6 / 60.3, 64 rows
# 306 / 225 / 207, 128 rows 525 / 371 / 379, 256 rows 1011 / 684 / 820. At 128 rows the head is 2 % slower this way
# and the layers 4 % faster; from 256 both are slower. "auto" keeps "rows" for one row (the head 11.7 against 20.7 ms
# W . x^T); an explicit "tiles" at one row is W . x^T too. The bound, int8_matmul.LHS_MAX_M, is shared with w8a8's
# float32 "wide" and the dense tiles.


def _tiles(x2: jax.Array, w: QuantArray, tile: int = _TILE, concurrent: int | None = None,
           out_dtype=jnp.float32, lhs: bool = False) -> jax.Array:
    """x2 [M, in_p] -> [M, N] (f32, or out_dtype bf16): a loop over tiles of `tile` weight rows (_tile_product),
    `concurrent` of them per iteration as independent chains (XLA:CPU runs one chain's dequantization beside another's
    GEMM; `concurrent` dequantized tiles are live at once: 10.5 MB in bf16 for in 640; None: _CONCURRENT for bf16
    x2, _F32_CONCURRENT for float32, the same bytes), written into the output in
    place; the rows left after the loop are done after it. The loop keeps the iteration's dequantized copies in cache
    (an unrolled sequence is fused by XLA into one whole-weight copy).
    out_dtype bf16: each tile is rounded as it is written and the output carried as its uint16 bits (a bf16 loop
    carry, or a convert of the float32 result after the loop, cost XLA:CPU 10 ms or more on the LM head). The
    640 x 262,144 LM head at M = 16 (AVX-512 Xeon, quiet, 512-bit vectors): 48 ms one tile at a time with the convert
    after the loop, 36 ms this way. lhs: each tile's GEMM as W . x^T (_tile_product)."""
    n, m = w.padded_out, x2.shape[0]
    v, s, g, short = w.values, w.scale, w.group, w.short_scales
    live = _live_cols(w) if w.words else _live(w)
    if concurrent is None:
        concurrent = _CONCURRENT if x2.dtype == jnp.bfloat16 else _F32_CONCURRENT
    step = tile * concurrent
    full = n // step
    bf = jnp.dtype(out_dtype) == jnp.bfloat16
    if not bf and jnp.dtype(out_dtype) != jnp.float32:
        raise ValueError(f"_tiles: out_dtype must be float32 or bfloat16, got {jnp.dtype(out_dtype)}")
    if n // tile <= 1:  # `after`: dequantized beside its GEMM, not hoisted (int8_matmul.after)
        return _tile_product(x2, after(x2, v), s, g, live, short, lhs).astype(out_dtype)
    if full < 2:  # concurrency only where the loop runs at least twice: a weight of fewer than 2 x `concurrent`
        step, full = tile, n // tile  # tiles goes tile by tile (else most of its dequantized copy is live at once)

    def _cast(t):
        return lax.bitcast_convert_type(t.astype(jnp.bfloat16), jnp.uint16) if bf else t

    bits = s.dtype == jnp.bfloat16  # bf16 scales are sliced as uint16: XLA:CPU widens a bf16 dynamic slice to
    s_in = lax.bitcast_convert_type(s, jnp.uint16) if bits else s  # float32 and hoists that over the whole array

    def body(i, y):
        parts = []
        for j in range(step // tile):
            r0 = i * step + j * tile
            vi = lax.dynamic_slice_in_dim(v, r0, tile, 0)
            si = lax.dynamic_slice_in_dim(s_in, r0, tile, 0)
            si = lax.bitcast_convert_type(si, jnp.bfloat16) if bits else si
            parts.append(_tile_product(x2, vi, si, g, live, short, lhs))
        part = jnp.concatenate(parts, 1) if len(parts) > 1 else parts[0]
        return lax.dynamic_update_slice_in_dim(y, _cast(part), i * step, 1)

    y = lax.fori_loop(0, full, body, after_init(x2, jnp.zeros((m, n), jnp.uint16 if bf else out_dtype)))
    done = full * step
    for r0 in range(done, n, tile):  # at most concurrent - 1 whole tiles and a partial one, independent
        tail = _tile_product(x2, after(x2, v[r0:r0 + tile]), s[r0:r0 + tile], g, live, short, lhs)
        y = lax.dynamic_update_slice_in_dim(y, _cast(tail), r0, 1)
    return lax.bitcast_convert_type(y, jnp.bfloat16) if bf else y


def int4_matmul_xla(x: jax.Array, w: QuantArray, *, form: str = "auto", bf16_dot: bool = True) -> jax.Array:
    """XLA w4a16 (CPU). x [..., in], w int4 QuantArray [out, in] -> [..., out] in x.dtype. form:
      "rows"   one fused matrix-vector pass per row of x, reading the packed weight (no copy of it);
      "tiles"  tiles of 2,048 weight rows dequantized (exactly, into the activations' dtype) and multiplied by
               YNNPACK GEMMs: native bf16 for bf16 x, float32 for float32 x; with bf16_dot=False (a CPU without bf16
               hardware, int4_matmul_cpu) float32 tiles for either, the tile the GEMM's left operand up to
               LHS_MAX_M rows (measured there);
      "auto"   "rows" up to _ROW_LOOP_MAX_M rows (measured crossovers; module docstring), else "tiles".
    "bf16" (bf16 x only, bf16 tiles always) and "dense" (float32 x) are older names of "tiles", kept for callers.
    Every form multiplies the activations in their compute dtype (bf16 values for bf16 x, x itself otherwise) by
    the bf16-valued weight with float32 sums: the reference's products for either dtype (float32 tiles multiply
    the same bf16 values, exactly).
    """
    _check(x, w)
    xb = _pad_x(x.reshape(-1, x.shape[-1]), w)
    m = xb.shape[0]
    if form == "bf16" and xb.dtype != jnp.bfloat16:
        raise ValueError(f"int4_matmul_xla: form 'bf16' multiplies bf16 activations, x is {x.dtype} (rounding it "
                         f"would change the float32 model's products); use 'tiles' or 'auto'")
    if form == "auto":
        form = "rows" if m <= _ROW_LOOP_MAX_M else "tiles"
    if form in ("tiles", "dense") and not bf16_dot:  # float32 tiles, W . x^T up to LHS_MAX_M rows
        return _finish(_tiles(xb.astype(jnp.float32), w, out_dtype=xb.dtype, lhs=m <= LHS_MAX_M), x, w)
    if form in ("tiles", "bf16", "dense"):
        return _finish(_tiles(xb, w, out_dtype=xb.dtype), x, w)  # xb: bf16 for bf16 x, else float32
    if form != "rows":
        raise ValueError(f"int4_matmul_xla: form must be 'auto', 'rows' or 'tiles', got {form!r}")
    x2 = materialize(xb.astype(jnp.float32))
    y = jnp.concatenate([_one_row(x2[i:i + 1], w, separate=m > 1) for i in range(m)], axis=0)
    return _finish(y, x, w)


def int4_matmul_cpu(x: jax.Array, w: QuantArray, *, form: str = "auto") -> jax.Array:
    """int4_matmul_xla for this host's CPU: the "tiles" / "auto" forms take bf16 tiles only where the CPU multiplies
    bf16 in hardware (cpu_features.native_bf16_dot, read when traced: JAX reuses a trace for the same shapes, so the
    answer is the process's first); elsewhere float32 tiles, W . x^T up to LHS_MAX_M rows (measured: LHS_MAX_M's
    comment). form="bf16" keeps bf16 tiles either way."""
    return int4_matmul_xla(x, w, form=form, bf16_dot=native_bf16_dot())


def int4_matmul_gpu(x: jax.Array, w: QuantArray) -> jax.Array:
    """XLA w4a16 for GPUs: dequantize to the compute dtype (fused by XLA) and one GEMM with f32 accumulation (bf16 x
    bf16 for bf16 x; float32 at HIGHEST precision, not TF32, for float32 x). Word-layout weights: repacked first."""
    _check(x, w)
    w = int4_to_halves(w)
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
                                      cpu=int4_matmul_cpu, default=int4_matmul_xla)
    if impl == "xla":
        return lax.platform_dependent(x, w, cuda=int4_matmul_gpu, rocm=int4_matmul_gpu, cpu=int4_matmul_cpu,
                                      default=int4_matmul_xla)
    if impl == "pallas":
        return int4_matmul_pallas(x, w)
    if impl == "pallas_interpret":
        return int4_matmul_pallas(x, w, interpret=pltpu.InterpretParams())
    raise ValueError(f"int4_matmul: impl must be 'auto', 'xla', 'pallas' or 'pallas_interpret', got {impl!r}")
