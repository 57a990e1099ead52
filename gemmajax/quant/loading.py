"""Quantization at load time: which tensors a scheme quantizes, and how.

Projections (attention, MLP, PLE gate / projection / model projection, MoE experts) get the scheme's linear kind
(w8a8: with activation scales per 128 input columns where 128 divides the width, `default_act_group`); the
vocabulary tables (embeddings, PLE table; the tied LM head reads the embedding table) get `+embN`, per-token
activations; norms, routers and scalars stay as they are. `qat-w4a16` repacks each tensor exactly or keeps it.
Expert stacks [E, out, in] pad `in` so that their rows are whole 128-byte lanes (int8 to 128 columns, int4 to 256):
XLA:TPU lays an unaligned stack out with `out` minor (e.g. 26B-A4B's down_proj, in 704), and the grouped matmul
kernel (gmm.py) would then get a relayout copy of the whole stack per step; zero levels, exact, 26B-A4B +0.36 GiB.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Callable

from gemmajax.quant.qat import RepackReport, repack_qat
from gemmajax.quant.quantize import default_act_group, parse_quant, quantize, quantize_table

PROJECTION = re.compile(r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|per_layer_input_gate|"
                        r"per_layer_projection|per_layer_model_projection)\.weight$|experts\.(gate_up_proj|down_proj)$")
TABLES = ("embed_tokens.weight", "embed_tokens_per_layer.weight")
EXPERTS = re.compile(r"experts\.(gate_up_proj|down_proj)$")
EXPERT_PAD_IN = {"int8": 128, "int4": 256}  # expert rows padded to whole 128-byte lanes (module docstring)
# Dense int8 rows too: an `in` that is not a multiple of 128 (Gemma 4 26B-A4B's down_proj, 2112) made the w8a8
# kernel's K block a partial lane tile; on a TPU v5e that projection ran at 85 GB/s at any blocks, padded to 2176 at
# 340 with the default blocks (bench/device_tpu_tiles.py, docs/device_tpu_v5e_tiles_2026-12-04.log), for 3 % more
# bytes. On one chip: a row-parallel shard of the padded row (1088 at TP 2) is unaligned again. int4 is left as it
# is: its half-rows (1056 bytes) would need 2304 columns (+9 % bytes) for 1.65x in time on that one projection.
INT8_PAD_IN = 128


class Quantizer:
    """Callable `(hf_name, array) -> array | QuantArray` for `gemma.build_weights`."""

    def __init__(self, quant: str):
        self.scheme = parse_quant(quant)
        self.report = RepackReport() if self.scheme.qat else None

    def __call__(self, name: str, w):
        s = self.scheme
        if name in TABLES:
            return quantize_table(w, s.table_bits) if s.table_bits else w
        if s.linear is None or not PROJECTION.search(name):
            return w
        pad = EXPERT_PAD_IN[s.linear] if EXPERTS.search(name) else INT8_PAD_IN if s.linear == "int8" else None
        if s.qat:
            q = repack_qat(w, report=self.report, name=name, pad_in_to=pad)
            return w if q is None else q
        if s.linear == "int8":
            return quantize(w, "int8", act_group=default_act_group(w.shape[-1]), pad_in_to=pad)
        return quantize(w, s.linear, pad_in_to=pad)

    def summary(self) -> str:
        return self.report.summary() if self.report is not None else ""


def make_quantizer(quant: str) -> Callable | None:
    if parse_quant(quant).name == "none":
        return None
    return Quantizer(quant)


def print_report(q) -> None:
    if isinstance(q, Quantizer) and q.report is not None:
        print(q.summary(), file=sys.stderr)
