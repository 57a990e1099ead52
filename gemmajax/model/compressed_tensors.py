"""Compressed-tensors checkpoints (llm-compressor exports, Google's `-qat-w4a16-ct`), served in their own scheme.

Design choices: such a checkpoint is read as "logical Hugging Face name -> plain array or QuantArray", so
`plan_tensors` and `build_weights` see the very names and shapes of a plain checkpoint. Each quantized weight is
converted once, on the host in numpy, from compressed-tensors' layout into gemmajax's (int4: nibble i of int32 word
j is column 8j + i, re-laid as half-split bytes; int8: the stored values, one float32 scale per row) and never
re-quantized, so `dequantize` returns exactly the values the checkpoint encodes. Every scheme is checked against
what gemmajax serves before a weight is read; anything else is an error naming the tensor and the scheme.

Layouts read (logical weight [out, in], HF row-major):
  pack-quantized (w4a16): weight_packed int32 [out, ceil(in / 8)], weight_scale [out, ceil(in / 32)], weight_shape
      int [2]; value = level * scale with level = nibble - 8 in -8..7, computed in the scale's dtype (bf16, as
      published: exact here; an f16 / f32 scale is kept as f32 and the value rounded to bf16, as every int4 path
      of gemmajax computes it).
  int-quantized (w8a8): weight int8 [out, in], weight_scale [out, 1] (channel) or [1] (tensor); value = level *
      scale; activations quantized to int8 per token at run time (dynamic).
Experts split per expert (`experts.{e}.gate_proj / up_proj / down_proj`) are stacked back into the fused
[E, 2F, D] / [E, D, F] tensors of the Weights tree.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from gemmajax.config import ModelConfig
from gemmajax.model import gemma
from gemmajax.model.loader import (
    KV_SHARED_EXTRAS,
    NON_TEXT,
    Checkpoint,
    CheckpointError,
    text_prefix,
)
from gemmajax.model.safetensors_io import TensorInfo, index_checkpoint, load_tensor
from gemmajax.quant.array import QuantArray, padded_in, padded_out
from gemmajax.quant.loading import INT8_PAD_IN

KIND = "compressed-tensors"
INT4_GROUP = 32  # the only int4 group the kernels serve (w4a16)
# Formats by the weight bits they carry; float-quantized (fp8), nvfp4-pack-quantized, marlin-24, sparse-* are not.
FORMATS = {"pack-quantized": 4, "int-quantized": 8, "naive-quantized": 8}
# Per-module parameters a compressed-tensors compressor writes beside (or instead of) `weight`.
QUANT_PARAMS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx",
                "weight_global_scale", "input_scale", "input_zero_point", "input_global_scale", "output_scale",
                "output_zero_point", "k_scale", "v_scale")
_EXPERT = re.compile(r"^(?P<base>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_TABLES = ("embed_tokens.weight", "embed_tokens_per_layer.weight")
_TABLE_PAD = {"int4": 256, "int8": 128}  # as quantize_table: 128-byte rows keep row gathers aligned
_UNPACK_ROWS = 2048  # rows of int32 words unpacked at a time (bounds the uint32 temporaries)
_SUPPORTED = ("gemmajax serves pack-quantized int4 (symmetric, groups of 32, 16-bit activations: w4a16) and "
              "int-quantized int8 (symmetric, per channel, with dynamic per-token int8 activations: w8a8)")


class CompressedTensorsError(CheckpointError):
    """A compressed-tensors checkpoint whose scheme or layout gemmajax cannot serve; names the tensor and scheme."""


# ------------------------------------------------------------------------------------------------ config
@dataclasses.dataclass(frozen=True)
class QuantArgs:
    """One `weights` / `input_activations` / `output_activations` entry of a config group."""

    num_bits: int
    type: str  # "int" | "float"
    strategy: str  # "tensor" | "channel" | "group" | "block" | "token" | ...
    group_size: int | None
    symmetric: bool
    dynamic: Any  # False | True | "local"

    @classmethod
    def from_dict(cls, d: dict | None) -> QuantArgs | None:
        if d is None:
            return None
        group = d.get("group_size")
        strategy = d.get("strategy") or ("group" if group else "tensor")
        return cls(int(d.get("num_bits", 8)), str(d.get("type", "int")), str(strategy),
                   None if group is None else int(group), bool(d.get("symmetric", True)), d.get("dynamic", False))

    def describe(self) -> str:
        g = f" group {self.group_size}" if self.strategy == "group" else ""
        dyn = ", dynamic" if self.dynamic is True else f", dynamic={self.dynamic}" if self.dynamic else ", static"
        return (f"{self.type} {self.num_bits}-bit {self.strategy}{g}, "
                f"{'symmetric' if self.symmetric else 'asymmetric'}{dyn}")


@dataclasses.dataclass(frozen=True)
class SchemeGroup:
    """One entry of `config_groups`: the modules it targets and how their weights / activations are quantized."""

    name: str
    format: str
    targets: tuple[str, ...]
    weights: QuantArgs | None
    input_activations: QuantArgs | None
    output_activations: QuantArgs | None

    def describe(self) -> str:
        acts = self.input_activations.describe() if self.input_activations else "none (16-bit)"
        out = f"; outputs {self.output_activations.describe()}" if self.output_activations else ""
        w = self.weights.describe() if self.weights else "none"
        return f"{self.name!r} ({self.format}: weights {w}; input activations {acts}{out})"


@dataclasses.dataclass(frozen=True)
class CompressedTensorsConfig:
    """A parsed `quantization_config` with quant_method "compressed-tensors"."""

    format: str
    groups: tuple[SchemeGroup, ...]
    ignore: tuple[str, ...]

    def is_ignored(self, module: str) -> bool:
        return any(_match_name(module, t) for t in self.ignore)

    def group_for(self, module: str) -> SchemeGroup | None:
        """The group whose targets match `module`: an exact name first, then a `re:` pattern, then a class name
        ("Linear" matches every module but the embedding tables, "Embedding" only those), as compressed-tensors
        resolves them."""
        for exact in (True, False):
            for g in self.groups:
                if any(not _is_class(t) and t.startswith("re:") != exact and _match_name(module, t)
                       for t in g.targets):
                    return g
        table = module.rsplit(".", 1)[-1].startswith("embed_tokens")
        for g in self.groups:
            if any(_is_class(t) and (t == "Embedding") == table and t in ("Linear", "Embedding") for t in g.targets):
                return g
        return None


def _is_class(target: str) -> bool:
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def _match_name(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target


def quantization_config(hf: dict) -> dict | None:
    """The `quantization_config` of a config.json (top level, or inside `text_config`), or None."""
    return hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config") or None


def parse_quantization_config(qc: dict) -> CompressedTensorsConfig:
    """Parse and check the checkpoint-wide parts of a compressed-tensors `quantization_config`.

    Raises CompressedTensorsError for another quant_method, sparsity, transforms (rotations) or a KV-cache scheme;
    per-tensor schemes are checked later, by `serving_kind`, for the tensors the model uses."""
    method = qc.get("quant_method")
    if method != KIND:
        raise CompressedTensorsError(
            f"quantization_config.quant_method is {method!r}: gemmajax loads only compressed-tensors checkpoints "
            f"({_SUPPORTED}); load the unquantized checkpoint with quant='w8a8' / 'w4a16' instead")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise CompressedTensorsError(f"quantization_config.{key} is set ({qc[key]!r}): sparse and transformed "
                                         f"(rotated) compressed-tensors checkpoints are not supported; {_SUPPORTED}")
    if qc.get("kv_cache_scheme"):
        raise CompressedTensorsError(
            f"quantization_config.kv_cache_scheme {qc['kv_cache_scheme']!r}: quantized KV-cache scales are not "
            "read from checkpoints; drop the scheme and choose kv_dtype='fp8_e4m3' / 'fp8_e5m2' at serve time")
    fmt = str(qc.get("format") or "")
    groups = []
    for name, g in (qc.get("config_groups") or {}).items():
        targets = g.get("targets") or []
        groups.append(SchemeGroup(str(name), str(g.get("format") or fmt), tuple(str(t) for t in targets),
                                  QuantArgs.from_dict(g.get("weights")),
                                  QuantArgs.from_dict(g.get("input_activations")),
                                  QuantArgs.from_dict(g.get("output_activations"))))
    if not groups:
        raise CompressedTensorsError("quantization_config.config_groups is empty: no quantization scheme to load")
    return CompressedTensorsConfig(fmt, tuple(groups), tuple(str(t) for t in qc.get("ignore") or ()))


def serving_kind(group: SchemeGroup, tensor: str) -> str:
    """"int4" (w4a16) or "int8" (w8a8): how gemmajax serves `tensor` under `group`; raises naming both otherwise."""
    w, act = group.weights, group.input_activations
    problems: list[str] = []
    kind = None
    if group.format not in FORMATS:
        problems.append(f"format {group.format!r} is not served")
    if w is None:
        problems.append("the group quantizes no weights")
    else:
        if w.type != "int":
            problems.append(f"weights of type {w.type!r} (fp8 / fp4 formats are not served)")
        if not w.symmetric:
            problems.append("asymmetric weights (zero points)")
        if w.num_bits == 4:
            kind = "int4"
            if group.format != "pack-quantized":
                problems.append(f"4-bit weights must be pack-quantized, not {group.format!r}")
            if w.strategy != "group" or w.group_size != INT4_GROUP:
                problems.append(f"int4 weights must be in groups of {INT4_GROUP} along `in`, got strategy "
                                f"{w.strategy!r} group_size {w.group_size}")
            if act is not None:
                problems.append(f"int4 weights run with 16-bit activations (w4a16), not {act.describe()}")
        elif w.num_bits == 8:
            kind = "int8"
            if group.format not in ("int-quantized", "naive-quantized"):
                problems.append(f"8-bit weights must be int-quantized, not {group.format!r}")
            if w.strategy not in ("channel", "tensor"):
                problems.append(f"int8 weights must have one scale per output channel, got strategy {w.strategy!r}")
            if act is None:
                problems.append("int8 weights with 16-bit activations (w8a16) are not served; w8a8 needs dynamic "
                                "per-token int8 input activations")
            elif not (act.type == "int" and act.num_bits == 8 and act.strategy == "token" and act.dynamic is True
                      and act.symmetric):
                problems.append(f"input activations {act.describe()} (w8a8 needs int 8-bit token, symmetric, "
                                "dynamic)")
        else:
            problems.append(f"{w.num_bits}-bit weights")
    if group.output_activations is not None:
        problems.append("output activation quantization")
    if problems:
        raise CompressedTensorsError(
            f"{tensor}: compressed-tensors scheme {group.describe()} is not supported: {'; '.join(problems)}. "
            f"{_SUPPORTED}; load the unquantized checkpoint with quant='w8a8' / 'w4a16' instead")
    return kind


# ------------------------------------------------------------------------------------------------ layouts
def unpack_int32_nibbles(packed: np.ndarray, cols: int) -> np.ndarray:
    """compressed-tensors int4 words [..., W] int32 -> levels int8 [..., cols] (cols <= 8 W).

    Nibble i (bits 4i..4i+3) of word j holds column 8j + i as level + 8 (levels -8..7)."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    flat = words.reshape(-1, words.shape[-1])
    out = np.empty((flat.shape[0], cols), np.int8)
    for r in range(0, flat.shape[0], _UNPACK_ROWS):
        nib = (flat[r:r + _UNPACK_ROWS, :, None] >> shifts) & np.uint32(15)        # [rows, W, 8]
        out[r:r + _UNPACK_ROWS] = nib.reshape(nib.shape[0], -1)[:, :cols].astype(np.int8) - 8
    return out.reshape(*words.shape[:-1], cols)


def int4_quantarray(levels: np.ndarray, scale: np.ndarray, dtype=jnp.bfloat16, pad_in_to: int | None = None
                    ) -> QuantArray:
    """Levels int8 [..., out, in] in -8..7 and group scales [..., out, ceil(in / 32)] -> int4 QuantArray.

    gemmajax's layout (array.py): in padded to a multiple of 64 (or pad_in_to), byte j = level[j] + 8 |
    (level[j + in_p / 2] + 8) << 4; padding is level 0 with scale 0. A bf16 scale stays bf16 (every path then
    computes bf16(level * scale), the checkpoint's own dequantization); f16 / f32 scales are kept as f32."""
    *lead, out, inp = levels.shape
    ng = -(-inp // INT4_GROUP)
    if tuple(scale.shape) != (*lead, out, ng):
        raise ValueError(f"int4 scale shape {tuple(scale.shape)} does not match weight {levels.shape} "
                         f"(expected {(*lead, out, ng)})")
    out_p, in_p = padded_out(out), padded_in(inp, "int4", INT4_GROUP, pad_in_to)
    u = np.full((*lead, out_p, in_p), 8, np.uint8)
    u[..., :out, :inp] = (levels.astype(np.int16) + 8).astype(np.uint8)
    h = in_p // 2
    values = u[..., :h] | (u[..., h:] << 4)
    sdt = ml_dtypes.bfloat16 if scale.dtype == ml_dtypes.bfloat16 else np.float32
    sc = np.zeros((*lead, out_p, in_p // INT4_GROUP), sdt)
    sc[..., :out, :ng] = scale.astype(sdt)
    return QuantArray(values, sc, "int4", (*lead, out, inp), INT4_GROUP, jnp.dtype(dtype))


def int8_quantarray(values: np.ndarray, scale: np.ndarray, dtype=jnp.bfloat16, pad_in_to: int | None = None
                    ) -> QuantArray:
    """Levels int8 [..., out, in] and per-row scales [..., out] -> int8 QuantArray (float32 scale; rows padded as
    array.py says, with level 0 and scale 0)."""
    *lead, out, inp = values.shape
    if tuple(scale.shape) != (*lead, out):
        raise ValueError(f"int8 scale shape {tuple(scale.shape)} does not match weight {values.shape}")
    out_p, in_p = padded_out(out), padded_in(inp, "int8", 0, pad_in_to)
    v = np.zeros((*lead, out_p, in_p), np.int8)
    v[..., :out, :inp] = values
    s = np.zeros((*lead, out_p), np.float32)
    s[..., :out] = scale.astype(np.float32)
    return QuantArray(v, s, "int8", (*lead, out, inp), 0, jnp.dtype(dtype))


# ------------------------------------------------------------------------------------------------ checkpoint
@dataclasses.dataclass
class _Entry:
    """One logical tensor: plain, a quantized module, or fused experts built from per-expert modules."""

    kind: str  # "plain" | "int4" | "int8" | "experts"
    shape: tuple[int, ...]
    parts: dict[str, str] = dataclasses.field(default_factory=dict)  # role -> stored tensor name
    members: list[list[str]] = dataclasses.field(default_factory=list)  # experts: per expert, logical names


class CompressedTensorsCheckpoint:
    """The tensors of a compressed-tensors checkpoint directory under their logical HF names.

    `read(name)` gives a numpy array (plain tensors) or a numpy-backed QuantArray (quantized modules, fused
    experts); `shape_of(name)` the logical shape. Schemes of the tensors the model uses are checked on open."""

    def __init__(self, ckpt_dir: str, hf: dict, cfg: ModelConfig):
        self.path = ckpt_dir
        qc = quantization_config(hf)
        if not qc:
            raise CompressedTensorsError(f"{ckpt_dir}: config.json has no quantization_config")
        self.qconfig = parse_quantization_config(qc)
        self.infos: dict[str, TensorInfo] = index_checkpoint(ckpt_dir)
        self.tensors: dict[str, _Entry] = self._index()  # every stored logical tensor, per-expert ones included
        self.entries: dict[str, _Entry] = self._fuse_experts()  # what the model reads
        self.kinds: dict[str, int] = {}  # "int4" / "int8" -> quantized tensors the model uses
        self._check(cfg)

    # -- names -------------------------------------------------------------------------------------------
    def _index(self) -> dict[str, _Entry]:
        modules: dict[str, dict[str, str]] = {}
        for name in self.infos:
            module, _, leaf = name.rpartition(".")
            if leaf in QUANT_PARAMS:
                modules.setdefault(module, {})[leaf] = name
        entries: dict[str, _Entry] = {}
        for name, info in self.infos.items():
            module, _, leaf = name.rpartition(".")
            if leaf in QUANT_PARAMS or (leaf == "weight" and module in modules):
                continue
            entries[name] = _Entry("plain", tuple(info.shape), {"weight": name})
        for module, parts in modules.items():
            logical = module + ".weight"
            if "weight_packed" in parts:
                missing = [p for p in ("weight_scale", "weight_shape") if p not in parts]
                if missing:
                    raise CompressedTensorsError(f"{parts['weight_packed']}: pack-quantized weight without "
                                                 f"{', '.join(module + '.' + p for p in missing)}")
                shape = tuple(int(d) for d in np.asarray(load_tensor(self.infos[parts["weight_shape"]])).reshape(-1))
                if len(shape) != 2:
                    raise CompressedTensorsError(f"{parts['weight_shape']}: expected [out, in], found {list(shape)}")
                entries[logical] = _Entry("int4", shape, dict(parts))
            elif "weight_scale" in parts and logical in self.infos:
                entries[logical] = _Entry("int8", tuple(self.infos[logical].shape), {**parts, "weight": logical})
            else:
                stray = ", ".join(sorted(parts.values()))
                raise CompressedTensorsError(
                    f"{stray}: quantization parameters without a quantized weight ({module}.weight_packed, or an "
                    f"int8 {logical} with {module}.weight_scale); static activation or KV-cache scales are not "
                    "served")
        return entries

    def _fuse_experts(self) -> dict[str, _Entry]:
        """Per-expert gate / up / down projections -> the fused [E, 2F, D] and [E, D, F] tensors of the model."""
        entries = dict(self.tensors)
        found: dict[str, dict[int, dict[str, str]]] = {}
        for name in self.tensors:
            m = _EXPERT.match(name)
            if m:
                found.setdefault(m["base"], {}).setdefault(int(m["e"]), {})[m["proj"]] = name
        for base, experts in found.items():
            n = len(experts)
            if sorted(experts) != list(range(n)) or any(set(p) != {"gate_proj", "up_proj", "down_proj"}
                                                         for p in experts.values()):
                have = {e: sorted(p) for e, p in sorted(experts.items())}
                raise CompressedTensorsError(f"{base}: per-expert projections are incomplete: expected experts "
                                             f"0..{n - 1} each with gate_proj, up_proj, down_proj; found {have}")
            for fused, projs in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
                members = [[experts[e][p] for p in projs] for e in range(n)]
                kinds = {self.tensors[x].kind for row in members for x in row}
                if len(kinds) != 1:
                    raise CompressedTensorsError(f"{base}.{fused}: experts mix storage kinds {sorted(kinds)}; "
                                                 "every expert projection must share one scheme to be fused")
                shapes = [[self.tensors[x].shape for x in row] for row in members]
                if any(s != shapes[0] for s in shapes) or len({s[1] for s in shapes[0]}) != 1:
                    raise CompressedTensorsError(f"{base}.{fused}: expert projection shapes differ: {shapes[:4]}")
                out = sum(s[0] for s in shapes[0])
                entries[f"{base}.{fused}"] = _Entry("experts", (n, out, shapes[0][0][1]), members=members)
                for row in members:
                    for x in row:
                        del entries[x]
        return entries

    def _check(self, cfg: ModelConfig) -> None:
        """Check the scheme of every quantized tensor the model uses (vision towers, lm_head and the unused k/v
        copies of KV-shared layers are never read, so their schemes do not matter). One error for all failures,
        naming the first tensor and counting the rest."""
        prefix = text_prefix(self.entries)
        expected = cfg.param_shapes()
        shared = {s.index for s in cfg.layers if not s.owns_kv}
        failures: list[tuple[str, str]] = []  # (tensor, message)
        for logical, e in self.entries.items():
            if e.kind == "plain" or not logical.startswith(prefix) or NON_TEXT.search(logical):
                continue
            local = logical[len(prefix):]
            m = re.match(r"layers\.(\d+)\.(.*)$", local)
            if local not in expected or (m and int(m.group(1)) in shared and m.group(2) in KV_SHARED_EXTRAS):
                continue
            for name in ([x for row in e.members for x in row] if e.kind == "experts" else [logical]):
                sub = self.tensors[name]
                if sub.kind == "plain":
                    continue
                try:
                    kind = self._kind_of(name)
                except CompressedTensorsError as err:
                    failures.append((self._main(name), str(err)))
                    continue
                if kind != sub.kind:
                    msg = (f"{self._main(name)}: stored as {sub.kind} ({', '.join(sorted(sub.parts))}) but its "
                           f"config group says {kind}")
                    failures.append((self._main(name), msg))
                    continue
                self.kinds[kind] = self.kinds.get(kind, 0) + 1
        if failures:
            extra = ""
            if len(failures) > 1:
                more = ", ".join(t for t, _ in failures[1:4])
                extra = f"\n(and {len(failures) - 1} more tensors: {more}{', ...' if len(failures) > 4 else ''})"
            raise CompressedTensorsError(failures[0][1] + extra)

    def _main(self, logical: str) -> str:
        """The stored tensor that carries the weight of `logical` (for messages)."""
        p = self.tensors[logical].parts
        return p.get("weight_packed") or p.get("weight") or logical

    def _kind_of(self, logical: str) -> str:
        module = logical[: -len(".weight")]
        if self.qconfig.is_ignored(module):
            raise CompressedTensorsError(f"{self._main(logical)}: is quantized, but quantization_config.ignore "
                                         f"lists its module {module!r}")
        group = self.qconfig.group_for(module)
        if group is None:
            raise CompressedTensorsError(f"{self._main(logical)}: is quantized, but no config group targets "
                                         f"{module!r} (targets: {[list(g.targets) for g in self.qconfig.groups]})")
        return serving_kind(group, self._main(logical))

    # -- access ------------------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.infos.values())

    @property
    def scheme_name(self) -> str:
        """The gemmajax scheme the used tensors are served in: "w4a16", "w8a8", both joined by "+", or "none"."""
        names = [{"int4": "w4a16", "int8": "w8a8"}[k] for k in sorted(self.kinds, reverse=True)]
        return "+".join(names) or "none"

    def read(self, name: str) -> np.ndarray | QuantArray:
        """Logical tensor `name`: numpy for plain tensors, a numpy-backed QuantArray (dtype bf16 until the builder
        sets the model's) for quantized ones."""
        e = self.entries[name]
        if e.kind == "plain":
            return load_tensor(self.infos[name])
        pad = _TABLE_PAD.get(e.kind) if name.endswith(_TABLES) else None
        if e.kind == "experts":
            return self._read_experts(name, e)
        levels, scale = self._levels(name, e)
        if e.kind == "int4":
            return int4_quantarray(levels, scale, pad_in_to=pad)
        return int8_quantarray(levels, scale, pad_in_to=pad or INT8_PAD_IN)

    def _levels(self, logical: str, e: _Entry) -> tuple[np.ndarray, np.ndarray]:
        """(levels int8 [out, in], scale [out, groups] (int4) or [out] (int8)) as stored; checks layouts."""
        p = e.parts
        out, inp = e.shape
        scale = np.asarray(load_tensor(self.infos[p["weight_scale"]]))
        if scale.dtype.kind not in "f" and scale.dtype != ml_dtypes.bfloat16:
            raise CompressedTensorsError(f"{p['weight_scale']}: scale dtype {scale.dtype}, expected a float type")
        if "weight_zero_point" in p:
            zp = np.asarray(load_tensor(self.infos[p["weight_zero_point"]]))
            if np.any(zp != 0):
                raise CompressedTensorsError(f"{p['weight_zero_point']}: non-zero zero points (asymmetric "
                                             f"quantization) are not served; {_SUPPORTED}")
        if e.kind == "int4":
            packed = load_tensor(self.infos[p["weight_packed"]])
            want = (out, -(-inp // 8))
            if packed.dtype != np.int32 or tuple(packed.shape) != want:
                raise CompressedTensorsError(f"{p['weight_packed']}: expected int32 {want} for weight_shape "
                                             f"{[out, inp]}, found {packed.dtype} {tuple(packed.shape)}")
            if tuple(scale.shape) != (out, -(-inp // INT4_GROUP)):
                raise CompressedTensorsError(f"{p['weight_scale']}: expected shape {(out, -(-inp // INT4_GROUP))} "
                                             f"(one scale per group of {INT4_GROUP}), found {tuple(scale.shape)}")
            if "weight_g_idx" in p:
                g_idx = np.asarray(load_tensor(self.infos[p["weight_g_idx"]])).reshape(-1)
                if not np.array_equal(g_idx, np.arange(inp) // INT4_GROUP):
                    raise CompressedTensorsError(f"{p['weight_g_idx']}: activation reordering (actorder groups) is "
                                                 f"not served; {_SUPPORTED}")
            return unpack_int32_nibbles(packed, inp), scale
        values = load_tensor(self.infos[p["weight"]])
        if values.dtype != np.int8:
            raise CompressedTensorsError(f"{p['weight']}: int-quantized weight must be int8, found {values.dtype}")
        if scale.size == 1:  # strategy "tensor": one scale, exactly the same as that scale on every row
            scale = np.full((out,), scale.reshape(()), scale.dtype)
        elif tuple(scale.shape) in ((out, 1), (out,)):
            scale = scale.reshape(out)
        else:
            raise CompressedTensorsError(f"{p['weight_scale']}: expected shape {(out, 1)} (one scale per output "
                                         f"channel), found {tuple(scale.shape)}")
        return np.asarray(values), scale

    def _read_experts(self, name: str, e: _Entry) -> np.ndarray | QuantArray:
        """Stack per-expert projections: rows of gate then up per expert ([E, 2F, D]), or down ([E, D, F])."""
        kind = self.tensors[e.members[0][0]].kind
        if kind == "plain":
            return np.stack([np.concatenate([np.asarray(load_tensor(self.infos[x])) for x in row], axis=0)
                             for row in e.members])
        levels, scales = [], []
        for row in e.members:
            lv, sc = zip(*(self._levels(x, self.tensors[x]) for x in row))
            levels.append(np.concatenate(lv, axis=0))
            scales.append(np.concatenate(sc, axis=0))
        if kind == "int4":
            sdt = {s.dtype for s in scales}
            sc = np.stack([s.astype(np.float32) for s in scales]) if len(sdt) > 1 else np.stack(scales)
            return int4_quantarray(np.stack(levels), sc)
        return int8_quantarray(np.stack(levels), np.stack(scales))


def open_compressed(ckpt_dir: str | os.PathLike, hf: dict) -> Checkpoint:
    """A compressed-tensors checkpoint directory as a loader `Checkpoint` (kind "compressed-tensors"). Checks every
    used tensor's scheme; reads no weights."""
    ckpt_dir = os.fspath(ckpt_dir)
    cfg = ModelConfig.from_hf(hf, name=os.path.basename(ckpt_dir.rstrip("/")))
    ct = CompressedTensorsCheckpoint(ckpt_dir, hf, cfg)
    c = Checkpoint(cfg, hf, ct.names, ct.shape_of, ct.read, ct.total_bytes, ckpt_dir, KIND)
    c.compressed = ct  # the loader's Model reports ct.scheme_name
    return c


def build_compressed(c: Checkpoint, prefix: str, dtype, quantize: Callable | None = None,
                     progress: bool | None = None) -> gemma.Weights:
    """The Weights tree of a compressed-tensors checkpoint: its QuantArrays as converted (never quantized again),
    plain tensors cast like `loader.build_from_getter` does (norms float32 with the Gemma 3 offset folded in after
    rounding to `dtype`). `quantize(name, array)` applies to the plain tensors only (e.g. quant="+emb4" tables)."""
    dtype = jnp.dtype({"bf16": "bfloat16", "fp32": "float32", "f32": "float32"}.get(dtype, dtype))
    cfg = c.config
    bar = None
    if progress is None:
        progress = c.total_bytes > (1 << 30) and sys.stderr.isatty()
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=c.total_bytes, unit="B", unit_scale=True, desc="loading weights")

    def get(name: str):
        a = c.read(prefix + name)
        if isinstance(a, QuantArray):
            if bar is not None:
                bar.update(a.nbytes)
            return QuantArray(jnp.asarray(a.values), jnp.asarray(a.scale), a.kind, a.shape, a.group, dtype)
        a = np.asarray(a)
        if bar is not None:
            bar.update(a.nbytes)
        if gemma.is_norm(name):
            w = a.astype(np.float32)
            if dtype != jnp.float32:  # HF keeps the stored value in the model dtype before upcasting
                w = np.asarray(jnp.asarray(w).astype(dtype).astype(jnp.float32))
            return jnp.asarray(w + np.float32(cfg.norm_offset))
        return jnp.asarray(a).astype(dtype) if a.dtype != dtype else jnp.asarray(a)

    def requantize_guard(name: str, leaf):
        return leaf if isinstance(leaf, QuantArray) or quantize is None else quantize(name, leaf)

    w = gemma.build_weights(cfg, get, quantize=requantize_guard)
    if bar is not None:
        bar.close()
    return w


def quant_name(c: Checkpoint, quant: str | None) -> str:
    """The scheme a compressed-tensors model runs in: the checkpoint's, plus what `quant` added on load."""
    base = c.compressed.scheme_name
    if quant in (None, "", "none"):
        return base
    return f"{base} (+ {quant} on the unquantized tensors)"


__all__ = ["CompressedTensorsCheckpoint", "CompressedTensorsConfig", "CompressedTensorsError", "QuantArgs",
           "SchemeGroup", "build_compressed", "int4_quantarray", "int8_quantarray",
           "open_compressed", "parse_quantization_config", "quant_name", "serving_kind", "unpack_int32_nibbles"]
