"""ModelConfig: one frozen, hashable description of a Gemma 4 (or Gemma 3) text decoder.

Built from a Hugging Face config.json (either dialect: `global_head_dim` / `num_global_key_value_heads`
or transformers' `per_layer_config`) or from a preset. The per-layer geometry (head dim, KV heads,
window, RoPE, K=V, KV-sharing source, MLP width) is derived once, here, into `LayerSpec`s, so model,
cache and engine code never re-derive it. Anything this code cannot serve is rejected naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

SLIDING, FULL = "sliding", "full"
_HF_LAYER_TYPES = {"sliding_attention": SLIDING, "full_attention": FULL}

GEMMA4_TYPES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")
GEMMA3_TYPES = ("gemma3", "gemma3_text")


class ConfigError(ValueError):
    """A config.json that gemmajax cannot serve; the message names the field."""


@dataclass(frozen=True)
class LayerSpec:
    """Static geometry of one decoder layer."""

    index: int
    kind: str               # "sliding" | "full"
    head_dim: int           # H: 256 sliding / 512 full on Gemma 4
    num_kv_heads: int       # K
    window: int | None      # sliding window W (a query at p sees keys j with p - j < W); None for full layers
    rope_theta: float
    rope_dims: int          # number of rotated frequency pairs (H // 2 for full rotation)
    rope_denominator: int   # inv_freq[j] = theta ** (-2j / rope_denominator) / rope_scale, j < rope_dims
    rope_scale: float       # linear RoPE scaling factor (Gemma 3 large models); 1.0 otherwise
    k_eq_v: bool            # V is the (v-normed) raw K projection; no v_proj
    kv_source: int          # layer whose K/V this layer attends over (== index when it owns its cache)
    mlp_dim: int            # F

    @property
    def owns_kv(self) -> bool:
        return self.kv_source == self.index


@dataclass(frozen=True)
class ModelConfig:
    """Frozen, hashable model description. Use `ModelConfig.from_hf(dict)` or `ModelConfig.preset(name)`."""

    family: str                      # "gemma4" | "gemma3"
    model_type: str                  # the HF model_type it came from
    vocab_size: int
    hidden_size: int                 # D
    num_heads: int                   # N
    layers: tuple[LayerSpec, ...]
    rms_norm_eps: float = 1e-6
    attn_scale: float = 1.0          # Gemma 4: 1.0; Gemma 3: query_pre_attn_scalar ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    use_v_norm: bool = True          # Gemma 4 normalizes V (weightless RMSNorm)
    use_layer_scalar: bool = True    # Gemma 4 multiplies the residual stream by a learned scalar per layer
    norm_offset: float = 0.0         # Gemma 3 stores RMSNorm weights as w with the multiplier 1 + w
    ple_dim: int = 0                 # P: per-layer-input dim (E2B/E4B: 256)
    ple_vocab_size: int = 0
    num_experts: int = 0             # E (26B-A4B: 128)
    top_k_experts: int = 0
    moe_dim: int = 0                 # expert MLP width (26B-A4B: 704)
    max_position_embeddings: int = 131072
    bos_token_id: int = 2
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 0
    name: str = ""

    # ------------------------------------------------------------------ derived
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def enable_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Indices of the layers that own a KV cache, in order (their position is the cache slot)."""
        return tuple(s.index for s in self.layers if s.owns_kv)

    @property
    def kv_slot(self) -> dict[int, int]:
        """layer index -> cache slot of the layer whose K/V it reads."""
        slots = {li: n for n, li in enumerate(self.kv_layers)}
        return {s.index: slots[s.kv_source] for s in self.layers}

    @property
    def first_shared_layer(self) -> int:
        """Index of the first KV-shared layer (num_layers when there are none)."""
        return next((s.index for s in self.layers if not s.owns_kv), self.num_layers)

    def kv_bytes_per_token(self, bytes_per_value: float = 2.0, windowed: bool = False, context: int = 0) -> float:
        """KV bytes one token costs. With `windowed`, sliding layers cost at most `window` tokens of a
        `context`-long sequence, so the per-token figure is averaged over that context."""
        total = 0.0
        for li in self.kv_layers:
            s = self.layers[li]
            per_tok = 2 * s.num_kv_heads * s.head_dim * bytes_per_value
            if windowed and s.window is not None and context > 0:
                per_tok *= min(s.window, context) / context
            total += per_tok
        return total

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face tensor name (without prefix) -> shape, for every tensor this model needs."""
        D, shapes = self.hidden_size, {}
        shapes["embed_tokens.weight"] = (self.vocab_size, D)
        shapes["norm.weight"] = (D,)
        if self.ple_dim:
            LP = self.num_layers * self.ple_dim
            shapes["embed_tokens_per_layer.weight"] = (self.ple_vocab_size, LP)
            shapes["per_layer_model_projection.weight"] = (LP, D)
            shapes["per_layer_projection_norm.weight"] = (self.ple_dim,)
        for s in self.layers:
            p = f"layers.{s.index}."
            for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm"):
                shapes[p + n + ".weight"] = (D,)
            if self.use_layer_scalar:
                shapes[p + "layer_scalar"] = (1,)
            a = p + "self_attn."
            shapes[a + "q_proj.weight"] = (self.num_heads * s.head_dim, D)
            shapes[a + "q_norm.weight"] = (s.head_dim,)
            shapes[a + "o_proj.weight"] = (D, self.num_heads * s.head_dim)
            if s.owns_kv:
                shapes[a + "k_proj.weight"] = (s.num_kv_heads * s.head_dim, D)
                shapes[a + "k_norm.weight"] = (s.head_dim,)
                if not s.k_eq_v:
                    shapes[a + "v_proj.weight"] = (s.num_kv_heads * s.head_dim, D)
            shapes[p + "mlp.gate_proj.weight"] = (s.mlp_dim, D)
            shapes[p + "mlp.up_proj.weight"] = (s.mlp_dim, D)
            shapes[p + "mlp.down_proj.weight"] = (D, s.mlp_dim)
            if self.ple_dim:
                shapes[p + "per_layer_input_gate.weight"] = (self.ple_dim, D)
                shapes[p + "per_layer_projection.weight"] = (D, self.ple_dim)
                shapes[p + "post_per_layer_input_norm.weight"] = (D,)
            if self.enable_moe:
                E, F = self.num_experts, self.moe_dim
                shapes[p + "router.proj.weight"] = (E, D)
                shapes[p + "router.scale"] = (D,)
                shapes[p + "router.per_expert_scale"] = (E,)
                shapes[p + "experts.gate_up_proj"] = (E, 2 * F, D)
                shapes[p + "experts.down_proj"] = (E, D, F)
                for n in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"):
                    shapes[p + n + ".weight"] = (D,)
        return shapes

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "") -> "ModelConfig":
        """Build from a Hugging Face config.json dict (Gemma 4 or Gemma 3, nested or text-only)."""
        mt = cfg.get("model_type")
        if mt in ("gemma4", "gemma4_unified", "gemma3") and "text_config" in cfg:
            text = dict(cfg["text_config"] or {})
            text.setdefault("model_type", mt + "_text")
            for k in ("bos_token_id", "pad_token_id"):  # top-level ids win only where the text config lacks them
                if k in cfg and k not in text:
                    text[k] = cfg[k]
            if "eos_token_id" in cfg:
                text["eos_token_id"] = cfg["eos_token_id"]
            cfg = text
            mt = cfg["model_type"]
        if mt in GEMMA4_TYPES:
            return _from_gemma4(cfg, name)
        if mt in GEMMA3_TYPES:
            return _from_gemma3(cfg, name)
        raise ConfigError(
            f"config.json: model_type {mt!r} is not supported; expected one of {GEMMA4_TYPES + GEMMA3_TYPES}")

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        with open(path) as f:
            return cls.from_hf(json.load(f), name=os.path.basename(os.path.dirname(os.path.abspath(path))))

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """One of the five published Gemma 4 sizes: e2b, e4b, 12b, 26b-a4b, 31b."""
        key = name.lower().replace("gemma-4-", "").replace("_", "-").removesuffix("-it")
        if key not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        return cls.from_hf(PRESETS[key], name=key)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


# ---------------------------------------------------------------------------- HF parsing

def _req(cfg: dict, key: str, types=(int,)):
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"config.json: required field {key!r} is missing")
    v = cfg[key]
    if not isinstance(v, types) or isinstance(v, bool) and bool not in types:
        raise ConfigError(f"config.json: field {key!r} must be {'/'.join(t.__name__ for t in types)}, got {v!r}")
    return v


def _positive(cfg: dict, key: str) -> int:
    v = _req(cfg, key)
    if v <= 0:
        raise ConfigError(f"config.json: field {key!r} must be > 0, got {v}")
    return v


def _core_fields(cfg: dict) -> tuple[int, int, int, int, int, int, int]:
    """(layers, hidden, heads, KV heads, MLP width, vocab, head dim): required and positive in every dialect."""
    L, D, N, K, F, V = (_positive(cfg, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                    "num_key_value_heads", "intermediate_size", "vocab_size"))
    return L, D, N, K, F, V, cfg.get("head_dim") or D // N


def _layer_kinds(cfg: dict, num_layers: int, default_period: int) -> list[str]:
    lt = cfg.get("layer_types")
    if lt is None:
        period = cfg.get("sliding_window_pattern") or default_period
        lt = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)]
    if len(lt) != num_layers:
        raise ConfigError(f"config.json: 'layer_types' has {len(lt)} entries, expected num_hidden_layers={num_layers}")
    kinds = []
    for i, t in enumerate(lt):
        if t not in _HF_LAYER_TYPES:
            raise ConfigError(f"config.json: layer_types[{i}] = {t!r}; expected 'sliding_attention' or 'full_attention'")
        kinds.append(_HF_LAYER_TYPES[t])
    return kinds


def _eos(cfg: dict) -> tuple[int, ...]:
    e = cfg.get("eos_token_id", 1)
    return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)


def _rope(params: dict | None, kind: str, head_dim: int, field_name: str) -> tuple[float, int, int, float]:
    """(theta, rotated pairs, exponent denominator, linear scale) for one layer kind."""
    params = dict(params or {})
    rtype = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 1e6 if kind == FULL else 1e4))
    if rtype == "default":
        return theta, head_dim // 2, head_dim, 1.0
    if rtype == "linear":
        return theta, head_dim // 2, head_dim, float(params.get("factor", 1.0))
    if rtype == "proportional":
        frac = float(params.get("partial_rotary_factor", 1.0))
        factor = float(params.get("factor", 1.0))
        return theta, int(frac * head_dim // 2), head_dim, factor
    raise ConfigError(f"config.json: {field_name}.rope_type {rtype!r} is not supported "
                      "(expected 'default', 'linear' or 'proportional')")


def _from_gemma4(cfg: dict, name: str) -> ModelConfig:
    L, D, N, K, F, V, hd = _core_fields(cfg)
    unified = cfg.get("model_type", "").startswith("gemma4_unified")
    if cfg.get("use_bidirectional_attention") == "all":
        raise ConfigError("config.json: use_bidirectional_attention='all' (a non-causal text model) is not supported")
    if cfg.get("attention_bias"):
        raise ConfigError("config.json: attention_bias=true is not supported (no released Gemma 4 uses it)")
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"config.json: hidden_activation {act!r} is not supported; expected 'gelu_pytorch_tanh'")
    kinds = _layer_kinds(cfg, L, 6)
    if kinds[-1] != FULL:  # HF forces the last layer to full attention
        kinds[-1] = FULL
    window = int(cfg.get("sliding_window") or (1024 if unified else 512))
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    # transformers' dialect (a per_layer_config key, even empty) omits what equals the base: a full layer with no
    # override has head_dim; the other dialect's missing global_head_dim means its 512 default
    global_hd = cfg.get("global_head_dim", hd if "per_layer_config" in cfg else 512)
    global_kv = cfg.get("num_global_key_value_heads")
    per_layer = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items() if str(k).isdigit()}
    rope = cfg.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
    shared = int(cfg.get("num_kv_shared_layers", 0) or 0)
    if not 0 <= shared <= L:
        raise ConfigError(f"config.json: num_kv_shared_layers={shared} must be in [0, num_hidden_layers={L}]")
    first_shared = L - shared
    if shared == L:
        raise ConfigError("config.json: num_kv_shared_layers equals num_hidden_layers: no layer would own a KV cache")
    producer = {}
    for i in range(first_shared):
        producer[kinds[i]] = i  # the last non-shared layer of each kind
    for i in range(first_shared, L):
        if kinds[i] not in producer:
            raise ConfigError(f"config.json: KV-shared layer {i} is {kinds[i]} but no earlier layer of that kind "
                              "owns a KV cache (num_kv_shared_layers too large)")
    ple = 0 if unified else int(cfg.get("hidden_size_per_layer_input", 256) or 0)
    moe = (not unified) and bool(cfg.get("enable_moe_block", False))
    E = topk = moe_dim = 0
    if moe:
        E, topk, moe_dim = (_positive(cfg, "num_experts"), _positive(cfg, "top_k_experts"),
                            _positive(cfg, "moe_intermediate_size"))
        if topk > E:
            raise ConfigError(f"config.json: top_k_experts={topk} exceeds num_experts={E}")
    double = bool(cfg.get("use_double_wide_mlp", False))

    layers = []
    for i, kind in enumerate(kinds):
        if kind == SLIDING:
            lhd, lkv = hd, K
        else:
            lhd = global_hd
            lkv = global_kv if (k_eq_v and global_kv) else K
        if i in per_layer:  # transformers' own dialect: explicit overrides per layer
            lhd = per_layer[i].get("head_dim", lhd)
            lkv = per_layer[i].get("num_key_value_heads", lkv)
        if N % lkv:
            raise ConfigError(f"config.json: layer {i}: num_attention_heads={N} is not a multiple of its "
                              f"KV heads ({lkv})")
        rkey = "sliding_attention" if kind == SLIDING else "full_attention"
        theta, rdims, rden, rscale = _rope(rope.get(rkey), kind, lhd, f"rope_parameters.{rkey}")
        src = i if i < first_shared else producer[kind]
        layers.append(LayerSpec(
            index=i, kind=kind, head_dim=int(lhd), num_kv_heads=int(lkv),
            window=window if kind == SLIDING else None, rope_theta=theta, rope_dims=rdims,
            rope_denominator=rden, rope_scale=rscale, k_eq_v=k_eq_v and kind == FULL, kv_source=src,
            mlp_dim=F * (2 if double and i >= first_shared else 1)))
    softcap = cfg.get("final_logit_softcapping")
    return ModelConfig(
        family="gemma4", model_type=cfg.get("model_type", "gemma4_text"), vocab_size=V, hidden_size=D,
        num_heads=N, layers=tuple(layers), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), attn_scale=1.0,
        final_logit_softcap=float(softcap) if softcap else None, use_v_norm=True, use_layer_scalar=True,
        ple_dim=ple, ple_vocab_size=int(cfg.get("vocab_size_per_layer_input", V)) if ple else 0,
        num_experts=E, top_k_experts=topk, moe_dim=moe_dim,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
        bos_token_id=int(cfg.get("bos_token_id", 2)), eos_token_ids=_eos(cfg),
        pad_token_id=int(cfg.get("pad_token_id", 0) or 0), name=name)


def _from_gemma3(cfg: dict, name: str) -> ModelConfig:
    L, D, N, K, F, V, hd = _core_fields(cfg)
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("config.json: use_bidirectional_attention=true (EmbeddingGemma) is not supported")
    kinds = _layer_kinds(cfg, L, 6)
    window = cfg.get("sliding_window") or 4096
    rope = cfg.get("rope_parameters")
    if not rope or "full_attention" not in rope:
        full = {"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 1e6))}
        if cfg.get("rope_scaling"):
            full.update(cfg["rope_scaling"])
        rope = {"full_attention": full,
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": float(cfg.get("rope_local_base_freq", 1e4))}}
    layers = []
    for i, kind in enumerate(kinds):
        rkey = "sliding_attention" if kind == SLIDING else "full_attention"
        theta, rdims, rden, rscale = _rope(rope.get(rkey), kind, hd, f"rope_parameters.{rkey}")
        layers.append(LayerSpec(index=i, kind=kind, head_dim=hd, num_kv_heads=K,
                                window=int(window) if kind == SLIDING else None, rope_theta=theta,
                                rope_dims=rdims, rope_denominator=rden, rope_scale=rscale, k_eq_v=False,
                                kv_source=i, mlp_dim=F))
    qpas = cfg.get("query_pre_attn_scalar", hd)
    fsc, asc = cfg.get("final_logit_softcapping"), cfg.get("attn_logit_softcapping")
    return ModelConfig(
        family="gemma3", model_type=cfg.get("model_type", "gemma3_text"), vocab_size=V, hidden_size=D,
        num_heads=N, layers=tuple(layers), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        attn_scale=float(qpas) ** -0.5, attn_logit_softcap=float(asc) if asc else None,
        final_logit_softcap=float(fsc) if fsc else None, use_v_norm=False, use_layer_scalar=False,
        norm_offset=1.0, max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
        bos_token_id=int(cfg.get("bos_token_id", 2)), eos_token_ids=_eos(cfg),
        pad_token_id=int(cfg.get("pad_token_id", 0) or 0), name=name)


# ---------------------------------------------------------------------------- presets
# The text_config of each published checkpoint (gemma4-text-configs.json in shared/reference); the layer
# pattern is written as its period since every published model is periodic with a full last layer.

def _g4(hidden, layers, heads, kv, global_kv, inter, period, window, *, ple=0, shared=0, double=False,
        k_eq_v=False, moe=None, unified=False, max_pos=262144):
    cfg = {
        "model_type": "gemma4_unified_text" if unified else "gemma4_text",
        "vocab_size": 262144, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "num_global_key_value_heads": global_kv, "head_dim": 256,
        "global_head_dim": 512, "intermediate_size": inter, "sliding_window": window,
        "layer_types": ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)],
        "hidden_size_per_layer_input": ple, "vocab_size_per_layer_input": 262144, "num_kv_shared_layers": shared,
        "use_double_wide_mlp": double, "attention_k_eq_v": k_eq_v, "final_logit_softcapping": 30.0,
        "max_position_embeddings": max_pos, "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": [1, 106],
        "pad_token_id": 0, "enable_moe_block": moe is not None,
    }
    if moe:
        cfg.update(num_experts=moe[0], top_k_experts=moe[1], moe_intermediate_size=moe[2])
    return cfg


PRESETS: dict[str, dict] = {
    "e2b": _g4(1536, 35, 8, 1, None, 6144, 5, 512, ple=256, shared=20, double=True, max_pos=131072),
    "e4b": _g4(2560, 42, 8, 2, None, 10240, 6, 512, ple=256, shared=18, max_pos=131072),
    "12b": _g4(3840, 48, 16, 8, 1, 15360, 6, 1024, k_eq_v=True, unified=True),
    "26b-a4b": _g4(2816, 30, 16, 8, 2, 2112, 6, 1024, k_eq_v=True, moe=(128, 8, 704)),
    "31b": _g4(5376, 60, 32, 16, 4, 21504, 6, 1024, k_eq_v=True),
}
