"""Dispatch for weight matmuls and row gathers: plain arrays keep the dense path, QuantArrays pick their kernel.

Design choices: the model calls only `linear` and `take_rows`, with weights in Hugging Face's [out, in] layout;
the kind of a QuantArray (static metadata) chooses w8a8 or w4a16, and `impl` chooses the implementation, by
default at lowering time (Pallas for TPU, XLA elsewhere), so the same jitted model serves CPU, GPU and TPU AOT.
Plain arrays with 16-bit activations are dispatched at lowering time too: on the CPU to the measured forms of
`dense_matmul_cpu` (XLA:CPU's plain dot copies every bf16 weight to float32 whole per call; the forms read it as it is,
or widen it one tile at a time), elsewhere to the plain `jnp.dot`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gemmajax.cpu_features import native_bf16_dot
from gemmajax.quant.array import QuantArray
from gemmajax.quant.int4_matmul import int4_matmul
from gemmajax.quant.int8_matmul import LHS_MAX_M, after, int8_matmul, materialize
from gemmajax.quant.quantize import dequantize_rows
from gemmajax.quant.sharded import linear_tp

IMPLS = ("auto", "xla", "pallas", "pallas_interpret")
_MATMULS = {"int8": int8_matmul, "int4": int4_matmul}
_NT = (((1,), (1,)), ((), ()))  # contract x[M, K] with w[N, K] over K


def dense_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """The accelerators' plain-array form (TPU / GPU): y = x @ w.T in x.dtype. x: [..., in]; w: [out, in]."""
    return jnp.dot(x, w.T.astype(x.dtype))


def dense_matmul_cpu(x: jax.Array, w: jax.Array, form: str = "auto") -> jax.Array:
    """XLA:CPU forms for a plain [out, in] weight, same result as `dense_matmul` (f32 accumulation, one rounding).

    x: [..., in]; w: [out, in]. Returns [..., out] in x.dtype. form:
      "vector" `dot(materialize(x.astype(f32)), w.astype(f32).T)`: XLA:CPU's one-row loop fusion (convert,
               transpose, dot split over the cores), reading a bf16 weight once at memory speed;
      "gemm"   `dot_general(x, w, contract in, preferred f32)` in the weight's own dtype: a YNNPACK GEMM that
               takes bf16 operands natively (no float32 copy of the weight);
      "tiles"  the weight widened to float32 in tiles of TILE_ROWS rows, each tile the left operand of a float32
               GEMM (W . x^T, int8_matmul.LHS_MAX_M), the tiles in DENSE_CHAINS independent chains (_dense_tiles);
      "auto"   "vector" for one row; "tiles" on a CPU without bf16 hardware (cpu_features.native_bf16_dot, read
               when traced) for TILES_MIN_M to LHS_MAX_M rows of a 16-bit weight of at least TILES_MIN_SIZE
               elements and TILES_MIN_OUT rows (more than two tiles: the LM head); else "gemm" (bench/kernels.py; the
               constants' comment). `jnp.dot(x_bf16, w.T)` in a whole model compiles to a float32 copy of every
               weight per call (10-40x slower at one row).
    For x and w of the same 16-bit dtype every form has the same (exact) products and float32 sums; "gemm" rounds a
    weight of another dtype to x's, "vector" and "tiles" keep its values. Static weights only for "tiles": a weight
    sliced at run time (an expert of a stack, quant.gmm) is widened whole by XLA:CPU.
    """
    return dense_matmul_cpu_f32(x, w, form).astype(x.dtype)


# "tiles" for a 16-bit weight on a CPU without bf16 hardware, where XLA:CPU's YNNPACK bf16 GEMM is slow. Measured on a
# 2-core AMD EPYC Zen 3 (AVX2, jax 0.10.2, 2026-12-07, min ms of alternating calls, load about 1.1 from the script
# itself; /tmp scripts, not committed), "gemm" / "tiles", in x out: the 640 x 262,144 LM head at 2 / 8 / 16 / 32 / 64
# / 128 rows 29.9 / 34.5, 54.2 / 45.6, 84.7 / 64.7, 161 / 143, 286 / 239, 554 / 510; 640 x 2048 at 2 / 8 / 16 / 32 /
# 64 / 128 rows 0.34 / 0.41, 0.48 / 0.47, 0.82 / 0.72, 1.17 / 1.02, 1.96 / 1.83, 3.92 / 3.27; 2048 x 640 0.29 / 0.34,
# 0.47 / 0.36, 0.83 / 0.63, 1.24 / 0.92, 1.90 / 1.37, 3.83 / 2.86; the smaller ones mixed at 16 rows (640 x 1024 0.43
# / 0.39, 1024 x 640 0.37 / 0.40, 640 x 256 0.18 / 0.21). The head's tiles as one loop over a dynamic slice ran 161-
# 332 ms: XLA:CPU widens a sliced bf16 array to float32 before the loop (a 671 MB copy per call), and slicing a uint16
# view copies the whole weight first; hence static tiles, each ordered after the previous one of its chain (`after`),
# which XLA would otherwise fuse into one whole-weight copy. By 2 chains / 1: 54.8 / 65.5 ms at 16 rows (tiles of
# 2,048 rows; 4,096: 71.4 / 62.7); unordered, the head's program held 635 MiB of float32 tiles, ordered 21. Compiling
# the head's 128 tiles takes about 3 s. Gemma 3 270M at 16 streams with this and w8a8's float32 "wide" as W . x^T
# (int8_matmul.LHS_MAX_M), before / after, bench/compare_cpu.py runs back to back (load 1.4-1.9, not quiet): paired
# medians of 6 rounds bf16 102.9 / 142.8 tok/s, w8a8 98.2 / 158.3; one process each bf16 108.9 / 121.8, w8a8 119.3
# / 150.5.
TILE_ROWS = 2048
DENSE_CHAINS = 2
TILES_MIN_M = 8
TILES_MIN_SIZE = 1 << 20
# and only for a weight of two tiles or more, whose chains overlap one tile's widening with the other's GEMM. One
# tile widened then multiplied lost in the whole chain of Gemma 3 270M's 126 layer GEMMs (each weight its own buffer,
# read from memory; bench/gemm_floor.py, 16 rows, load 0.43): 68.5 ms against 48.6 for the bf16 GEMM (run19), where
# the same weights alone, in cache, gained (above); the LM head there 47.5 against 76.4. More than two tiles: Gemma 3
# 270M's gate and up joined (gemma.fuse_projections) are exactly two, and stay on the GEMM their halves had (two tiles
# alone unmeasured).
TILES_MIN_OUT = 2 * TILE_ROWS + 1


def _tile_products(x2: jax.Array, w: jax.Array, per_tile, tile: int = TILE_ROWS, chains: int = DENSE_CHAINS) -> list:
    """[per_tile(p) for each tile's product p]: x2 [M, in] times w [out, in] (16-bit floats) in tiles of `tile` rows
    widened to float32, each the left operand of a float32 GEMM, p = W_t . x^T f32 [rows, M] behind an optimization
    barrier (without it XLA folds a following transpose into x . W^T), tile t of chain t % chains ordered after that
    chain's previous product."""
    xf = x2.astype(jnp.float32)
    last = [xf] * chains
    parts = []
    for t, r0 in enumerate(range(0, w.shape[0], tile)):
        wt = after(last[t % chains], w[r0:r0 + tile]).astype(jnp.float32)
        p = lax.optimization_barrier(lax.dot_general(wt, xf, _NT, precision=lax.Precision.HIGHEST,
                                                     preferred_element_type=jnp.float32))
        last[t % chains] = p
        parts.append(per_tile(p))
    return parts


def _dense_tiles(x2: jax.Array, w: jax.Array, tile: int = TILE_ROWS, chains: int = DENSE_CHAINS) -> jax.Array:
    """x2 [M, in] times w [out, in] (16-bit floats) -> f32 [M, out], by `_tile_products`, each transposed back."""
    parts = _tile_products(x2, w, lambda p: p.T, tile, chains)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _first_max(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(max over axis 0, int32 index of its first occurrence) of v [N, M]. Two plain reductions: XLA:CPU's variadic
    argmax reduction is not vectorized (sampler._argmax). NaN: XLA:CPU's vectorized max does not reliably propagate
    it (nor, so, does the sampler's argmax), so which index a column with a NaN gets is unspecified, but it is in
    range: a NaN counts as a hit, and the index is clamped."""
    top = jnp.max(v, axis=0)
    hit = (v == top) | jnp.isnan(v)   # a NaN top still finds an index
    idx = jnp.min(jnp.where(hit, lax.broadcasted_iota(jnp.int32, v.shape, 0), v.shape[0] - 1), axis=0)
    return top, idx


def dense_argmax_cpu(x: jax.Array, w: jax.Array, round_to=None, tile: int = TILE_ROWS,
                     chains: int = DENSE_CHAINS) -> jax.Array:
    """int32 [...]: the first index of the maximum of `dense_matmul_cpu_f32(x, w, form="tiles")` over its last axis,
    each sum rounded to `round_to` first when given (the greedy LM head's token, sampler._argmax's rule), without
    the [M, out] sums: each tile's product is reduced to its rows' (rounded) maxima and their first indices as it is
    made, then the tiles' winners are compared. Why: on the 2-core Zen 3 (no bf16 hardware) the 16-row bf16 decode
    step of Gemma 3 270M kept its 16.8 MB of float32 logits beside the transposed tiles in a 33.6 MB temporary
    buffer, just over the 32 MiB mmap threshold that engine.cpu_malloc sets (glibc's largest), so a fresh mapping,
    page-faulted, every step; this program's temporaries are a few tiles (11.3 MB for that step). Timed with the
    tiles forced on a Zen 4 (GEMMAJAX_CPU_BF16_DOT=0; bench/compare_cpu.py, 16 streams, one round each): 99.9 -> 71.8
    ms a step, against a GEMM floor of 65-69 ms; not yet on a Zen 3 (docs/cpu_notes_2026-12-07_c.md)."""
    x2 = x.reshape(-1, x.shape[-1])
    rnd = (lambda v: v) if round_to is None else (lambda v: v.astype(round_to))
    parts = _tile_products(x2, w, lambda p: _first_max(rnd(p)), tile, chains)
    tops = jnp.stack([t for t, _ in parts])     # [tiles, M]
    idxs = jnp.stack([i for _, i in parts])
    _, win = _first_max(tops)                   # the first tile holding the maximum
    tok = win * tile + jnp.take_along_axis(idxs, win[None], axis=0)[0]
    return tok.reshape(x.shape[:-1])


def dense_cpu_form(m: int, w: jax.Array) -> str:
    """The form `dense_matmul_cpu`'s "auto" takes for m rows of the plain weight w [out, in] (module constants)."""
    if m == 1:
        return "vector"
    if (TILES_MIN_M <= m <= LHS_MAX_M and w.shape[0] >= TILES_MIN_OUT and w.size >= TILES_MIN_SIZE
            and jnp.dtype(w.dtype).itemsize == 2 and not native_bf16_dot()):
        return "tiles"
    return "gemm"


def dense_matmul_cpu_f32(x: jax.Array, w: jax.Array, form: str = "auto") -> jax.Array:
    """`dense_matmul_cpu` before its one rounding: the float32 sums [..., out] (for a consumer that rounds them
    itself, e.g. the greedy LM head's argmax, without a pass that writes the rounded copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if form == "auto":
        form = dense_cpu_form(m, w)
    if form == "vector":
        y = jnp.dot(materialize(x2.astype(jnp.float32)), w.astype(jnp.float32).T)
    elif form == "gemm":
        y = lax.dot_general(x2, w.astype(x.dtype), _NT, preferred_element_type=jnp.float32)
    elif form == "tiles":
        y = _dense_tiles(x2, w)
    else:
        raise ValueError(f"dense_matmul_cpu: form must be 'auto', 'vector', 'gemm' or 'tiles', got {form!r}")
    return y.reshape(*x.shape[:-1], w.shape[0])


def linear(x: jax.Array, w: jax.Array | QuantArray, impl: str = "auto") -> jax.Array:
    """y = x @ w.T. x: [..., in]; w: [out, in] (Hugging Face layout), a plain array or a 2-D QuantArray.

    Returns [..., out] in x.dtype. impl: "auto" | "xla" | "pallas" | "pallas_interpret" (ignored for plain arrays).
    Expert stacks [E, out, in] do not come here: the model runs them through ragged_dot (gemma.moe_block).
    """
    if not isinstance(w, QuantArray):
        if jnp.dtype(x.dtype).itemsize != 2:  # float32 models: the plain dot is already XLA:CPU's fast form
            return dense_matmul(x, w)
        # 16-bit activations: decided at lowering time, so deviceless TPU AOT keeps the plain dot
        return lax.platform_dependent(x, w, cpu=dense_matmul_cpu, default=dense_matmul)
    if impl not in IMPLS:
        raise ValueError(f"linear: impl must be one of {IMPLS}, got {impl!r}")
    if w.tp is not None:  # a tensor-parallel step: the kernel runs per shard (quant/sharded.py)
        return linear_tp(x, w, lambda xl, wl: _MATMULS[w.kind](xl, wl, impl))
    return _MATMULS[w.kind](x, w, impl)


def take_rows(table: jax.Array | QuantArray, ids: jax.Array, dtype=None) -> jax.Array:
    """table: [V, D] (plain or QuantArray); ids: int [...]. Returns table[ids]: [..., D] (cast to dtype if given;
    a QuantArray defaults to the dtype the table had before quantization). A QuantArray table is gathered and
    unpacked only at the rows read."""
    if isinstance(table, QuantArray):
        return dequantize_rows(table, ids, dtype)
    rows = jnp.take(table, ids, axis=0)
    return rows if dtype is None else rows.astype(dtype)
