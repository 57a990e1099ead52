"""Gemma 4's vision and audio towers as one unit: config, loading from released checkpoints, media -> soft tokens,
and the pure function that places soft tokens in a text embedding sequence.

Design choices: the towers load from the same safetensors files as the text decoder but never through its loader
(`model.loader` skips them and keeps loading text-only checkpoints as before); every expected tensor is checked by
name and shape first, and one error lists every missing, misshapen or unexpected tower tensor. Quantization follows
the text scheme (`w8a8`, `w4a16`, `qat-w4a16`) for the towers' projections only; convolutions, norms, position tables
and clip bounds stay dense. The engine sees only `embed_multimodal` (arrays per image / clip) and `merge_embeddings`.

How the text decoder consumes them (HF's Gemma4Model / Gemma4UnifiedModel.forward, transformers 5.24; reproduced
end to end in tests/model/test_vision.py::test_merged_prompt_reproduces_hf_logits):
  1. Embedding: the ids are embedded with every placeholder (image / audio / video) replaced by pad_token_id
     (`ple_token_ids`) and scaled by sqrt(D) as usual; then the rows at the placeholder positions are *replaced*
     by the soft tokens (`merge_embeddings`), which are not scaled. `<|image>` / `<image|>` are ordinary tokens.
  2. PLE (E2B / E4B): the token-identity part looks up pad_token_id at placeholder positions (the same
     `ple_token_ids`); the context part projects the merged embeddings, soft tokens included; i.e.
     `gemma.per_layer_inputs(w, cfg, ple_token_ids, merged_x)`.
  3. Masks, when text_config.use_bidirectional_attention == "vision" (26B, 31B, 12B) *and* the processor's
     mm_token_type_ids are given (without them HF is plain causal; E2B / E4B are always causal). A block is a
     maximal run of image / video placeholders (`vision_block_ids`; the begin / end markers and audio are not in
     it). Gemma4ForConditionalGeneration (forward and generate): full-attention layers stay causal; sliding layers let query i see key j iff (j <= i or block[i] == block[j]
     >= 0) and i - j < sliding_window, so an image token also sees the later tokens of its image, but no key
     sliding_window or more behind it. The 12B (Gemma4UnifiedModel.forward, and so its generate: measured, HF's
     generate and forward pick the same tokens and the Gemma 4 rule does not) ORs the block in after the window,
     on every layer type (full: j <= i or same block; sliding: (j <= i and i - j < W) or same block); the engine
     follows each (RunnerSpec.block_mode). HF drops mm_token_type_ids on decode steps (new tokens are text).
     Consequence for chunked prefill / prefix caching: an image block's K/V depend on the whole block, so a block
     must not be split across prefill chunks (or its earlier chunk must be recomputed) on those models.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemmajax.model import audio as au
from gemmajax.model import vision as vi
from gemmajax.model.gemma import pytree_dataclass
from gemmajax.model.loader import CheckpointError
from gemmajax.model.safetensors_io import index_checkpoint, load_tensor

Array = jax.Array
TOWER = re.compile(r"(^|\.)(vision_tower|vision_embedder|embed_vision|audio_tower|embed_audio)\.")
# Leaves HF computes in float32 from the stored (model-dtype) value: norms, LayerNorm biases, standardization.
F32_LEAF = re.compile(r"(norm[^.]*\.(weight|bias)|_ln\d\.(weight|bias)|std_bias|std_scale)$")


@dataclasses.dataclass(frozen=True)
class MultimodalConfig:
    """Which towers a checkpoint has, their geometry, and the special token ids of the prompt format."""

    vision: vi.VisionConfig | vi.UnifiedVisionConfig | None = None
    audio: au.AudioConfig | au.UnifiedAudioConfig | None = None
    image_token_id: int = 258880      # <|image|> soft-token placeholder
    boi_token_id: int = 255999        # <|image>
    eoi_token_id: int = 258882        # <image|>
    audio_token_id: int = 258881      # <|audio|>
    boa_token_id: int = 256000        # <|audio>
    eoa_token_id: int = 258883        # <audio|>
    video_token_id: int = 258884      # <|video|>
    pad_token_id: int = 0
    bidirectional_vision: bool = False  # text_config.use_bidirectional_attention == "vision"

    @property
    def unified(self) -> bool:
        return isinstance(self.vision, vi.UnifiedVisionConfig) or isinstance(self.audio, au.UnifiedAudioConfig)

    @property
    def placeholder_ids(self) -> tuple[int, int, int]:
        return (self.image_token_id, self.audio_token_id, self.video_token_id)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for t in (self.vision, self.audio):
            if t is not None:
                shapes.update(t.param_shapes())
        return shapes

    def num_params(self) -> int:
        return sum(int(np.prod(s)) for s in self.param_shapes().values())

    @classmethod
    def from_hf(cls, cfg: dict) -> MultimodalConfig:
        """From a Gemma 4 config.json dict (`gemma4` or `gemma4_unified` with text_config); a text-only config
        gives a config with no towers."""
        mt = cfg.get("model_type", "")
        if mt not in ("gemma4", "gemma4_unified", "gemma4_text", "gemma4_unified_text"):
            raise vi.VisionConfigError(f"config.json: model_type {mt!r}: the vision / audio towers here are Gemma 4's "
                                       "(gemma4, gemma4_unified)")
        text = cfg.get("text_config") or cfg
        if "hidden_size" not in text:
            raise vi.VisionConfigError("config.json: text_config.hidden_size is missing (the towers project to it)")
        D = int(text["hidden_size"])
        unified = mt.startswith("gemma4_unified")
        vis = aud = None
        if cfg.get("vision_config") is not None:
            vis = (vi.UnifiedVisionConfig if unified else vi.VisionConfig).from_hf(cfg["vision_config"], D)
        if cfg.get("audio_config") is not None:
            aud = (au.UnifiedAudioConfig if unified else au.AudioConfig).from_hf(cfg["audio_config"], D)
        ids = {k: int(cfg[k]) for k in ("image_token_id", "boi_token_id", "eoi_token_id", "audio_token_id",
                                          "boa_token_id", "video_token_id") if cfg.get(k) is not None}
        eoa = cfg.get("eoa_token_index", cfg.get("eoa_token_id"))  # HF's config names it eoa_token_index
        if eoa is not None:
            ids["eoa_token_id"] = int(eoa)
        bidir = text.get("use_bidirectional_attention", "vision" if unified else None)
        return cls(vision=vis, audio=aud, pad_token_id=int(text.get("pad_token_id", 0) or 0),
                   bidirectional_vision=bidir == "vision", **ids)


@pytree_dataclass
class MultimodalWeights:
    vision: Any = None        # VisionWeights | UnifiedVisionWeights | None
    audio: Any = None         # AudioWeights | UnifiedAudioWeights | None


# ---------------------------------------------------------------------------- building and loading

def build_multimodal_weights(cfg: MultimodalConfig, get: Callable[[str], Any],
                             quantize: Callable | None = None) -> MultimodalWeights:
    """Assemble the towers from a getter of released names (without `model.`)."""
    v = a = None
    if isinstance(cfg.vision, vi.UnifiedVisionConfig):
        v = vi.build_unified_vision_weights(cfg.vision, get, quantize)
    elif cfg.vision is not None:
        v = vi.build_vision_weights(cfg.vision, get, quantize)
    if isinstance(cfg.audio, au.UnifiedAudioConfig):
        a = au.build_unified_audio_weights(cfg.audio, get, quantize)
    elif cfg.audio is not None:
        a = au.build_audio_weights(cfg.audio, get, quantize)
    return MultimodalWeights(v, a)


def abstract_multimodal_weights(cfg: MultimodalConfig, dtype=jnp.bfloat16, quant: str = "none"
                                ) -> MultimodalWeights:
    """The towers as ShapeDtypeStructs (abstract QuantArrays for the projections under `quant`)."""
    shapes = cfg.param_shapes()
    return build_multimodal_weights(cfg, lambda n: jax.ShapeDtypeStruct(shapes[n], dtype), tower_quantizer(quant))


def _is_linear(name: str) -> bool:
    return name.endswith(vi.VISION_LINEARS + au.AUDIO_LINEARS)


def tower_quantizer(quant: str) -> Callable | None:
    """`(name, leaf) -> leaf` quantizing the towers' projections under a text `quant` scheme; None for 'none'.

    w8a8: int8 per output row, activations per token per 128 columns where 128 divides the width; w4a16: int4 in
    groups of 32; qat-w4a16: the exact repack where a weight is on the 4-bit grid, else dense. `+embN` concerns
    vocabulary tables only: the towers have none."""
    from gemmajax.quant import abstract_quant, parse_quant, repack_qat
    from gemmajax.quant.quantize import default_act_group

    scheme = parse_quant(quant)
    if scheme.linear is None:
        return None

    def q(name, w):
        if not _is_linear(name):
            return w
        act = default_act_group(w.shape[-1]) if scheme.linear == "int8" else 0
        if isinstance(w, jax.ShapeDtypeStruct):
            return abstract_quant(w.shape, scheme.linear, dtype=w.dtype, act_group=act)
        if scheme.qat:
            r = repack_qat(w, name=name)
            return w if r is None else r
        return _quantize_jit(w, scheme.linear, act)

    return q


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_jit(w, kind: str, act_group: int):
    """quant.quantize as one compiled program per weight shape (eagerly it is a dozen small compiles per shape)."""
    from gemmajax.quant import quantize
    return quantize(w, kind, act_group=act_group) if act_group else quantize(w, kind)


def _tower_prefix(names: set[str], expected: dict) -> str:
    first = next(iter(expected))
    for p in ("model.", ""):
        if p + first in names:
            return p
    return "model."


def load_multimodal(ckpt: str | os.PathLike, dtype="float32", quant: str = "none"
                    ) -> tuple[MultimodalConfig, MultimodalWeights]:
    """Load the vision / audio towers of an HF Gemma 4 checkpoint directory (config.json + safetensors, keys as
    released: `model.vision_tower.*`, `model.embed_vision.*`, `model.audio_tower.*`, `model.embed_audio.*`, and the
    12B's `model.vision_embedder.*`). A checkpoint without towers gives (config, MultimodalWeights(None, None)).

    Raises CheckpointError listing every missing, misshapen or unexpected tower tensor."""
    ckpt = os.fspath(ckpt)
    path = os.path.join(ckpt, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {ckpt!r}: no config.json")
    with open(path) as f:
        cfg = MultimodalConfig.from_hf(json.load(f))
    expected = cfg.param_shapes()
    if not expected:
        return cfg, MultimodalWeights()
    infos = index_checkpoint(ckpt)
    names = set(infos)
    prefix = _tower_prefix(names, expected)
    problems = []
    for n, shp in expected.items():
        info = infos.get(prefix + n)
        if info is None:
            problems.append(f"  missing tensor {prefix + n}: expected shape {shp}")
        elif tuple(info.shape) != tuple(shp):
            problems.append(f"  wrong shape {prefix + n}: expected {shp}, found {tuple(info.shape)}")
    for n in sorted(names):
        local = n[len(prefix):] if n.startswith(prefix) else None
        if local is not None and TOWER.match(local) and local not in expected:
            problems.append(f"  unexpected tensor {n}: {tuple(infos[n].shape)}")
    if problems:
        towers = ", ".join(type(t).__name__ for t in (cfg.vision, cfg.audio) if t is not None)
        raise CheckpointError(f"checkpoint {ckpt!r}: tower tensors do not match config.json ({towers}):\n"
                              + "\n".join(problems))
    dt = jnp.dtype({"bf16": "bfloat16", "fp32": "float32", "f32": "float32"}.get(dtype, dtype))

    def get(name):
        a = np.asarray(load_tensor(infos[prefix + name]))
        x = jnp.asarray(a).astype(dt)                     # HF keeps every tensor in the model dtype
        return x.astype(jnp.float32) if F32_LEAF.search(name) else x

    return cfg, build_multimodal_weights(cfg, get, tower_quantizer(quant))


# ---------------------------------------------------------------------------- media -> soft tokens

_encoders = {
    vi.VisionConfig: jax.jit(vi.encode_images, static_argnums=1),
    vi.UnifiedVisionConfig: jax.jit(vi.encode_images_unified, static_argnums=1),
    au.AudioConfig: jax.jit(au.encode_audio, static_argnums=1),
    au.UnifiedAudioConfig: jax.jit(au.encode_audio_unified, static_argnums=1),
}
AUDIO_FRAME_BUCKET = 128  # log-mel frames are padded (masked) to a multiple of this: fewer compiles, same tokens


def embed_multimodal(weights: MultimodalWeights, cfg: MultimodalConfig, media: Sequence[Any]) -> list[Array]:
    """Soft-token embeddings [N_i, D_text] for each processed image / clip, in the order given.

    `media` items are what `gemmajax.tools.media` produces: `.kind == "image"` with `.pixel_values` [T, C] and
    `.position_ids` [T, 2] (and `.num_soft_tokens`), or `.kind == "audio"` with `.features` [F, 128] (12B: raw frames
    [M, 640]) and `.mask` [F]. Images of one shape run as one batch. N_i equals the number of placeholders the
    processor put in the prompt for that item (checked), so `merge_embeddings` can place them in order."""
    out: list[Array | None] = [None] * len(media)
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(media):
        kind = getattr(m, "kind", None)
        if kind == "image":
            if cfg.vision is None or weights.vision is None:
                raise ValueError(f"media[{i}]: an image, but this checkpoint has no vision tower")
            key = ("image", tuple(np.shape(m.pixel_values)))
        elif kind == "audio":
            if cfg.audio is None or weights.audio is None:
                raise ValueError(f"media[{i}]: an audio clip, but this checkpoint has no audio tower")
            n = np.shape(m.features)[0]
            if isinstance(cfg.audio, au.AudioConfig):
                n = -(-n // AUDIO_FRAME_BUCKET) * AUDIO_FRAME_BUCKET
            key = ("audio", (n,) + tuple(np.shape(m.features)[1:]))
        else:
            raise ValueError(f"media[{i}]: expected a processed image or audio clip (kind 'image' / 'audio'), "
                             f"got {type(m).__name__} with kind {kind!r}")
        groups.setdefault(key, []).append(i)
    for (kind, shape), idx in groups.items():
        if kind == "image":
            x = np.stack([np.asarray(media[i].pixel_values, np.float32) for i in idx])
            p = np.stack([np.asarray(media[i].position_ids, np.int32) for i in idx])
            emb, valid = _encoders[type(cfg.vision)](weights.vision, cfg.vision, jnp.asarray(x), jnp.asarray(p))
        else:
            x = np.stack([_pad_rows(np.asarray(media[i].features, np.float32), shape[0], 0) for i in idx])
            msk = np.stack([_pad_rows(np.asarray(media[i].mask, bool), shape[0], False) for i in idx])
            emb, valid = _encoders[type(cfg.audio)](weights.audio, cfg.audio, jnp.asarray(x), jnp.asarray(msk))
        valid = np.asarray(valid)
        for j, i in enumerate(idx):
            n = int(valid[j].sum())
            want = getattr(media[i], "num_soft_tokens", n)
            if n != want:
                raise ValueError(f"media[{i}] ({kind}): the encoder gives {n} soft tokens but the processor counted "
                                 f"{want} placeholders")
            out[i] = emb[j][np.flatnonzero(valid[j])]
    return out


def _pad_rows(a: np.ndarray, n: int, fill) -> np.ndarray:
    return np.pad(a, [(0, n - a.shape[0])] + [(0, 0)] * (a.ndim - 1), constant_values=fill)


# ---------------------------------------------------------------------------- placing soft tokens in the prompt

def merge_embeddings(text_embeds: Array, positions: Array, mm_embeds: Array | Sequence[Array]) -> Array:
    """Replace the rows of `text_embeds` [T, D] at `positions` [M] (placeholder indices, in prompt order) by the
    soft tokens: `mm_embeds` [M, D], or a list of [N_i, D] with sum N_i = M (as `embed_multimodal` returns them).

    Pure and jittable for static shapes. The text rows there are dropped, not added to (HF's masked_scatter); the
    soft tokens are cast to the text dtype and not scaled by sqrt(D)."""
    mm = jnp.concatenate([jnp.asarray(e) for e in mm_embeds], axis=0) if isinstance(mm_embeds, (list, tuple)) \
        else jnp.asarray(mm_embeds)
    positions = jnp.asarray(positions)
    if mm.ndim != 2 or mm.shape[0] != positions.shape[0] or mm.shape[1] != text_embeds.shape[-1]:
        raise ValueError(f"merge_embeddings: {positions.shape[0]} placeholder positions for width "
                         f"{text_embeds.shape[-1]}, but the soft tokens are {tuple(mm.shape)}")
    return text_embeds.at[positions].set(mm.astype(text_embeds.dtype))


def placeholder_positions(ids: Sequence[int] | np.ndarray, cfg: MultimodalConfig) -> np.ndarray:
    """Indices of every soft-token placeholder (image, audio, video) in a prompt's ids [T], in order: [M] int32."""
    ids = np.asarray(ids)
    return np.flatnonzero(np.isin(ids, cfg.placeholder_ids)).astype(np.int32)


def ple_token_ids(ids: Sequence[int] | np.ndarray, cfg: MultimodalConfig) -> np.ndarray:
    """The ids HF embeds (and, on E2B / E4B, looks up in the PLE table): placeholders -> pad_token_id. [T]."""
    ids = np.asarray(ids)
    return np.where(np.isin(ids, cfg.placeholder_ids), cfg.pad_token_id, ids)


def vision_block_ids(ids: Sequence[int] | np.ndarray, cfg: MultimodalConfig) -> np.ndarray:
    """HF's block_sequence_ids [T]: each maximal run of image / video placeholders gets 0, 1, ...; others -1.

    With `cfg.bidirectional_vision`, HF lets query i see key j on sliding-window layers when
    (j <= i or block[i] == block[j] >= 0) and i - j < window; full-attention layers stay causal."""
    ids = np.asarray(ids)
    vis = np.isin(ids, (cfg.image_token_id, cfg.video_token_id))
    start = vis & ~np.concatenate([[False], vis[:-1]])
    return np.where(vis, np.cumsum(start) - 1, -1).astype(np.int32)
