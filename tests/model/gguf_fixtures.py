"""Tiny GGUF files written the way llama.cpp's converter (conversion/gemma.py) writes Gemma 3 and Gemma 4.

Tensor names come from the gguf package's own HF -> GGUF map (gguf.get_tensor_name_map), not from
gemmajax's table, so a test reading these files back checks gemmajax's inverse against an independent source.
"""
from __future__ import annotations

import re

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

TINY_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"tok{i}" for i in range(4, 64)]


def randomize(state: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 numpy copies of a torch state dict with every value random (norms included, so an offset
    forgotten or applied twice shows)."""
    rng = np.random.default_rng(seed)
    return {k: rng.normal(0.0, 0.5, tuple(v.shape)).astype(np.float32) for k, v in state.items()}


def encode(arr: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(what to hand GGUFWriter.add_tensor, the float32 values a correct reader must return)."""
    if qtype == Q.F32:
        return arr, arr
    if qtype == Q.F16:
        return arr.astype(np.float16), arr.astype(np.float16).astype(np.float32)
    q = gguf.quants.quantize(arr, qtype)
    return q, gguf.quants.dequantize(q, qtype).reshape(arr.shape)


def gguf_name(arch: gguf.MODEL_ARCH, num_layers: int, hf_name: str) -> str:
    """The name llama.cpp's converter gives an HF tensor (Gemma4Model.filter_tensors / modify_tensors)."""
    m = re.match(r"model\.layers\.(\d+)\.router\.(scale|per_expert_scale)$", hf_name)
    if m:
        return f"blk.{m.group(1)}." + ("ffn_gate_inp.scale" if m.group(2) == "scale" else "ffn_down_exps.scale")
    if hf_name.endswith("layer_scalar") or (".experts." in hf_name and not hf_name.endswith(".weight")):
        hf_name += ".weight"
    base, suffix = hf_name.rsplit(".", 1)
    mapped = gguf.get_tensor_name_map(arch, num_layers).get_name(base)
    if mapped is None:
        raise KeyError(f"gguf's tensor map has no name for {hf_name}")
    return f"{mapped}.{suffix}"


def _tokenizer(w: gguf.GGUFWriter, tokens: list[str]) -> None:
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types([3 if t.startswith("<") else 1 for t in tokens])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)
    w.add_add_space_prefix(False)


def write_gemma3(path: str, cfg, state: dict[str, np.ndarray], qtypes: dict[str, Q] | None = None,
                 drop: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None,
                 arch_name: str = "gemma3") -> dict[str, np.ndarray]:
    """Write `state` (HF names) as Gemma3Model does: norms + 1, tied lm_head dropped. cfg: a Gemma3TextConfig.
    qtypes: HF name -> storage type (default F32). Returns HF name -> the values a reader must produce."""
    qtypes = qtypes or {}
    L = cfg.num_hidden_layers
    w = gguf.GGUFWriter(path, arch_name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(L)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    _tokenizer(w, TINY_TOKENS[:cfg.vocab_size])
    expected = {}
    for hf, arr in state.items():
        if hf == "lm_head.weight" or hf in drop:
            continue
        name = gguf_name(gguf.MODEL_ARCH.GEMMA3, L, hf)
        stored = arr + np.float32(1.0) if name.endswith("norm.weight") else arr
        data, back = encode(stored, qtypes.get(hf, Q.F32))
        w.add_tensor(name, data, raw_dtype=None if data.dtype != np.uint8 else qtypes[hf])
        expected[hf] = back - np.float32(1.0) if name.endswith("norm.weight") else back
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def write_gemma4(path: str, hp: dict, state: dict[str, np.ndarray], qtypes: dict[str, Q] | None = None,
                 shared_kv_extras: bool = True) -> dict[str, np.ndarray]:
    """Write `state` as Gemma4Model does (no norm offset, per-layer metadata arrays, rope_freqs). hp: the
    published-dialect config dict (global_head_dim, num_global_key_value_heads, rope_parameters, ...).
    shared_kv_extras: also write the k copies of KV-shared layers that some exports carry (to be ignored)."""
    qtypes = qtypes or {}
    L = hp["num_hidden_layers"]
    swa = [t == "sliding_attention" for t in hp["layer_types"]]
    first_shared = L - hp["num_kv_shared_layers"]
    w = gguf.GGUFWriter(path, "gemma4")
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_block_count(L)
    ff = hp["intermediate_size"]
    w.add_feed_forward_length([ff if i < first_shared else 2 * ff for i in range(L)] if hp["use_double_wide_mlp"]
                              else ff)
    w.add_head_count(hp["num_attention_heads"])
    kv, kv_full = hp["num_key_value_heads"], hp.get("num_global_key_value_heads")
    w.add_head_count_kv([kv if s else kv_full for s in swa] if kv_full is not None else kv)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hp["global_head_dim"])
    w.add_value_length(hp["global_head_dim"])
    w.add_key_length_swa(hp["head_dim"])
    w.add_value_length_swa(hp["head_dim"])
    rope_full = hp["rope_parameters"]["full_attention"]
    w.add_rope_freq_base(rope_full["rope_theta"])
    w.add_rope_freq_base_swa(hp["rope_parameters"]["sliding_attention"]["rope_theta"])
    w.add_rope_dimension_count(hp["global_head_dim"])
    w.add_rope_dimension_count_swa(hp["head_dim"])
    w.add_sliding_window(hp["sliding_window"])
    w.add_sliding_window_pattern(swa)
    w.add_shared_kv_layers(hp["num_kv_shared_layers"])
    w.add_embedding_length_per_layer_input(hp.get("hidden_size_per_layer_input") or 0)
    if hp.get("enable_moe_block"):
        w.add_expert_count(hp["num_experts"])
        w.add_expert_used_count(hp["top_k_experts"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    _tokenizer(w, TINY_TOKENS[:hp["vocab_size"]])
    n_rot = int(hp["global_head_dim"] * rope_full["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * n_rot + [1e30] * (hp["global_head_dim"] // 2 - n_rot),
                                               np.float32))
    expected = {}
    for hf, arr in state.items():
        if hf == "lm_head.weight":
            continue
        data, back = encode(arr, qtypes.get(hf, Q.F32))
        w.add_tensor(gguf_name(gguf.MODEL_ARCH.GEMMA4, L, hf), data,
                     raw_dtype=None if data.dtype != np.uint8 else qtypes[hf])
        expected[hf] = back
    if shared_kv_extras:
        for i in range(first_shared, L):
            hd = hp["head_dim"] if swa[i] else hp["global_head_dim"]
            w.add_tensor(f"blk.{i}.attn_k.weight", np.zeros((kv * hd, hp["hidden_size"]), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected
