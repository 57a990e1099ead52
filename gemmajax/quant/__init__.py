"""Quantized weights as pytree leaves and the one matmul that dispatches on them.

`linear(x, w)` multiplies activations [..., in] by a weight stored in Hugging Face's [out, in] layout,
whether `w` is a plain array or a `QuantArray`; `take_rows(table, ids)` gathers embedding rows the same
way. The model calls only these two, so a quantized checkpoint needs no other model code.
"""
from gemmajax.quant.ops import linear, take_rows

__all__ = ["linear", "take_rows"]
