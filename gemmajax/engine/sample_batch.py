"""Host side of sampling: per-row arrays for `sampler.sample`, built from the step's sequences, and one jitted
call per step. Every logits row is sampled (rows that need no token get greedy defaults), so the only shapes are
the step's sequence bucket; penalty histories, grammar masks and banned ids add a variant only when used.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import numpy as np

from gemmajax.engine import sampler
from gemmajax.engine.sequence import Sequence


def _pow2(n: int, lo: int = 16) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


@dataclass
class SamplerBatch:
    arrays: dict                    # sampler.sampling_arrays names -> [S] arrays
    key_base: np.ndarray            # uint32 [S, 2]
    key_data: np.ndarray            # uint32 [S]
    prompt_ids: np.ndarray | None   # int32 [S, Lp] (-1 padded), only when a row uses penalties
    output_ids: np.ndarray | None   # int32 [S, Lo]
    allowed: np.ndarray | None      # bool [S, V], only when a row is grammar-constrained
    banned: np.ndarray | None       # int32 [S, K] (-1 padded): stop ids below min_tokens
    num_logprobs: int               # top entries computed per row: the most any row asked for
    rows: list[int]                 # logits rows that need a token, in order
    want_logprobs: list[int | None]  # per entry of `rows`: its own SamplingParams.logprobs (None = none)

    @classmethod
    def build(cls, seqs: list[Sequence], rows: list[int], num_rows: int, vocab_size: int, constraints: list,
              eos_token_ids: tuple[int, ...] = (), forced: list[int | None] | None = None) -> "SamplerBatch":
        """forced: per sequence, a token the row must pick (the end of a thought at its budget) or None."""
        from gemmajax.engine.sampling_params import SamplingParams
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        params = [greedy] * num_rows
        seeds: list[int] = [0] * num_rows   # padding rows are greedy: their key is never used
        nout = [0] * num_rows
        for s, r in zip(seqs, rows):
            params[r] = s.params
            seeds[r] = s.sample_seed
            nout[r] = s.num_output_tokens
        arrays = sampler.sampling_arrays(params)
        base, data = sampler.request_key_data(seeds, nout)
        prompt_ids = output_ids = None
        if any(s.params.uses_penalties for s in seqs):
            lp = _pow2(max(s.num_prompt_tokens for s in seqs))
            lo = _pow2(max(max(s.num_output_tokens for s in seqs), 1))
            prompt_ids = np.full((num_rows, lp), -1, np.int32)
            output_ids = np.full((num_rows, lo), -1, np.int32)
            for s, r in zip(seqs, rows):
                if s.params.uses_penalties:
                    prompt_ids[r, :s.num_prompt_tokens] = s.prompt_token_ids
                    output_ids[r, :s.num_output_tokens] = s.output_token_ids
        allowed = None
        forced = forced or [None] * len(seqs)
        if any(c is not None for c in constraints) or any(f is not None for f in forced):
            allowed = np.ones((num_rows, vocab_size), bool)
            for c, f, r in zip(constraints, forced, rows):
                if f is not None:
                    allowed[r, :] = False
                    allowed[r, f] = True
                elif c is not None:  # once the grammar is done its mask allows only end tokens
                    m = np.asarray(c.allowed_mask(vocab_size), bool)
                    allowed[r, :] = False
                    allowed[r, :m.shape[0]] = m[:vocab_size]
        banned = None
        bans = [(r, s.banned_token_ids(eos_token_ids)) for s, r in zip(seqs, rows)]
        if any(b for _, b in bans):
            k = _pow2(max(len(b) for _, b in bans), 4)
            banned = np.full((num_rows, k), -1, np.int32)
            for r, b in bans:
                banned[r, :len(b)] = b
        nlp = max([s.params.logprobs or 0 for s in seqs] + [0])
        want = [s.params.logprobs for s in seqs]
        return cls(arrays, base, data, prompt_ids, output_ids, allowed, banned, nlp, list(rows), want)


def plain_greedy(seqs: list[Sequence], constraints: list, eos_token_ids: tuple[int, ...] = (),
                 forced: list[int | None] | None = None) -> bool:
    """True when every row's token is the plain argmax of its logits: temperature 0, no logprobs, no penalties, no
    grammar, no banned or forced ids. Such a batch can skip the sampler (`ModelRunner.forward_greedy` picks the
    same tokens inside the model step)."""
    forced = forced or [None] * len(seqs)
    return all(s.params.temperature <= 0.0 and s.params.logprobs is None and not s.params.uses_penalties
               and c is None and f is None and not s.banned_token_ids(eos_token_ids)
               for s, c, f in zip(seqs, constraints, forced))


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def _sample(logits, arrays, key_base, key_data, prompt_ids, output_ids, allowed, banned, num_logprobs):
    V = logits.shape[-1]
    counts = seen = None
    if prompt_ids is not None:
        counts, seen = sampler.penalty_inputs(prompt_ids, output_ids, V)
    keys = sampler.fold_keys(key_base, key_data)
    return sampler.sample(logits, arrays["temps"], arrays["top_ks"], arrays["top_ps"], arrays["min_ps"],
                          arrays["presence"], arrays["frequency"], arrays["repetition"], counts, seen, keys,
                          allowed_mask=allowed, banned_ids=banned, num_logprobs=num_logprobs)


def sample_step(logits: jax.Array, b: SamplerBatch) -> tuple[np.ndarray, list[dict] | None]:
    """Sample the batch's rows. Returns (tokens [len(rows)], per-row logprob dicts or None)."""
    out = _sample(logits, b.arrays, b.key_base, b.key_data, b.prompt_ids, b.output_ids, b.allowed, b.banned,
                  num_logprobs=b.num_logprobs)
    rows = np.asarray(b.rows)
    tokens = np.asarray(out.tokens)[rows]
    if all(k is None for k in b.want_logprobs):
        return tokens, None
    lp = np.asarray(out.logprob)[rows]
    top_ids = np.asarray(out.top_ids)[rows]
    top_lp = np.asarray(out.top_logprobs)[rows]
    res = []
    for i, k in enumerate(b.want_logprobs):  # each row gets exactly the k top entries it asked for
        res.append(None if k is None else {"token_id": int(tokens[i]), "logprob": float(lp[i]),
                                           "top": [(int(t), float(v)) for t, v in zip(top_ids[i, :k], top_lp[i, :k])]})
    return tokens, res
