"""Images and audio in a request: where their soft tokens go in the prompt, and what a step needs of them.

A request's media (processed by gemmajax.tools.media, in prompt order) are encoded once, the first time the request
is scheduled (every request of that step together, so images of one shape run as one batch), into soft-token rows
kept with the request. A step that computes placeholder positions gets their rows (`StepInputs.soft_mask` /
`soft_rows`; the model sees the pad id there, as HF does), and on models with bidirectional image blocks
(26B / 31B / 12B) each token's block (`block_lo` / `block_hi`: the keys it sees besides the causal ones). The prefix cache hashes a
digest of each medium in place of its placeholder ids, so a page holding an image is reused only for that image;
a bidirectional image block is computed within one step (`Sequence.atomic_spans`).
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np


@dataclasses.dataclass
class MediaState:
    """One request's media.

    Attributes:
      items: ProcessedImage / ProcessedAudio in prompt order.
      positions: int [M] the placeholder positions in the prompt, in order (M = sum of items' soft tokens).
      block_start, block_end: int [M] the first / last position of each placeholder's image block (bidirectional
        models; else the placeholder itself).
      rows: [M, D] the soft tokens once encoded (host array in the model dtype), else None.
    """

    items: list
    positions: np.ndarray
    block_start: np.ndarray
    block_end: np.ndarray
    rows: np.ndarray | None = None


def media_state(prompt_ids: list[int], items: list, mm_cfg: Any) -> MediaState:
    """Check that the prompt's placeholders are the media's (count and kind, in order) and index them.

    Raises ValueError naming the medium when they disagree."""
    from gemmajax.model.multimodal import placeholder_positions, vision_block_ids
    ids = np.asarray(prompt_ids)
    pos = placeholder_positions(ids, mm_cfg)
    want = {"image": mm_cfg.image_token_id, "audio": mm_cfg.audio_token_id}
    at = 0
    for i, m in enumerate(items):
        kind, n = getattr(m, "kind", None), getattr(m, "num_soft_tokens", None)
        if kind not in want or not isinstance(n, int):
            raise ValueError(f"media[{i}]: expected a processed image or audio clip (gemmajax.tools.media), got "
                             f"{type(m).__name__}")
        got = ids[pos[at:at + n]]
        if len(got) != n or np.any(got != want[kind]):
            raise ValueError(f"media[{i}] ({kind}) takes {n} soft tokens, but the prompt has "
                             f"{int(np.sum(got == want[kind]))} {kind} placeholders at its place; expand the prompt "
                             f"with gemmajax.tools.media.expand_prompt")
        at += n
    if at != len(pos):
        raise ValueError(f"the prompt has {len(pos)} media placeholders, the request's media take {at}")
    start, end = pos.copy(), pos.copy()
    if mm_cfg.bidirectional_vision:
        blk = vision_block_ids(ids, mm_cfg)
        for b in np.unique(blk[blk >= 0]):
            idx = np.flatnonzero(blk == b)
            sel = np.isin(pos, idx)
            start[sel], end[sel] = idx[0], idx[-1]
    return MediaState(list(items), pos.astype(np.int64), start.astype(np.int64), end.astype(np.int64))


def covers(ms: MediaState | None, start: int) -> bool:
    """Does a chunk starting at `start` still reach placeholders of these media (a prefill, not a decode)?"""
    return ms is not None and len(ms.positions) > 0 and start <= int(ms.positions[-1])


def atomic_spans(ms: MediaState) -> list[tuple[int, int]]:
    """[start, end) of each bidirectional image block: its tokens attend to each other, so one step computes it."""
    spans = []
    for p, e in zip(ms.positions, ms.block_end):
        if e > p and (not spans or p >= spans[-1][1]):
            spans.append((int(p), int(e) + 1))
    return spans


def hash_overrides(ms: MediaState) -> dict[int, int]:
    """Per placeholder position, a value derived from its medium's content and its index in it (negative: never a
    token id), hashed by the prefix cache instead of the placeholder id."""
    out, at = {}, 0
    for m in ms.items:
        data = m.pixel_values if m.kind == "image" else m.features
        d = hashlib.blake2b(np.ascontiguousarray(data).tobytes(), digest_size=8).digest()
        base = int.from_bytes(d, "little") >> 2
        for j in range(m.num_soft_tokens):
            out[int(ms.positions[at + j])] = -1 - ((base + j) % (1 << 62))
        at += m.num_soft_tokens
    return out


def encode(states: list[MediaState], mm_weights: Any, mm_cfg: Any, dtype) -> None:
    """Fill `rows` of every state without them, in one `embed_multimodal` call (same-shape images batched)."""
    from gemmajax.model.multimodal import embed_multimodal
    todo = [ms for ms in states if ms.rows is None]
    if not todo:
        return
    embs = embed_multimodal(mm_weights, mm_cfg, [m for ms in todo for m in ms.items])
    at = 0
    for ms in todo:
        k = len(ms.items)
        parts = [np.asarray(e) for e in embs[at:at + k]]
        at += k
        ms.rows = np.concatenate(parts, axis=0).astype(dtype) if parts else None


def step_inputs(entries: list[tuple[MediaState | None, int, int]], t_pad: int, width: int, dtype,
                bidirectional: bool) -> tuple | None:
    """The soft-token arrays of a step: entries are (media state or None, first position, num tokens) in the step's
    token order. Returns (soft_mask bool [T], soft_rows [T, D], block_lo int32 [T], block_hi int32 [T]) (the block
    arrays None unless bidirectional; lo > hi outside blocks), or None when no token of the step is a placeholder."""
    mask = np.zeros(t_pad, bool)
    rows = None
    lo = np.full(t_pad, 1 << 30, np.int32) if bidirectional else None
    hi = np.full(t_pad, -1, np.int32) if bidirectional else None
    t = 0
    for ms, c, n in entries:
        if ms is not None:
            sel = (ms.positions >= c) & (ms.positions < c + n)
            if np.any(sel):
                if rows is None:
                    rows = np.zeros((t_pad, width), dtype)
                idx = t + (ms.positions[sel] - c)
                mask[idx] = True
                rows[idx] = ms.rows[sel]
                if bidirectional:
                    blk = ms.block_end[sel] > ms.block_start[sel]
                    lo[idx[blk]], hi[idx[blk]] = ms.block_start[sel][blk], ms.block_end[sel][blk]
        t += n
    if rows is None:
        return None
    return mask, rows, lo, hi
