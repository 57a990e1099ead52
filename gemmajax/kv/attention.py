"""Ragged paged attention over the paged cache of gemmajax.kv.layout: a jnp reference, a Pallas TPU kernel, a wrapper.

The reference is the CPU/GPU serving path: it splits the step into decode rows (sequences with one new token,
batched, one gather per KV block) and prefill chunks (a loop over q chunks of one sequence each), so no token pays
for another sequence's KV length; both loop over KV blocks with dynamic trip counts and an online softmax.
The kernel keeps the pages in HBM, DMAs whole pages into double-buffered VMEM by a scalar-prefetched page table,
folds GQA into rows, and writes the step's new K/V into the (aliased) pages before any attention block reads them.
impl="auto" is decided at lowering time (`lax.platform_dependent`: the kernel for TPU, the reference elsewhere), so
a deviceless TPU compile from a CPU host gets the TPU program; a case the kernel cannot take is the reference on
every platform, and says so once in the log.

Einsum letters: T tokens, S sequences, N query heads, K KV heads, G = N // K query heads per KV head, H head dim,
L KV positions of a block, Q query rows of a chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gemmajax.kv.layout import (
    gather_pages,
    interleave_kv,
    page_dtype,
    quantize_kv,
    sublane_tile,
    write_kv,
)
from gemmajax.quant.int8_matmul import after_init

logger = logging.getLogger(__name__)

# A large finite negative instead of -inf: exp(MASK - MASK) = 1 stays finite for rows with nothing to attend to.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Prefill chunks the reference batches per loop iteration (`_ref_prefill_chunks`). Gemma 3 270M, 2 cores, time to
# first token of 16 prompts of 24 tokens, one process per value, load about 0.7 (not a quiet measurement): 1: 408 ms,
# 4: 373, 8: 375, 16: 439, 32: 357; attention replaced by the identity 353. 8 is a guess among the close ones.
PREFILL_ITEMS = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedMeta:
    """Per-step metadata of a ragged batch (one per step, shared by all layers)."""

    cu_q_lens: jax.Array  # int32 [S_max + 1]; prefix sums of query tokens per sequence; padded seqs repeat the last
    kv_lens: jax.Array  # int32 [S_max]; total KV length of each sequence AFTER this step (cached + new)
    page_indices: jax.Array  # int32 [S_max, P_max]; page ids by logical page (pos // page_size); unread: anything
    num_seqs: jax.Array  # int32 [1]; number of real sequences (<= S_max)
    # Static: token i is the one query of sequence i (T_pad == S_max, q_len 1 for every real sequence). The
    # reference then skips finding each token's sequence and the prefill machinery; the kernel ignores it.
    decode_only: bool = dataclasses.field(default=False, metadata={"static": True})
    # Bidirectional image blocks (Gemma 4 26B / 31B / 12B): optional int32 [T_pad] first / last key position of the
    # query token's block (lo > hi: not in a block). A query also sees every key in [lo, hi] (its block is computed
    # in this step); block_in_window: the sliding window still cuts those keys (Gemma 4's rule) or not (the 12B's).
    # Reference only (the kernel is causal).
    block_lo: jax.Array | None = None
    block_hi: jax.Array | None = None
    block_in_window: bool = dataclasses.field(default=True, metadata={"static": True})
    # Reference only: optional bool [S_max], sequences (a speculative verification's, 1 + k tokens) whose every
    # token is computed as a decode row, the math of a one-token step, so each gets the bits plain decoding gives it
    # and seeded sampling stays equal; at most row_q_max (static) tokens each (more, or any in an image block: the
    # chunk path). None: only sequences with q_len == 1 are decode rows.
    by_row: jax.Array | None = None
    row_q_max: int = dataclasses.field(default=1, metadata={"static": True})


def make_ragged_meta(
    q_lens: list[int] | np.ndarray,
    kv_lens: list[int] | np.ndarray,
    page_tables: list[list[int]] | list[np.ndarray],
    *,
    max_num_seqs: int,
    pages_per_seq: int,
    fill_page: int = 0,
) -> RaggedMeta:
    """Host helper: builds padded RaggedMeta arrays from per-sequence lists.

    Args:
      q_lens, kv_lens: [S] new tokens and total KV length (after the step) of each real sequence.
      page_tables: S lists of page ids, each covering at least ceil(kv_len / page_size) logical pages.
      max_num_seqs: S_max (static); pages_per_seq: P_max (static); fill_page: id written into unused entries.
    """
    s = len(q_lens)
    if not (len(kv_lens) == len(page_tables) == s) or s > max_num_seqs:
        raise ValueError(
            f"need len(q_lens) == len(kv_lens) == len(page_tables) <= max_num_seqs={max_num_seqs}; "
            f"got {len(q_lens)}, {len(kv_lens)}, {len(page_tables)}"
        )
    cu = np.zeros(max_num_seqs + 1, np.int32)
    cu[1 : s + 1] = np.cumsum(np.asarray(q_lens, np.int64))
    cu[s + 1 :] = cu[s]
    kv = np.zeros(max_num_seqs, np.int32)
    kv[:s] = kv_lens
    pages = np.full((max_num_seqs, pages_per_seq), fill_page, np.int32)
    for i, table in enumerate(page_tables):
        if len(table) > pages_per_seq:
            raise ValueError(f"sequence {i} has {len(table)} pages; pages_per_seq is {pages_per_seq}")
        pages[i, : len(table)] = table
    for i in range(s):
        if q_lens[i] > kv_lens[i]:
            raise ValueError(f"sequence {i}: q_len {q_lens[i]} > kv_len {kv_lens[i]}")
    return RaggedMeta(
        cu_q_lens=jnp.asarray(cu),
        kv_lens=jnp.asarray(kv),
        page_indices=jnp.asarray(pages),
        num_seqs=jnp.asarray([s], jnp.int32),
    )


# ----------------------------------------------------------------------------------------------------------------
# Shared helpers (plain jnp; used by the reference and by the kernel's wrapper)
# ----------------------------------------------------------------------------------------------------------------


def _token_seq_and_pos(meta: RaggedMeta, t_pad: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For every flat token: its sequence, its absolute position, and whether it is real.

    Returns: seq int32 [T], pos int32 [T], valid bool [T].
    """
    cu = meta.cu_q_lens
    s_max = meta.kv_lens.shape[0]
    if meta.decode_only:  # token i is sequence i's one query: nothing to search
        if t_pad != s_max:
            raise ValueError(f"a decode_only RaggedMeta needs one query per sequence slot: q has {t_pad} rows, "
                             f"S_max is {s_max}")
        seq = jnp.arange(t_pad, dtype=jnp.int32)
        return seq, meta.kv_lens - 1, seq < meta.num_seqs[0]
    t = jnp.arange(t_pad, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right", method="compare_all").astype(jnp.int32), s_max - 1)
    valid = t < cu[meta.num_seqs[0]]
    q_len = cu[seq + 1] - cu[seq]
    pos = meta.kv_lens[seq] - q_len + (t - cu[seq])
    return seq, pos, valid


def _slots(meta: RaggedMeta, seq: jax.Array, pos: jax.Array, valid: jax.Array, page_size: int) -> jax.Array:
    p_max = meta.page_indices.shape[1]
    page = meta.page_indices[seq, jnp.clip(pos // page_size, 0, p_max - 1)]
    return jnp.where(valid, page * page_size + pos % page_size, -1)


def _scores(s: jax.Array, scale, soft_cap: float | None) -> jax.Array:
    """Scaled (sm_scale * k_scale: the keys are not dequantized) and optionally soft-capped f32 scores."""
    s = s * scale
    if soft_cap is not None:
        s = jnp.tanh(s / soft_cap) * soft_cap
    return s


def _online_softmax_step(m, l, acc, s, mask, v, pv_spec: str):
    """One flash-attention update. m, l: [..., R]; acc: [..., R, H]; s, mask: [..., R, L]; v: [..., L, H].

    Masking is by `where` everywhere (never a multiply by 0): masked scores may be NaN (unread or freed pages).
    """
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l = alpha * l + p.sum(axis=-1)
    acc = alpha[..., None] * acc + jnp.einsum(pv_spec, p, v.astype(jnp.float32))
    return m_new, l, acc


def _gather_kv_block(kv_pages: jax.Array, page_ids: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Gathers the K rows and the V rows of pages, each straight into [..., K, ppb * page_size, H].

    The pool is viewed as [num_pages * 2K, page_size * H], one contiguous row per (page, K or V head), and K / V
    rows are gathered separately: the result is already K-major (nothing is transposed), and XLA:CPU gathers whole
    rows at memcpy speed (a [..., ppb, 2K, ps, H] gather plus a moveaxis measured ~10x slower).

    Args:
      kv_pages: [num_pages, 2K, page_size, H] (float or bit-stored as `dtype`); page_ids: int32 [..., ppb]
        (clipped into range; the caller masks what it must not use).
    Returns:
      k, v: [..., K, ppb * page_size, H] in the compute dtype of `_ref_dot_dtype` (not scaled).
    """
    num_pages, two_k, ps, h = kv_pages.shape
    nk = two_k // 2
    flat = kv_pages.reshape(num_pages * two_k, ps * h)
    ids = jnp.clip(page_ids, 0, num_pages - 1)[..., None, :] * two_k + 2 * jnp.arange(nk)[:, None]  # [..., K, ppb]
    lead = ids.shape[:-1]
    k = gather_pages(flat, ids, dtype).reshape(*lead, ids.shape[-1] * ps, h)
    v = gather_pages(flat, ids + 1, dtype).reshape(*lead, ids.shape[-1] * ps, h)
    cd = _ref_dot_dtype(dtype)
    return k.astype(cd), v.astype(cd)


def _ref_dot_dtype(page_dt) -> jnp.dtype:
    """K/V enter the reference's matmuls as bf16 when that is exact (bf16 and fp8 pages), else as f32."""
    return jnp.dtype(jnp.float32) if jnp.dtype(page_dt).itemsize == 4 else jnp.dtype(jnp.bfloat16)


def _qk(spec: str, q: jax.Array, k: jax.Array) -> jax.Array:
    """q . k with float32 results. bf16 q with bf16 K runs as a bf16 dot with f32 accumulation, which is exact
    (a bf16 x bf16 product fits in f32) and much faster on XLA:CPU than upcasting K; anything else in f32."""
    if q.dtype == jnp.bfloat16 and k.dtype == jnp.bfloat16:
        return jnp.einsum(spec, q.astype(jnp.bfloat16), k, preferred_element_type=jnp.float32)
    return jnp.einsum(spec, q.astype(jnp.float32), k.astype(jnp.float32))


# ----------------------------------------------------------------------------------------------------------------
# Reference (pure jnp): the CPU / GPU path
# ----------------------------------------------------------------------------------------------------------------


def _decode_block_kv(rows: int, pages_shape: tuple[int, ...], budget: int = 512 << 10) -> int:
    """KV tokens per block of `_ref_decode_rows`: the largest multiple of the page size, at most 128, whose gathered
    K and V blocks for all `rows` sequences ([rows, K, block, H] each, 2-byte compute dtype) fit in `budget`.

    Every row pays for the batch's longest KV range in whole blocks, and a block's gathers and products must stay in
    cache. Measured on XLA:CPU (2 cores, Gemma 3 270M heads, best of 2, ms per layer) 32 / 128-token blocks:
    16 rows of 24-88 tokens 0.19 / 0.24, 64 rows of 24-300 1.84 / 2.63, 64 of 400-500 3.31 / 4.70; one row of 1k
    tokens 0.12 / 0.10 (which this rule gives 128)."""
    _, two_k, ps, h = pages_shape
    fit = budget // max(1, rows * two_k * h * 2)
    return max(ps, min(128, fit // ps * ps))


def _prefill_block_kv(t_pad: int, s_max: int) -> int:
    """KV tokens per block of `_ref_prefill_chunks` for a step of t_pad tokens and s_max sequences (static shapes):
    32 when the step averages at most 32 tokens a sequence slot (decode slots included: a mixed step of many decodes
    and one long prompt also gets 32, slower for that prompt by the figures below), else 64.

    A chunk computes its whole tile, so short prompts waste most of a large one, and long ones pay a loop iteration
    per block. Measured on Gemma 3 270M w8a8+emb8 (2 cores; the prefill step alone, engines of each setting
    alternating in one process, min of 8-10 calls, ms, 16 x 64 / 16 x 32 query x KV tokens): 16 prompts of 24 tokens
    291.2 / 279.1 (and 8 x 32 with 16 chunks an iteration 275.0), 8 of 48 267.0 / 280.1, 4 of 96 284.9 / 283.2,
    2 of 250 396.5 / 407.4, 1 of 500 441.9 / 463.1. Earlier, against 64 x 256: 16 prompts of 24 tokens 502 -> 380 ms
    time to first token, 4 of 200 882 -> 784, 1 of 500 436 -> 451."""
    return 32 if t_pad <= 32 * s_max else 64


def _ref_decode_rows(q, kv_pages, meta, seq, pos, valid, *, row_tokens=None, **kw):
    """Attention for the tokens of sequences with q_len == 1 (and, with `row_tokens`, the tokens marked there), each
    token a row of its own that attends over its sequence's KV up to its own position.

    Rows go in groups of S_max (one group; with row_tokens, min(T, S_max * meta.row_q_max) rows in groups, one after
    the other), so every row is computed by the same program shape as a one-token step's: XLA:CPU's bits for a row
    change with the number of rows batched with it (measured: 3 against 8 rows, float32 and fp8 pages, last bits).

    Cost per group: O(S_max * span * (2K + 2N) * H) where span is the KV range from the earliest window start to the
    furthest row position in the group (one gather of [S_max, block_kv] KV tokens per KV block). kw: the keyword
    arguments of `_decode_row_group` (sm_scale ... block_kv, kv_dtype).
    Returns: (rows int32 [R] token index or T for unused, out f32 [R, N, H]).
    """
    t_pad = q.shape[0]
    s_max = meta.page_indices.shape[0]
    group = functools.partial(_decode_row_group, q, kv_pages, meta, seq, pos, **kw)
    if meta.decode_only:  # token i is sequence i's query
        rows = jnp.where(valid, jnp.arange(s_max, dtype=jnp.int32), t_pad)
    elif row_tokens is None:
        q_len = meta.cu_q_lens[seq + 1] - meta.cu_q_lens[seq]
        rows = jnp.nonzero(valid & (q_len == 1), size=s_max, fill_value=t_pad)[0].astype(jnp.int32)  # [S]
    else:
        n_groups = -(-min(t_pad, s_max * meta.row_q_max) // s_max)
        rows = jnp.nonzero(row_tokens, size=n_groups * s_max, fill_value=t_pad)[0].astype(jnp.int32)
        out = lax.map(group, rows.reshape(n_groups, s_max))
        return rows, out.reshape(n_groups * s_max, *q.shape[1:])
    return rows, group(rows)


def _decode_row_group(
    q, kv_pages, meta, seq, pos, rows, *, sm_scale, sliding_window, soft_cap, k_scale, v_scale, block_kv, kv_dtype
):
    """`_ref_decode_rows` for one group of S_max rows (token indices; T for an unused row): f32 [S_max, N, H]."""
    t_pad, n, h = q.shape
    _, two_k, ps, _ = kv_pages.shape
    nk = two_k // 2
    g = n // nk
    s_max, p_max = meta.page_indices.shape
    ppb = max(1, block_kv // ps)
    bkv = ppb * ps
    row_ok = rows < t_pad
    r = jnp.minimum(rows, t_pad - 1)
    r_seq, r_pos = seq[r], pos[r]  # [S]
    win_lo = jnp.maximum(r_pos - sliding_window + 1, 0) if sliding_window is not None else jnp.zeros_like(r_pos)
    j_lo = jnp.min(jnp.where(row_ok, win_lo // bkv, jnp.iinfo(jnp.int32).max))
    j_hi = jnp.max(jnp.where(row_ok, r_pos // bkv + 1, 0))
    j_lo = jnp.minimum(j_lo, j_hi)

    qr = q[r].reshape(s_max, nk, g, h)  # [S, K, G, H]
    tables = meta.page_indices[r_seq]  # [S, P_max]

    def body(j, carry):
        m, l, acc = carry
        lp = jnp.clip(j * ppb + jnp.arange(ppb), 0, p_max - 1)
        k, v = _gather_kv_block(kv_pages, tables[:, lp], kv_dtype)  # [S, K, L, H]
        kv_pos = j * bkv + jnp.arange(bkv)  # [L]
        ok = row_ok[:, None] & (kv_pos[None, :] <= r_pos[:, None])  # [S, L]
        if sliding_window is not None:
            ok &= r_pos[:, None] - kv_pos[None, :] < sliding_window
        v = jnp.where(ok[:, None, :, None], v, jnp.zeros((), v.dtype))
        s = _scores(_qk("skgh,sklh->skgl", qr, k), sm_scale * k_scale, soft_cap)
        return _online_softmax_step(m, l, acc, s, ok[:, None, None, :], v, "skgl,sklh->skgh")

    init = (
        jnp.full((s_max, nk, g), MASK_VALUE, jnp.float32),
        jnp.zeros((s_max, nk, g), jnp.float32),
        jnp.zeros((s_max, nk, g, h), jnp.float32),
    )
    _m, l, acc = lax.fori_loop(j_lo, j_hi, body, init)
    acc = acc * jnp.asarray(v_scale, jnp.float32)  # V was not dequantized
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(s_max, n, h)


def _ref_prefill_chunks(
    q, kv_pages, meta, out, *, sm_scale, sliding_window, soft_cap, k_scale, v_scale, block_q, block_kv, kv_dtype,
    items: int, by_row=None,
):
    """Attention for the tokens of sequences with q_len >= 2, in chunks ("items") of `block_q` query rows of one
    sequence, `items` chunks per loop iteration (batched: one gather and one pair of dots for all of them).

    Cost per call: ceil(chunks / items) iterations; each runs as many KV blocks as the longest KV range among its
    chunks (a chunk's range: its window start to its last position, so no other sequence's length leaks in; a
    chunk past its own range only masks), O(items * block_q * block_kv * N * H) compute and O(items * block_kv *
    2K * H) gather per block. Batching exists for XLA:CPU, where a loop iteration costs far more than a chunk's
    arithmetic: 16 prompts of 24 tokens are 32 chunks, 32 iterations of small ops per layer one at a time.
    Writes the chunk rows into `out` f32 [T, N, H] and returns it. by_row: bool [S_max], sequences left out (their
    tokens were computed as decode rows).
    """
    t_pad, n, h = q.shape
    _, two_k, ps, _ = kv_pages.shape
    nk = two_k // 2
    g = n // nk
    s_max, p_max = meta.page_indices.shape
    ppb = max(1, block_kv // ps)
    bkv = ppb * ps
    bq, nb = block_q, items

    cu = meta.cu_q_lens
    q_len = cu[1:] - cu[:-1]
    is_pf = (jnp.arange(s_max) < meta.num_seqs[0]) & (q_len >= 2)
    if by_row is not None:
        is_pf &= ~by_row
    n_chunks = jnp.where(is_pf, (q_len + bq - 1) // bq, 0)
    cum = jnp.cumsum(n_chunks)
    n_items = cum[-1]
    blocks = meta.block_lo is not None
    if blocks:   # per token: its image block (lo > hi: none); padded so every chunk's rows can be read
        b_lo_pad = jnp.pad(meta.block_lo, (0, bq), constant_values=1 << 30)
        b_hi_pad = jnp.pad(meta.block_hi, (0, bq), constant_values=-1)
    q_pad = jnp.pad(q, ((0, bq), (0, 0), (0, 0)))
    rq = jnp.arange(bq)

    def batch(b, out):
        w = b * nb + jnp.arange(nb)                                              # [B] chunk ids
        live = w < n_items
        s = jnp.minimum(jnp.searchsorted(cum, w, side="right", method="compare_all"), s_max - 1).astype(jnp.int32)
        c = w - (cum[s] - n_chunks[s])
        t0 = cu[s] + c * bq                                                      # [B] first row
        n_rows = jnp.where(live, jnp.minimum(bq, q_len[s] - c * bq), 0)
        row_ok = rq[None, :] < n_rows[:, None]                                   # [B, Q]
        pos = (meta.kv_lens[s] - q_len[s] + (t0 - cu[s]))[:, None] + rq[None, :]  # [B, Q]
        p_first = pos[:, 0]
        p_last = p_first + n_rows - 1
        win_lo = jnp.maximum(p_first - sliding_window + 1, 0) if sliding_window is not None else jnp.zeros_like(s)
        rows = jnp.minimum(t0[:, None] + rq[None, :], t_pad + bq - 1)           # [B, Q] (clipped: dead chunks)
        if blocks:   # the rows' image blocks; the loop covers them too
            b_lo, b_hi = b_lo_pad[rows], b_hi_pad[rows]
            in_blk = row_ok & (b_lo <= b_hi)
            p_last = jnp.maximum(p_last, jnp.max(jnp.where(in_blk, b_hi, p_first[:, None]), axis=1))
            win_lo = jnp.minimum(win_lo, jnp.min(jnp.where(in_blk, b_lo, win_lo[:, None]), axis=1))
        qc = q_pad[rows].reshape(nb, bq, nk, g, h)
        table = meta.page_indices[s]                                             # [B, P_max]
        j0 = win_lo // bkv
        n_blk = jnp.where(live, p_last // bkv + 1 - j0, 0)                       # [B] KV blocks of each chunk

        def kv_block(jj, carry):
            m, l, acc = carry
            j = j0 + jj                                                          # [B]
            lp = jnp.clip(j[:, None] * ppb + jnp.arange(ppb), 0, p_max - 1)      # [B, ppb]
            k, v = _gather_kv_block(kv_pages, jnp.take_along_axis(table, lp, axis=1), kv_dtype)  # [B, K, L, H]
            kv_pos = j[:, None] * bkv + jnp.arange(bkv)                          # [B, L]
            ok = kv_pos[:, None, :] <= pos[:, :, None]                           # [B, Q, L] causal
            if sliding_window is not None:
                ok &= pos[:, :, None] - kv_pos[:, None, :] < sliding_window
            if blocks:   # Gemma 4: AND(window, OR(causal, block)); the 12B: OR(AND(causal, window), block)
                blk = (kv_pos[:, None, :] >= b_lo[:, :, None]) & (kv_pos[:, None, :] <= b_hi[:, :, None])
                if sliding_window is not None and meta.block_in_window:
                    blk &= pos[:, :, None] - kv_pos[:, None, :] < sliding_window
                ok |= blk
            ok &= row_ok[:, :, None] & (jj < n_blk)[:, None, None]
            kv_ok = (kv_pos >= win_lo[:, None]) & (kv_pos <= p_last[:, None])   # [B, L]
            v = jnp.where(kv_ok[:, None, :, None], v, jnp.zeros((), v.dtype))
            s_ = _scores(_qk("bqkgh,bklh->bkgql", qc, k), sm_scale * k_scale, soft_cap)
            return _online_softmax_step(m, l, acc, s_, ok[:, None, None], v, "bkgql,bklh->bkgqh")

        init = (
            jnp.full((nb, nk, g, bq), MASK_VALUE, jnp.float32),
            jnp.zeros((nb, nk, g, bq), jnp.float32),
            jnp.zeros((nb, nk, g, bq, h), jnp.float32),
        )
        _m, l, acc = lax.fori_loop(0, jnp.max(n_blk), kv_block, init)
        acc = acc * jnp.asarray(v_scale, jnp.float32)  # V was not dequantized
        res = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)  # [B, K, G, Q, H]
        res = jnp.moveaxis(res, 3, 1).reshape(nb, bq, n, h)
        dst = jnp.where(row_ok, rows, t_pad)                                     # rows not of the chunk: dropped
        return out.at[dst].set(res, mode="drop")

    return lax.fori_loop(0, (n_items + nb - 1) // nb, batch, out)


def _sequences_by_row(meta: RaggedMeta, seq: jax.Array, valid: jax.Array) -> jax.Array:
    """bool [S_max]: the real sequences whose tokens are computed as decode rows: q_len == 1, and those marked in
    meta.by_row with q_len <= meta.row_q_max and no token in an image block (a block's tokens also see the keys
    after them, which a decode row never does)."""
    s_max = meta.kv_lens.shape[0]
    q_lens = meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]
    marked = meta.by_row & (q_lens <= meta.row_q_max)
    if meta.block_lo is not None:
        in_block = valid & (meta.block_lo <= meta.block_hi)
        marked &= ~jnp.zeros(s_max, bool).at[seq].max(in_block)
    return (jnp.arange(s_max) < meta.num_seqs[0]) & ((q_lens == 1) | marked)


def ragged_paged_attention_ref(
    q: jax.Array,
    k_new: jax.Array | None,
    v_new: jax.Array | None,
    kv_pages: jax.Array,
    meta: RaggedMeta,
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
    block_q: int | None = None,
    block_kv: int | None = None,
    kv_dtype=None,
    prefill_items: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp ragged paged attention (see `ragged_paged_attention`); scores, softmax and sums in float32.

    Writes k_new / v_new into their slots with an XLA scatter (`write_kv`: in place under donation), then runs
    decode rows (q_len == 1, batched) and prefill chunks (q_len >= 2, `block_q` rows each) over KV blocks of
    `block_kv` tokens. Cost: see `_ref_decode_rows`, `_ref_prefill_chunks` and `write_kv` (on XLA:CPU use f32 or
    bit-stored pages); memory is O(S_max * block_kv * 2K * H) per step.
    """
    t_pad = q.shape[0]
    ps = kv_pages.shape[2]
    # Decode rows default to KV blocks whose K and V for every row fit in about 512 KiB (`_decode_block_kv`);
    # prefill chunks to 16 query tokens x `_prefill_block_kv` KV tokens.
    block_q, dec_block_kv = block_q or 16, block_kv or _decode_block_kv(meta.page_indices.shape[0], kv_pages.shape)
    block_kv = block_kv or _prefill_block_kv(t_pad, meta.page_indices.shape[0])
    dt = page_dtype(kv_pages, kv_dtype)
    seq, pos, valid = _token_seq_and_pos(meta, t_pad)
    if k_new is not None:
        kv_pages = write_kv(kv_pages, k_new, v_new, _slots(meta, seq, pos, valid, ps), k_scale=k_scale,
                            v_scale=v_scale, kv_dtype=dt)
    kw = {
        "sm_scale": sm_scale,
        "sliding_window": sliding_window,
        "soft_cap": soft_cap,
        "k_scale": k_scale,
        "v_scale": v_scale,
        "kv_dtype": dt,
    }
    by_row = row_tokens = None
    if meta.by_row is not None and meta.row_q_max > 1 and not meta.decode_only:
        by_row = _sequences_by_row(meta, seq, valid)
        row_tokens = valid & by_row[seq]
    rows, dec = _ref_decode_rows(q, kv_pages, meta, seq, pos, valid, block_kv=dec_block_kv, row_tokens=row_tokens,
                                 **kw)
    if meta.decode_only:  # row i is token i (padding rows come out zero)
        return dec.astype(q.dtype), kv_pages
    out = after_init(dec, jnp.zeros(q.shape, jnp.float32)).at[rows].set(dec, mode="drop")
    # An all-decode step (the common one) skips the prefill machinery (its pads, prefix sums and copies) entirely.
    q_lens = meta.cu_q_lens[1:] - meta.cu_q_lens[:-1]
    pf = (jnp.arange(q_lens.shape[0]) < meta.num_seqs[0]) & (q_lens >= 2)
    any_prefill = jnp.any(pf if by_row is None else pf & ~by_row)
    out = lax.cond(any_prefill,
                   lambda o: _ref_prefill_chunks(q, kv_pages, meta, o, block_q=block_q, block_kv=block_kv,
                                                 items=prefill_items or PREFILL_ITEMS, by_row=by_row, **kw),
                   lambda o: o, out)
    return out.astype(q.dtype), kv_pages


# ----------------------------------------------------------------------------------------------------------------
# Pallas TPU kernel
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _KernelDims:
    """Static geometry of one kernel instance."""

    nk: int  # K, KV heads
    g: int  # G, query heads per KV head
    h: int  # H
    ps: int  # page size
    p_max: int  # P_max, pages per sequence in page_indices
    s_max: int  # S_max
    bq: int  # tokens per q block; rows per block = bq * g
    ppb: int  # pages per KV block
    sliding_window: int | None
    sm_scale: float
    soft_cap: float | None
    compute_dtype: jnp.dtype
    write: bool  # fused write of the step's new K/V
    q_f32_copy: bool  # q is 16-bit and the small-row path is on: keep an f32 copy of the q block in VMEM

    @property
    def rows(self) -> int:
        return self.bq * self.g

    @property
    def small_rows(self) -> int:
        """Rows of the decode window: any G consecutive rows fit in an 8-aligned window of this many rows."""
        return min(self.rows, -(-(self.g + 7) // 8) * 8)

    @property
    def bkv(self) -> int:
        return self.ppb * self.ps


def _div(x, y: int):
    """Truncating division by a static int. Used in the kernel instead of `//`, whose floor semantics lower to
    extra sign ops (and query the default device's TPU generation); every operand divided here is >= 0 when used."""
    if isinstance(x, int):
        return x // y
    return lax.div(x, jnp.asarray(y, x.dtype))


def _rpa_kernel(
    # scalar prefetch (SMEM)
    cu_ref,  # int32 [S_max + 1]
    kvlen_ref,  # int32 [S_max]
    pages_ref,  # int32 [S_max * P_max]
    qblk_ref,  # int32 [2 * num_q_blocks]: first and one-past-last sequence overlapping each q block
    wsched_ref,  # int32 [1 + 3 * J]: number of write tiles, then (page, first row, end row) per tile
    scale_ref,  # f32 [2] SMEM: k_scale, v_scale
    q_ref,  # [R, H] VMEM block: rows (token, group) of KV head k, q block i
    kv_hbm,  # [num_pages, 2K, ps, H] HBM (aliased to kv_out in write mode)
    *rest,
    d: _KernelDims,
):
    if d.write:
        new_hbm, o_ref, kv_out, *scratch = rest
        kv = kv_out  # read and write through the aliased output: it holds this step's writes
    else:
        o_ref, *scratch = rest
        kv = kv_hbm
    del kv_hbm
    kv_buf, sem, m_ref, l_ref, acc_ref, *more = scratch
    qf_ref = more.pop(0) if d.q_f32_copy else None
    if d.write:
        w_old, w_new, wsem = more
    head = pl.program_id(0)
    qi = pl.program_id(1)
    bkv, ps, ppb = d.bkv, d.ps, d.ppb

    # ---- fused cache write: once per step, before any attention block reads a page
    if d.write:

        @pl.when((head == 0) & (qi == 0))
        def _write():
            n_tiles = wsched_ref[0]

            def reads(w, slot):
                page = wsched_ref[1 + 3 * w]
                return (
                    pltpu.make_async_copy(kv.at[page], w_old.at[slot], wsem.at[slot, 0]),
                    pltpu.make_async_copy(new_hbm.at[w], w_new.at[slot], wsem.at[slot, 1]),
                )

            def write(w, slot):
                return pltpu.make_async_copy(w_old.at[slot], kv.at[wsched_ref[1 + 3 * w]], wsem.at[slot, 2])

            @pl.when(n_tiles > 0)
            def _():
                for c in reads(0, 0):
                    c.start()

            def tile(w, carry):
                slot = lax.rem(w, 2)

                @pl.when(w >= 1)
                def _():
                    write(w - 1, 1 - slot).wait()  # frees the other slot's buffers

                @pl.when(w + 1 < n_tiles)
                def _():
                    for c in reads(w + 1, 1 - slot):
                        c.start()

                for c in reads(w, slot):
                    c.wait()
                lo, hi = wsched_ref[2 + 3 * w], wsched_ref[3 + 3 * w]
                row = lax.broadcasted_iota(jnp.int32, w_old.shape[1:], 1)
                w_old[slot] = jnp.where((row >= lo) & (row < hi), w_new[slot], w_old[slot])
                write(w, slot).start()
                return carry

            lax.fori_loop(0, n_tiles, tile, 0)

            @pl.when(n_tiles > 0)
            def _():
                last = n_tiles - 1
                write(last, lax.rem(last, 2)).wait()

    # ---- attention for q block qi of KV head `head`
    if qf_ref is not None:  # f32 copy of a 16-bit q block: row windows at 8-aligned offsets are whole tiles
        qf_ref[...] = q_ref[...].astype(jnp.float32)
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    s_lo, s_hi = qblk_ref[2 * qi], qblk_ref[2 * qi + 1]
    q_start = qi * d.bq
    q_end = q_start + d.bq
    k_scale, v_scale = scale_ref[0], scale_ref[1]

    def seq_info(s):
        """Scalars of sequence s restricted to this q block (s clamped so that SMEM reads stay in bounds)."""
        s = jnp.minimum(s, d.s_max - 1)
        cu_s, cu_s1 = cu_ref[s], cu_ref[s + 1]
        tok_lo = jnp.maximum(cu_s, q_start)
        tok_hi = jnp.minimum(cu_s1, q_end)
        base = kvlen_ref[s] - (cu_s1 - cu_s) - cu_s  # absolute position = flat token index + base
        p_max = tok_hi - 1 + base
        win_lo = jnp.maximum(tok_lo + base - d.sliding_window + 1, 0) if d.sliding_window is not None else 0
        j_lo = _div(win_lo, bkv)
        j_hi = jnp.where(tok_lo < tok_hi, _div(p_max, bkv) + 1, j_lo)  # no tokens here -> no blocks
        return {
            "s": s,
            "tok_lo": tok_lo,
            "tok_hi": tok_hi,
            "base": base,
            "p_max": p_max,
            "win_lo": win_lo,
            "j_lo": j_lo,
            "j_hi": j_hi,
        }

    def next_nonempty(s):
        def cond(s):
            inf = seq_info(s)
            return (s < s_hi) & (inf["j_lo"] >= inf["j_hi"])

        return lax.while_loop(cond, lambda s: s + 1, s)

    def page_copies(inf, j, slot):
        """(needed, copy) per page of KV block j of a sequence; pages wholly outside [win_lo, p_max] are skipped."""
        out = []
        for p in range(ppb):
            lp = j * ppb + p
            need = (lp * ps <= inf["p_max"]) & ((lp + 1) * ps > inf["win_lo"]) & (lp < d.p_max)
            page = pages_ref[inf["s"] * d.p_max + jnp.minimum(lp, d.p_max - 1)]
            src = kv.at[page, pl.ds(2 * head, 2)]  # [2, ps, H]: K and V of this KV head in one DMA
            dst = kv_buf.at[slot, :, pl.ds(p * ps, ps)]
            out.append((need, pltpu.make_async_copy(src, dst, sem.at[slot])))
        return out

    def start_fetch(inf, j, slot):
        for need, c in page_copies(inf, j, slot):
            pl.when(need)(c.start)

    def wait_fetch(inf, j, slot):
        for need, c in page_copies(inf, j, slot):
            pl.when(need)(c.wait)

    def sanitize_v(inf, j, slot):
        """Zero V rows outside [win_lo, p_max] (stale VMEM of skipped pages, freed pages with NaN, the tail of the
        last page): the probabilities there are 0, but 0 * NaN = NaN. Only boundary blocks have such rows."""
        first, last = j * bkv, j * bkv + bkv - 1

        @pl.when((first < inf["win_lo"]) | (last > inf["p_max"]))
        def _():
            kv_row = first + lax.broadcasted_iota(jnp.int32, (bkv, 1), 0)
            ok = (kv_row >= inf["win_lo"]) & (kv_row <= inf["p_max"])
            kv_buf[slot, 1] = jnp.where(ok, kv_buf[slot, 1], jnp.zeros((), kv_buf.dtype))

    def compute(inf, j, slot, r0, nr):
        """Online-softmax update of rows [r0, r0 + nr) of the q block with KV block j (r0: multiple of 8)."""
        cd = d.compute_dtype
        rows = pl.ds(r0, nr)
        q = (qf_ref if qf_ref is not None else q_ref)[rows, :].astype(cd)  # [nr, H]
        k = kv_buf[slot, 0].astype(cd)  # [L, H]; fp8 pages are dequantized here (exact in bf16), scale below
        v = kv_buf[slot, 1].astype(cd)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [nr, L]
        s = s * (d.sm_scale * k_scale)
        if d.soft_cap is not None:
            s = jnp.tanh(s / d.soft_cap) * d.soft_cap
        row = r0 + lax.broadcasted_iota(jnp.int32, (nr, bkv), 0)
        g_shift = int(math.log2(d.g)) if d.g & (d.g - 1) == 0 else None
        tok = q_start + (row >> g_shift if g_shift is not None else _div(row, d.g))
        pos = tok + inf["base"]
        kv_pos = j * bkv + lax.broadcasted_iota(jnp.int32, (nr, bkv), 1)
        mask = (tok >= inf["tok_lo"]) & (tok < inf["tok_hi"]) & (kv_pos <= pos)
        if d.sliding_window is not None:
            mask &= pos - kv_pos < d.sliding_window
        s = jnp.where(mask, s, MASK_VALUE)
        m_prev = m_ref[rows, :][:, :1]
        l_prev = l_ref[rows, :][:, :1]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * l_prev + p.sum(axis=1, keepdims=True)
        pv = jnp.dot(p.astype(cd), v, preferred_element_type=jnp.float32)  # [nr, H]
        acc_ref[rows, :] = alpha * acc_ref[rows, :] + pv * v_scale
        m_ref[rows, :] = jnp.broadcast_to(m_new, (nr, m_ref.shape[1]))
        l_ref[rows, :] = jnp.broadcast_to(l_new, (nr, l_ref.shape[1]))

    def compute_block(inf, j, slot):
        """A sequence whose rows fit in an 8-aligned window of d.small_rows rows (a decode token: G rows) updates
        only that window; otherwise all rows of the q block go through the MXU and the VPU."""
        sanitize_v(inf, j, slot)
        if d.small_rows >= d.rows:
            compute(inf, j, slot, 0, d.rows)
            return
        r_lo = (inf["tok_lo"] - q_start) * d.g
        r_hi = (inf["tok_hi"] - q_start) * d.g
        r0 = (r_lo >> 3) << 3
        small = r_hi - r0 <= d.small_rows

        @pl.when(small)
        def _():
            compute(inf, j, slot, pl.multiple_of(jnp.minimum(r0, d.rows - d.small_rows), 8), d.small_rows)

        @pl.when(jnp.logical_not(small))
        def _():
            compute(inf, j, slot, 0, d.rows)

    s0 = next_nonempty(s_lo)

    @pl.when(s0 < s_hi)
    def _():
        start_fetch(seq_info(s0), seq_info(s0)["j_lo"], 0)

    def cond(carry):
        return carry[0] < s_hi

    def body(carry):
        s, j, slot = carry
        inf = seq_info(s)
        same = j + 1 < inf["j_hi"]
        s_n = jnp.where(same, s, next_nonempty(s + 1))
        inf_n = seq_info(s_n)
        j_n = jnp.where(same, j + 1, inf_n["j_lo"])

        @pl.when(s_n < s_hi)
        def _():
            start_fetch(inf_n, j_n, 1 - slot)  # prefetch the next block (possibly of the next sequence)

        wait_fetch(inf, j, slot)
        compute_block(inf, j, slot)
        return s_n, j_n, 1 - slot

    lax.while_loop(cond, body, (s0, seq_info(s0)["j_lo"], jnp.int32(0)))

    l_fin = l_ref[...][:, :1]
    out = jnp.where(l_fin > 0, acc_ref[...] / jnp.where(l_fin > 0, l_fin, 1.0), 0.0)
    o_ref[...] = out.astype(o_ref.dtype)


def _q_block_tokens(g: int, block_q: int | None, q_dtype) -> int:
    """Tokens per q block: block_q (default 128 // G, i.e. about 128 rows), rounded up so that its rows
    (tokens * G) fill whole sublane tiles of q's dtype."""
    tile = max(sublane_tile(q_dtype), 8)
    bq = max(1, block_q if block_q is not None else 128 // g)
    while (bq * g) % tile:
        bq += 1
    return bq


def _q_block_seqs(meta: RaggedMeta, num_q_blocks: int, bq: int) -> jax.Array:
    """int32 [2 * num_q_blocks]: (first, one past last) real sequence overlapping each q block of bq tokens."""
    cu = meta.cu_q_lens
    s_max = meta.kv_lens.shape[0]
    real = jnp.arange(s_max) < meta.num_seqs[0]
    start = jnp.arange(num_q_blocks, dtype=jnp.int32) * bq
    lo = jnp.sum(real[None, :] & (cu[None, 1:] <= start[:, None]), axis=1)
    hi = jnp.sum(real[None, :] & (cu[None, :-1] < start[:, None] + bq), axis=1)
    return jnp.stack([lo, hi], axis=1).reshape(-1).astype(jnp.int32)


def _write_schedule(meta: RaggedMeta, k_new, v_new, kv_pages, k_scale, v_scale):
    """Page-aligned tiles of the step's new K/V, one per (sequence, touched page), for the kernel's fused write.

    A DMA cannot start at an unaligned row of a tiled (page_size, H) slab, so the new tokens are laid out here
    (an XLA gather over new tokens only) at their in-page offsets; the kernel merges rows [lo, hi) of each tile
    into the page and writes the page back.
    Returns: sched int32 [1 + 3 * J] (count, then page, lo, hi per tile), tiles [J, 2K, page_size, H] page dtype.
    """
    t_pad = k_new.shape[0]
    _, _two_k, ps, _h = kv_pages.shape
    s_max, p_max = meta.page_indices.shape
    cu = meta.cu_q_lens
    q_len = cu[1:] - cu[:-1]
    real = (jnp.arange(s_max) < meta.num_seqs[0]) & (q_len > 0)
    start = meta.kv_lens - q_len
    first_lp = start // ps
    count = jnp.where(real, (meta.kv_lens - 1) // ps - first_lp + 1, 0)
    cum = jnp.cumsum(count)
    n_tiles = cum[-1]
    j_max = min(t_pad, -(-t_pad // ps) + 2 * s_max)
    w = jnp.arange(j_max, dtype=jnp.int32)
    s = jnp.minimum(jnp.searchsorted(cum, w, side="right", method="compare_all"), s_max - 1)
    lp = first_lp[s] + w - (cum[s] - count[s])
    page = meta.page_indices[s, jnp.clip(lp, 0, p_max - 1)]
    lo = jnp.clip(start[s] - lp * ps, 0, ps)
    hi = jnp.clip(meta.kv_lens[s] - lp * ps, 0, ps)
    sched = jnp.concatenate([n_tiles[None], jnp.stack([page, lo, hi], axis=1).reshape(-1)]).astype(jnp.int32)
    tok = cu[s][:, None] + lp[:, None] * ps + jnp.arange(ps)[None, :] - start[s][:, None]  # [J, ps]
    kv_new = interleave_kv(quantize_kv(k_new, kv_pages.dtype, k_scale), quantize_kv(v_new, kv_pages.dtype, v_scale))
    tiles = jnp.take(kv_new, jnp.clip(tok, 0, t_pad - 1), axis=0)  # [J, ps, 2K, H]
    return sched, jnp.swapaxes(tiles, 1, 2)


# Scalar memory per TensorCore on v5e / v6e (pltpu.get_tpu_info().smem_capacity_bytes); the page table and the
# schedules are scalar-prefetched into it whole.
SMEM_BYTES = 1 << 20


def kernel_supports(kv_pages: jax.Array, q: jax.Array, meta: RaggedMeta) -> str | None:
    """None when the Pallas kernel takes these shapes, else the reason (a sentence naming the values).

    Any page size and head dim lower (Mosaic pads partial tiles); whole tiles, i.e. page_size a multiple of
    32 // itemsize and H of 128 (`KVLayout.tile_aligned`), waste no HBM or VMEM.
    """
    s_max, p_max = meta.page_indices.shape
    t_pad = q.shape[0]
    if meta.block_lo is not None:
        return "bidirectional image blocks (block_lo / block_hi) are not in the kernel"
    if not jnp.issubdtype(kv_pages.dtype, jnp.floating):
        return f"pages of dtype {kv_pages.dtype} are bit-stored (the XLA:CPU layout); the kernel needs float pages"
    if q.shape[2] != kv_pages.shape[3]:
        return f"q head_dim {q.shape[2]} != page head_dim {kv_pages.shape[3]}"
    smem = 4 * (s_max * p_max + 3 * s_max + 3 * t_pad + 8)  # page table, lens, q-block and write schedules
    if smem > SMEM_BYTES * 15 // 16:
        return (
            f"the page table [S_max={s_max}, P_max={p_max}] and schedules need {smem} bytes of SMEM, more than the "
            f"{SMEM_BYTES} available; use a larger page_size or fewer sequences per step"
        )
    return None


def ragged_paged_attention_pallas(
    q: jax.Array,
    k_new: jax.Array | None,
    v_new: jax.Array | None,
    kv_pages: jax.Array,
    meta: RaggedMeta,
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
    block_q: int | None = None,
    block_kv: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[jax.Array, jax.Array]:
    """The Pallas TPU kernel (see `ragged_paged_attention`); `interpret=True` (or an InterpretParams, e.g. with
    detect_races=True) runs it in TPU interpret mode on CPU.

    block_q: query tokens per grid step (default about 128 rows of tokens x G); block_kv: KV tokens per block
    (default 512, rounded down to whole pages).

    Grid (K, q blocks), both sequential ("arbitrary"): step (0, 0) first writes the new K/V into the pages; each
    step then walks the sequences overlapping its q block and their KV blocks of `block_kv` tokens, prefetching
    the next block while computing the current one. q is laid out [K, T * G, H] so one KV head's rows are one block.
    """
    reason = kernel_supports(kv_pages, q, meta)
    if reason is not None:
        raise ValueError(f"ragged_paged_attention impl='pallas': {reason}; use impl='ref'")
    t_pad, n, h = q.shape
    _num_pages, two_k, ps, _ = kv_pages.shape
    nk = two_k // 2
    g = n // nk
    s_max, p_max = meta.page_indices.shape
    write = k_new is not None
    cdt = jnp.float32 if jnp.float32 in (jnp.dtype(q.dtype), jnp.dtype(kv_pages.dtype)) else jnp.bfloat16
    d = _KernelDims(
        nk=nk, g=g, h=h, ps=ps, p_max=p_max, s_max=s_max,
        bq=_q_block_tokens(g, block_q, q.dtype), ppb=max(1, (block_kv or 512) // ps),
        sliding_window=sliding_window, sm_scale=float(sm_scale), soft_cap=soft_cap,
        compute_dtype=jnp.dtype(cdt), write=write, q_f32_copy=False,
    )  # fmt: skip
    if d.small_rows < d.rows and jnp.dtype(q.dtype).itemsize < 4:
        d = dataclasses.replace(d, q_f32_copy=True)
    nqb = -(-t_pad // d.bq)
    t2 = nqb * d.bq
    q_t = jnp.pad(q.reshape(t_pad, nk, g, h), ((0, t2 - t_pad), (0, 0), (0, 0), (0, 0)))
    q_t = jnp.transpose(q_t, (1, 0, 2, 3)).reshape(nk, t2 * g, h)  # [K, T2 * G, H]

    qblk = _q_block_seqs(meta, nqb, d.bq)
    if write:
        wsched, tiles = _write_schedule(meta, k_new, v_new, kv_pages, k_scale, v_scale)
    else:
        wsched, tiles = jnp.zeros((1,), jnp.int32), None
    scales = jnp.stack([jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32)])

    row_spec = pl.BlockSpec((None, d.rows, h), lambda k, i, *_: (k, i, 0))
    in_specs = [pl.BlockSpec(memory_space=pltpu.SMEM), row_spec, pl.BlockSpec(memory_space=pl.ANY)]
    out_specs = [row_spec]
    out_shape = [jax.ShapeDtypeStruct((nk, t2 * g, h), q.dtype)]
    scratch = [
        pltpu.VMEM((2, 2, d.bkv, h), kv_pages.dtype),  # double-buffered K/V block of one KV head
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.VMEM((d.rows, 128), jnp.float32),  # m (lane-replicated)
        pltpu.VMEM((d.rows, 128), jnp.float32),  # l
        pltpu.VMEM((d.rows, h), jnp.float32),  # acc
    ]
    if d.q_f32_copy:
        scratch.append(pltpu.VMEM((d.rows, h), jnp.float32))  # f32 copy of the q block
    args = [meta.cu_q_lens, meta.kv_lens, meta.page_indices.reshape(-1), qblk, wsched, scales, q_t, kv_pages]
    aliases = {}
    if write:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        out_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        out_shape.append(jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype))
        scratch += [
            pltpu.VMEM((2, two_k, ps, h), kv_pages.dtype),  # page being merged
            pltpu.VMEM((2, two_k, ps, h), kv_pages.dtype),  # its new-token tile
            pltpu.SemaphoreType.DMA((2, 3)),
        ]
        args.append(tiles)
        aliases = {7: 1}  # kv_pages (operand 7, counting the 5 scalar-prefetch operands) -> output 1

    itemsize = jnp.dtype(kv_pages.dtype).itemsize
    cost = pl.CostEstimate(
        flops=4 * t2 * n * h * min(p_max * ps, 8192),
        transcendentals=t2 * n * min(p_max * ps, 8192),
        bytes_accessed=int(q.size * q.dtype.itemsize * 2 + s_max * p_max * ps * two_k * h * itemsize),
    )
    outs = pl.pallas_call(
        functools.partial(_rpa_kernel, d=d),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=(nk, nqb), in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch
        ),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        cost_estimate=cost,
        interpret=(interpret if isinstance(interpret, pltpu.InterpretParams) else pltpu.InterpretParams())
        if interpret
        else False,
    )(*args)
    out = outs[0].reshape(nk, t2, g, h).transpose(1, 0, 2, 3).reshape(t2, n, h)[:t_pad]
    return out, (outs[1] if write else kv_pages)


# ----------------------------------------------------------------------------------------------------------------
# Public op
# ----------------------------------------------------------------------------------------------------------------


def ragged_paged_attention(
    q: jax.Array,
    k_new: jax.Array | None,
    v_new: jax.Array | None,
    kv_pages: jax.Array,
    meta: RaggedMeta,
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
    impl: str = "auto",
    block_q: int | None = None,
    block_kv: int | None = None,
    kv_dtype: str | jnp.dtype | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Writes the step's new K/V into the paged cache, then attends every query token over its sequence's cache.

    Token i of sequence s sits at position kv_lens[s] - q_len[s] + i; it sees positions j <= its own and, with a
    sliding window W, only those with position - j < W. Query head n uses KV head n // (N // K). Scores and softmax
    are float32; soft_cap gives tanh(s / c) * c.

    Args:
      q: [T_pad, N, H] queries, flattened over sequences (rows past cu_q_lens[num_seqs] are padding -> zeros).
      k_new, v_new: [T_pad, K, H] the step's new keys / values, or both None for a read-only (KV-shared) layer.
      kv_pages: [num_pages, 2K, page_size, H] (gemmajax.kv.layout); fp8 pages use k_scale / v_scale. Bit-stored
        pages (uint16 / uint8, the fast layout for XLA:CPU, ref only) need kv_dtype ("bf16", "fp8_e5m2", ...).
      meta: RaggedMeta of the step.
      impl: "ref" (jnp), "pallas" (TPU kernel), "pallas_interpret" (kernel in TPU interpret mode on CPU),
        "auto" (chosen at lowering time: the kernel when lowered for TPU, the reference for any other platform;
        the reference everywhere, logged once, when `kernel_supports` refuses the case, e.g. bit-stored pages).
      block_q, block_kv: tile sizes in tokens (None: the implementation's default); for tuning and tests.
    Returns:
      out: [T_pad, N, H] in q.dtype; kv_pages: the updated pages (the input itself in read-only mode).
    """
    t_pad, n, h = q.shape
    if kv_pages.ndim != 4 or kv_pages.shape[3] != h or kv_pages.shape[1] % 2:
        raise ValueError(f"kv_pages must be [num_pages, 2K, page_size, {h}] for q {q.shape}; got {kv_pages.shape}")
    nk = kv_pages.shape[1] // 2
    if n % nk:
        raise ValueError(f"query heads N={n} must be a multiple of KV heads K={nk}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must both be arrays or both be None (read-only mode)")
    if k_new is not None and (k_new.shape != (t_pad, nk, h) or v_new.shape != (t_pad, nk, h)):
        raise ValueError(f"k_new / v_new must be [{t_pad}, {nk}, {h}]; got {k_new.shape} and {v_new.shape}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1; got {sliding_window}")
    kw = {
        "sm_scale": sm_scale,
        "sliding_window": sliding_window,
        "soft_cap": soft_cap,
        "k_scale": k_scale,
        "v_scale": v_scale,
        "block_q": block_q,
        "block_kv": block_kv,
    }
    if impl == "auto":
        return _auto(q, k_new, v_new, kv_pages, meta, kv_dtype, kw)
    if impl == "ref":
        return ragged_paged_attention_ref(q, k_new, v_new, kv_pages, meta, kv_dtype=kv_dtype, **kw)
    page_dtype(kv_pages, kv_dtype)  # a kv_dtype that contradicts the pages is an error on every path
    if impl == "pallas":
        return ragged_paged_attention_pallas(q, k_new, v_new, kv_pages, meta, **kw)
    if impl == "pallas_interpret":
        return ragged_paged_attention_pallas(q, k_new, v_new, kv_pages, meta, interpret=True, **kw)
    raise ValueError(f"impl must be 'auto', 'ref', 'pallas' or 'pallas_interpret'; got {impl!r}")


_FALLBACKS_LOGGED: set[str] = set()


def _auto(q, k_new, v_new, kv_pages, meta, kv_dtype, kw) -> tuple[jax.Array, jax.Array]:
    """impl="auto": `lax.platform_dependent` picks the kernel when the program is lowered for TPU and the reference
    for every other platform (one rule with gemmajax.quant's "auto"). The kernel's limits are shapes and dtypes,
    known at trace time: a case it cannot take runs the reference on every platform, logged once per reason."""
    ref = functools.partial(ragged_paged_attention_ref, kv_dtype=kv_dtype, **kw)
    reason = kernel_supports(kv_pages, q, meta)
    if reason is not None:
        if reason not in _FALLBACKS_LOGGED:
            _FALLBACKS_LOGGED.add(reason)
            logger.info("ragged_paged_attention impl='auto': the Pallas kernel cannot take this case (%s); the jnp "
                        "reference runs instead, on every platform", reason)
        return ref(q, k_new, v_new, kv_pages, meta)
    page_dtype(kv_pages, kv_dtype)  # a kv_dtype that contradicts the pages is an error on every path
    kernel = functools.partial(ragged_paged_attention_pallas, **kw)
    return lax.platform_dependent(q, k_new, v_new, kv_pages, meta, tpu=kernel, default=ref)
