"""Speculative decoding: who drafts, and how a verified step's results become accepted tokens.

A decoding sequence with drafts d_1..d_k computes [last token, d_1, ..., d_k] in one step and gets logits at all
k + 1 positions (a ragged, prefill-like verification). Drafts are deterministic (prompt lookup, or the drafter's
argmax), and every verified row is sampled exactly as a plain decode step would sample that position (its own
key, its grammar mask): a draft is kept while it equals the row's token. So greedy and seeded sampled outputs are
the tokens plain decoding gives, and the target's distribution is kept exactly (for a one-hot proposal this is
rejection sampling, coupled to the plain draw through the shared uniform).
The accepted drafts plus one token from the target after them are the step's new tokens; the rejected drafts'
K/V are past the sequence's computed length and are overwritten by later steps.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from gemmajax.kv.attention import ragged_paged_attention
from gemmajax.model import assistant

METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """vLLM's `speculative_config` fields we use.

    Attributes:
      method: "ngram" (prompt lookup) or "draft_model" (a gemma4_assistant checkpoint in `model`).
      num_speculative_tokens: k, the most tokens drafted per step.
      prompt_lookup_max / prompt_lookup_min: n-gram lengths tried, longest first.
      model: the drafter checkpoint (method "draft_model").
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None

    @classmethod
    def parse(cls, cfg: dict[str, Any] | SpecConfig | None) -> SpecConfig | None:
        """From vLLM's dict form ({"method": "ngram", ...} or {"model": DIR, ...}); None stays None."""
        if cfg is None or isinstance(cfg, SpecConfig):
            return cfg
        if not isinstance(cfg, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(cfg).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        kw = dict(cfg)
        kw.setdefault("method", "draft_model" if kw.get("model") else "ngram")
        out = cls(**kw)
        if out.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {out.method!r}")
        if out.method == "draft_model" and not out.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (a gemma4_assistant checkpoint)")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(out, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {v!r}")
        if out.prompt_lookup_min > out.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({out.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({out.prompt_lookup_max})")
        return out


def ngram_propose(token_ids: list[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: for n from n_max down to n_min, find an earlier occurrence of the last n tokens and propose
    the (up to k) tokens that followed it: the latest occurrence followed by k tokens, else the earliest (the
    most tokens after it; in a loop the latest match is the one just before the end). [] when nothing matches."""
    ids = np.asarray(token_ids, np.int64)
    L = len(ids)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = ids[L - n:]
        windows = np.lib.stride_tricks.sliding_window_view(ids[:L - 1], n)   # windows starting before the suffix
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= L]
            start = int(full[-1] if full.size else hits[0]) + n
            return [int(t) for t in ids[start:start + k]]
    return []


def accepted_tokens(drafts: list[int], tokens: np.ndarray) -> tuple[list[int], int]:
    """A verified sequence's new tokens and how many drafts they accept: tokens [k + 1] are the target's tokens
    at the k + 1 verified rows; a draft is kept while it equals the row's token. Returns
    (drafts[:m] + [tokens[m]], m)."""
    m = 0
    while m < len(drafts) and tokens[m] == drafts[m]:
        m += 1
    return list(drafts[:m]) + [int(tokens[m])], m


# ------------------------------------------------------------------------------------------------------------ drafter

class Drafter:
    """A gemma4_assistant checkpoint drafting for the engine (model/assistant.py).

    Per drafting round and row: the target's newest token t at position p (its K/V not written), the target's
    final-normed hidden state at p - 1 (kept by the engine from the step that produced t), and the target's paged
    K/V of the layers the drafter reads (`assistant.target_layers`: the last KV-owning layer of each kind),
    read-only, one query per row with kv_lens = p. A sliding group must keep W + 2 positions (the drafter reads
    one more than the target): the engine widens the block manager's windows by 2."""

    def __init__(self, path: str, target_cfg: Any, dtype: str, groups: tuple[str, ...]) -> None:
        self.acfg, self.aw = assistant.load_assistant(path, dtype=dtype)
        layers = assistant.target_layers(self.acfg, target_cfg)
        self.slots = tuple((kind, target_cfg.kv_slot[li]) for kind, li in sorted(layers.items()))
        self.groups = tuple((kind, groups.index(kind)) for kind, _ in self.slots)

    def draft(self, runner: Any, entries: list[tuple[int, int, list[list[int]], np.ndarray]], k: int,
              s_pad: int) -> np.ndarray:
        """Greedy drafts int32 [len(entries), k]. entries: per row (token t, position p, page tables per group,
        the target's hidden at p - 1 [D_t]); s_pad: the padded row count (a sequence bucket)."""
        from gemmajax.engine.runner import build_step_inputs
        n = len(entries)
        inp = build_step_inputs(runner.spec, [([t], p - 1, 1, pts) for t, p, pts, _ in entries], s_pad, s_pad)
        hid = np.zeros((s_pad, self.acfg.backbone_hidden_size), np.float32)
        tok = np.zeros(s_pad, np.int32)
        pos = np.zeros(s_pad, np.int32)
        for i, (t, p, _, h) in enumerate(entries):
            hid[i], tok[i], pos[i] = h, t, p
        metas = {kind: inp.metas[g] for kind, g in self.groups}
        out = _draft(self.aw, self.acfg, runner.weights.embed, runner.kv, runner.spec, self.slots, metas, hid, tok,
                     pos, num_steps=k)
        return np.asarray(out)[:n]


@functools.partial(jax.jit, static_argnames=("acfg", "spec", "slots", "num_steps"))
def _draft(aw, acfg, target_embed, kv_all, spec, slots, metas, hidden, tokens, positions, num_steps):
    """`assistant.draft_greedy` over the runner's paged caches (read-only attention: nothing is written)."""
    kv = {kind: (kv_all[slot], metas[kind]) for kind, slot in slots}

    def attend(lspec, q, k_new, v_new, pages_meta):
        pages, meta = pages_meta
        out, _ = ragged_paged_attention(q[:, 0], None, None, pages, meta, sm_scale=acfg.text.attn_scale,
                                        sliding_window=lspec.window, soft_cap=acfg.text.attn_logit_softcap,
                                        k_scale=spec.k_scale, v_scale=spec.v_scale, impl=spec.attn_impl,
                                        kv_dtype=spec.kv_dtype)
        return out[:, None], pages_meta

    return assistant.draft_greedy(aw, acfg, target_embed, hidden, tokens, positions, kv, num_steps, attend)
