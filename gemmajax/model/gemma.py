"""The Gemma 4 (and Gemma 3) text decoder as pure functions over frozen dataclass pytrees.

Design choices:
- Weights stay in Hugging Face's [out, in] layout and every projection goes through `quant.linear`, so a
  `QuantArray` can stand wherever an array does. Norm weights are float32 (HF upcasts them anyway), with
  Gemma 3's `1 + w` folded in at load time.
- Attention is a pluggable function: `decoder(...)` calls `attend(layer, q, k, v, kv) -> (out, kv)` for
  every layer, where `kv` is that layer's cache slot. The contiguous cache below (`DenseKVCache`) backs
  `logits()` and prefill/decode tests; the engine plugs in the paged cache. KV-shared layers get k = v = None
  and the slot of their source layer (already updated this step).
- Numerics follow HF (eager attention): RMSNorm in float32 with the weight applied before the downcast, the
  embedding scale rounded to the weight dtype, scalar multiplies done in float32 and rounded once (torch's
  "opmath"), softmax in float32.

Einsum letters: B batch, T tokens, S KV length, D model dim, N query heads, K KV heads, G = N // K query
heads per KV head, H head dim, F MLP dim, V vocab, E experts, L layers, P per-layer-input dim.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from gemmajax.config import ModelConfig, LayerSpec
from gemmajax.quant import gmm, linear, take_rows
from gemmajax.quant.array import concat_out, split_out

Array = jax.Array
f32 = jnp.float32


def pytree_dataclass(cls):
    """Frozen dataclass registered as a pytree: every field is a child (None children have no leaves)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


# ---------------------------------------------------------------------------- weights

@pytree_dataclass
class AttentionWeights:
    q_proj: Any               # [N*H, D]
    q_norm: Any               # [H] f32
    o_proj: Any               # [D, N*H]
    k_proj: Any = None        # [K*H, D]; None on KV-shared layers
    k_norm: Any = None        # [H] f32; None on KV-shared layers
    v_proj: Any = None        # [K*H, D]; None on K=V and KV-shared layers
    # [(N+2K)*H or (N+K)*H, D]: q_proj, k_proj and v_proj joined along `out` (fuse_projections, the CPU engine's
    # form); those three are None then
    qkv_proj: Any = None


@pytree_dataclass
class MLPWeights:
    gate_proj: Any            # [F, D]; None when fused
    up_proj: Any              # [F, D]; None when fused
    down_proj: Any            # [D, F]
    gate_up_proj: Any = None  # [2F, D]: gate_proj and up_proj joined along `out` (fuse_projections)


@pytree_dataclass
class MoEWeights:
    router_proj: Any          # [E, D]
    router_scale: Any         # [D]
    per_expert_scale: Any     # [E]
    gate_up_proj: Any         # [E, 2F, D]  rows 0..F-1 gate, F..2F-1 up
    down_proj: Any            # [E, D, F]
    pre_norm_2: Any           # [D] f32  (pre_feedforward_layernorm_2)
    post_norm_1: Any          # [D] f32  (post_feedforward_layernorm_1, dense branch)
    post_norm_2: Any          # [D] f32  (post_feedforward_layernorm_2, expert branch)


@pytree_dataclass
class LayerWeights:
    input_norm: Any           # [D] f32
    post_attn_norm: Any       # [D] f32
    pre_ff_norm: Any          # [D] f32
    post_ff_norm: Any         # [D] f32
    attn: AttentionWeights
    mlp: MLPWeights
    moe: MoEWeights | None = None
    ple_gate: Any = None      # [P, D]
    ple_proj: Any = None      # [D, P]
    ple_post_norm: Any = None  # [D] f32
    layer_scalar: Any = None  # [1] model dtype


@pytree_dataclass
class Weights:
    embed: Any                # [V, D] (tied LM head)
    final_norm: Any           # [D] f32
    layers: tuple
    ple_table: Any = None     # [V_ple, L*P]
    ple_model_proj: Any = None  # [L*P, D]
    ple_proj_norm: Any = None  # [P] f32


def abstract_weights(cfg: ModelConfig, dtype=jnp.bfloat16, quantize: Callable | None = None) -> Weights:
    """The weight tree as ShapeDtypeStructs (no memory): for jax.eval_shape, TPU AOT and loading alike.

    `quantize(name, shape_dtype) -> leaf` may replace projection leaves by abstract QuantArrays."""
    shapes = cfg.param_shapes()
    return build_weights(cfg, lambda name: jax.ShapeDtypeStruct(shapes[name], dtype), norm_dtype=f32,
                         quantize=quantize)


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight") or "layernorm" in name


def build_weights(cfg: ModelConfig, get: Callable[[str], Any], norm_dtype=f32,
                  quantize: Callable | None = None) -> Weights:
    """Assemble the Weights tree from a getter of HF-named tensors (names without the model prefix).

    Norm leaves are cast to `norm_dtype` by the getter's caller; `quantize(name, leaf)` may wrap projections."""
    def norm(name):
        v = get(name)
        return jax.ShapeDtypeStruct(v.shape, norm_dtype) if isinstance(v, jax.ShapeDtypeStruct) else v

    def proj(name):  # projections and vocabulary tables: the quantizer decides by name
        v = get(name)
        return quantize(name, v) if quantize is not None else v

    layers = []
    for s in cfg.layers:
        p = f"layers.{s.index}."
        a = p + "self_attn."
        attn = AttentionWeights(
            q_proj=proj(a + "q_proj.weight"), q_norm=norm(a + "q_norm.weight"), o_proj=proj(a + "o_proj.weight"),
            k_proj=proj(a + "k_proj.weight") if s.owns_kv else None,
            k_norm=norm(a + "k_norm.weight") if s.owns_kv else None,
            v_proj=proj(a + "v_proj.weight") if s.owns_kv and not s.k_eq_v else None)
        mlp = MLPWeights(proj(p + "mlp.gate_proj.weight"), proj(p + "mlp.up_proj.weight"),
                         proj(p + "mlp.down_proj.weight"))
        moe = None
        if cfg.enable_moe:
            moe = MoEWeights(
                router_proj=get(p + "router.proj.weight"), router_scale=get(p + "router.scale"),
                per_expert_scale=get(p + "router.per_expert_scale"),
                gate_up_proj=proj(p + "experts.gate_up_proj"), down_proj=proj(p + "experts.down_proj"),
                pre_norm_2=norm(p + "pre_feedforward_layernorm_2.weight"),
                post_norm_1=norm(p + "post_feedforward_layernorm_1.weight"),
                post_norm_2=norm(p + "post_feedforward_layernorm_2.weight"))
        layers.append(LayerWeights(
            input_norm=norm(p + "input_layernorm.weight"), post_attn_norm=norm(p + "post_attention_layernorm.weight"),
            pre_ff_norm=norm(p + "pre_feedforward_layernorm.weight"),
            post_ff_norm=norm(p + "post_feedforward_layernorm.weight"), attn=attn, mlp=mlp, moe=moe,
            ple_gate=proj(p + "per_layer_input_gate.weight") if cfg.ple_dim else None,
            ple_proj=proj(p + "per_layer_projection.weight") if cfg.ple_dim else None,
            ple_post_norm=norm(p + "post_per_layer_input_norm.weight") if cfg.ple_dim else None,
            layer_scalar=get(p + "layer_scalar") if cfg.use_layer_scalar else None))
    return Weights(
        embed=proj("embed_tokens.weight"), final_norm=norm("norm.weight"), layers=tuple(layers),
        ple_table=proj("embed_tokens_per_layer.weight") if cfg.ple_dim else None,
        ple_model_proj=proj("per_layer_model_projection.weight") if cfg.ple_dim else None,
        ple_proj_norm=norm("per_layer_projection_norm.weight") if cfg.ple_dim else None)


def fuse_projections(weights: Weights) -> Weights:
    """`weights` with each layer's q / k / v projections joined into `qkv_proj` and gate / up into `gate_up_proj`
    (quant.array.concat_out: the same rows in order; what cannot be joined exactly stays apart, as do KV-shared
    layers' lone q_proj). One matmul then reads what two or three read before: fewer, larger matrix-vector passes,
    each split over the cores once. The CPU engine's form (engine/llm_engine.py); `unfuse_projections` undoes it."""
    layers = []
    for lw in weights.layers:
        a, m = lw.attn, lw.mlp
        if a.qkv_proj is None and a.k_proj is not None:
            qkv = concat_out([a.q_proj, a.k_proj] + ([a.v_proj] if a.v_proj is not None else []))
            if qkv is not None:
                a = dataclasses.replace(a, qkv_proj=qkv, q_proj=None, k_proj=None, v_proj=None)
        if m.gate_up_proj is None:
            gu = concat_out([m.gate_proj, m.up_proj])
            if gu is not None:
                m = dataclasses.replace(m, gate_up_proj=gu, gate_proj=None, up_proj=None)
        layers.append(dataclasses.replace(lw, attn=a, mlp=m))
    return dataclasses.replace(weights, layers=tuple(layers))


def unfuse_projections(weights: Weights, cfg: ModelConfig) -> Weights:
    """The inverse of `fuse_projections`: the standard tree, each projection its own leaf again (copies of the
    joined rows)."""
    layers = []
    for s, lw in zip(cfg.layers, weights.layers):
        a, m = lw.attn, lw.mlp
        if a.qkv_proj is not None:
            nh, kh = cfg.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
            parts = split_out(a.qkv_proj, [nh, kh] + ([] if s.k_eq_v else [kh]))
            a = dataclasses.replace(a, qkv_proj=None, q_proj=parts[0], k_proj=parts[1],
                                    v_proj=None if s.k_eq_v else parts[2])
        if m.gate_up_proj is not None:
            g, u = split_out(m.gate_up_proj, [m.gate_up_proj.shape[0] // 2] * 2)
            m = dataclasses.replace(m, gate_up_proj=None, gate_proj=g, up_proj=u)
        layers.append(dataclasses.replace(lw, attn=a, mlp=m))
    return dataclasses.replace(weights, layers=tuple(layers))


# ---------------------------------------------------------------------------- numerics helpers

def fixed_order_sum(x: Array) -> Array:
    """Sum over the last axis (kept, size 1) by a fixed tree of elementwise adds: halves are added until one column
    is left (an odd width first adds its last column into its first). Each row's result depends on that row alone,
    whatever the shape around it."""
    while x.shape[-1] > 1:
        n = x.shape[-1]
        if n % 2:
            x = jnp.concatenate([x[..., :1] + x[..., n - 1:], x[..., 1:n - 1]], axis=-1)
            n -= 1
        x = x[..., :n // 2] + x[..., n // 2:]
    return x


def row_mean(x: Array) -> Array:
    """Mean over the last axis (kept). On XLA:CPU by `fixed_order_sum`: there a reduce's bits for a row change with
    the array's size (measured on a Zen 3, [1, T, 4, H] float32: from 4,096 elements on, e.g. H=64 from 16 tokens,
    at -O0 and at the default level), so the same token got other bits in a step of more tokens, and speculative
    verification (more tokens a step) left plain decoding's tokens after fp8 rounding. Elsewhere: jnp.mean."""
    n = x.shape[-1]
    return jax.lax.platform_dependent(
        x, cpu=lambda v: fixed_order_sum(v) / n, default=lambda v: jnp.mean(v, axis=-1, keepdims=True))


def rms_norm(x: Array, w: Array | None, eps: float) -> Array:
    """HF RMSNorm: float32 math, weight (float32) applied before casting back to x.dtype. w=None: no weight."""
    xf = x.astype(f32)
    y = xf * jax.lax.rsqrt(row_mean(xf * xf) + eps)
    if w is not None:
        y = y * w.astype(f32)
    return y.astype(x.dtype)


def scale(x: Array, c: float) -> Array:
    """x * python float the way torch does it: in float32, rounded once to x.dtype."""
    return (x.astype(f32) * c).astype(x.dtype)


def gelu_tanh(x: Array) -> Array:
    return jax.nn.gelu(x.astype(f32), approximate=True).astype(x.dtype)


def rope_tables(spec: LayerSpec, positions: Array, dtype) -> tuple[Array, Array]:
    """cos, sin: [B, T, H] for the layer's RoPE (NeoX / rotate-half pairs j, j + H/2), cast to dtype as HF does.

    Frequencies j >= rope_dims are zero ("proportional" partial rotation keeps those dims unrotated)."""
    H = spec.head_dim
    j = np.arange(H // 2)
    inv = np.where(j < spec.rope_dims, spec.rope_theta ** (-(2.0 * j) / spec.rope_denominator), 0.0)
    inv = jnp.asarray((inv / spec.rope_scale).astype(np.float32))
    freqs = positions.astype(f32)[..., None] * inv          # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)          # [B, T, H]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x: [B, T, heads, H]; cos/sin: [B, T, H]."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rot * sin[:, :, None, :]


# ---------------------------------------------------------------------------- embeddings

def embed(w: Weights, cfg: ModelConfig, ids: Array) -> Array:
    """ids [B, T] -> x [B, T, D] in the embedding's dtype, times sqrt(D) rounded to that dtype (HF)."""
    dtype = compute_dtype(w)
    x = take_rows(w.embed, ids, dtype)
    return x * jnp.asarray(cfg.hidden_size ** 0.5, dtype=f32).astype(dtype)


def per_layer_inputs(w: Weights, cfg: ModelConfig, ids: Array, x: Array) -> Array | None:
    """PLE: [B, T, L, P] = (rms(proj(x) * D^-0.5) + table[ids] * sqrt(P)) * 2^-0.5; None without PLE."""
    if not cfg.ple_dim:
        return None
    B, T = ids.shape
    L, P = cfg.num_layers, cfg.ple_dim
    ple_ids = jnp.where((ids >= 0) & (ids < cfg.ple_vocab_size), ids, 0)
    tok = take_rows(w.ple_table, ple_ids, x.dtype)
    tok = (tok * jnp.asarray(P ** 0.5, f32).astype(x.dtype)).reshape(B, T, L, P)
    proj = scale(linear(x, w.ple_model_proj), cfg.hidden_size ** -0.5).reshape(B, T, L, P)
    proj = rms_norm(proj, w.ple_proj_norm, cfg.rms_norm_eps)
    return scale(proj + tok, 2.0 ** -0.5)


def compute_dtype(w: Weights):
    """Activation dtype = the dtype of the (possibly quantized) embedding table's values."""
    e = w.embed
    return getattr(e, "compute_dtype", None) or e.dtype


# ---------------------------------------------------------------------------- blocks

AttendFn = Callable[[LayerSpec, Array, "Array | None", "Array | None", Any], tuple[Array, Any]]


def attention_block(cfg: ModelConfig, spec: LayerSpec, lw: LayerWeights, h: Array, cos: Array, sin: Array,
                    attend: AttendFn, kv: Any, rows: Array | None = None) -> tuple[Array, Any]:
    """h: [B, T, D] (input-normed). Returns (o_proj output [B, T, D], updated kv slot); with `rows` (int [R]) the
    o_proj output of those tokens only, [B, R, D] (every token's K/V is still written and attended)."""
    B, T, _ = h.shape
    N, K, H = cfg.num_heads, spec.num_kv_heads, spec.head_dim
    a = lw.attn
    if a.qkv_proj is not None:  # one matmul, its columns split (fuse_projections)
        n_qkv = (N + (1 if spec.k_eq_v else 2) * K) * H
        if a.qkv_proj.shape[0] != n_qkv or not spec.owns_kv:
            raise ValueError(f"layer {spec.index}: a joined qkv_proj needs a layer that owns its K/V and q, k"
                             f"{'' if spec.k_eq_v else ', v'} rows ({n_qkv}); got {a.qkv_proj.shape[0]} rows, "
                             f"owns_kv={spec.owns_kv}")
        y = linear(h, a.qkv_proj)
        q, k_raw = y[..., :N * H], y[..., N * H:(N + K) * H].reshape(B, T, K, H)
        v_raw = k_raw if spec.k_eq_v else y[..., (N + K) * H:].reshape(B, T, K, H)
    else:
        q = linear(h, a.q_proj)
        if spec.owns_kv:
            k_raw = linear(h, a.k_proj).reshape(B, T, K, H)
            v_raw = k_raw if spec.k_eq_v else linear(h, a.v_proj).reshape(B, T, K, H)
    q = apply_rope(rms_norm(q.reshape(B, T, N, H), a.q_norm, cfg.rms_norm_eps), cos, sin)
    k = v = None
    if spec.owns_kv:
        k = apply_rope(rms_norm(k_raw, a.k_norm, cfg.rms_norm_eps), cos, sin)
        v = rms_norm(v_raw, None, cfg.rms_norm_eps) if cfg.use_v_norm else v_raw
    o, kv = attend(spec, q, k, v, kv)                        # [B, T, N, H]
    if rows is not None:
        o = o[:, rows]
    return linear(o.reshape(B, o.shape[1], N * H), a.o_proj), kv


def mlp_block(mw: MLPWeights, h: Array) -> Array:
    if mw.gate_up_proj is not None:  # one matmul, its columns split (fuse_projections)
        y = linear(h, mw.gate_up_proj)
        f = y.shape[-1] // 2   # gate and up are alike
        return linear(gelu_tanh(y[..., :f]) * y[..., f:], mw.down_proj)
    return linear(gelu_tanh(linear(h, mw.gate_proj)) * linear(h, mw.up_proj), mw.down_proj)


def moe_block(cfg: ModelConfig, mw: MoEWeights, res: Array) -> Array:
    """26B-A4B experts branch on the raw residual res: [B, T, D] -> [B, T, D] (before post_norm_2).

    Each token's top-k copies are sorted by expert and run through `quant.gmm` (the grouped expert matmul): only
    the routed experts are read and multiplied, quantized stacks in place (the Pallas kernel on TPU), plain ones
    through ragged_dot (TPU / GPU) or the per-expert loop (CPU); no stack is dequantized or copied."""
    B, T, D = res.shape
    E, k, F = cfg.num_experts, cfg.top_k_experts, cfg.moe_dim
    x = res.reshape(B * T, D)
    # router: weightless RMSNorm of the raw residual, times scale and D^-0.5
    r = rms_norm(x, None, cfg.rms_norm_eps)
    r = scale(r * mw.router_scale.astype(r.dtype), D ** -0.5)
    probs = jax.nn.softmax(linear(r, mw.router_proj).astype(f32), axis=-1)     # [BT, E]
    top_w, top_i = jax.lax.top_k(probs, k)                                     # [BT, k]
    top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    top_w = top_w * mw.per_expert_scale[top_i].astype(f32)

    xe = rms_norm(x, mw.pre_norm_2, cfg.rms_norm_eps)
    flat_e = top_i.reshape(-1)                                                  # [BT*k]
    order = jnp.argsort(flat_e)
    tok = order // k
    xs = xe[tok]                                                                # [BT*k, D]
    sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)                  # [E] rows per expert
    gu = gmm(xs, mw.gate_up_proj, sizes)                                        # [BT*k, 2F]; experts [E, 2F, D]
    hmid = gelu_tanh(gu[:, :F]) * gu[:, F:]
    y = gmm(hmid, mw.down_proj, sizes)                                          # [BT*k, D]; experts [E, D, F]
    wt = top_w.reshape(-1)[order]
    y = (y.astype(f32) * wt[:, None]).astype(x.dtype)
    out = jnp.zeros_like(x).at[tok].add(y)
    return out.reshape(B, T, D)


def decoder_layer(cfg: ModelConfig, spec: LayerSpec, lw: LayerWeights, x: Array, cos: Array, sin: Array,
                  ple: Array | None, attend: AttendFn, kv: Any, rows: Array | None = None) -> tuple[Array, Any]:
    """x: [B, T, D] -> ([B, T, D], kv); with `rows` (int [R]) every token's K/V is written and attended, and only
    those tokens go on after attention: [B, R, D] (the rest of the layer is per token)."""
    eps = cfg.rms_norm_eps
    h, kv = attention_block(cfg, spec, lw, rms_norm(x, lw.input_norm, eps), cos, sin, attend, kv, rows)
    if rows is not None:
        x = x[:, rows]
        ple = None if ple is None else ple[:, rows]
    x = x + rms_norm(h, lw.post_attn_norm, eps)

    res = x
    h = mlp_block(lw.mlp, rms_norm(x, lw.pre_ff_norm, eps))
    if lw.moe is not None:
        h1 = rms_norm(h, lw.moe.post_norm_1, eps)
        h2 = rms_norm(moe_block(cfg, lw.moe, res), lw.moe.post_norm_2, eps)
        h = h1 + h2
    x = res + rms_norm(h, lw.post_ff_norm, eps)

    if ple is not None:
        g = gelu_tanh(linear(x, lw.ple_gate)) * ple
        x = x + rms_norm(linear(g, lw.ple_proj), lw.ple_post_norm, eps)
    if lw.layer_scalar is not None:
        x = x * lw.layer_scalar.astype(x.dtype)
    return x, kv


def decoder(w: Weights, cfg: ModelConfig, ids: Array, positions: Array, attend: AttendFn, kv: tuple,
            shared_band: Callable | None = None, soft_tokens: tuple[Array, Array] | None = None,
            last_rows: Array | None = None) -> tuple[Array, tuple]:
    """Run all layers. ids, positions: [B, T]; kv: one cache slot per KV-owning layer (cfg.kv_layers).

    `shared_band(x, positions, ple) -> (x, positions, ple, attend)` may shrink the token set before the first
    KV-shared layer (they write no cache, so only positions whose logits are needed must go on) and give the
    attention function those layers use. `soft_tokens` = (mask bool [B, T], rows [B, T, D]): image / audio soft
    tokens replace the embedding where mask is set (HF: ids there are the pad id, the rows are not scaled, and
    PLE projects the merged rows; model/multimodal.py). `last_rows` (int [R]): the last layer writes and attends
    every token's K/V, then carries only these tokens through its o_proj and MLP (the only ones whose hidden state
    is used: a prompt's last token, say), so its output is [B, R, D]. Returns (final-normed hidden [B, T', D],
    updated kv)."""
    if last_rows is not None and shared_band is not None:
        raise ValueError("decoder: last_rows and shared_band cannot both be given (last_rows index all T tokens, "
                         "and a shared band has already narrowed them to its own rows)")
    x = embed(w, cfg, ids)
    if soft_tokens is not None:
        mask, rows = soft_tokens
        x = jnp.where(mask[..., None], rows.astype(x.dtype), x)
    ple = per_layer_inputs(w, cfg, ids, x)
    kv = list(kv)
    slot = cfg.kv_slot
    tables = {}
    for spec, lw in zip(cfg.layers, w.layers):
        if spec.index == cfg.first_shared_layer and shared_band is not None:
            x, positions, ple, attend = shared_band(x, positions, ple)
            tables = {}
        key = (spec.kind, spec.head_dim, spec.rope_theta, spec.rope_dims, spec.rope_scale)
        if key not in tables:
            tables[key] = rope_tables(spec, positions, x.dtype)
        cos, sin = tables[key]
        s = slot[spec.index]
        rows = last_rows if spec.index == cfg.num_layers - 1 else None
        x, kv[s] = decoder_layer(cfg, spec, lw, x, cos, sin,
                                 None if ple is None else ple[:, :, spec.index, :], attend, kv[s], rows)
    return rms_norm(x, w.final_norm, cfg.rms_norm_eps), tuple(kv)


def lm_head(w: Weights, cfg: ModelConfig, h: Array) -> Array:
    """Tied LM head with the final softcap, in the activation dtype. h: [..., D] -> [..., V]."""
    logits = linear(h, w.embed)
    if cfg.final_logit_softcap:
        c = cfg.final_logit_softcap
        logits = jnp.tanh(logits / jnp.asarray(c, logits.dtype)) * jnp.asarray(c, logits.dtype)
    return logits


# ---------------------------------------------------------------------------- contiguous cache

@pytree_dataclass
class DenseKVCache:
    """A contiguous cache: per KV-owning layer, K and V [B, S_max, K, H]; token at position p sits at slot p."""

    k: tuple                  # per slot: [B, S_max, K, H]
    v: tuple                  # per slot: [B, S_max, K, H]
    lengths: Any              # [B] int32: tokens already written


def init_dense_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> DenseKVCache:
    shapes = [(batch, max_len, cfg.layers[li].num_kv_heads, cfg.layers[li].head_dim) for li in cfg.kv_layers]
    return DenseKVCache(k=tuple(jnp.zeros(s, dtype) for s in shapes), v=tuple(jnp.zeros(s, dtype) for s in shapes),
                        lengths=jnp.zeros((batch,), jnp.int32))


def dense_attention(q: Array, k: Array, v: Array, q_pos: Array, kv_len: Array, spec: LayerSpec, sm_scale: float,
                    softcap: float | None) -> Array:
    """Eager attention over a contiguous cache. q: [B, T, N, H]; k, v: [B, S, K, H]; q_pos: [B, T];
    kv_len: [B] (slots < kv_len are valid). Causal, plus the sliding window when spec.window is set."""
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    qg = q.reshape(B, T, K, G, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=f32)
    s = (s * sm_scale).astype(q.dtype).astype(f32)          # HF: q @ k.T in the activation dtype, times scaling
    if softcap:
        s = jnp.tanh(s / softcap) * softcap
    j = jnp.arange(k.shape[1])
    ok = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_len[:, None, None])  # [B, T, S]
    if spec.window is not None:
        ok &= q_pos[:, :, None] - j[None, None, :] < spec.window
    s = jnp.where(ok[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    o = jnp.einsum("bkgts,bskh->btkgh", p, v, preferred_element_type=f32).astype(q.dtype)
    return o.reshape(B, T, N, H)


def forward_dense(w: Weights, cfg: ModelConfig, ids: Array, cache: DenseKVCache) -> tuple[Array, DenseKVCache]:
    """Run T new tokens per row on top of a contiguous cache. ids: [B, T]. Returns (logits [B, T, V], cache)."""
    B, T = ids.shape
    start = cache.lengths
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    new_len = start + T

    def attend(spec, q, k, v, slot_kv):
        kc, vc = slot_kv
        if k is not None:  # write the new K/V at their positions, then attend over the cache
            def write(c, new, s):
                return jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), s, axis=0)
            kc = jax.vmap(write)(kc, k, start)
            vc = jax.vmap(write)(vc, v, start)
        o = dense_attention(q, kc.astype(q.dtype), vc.astype(q.dtype), positions, new_len, spec, cfg.attn_scale,
                            cfg.attn_logit_softcap)
        return o, (kc, vc)

    h, kv = decoder(w, cfg, ids, positions, attend, tuple(zip(cache.k, cache.v)))
    cache = DenseKVCache(k=tuple(a for a, _ in kv), v=tuple(b for _, b in kv), lengths=new_len)
    return lm_head(w, cfg, h), cache


@functools.partial(jax.jit, static_argnames=("cfg",))
def full_logits(w: Weights, cfg: ModelConfig, ids: Array) -> Array:
    """One causal forward with no prior cache, positions 0..T-1. ids: [B, T] -> logits [B, T, V] float32."""
    B, T = ids.shape
    cache = init_dense_cache(cfg, B, T, compute_dtype(w))
    logits, _ = forward_dense(w, cfg, ids, cache)
    return logits.astype(f32)
