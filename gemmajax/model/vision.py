"""The Gemma 4 vision encoders as pure functions over frozen dataclass pytrees, next to the text decoder.

Two encoders, both ending in soft tokens of the text model's width:
- `Gemma4VisionModel` (E2B / E4B / 26B-A4B / 31B): 16x16 patches -> Linear + learned 2-D position table -> Gemma-style
  bidirectional encoder layers (four RMSNorms, q/k norms, weightless v norm, scaling 1, 2-D axial RoPE, gelu-tanh
  GLU; optionally "clipped" linears that clamp their inputs and outputs to stored bounds) -> 3x3 average pooling by
  patch position, times sqrt(D) -> optional standardization -> `embed_vision` (weightless RMSNorm + Linear).
- the 12B (`gemma4_unified`) encoder-free embedder: 48x48 merged patches -> LayerNorm -> Dense -> LayerNorm ->
  + factorized 2-D position table -> LayerNorm -> weightless RMSNorm -> Linear.

Design choices: images keep the processor's fixed padded length (max soft tokens x k^2 patches; padding patches have
position (-1, -1)), so one compiled program serves every aspect ratio; padding is masked out of attention and pooling
and the outputs carry a validity mask (valid soft tokens come first). Projections go through `quant.linear`, so a
QuantArray may stand for any of them. Numerics follow HF eager: RMSNorm / LayerNorm / softmax / pooling in float32,
everything else in the weights' dtype.

Einsum letters: B images, T patches (queries), S patches (keys), D vision width, N query heads, K KV heads,
G = N // K, H head dim, F MLP width, C pixels per patch, M soft tokens per image.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemmajax.model.gemma import gelu_tanh, pytree_dataclass, rms_norm
from gemmajax.quant import linear

Array = jax.Array
f32 = jnp.float32


class VisionConfigError(ValueError):
    """A vision config this code cannot serve; the message names the field."""


# ---------------------------------------------------------------------------- configs

@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Gemma4VisionModel geometry plus the text width its soft tokens are projected to (hashable: a jit static)."""

    hidden_size: int = 768                 # D
    intermediate_size: int = 3072          # F
    num_layers: int = 16
    num_heads: int = 12                    # N
    num_kv_heads: int = 12                 # K
    head_dim: int = 64                     # H (a multiple of 4: two axes, each rotated in halves)
    patch_size: int = 16
    pooling_kernel_size: int = 3           # k: soft token = mean of a k x k block of patches
    position_embedding_size: int = 10240   # rows of the learned x / y position tables
    rope_theta: float = 100.0
    rms_norm_eps: float = 1e-6
    use_clipped_linears: bool = False      # E2B / E4B: every encoder linear clamps input and output
    standardize: bool = False              # 26B / 31B: (h - std_bias) * std_scale after pooling
    text_hidden_size: int = 1536           # width of the text embeddings (embed_vision's output)

    @property
    def patch_dim(self) -> int:
        """C = 3 * patch_size^2 pixel values per patch (row-major p x p x RGB, as the processor flattens them)."""
        return 3 * self.patch_size ** 2

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Released-checkpoint tensor name (without the leading `model.`) -> shape, for every tensor needed."""
        D, F, H, N, K = self.hidden_size, self.intermediate_size, self.head_dim, self.num_heads, self.num_kv_heads
        p = "vision_tower."
        shapes = {p + "patch_embedder.input_proj.weight": (D, self.patch_dim),
                  p + "patch_embedder.position_embedding_table": (2, self.position_embedding_size, D)}
        lin = {"self_attn.q_proj": (N * H, D), "self_attn.k_proj": (K * H, D), "self_attn.v_proj": (K * H, D),
               "self_attn.o_proj": (D, N * H), "mlp.gate_proj": (F, D), "mlp.up_proj": (F, D), "mlp.down_proj": (D, F)}
        for i in range(self.num_layers):
            lp = f"{p}encoder.layers.{i}."
            for n, s in lin.items():
                shapes[lp + n + ".linear.weight"] = s
                if self.use_clipped_linears:
                    for b in CLIP_BOUNDS:
                        shapes[lp + n + "." + b] = ()
            shapes[lp + "self_attn.q_norm.weight"] = (H,)
            shapes[lp + "self_attn.k_norm.weight"] = (H,)
            for n in LAYER_NORMS:
                shapes[lp + n + ".weight"] = (D,)
        if self.standardize:
            shapes[p + "std_bias"] = (D,)
            shapes[p + "std_scale"] = (D,)
        shapes["embed_vision.embedding_projection.weight"] = (self.text_hidden_size, D)
        return shapes

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())

    @classmethod
    def from_hf(cls, vision: dict, text_hidden_size: int) -> VisionConfig:
        """From the `vision_config` of a Gemma 4 config.json (HF's defaults for missing fields)."""
        d = {f.name: f.default for f in dataclasses.fields(cls)}
        hf_names = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                    "num_kv_heads": "num_key_value_heads"}
        v = {k: vision[hf_names.get(k, k)] for k in d if vision.get(hf_names.get(k, k)) is not None}
        rope = dict(vision.get("rope_parameters") or {})
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise VisionConfigError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r}: expected 'axial'")
        if vision.get("attention_bias"):
            raise VisionConfigError("vision_config.attention_bias=true is not supported (no released Gemma 4 uses it)")
        act = vision.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise VisionConfigError(f"vision_config.hidden_activation {act!r}: expected 'gelu_pytorch_tanh'")
        v["rope_theta"] = float(rope.get("rope_theta", d["rope_theta"]))
        v["text_hidden_size"] = int(text_hidden_size)
        cfg = cls(**{k: type(d[k])(val) for k, val in {**d, **v}.items()})
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.head_dim % 4:
            raise VisionConfigError(f"vision_config.head_dim={self.head_dim}: must be a multiple of 4 (2-D axial RoPE "
                                    "rotates each half of the head dim in halves)")
        if self.num_heads % self.num_kv_heads:
            raise VisionConfigError(f"vision_config: num_attention_heads={self.num_heads} is not a multiple of "
                                    f"num_key_value_heads={self.num_kv_heads}")
        if self.pooling_kernel_size < 2:
            raise VisionConfigError(f"vision_config.pooling_kernel_size={self.pooling_kernel_size}: HF's pooler "
                                    "needs at least 2 (with 1 it skips pooling and keeps the wrong mask)")

    @classmethod
    def preset(cls, name: str) -> VisionConfig:
        """The vision tower of a published size: e2b, e4b, 26b-a4b, 31b (12b has no tower: UnifiedVisionConfig)."""
        key = name.lower().replace("gemma-4-", "").removesuffix("-it")
        if key not in VISION_PRESETS:
            raise VisionConfigError(f"unknown vision preset {name!r}; expected one of {sorted(VISION_PRESETS)}")
        return VISION_PRESETS[key]


@dataclasses.dataclass(frozen=True)
class UnifiedVisionConfig:
    """The 12B (gemma4_unified) encoder-free vision embedder."""

    patch_size: int = 16                   # teacher patch; the processor merges k x k of them per soft token
    pooling_kernel_size: int = 3
    embed_dim: int = 3840                  # mm_embed_dim (== output_proj_dims, the embedder's input)
    posemb_size: int = 1120                # rows of the factorized position table
    rms_norm_eps: float = 1e-6
    layer_norm_eps: float = 1e-5           # torch nn.LayerNorm's default: HF builds the three LayerNorms without eps
    text_hidden_size: int = 3840

    @property
    def patch_dim(self) -> int:
        """C = 3 * (k * patch_size)^2 pixel values per merged patch (6912 for 48 x 48)."""
        return 3 * (self.patch_size * self.pooling_kernel_size) ** 2

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Released (on-disk) names without `model.`: HF renames vision_embedder.* to embed_vision.* at load."""
        C, E = self.patch_dim, self.embed_dim
        p = "vision_embedder."
        return {p + "patch_ln1.weight": (C,), p + "patch_ln1.bias": (C,), p + "patch_dense.weight": (E, C),
                p + "patch_dense.bias": (E,), p + "patch_ln2.weight": (E,), p + "patch_ln2.bias": (E,),
                p + "pos_embedding": (self.posemb_size, 2, E), p + "pos_norm.weight": (E,), p + "pos_norm.bias": (E,),
                "embed_vision.embedding_projection.weight": (self.text_hidden_size, E)}

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())

    @classmethod
    def from_hf(cls, vision: dict, text_hidden_size: int) -> UnifiedVisionConfig:
        d = {f.name: f.default for f in dataclasses.fields(cls)}
        e = int(vision.get("mm_embed_dim", d["embed_dim"]))
        out = int(vision.get("output_proj_dims", e))
        if out != e:
            raise VisionConfigError(f"vision_config: output_proj_dims={out} must equal mm_embed_dim={e} (the "
                                    "embedder normalizes and projects the mm_embed_dim-wide patch embeddings)")
        return cls(patch_size=int(vision.get("patch_size", d["patch_size"])),
                   pooling_kernel_size=int(vision.get("pooling_kernel_size", d["pooling_kernel_size"])),
                   embed_dim=e, posemb_size=int(vision.get("mm_posemb_size", d["posemb_size"])),
                   rms_norm_eps=float(vision.get("rms_norm_eps", d["rms_norm_eps"])),
                   text_hidden_size=int(text_hidden_size))


# The published towers (shared/reference/gemma4-architecture.md section 6): E2B and E4B share one, so do 26B and 31B.
VISION_PRESETS: dict[str, VisionConfig] = {
    "e2b": VisionConfig(use_clipped_linears=True, text_hidden_size=1536),
    "e4b": VisionConfig(use_clipped_linears=True, text_hidden_size=2560),
    "26b-a4b": VisionConfig(hidden_size=1152, intermediate_size=4304, num_layers=27, num_heads=16, num_kv_heads=16,
                            head_dim=72, standardize=True, text_hidden_size=2816),
    "31b": VisionConfig(hidden_size=1152, intermediate_size=4304, num_layers=27, num_heads=16, num_kv_heads=16,
                        head_dim=72, standardize=True, text_hidden_size=5376),
}
UNIFIED_VISION_PRESETS: dict[str, UnifiedVisionConfig] = {"12b": UnifiedVisionConfig()}

CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
# Leaves the quantizer may replace (name suffixes): every encoder / embedder projection.
VISION_LINEARS = ("linear.weight", "input_proj.weight", "embedding_projection.weight", "patch_dense.weight")


# ---------------------------------------------------------------------------- weights

@pytree_dataclass
class ClippedLinear:
    """HF's Gemma4ClippableLinear: y = clip(clip(x, in_min, in_max) @ w.T, out_min, out_max)."""

    weight: Any               # [out, in] (or a QuantArray)
    bounds: Any = None        # [4] model dtype: input_min, input_max, output_min, output_max; None: no clipping


@pytree_dataclass
class VisionLayerWeights:
    input_norm: Any           # [D] f32
    post_attn_norm: Any       # [D] f32
    pre_ff_norm: Any          # [D] f32
    post_ff_norm: Any         # [D] f32
    q_proj: ClippedLinear     # [N*H, D]
    k_proj: ClippedLinear     # [K*H, D]
    v_proj: ClippedLinear     # [K*H, D]
    o_proj: ClippedLinear     # [D, N*H]
    q_norm: Any               # [H] f32
    k_norm: Any               # [H] f32
    gate_proj: ClippedLinear  # [F, D]
    up_proj: ClippedLinear    # [F, D]
    down_proj: ClippedLinear  # [D, F]


@pytree_dataclass
class VisionWeights:
    patch_proj: Any           # [D, C]
    pos_table: Any            # [2, position_embedding_size, D]: x table, y table
    layers: tuple
    embed_proj: Any           # [D_text, D] (embed_vision.embedding_projection)
    std_bias: Any = None      # [D] f32 (standardize only)
    std_scale: Any = None     # [D] f32


@pytree_dataclass
class UnifiedVisionWeights:
    ln1_w: Any                # [C] f32
    ln1_b: Any                # [C] f32
    dense_w: Any              # [E, C]
    dense_b: Any              # [E]
    ln2_w: Any                # [E] f32
    ln2_b: Any                # [E] f32
    pos_table: Any            # [posemb_size, 2, E]
    pos_norm_w: Any           # [E] f32
    pos_norm_b: Any           # [E] f32
    embed_proj: Any           # [D_text, E]


def _as_f32(v):
    return jax.ShapeDtypeStruct(v.shape, f32) if isinstance(v, jax.ShapeDtypeStruct) else v


def _bounds(get: Callable, name: str):
    """Stack the four scalar clip buffers of `name` into one [4] leaf (abstract when the getter is)."""
    vals = [get(f"{name}.{b}") for b in CLIP_BOUNDS]
    if isinstance(vals[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((4,), vals[0].dtype)
    return jnp.stack([jnp.reshape(v, ()) for v in vals])


def build_vision_weights(cfg: VisionConfig, get: Callable[[str], Any], quantize: Callable | None = None
                         ) -> VisionWeights:
    """Assemble VisionWeights from a getter of released-checkpoint names (without `model.`).

    The getter returns arrays (or ShapeDtypeStructs); norms and std buffers are made float32 here, clip bounds keep
    the getter's dtype (HF clamps against bounds in the model dtype). `quantize(name, leaf)` may replace the
    projection leaves (names ending in VISION_LINEARS)."""
    def proj(name):
        v = get(name)
        return quantize(name, v) if quantize is not None else v

    def norm(name):
        return _as_f32(get(name))

    def clipped(name):
        return ClippedLinear(proj(name + ".linear.weight"), _bounds(get, name) if cfg.use_clipped_linears else None)

    p = "vision_tower."
    layers = []
    for i in range(cfg.num_layers):
        lp = f"{p}encoder.layers.{i}."
        layers.append(VisionLayerWeights(
            input_norm=norm(lp + "input_layernorm.weight"), post_attn_norm=norm(lp + "post_attention_layernorm.weight"),
            pre_ff_norm=norm(lp + "pre_feedforward_layernorm.weight"),
            post_ff_norm=norm(lp + "post_feedforward_layernorm.weight"),
            q_proj=clipped(lp + "self_attn.q_proj"), k_proj=clipped(lp + "self_attn.k_proj"),
            v_proj=clipped(lp + "self_attn.v_proj"), o_proj=clipped(lp + "self_attn.o_proj"),
            q_norm=norm(lp + "self_attn.q_norm.weight"), k_norm=norm(lp + "self_attn.k_norm.weight"),
            gate_proj=clipped(lp + "mlp.gate_proj"), up_proj=clipped(lp + "mlp.up_proj"),
            down_proj=clipped(lp + "mlp.down_proj")))
    return VisionWeights(
        patch_proj=proj(p + "patch_embedder.input_proj.weight"),
        pos_table=get(p + "patch_embedder.position_embedding_table"), layers=tuple(layers),
        embed_proj=proj("embed_vision.embedding_projection.weight"),
        std_bias=norm(p + "std_bias") if cfg.standardize else None,
        std_scale=norm(p + "std_scale") if cfg.standardize else None)


def build_unified_vision_weights(cfg: UnifiedVisionConfig, get: Callable[[str], Any],
                                 quantize: Callable | None = None) -> UnifiedVisionWeights:
    """Assemble UnifiedVisionWeights from a getter of released names (`vision_embedder.*`, `embed_vision.*`)."""
    def proj(name):
        v = get(name)
        return quantize(name, v) if quantize is not None else v

    p = "vision_embedder."
    n = lambda name: _as_f32(get(p + name))
    return UnifiedVisionWeights(
        ln1_w=n("patch_ln1.weight"), ln1_b=n("patch_ln1.bias"), dense_w=proj(p + "patch_dense.weight"),
        dense_b=get(p + "patch_dense.bias"), ln2_w=n("patch_ln2.weight"), ln2_b=n("patch_ln2.bias"),
        pos_table=get(p + "pos_embedding"), pos_norm_w=n("pos_norm.weight"), pos_norm_b=n("pos_norm.bias"),
        embed_proj=proj("embed_vision.embedding_projection.weight"))


def _abstract_getter(shapes: dict, dtype):
    return lambda name: jax.ShapeDtypeStruct(shapes[name], dtype)


def abstract_vision_weights(cfg: VisionConfig, dtype=jnp.bfloat16, quantize: Callable | None = None
                            ) -> VisionWeights:
    """The VisionWeights tree as ShapeDtypeStructs (no memory): for jax.eval_shape, AOT compiles and loading."""
    return build_vision_weights(cfg, _abstract_getter(cfg.param_shapes(), dtype), quantize)


def abstract_unified_vision_weights(cfg: UnifiedVisionConfig, dtype=jnp.bfloat16,
                                    quantize: Callable | None = None) -> UnifiedVisionWeights:
    return build_unified_vision_weights(cfg, _abstract_getter(cfg.param_shapes(), dtype), quantize)


# ---------------------------------------------------------------------------- blocks

def clipped_linear(x: Array, cl: ClippedLinear) -> Array:
    """x: [..., in] -> [..., out], clamping input and output to the stored bounds when there are any."""
    if cl.bounds is None:
        return linear(x, cl.weight)
    b = cl.bounds.astype(x.dtype)
    y = linear(jnp.clip(x, b[0], b[1]), cl.weight)
    return jnp.clip(y, b[2], b[3])


def layer_norm(x: Array, w: Array, b: Array, eps: float) -> Array:
    """torch nn.LayerNorm (biased variance) in float32, weight and bias applied before casting back to x.dtype."""
    xf = x.astype(f32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + eps) * w.astype(f32) + b.astype(f32)
    return y.astype(x.dtype)


def axial_rope_tables(cfg: VisionConfig, positions: Array, dtype) -> tuple[Array, Array]:
    """cos, sin: [B, T, H] for patch positions [B, T, 2] (x, y).

    Head dims [0, H/2) rotate with the x position, [H/2, H) with y; within each half, dim j pairs with j + H/4 and
    turns by pos * theta^(-4j / H) (HF: inverse frequencies over head_dim // 2, laid out x-x-y-y)."""
    half = cfg.head_dim // 2
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half))))
    freqs = positions.astype(f32)[..., None] * jnp.asarray(inv.astype(np.float32))    # [B, T, 2, H/4]
    emb = jnp.concatenate([freqs[..., 0, :], freqs[..., 0, :], freqs[..., 1, :], freqs[..., 1, :]], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_axial_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x: [B, T, heads, H]; cos / sin: [B, T, H]. Rotate-half within each of the two axis halves."""
    B, T, n, H = x.shape
    xs = x.reshape(B, T, n, 2, H // 2)
    q = H // 4
    rot = jnp.concatenate([-xs[..., q:], xs[..., :q]], axis=-1)
    c = cos.reshape(B, T, 1, 2, H // 2)
    s = sin.reshape(B, T, 1, 2, H // 2)
    return (xs * c + rot * s).reshape(B, T, n, H)


def _query_chunk(T: int, limit: int = 2048) -> int:
    """Largest divisor of T that is <= limit: queries are processed in blocks so scores stay [.., chunk, T]."""
    if T <= limit:
        return T
    return max(c for c in range(1, limit + 1) if T % c == 0)


def bidirectional_attention(q: Array, k: Array, v: Array, valid: Array) -> Array:
    """Unmasked-causality attention with key padding, scaling 1. q: [B, T, N, H]; k, v: [B, S, K, H];
    valid: [B, S] bool. Scores in the activation dtype (HF eager), softmax in float32. Returns [B, T, N, H]."""
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    chunk = _query_chunk(T)

    def block(qb):                                                    # qb: [B, c, N, H]
        c = qb.shape[1]
        s = jnp.einsum("btkgh,bskh->bkgts", qb.reshape(B, c, K, G, H), k, preferred_element_type=f32)
        s = s.astype(q.dtype).astype(f32)
        s = jnp.where(valid[:, None, None, None, :], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
        o = jnp.einsum("bkgts,bskh->btkgh", p, v, preferred_element_type=f32).astype(q.dtype)
        return o.reshape(B, c, N, H)

    if chunk == T:
        return block(q)
    qs = jnp.moveaxis(q.reshape(B, T // chunk, chunk, N, H), 1, 0)   # [T/c, B, c, N, H]
    out = jax.lax.map(block, qs)
    return jnp.moveaxis(out, 0, 1).reshape(B, T, N, H)


def vision_layer(cfg: VisionConfig, lw: VisionLayerWeights, x: Array, cos: Array, sin: Array, valid: Array
                 ) -> Array:
    """One encoder layer. x: [B, T, D]; valid: [B, T] (False for padding patches)."""
    B, T, _ = x.shape
    N, K, H, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    h = rms_norm(x, lw.input_norm, eps)
    q = apply_axial_rope(rms_norm(clipped_linear(h, lw.q_proj).reshape(B, T, N, H), lw.q_norm, eps), cos, sin)
    k = apply_axial_rope(rms_norm(clipped_linear(h, lw.k_proj).reshape(B, T, K, H), lw.k_norm, eps), cos, sin)
    v = rms_norm(clipped_linear(h, lw.v_proj).reshape(B, T, K, H), None, eps)
    o = bidirectional_attention(q, k, v, valid).reshape(B, T, N * H)
    x = x + rms_norm(clipped_linear(o, lw.o_proj), lw.post_attn_norm, eps)
    h = rms_norm(x, lw.pre_ff_norm, eps)
    h = clipped_linear(gelu_tanh(clipped_linear(h, lw.gate_proj)) * clipped_linear(h, lw.up_proj), lw.down_proj)
    return x + rms_norm(h, lw.post_ff_norm, eps)


def pool_by_position(h: Array, positions: Array, out_len: int) -> tuple[Array, Array]:
    """Average k x k blocks of patches by their (x, y) positions. h: [B, T, D] (padding rows already zero);
    positions: [B, T, 2]. Returns (pooled float32 [B, M, D], valid [B, M]); soft token m of an image w patches
    wide is block (m mod (w/k), m div (w/k)), so valid soft tokens come first."""
    T = h.shape[1]
    k = math.isqrt(T // out_len)
    if k * k * out_len != T:
        raise ValueError(f"vision pooling: {T} patches cannot pool to {out_len} soft tokens (k={k}: k^2 * {out_len} "
                         f"must equal {T})")
    pos = jnp.maximum(positions, 0)
    width = jnp.max(pos[..., 0], axis=-1, keepdims=True) + 1                  # [B, 1] patches per row
    kidx = pos // k
    idx = kidx[..., 0] + (width // k) * kidx[..., 1]                          # [B, T] soft token of each patch
    sums = jax.vmap(lambda hb, ib: jax.ops.segment_sum(hb, ib, num_segments=out_len))(h.astype(f32), idx)
    counts = jax.vmap(lambda ib: jnp.bincount(ib, length=out_len))(idx)       # padding patches land on token 0
    return sums * np.float32(1.0 / (k * k)), counts > 0


def encode_images(w: VisionWeights, cfg: VisionConfig, pixel_values: Array, position_ids: Array
                  ) -> tuple[Array, Array]:
    """Images -> soft tokens in the text embedding space (vision tower + embed_vision).

    Args:
      pixel_values: [B, T, C] float, in [0, 1], as `tools.media.preprocess_image` (HF's processor) lays them out;
        T = max_soft_tokens * k^2 (padding rows zero).
      position_ids: [B, T, 2] int (x, y) patch coordinates, (-1, -1) for padding.
    Returns:
      (embeds [B, M, D_text] in the weights' dtype, valid [B, M] bool), M = T / k^2; valid tokens come first and
      number (height / 16k) * (width / 16k) for each image.
    """
    dtype = _dtype(w.patch_proj)
    T = pixel_values.shape[1]
    pad = jnp.all(position_ids == -1, axis=-1)                                # [B, T]
    x = linear((2.0 * (pixel_values.astype(f32) - 0.5)).astype(dtype), w.patch_proj)
    pos = jnp.maximum(position_ids, 0)
    pe = jnp.take(w.pos_table[0], pos[..., 0], axis=0) + jnp.take(w.pos_table[1], pos[..., 1], axis=0)
    x = x + jnp.where(pad[..., None], 0, pe).astype(dtype)
    cos, sin = axial_rope_tables(cfg, position_ids, dtype)
    for lw in w.layers:
        x = vision_layer(cfg, lw, x, cos, sin, ~pad)
    x = jnp.where(pad[..., None], 0, x)
    pooled, valid = pool_by_position(x, position_ids, T // cfg.pooling_kernel_size ** 2)
    h = pooled.astype(dtype).astype(f32) * np.float32(cfg.hidden_size ** 0.5)  # HF: pool output cast, then scaled
    if cfg.standardize:
        h = (h - w.std_bias) * w.std_scale
    h = h.astype(dtype)
    return linear(rms_norm(h, None, cfg.rms_norm_eps), w.embed_proj), valid


def encode_images_unified(w: UnifiedVisionWeights, cfg: UnifiedVisionConfig, pixel_values: Array,
                          position_ids: Array) -> tuple[Array, Array]:
    """12B: merged patches -> soft tokens in the text embedding space (no encoder layers).

    Args:
      pixel_values: [B, M, C] float in [0, 1], C = 3 * (16k)^2 (`tools.media.preprocess_image(..., unified=True)`).
      position_ids: [B, M, 2] int merged-patch (x, y), (-1, -1) for padding.
    Returns: (embeds [B, M, D_text], valid [B, M] bool).
    """
    dtype = _dtype(w.dense_w)
    eps = cfg.layer_norm_eps
    x = layer_norm(pixel_values.astype(dtype), w.ln1_w, w.ln1_b, eps)
    x = layer_norm(linear(x, w.dense_w) + w.dense_b.astype(dtype), w.ln2_w, w.ln2_b, eps)
    pos = jnp.maximum(position_ids, 0)
    keep = (position_ids != -1).astype(dtype)                                 # [B, M, 2] per axis
    pe = (jnp.take(w.pos_table[:, 0], pos[..., 0], axis=0) * keep[..., 0:1]
          + jnp.take(w.pos_table[:, 1], pos[..., 1], axis=0) * keep[..., 1:2])
    x = layer_norm(x + pe.astype(dtype), w.pos_norm_w, w.pos_norm_b, eps)
    valid = jnp.all(position_ids != -1, axis=-1)
    return linear(rms_norm(x, None, cfg.rms_norm_eps), w.embed_proj), valid


def _dtype(w) -> Any:
    """Activation dtype of a (possibly quantized) weight: a QuantArray's `dtype` is the one it was made from."""
    return w.dtype
