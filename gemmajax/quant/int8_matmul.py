"""w8a8 matmul: int8 weights per output row, int8 activations per token (dynamic), int32 accumulation.

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
M >= 2 "int" (also the GPU form). Both give the reference's integers; "vector" sums them in float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gemmajax.quant.array import INT8_MAX, QuantArray

_NT = (((1,), (1,)), ((), ()))  # contract x[M, K] with w[N, K] over K


def quantize_activations(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token symmetric int8: x [M, K] float -> (xq int8 [M, K], x_scale float32 [M, 1]); x ~= xq * x_scale.

    x_scale = max|x_row| / 127 (an all-zero row gets scale 0 and levels 0).
    """
    xf = x.astype(jnp.float32)
    xs = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / INT8_MAX
    xq = jnp.clip(jnp.round(xf / jnp.where(xs == 0, 1, xs)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return xq, xs


def materialize(v: jax.Array) -> jax.Array:
    """v, computed into its own buffer. XLA:CPU fuses cheap producers (here: the activation quantization) into the
    matrix-vector dot loop and recomputes them for every output row (4x slower at in 1536 x out 6144); a
    conditional is a fusion boundary that no pass removes, and its predicate (never false; NaN compares false)
    cannot be folded. optimization_barrier does not survive to fusion on the CPU."""
    never = jnp.any(v.reshape(-1)[:1] < -jnp.inf)
    return lax.cond(never, lambda t: t * 0, lambda t: t, v)


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

    y = (int32 sum_k xq[m, k] * wq[n, k]) * x_scale[m] * w_scale[n].
    """
    _check(x, w)
    x = _pad_in(x, w)
    xq, xs = quantize_activations(x.reshape(-1, x.shape[-1]))
    acc = lax.dot_general(xq, w.values, _NT, preferred_element_type=jnp.int32)
    return _finish(acc.astype(jnp.float32) * xs * w.scale.astype(jnp.float32)[None, :], x, w)


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


def _pick(n: int, options: tuple[int, ...]) -> int:
    """Largest option dividing n, or n itself (one full block) when none does."""
    return next((t for t in options if n % t == 0), n)


def int8_blocks(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(tm, tn, tk, m_padded) for x [m, k] @ w[n, k].T. Blocks respect TPU tiling: int8 rows in 32s, lanes in 128s,
    or a block spanning the whole dimension."""
    if m <= 256:
        mp = -(-m // 32) * 32
        tm = mp
    else:
        tm = 256
        mp = -(-m // tm) * tm
    tn = _pick(n, (1024, 512, 256, 128))  # v5e static bundles per 1024 weights at tn 1024/512/256: 0.45/0.53/0.67
    tk = _pick(k, tuple(range(4096, 127, -128)))
    return tm, tn, tk, mp


def int8_matmul_pallas(x: jax.Array, w: QuantArray, *, interpret=False, blocks=None) -> jax.Array:
    """Pallas TPU w8a8. x [..., in] float, w int8 QuantArray [out, in] -> [..., out] in x.dtype.

    interpret: False (compile for TPU) | True | pltpu.InterpretParams(...) (run on the CPU).
    blocks: optional (tm, tn, tk) override (tm must be a multiple of 32, tn of 128, tk of 128 or the full size).
    """
    _check(x, w)
    x = _pad_in(x, w)
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = w.padded_out
    tm, tn, tk, mp = int8_blocks(m, n, k)
    if blocks is not None:
        tm, tn, tk = blocks
        mp = -(-m // tm) * tm
        if n % tn or k % tk or tm % 32 or (tn % 128 and tn != n) or (tk % 128 and tk != k):
            raise ValueError(f"int8_matmul_pallas: blocks {blocks} do not tile x [{m}, {k}] @ w [{n}, {k}].T "
                             f"(tm % 32, tn | {n} and tn % 128, tk | {k} and tk % 128; or the whole dimension)")
    xq, xs = quantize_activations(x2)
    if mp != m:
        xq = jnp.pad(xq, ((0, mp - m), (0, 0)))
        xs = jnp.pad(xs, ((0, mp - m), (0, 0)))
    nk = k // tk
    out_dtype = x.dtype
    ob = jnp.dtype(out_dtype).itemsize
    vmem = 2 * (tm * tk + tn * tk + tm * tn * ob + tm * 4 + tn * 4) + (tm * tn * 4 if nk > 1 else 0)
    vmem += 3 * tm * tn * 4  # int32 / f32 temporaries of the epilogue
    y = pl.pallas_call(
        functools.partial(_int8_kernel, nk=nk),
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid=(mp // tm, n // tn, nk),
        in_specs=[
            pl.BlockSpec((tm, tk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((tm, 1), lambda i, j, kk: (i, 0)),
            pl.BlockSpec((tn, tk), lambda i, j, kk: (j, kk)),
            pl.BlockSpec((1, tn), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.int32)] if nk > 1 else [],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=int(min(max(2 * vmem, 32 << 20), 100 << 20))),
        cost_estimate=pl.CostEstimate(flops=2 * mp * n * k, transcendentals=0,
                                      bytes_accessed=n * k + (n // tn) * mp * k + mp * n * ob + 4 * (mp + n)),
        interpret=interpret,
        name="int8_matmul",
    )(xq, xs, w.values, w.scale.astype(jnp.float32).reshape(1, n))
    return _finish(y[:m], x, w)


# --- XLA paths ------------------------------------------------------------------------------------------------------
def int8_matmul_xla(x: jax.Array, w: QuantArray, *, form: str = "auto") -> jax.Array:
    """XLA w8a8 (CPU / GPU). form: "vector" (f32 fusion, the CPU's fast one-row form) | "int" (int8 x int8 ->
    int32 dot_general) | "auto" ("vector" for one row, else "int"). Same integers as the reference; "vector"
    accumulates them in float32 (exact while |sum| < 2**24)."""
    _check(x, w)
    x = _pad_in(x, w)
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_activations(x2)
    if form == "auto":
        form = "vector" if x2.shape[0] == 1 else "int"
    ws = w.scale.astype(jnp.float32)[None, :]
    if form == "vector":
        y = jnp.dot(materialize(xq.astype(jnp.float32)), w.values.astype(jnp.float32).T) * xs * ws
    elif form == "int":
        acc = lax.dot_general(xq, w.values, _NT, preferred_element_type=jnp.int32)
        y = acc.astype(jnp.float32) * xs * ws
    else:
        raise ValueError(f"int8_matmul_xla: form must be 'auto', 'vector' or 'int', got {form!r}")
    return _finish(y, x, w)


def int8_matmul(x: jax.Array, w: QuantArray, impl: str = "auto") -> jax.Array:
    """w8a8 y = x @ w.T. x [..., in], w int8 QuantArray [out, in] -> [..., out] in x.dtype.

    impl: "auto" (decided at lowering time, so deviceless TPU AOT compiles get the kernel: Pallas for TPU, the
    int8 GEMM for CUDA/ROCm, the measured CPU forms otherwise) | "xla" (the same without TPU) | "pallas" |
    "pallas_interpret".
    """
    gpu = functools.partial(int8_matmul_xla, form="int")  # one-row "vector" would hand cuBLAS a float32 copy
    if impl == "auto":
        return lax.platform_dependent(x, w, tpu=int8_matmul_pallas, cuda=gpu, rocm=gpu, default=int8_matmul_xla)
    if impl == "xla":
        return lax.platform_dependent(x, w, cuda=gpu, rocm=gpu, default=int8_matmul_xla)
    if impl == "pallas":
        return int8_matmul_pallas(x, w)
    if impl == "pallas_interpret":
        return int8_matmul_pallas(x, w, interpret=pltpu.InterpretParams())
    raise ValueError(f"int8_matmul: impl must be 'auto', 'xla', 'pallas' or 'pallas_interpret', got {impl!r}")
