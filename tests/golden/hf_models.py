"""Tiny random Hugging Face Gemma 4 / Gemma 3 reference models, one per architectural variant.

Weights are randomized beyond HF's init (norms, layer_scalar, router scales are all ones there, which hides
bugs), and the final norm is large enough that logits reach the softcap. Each builder returns the torch model
(eager attention, float32) and its text config dict.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import torch

VOCAB = 512


def _g4_text(**kw) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, global_head_dim=64, sliding_window=8,
                final_logit_softcapping=30.0, max_position_embeddings=4096, hidden_size_per_layer_input=0,
                vocab_size_per_layer_input=VOCAB, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    base.update(kw)
    return base


def _period(n, p):
    return ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(n)]


VARIANTS: dict[str, dict] = {
    # E2B: PLE, KV sharing, double-wide MLP on shared layers, 4:1 pattern, one KV head
    "e2b": _g4_text(num_hidden_layers=10, layer_types=_period(10, 5), num_key_value_heads=1,
                    hidden_size_per_layer_input=16, num_kv_shared_layers=4, use_double_wide_mlp=True),
    # E4B: 5:1 pattern, KV sharing, PLE, two KV heads
    "e4b": _g4_text(num_hidden_layers=12, layer_types=_period(12, 6), num_key_value_heads=2,
                    hidden_size_per_layer_input=16, num_kv_shared_layers=5),
    # 31B: K=V full layers with their own (fewer) KV heads
    "31b": _g4_text(num_hidden_layers=6, layer_types=_period(6, 6), num_key_value_heads=2,
                    num_global_key_value_heads=1, attention_k_eq_v=True),
    # 26B-A4B: dense MLP + top-k MoE in every layer, K=V
    "26b": _g4_text(num_hidden_layers=6, layer_types=_period(6, 3), num_key_value_heads=2,
                    num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True, num_experts=8,
                    top_k_experts=2, moe_intermediate_size=32),
    # 12B: the gemma4_unified text config
    "12b": dict(model_type="gemma4_unified_text", **{k: v for k, v in _g4_text(
        num_hidden_layers=6, layer_types=_period(6, 6), num_key_value_heads=2, num_global_key_value_heads=1,
        attention_k_eq_v=True).items() if k not in ("hidden_size_per_layer_input", "vocab_size_per_layer_input")}),
}

# Overrides of VARIANTS["e2b"] for the engine files that compile dozens of step programs: E2B's features (per-layer
# embeddings, KV-shared sliding and full layers, one KV head, the double-wide MLP) in 6 layers with a 2:1 pattern
# instead of 10 with 4:1. A step program's compile time grows with its layers (each layer its own attention code;
# attention is about 2/3 of a tiny model's mixed-step compile). Measured under make test with empty caches (Zen 3,
# 2026-12-06, 10 layers -> 6): test_many_requests.py 158 -> 104 s, test_api_contract.py 143 -> 116, but
# test_spec_decode.py 332 -> 336, and the suite's total did not move (1875 -> 1893 s): per-file times under two
# workers vary by as much (docs/cpu_notes_2026-12-06.md, last section).
E2B_SMALL = {"num_hidden_layers": 6, "layer_types": _period(6, 3), "num_kv_shared_layers": 3}

GEMMA3 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
              layer_types=_period(6, 3), max_position_embeddings=4096, rope_theta=1e6, rope_local_base_freq=1e4,
              rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2)


_BLOCK_END_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm.", "post_per_layer_input_norm")


def _randomize(model: torch.nn.Module, seed: int, final_norm_scale: float = 1.0, block_gain: float = 1.0) -> None:
    """Random weights; `block_gain` multiplies the norms that end each block (post-attention, post-feedforward,
    post-PLE), so the blocks' outputs, not the token's own embedding, dominate the residual stream."""
    g = torch.Generator().manual_seed(seed)

    def rnd(shape, std=1.0, mean=0.0):
        return torch.randn(shape, generator=g) * std + mean

    def uni(shape, lo, hi):
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    gemma3 = "Gemma3" in type(model).__name__
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name or "embed_scale" in name or name.endswith("_scale") and "per_expert" not in name \
                    and "router" not in name:
                continue
            shape = p.shape
            if name.endswith("layer_scalar"):
                p.copy_(uni(shape, 0.5, 1.5))
            elif "norm" in name:
                if name in ("model.norm.weight",):
                    base = final_norm_scale - (1.0 if gemma3 else 0.0)
                    p.copy_(uni(shape, base - 0.5, base + 0.5))
                else:  # Gemma 3 stores w for 1 + w; Gemma 4 stores the multiplier itself
                    p.copy_(rnd(shape, 0.3) if gemma3 else uni(shape, 0.5, 1.5))
                    if block_gain != 1.0 and any(k in name for k in _BLOCK_END_NORMS):
                        p.copy_((p + 1) * block_gain - 1 if gemma3 else p * block_gain)
            elif "router.scale" in name or "per_expert_scale" in name:
                p.copy_(uni(shape, 0.5, 1.5))
            elif "embed_tokens" in name:
                p.copy_(rnd(shape, 1.0))
            elif p.ndim >= 2:
                p.copy_(rnd(shape, 1.0 / math.sqrt(shape[-1])))
            else:
                p.copy_(rnd(shape, 0.1))


def build_hf(variant: str, seed: int = 0, dtype=torch.float32, **overrides):
    """Return (torch model, text config dict) for a Gemma 4 variant name or 'gemma3'; `overrides` replace config
    fields (e.g. vocab_size=262144 for the real vocabulary)."""
    if variant == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        cfg = Gemma3TextConfig(**{**GEMMA3, **overrides})
        cfg._attn_implementation = "eager"
        model = Gemma3ForCausalLM(cfg)
    else:
        kw = {**VARIANTS[variant], **overrides}
        if "vocab_size" in overrides and "vocab_size_per_layer_input" in kw:
            kw["vocab_size_per_layer_input"] = overrides.get("vocab_size_per_layer_input", overrides["vocab_size"])
        if kw.get("model_type") == "gemma4_unified_text":
            from transformers.models.gemma4_unified import Gemma4UnifiedForCausalLM, Gemma4UnifiedTextConfig
            kw.pop("model_type")
            cfg = Gemma4UnifiedTextConfig(**kw)
            cfg._attn_implementation = "eager"
            model = Gemma4UnifiedForCausalLM(cfg)
        else:
            from transformers import Gemma4ForCausalLM, Gemma4TextConfig
            cfg = Gemma4TextConfig(**kw)
            cfg._attn_implementation = "eager"
            model = Gemma4ForCausalLM(cfg)
    _randomize(model, seed)
    model = model.to(dtype).eval()
    return model, json.loads(cfg.to_json_string())


# ---------------------------------------------------------------------------- random configs

FAMILIES = ("gemma4", "gemma4_unified", "gemma3")
# block_gain per family: the smallest found to give greedy continuations of many distinct tokens (at 1.0 every
# family's tied embedding makes the model repeat its input token, which hides position and cache bugs)
BLOCK_GAIN = {"gemma4": 8.0, "gemma4_unified": 8.0, "gemma3": 32.0}


def random_text_config(rng: np.random.Generator, family: str | None = None, **overrides) -> dict:
    """A tiny text config drawn from the whole space a config.json can describe, as HF keyword arguments plus a
    "family" key ("gemma4" | "gemma4_unified" | "gemma3"); `build_hf_config` builds it.

    Gemma 4 / unified: 2-8 layers, a periodic or an arbitrary layer_types list (the last layer full, as HF
    forces), sliding window 4-16, 1-4 query heads over 1-2 KV heads, head dims 16/32 sliding and 32/64 full,
    K=V full layers with their own num_global_key_value_heads, KV-shared layers (every kind the shared region uses
    has a producer before it, as HF requires) with or without the double-wide MLP, full-layer RoPE partial
    factor 0.25 / 0.5 / 1 or plain, final softcap on or off; gemma4 only: PLE and MoE (2-8 experts, top-k 1-E).
    Gemma 3: arbitrary layer_types, query_pre_attn_scalar, attention and final softcaps, linear RoPE scaling."""
    family = family or str(rng.choice(["gemma4", "gemma4", "gemma4", "gemma4_unified", "gemma3"]))
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    L = int(rng.integers(2, 9))
    if rng.random() < 0.5:
        types = _period(L, int(rng.integers(2, 7)))
    else:
        types = ["sliding_attention" if rng.random() < 0.65 else "full_attention" for _ in range(L)]
    heads = int(rng.choice([1, 2, 4]))
    kv = int(rng.choice([k for k in (1, 2) if heads % k == 0]))
    hd = int(rng.choice([16, 32]))
    cfg = dict(family=family, vocab_size=VOCAB, hidden_size=int(rng.choice([32, 64])),
               intermediate_size=int(rng.choice([48, 96])), num_hidden_layers=L, num_attention_heads=heads,
               num_key_value_heads=kv, head_dim=hd, sliding_window=int(rng.integers(4, 17)),
               max_position_embeddings=4096, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if family == "gemma3":
        types[-1] = types[-1] if rng.random() < 0.5 else "full_attention"
        scaling = None if rng.random() < 0.6 else {"rope_type": "linear", "factor": float(rng.choice([2.0, 8.0]))}
        full = {"rope_type": "default", "rope_theta": 1e6, **(scaling or {})}
        cfg.update(layer_types=types, query_pre_attn_scalar=int(rng.choice([hd, 2 * hd, hd // 2])),
                   attn_logit_softcapping=None if rng.random() < 0.6 else float(rng.choice([20.0, 50.0])),
                   final_logit_softcapping=None if rng.random() < 0.5 else 30.0,
                   rope_parameters={"full_attention": full,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
        cfg.update(overrides)
        return cfg
    types[-1] = "full_attention"
    partial = rng.choice([0.25, 0.5, 1.0, 0.0])
    full = ({"rope_type": "default", "rope_theta": 1e6} if partial == 0.0 else
            {"rope_type": "proportional", "partial_rotary_factor": float(partial), "rope_theta": 1e6})
    # global_head_dim == head_dim is left out: transformers then saves no per-layer override at all (an empty
    # per_layer_config), which gemmajax reads as the 512 default (tests/engine/test_vs_hf.py has that case)
    cfg.update(layer_types=types, global_head_dim=int(rng.choice([g for g in (32, 64) if g != hd])),
               final_logit_softcapping=None if rng.random() < 0.25 else 30.0,
               rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 1e4}})
    if rng.random() < 0.5:  # K=V full layers with their own KV heads (without K=V HF ignores the field)
        cfg["num_global_key_value_heads"] = int(rng.choice([k for k in (1, 2) if heads % k == 0]))
        cfg["attention_k_eq_v"] = bool(rng.random() < 0.8)
    shareable = [n for n in range(1, L) if set(types[:L - n]) == set(types)]
    both = [n for n in shareable if len(set(types[L - n:])) == 2]  # shared layers reading sliding and full producers
    if shareable and rng.random() < 0.6:
        cfg["num_kv_shared_layers"] = int(rng.choice(both if both and rng.random() < 0.75 else shareable))
        cfg["use_double_wide_mlp"] = bool(rng.random() < 0.5)
    if family == "gemma4":
        ple = int(rng.choice([0, 0, 8, 16]))
        cfg.update(hidden_size_per_layer_input=ple, vocab_size_per_layer_input=VOCAB)
        if rng.random() < 0.35:
            e = int(rng.integers(2, 9))
            cfg.update(enable_moe_block=True, num_experts=e, top_k_experts=int(rng.integers(1, e + 1)),
                       moe_intermediate_size=int(rng.choice([16, 32])))
    cfg.update(overrides)
    return cfg


def build_hf_config(text: dict, seed: int = 0, dtype=torch.float32, block_gain: float | None = None):
    """Return (torch model, text config dict as HF saves it) for a `random_text_config` dict (eager attention,
    weights as `_randomize` with the family's BLOCK_GAIN unless given)."""
    kw = dict(text)
    family = kw.pop("family")
    if family == "gemma3":
        from transformers import Gemma3ForCausalLM as Model
        from transformers import Gemma3TextConfig as Config
    elif family == "gemma4_unified":
        from transformers.models.gemma4_unified import Gemma4UnifiedForCausalLM as Model
        from transformers.models.gemma4_unified import Gemma4UnifiedTextConfig as Config
    else:
        from transformers import Gemma4ForCausalLM as Model
        from transformers import Gemma4TextConfig as Config
    cfg = Config(**kw)
    cfg._attn_implementation = "eager"
    model = Model(cfg)
    _randomize(model, seed, block_gain=BLOCK_GAIN[family] if block_gain is None else block_gain)
    model = model.to(dtype).eval()
    return model, json.loads(cfg.to_json_string())


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids, dtype=torch.long), use_cache=True)
    return out.logits.float().numpy()


def text_state_dict(model) -> dict[str, np.ndarray]:
    """The decoder's tensors under HF's text-only names (`model.` prefix), tied lm_head dropped, float32."""
    sd = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" or "inv_freq" in k or k.endswith("embed_scale"):
            continue
        sd[k] = v.detach().float().numpy()
    return sd


def save_text_checkpoint(model, cfg: dict, path: str) -> str:
    """A text-only save as transformers writes it (config.json + model.safetensors, `model.` keys)."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def save_released_layout(model, cfg: dict, path: str, shared_layers: list[int], seed: int = 1) -> str:
    """The layout of released multimodal checkpoints: nested config (`gemma4` with `text_config`), keys under
    `model.language_model.`, two shards with an index, unused k/v copies on KV-shared layers, vision tensors."""
    from gemmajax.model.safetensors_io import save_file
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    sd = {"model.language_model." + k[len("model."):]: v for k, v in text_state_dict(model).items()}
    D, hd, kvh = cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"]
    for i in shared_layers:  # Google's non-QAT exports still ship these for KV-shared layers; they are unused
        p = f"model.language_model.layers.{i}.self_attn."
        sd[p + "k_proj.weight"] = rng.standard_normal((kvh * hd, D)).astype(np.float32)
        sd[p + "v_proj.weight"] = rng.standard_normal((kvh * hd, D)).astype(np.float32)
        sd[p + "k_norm.weight"] = rng.standard_normal((hd,)).astype(np.float32)
    sd["model.vision_tower.encoder.layers.0.mlp.gate_proj.linear.weight"] = np.zeros((8, 4), np.float32)
    sd["model.embed_vision.embedding_projection.weight"] = np.zeros((D, 8), np.float32)
    sd["model.audio_tower.output_proj.weight"] = np.zeros((4, 4), np.float32)
    names = sorted(sd)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fn, keys in shards.items():
        save_file({k: sd[k] for k in keys}, os.path.join(path, fn))
        weight_map.update({k: fn for k in keys})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    text = dict(cfg)
    top_type = "gemma4_unified" if text.get("model_type") == "gemma4_unified_text" else "gemma4"
    nested = {"model_type": top_type, "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text,
              "vision_config": {"model_type": "gemma4_vision", "hidden_size": 8}, "eos_token_id": [1, 106]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(nested, f)
    return path


REAL_VOCAB = 262144


def save_real_vocab_checkpoint(path: str, gguf_file: str, variant: str = "e2b", seed: int = 0, **overrides) -> str:
    """A tiny random `variant` over the real 262,144-token Gemma 4 vocabulary, saved with its tokenizer.model (the
    GGUF's vocabulary with Gemma 4's special pieces), so LLM(path) and the chat template work as on a release."""
    from gemmajax.tools.tokenizer import gguf_to_gemma4_sp
    model, cfg = build_hf(variant, seed=seed, vocab_size=REAL_VOCAB, eos_token_id=[1, 106], **overrides)
    save_text_checkpoint(model, cfg, path)
    with open(os.path.join(path, "tokenizer.model"), "wb") as f:
        f.write(gguf_to_gemma4_sp(gguf_file))
    return path
