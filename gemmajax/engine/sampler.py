"""Batched token sampling on device, one row per sequence, every parameter a per-row array.

Order (vLLM's): allowed-token mask and banned ids, repetition / frequency / presence penalties, greedy argmax
where temperature == 0, else temperature, min-p, top-k, top-p and one draw per row. Top-k / top-p are exact:
thresholds come from `lax.top_k` over `candidate_k` values, and a row whose kept set is larger falls back to
a bisection over the float order (both skipped by `lax.cond` when no row needs them); tokens tied at a
threshold are all kept. The draw is an inverse-CDF lookup with one uniform per row, done in two levels
(512-token blocks) so it never sorts or scans the vocabulary sequentially. Returned logprobs are those of
the raw model distribution (log_softmax of the unmodified logits, vLLM's default), not of the filtered one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence as Seq
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gemmajax.engine.sampling_params import SamplingParams

_BLOCK = 512  # tokens per block of the two-level argmax / inverse-CDF draw
NEG_INF = float("-inf")


class SampleOutput(NamedTuple):
    """Result of `sample` for a batch of B rows.

    Attributes:
      tokens: int32 [B] chosen tokens.
      logprob: f32 [B] log-probability of the chosen token under the raw model distribution.
      top_ids: int32 [B, k] the k = num_logprobs most likely tokens (raw distribution), best first.
      top_logprobs: f32 [B, k] their log-probabilities.
    """

    tokens: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


# -- host-side inputs --------------------------------------------------------------------------------------
def sampling_arrays(params: Seq[SamplingParams]) -> dict[str, np.ndarray]:
    """Per-row parameter arrays for `sample`, from one SamplingParams per row.

    Returns:
      dict with temps, top_ps, min_ps, presence, frequency, repetition (f32 [B]) and top_ks (int32 [B]),
      keyed by `sample`'s argument names.
    """
    return {
        "temps": np.array([p.temperature for p in params], np.float32),
        "top_ks": np.array([max(p.top_k, 0) for p in params], np.int32),
        "top_ps": np.array([p.top_p for p in params], np.float32),
        "min_ps": np.array([p.min_p for p in params], np.float32),
        "presence": np.array([p.presence_penalty for p in params], np.float32),
        "frequency": np.array([p.frequency_penalty for p in params], np.float32),
        "repetition": np.array([p.repetition_penalty for p in params], np.float32),
    }


def request_key_data(seeds: Seq[int], num_output_tokens: Seq[int]) -> tuple[np.ndarray, np.ndarray]:
    """Inputs of `fold_keys` for a batch: row i gets fold_in(PRNGKey(seeds[i]), num_output_tokens[i]), so a
    request draws the same tokens whatever batch it is in and whatever else the engine has served. (The engine
    gives every unseeded request a seed of its own, drawn from the engine's seed.)

    Returns:
      base uint32 [B, 2] (equal to jax.random.PRNGKey(seed) for 0 <= seed < 2**32; wider seeds keep all
      64 bits) and data uint32 [B].
    """
    b = len(seeds)
    base = np.empty((b, 2), np.uint32)
    data = np.empty((b,), np.uint32)
    for i, (seed, n_out) in enumerate(zip(seeds, num_output_tokens)):
        s = int(seed) % 2**64
        base[i] = (s >> 32, s & 0xFFFFFFFF)
        data[i] = n_out & 0xFFFFFFFF
    return base, data


def fold_keys(base: jax.Array, data: jax.Array) -> jax.Array:
    """uint32 [B, 2] keys: row i is jax.random.fold_in(base[i], data[i]). base: uint32 [B, 2]; data: [B]."""
    return jax.vmap(jax.random.fold_in)(base, data.astype(jnp.uint32))


# -- penalties ---------------------------------------------------------------------------------------------
def token_counts(token_ids: jax.Array, vocab_size: int) -> jax.Array:
    """Occurrences of every vocabulary id per row.

    Args:
      token_ids: int [B, L], padded with -1 (ids outside [0, vocab_size) are ignored).
    Returns:
      int32 [B, vocab_size].
    """
    b, _ = token_ids.shape
    ids = jnp.where((token_ids >= 0) & (token_ids < vocab_size), token_ids, vocab_size)  # vocab_size: dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)
    return jnp.zeros((b, vocab_size), jnp.int32).at[rows, ids].add(1, mode="drop")


def penalty_inputs(prompt_ids: jax.Array, output_ids: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """The two penalty arrays of `sample` from padded token histories.

    Args:
      prompt_ids: int [B, Lp], output_ids: int [B, Lo], both padded with -1.
    Returns:
      output_counts int32 [B, V] (occurrences in the output) and seen bool [B, V] (in prompt or output).
    """
    out = token_counts(output_ids, vocab_size)
    seen = (out + token_counts(prompt_ids, vocab_size)) > 0
    return out, seen


def apply_penalties(logits: jax.Array, output_counts: jax.Array, seen: jax.Array, presence: jax.Array,
                    frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """vLLM's penalties. logits f32 [B, V]; output_counts int [B, V]; seen bool [B, V]; the rest f32 [B].

    Repetition (1 = off) divides positive and multiplies negative logits of tokens seen in the prompt or the
    output; then frequency x count and presence x (count > 0) are subtracted for output tokens (OpenAI)."""
    rep = repetition[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)
    counts = output_counts.astype(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).astype(logits.dtype)


def unpack_token_bitmask(words: jax.Array, vocab_size: int) -> jax.Array:
    """bool [B, vocab_size] from an llguidance-style bitmask int32 [B, ceil(V / 32)] (bit j of word i is
    token 32 i + j)."""
    bits = (words.astype(jnp.uint32)[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].astype(bool)


# -- building blocks -------------------------------------------------------------------------------------
def _blocks(x: jax.Array, fill: float) -> jax.Array:
    """[B, V] -> [B, nb, bs] padded with `fill` (bs = 512, or V when V <= 512)."""
    b, v = x.shape
    bs = min(_BLOCK, v)
    pad = (-v) % bs
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill)
    return x.reshape(b, -1, bs)


def _argmax(x: jax.Array, round_to=None) -> jax.Array:
    """First index of the row maximum, int32 [B]. Two levels: XLA's CPU argmax over 262144 columns is ~30x
    slower than a max reduction.

    round_to: a dtype: the same index as `_argmax(x.astype(round_to))` without writing that rounded copy. Rounding
    is monotone, so a block's rounded maximum is the maximum of its rounded values, and only the chosen block is
    rounded element by element (16 x 262,144 float32 logits on XLA:CPU: 1.1 ms for the bf16 copy and its argmax,
    0.66 ms this way)."""
    x3 = _blocks(x, NEG_INF)
    rnd = (lambda v: v) if round_to is None else (lambda v: v.astype(round_to))
    blk = jnp.argmax(rnd(jnp.max(x3, axis=-1)), axis=-1)
    inner = jnp.argmax(rnd(jnp.take_along_axis(x3, blk[:, None, None], axis=1)[:, 0]), axis=-1)
    return (blk * x3.shape[-1] + inner).astype(jnp.int32)


def _draw(y: jax.Array, row_max: jax.Array, u: jax.Array) -> jax.Array:
    """One token per row with probability softmax(y) by inverse CDF: the first token whose cumulative mass
    reaches u x total, found block-wise. y: f32 [B, V] (-inf = excluded); row_max: [B]; u: (0, 1] [B]."""
    p3 = _blocks(jnp.exp(y - row_max[:, None]), 0.0)  # [B, nb, bs]
    bs = p3.shape[-1]
    block_mass = p3.sum(-1)  # [B, nb]
    cum = jnp.cumsum(block_mass, axis=-1)
    target = u * cum[:, -1]
    blk = jnp.minimum(jnp.sum(cum < target[:, None], axis=-1), cum.shape[-1] - 1)
    before = jnp.where(blk > 0, jnp.take_along_axis(cum, jnp.maximum(blk - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    pb = jnp.take_along_axis(p3, blk[:, None, None], axis=1)[:, 0]  # [B, bs]
    cb = jnp.cumsum(pb, axis=-1)
    # Clipping keeps float rounding from landing on a zero-mass token at either end of the block.
    rest = jnp.clip(target - before, jnp.finfo(jnp.float32).tiny, cb[:, -1])
    inner = jnp.minimum(jnp.sum(cb < rest[:, None], axis=-1), bs - 1)
    return (blk * bs + inner).astype(jnp.int32)


def _ordered_u32(x: jax.Array) -> jax.Array:
    """Map f32 to uint32 with the same order (x < y iff key(x) < key(y), NaN aside)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_ordered_u32(k: jax.Array) -> jax.Array:
    bits = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _largest_threshold(keys: jax.Array, predicate) -> jax.Array:
    """Per row, the largest uint32 t with predicate(keys >= t) true (predicate monotone: true at t = 0).
    32 halvings of the uint32 range. keys: uint32 [B, V]; predicate(mask [B, V] bool, t [B]) -> bool [B]."""
    b = keys.shape[0]

    def body(_, lo_hi):
        lo, hi = lo_hi
        gap = hi - lo
        mid = lo + (gap >> 1) + (gap & 1)  # upper middle, no overflow
        ok = predicate(keys >= mid[:, None], mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo = jnp.zeros((b,), jnp.uint32)
    hi = jnp.full((b,), 0xFFFFFFFF, jnp.uint32)
    lo, _ = lax.fori_loop(0, 32, body, (lo, hi))
    return lo


def _exact_thresholds(y: jax.Array, row_max: jax.Array, k: jax.Array, k_on: jax.Array, top_ps: jax.Array,
                      p_on: jax.Array) -> jax.Array:
    """Top-k then top-p thresholds over the whole vocabulary by bisection, f32 [B] (-inf = keep all)."""
    keys = _ordered_u32(y)
    e = jnp.exp(y - row_max[:, None])
    t_k = _largest_threshold(keys, lambda m, t: jnp.sum(m, axis=-1) >= k)
    t_k = jnp.where(k_on, t_k, 0)
    z = jnp.sum(jnp.where(keys >= t_k[:, None], e, 0.0), axis=-1)
    t_p = _largest_threshold(keys, lambda m, t: (jnp.sum(jnp.where(m, e, 0.0), axis=-1) >= top_ps * z) | (t <= t_k))
    tau = jnp.where(p_on, jnp.maximum(t_p, t_k), t_k)
    return jnp.where(k_on | p_on, _from_ordered_u32(tau), NEG_INF)


def _thresholds(y: jax.Array, row_max: jax.Array, top_ks: jax.Array, top_ps: jax.Array,
                candidate_k: int) -> jax.Array:
    """Per row, the smallest scaled logit kept by top-k then top-p (vLLM's rule: keep the most likely tokens
    until their mass reaches top_p, renormalised after top-k), f32 [B]; -inf where neither is on.

    y: f32 [B, V] temperature-scaled, masked logits; row_max: [B] their max. Ties at the threshold are all
    kept."""
    b, v = y.shape
    kc = min(candidate_k, v)
    vals, _ = lax.top_k(y, kc)  # [B, kc] best first
    k_on = (top_ks > 0) & (top_ks < v)
    p_on = top_ps < 1.0
    k = jnp.where(k_on, top_ks, v)
    k_fits = k <= kc

    tau_k = jnp.where(k_on, jnp.take_along_axis(vals, jnp.clip(k - 1, 0, kc - 1)[:, None], axis=-1)[:, 0], NEG_INF)
    e = jnp.exp(vals - row_max[:, None])
    kept_k = vals >= tau_k[:, None]
    z_full = jnp.sum(jnp.exp(y - row_max[:, None]), axis=-1)
    z = jnp.where(k_on, jnp.sum(jnp.where(kept_k, e, 0.0), axis=-1), z_full)
    probs = jnp.where(kept_k, e, 0.0) / z[:, None]
    cum = jnp.cumsum(probs, axis=-1)
    n_keep = jnp.sum(((cum - probs) < top_ps[:, None]) & kept_k, axis=-1)
    tau_p = jnp.take_along_axis(vals, jnp.maximum(n_keep - 1, 0)[:, None], axis=-1)[:, 0]
    tau = jnp.where(p_on, jnp.maximum(tau_p, tau_k), tau_k)

    # Rows whose kept set may reach past the candidates: a top-k above kc, or a top-p whose mass is not
    # reached within them (top-k off or above kc).
    need_exact = (k_on & ~k_fits) | (p_on & ~(k_on & k_fits) & (cum[:, -1] < top_ps) & (kc < v))
    exact = lax.cond(jnp.any(need_exact), lambda: _exact_thresholds(y, row_max, k, k_on, top_ps, p_on),
                     lambda: tau)
    return jnp.where(need_exact, exact, tau)


# -- the sampler -----------------------------------------------------------------------------------------
def _filtered(x: jax.Array, greedy: jax.Array, temps: jax.Array, top_ks: jax.Array, top_ps: jax.Array,
              min_ps: jax.Array, candidate_k: int) -> tuple[jax.Array, jax.Array]:
    """The distribution a sampled row draws from, as scaled logits: temperature, then min-p, top-k and top-p
    (excluded tokens -inf). x: f32 [B, V] masked, penalised logits. Returns (y [B, V], row max [B])."""
    b, v = x.shape
    y = x / jnp.where(greedy, 1.0, temps)[:, None]
    row_max = jnp.max(y, axis=-1)
    floor = row_max + jnp.log(jnp.maximum(min_ps, jnp.finfo(jnp.float32).tiny))  # p >= min_p * p_max
    y = jnp.where((min_ps > 0)[:, None] & (y < floor[:, None]), NEG_INF, y)
    filtered = ((top_ks > 0) & (top_ks < v)) | (top_ps < 1.0)
    tau = lax.cond(jnp.any(filtered & ~greedy), lambda: _thresholds(y, row_max, top_ks, top_ps, candidate_k),
                   lambda: jnp.full((b,), NEG_INF, jnp.float32))
    return jnp.where(y >= tau[:, None], y, NEG_INF), row_max


def _uniform(keys: jax.Array) -> jax.Array:
    """One uniform in (0, 1] per row. keys: uint32 [B, 2]."""
    return 1.0 - jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)


@functools.partial(jax.jit, static_argnames=("num_logprobs", "candidate_k"))
def sample(logits: jax.Array, temps: jax.Array, top_ks: jax.Array, top_ps: jax.Array, min_ps: jax.Array,
           presence: jax.Array, frequency: jax.Array, repetition: jax.Array, output_counts: jax.Array | None,
           seen: jax.Array | None, keys: jax.Array, allowed_mask: jax.Array | None = None,
           banned_ids: jax.Array | None = None, *, num_logprobs: int = 0, candidate_k: int = 1024) -> SampleOutput:
    """Sample one token per row.

    Args:
      logits: [B, V] model output (any float dtype; computed in f32).
      temps: f32 [B]; 0 = greedy (argmax after masks and penalties).
      top_ks: int [B]; <= 0 or >= V = off.   top_ps: f32 [B] in (0, 1]; 1 = off.   min_ps: f32 [B]; 0 = off.
      presence, frequency: f32 [B] (0 = off); repetition: f32 [B] (1 = off).
      output_counts: int32 [B, V] and seen: bool [B, V] from `penalty_inputs`, or both None to skip penalties.
      keys: uint32 [B, 2] per-row PRNG keys (`fold_keys`).
      allowed_mask: optional bool [B, V]; False tokens are never chosen (constrained decoding). Every row
        must allow at least one token.
      banned_ids: optional int [B, K] ids never chosen, padded with -1 (stop ids below min_tokens).
      num_logprobs: static; how many top raw logprobs per row to return (0 = none).
      candidate_k: static; top-k / top-p thresholds come from this many best tokens, exact beyond it by a
        slower fallback. A speed knob only: results do not depend on it.
    Returns:
      SampleOutput; logprobs are log_softmax of the raw `logits` (before masks, penalties, temperature).
    """
    logits = logits.astype(jnp.float32)
    b, v = logits.shape
    lse = jax.nn.logsumexp(logits, axis=-1)

    x = logits
    if allowed_mask is not None:
        x = jnp.where(allowed_mask, x, NEG_INF)
    if banned_ids is not None:
        ids = jnp.where(banned_ids >= 0, banned_ids, v)
        x = x.at[jnp.arange(b)[:, None], ids].set(NEG_INF, mode="drop")
    if output_counts is not None:
        x = apply_penalties(x, output_counts, seen, presence, frequency, repetition)

    greedy = temps <= 0.0
    greedy_tokens = _argmax(x)

    def draw() -> jax.Array:
        y, row_max = _filtered(x, greedy, temps, top_ks, top_ps, min_ps, candidate_k)
        return _draw(y, row_max, _uniform(keys))

    drawn = lax.cond(jnp.all(greedy), lambda: greedy_tokens, draw)
    tokens = jnp.where(greedy, greedy_tokens, drawn)
    logprob = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
    if num_logprobs > 0:
        top_vals, top_ids = lax.top_k(logits, num_logprobs)
        top_logprobs = top_vals - lse[:, None]
    else:
        top_ids = jnp.zeros((b, 0), jnp.int32)
        top_logprobs = jnp.zeros((b, 0), jnp.float32)
    return SampleOutput(tokens, logprob, top_ids.astype(jnp.int32), top_logprobs)
