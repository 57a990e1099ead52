"""Quantized weights as pytree leaves and the one matmul that dispatches on them.

`linear(x, w)` multiplies activations [..., in] by a weight stored in Hugging Face's [out, in] layout,
whether `w` is a plain array or a `QuantArray`; `take_rows(table, ids)` gathers embedding rows the same
way; `gmm(x, experts, group_sizes)` multiplies rows sorted by expert by their experts [E, out, in] (MoE).
The model calls only these three, so a quantized checkpoint needs no other model code.
"""
from gemmajax.quant.array import QuantArray, abstract_quant
from gemmajax.quant.gmm import gmm, gmm_ref
from gemmajax.quant.int4_matmul import int4_matmul, int4_matmul_ref
from gemmajax.quant.int8_matmul import int8_matmul, int8_matmul_ref
from gemmajax.quant.ops import linear, take_rows
from gemmajax.quant.qat import RepackReport, repack_qat
from gemmajax.quant.quantize import QuantScheme, dequantize, parse_quant, quantize, quantize_table

__all__ = [
    "QuantArray", "QuantScheme", "RepackReport", "abstract_quant", "dequantize", "gmm", "gmm_ref", "int4_matmul",
    "int4_matmul_ref", "int8_matmul", "int8_matmul_ref", "linear", "parse_quant", "quantize", "quantize_table",
    "repack_qat", "take_rows",
]
