"""Dispatch for weight matmuls and row gathers: plain arrays keep the dense path, QuantArrays pick their kernel.

Design choices: the model calls only `linear` and `take_rows`, with weights in Hugging Face's [out, in] layout;
the kind of a QuantArray (static metadata) chooses w8a8 or w4a16, and `impl` chooses the implementation, by
default at lowering time (Pallas for TPU, XLA elsewhere), so the same jitted model serves CPU, GPU and TPU AOT.
Plain arrays with 16-bit activations are dispatched at lowering time too: on the CPU to the measured forms of
`dense_matmul_cpu` (XLA:CPU otherwise copies every bf16 weight to float32 per call), elsewhere to the plain `jnp.dot`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gemmajax.quant.array import QuantArray
from gemmajax.quant.int4_matmul import int4_matmul
from gemmajax.quant.int8_matmul import int8_matmul, materialize
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
      "auto"   "vector" for one row, else "gemm" (bench/kernels.py). `jnp.dot(x_bf16, w.T)` in a whole model
               compiles to a float32 copy of every weight per call (10-40x slower at one row).
    """
    return dense_matmul_cpu_f32(x, w, form).astype(x.dtype)


def dense_matmul_cpu_f32(x: jax.Array, w: jax.Array, form: str = "auto") -> jax.Array:
    """`dense_matmul_cpu` before its one rounding: the float32 sums [..., out] (for a consumer that rounds them
    itself, e.g. the greedy LM head's argmax, without a pass that writes the rounded copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    if form == "auto":
        form = "vector" if x2.shape[0] == 1 else "gemm"
    if form == "vector":
        y = jnp.dot(materialize(x2.astype(jnp.float32)), w.astype(jnp.float32).T)
    elif form == "gemm":
        y = lax.dot_general(x2, w.astype(x.dtype), _NT, preferred_element_type=jnp.float32)
    else:
        raise ValueError(f"dense_matmul_cpu: form must be 'auto', 'vector' or 'gemm', got {form!r}")
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
