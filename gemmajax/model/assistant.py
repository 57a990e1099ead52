"""The Gemma 4 assistant drafter (`gemma4_assistant` / `gemma4_unified_assistant`) as pure functions over pytrees.

Google's drafter for each Gemma 4 size is a small decoder (4 layers on E2B) that owns no KV cache: every layer is
Q-only and attends over the *target's* K/V. One draft step, exactly as transformers computes it
(`Gemma4AssistantForCausalLM.forward` driven by `SinglePositionMultiTokenCandidateGenerator`):

    x      = pre_projection(concat(target_embed(token) * sqrt(D_t), prev_hidden))         [B, D_a]
    h      = final_norm(layers(x))     each layer: Gemma 4 block, Q-only attention over the target's K/V
    logits = h @ lm_head.T             no softcap; or centroid-masked (E2B/E4B `use_ordered_embeddings`)
    next   = post_projection(h)                                                           [B, D_t]

The contract with the target (what an engine must hand over; `SinglePositionMultiTokenCandidateGenerator`):
- State: a row whose target has computed positions [0, p) and whose newest token t sits at position p (sampled
  from the logits at p - 1, its K/V not written yet). p is also the row's valid KV length.
- First step: token t, prev_hidden = the target's *final-normed* hidden state at position p - 1 (the input of
  its LM head, the row whose logits gave t: HF's `hidden_states[-1]`, which is `last_hidden_state`).
- Later steps: the previous step's argmax token and its `next` (post_projection output). No other state: the
  drafter writes no cache.
- Position: every step of a round uses RoPE position p (HF's generator keeps position_ids constant in a round).
- K/V: for each attention kind, the target's *last KV-owning layer of that kind* (HF's `shared_kv_states`, the
  "store" layers; E2B: 13 sliding / 14 full, E4B: 22 / 23, 12B/26B/31B: the last sliding and last full layer),
  positions [0, p) on full layers, and [p - 1 - W, p) on sliding layers: W + 1 positions, one more than the
  target's own window (HF's bidirectional window |i| <= W over the flipped buffer). `target_layers` names them.
  In the paged cache this is a read-only `ragged_paged_attention` (k = v = None) with one query per row and
  kv_lens = p: it places the query at p - 1, so this module's sliding LayerSpecs carry window = W + 1 and the
  runner's attend function gives exactly those positions. With C = p computed tokens the block manager keeps
  sliding positions from C - W + 1 (what the target's next query sees); the drafter reads from C - 1 - W, so
  with a drafter a sliding group must be released as if its window were W + 2.
HF's own `generate(assistant_model=...)` hands the drafter a trimmed sliding buffer and, after a partial accept,
the rejected drafts' K/V; that is not what the drafter's forward defines and this module does not copy it.

Centroid masking (`use_ordered_embeddings`): the top-k centroids of h pick k clusters of V / C token ids each
(`token_ordering` viewed as [C, V / C]); only those tokens get logits (the gathered LM-head rows), every other
token gets min(those logits) - 1. HF takes that minimum over its whole batch; its generator runs one row, and
here it is per row (the same for one row; a row's logits never depend on other rows).

Einsum letters: B batch, D model dim (D_a the drafter's, D_t the target's), V vocab, C centroids, J tokens the
selected centroids hold (k * V / C); attention as in gemma.py.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemmajax.config import FULL, SLIDING, ConfigError, LayerSpec, ModelConfig
from gemmajax.model import gemma
from gemmajax.model.gemma import pytree_dataclass
from gemmajax.quant import linear, take_rows

Array = jax.Array
f32 = jnp.float32

ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
# kv_source of a drafter layer: it reads the target's K/V (LayerSpec.owns_kv is False, so no K/V projections).
TARGET_KV = -1


# ---------------------------------------------------------------------------- config

@dataclass(frozen=True)
class AssistantConfig:
    """Frozen, hashable drafter description (`AssistantConfig.from_hf(config.json dict)`).

    `text` is the drafter's decoder: D_a = text.hidden_size, every LayerSpec Q-only (kv_source TARGET_KV), its
    sliding layers' window W + 1 (the module docstring says why) while `sliding_window` keeps HF's W."""

    text: ModelConfig
    backbone_hidden_size: int           # D_t: the target's hidden size
    sliding_window: int | None          # W of the drafter's config (None without sliding layers)
    use_ordered_embeddings: bool = False
    num_centroids: int = 0              # C
    centroid_top_k: int = 0             # centroid_intermediate_top_k
    tie_word_embeddings: bool = True    # LM head = the drafter's own embedding table [V, D_a]
    model_type: str = "gemma4_assistant"
    name: str = ""

    @property
    def tokens_per_centroid(self) -> int:
        return self.text.vocab_size // self.num_centroids

    @property
    def kinds(self) -> tuple[str, ...]:
        """Attention kinds the drafter's layers read, in (sliding, full) order."""
        used = {s.kind for s in self.text.layers}
        return tuple(k for k in (SLIDING, FULL) if k in used)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name (as Gemma4AssistantForCausalLM saves it) -> shape, for every tensor the drafter needs."""
        D, Dt, V = self.text.hidden_size, self.backbone_hidden_size, self.text.vocab_size
        shapes = {"model." + k: v for k, v in self.text.param_shapes().items()}
        shapes["pre_projection.weight"] = (D, 2 * Dt)
        shapes["post_projection.weight"] = (Dt, D)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (V, D)
        if self.use_ordered_embeddings:
            shapes["masked_embedding.centroids.weight"] = (self.num_centroids, D)
            shapes["masked_embedding.token_ordering"] = (V,)
        return shapes

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "") -> AssistantConfig:
        """From a `gemma4_assistant` / `gemma4_unified_assistant` config.json dict (either text-config dialect)."""
        mt = cfg.get("model_type")
        if mt not in ASSISTANT_TYPES:
            raise ConfigError(f"config.json: model_type {mt!r} is not a drafter; expected one of {ASSISTANT_TYPES}")
        if not isinstance(cfg.get("text_config"), dict):
            raise ConfigError("config.json: a drafter needs its 'text_config' (the decoder's geometry)")
        text = dict(cfg["text_config"])
        unified = mt == "gemma4_unified_assistant"
        text.setdefault("model_type", "gemma4_unified_text" if unified else "gemma4_text")
        L = text.get("num_hidden_layers")
        shared = text.get("num_kv_shared_layers") or 0
        if shared not in (0, L):  # HF turns 0 into L; every drafter layer reads the target's K/V
            raise ConfigError(f"config.json: text_config.num_kv_shared_layers={shared}: a drafter shares all "
                              f"{L} layers (HF requires num_kv_shared_layers == num_hidden_layers, or 0)")
        for key, default in (("hidden_size_per_layer_input", 256), ("vocab_size_per_layer_input", 0)):
            if not unified and (text.get(key, default) or 0) != 0:
                raise ConfigError(f"config.json: text_config.{key} must be 0 for a drafter (HF's validation), "
                                  f"got {text.get(key, default)}")
        for key in ("enable_moe_block", "use_double_wide_mlp"):
            if text.get(key):
                raise ConfigError(f"config.json: text_config.{key} must be false for a drafter (HF's validation)")
        text["num_kv_shared_layers"] = 0   # parse the geometry as a KV-owning model, then make every layer Q-only
        base = ModelConfig.from_hf(text, name=name)
        windows = {s.window for s in base.layers if s.kind == SLIDING}
        W = windows.pop() if windows else None
        layers = tuple(dataclasses.replace(s, kv_source=TARGET_KV, window=None if s.window is None else s.window + 1)
                       for s in base.layers)
        text_cfg = base.replace(layers=layers)

        Dt = cfg.get("backbone_hidden_size", 3840 if unified else 1536)   # HF's class defaults
        if isinstance(Dt, bool) or not isinstance(Dt, int) or Dt <= 0:
            raise ConfigError(f"config.json: backbone_hidden_size must be a positive int, got {Dt!r}")
        ordered = bool(cfg.get("use_ordered_embeddings", False))
        C = int(cfg.get("num_centroids", 2048))
        top_k = int(cfg.get("centroid_intermediate_top_k", 32))
        if ordered:
            V = text_cfg.vocab_size
            if C <= 0 or V % C:
                raise ConfigError(f"config.json: num_centroids={C} must divide vocab_size={V}")
            if not 1 <= top_k <= C:
                raise ConfigError(f"config.json: centroid_intermediate_top_k={top_k} must be in [1, {C}]")
        return cls(text=text_cfg, backbone_hidden_size=Dt, sliding_window=W, use_ordered_embeddings=ordered,
                   num_centroids=C if ordered else 0, centroid_top_k=top_k if ordered else 0,
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), model_type=mt, name=name)


def target_layers(acfg: AssistantConfig, target: ModelConfig) -> dict[str, int]:
    """kind -> index of the target layer whose K/V the drafter's layers of that kind read: the last KV-owning
    layer of that kind (HF's "store" layers). Raises ConfigError naming the field when the pair does not fit."""
    if target.hidden_size != acfg.backbone_hidden_size:
        raise ConfigError(f"drafter {acfg.name or acfg.model_type}: backbone_hidden_size={acfg.backbone_hidden_size} "
                          f"but the target's hidden_size is {target.hidden_size}")
    if target.vocab_size != acfg.text.vocab_size:
        raise ConfigError(f"drafter: vocab_size {acfg.text.vocab_size} differs from the target's {target.vocab_size}")
    out = {}
    for kind in acfg.kinds:
        owners = [li for li in target.kv_layers if target.layers[li].kind == kind]
        if not owners:
            raise ConfigError(f"drafter: its {kind} layers need the target's {kind} K/V, and the target has no "
                              f"{kind}-attention layer")
        t = target.layers[owners[-1]]
        for s in acfg.text.layers:
            if s.kind == kind and (s.head_dim, s.num_kv_heads) != (t.head_dim, t.num_kv_heads):
                raise ConfigError(f"drafter layer {s.index} ({kind}): head_dim {s.head_dim} x {s.num_kv_heads} KV "
                                  f"heads, but target layer {t.index} stores {t.head_dim} x {t.num_kv_heads}")
        out[kind] = t.index
    return out


# ---------------------------------------------------------------------------- weights

@pytree_dataclass
class AssistantWeights:
    text: gemma.Weights       # the drafter's decoder: Q-only layers; text.embed [V, D_a] is the tied LM head
    pre_projection: Any       # [D_a, 2 * D_t]: concat(target embedding of the token, previous hidden) -> D_a
    post_projection: Any      # [D_t, D_a]: final-normed drafter hidden -> the next step's previous hidden
    lm_head: Any = None       # [V, D_a] when tie_word_embeddings is false
    centroids: Any = None     # [C, D_a] (use_ordered_embeddings)
    token_ordering: Any = None  # [V] int32: token ids cluster by cluster, viewed as [C, V / C]


def build_assistant_weights(acfg: AssistantConfig, get: Callable[[str], Any], text: gemma.Weights) -> AssistantWeights:
    """Assemble the tree from a getter of HF-named tensors (outside the decoder) and the decoder's Weights."""
    ordered = acfg.use_ordered_embeddings
    return AssistantWeights(
        text=text, pre_projection=get("pre_projection.weight"), post_projection=get("post_projection.weight"),
        lm_head=None if acfg.tie_word_embeddings else get("lm_head.weight"),
        centroids=get("masked_embedding.centroids.weight") if ordered else None,
        token_ordering=get("masked_embedding.token_ordering") if ordered else None)


def abstract_assistant_weights(acfg: AssistantConfig, dtype=jnp.bfloat16) -> AssistantWeights:
    """The weight tree as ShapeDtypeStructs (no memory), for jax.eval_shape and AOT compiles."""
    shapes = acfg.param_shapes()

    def get(name):
        dt = jnp.int32 if name.endswith("token_ordering") else dtype
        return jax.ShapeDtypeStruct(shapes[name], dt)

    text = gemma.abstract_weights(acfg.text, dtype)
    return build_assistant_weights(acfg, get, text)


def load_assistant(ckpt: str | os.PathLike, dtype="float32") -> tuple[AssistantConfig, AssistantWeights]:
    """Load a drafter checkpoint directory (config.json + safetensors as transformers saves
    Gemma4AssistantForCausalLM: the decoder under `model.`, `pre_projection`, `post_projection`,
    `masked_embedding.*`, and `lm_head.weight` only when untied). Every missing, unexpected or misshapen tensor
    is listed in one CheckpointError. Norms load as float32, token_ordering as int32, the rest in `dtype`."""
    from gemmajax.model.loader import CheckpointError, _dtype, build_from_getter
    from gemmajax.model.safetensors_io import index_checkpoint, load_tensor

    ckpt = os.fspath(ckpt)
    cfg_path = os.path.join(ckpt, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"drafter checkpoint {ckpt!r}: no config.json")
    with open(cfg_path) as f:
        acfg = AssistantConfig.from_hf(json.load(f), name=os.path.basename(ckpt.rstrip("/")))
    infos = index_checkpoint(ckpt)
    expected = acfg.param_shapes()
    ignored = {"lm_head.weight"} if acfg.tie_word_embeddings else set()   # HF ties it to the embedding on load
    missing = [n for n in expected if n not in infos]
    wrong = [(n, expected[n], infos[n].shape) for n in expected if n in infos and infos[n].shape != expected[n]]
    unexpected = [n for n in infos if n not in expected and n not in ignored]
    if missing or wrong or unexpected:
        head = (f"drafter checkpoint {ckpt} does not match its config ({acfg.model_type}, {acfg.text.num_layers} "
                f"layers, hidden {acfg.text.hidden_size}, backbone {acfg.backbone_hidden_size}):")
        lines = [head]
        lines += [f"  missing tensor {n}: expected shape {expected[n]}" for n in missing]
        lines += [f"  wrong shape {n}: expected {e}, found {a}" for n, e, a in wrong]
        lines += [f"  unexpected tensor {n}: {infos[n].shape}" for n in unexpected]
        raise CheckpointError("\n".join(lines))

    def read(name):
        return load_tensor(infos[name])

    text = build_from_getter(acfg.text, read, "model.", dtype)
    dt = _dtype(dtype)

    def get(name):
        a = np.asarray(read(name))
        if name.endswith("token_ordering"):
            V = acfg.text.vocab_size
            if a.min() < 0 or a.max() >= V:
                raise CheckpointError(f"{name}: token ids must be in [0, {V}), found [{a.min()}, {a.max()}]")
            return jnp.asarray(a.astype(np.int32))
        return jnp.asarray(a).astype(dt)

    return acfg, build_assistant_weights(acfg, get, text)


# ---------------------------------------------------------------------------- target K/V (dense form)

@pytree_dataclass
class TargetKV:
    """The target's K/V the drafter reads, contiguous: slot j of a row holds position j.

    For the paged cache the engine passes its own `attend` and page arrays instead (module docstring)."""

    k: dict                   # kind -> [B, S, K, H] K of target_layers()[kind] (normed, RoPE'd, as cached)
    v: dict                   # kind -> [B, S, K, H]
    lengths: Any              # [B] int32: p, the valid positions per row (the drafted-from token's position)

    def by_kind(self) -> dict[str, tuple[Array, Array, Array]]:
        """The per-kind `kv` argument of `draft_step` for `dense_attend`: (K, V, lengths)."""
        return {kind: (self.k[kind], self.v[kind], self.lengths) for kind in self.k}

    @classmethod
    def from_dense_cache(cls, acfg: AssistantConfig, target: ModelConfig, cache: gemma.DenseKVCache,
                         lengths: Array | None = None) -> TargetKV:
        """Pick the layers the drafter reads out of the target's contiguous cache (gemma.DenseKVCache). lengths:
        [B], default the cache's own (every computed position is visible)."""
        slot = {li: n for n, li in enumerate(target.kv_layers)}
        layers = target_layers(acfg, target)
        return cls(k={kind: cache.k[slot[li]] for kind, li in layers.items()},
                   v={kind: cache.v[slot[li]] for kind, li in layers.items()},
                   lengths=cache.lengths if lengths is None else lengths)


def dense_attend(spec: LayerSpec, q: Array, k: None, v: None, kv: tuple[Array, Array, Array]) -> tuple[Array, Any]:
    """gemma.AttendFn over a TargetKV kind: q [B, 1, N, H] attends K/V [B, S, K, H] at positions j < p (sliding:
    also j >= p - 1 - W, spec.window being W + 1), HF's eager numerics. Rows need p >= 1."""
    kc, vc, lengths = kv
    last = (lengths - 1)[:, None]                                        # [B, 1]: the query sits at p - 1
    o = gemma.dense_attention(q, kc.astype(q.dtype), vc.astype(q.dtype), last, lengths, spec, 1.0, None)
    return o, kv


# ---------------------------------------------------------------------------- forward

def masked_logits(aw: AssistantWeights, acfg: AssistantConfig, h: Array) -> Array:
    """Centroid-masked logits. h: [B, D_a] final-normed -> [B, V]: the tokens of the top-k centroids get
    h . lm_head[token], every other token min(those) - 1 (per row). Gathers k * V / C LM-head rows per row
    instead of the whole [V, D_a] matmul (what HF does; cheaper at the small batches drafting runs)."""
    B = h.shape[0]
    V, C, n = acfg.text.vocab_size, acfg.num_centroids, acfg.tokens_per_centroid
    head = aw.text.embed if aw.lm_head is None else aw.lm_head
    c_logits = linear(h, aw.centroids)                                   # [B, C]
    _, top = jax.lax.top_k(c_logits.astype(f32), acfg.centroid_top_k)    # [B, k]
    ids = aw.token_ordering.reshape(C, n)[top].reshape(B, -1)            # [B, J]
    rows = take_rows(head, ids, h.dtype)                                 # [B, J, D_a]
    sel = jnp.einsum("bd,bjd->bj", h, rows, preferred_element_type=f32).astype(h.dtype)
    fill = jnp.min(sel, axis=-1, keepdims=True) - jnp.asarray(1.0, h.dtype)
    out = jnp.broadcast_to(fill, (B, V))
    return out.at[jnp.arange(B)[:, None], ids].set(sel)


def draft_step(aw: AssistantWeights, acfg: AssistantConfig, target_embed: Any, prev_hidden: Array,
               token_ids: Array, positions: Array, kv: dict[str, Any],
               attend: gemma.AttendFn = dense_attend) -> tuple[Array, Array]:
    """One drafter forward.

    Args:
      target_embed: the target's embedding table [V, D_t] (plain or QuantArray; gemma.Weights.embed).
      prev_hidden: [B, D_t] the target's final-normed hidden at p - 1 (first step) or the previous step's
        next_hidden.
      token_ids: [B] the token at position p (first step) or the previous step's draft.
      positions: [B] p, the RoPE position of every step of the round.
      kv: kind -> what `attend` reads for the drafter's layers of that kind (dense: TargetKV.by_kind()).
      attend: gemma.AttendFn called as attend(spec, q [B, 1, N, H], None, None, kv[spec.kind]) -> (o, _).
    Returns:
      logits [B, V] in the activation dtype (no softcap), next_hidden [B, D_t].
    """
    dtype = gemma.compute_dtype(aw.text)
    cfg = acfg.text
    e = take_rows(target_embed, token_ids, dtype)                        # [B, D_t]
    e = e * jnp.asarray(acfg.backbone_hidden_size ** 0.5, f32).astype(dtype)
    x = linear(jnp.concatenate([e, prev_hidden.astype(dtype)], axis=-1), aw.pre_projection)[:, None]  # [B, 1, D_a]
    pos = positions.astype(jnp.int32)[:, None]                            # [B, 1]
    tables = {}
    for spec, lw in zip(cfg.layers, aw.text.layers):
        key = (spec.kind, spec.head_dim, spec.rope_theta, spec.rope_dims, spec.rope_scale)
        if key not in tables:
            tables[key] = gemma.rope_tables(spec, pos, dtype)
        cos, sin = tables[key]
        x, _ = gemma.decoder_layer(cfg, spec, lw, x, cos, sin, None, attend, kv[spec.kind])
    h = gemma.rms_norm(x[:, 0], aw.text.final_norm, cfg.rms_norm_eps)    # [B, D_a]
    next_hidden = linear(h, aw.post_projection)                           # [B, D_t]
    if acfg.use_ordered_embeddings:
        logits = masked_logits(aw, acfg, h)
    else:
        logits = linear(h, aw.text.embed if aw.lm_head is None else aw.lm_head)
    return logits, next_hidden


def draft_greedy(aw: AssistantWeights, acfg: AssistantConfig, target_embed: Any, prev_hidden: Array,
                 token_ids: Array, positions: Array, kv: dict[str, Any], num_steps: int,
                 attend: gemma.AttendFn = dense_attend, return_logits: bool = False):
    """`num_steps` greedy draft steps from a target state (the arguments of `draft_step`'s first step): each step
    feeds its argmax (first index of the maximum) and its next_hidden to the next, at the same position and K/V.

    Returns tokens int32 [B, num_steps] (and, with return_logits, the logits float32 [B, num_steps, V])."""

    def step(carry, _):
        hidden, tok = carry
        logits, hidden = draft_step(aw, acfg, target_embed, hidden, tok, positions, kv, attend)
        logits = logits.astype(f32)
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (hidden, tok), ((tok, logits) if return_logits else tok)

    hidden0 = prev_hidden.astype(gemma.compute_dtype(aw.text))
    _, out = jax.lax.scan(step, (hidden0, token_ids.astype(jnp.int32)), None, length=num_steps)
    if return_logits:
        toks, logits = out
        return jnp.moveaxis(toks, 0, 1), jnp.moveaxis(logits, 0, 1)
    return jnp.moveaxis(out, 0, 1)


@functools.partial(jax.jit, static_argnames=("acfg", "num_steps", "return_logits"))
def draft_greedy_dense(aw: AssistantWeights, acfg: AssistantConfig, target_embed: Any, prev_hidden: Array,
                       token_ids: Array, positions: Array, target_kv: TargetKV, num_steps: int,
                       return_logits: bool = False):
    """`draft_greedy` over a contiguous TargetKV, jitted (tests and offline use; the engine passes its paged
    attend to `draft_greedy` inside its own step)."""
    return draft_greedy(aw, acfg, target_embed, prev_hidden, token_ids, positions, target_kv.by_kind(), num_steps,
                        dense_attend, return_logits)
