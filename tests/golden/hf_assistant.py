"""Tiny random Hugging Face Gemma 4 drafters (`Gemma4AssistantForCausalLM`) paired with tiny targets, and HF's
drafting math run directly: the target's final-normed hidden state and `shared_kv_states` of positions [0, p),
then the drafter's forward step by step at position p, as `SinglePositionMultiTokenCandidateGenerator` calls it
(but with the untrimmed K/V of exactly the positions before the drafted token, not what HF's generate hands over).

Weights are randomized beyond HF's init (norms and layer_scalar are ones there, token_ordering zeros), with
token_ordering a random permutation, so neither an identity nor a constant can hide a bug.
"""
from __future__ import annotations

import json
import math

import numpy as np
import torch

from tests.golden.hf_models import build_hf

# Geometry a drafter must share with its target: it reads the target's K/V with its own query heads.
_SHARED_GEOMETRY = ("vocab_size", "head_dim", "global_head_dim", "num_key_value_heads", "num_global_key_value_heads",
                    "attention_k_eq_v", "sliding_window", "rope_parameters", "rms_norm_eps", "pad_token_id",
                    "bos_token_id", "eos_token_id", "max_position_embeddings")


def build_target(variant: str, seed: int = 0, ff_gain: float = 4.0, **overrides):
    """(torch target, text config dict): `build_hf(variant)` with the post-feedforward norms scaled by `ff_gain`,
    so the MLPs, not the token's own tied embedding, decide the next token (at gain 1 the tiny models mostly
    repeat their input token, which would make greedy continuations trivial)."""
    model, cfg = build_hf(variant, seed=seed, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("post_feedforward_layernorm.weight"):
                p.mul_(ff_gain)
    return model, cfg


def assistant_text_config(target_text: dict, **kw) -> dict:
    """A drafter text config for a target: the target's attention geometry, the drafter's own size."""
    text = {k: target_text[k] for k in _SHARED_GEOMETRY if k in target_text}
    full = target_text["layer_types"].index("full_attention")   # a saved config states full layers per layer
    override = (target_text.get("per_layer_config") or {}).get(str(full), {})
    if "head_dim" in override:
        text["global_head_dim"] = override["head_dim"]
    if "num_key_value_heads" in override:
        text["num_global_key_value_heads"] = override["num_key_value_heads"]
    if target_text.get("model_type") != "gemma4_unified_text":
        text.update(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    text.update(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                final_logit_softcapping=30.0)   # set in the config, unused by the drafter (HF applies none)
    text.update(kw)
    return text


def build_assistant(target_text: dict, seed: int = 0, ordered: bool = False, num_centroids: int = 16,
                    top_k: int = 4, dtype=torch.float32, **text_overrides):
    """(torch drafter, config dict as HF saves it) for a target text config. ordered: use_ordered_embeddings
    with `num_centroids` clusters and the top `top_k` of them kept."""
    unified = target_text.get("model_type") == "gemma4_unified_text"
    if unified:
        from transformers.models.gemma4_unified import Gemma4UnifiedTextConfig as TextConfig
        from transformers.models.gemma4_unified_assistant import Gemma4UnifiedAssistantConfig as Config
        from transformers.models.gemma4_unified_assistant import Gemma4UnifiedAssistantForCausalLM as Model
    else:
        from transformers import Gemma4TextConfig as TextConfig
        from transformers.models.gemma4_assistant import Gemma4AssistantConfig as Config
        from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM as Model
    text = assistant_text_config(target_text, **text_overrides)
    text = TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    cfg = Config(text_config=text, backbone_hidden_size=target_text["hidden_size"], use_ordered_embeddings=ordered,
                 num_centroids=num_centroids, centroid_intermediate_top_k=top_k)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    model = Model(cfg)
    randomize_assistant(model, seed)
    model = model.to(dtype).eval()
    return model, json.loads(cfg.to_json_string())


def randomize_assistant(model, seed: int) -> None:
    """Norms and layer_scalar uniform in [0.5, 1.5], matrices N(0, 1/in), embedding N(0, 1), token_ordering a
    random permutation of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name or name.endswith("embed_scale"):
                continue
            if name.endswith("token_ordering"):
                p.copy_(torch.randperm(p.shape[0], generator=g))
            elif name.endswith("layer_scalar") or "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def hf_target_state(target, ids: np.ndarray) -> tuple[torch.Tensor, dict]:
    """Run the target on ids [p] (positions 0..p-1, no cache). Returns (final-normed hidden at p - 1 [1, 1, D],
    shared_kv_states {HF layer type: (K, V) [1, K, p, H]}: the untrimmed K/V of the store layers)."""
    with torch.no_grad():
        out = target(input_ids=torch.as_tensor(np.asarray(ids)[None], dtype=torch.long), use_cache=False,
                     output_hidden_states=True, return_shared_kv_states=True)
    return out.hidden_states[-1][:, -1:], dict(out.shared_kv_states)


def hf_draft(assistant, target, ids: np.ndarray, token: int, steps: int, state: tuple | None = None
             ) -> tuple[list[int], np.ndarray, np.ndarray]:
    """HF's greedy drafting for a target that computed ids [p] and whose next token `token` sits at position p:
    the drafter's forward `steps` times at position p over the K/V of [0, p), each step fed the last argmax and
    the drafter's own projected hidden state. state: `hf_target_state(target, ids)` if already computed.
    Returns (tokens [steps], logits [steps, V], projected hiddens [steps, D_t])."""
    hidden, kv = state if state is not None else hf_target_state(target, ids)
    embed = target.get_input_embeddings()
    tok = torch.tensor([[token]])
    pos = torch.tensor([[len(ids)]])
    toks, logits, hiddens = [], [], []
    with torch.no_grad():
        for _ in range(steps):
            x = torch.cat([embed(tok), hidden], dim=-1)
            out = assistant(inputs_embeds=x, position_ids=pos, shared_kv_states=kv, attention_mask=None)
            tok = out.logits.argmax(dim=-1)
            hidden = out.last_hidden_state
            toks.append(int(tok))
            logits.append(out.logits[0, 0].float().numpy())
            hiddens.append(hidden[0, 0].float().numpy())
    return toks, np.stack(logits), np.stack(hiddens)


# ---------------------------------------------------------------------------- a drafter that agrees with its target

SINKS = (3, 4, 5, 6)      # the only tokens a sink head attends to; a prompt starts with one of them
_SINK_DIM = 20            # a head dim the full layers' partial RoPE leaves unrotated (20 >= 8 rotated pairs)


def build_agreeing_pair(seed: int = 3, ff_gain: float = 48.0, attn_gain: float = 4.0):
    """(target, target config dict, drafter, drafter config dict) where the drafter's greedy drafts equal the
    target's greedy continuation exactly, while its attention over the target's K/V decides them.

    The target has two layers, [sliding, full]. Its sliding layer's attention is switched off (zero
    post-attention norm), so that layer is an MLP. Its full layer is a sink head: every query has +8 in one
    unrotated dim u, the key of a SINKS token +8 there and every other key -8, so a sink's score beats the rest
    by 128 and float32 softmax is exactly one-hot on the prompt's first token (no other sink in the sequence).
    The next token is therefore g(current token, first token), and the first token reaches it only through the
    full layer's V. Embedding dims 0 (constant 1) and 1 (+3 for SINKS, -3 otherwise) feed q and k; no block
    writes them. `ff_gain` makes the MLPs, not the tied embedding, pick the next token, `attn_gain` lets the
    first token's V weigh in (seed 3 at gains 48 / 4: a greedy continuation of 24 distinct tokens after a
    10-token prompt, and another first token changes 19 of them).

    The drafter copies the target's layers, final norm and embedding; pre_projection = [I, 0] gives it the
    target's own layer input embed(t) * sqrt(D) at the drafted token. Its full layer reads the target's full
    layer K/V, so at any position it attends the same first token and computes g exactly."""
    target, tcfg = build_hf("31b", seed=seed, attention_k_eq_v=False, num_hidden_layers=2,
                            layer_types=["sliding_attention", "full_attention"])
    D, N = tcfg["hidden_size"], tcfg["num_attention_heads"]
    H = tcfg["per_layer_config"]["1"]["head_dim"] if "per_layer_config" in tcfg else tcfg["global_head_dim"]
    K = tcfg["num_key_value_heads"]
    u = _SINK_DIM
    m = target.model
    with torch.no_grad():
        E = m.embed_tokens.weight
        E[:, 0] = 1.0
        E[:, 1] = -3.0
        E[list(SINKS), 1] = 3.0
        for layer in m.layers:
            layer.post_feedforward_layernorm.weight.mul_(ff_gain)
            for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                norm.weight[:2] = 0.0
        m.layers[0].post_attention_layernorm.weight.zero_()
        m.layers[1].post_attention_layernorm.weight.mul_(attn_gain)
        a = m.layers[1].self_attn
        a.q_proj.weight.zero_()
        a.k_proj.weight.zero_()
        for n in range(N):
            a.q_proj.weight[n * H + u, 0] = 1.0
        for k in range(K):
            a.k_proj.weight[k * H + u, 1] = 1.0
        a.q_norm.weight[u] = 1.0
        a.k_norm.weight[u] = 1.0

    drafter, dcfg = build_assistant(tcfg, seed=seed + 1, hidden_size=D, intermediate_size=tcfg["intermediate_size"],
                                    num_hidden_layers=2, num_attention_heads=N,
                                    layer_types=["sliding_attention", "full_attention"])
    sd = target.state_dict()
    with torch.no_grad():
        for name, p in list(drafter.named_parameters()) + list(drafter.named_buffers()):
            if name.startswith("model.") and name in sd:   # weights and layer_scalar buffers
                p.copy_(sd[name])
        drafter.pre_projection.weight.copy_(torch.cat([torch.eye(D), torch.zeros(D, D)], dim=1))
        drafter.post_projection.weight.copy_(torch.eye(D))
    return target, tcfg, drafter, dcfg
