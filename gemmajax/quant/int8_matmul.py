"""w8a8 matmul: int8 weights per output row, int8 activations per token or per token per group of G input columns
(dynamic; w.act_group = G), int32 accumulation of each group's products, float32 across groups.

Design choices: activations are quantized once outside the kernel (one fused XLA pass over x, shared by every
path so they agree bit-for-bit on the integers); the Pallas kernel is a plain int8 x int8 -> int32 GEMM over a
(M, N, K) grid with a VMEM int32 accumulator and the two scales applied at the last K step; on the CPU the form
is picked per M from measurements (below), because XLA:CPU's speed depends on how the matmul is written.
TPU projection (static LLO bundles of a deviceless compile, not a measurement): a decode step of 32 x 1024 x 1536
is 0.45 bundles per 1,024 weights on v5e (0.51 on v6e), under the 1.2 cycles their 1 KiB takes to stream from v5e
HBM, so the kernel should run at HBM bandwidth.

CPU forms, measured with bench/kernels_matmul.py (2 shared cores, jax 0.10.2; the forms called round-robin, min of
10 (3 for the LM head) calls, ms; load average 7.5-8, so absolute times run 2-5x a quiet machine's, ratios hold):

| in x out     | M  | "vector" f32 fusion | "int" int8 x int8 -> int32 | bf16 weight, dot(x, W.astype(f32).T) |
|--------------|----|---------------------|----------------------------|--------------------------------------|
| 640 x 2048   | 1  | **0.10**            | 0.27                       | 0.17                                 |
| 640 x 2048   | 16 | 0.77                | **0.46**                   | 0.79                                 |
| 1536 x 6144  | 1  | **0.54**            | 18.4                       | 0.86                                 |
| 1536 x 6144  | 16 | 37.3                | **1.78**                   | 43.9                                 |
| 640 x 262144 | 1  | **27.2**            | 946                        | 55.3                                 |
| 640 x 262144 | 16 | 1174                | **229**                    | 1230                                 |

"vector" is `dot(materialize(xq.astype(f32)), w_int8.astype(f32).T) * x_scale * w_scale`: XLA:CPU turns a one-row
dot over a converted, transposed operand into one loop fusion split over both cores, reading int8 at memory speed;
from two rows on it becomes a generic dot on a float32 copy and the int8 GEMM wins by 5-20x. So: M = 1 "vector",
M >= 2 "int" (also the GPU form). Both give the reference's integers; "vector" sums them in float32. Since then, for
bf16 x, "wide" (one bf16 GEMM over the levels, the conversion kept beside it by `after`) beats "int" in the whole
step from 64 rows, and from 2 rows for small weights with activation groups (`wide_pays`); "int" stays for the
rest, float32 x and the GPU. On a CPU without bf16 hardware (`int8_matmul_cpu`) "wide" multiplies float32 levels
instead, and only for weights with activation groups.

Activation groups (act_group G; the loaders' w8a8 default is 128, quantize.default_act_group). Gemma's activations
have outlier channels: one scale per token gives every column the outliers' coarse step; per group only the
outliers' own group gets it. Gemma 3 270M, 111 tokens teacher-forced against float32 (/tmp/q270.py): per token
KL 0.041, top-1 92.8 %; G = 128: KL 0.011, 95.5 %; G = 64: 0.008, 94.6 %; G = 32: 0.006, 95.5 %. Each group's
int8 x int8 product is its own int32 partial (on the MXU), scaled by its x scale and summed in float32 in group
order, then times w_scale. The kernel takes K blocks of whole groups (at most 32) and unrolls one matmul per group
into a float32 VMEM accumulator. Static LLO bundles per 1,024 weights (deviceless compile, in 1536 x out 6144;
a projection, not a measurement):

| G         | v5e M=1 | v6e M=1 | v5e M=512 | v6e M=512 |
|-----------|---------|---------|-----------|-----------|
| per token | 0.45    | 0.52    | 1.95      | 0.67      |
| 128       | 0.55    | 0.50    | 2.35      | 2.20      |
| 64        | 1.17    | 1.18    | 5.32      | 4.68      |
| 32        | 2.86    | 2.74    | 12.4      | 10.9      |

G = 128 keeps decode at per-token cost (under v5e's 1.2 cycles of HBM per KiB; no more bundles on v6e); 64 and 32
feed the MXU half / quarter-deep contractions and multiply the float epilogue (pop, convert, multiply-add per
output per group), leaving decode compute-bound, and prefill pays that epilogue (v6e 3.3x at 128, 7-16x below).
CPU (same bench method, load 6-6.5, min of 30-60 round-robin calls, ms): M = 1 "vector" on dequantized
activations xq * x_scale costs what per-token "vector" costs (640 x 2048 0.11 / 0.08-0.11, 1536 x 6144 0.28-0.41
both); XLA:CPU's one-row fusion stops streaming beyond in ~3072 (6144 x 1536: 20-50 ms, either way), so grouped
one-row calls wider than 3072 take the group loop (2.1 ms). M = 16 "int" loops over the groups, one int8 GEMM each
(fori_loop; unrolled slices and one batched dot_general, "batch", measured 1.2-2x slower): per token / G = 128 /
64 / 32 at 640 x 2048 0.36 / 0.44-0.47 / 0.78 / 0.74, 2048 x 640 0.29-0.38 / 0.43 / 0.74 / 0.77, 1536 x 6144
1.9-3.5 / 3.7-4.4 / 4.2-6.6 / 6.9-8.1. G = 128 costs 1.1-1.4x per token when both runs get the same cores (up to
2x when the single int8 GEMM gets both and the loop does not); 64 and 32 cost 2-4x. Hence G = 128.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gemmajax.cpu_features import native_bf16_dot
from gemmajax.quant.array import INT8_MAX, QuantArray

_NT = (((1,), (1,)), ((), ()))  # contract x[M, K] with w[N, K] over K
_VECTOR_MAX_IN = 3072  # grouped one-row "vector" up to this width; the group loop ("int") beyond (module docstring)
# "wide" (one bf16 GEMM over the int8 levels) from this many rows of bf16 x; "int" (the group loop) below. Measured on
# a 2-core AMD EPYC with AVX-512 bf16 (jax 0.10.2, act_group 128, bf16 x, in x out, min of 10 calls, ms int / wide):
# 64 rows 640 x 2048 1.30 / 0.81, 2048 x 640 1.50 / 1.06, 640 x 1024 0.80 / 0.76, 1024 x 640 0.82 / 0.46;
# 384 rows 4.15 / 2.72, 4.65 / 3.25, 2.17 / 1.57, 2.59 / 1.52; 16 rows mixed (0.50 / 0.52, 0.51 / 0.38, 0.33 / 0.24,
# 0.28 / 0.32). In the whole step "wide" once lost at 16 rows (89 / 148 ms) because XLA hoisted every layer's weight
# conversion to the program's start (a 235 MB temporary buffer, page-faulted in every call); with `after` it wins
# from 2 rows for a weight with activation groups (their loop is what it replaces) and a small bf16 copy: Gemma 3
# 270M w8a8 decode, ms a step int / wide, fresh processes alternating (load 1.0-1.6, not quiet): 2 streams
# 46.8 / 37.3, 4 52.9 / 39.7, 8 65.4 / 52.9, 16 75.5 / 55.0 and 75.6 / 60.6 (bf16 59.3). Not for a weight without
# groups (one int8 GEMM already) nor a large one below WIDE_MIN_ROWS: the +emb8 LM head (262,144 x 640) converted
# per step is a 335 MB copy, 16-stream step 176-181 ms against 75.6 with its int8 GEMM; and a copy beyond glibc's
# 32 MiB mmap threshold is page-faulted afresh in every call.
WIDE_MIN_ROWS = 64  # "wide" for any weight from here (the per-call conversion amortized over the rows)
WIDE_SMALL_ROWS = 2  # and from here for a grouped weight whose bf16 copy is at most WIDE_SMALL_MAX_BYTES
WIDE_SMALL_MAX_BYTES = 8 << 20  # Gemma 3 270M's largest projection 2.6 MB, gate and up joined 5.2; unmeasured above
# The same for the float32 levels of a CPU without bf16 hardware: Gemma 3 270M's gate and up joined
# (gemma.fuse_projections, the CPU engine's form) are 10.5 MB there, which this keeps on the form its halves had.
WIDE_SMALL_MAX_F32_BYTES = 12 << 20
# Up to this many rows a CPU without bf16 hardware multiplies a float32 weight (w8a8 "wide" levels, a dense bf16
# weight's float32 tiles: ops.dense_matmul_cpu_f32, int4 tiles: int4_matmul._tiles) as the GEMM's left operand,
# W . x^T, the small [N, M] product transposed back behind an optimization barrier (without it XLA folds the
# transpose into x . W^T): XLA:CPU's YNNPACK GEMM then reads the weight as it is, where x . W^T first transposes it
# into its packed layout. The same products and sums. w8a8 "wide" (act_group 128, float32 levels), 2-core AMD EPYC
# Zen 3 (AVX2, jax 0.10.2, 2026-12-07, min of 60 alternating calls, load 1.1 from the script itself), ms x . W^T /
# W . x^T, in x out: 16 rows 640 x 2048 0.66 / 0.56, 2048 x 640 0.79 / 0.61, 640 x 1024 0.45 / 0.32, 1024 x 640
# 0.45 / 0.30, 640 x 256 0.22 / 0.14 (a Gemma 3 270M layer 3.46 / 2.62); 64 rows 1.74 / 1.68, 1.40 / 1.19,
# 0.89 / 0.82, 0.84 / 0.69, 0.38 / 0.37. 128 is where the int4 tiles' gain ended (int4_matmul's comment above _tiles).
LHS_MAX_M = 128


def wide_pays(m: int, n: int, k: int, act_group: int, bf16_dot: bool = True) -> bool:
    """Whether `int8_matmul_xla`'s "auto" takes "wide" for m rows of 16-bit x times an [n, k] weight (see above).

    bf16_dot False ("wide" in float32 levels, a CPU without bf16 hardware): only for a grouped weight, the small
    weight's limit counting the float32 copy. Without groups "int" is one int8 GEMM, which such a CPU runs faster at
    any row count measured: on a 2-core AMD EPYC Zen 3 (AVX2, 2026-12-06, load 2.0 falling: rough), ms int / float32
    levels / bf16 levels, 64 rows 640 x 2048 1.32 / 1.62 / 3.78, the 262,144 x 640 +emb8 head 159 / 454 / 661;
    256 rows 4.83 / 5.97 / 10.08 and 728 / 1173 / 1561."""
    if not bf16_dot and not act_group:
        return False
    copy, limit = (2 * n * k, WIDE_SMALL_MAX_BYTES) if bf16_dot else (4 * n * k, WIDE_SMALL_MAX_F32_BYTES)
    return m >= WIDE_MIN_ROWS or (bool(act_group) and m >= WIDE_SMALL_ROWS and copy <= limit)


def quantize_activations(x: jax.Array, group: int = 0, axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per token (group 0) or per token per `group` columns.

    x [M, K] float -> (xq int8 [M, K], x_scale float32 [M, K // G]) with G = group or K; x[m, k] ~= xq[m, k] *
    x_scale[m, k // G]. x_scale = max|x[m, group]| / 127 (an all-zero group gets scale 0 and levels 0). axis: inside a
    row-parallel shard (the weight's act_axis), group 0's maximum is taken over every shard of the row on that mesh
    axis (its columns are split there), so the levels are the ones one device would compute.
    """
    m, k = x.shape
    g = group or k
    if k % g:
        raise ValueError(f"quantize_activations: group {group} does not divide the width {k} of x {x.shape}")
    xf = x.astype(jnp.float32).reshape(m, k // g, g)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    if not group and axis is not None:  # a row-parallel shard (quant/sharded.py): the whole row's maximum
        amax = lax.pmax(amax, axis)
    xs = amax / INT8_MAX
    xq = jnp.clip(jnp.round(xf / jnp.where(xs == 0, 1, xs)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return xq.reshape(m, k), xs[..., 0]


def materialize(v: jax.Array) -> jax.Array:
    """v, computed into its own buffer. XLA:CPU fuses cheap producers (here: the activation quantization) into the
    matrix-vector dot loop and recomputes them for every output row (4x slower at in 1536 x out 6144); a
    conditional is a fusion boundary that no pass removes, and its predicate (never false; NaN compares false)
    cannot be folded. optimization_barrier does not survive to fusion on the CPU."""
    never = jnp.any(v.reshape(-1)[:1] < -jnp.inf)
    return lax.cond(never, lambda t: t * 0, lambda t: t, v)


def after(x: jax.Array, w: jax.Array) -> jax.Array:
    """w, made to depend on x (a select on x's first element that is never taken: NaN compares false, and no pass
    folds it), so that XLA schedules the work on w (a weight's per-call dequantization or conversion) where x
    exists, beside its matmul, instead of hoisting it to the program's start. Hoisted, every layer's converted weight
    is live at once: Gemma 3 270M's step kept 200-235 MB of them in its temporary buffer (w4a16 16-row decode, w8a8
    384-row prefill), and a buffer that size is a fresh mmap per call, page-faulted in every step; with this, 17-65
    MB (prefill 39-65, decode 17-31). The select fuses into the consumer: no copy of w."""
    return jnp.where(_never(x), jnp.zeros((), w.dtype), w)


def _never(x: jax.Array) -> jax.Array:
    """A scalar False that XLA cannot fold, computed from x. [:1] and any: an x of no rows gives False, not an
    IndexError."""
    return jnp.any(x.reshape(-1)[:1] < -jnp.inf)


def after_init(x: jax.Array, init):
    """A loop's initial carry (a pytree of arrays), made to depend on x, for a loop that updates it in place.

    A constant init (jnp.zeros) is one broadcast XLA shares between every layer's loop, so each loop gets its own copy
    of it, and XLA:CPU schedules those copies at the program's start: every layer's carry is live for the whole step.
    Gemma 3 270M's 384-row w4a16 prefill held 18 copies of the joined gate / up loop's [384, 4096] output and 18 of the
    attention's [384, 4, 256] scatter target, a 93 MB temporary buffer (glibc mmaps a fresh one each call: page
    faults); made to depend on the layer's input, each is made where the loop runs. The never-taken branch is the
    init plus one, so no pass folds the select away (select(p, a, a) would fold)."""
    never = _never(x)
    return jax.tree.map(lambda v: jnp.where(never, v + jnp.ones((), v.dtype), v), init)


def _check(x: jax.Array, w: QuantArray) -> None:
    if not isinstance(w, QuantArray) or w.kind != "int8" or w.ndim != 2:
        raise ValueError(f"int8 matmul needs a 2-D int8 QuantArray [out, in], got {w!r}")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"int8 matmul: x has {x.shape[-1]} features, weight {w.shape} expects {w.in_features}")


def _finish(y: jax.Array, x: jax.Array, w: QuantArray) -> jax.Array:
    return y[:, : w.out_features].reshape(*x.shape[:-1], w.out_features).astype(x.dtype)


# --- reference ------------------------------------------------------------------------------------------------------
def _pad_in(x: jax.Array, w: QuantArray) -> jax.Array:
    """Zero columns up to the weight's padded width (a +emb8 table pads D to 128; its padding holds zero levels)."""
    extra = w.padded_in - x.shape[-1]
    return x if extra <= 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def int8_matmul_ref(x: jax.Array, w: QuantArray) -> jax.Array:
    """w8a8 reference in jnp. x [..., in] float, w int8 QuantArray [out, in] -> [..., out] in x.dtype.

    With G = w.act_group (or the whole width when 0) and groups g of G input columns:
    y[m, n] = w_scale[n] * sum_g x_scale[m, g] * int32(sum_{k in g} xq[m, k] * wq[n, k]), the float32 sum taken
    over g in order (the kernel's order).
    """
    _check(x, w)
    x = _pad_in(x, w)
    x2 = x.reshape(-1, x.shape[-1])
    (m, k), n = x2.shape, w.padded_out
    g = w.act_group or k
    xq, xs = quantize_activations(x2, w.act_group, w.act_axis)
    # [M, G', g] x [N, G', g] -> int32 [G', M, N]: each group is its own integer partial sum
    acc = lax.dot_general(xq.reshape(m, k // g, g), w.values.reshape(n, k // g, g), (((2,), (2,)), ((1,), (1,))),
                          preferred_element_type=jnp.int32)
    y = acc[0].astype(jnp.float32) * xs[:, :1]
    for j in range(1, k // g):
        y = y + acc[j].astype(jnp.float32) * xs[:, j:j + 1]
    return _finish(y * w.scale.astype(jnp.float32)[None, :], x, w)


# --- Pallas TPU kernel ----------------------------------------------------------------------------------------------
def _int8_kernel(xq_ref, xs_ref, w_ref, ws_ref, o_ref, *scratch, nk: int):
    """One (i, j, k) step. xq [tm, tk] int8, xs [tm, 1] f32, w [tn, tk] int8, ws [1, tn] f32, o [tm, tn]."""
    part = lax.dot_general(xq_ref[...], w_ref[...], _NT, preferred_element_type=jnp.int32)
    if nk == 1:  # whole K in one block: no accumulator round trip
        o_ref[...] = (part.astype(jnp.float32) * xs_ref[...] * ws_ref[...]).astype(o_ref.dtype)
        return
    (acc_ref,) = scratch
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = part

    @pl.when(k > 0)
    def _():
        acc_ref[...] += part

    @pl.when(k == nk - 1)
    def _():
        o_ref[...] = (acc_ref[...].astype(jnp.float32) * xs_ref[...] * ws_ref[...]).astype(o_ref.dtype)


def _int8_group_kernel(xq_ref, xs_ref, w_ref, ws_ref, o_ref, *scratch, nk: int, g: int):
    """One (i, j, k) step with activation groups of g columns. xq [tm, tk] int8, xs [tm, tk // g] f32 (this K
    block's group scales), w [tn, tk] int8, ws [1, tn] f32, o [tm, tn]. Each group's int8 x int8 product is its own
    int32 partial, scaled by its column of xs into a float32 sum taken over the groups in order."""
    k = pl.program_id(2)
    acc = None
    if nk > 1:
        (acc_ref,) = scratch

        @pl.when(k == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc = acc_ref[...]
    for s in range(xq_ref.shape[1] // g):  # static: lane-aligned sub-blocks of the K block
        part = lax.dot_general(xq_ref[:, s * g:(s + 1) * g], w_ref[:, s * g:(s + 1) * g], _NT,
                               preferred_element_type=jnp.int32)
        t = part.astype(jnp.float32) * xs_ref[:, s:s + 1]
        acc = t if acc is None else acc + t
    if nk == 1:
        o_ref[...] = (acc * ws_ref[...]).astype(o_ref.dtype)
        return

    @pl.when(k < nk - 1)
    def _():
        acc_ref[...] = acc

    @pl.when(k == nk - 1)
    def _():
        o_ref[...] = (acc * ws_ref[...]).astype(o_ref.dtype)


def _pick(n: int, options: tuple[int, ...]) -> int:
    """Largest option dividing n, or n itself (one full block) when none does."""
    return next((t for t in options if n % t == 0), n)


def int8_blocks(m: int, n: int, k: int, group: int = 0) -> tuple[int, int, int, int]:
    """(tm, tn, tk, m_padded) for x [m, k] @ w[n, k].T. Blocks respect TPU tiling: int8 rows in 32s, lanes in 128s,
    or a block spanning the whole dimension. With activation groups, tk holds whole groups (a multiple of
    lcm(group, 128)) and at most 32 of them (the kernel unrolls one matmul per group)."""
    if m <= 256:
        mp = -(-m // 32) * 32
        tm = mp
    else:
        tm = 256
        mp = -(-m // tm) * tm
    tn = _pick(n, (1024, 512, 256, 128))  # v5e static bundles per 1024 weights at tn 1024/512/256: 0.45/0.53/0.67
    if group:
        step = math.lcm(group, 128)
        tk = _pick(k, tuple(range(min(4096, 32 * group) // step * step, step - 1, -step)))
    else:
        tk = _pick(k, tuple(range(4096, 127, -128)))
    return tm, tn, tk, mp


def int8_matmul_pallas(x: jax.Array, w: QuantArray, *, interpret=False, blocks=None) -> jax.Array:
    """Pallas TPU w8a8. x [..., in] float, w int8 QuantArray [out, in] -> [..., out] in x.dtype.

    interpret: False (compile for TPU) | True | pltpu.InterpretParams(...) (run on the CPU).
    blocks: optional (tm, tn, tk) override (tm must be a multiple of 32, tn of 128, tk of 128 or the full size;
    with w.act_group, tk also a multiple of it).
    """
    _check(x, w)
    x = _pad_in(x, w)
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n, ag = w.padded_out, w.act_group
    tm, tn, tk, mp = int8_blocks(m, n, k, ag)
    if blocks is not None:
        tm, tn, tk = blocks
        mp = -(-m // tm) * tm
        if (n % tn or k % tk or tm % 32 or (tn % 128 and tn != n) or (tk % 128 and tk != k)
                or (ag and tk % ag)):
            raise ValueError(f"int8_matmul_pallas: blocks {blocks} do not tile x [{m}, {k}] @ w [{n}, {k}].T "
                             f"(tm % 32, tn | {n} and tn % 128, tk | {k} and tk % 128; or the whole dimension; "
                             f"tk a multiple of act_group {ag})")
    xq, xs = quantize_activations(x2, ag, w.act_axis)
    if mp != m:
        xq = jnp.pad(xq, ((0, mp - m), (0, 0)))
        xs = jnp.pad(xs, ((0, mp - m), (0, 0)))
    nk = k // tk
    out_dtype = x.dtype
    ob = jnp.dtype(out_dtype).itemsize
    vmem = 2 * (tm * tk + tn * tk + tm * tn * ob + tm * 4 + tn * 4) + (tm * tn * 4 if nk > 1 else 0)
    vmem += 3 * tm * tn * 4  # int32 / f32 temporaries of the epilogue
    if ag:
        # the scales of one K block, [nk, Mp, tk // G]: a block whose last dim is the whole array's (any width)
        xs = xs.reshape(mp, nk, tk // ag).transpose(1, 0, 2)
        xs_spec = pl.BlockSpec((None, tm, tk // ag), lambda i, j, kk: (kk, i, 0))
        kernel = functools.partial(_int8_group_kernel, nk=nk, g=ag)
        vmem += 2 * tm * 128 * 4 + 2 * tm * tn * 4  # lane-padded scales; the f32 partials
    else:
        xs_spec = pl.BlockSpec((tm, 1), lambda i, j, kk: (i, 0))
        kernel = functools.partial(_int8_kernel, nk=nk)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid=(mp // tm, n // tn, nk),
        in_specs=[
            pl.BlockSpec((tm, tk), lambda i, j, kk: (i, kk)),
            xs_spec,
            pl.BlockSpec((tn, tk), lambda i, j, kk: (j, kk)),
            pl.BlockSpec((1, tn), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32 if ag else jnp.int32)] if nk > 1 else [],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=int(min(max(2 * vmem, 32 << 20), 100 << 20))),
        cost_estimate=pl.CostEstimate(flops=2 * mp * n * k, transcendentals=0,
                                      bytes_accessed=n * k + (n // tn) * mp * k + mp * n * ob + 4 * n
                                      + 4 * xs.size * (n // tn if ag else 1)),  # group scales follow kk
        interpret=interpret,
        name="int8_matmul",
    )(xq, xs, w.values, w.scale.astype(jnp.float32).reshape(1, n))
    return _finish(y[:m], x, w)


# --- XLA paths ------------------------------------------------------------------------------------------------------
def int8_matmul_xla(x: jax.Array, w: QuantArray, *, form: str = "auto", bf16_dot: bool = True) -> jax.Array:
    """XLA w8a8 (CPU / GPU). x [..., in] float, w int8 QuantArray [out, in] -> [..., out] in x.dtype.

    form: "vector" (f32 fusion, the CPU's fast one-row form) | "int" (int8 x int8 -> int32 dot_general; with
    w.act_group one per group in a loop) | "batch" (one int8 dot_general batched over the groups, int32 [G', M, N],
    then the scaled sum) | "wide" (one GEMM in x's 16-bit dtype, float32 accumulation, over the weight's levels
    converted to it, exact, and the activations: their levels without act_group, else the dequantized xq * x_scale
    rounded once to x.dtype; float32 x stays float32) | "auto" ("vector" for one row; "wide" from WIDE_MIN_ROWS rows
    of 16-bit x, or from 2 for a small grouped weight (`wide_pays`); else "int"; with act_group "vector" only up to
    in 3072, where XLA:CPU's one-row fusion stops streaming: see the module docstring). "int" and "batch" give the
    reference's integers; "vector" sums them in float32 (exact while |sum| < 2**24), as "wide" does without
    act_group; with act_group both multiply the dequantized activations instead ("vector" rounds each product to
    float32, "wide" each activation to x.dtype: bf16 at most 2**-8 relative, below the int8 step of 2**-7 of the
    group maximum).
    bf16_dot: whether "wide" may multiply in x's 16-bit dtype; False (a CPU without bf16 hardware: int8_matmul_cpu)
    multiplies float32 levels by the float32 activations instead (their levels, or xq * x_scale unrounded, as
    "vector" does), the levels the GEMM's left operand up to LHS_MAX_M rows (W . x^T), and "auto" takes it only for
    a grouped weight (`wide_pays`).
    """
    _check(x, w)
    x = _pad_in(x, w)
    x2 = x.reshape(-1, x.shape[-1])
    (m, k), n, ag = x2.shape, w.padded_out, w.act_group
    xq, xs = quantize_activations(x2, ag, w.act_axis)
    x16 = jnp.dtype(x.dtype).itemsize == 2
    if form == "auto":
        if m == 1 and (not ag or k <= _VECTOR_MAX_IN):
            form = "vector"
        else:
            form = "wide" if x16 and wide_pays(m, n, k, ag, bf16_dot) else "int"
    ws = w.scale.astype(jnp.float32)[None, :]

    def dequantized():  # xq * x_scale per group, float32 [M, K]
        return (xq.astype(jnp.float32).reshape(m, k // ag, ag) * xs[..., None]).reshape(m, k)

    if form == "wide":
        cd = x.dtype if x16 and bf16_dot else jnp.float32
        xa = dequantized().astype(cd) if ag else xq.astype(cd)
        wa = after(xa, w.values).astype(cd)
        if not bf16_dot and m <= LHS_MAX_M:  # W . x^T: YNNPACK reads the converted weight as it is
            y = lax.optimization_barrier(lax.dot_general(wa, xa, _NT, preferred_element_type=jnp.float32)).T
        else:
            y = lax.dot_general(xa, wa, _NT, preferred_element_type=jnp.float32)
        y = y * ws if ag else y * xs * ws
    elif form == "vector":
        if ag:  # dequantize per group before the dot: the same one-row loop fusion
            y = jnp.dot(materialize(dequantized()), w.values.astype(jnp.float32).T) * ws
        else:
            y = jnp.dot(materialize(xq.astype(jnp.float32)), w.values.astype(jnp.float32).T) * xs * ws
    elif form in ("int", "batch") and not ag:
        acc = lax.dot_general(xq, w.values, _NT, preferred_element_type=jnp.int32)
        y = acc.astype(jnp.float32) * xs * ws
    elif form == "int":
        # one int8 GEMM per group; a loop rather than unrolled slices keeps the program small and measured faster
        def group(g, y):
            p = lax.dot_general(lax.dynamic_slice_in_dim(xq, g * ag, ag, 1),
                                lax.dynamic_slice_in_dim(w.values, g * ag, ag, 1), _NT,
                                preferred_element_type=jnp.int32)
            return y + p.astype(jnp.float32) * lax.dynamic_slice_in_dim(xs, g, 1, 1)

        y = lax.fori_loop(0, k // ag, group, after_init(xq, jnp.zeros((m, n), jnp.float32))) * ws
    elif form == "batch":
        acc = lax.dot_general(xq.reshape(m, k // ag, ag), w.values.reshape(n, k // ag, ag),
                              (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.int32)  # [G', M, N]
        y = jnp.sum(acc.astype(jnp.float32) * xs.T[:, :, None], axis=0) * ws
    else:
        raise ValueError(f"int8_matmul_xla: form must be 'auto', 'vector', 'int', 'batch' or 'wide', got {form!r}")
    return _finish(y, x, w)


def _int8_matmul_gpu(x: jax.Array, w: QuantArray) -> jax.Array:
    """CUDA / ROCm: one int8 GEMM ("int"), batched over the activation groups when there are some ("batch":
    one fusion, not a loop of small GEMMs). Chosen by reasoning; not measured on a GPU yet."""
    return int8_matmul_xla(x, w, form="batch" if w.act_group else "int")


def int8_matmul_cpu(x: jax.Array, w: QuantArray, *, form: str = "auto") -> jax.Array:
    """int8_matmul_xla for this host's CPU: "wide" in bf16 only where the CPU multiplies bf16 in hardware
    (cpu_features.native_bf16_dot, read when traced: JAX reuses a trace for the same shapes, so the answer is the
    process's first). Without it, measured on a 2-core AMD EPYC Zen 3 (AVX2, jax 0.10.2, load 0.6, act_group 128,
    16 rows of bf16 x, min of 30 calls; ms bf16 levels / float32 levels / "int" / a bf16 weight): 640 x 2048
    2.77 / 0.80 / 0.55 / 0.68, 2048 x 640 2.95 / 0.92 / 0.96 / 0.74, 640 x 1024 0.93 / 0.46 / 0.70 / 0.45,
    1024 x 640 0.98 / 0.50 / 0.63 / 0.61. Gemma 3 270M w8a8 decoded 16 streams there at 57.9 tok/s with bf16 levels
    and 116.0 with float32 ones, bf16's 112.3 and 110.7 in the same runs (docs/cpu_notes_2026-12-06.md)."""
    return int8_matmul_xla(x, w, form=form, bf16_dot=native_bf16_dot())


def int8_matmul(x: jax.Array, w: QuantArray, impl: str = "auto") -> jax.Array:
    """w8a8 y = x @ w.T. x [..., in], w int8 QuantArray [out, in] -> [..., out] in x.dtype.

    impl: "auto" (decided at lowering time, so deviceless TPU AOT compiles get the kernel: Pallas for TPU, the
    int8 GEMM for CUDA/ROCm, the measured CPU forms otherwise) | "xla" (the same without TPU) | "pallas" |
    "pallas_interpret".
    """
    gpu = _int8_matmul_gpu  # one-row "vector" would hand cuBLAS a float32 copy
    if impl == "auto":
        return lax.platform_dependent(x, w, tpu=int8_matmul_pallas, cuda=gpu, rocm=gpu, cpu=int8_matmul_cpu,
                                      default=int8_matmul_xla)
    if impl == "xla":
        return lax.platform_dependent(x, w, cuda=gpu, rocm=gpu, cpu=int8_matmul_cpu, default=int8_matmul_xla)
    if impl == "pallas":
        return int8_matmul_pallas(x, w)
    if impl == "pallas_interpret":
        return int8_matmul_pallas(x, w, interpret=pltpu.InterpretParams())
    raise ValueError(f"int8_matmul: impl must be 'auto', 'xla', 'pallas' or 'pallas_interpret', got {impl!r}")
