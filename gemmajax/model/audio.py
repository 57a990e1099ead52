"""The Gemma 4 audio encoders as pure functions over frozen dataclass pytrees, next to the text decoder.

- `Gemma4AudioModel` (E2B / E4B), a USM-style conformer: log-mel features [F, 128] -> two stride-2 3x3 conv blocks
  (conv, channel LayerNorm, ReLU; time and frequency / 4) -> Linear -> conformer layers (half-step feed-forward,
  chunked local self-attention with relative positions and a logit cap, light causal depthwise conv, half-step
  feed-forward, RMSNorm) -> output Linear (with bias) -> `embed_audio` (weightless RMSNorm + Linear).
- the 12B (`gemma4_unified`) encoder-free embedder: raw 640-sample waveform frames -> weightless RMSNorm -> Linear.

Design choices: HF's chunked attention (blocks of `chunk` queries over `chunk + left - 1 + right` keys, relative
logits realigned by a pad-and-reshape shift) equals a banded attention where query t sees keys t - d for
d in [-(right - 1), left - 2] (HF's sliding mask, `attention_context_left - 1` keys back including itself); it is
computed here in that banded form, with the relative-position term looked up per distance exactly as the shift
places it. Attention math is float32 as in HF (it upcasts q / k / v); linears run in the weights' dtype and go
through `quant.linear`, so QuantArrays may stand for them.

Einsum letters: B clips, T audio tokens (after subsampling), W keys per query (the band), N heads, H head dim,
D conformer width.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemmajax.model.gemma import pytree_dataclass, rms_norm, scale
from gemmajax.model.vision import ClippedLinear, _abstract_getter, _as_f32, _bounds, clipped_linear, layer_norm
from gemmajax.quant import linear

Array = jax.Array
f32 = jnp.float32
N_MELS = 128  # the feature extractor's mel bins; HF sizes the subsampler's output as (channels[0] // 4) * channels[1]


class AudioConfigError(ValueError):
    """An audio config this code cannot serve; the message names the field."""


@dataclasses.dataclass(frozen=True)
class AudioConfig:
    """Gemma4AudioModel geometry plus the text width its soft tokens are projected to (hashable: a jit static)."""

    hidden_size: int = 1024                    # D
    num_layers: int = 12
    num_heads: int = 8                         # N (H = D / N)
    subsampling_conv_channels: tuple[int, int] = (128, 32)
    conv_kernel_size: int = 5                  # light conv (depthwise, causal)
    residual_weight: float = 0.5               # feed-forward half step
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536
    text_hidden_size: int = 1536

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Released-checkpoint tensor name (without the leading `model.`) -> shape, for every tensor needed."""
        D, N, H = self.hidden_size, self.num_heads, self.head_dim
        c0, c1 = self.subsampling_conv_channels
        p = "audio_tower."
        s = p + "subsample_conv_projection."
        shapes = {s + "layer0.conv.weight": (c0, 1, 3, 3), s + "layer0.norm.weight": (c0,),
                  s + "layer1.conv.weight": (c1, c0, 3, 3), s + "layer1.norm.weight": (c1,),
                  s + "input_proj_linear.weight": (D, (N_MELS // 4) * c1)}
        clipped = {"self_attn.q_proj": (N * H, D), "self_attn.k_proj": (N * H, D), "self_attn.v_proj": (N * H, D),
                   "self_attn.post": (D, D), "lconv1d.linear_start": (2 * D, D), "lconv1d.linear_end": (D, D)}
        for ff in ("feed_forward1", "feed_forward2"):
            clipped[ff + ".ffw_layer_1"] = (4 * D, D)
            clipped[ff + ".ffw_layer_2"] = (D, 4 * D)
        for i in range(self.num_layers):
            lp = f"{p}layers.{i}."
            for n, shp in clipped.items():
                shapes[lp + n + ".linear.weight"] = shp
                if self.use_clipped_linears:
                    for b in ("input_min", "input_max", "output_min", "output_max"):
                        shapes[lp + n + "." + b] = ()
            for ff in ("feed_forward1", "feed_forward2"):
                shapes[lp + ff + ".pre_layer_norm.weight"] = (D,)
                shapes[lp + ff + ".post_layer_norm.weight"] = (D,)
            shapes[lp + "self_attn.per_dim_scale"] = (H,)
            shapes[lp + "self_attn.relative_k_proj.weight"] = (N * H, D)
            shapes[lp + "lconv1d.depthwise_conv1d.weight"] = (D, 1, self.conv_kernel_size)
            for n in ("lconv1d.pre_layer_norm", "lconv1d.conv_norm", "norm_pre_attn", "norm_post_attn", "norm_out"):
                shapes[lp + n + ".weight"] = (D,)
        shapes[p + "output_proj.weight"] = (self.output_proj_dims, D)
        shapes[p + "output_proj.bias"] = (self.output_proj_dims,)
        shapes["embed_audio.embedding_projection.weight"] = (self.text_hidden_size, self.output_proj_dims)
        return shapes

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())

    @classmethod
    def from_hf(cls, audio: dict, text_hidden_size: int) -> AudioConfig:
        """From the `audio_config` of a Gemma 4 config.json (HF's defaults for missing fields)."""
        d = {f.name: f.default for f in dataclasses.fields(cls)}
        names = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads"}
        v = {k: audio[names.get(k, k)] for k in d if audio.get(names.get(k, k)) is not None}
        act = audio.get("hidden_act", "silu")
        if act != "silu":
            raise AudioConfigError(f"audio_config.hidden_act {act!r}: expected 'silu'")
        v["subsampling_conv_channels"] = tuple(int(c) for c in v.get("subsampling_conv_channels", (128, 32)))
        v["text_hidden_size"] = int(text_hidden_size)
        cfg = cls(**{k: (val if k == "subsampling_conv_channels" else type(d[k])(val)) for k, val in {**d, **v}.items()})
        cfg.validate()
        return cfg

    def validate(self) -> None:
        c = self.subsampling_conv_channels
        if len(c) != 2:
            raise AudioConfigError(f"audio_config.subsampling_conv_channels={list(c)}: expected two channel counts")
        if c[0] != N_MELS:
            raise AudioConfigError(f"audio_config.subsampling_conv_channels[0]={c[0]}: HF sizes the subsampler's "
                                   f"output from it as if it were the {N_MELS} mel bins, so it must be {N_MELS}")
        if self.hidden_size % self.num_heads:
            raise AudioConfigError(f"audio_config: hidden_size={self.hidden_size} is not a multiple of "
                                   f"num_attention_heads={self.num_heads}")
        if self.attention_context_left < 2 or self.attention_context_right < 0:
            raise AudioConfigError(f"audio_config: attention_context_left={self.attention_context_left} must be >= 2 "
                                   f"and attention_context_right={self.attention_context_right} >= 0")

    @classmethod
    def preset(cls, name: str) -> AudioConfig:
        """The audio tower of a published size: e2b or e4b (the others have none; 12b: UnifiedAudioConfig)."""
        key = name.lower().replace("gemma-4-", "").removesuffix("-it")
        if key not in AUDIO_PRESETS:
            raise AudioConfigError(f"unknown audio preset {name!r}; expected one of {sorted(AUDIO_PRESETS)}")
        return AUDIO_PRESETS[key]


@dataclasses.dataclass(frozen=True)
class UnifiedAudioConfig:
    """The 12B's audio embedder: raw waveform frames of `frame_size` samples, RMSNorm, Linear."""

    frame_size: int = 640                      # audio_embed_dim == audio_samples_per_token (40 ms at 16 kHz)
    rms_norm_eps: float = 1e-6
    text_hidden_size: int = 3840

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"embed_audio.embedding_projection.weight": (self.text_hidden_size, self.frame_size)}

    def num_params(self) -> int:
        return self.text_hidden_size * self.frame_size

    @classmethod
    def from_hf(cls, audio: dict, text_hidden_size: int) -> UnifiedAudioConfig:
        return cls(frame_size=int(audio.get("audio_embed_dim", 640)),
                   rms_norm_eps=float(audio.get("rms_norm_eps", 1e-6)), text_hidden_size=int(text_hidden_size))


AUDIO_PRESETS: dict[str, AudioConfig] = {
    "e2b": AudioConfig(text_hidden_size=1536),
    "e4b": AudioConfig(text_hidden_size=2560),
}
AUDIO_LINEARS = ("linear.weight", "input_proj_linear.weight", "relative_k_proj.weight", "output_proj.weight",
                 "embedding_projection.weight")


# ---------------------------------------------------------------------------- weights

@pytree_dataclass
class FeedForwardWeights:
    pre_norm: Any             # [D] f32
    up: ClippedLinear         # [4D, D] (ffw_layer_1)
    down: ClippedLinear       # [D, 4D] (ffw_layer_2)
    post_norm: Any            # [D] f32


@pytree_dataclass
class ConformerLayerWeights:
    ff1: FeedForwardWeights
    ff2: FeedForwardWeights
    norm_pre_attn: Any        # [D] f32
    q_proj: ClippedLinear     # [N*H, D]
    k_proj: ClippedLinear     # [N*H, D]
    v_proj: ClippedLinear     # [N*H, D]
    post: ClippedLinear       # [D, D]
    relative_k_proj: Any      # [N*H, D]
    per_dim_scale: Any        # [H] model dtype
    norm_post_attn: Any       # [D] f32
    conv_pre_norm: Any        # [D] f32
    linear_start: ClippedLinear  # [2D, D]
    depthwise: Any            # [D, 1, kernel]
    conv_norm: Any            # [D] f32
    linear_end: ClippedLinear  # [D, D]
    norm_out: Any             # [D] f32


@pytree_dataclass
class AudioWeights:
    conv0: Any                # [c0, 1, 3, 3]
    norm0: Any                # [c0] f32
    conv1: Any                # [c1, c0, 3, 3]
    norm1: Any                # [c1] f32
    input_proj: Any           # [D, 32 * c1]
    layers: tuple
    output_proj: Any          # [out, D]
    output_bias: Any          # [out]
    embed_proj: Any           # [D_text, out] (embed_audio.embedding_projection)


@pytree_dataclass
class UnifiedAudioWeights:
    embed_proj: Any           # [D_text, frame_size]


def build_audio_weights(cfg: AudioConfig, get: Callable[[str], Any], quantize: Callable | None = None
                        ) -> AudioWeights:
    """Assemble AudioWeights from a getter of released-checkpoint names (without `model.`); norms become float32,
    `quantize(name, leaf)` may replace the projections (names ending in AUDIO_LINEARS)."""
    def proj(name):
        v = get(name)
        return quantize(name, v) if quantize is not None else v

    def norm(name):
        return _as_f32(get(name))

    def clipped(name):
        return ClippedLinear(proj(name + ".linear.weight"), _bounds(get, name) if cfg.use_clipped_linears else None)

    def ff(lp):
        return FeedForwardWeights(norm(lp + ".pre_layer_norm.weight"), clipped(lp + ".ffw_layer_1"),
                                  clipped(lp + ".ffw_layer_2"), norm(lp + ".post_layer_norm.weight"))

    p = "audio_tower."
    s = p + "subsample_conv_projection."
    layers = []
    for i in range(cfg.num_layers):
        lp = f"{p}layers.{i}."
        a = lp + "self_attn."
        c = lp + "lconv1d."
        layers.append(ConformerLayerWeights(
            ff1=ff(lp + "feed_forward1"), ff2=ff(lp + "feed_forward2"), norm_pre_attn=norm(lp + "norm_pre_attn.weight"),
            q_proj=clipped(a + "q_proj"), k_proj=clipped(a + "k_proj"), v_proj=clipped(a + "v_proj"),
            post=clipped(a + "post"), relative_k_proj=proj(a + "relative_k_proj.weight"),
            per_dim_scale=get(a + "per_dim_scale"), norm_post_attn=norm(lp + "norm_post_attn.weight"),
            conv_pre_norm=norm(c + "pre_layer_norm.weight"), linear_start=clipped(c + "linear_start"),
            depthwise=get(c + "depthwise_conv1d.weight"), conv_norm=norm(c + "conv_norm.weight"),
            linear_end=clipped(c + "linear_end"), norm_out=norm(lp + "norm_out.weight")))
    return AudioWeights(
        conv0=get(s + "layer0.conv.weight"), norm0=norm(s + "layer0.norm.weight"), conv1=get(s + "layer1.conv.weight"),
        norm1=norm(s + "layer1.norm.weight"), input_proj=proj(s + "input_proj_linear.weight"), layers=tuple(layers),
        output_proj=proj(p + "output_proj.weight"), output_bias=get(p + "output_proj.bias"),
        embed_proj=proj("embed_audio.embedding_projection.weight"))


def build_unified_audio_weights(cfg: UnifiedAudioConfig, get: Callable[[str], Any],
                                quantize: Callable | None = None) -> UnifiedAudioWeights:
    v = get("embed_audio.embedding_projection.weight")
    return UnifiedAudioWeights(quantize("embed_audio.embedding_projection.weight", v) if quantize else v)


def abstract_audio_weights(cfg: AudioConfig, dtype=jnp.bfloat16, quantize: Callable | None = None) -> AudioWeights:
    """The AudioWeights tree as ShapeDtypeStructs (no memory): for jax.eval_shape, AOT compiles and loading."""
    return build_audio_weights(cfg, _abstract_getter(cfg.param_shapes(), dtype), quantize)


def abstract_unified_audio_weights(cfg: UnifiedAudioConfig, dtype=jnp.bfloat16,
                                   quantize: Callable | None = None) -> UnifiedAudioWeights:
    return build_unified_audio_weights(cfg, _abstract_getter(cfg.param_shapes(), dtype), quantize)


# ---------------------------------------------------------------------------- blocks

def _silu(x: Array) -> Array:
    return jax.nn.silu(x.astype(f32)).astype(x.dtype)


def _clip_grad(cfg: AudioConfig, x: Array) -> Array:
    """HF's `gradient_clipping` clamp (1e10, or the dtype's max): a no-op on finite values, kept for infinities."""
    g = min(cfg.gradient_clipping, float(jnp.finfo(x.dtype).max))
    return jnp.clip(x, -g, g)


def subsample(cfg: AudioConfig, w: AudioWeights, features: Array, mask: Array) -> tuple[Array, Array]:
    """features [B, F, 128] float32, mask [B, F] -> (x [B, T, D], valid [B, T]), T = ceil(ceil(F / 2) / 2).

    Each block: zero the invalid frames, 3x3 conv stride 2 pad 1 (no bias), LayerNorm over channels (no bias), ReLU.
    Layout NHWC = (clip, time, frequency, channel); the flattened output is frequency-major, as HF's permute."""
    dtype = w.conv0.dtype
    x = features[..., None]                                               # [B, F, 128, 1]
    for conv, norm in ((w.conv0, w.norm0), (w.conv1, w.norm1)):
        x = (x * mask[:, :, None, None]).astype(dtype)
        x = jax.lax.conv_general_dilated(x, conv.astype(dtype), window_strides=(2, 2), padding=((1, 1), (1, 1)),
                                         dimension_numbers=("NHWC", "OIHW", "NHWC"),
                                         precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)
        x = x.astype(dtype)
        x = jax.nn.relu(layer_norm(x, norm, jnp.zeros_like(norm), cfg.rms_norm_eps))
        mask = mask[:, ::2]
    B, T, Fq, C = x.shape
    return linear(x.reshape(B, T, Fq * C), w.input_proj), mask


def feed_forward(cfg: AudioConfig, fw: FeedForwardWeights, x: Array) -> Array:
    """Half-step macaron feed-forward: x + residual_weight * norm(down(silu(up(norm(x)))))."""
    eps = cfg.rms_norm_eps
    h = rms_norm(_clip_grad(cfg, x), fw.pre_norm, eps)
    h = clipped_linear(_silu(clipped_linear(h, fw.up)), fw.down)
    h = rms_norm(_clip_grad(cfg, h), fw.post_norm, eps)
    return scale(h, cfg.residual_weight) + x


def relative_position_band(cfg: AudioConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The attention band, static: (distances d [W] (query t sees key t - d), sinusoid positions [W], has_bias [W]).

    HF computes relative logits for positions ctx//2 .. 0 (ctx = chunk + left - 1 + right) and shifts them so that the
    key d tokens back gets position ctx//2 - (left - 1 - d) when that index is in range, else no relative term."""
    P, R = cfg.attention_context_left - 1, cfg.attention_context_right
    ctx = cfg.attention_chunk_size + P + R
    d = np.arange(-max(R - 1, 0), P)
    c = P - d                                                  # column of the shifted relative-logit row
    has = c < ctx // 2 + 1
    return d, np.where(has, ctx // 2 - c, 0), has


def _sinusoids(positions: np.ndarray, dim: int) -> np.ndarray:
    """[len(positions), dim] float32 = [sin(p * inv_t), cos(p * inv_t)], inv_t geometric from 1 to 1e-4 (HF)."""
    n = dim // 2
    inc = math.log(10000.0) / max(n - 1, 1)
    inv = np.exp(np.arange(n, dtype=np.float32) * np.float32(-inc)).astype(np.float32)
    t = positions.astype(np.float32)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=-1).astype(np.float32)


def conformer_attention(cfg: AudioConfig, lw: ConformerLayerWeights, x: Array, valid: Array) -> Array:
    """Local self-attention with relative positions and a tanh logit cap. x: [B, T, D] (normed); valid: [B, T]."""
    B, T, D = x.shape
    N, H = cfg.num_heads, cfg.head_dim
    q = clipped_linear(x, lw.q_proj).astype(f32).reshape(B, T, N, H)
    k = clipped_linear(x, lw.k_proj).astype(f32).reshape(B, T, N, H)
    v = clipped_linear(x, lw.v_proj).astype(f32).reshape(B, T, N, H)
    q = q * np.float32(H ** -0.5 / math.log(2)) * jax.nn.softplus(lw.per_dim_scale).astype(f32)
    k = k * np.float32(math.log(1 + math.e) / math.log(2))

    d, rel_pos, has = relative_position_band(cfg)
    back, ahead = int(d.max()), int(-d.min())
    pad = lambda a: jnp.pad(a, [(0, 0), (back, ahead)] + [(0, 0)] * (a.ndim - 2))
    kp, vp, okp = pad(k), pad(v), pad(valid)
    starts = [back - int(di) for di in d]                    # key t - d sits at padded index t + back - d
    k_band = jnp.stack([kp[:, s:s + T] for s in starts], axis=2)          # [B, T, W, N, H]
    v_band = jnp.stack([vp[:, s:s + T] for s in starts], axis=2)
    ok = jnp.stack([okp[:, s:s + T] for s in starts], axis=2)            # [B, T, W]

    sin_table = jnp.asarray(_sinusoids(rel_pos, D)).astype(x.dtype)      # HF casts them to the activation dtype
    rel_k = linear(sin_table, lw.relative_k_proj).astype(f32).reshape(-1, N, H)
    rel_k = rel_k * jnp.asarray(has, f32)[:, None, None]                  # [W, N, H]

    logits = (jnp.einsum("btnh,btwnh->bntw", q, k_band, precision=jax.lax.Precision.HIGHEST)
              + jnp.einsum("btnh,wnh->bntw", q, rel_k, precision=jax.lax.Precision.HIGHEST))
    cap = np.float32(cfg.attention_logit_cap)
    logits = jnp.tanh(logits / cap) * cap
    logits = jnp.where(ok[:, None], logits, np.float32(cfg.attention_invalid_logits_value))
    p = jax.nn.softmax(logits, axis=-1)
    o = jnp.einsum("bntw,btwnh->btnh", p, v_band, precision=jax.lax.Precision.HIGHEST)
    return clipped_linear(o.reshape(B, T, N * H).astype(x.dtype), lw.post)


def light_conv(cfg: AudioConfig, lw: ConformerLayerWeights, x: Array) -> Array:
    """x + linear_end(silu(norm(causal depthwise conv(glu(linear_start(norm(x))))))). x: [B, T, D]."""
    eps = cfg.rms_norm_eps
    h = clipped_linear(rms_norm(x, lw.conv_pre_norm, eps), lw.linear_start).astype(f32)
    D = x.shape[-1]
    h = h[..., :D] * jax.nn.sigmoid(h[..., D:])                            # GLU over the last dim
    h = h.astype(x.dtype).astype(f32)
    kern = lw.depthwise[:, 0, :].astype(f32)                               # [D, kernel]
    K = kern.shape[-1]
    T = x.shape[1]
    hp = jnp.pad(h, [(0, 0), (K - 1, 0), (0, 0)])
    y = sum(hp[:, j:j + T] * kern[:, j] for j in range(K)).astype(x.dtype)
    y = rms_norm(_clip_grad(cfg, y), lw.conv_norm, eps)
    return clipped_linear(_silu(y), lw.linear_end) + x


def conformer_layer(cfg: AudioConfig, lw: ConformerLayerWeights, x: Array, valid: Array) -> Array:
    eps = cfg.rms_norm_eps
    x = feed_forward(cfg, lw.ff1, x)
    h = conformer_attention(cfg, lw, rms_norm(_clip_grad(cfg, x), lw.norm_pre_attn, eps), valid)
    x = rms_norm(_clip_grad(cfg, h), lw.norm_post_attn, eps) + x
    x = feed_forward(cfg, lw.ff2, light_conv(cfg, lw, x))
    return rms_norm(_clip_grad(cfg, x), lw.norm_out, eps)


def encode_audio(w: AudioWeights, cfg: AudioConfig, features: Array, mask: Array) -> tuple[Array, Array]:
    """Log-mel features -> audio soft tokens in the text embedding space (audio tower + embed_audio).

    Args:
      features: [B, F, 128] float32 (`tools.media.audio_features`, HF's Gemma4AudioFeatureExtractor).
      mask: [B, F] bool, True for real frames.
    Returns:
      (embeds [B, T, D_text] in the weights' dtype, valid [B, T] bool), T = ceil(ceil(F / 2) / 2); valid tokens
      (mask[::2][::2]) are the clip's soft tokens, in order.
    """
    x, valid = subsample(cfg, w, features.astype(f32), mask)
    for lw in w.layers:
        x = conformer_layer(cfg, lw, x, valid)
    x = linear(x, w.output_proj) + w.output_bias.astype(x.dtype)
    return linear(rms_norm(x, None, cfg.rms_norm_eps), w.embed_proj), valid


def encode_audio_unified(w: UnifiedAudioWeights, cfg: UnifiedAudioConfig, frames: Array, mask: Array
                         ) -> tuple[Array, Array]:
    """12B: raw waveform frames [B, M, frame_size] (mask [B, M]) -> (embeds [B, M, D_text], valid [B, M])."""
    x = frames.astype(w.embed_proj.dtype)
    return linear(rms_norm(x, None, cfg.rms_norm_eps), w.embed_proj), mask
