"""Page allocator for the paged KV cache: one pool per KV group, prefix caching, sliding-window release.

Each group ("full" or "sliding" attention layers) owns a pool of pages; page 0 is the null page, never handed
out, and every unused or released page-table entry points to it. A full, computed page is registered under a
chained hash (blake2b of the parent hash and its token ids) and reference counted; a page whose count drops
to 0 goes to an LRU free queue but keeps its hash, so it can still be a prefix hit until it is reused
(unhashed pages go to the front of the queue, hashed ones to the back, so cached content is evicted last).
A sliding group holds only the pages its window can still reach: `release_out_of_window` returns the rest.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
import math

import numpy as np

from gemmajax.engine.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class KVGroupSpec:
    """One KV group: the layers sharing a page table.

    Attributes:
      name: e.g. "full" or "sliding".
      num_pages: pages in the pool, including the reserved null page 0.
      page_size: tokens per page.
      window: sliding window W (a query at position q sees keys q-W+1 .. q), or None for full attention.
    """

    name: str
    num_pages: int
    page_size: int
    window: int | None = None

    def __post_init__(self) -> None:
        if self.num_pages < 2:
            raise ValueError(f"KVGroupSpec {self.name!r}: num_pages must be >= 2 (page 0 is reserved), "
                             f"got {self.num_pages}")
        if self.page_size < 1:
            raise ValueError(f"KVGroupSpec {self.name!r}: page_size must be >= 1, got {self.page_size}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"KVGroupSpec {self.name!r}: window must be >= 1 or None, got {self.window}")


class _PagePool:
    """Reference counts, hashes and the LRU free queue of one group's pages."""

    def __init__(self, spec: KVGroupSpec) -> None:
        self.spec = spec
        self.ref_count = [0] * spec.num_pages
        self.page_hash: list[bytes | None] = [None] * spec.num_pages
        self.cached: dict[bytes, int] = {}  # hash -> page
        # Free pages in eviction order: the front is reused first.
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(1, spec.num_pages))

    def take(self) -> int:
        """A fresh page (evicting its cached content, if any) with reference count 1."""
        page, _ = self.free.popitem(last=False)
        h = self.page_hash[page]
        if h is not None:
            if self.cached.get(h) == page:
                del self.cached[h]
            self.page_hash[page] = None
        self.ref_count[page] = 1
        return page

    def ref(self, page: int) -> None:
        """One more user of a cached page (taking it off the free queue if it was there)."""
        if self.ref_count[page] == 0:
            del self.free[page]
        self.ref_count[page] += 1

    def unref(self, page: int) -> None:
        self.ref_count[page] -= 1
        if self.ref_count[page] < 0:
            raise RuntimeError(f"group {self.spec.name!r}: page {page} freed more often than allocated")
        if self.ref_count[page] == 0:
            self.free[page] = None
            if self.page_hash[page] is None:
                self.free.move_to_end(page, last=False)

    def register(self, page: int, h: bytes) -> None:
        if self.page_hash[page] is None and h not in self.cached:
            self.page_hash[page] = h
            self.cached[h] = page


class BlockManager:
    """Allocates pages of every KV group to sequences.

    The usual life of a sequence: `match_prefix` (once, at admission), then per step `allocate(seq, n)` before
    the step and `cache_full_pages` + `release_out_of_window` after it (the Scheduler does this), `free` at the
    end or at preemption. Page tables live in `seq.page_tables[g]`; `page_table_array` packs them for the step.
    """

    def __init__(self, groups: list[KVGroupSpec], enable_prefix_caching: bool = True) -> None:
        if not groups:
            raise ValueError("BlockManager needs at least one KVGroupSpec, got none")
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"BlockManager: KV group names must be unique, got {names}")
        self.groups = list(groups)
        self.enable_prefix_caching = enable_prefix_caching
        self._pools = [_PagePool(g) for g in groups]
        # A cached prefix must end on a page boundary of every group.
        self._prefix_step = math.lcm(*(g.page_size for g in groups))

    # -- queries -----------------------------------------------------------------------------------------
    def group_index(self, group: int | str) -> int:
        """Index of a group given by index or name."""
        if isinstance(group, str):
            for i, g in enumerate(self.groups):
                if g.name == group:
                    return i
            raise KeyError(f"no KV group named {group!r}; groups are {[g.name for g in self.groups]}")
        if not 0 <= group < len(self.groups):
            raise IndexError(f"KV group index must be in [0, {len(self.groups)}), got {group}")
        return group

    def num_free_pages(self, group: int | str) -> int:
        """Pages that can be handed out now (including evictable prefix-cache pages)."""
        return len(self._pools[self.group_index(group)].free)

    def num_usable_pages(self, group: int | str) -> int:
        """All pages of the group but the null page."""
        return self.groups[self.group_index(group)].num_pages - 1

    def ref_count(self, group: int | str, page: int) -> int:
        return self._pools[self.group_index(group)].ref_count[page]

    def usage(self) -> float:
        """Fraction (0..1) of pages in use in the fullest group; cached-but-free pages count as free."""
        return max(1.0 - len(p.free) / (p.spec.num_pages - 1) for p in self._pools)

    def max_pages_needed(self, num_tokens: int, max_chunk: int) -> list[int]:
        """Most pages per group that one sequence ever holds at once when at most `num_tokens` tokens get
        their K/V written, in steps of at most `max_chunk` tokens. A sliding group needs the window plus one
        chunk: positions [c - W + 1, c + n) span at most ceil((W - 1 + n) / P) + 1 pages."""
        out = []
        for g in self.groups:
            full = -(-num_tokens // g.page_size)
            if g.window is not None:
                full = min(full, -(-(g.window - 1 + max_chunk) // g.page_size) + 1)
            out.append(full)
        return out

    def page_table_array(self, seqs: list[Sequence], group: int | str, max_pages: int) -> np.ndarray:
        """Page tables of `seqs` for one group, zero padded.

        Returns:
          int32 [len(seqs), max_pages]: physical page of each logical page; 0 (the null page) where unused.
        """
        g = self.group_index(group)
        out = np.zeros((len(seqs), max_pages), np.int32)
        for row, seq in enumerate(seqs):
            table = seq.page_tables[g] if seq.page_tables else []
            if len(table) > max_pages:
                raise ValueError(f"{seq!r} has {len(table)} pages in group {self.groups[g].name!r}, more than "
                                 f"max_pages={max_pages}; raise max_pages (max_model_len / page_size)")
            out[row, : len(table)] = table
        return out

    # -- allocation --------------------------------------------------------------------------------------
    def _init_seq(self, seq: Sequence) -> None:
        if not seq.page_tables:
            n = len(self.groups)
            seq.page_tables = [[] for _ in range(n)]
            seq.num_hashed_pages = [0] * n
            seq.num_released_pages = [0] * n

    def allocate(self, seq: Sequence, num_tokens: int, ahead: int = 0) -> bool:
        """Give `seq` pages for positions [0, seq.num_computed_tokens + num_tokens) in every group (a sliding
        group: from the first position the step's queries can see). All or nothing: returns False, changing
        nothing, when any group lacks free pages. `ahead`: how many tokens not yet known (sampled by a step still
        on the device) the positions may run past the sequence's end (the scheduler's lookahead)."""
        wanted = self.new_pages(seq, num_tokens, ahead)
        if any(n > len(pool.free) for n, pool in zip(wanted, self._pools)):
            return False
        for g, pool in enumerate(self._pools):
            seq.page_tables[g].extend(pool.take() for _ in range(wanted[g]))
        return True

    def new_pages(self, seq: Sequence, num_tokens: int, ahead: int = 0) -> list[int]:
        """Per group, how many pages `allocate(seq, num_tokens, ahead)` would take now (free or not); changes
        nothing but an unseen sequence's empty page tables."""
        self._init_seq(seq)
        end = seq.num_computed_tokens + num_tokens
        if num_tokens < 0 or end > seq.num_tokens + ahead:
            raise ValueError(f"allocate({seq!r}, {num_tokens}): positions up to {end} requested, the sequence "
                             f"has {seq.num_tokens} tokens")
        return [max(0, -(-end // pool.spec.page_size) - len(seq.page_tables[g])) for g, pool in enumerate(self._pools)]

    def cache_full_pages(self, seq: Sequence) -> None:
        """Register the pages that are full and computed under their prefix hash (call after a step)."""
        if not self.enable_prefix_caching or not seq.page_tables:
            return
        for g, pool in enumerate(self._pools):
            size = pool.spec.page_size
            n_full = seq.num_computed_tokens // size
            start = seq.num_hashed_pages[g]
            if n_full <= start:
                continue
            hashes = self._hashes(seq, size, n_full)
            table = seq.page_tables[g]
            for i in range(start, n_full):
                if table[i] != 0:
                    pool.register(table[i], hashes[i])
            seq.num_hashed_pages[g] = n_full

    def release_out_of_window(self, seq: Sequence) -> None:
        """Return the sliding-group pages that no later query can see: every page wholly before position
        num_computed_tokens - W + 1 (the oldest key of the next query). Their entries become 0."""
        if not seq.page_tables:
            return
        for g, pool in enumerate(self._pools):
            window = pool.spec.window
            if window is None:
                continue
            n_out = max(0, seq.num_computed_tokens - window + 1) // pool.spec.page_size
            table = seq.page_tables[g]
            for i in range(seq.num_released_pages[g], min(n_out, len(table))):
                if table[i] != 0:
                    pool.unref(table[i])
                    table[i] = 0
            seq.num_released_pages[g] = max(seq.num_released_pages[g], n_out)

    def free(self, seq: Sequence) -> None:
        """Return all pages of `seq` (hashed pages stay findable in the prefix cache until reused)."""
        if not seq.page_tables:
            return
        for g, pool in enumerate(self._pools):
            # Last pages first, so the free queue evicts a prefix's tail before its head.
            for page in reversed(seq.page_tables[g]):
                if page != 0:
                    pool.unref(page)
        seq.page_tables = []
        seq.num_hashed_pages = []
        seq.num_released_pages = []

    # -- prefix cache ------------------------------------------------------------------------------------
    def _hashes(self, seq: Sequence, page_size: int, num_pages: int) -> list[bytes]:
        """Chained hashes of the first `num_pages` full pages of `seq` (memoised on the sequence)."""
        memo = seq.page_hashes.setdefault(page_size, [])
        tokens = seq.token_ids
        over = seq.hash_overrides
        while len(memo) < num_pages:
            i = len(memo)
            ids = tokens[i * page_size: (i + 1) * page_size]
            if over:   # media placeholders hash as their content
                ids = [over.get(i * page_size + j, t) for j, t in enumerate(ids)]
            chunk = array.array("q", ids).tobytes()
            memo.append(hashlib.blake2b((memo[-1] if memo else b"") + chunk, digest_size=16).digest())
        return memo

    def match_prefix(self, seq: Sequence) -> int:
        """Attach the longest usable cached prefix of `seq`'s tokens and return its length L.

        L is a multiple of every group's page size and at most num_tokens - 1 (the last token must run to give
        logits). A full group must hold every page of [0, L); a sliding group every page meeting the window of
        the first query, [L - W + 1, L) (its earlier entries stay 0). Sets seq.num_computed_tokens and
        seq.num_cached_tokens to L. Preempted sequences match their output tokens too.
        """
        if seq.num_computed_tokens != 0 or any(seq.page_tables):
            raise ValueError(f"match_prefix({seq!r}): the sequence must hold no pages and no computed tokens")
        self._init_seq(seq)
        step = self._prefix_step
        num_candidates = (seq.num_tokens - 1) // step
        if not self.enable_prefix_caching or num_candidates == 0:
            return 0
        hits: list[list[int]] = []  # per group: physical page of each logical page, 0 on a miss
        for pool in self._pools:
            size = pool.spec.page_size
            hashes = self._hashes(seq, size, num_candidates * step // size)
            row = []
            for h in hashes:
                page = pool.cached.get(h, 0)
                if page == 0 and pool.spec.window is None:
                    break  # a full group needs the whole prefix: stop at the first miss
                row.append(page)
            hits.append(row)

        def usable(length: int) -> bool:
            for pool, row in zip(self._pools, hits):
                size, window = pool.spec.page_size, pool.spec.window
                first = 0 if window is None else max(0, length - window + 1) // size
                last = length // size
                if len(row) < last or not all(row[first:last]):
                    return False
            return True

        length = next((c * step for c in range(num_candidates, 0, -1) if usable(c * step)), 0)
        if length == 0:
            return 0
        for g, (pool, row) in enumerate(zip(self._pools, hits)):
            size, window = pool.spec.page_size, pool.spec.window
            first = 0 if window is None else max(0, length - window + 1) // size
            last = length // size
            for page in row[first:last]:
                pool.ref(page)
            seq.page_tables[g] = [0] * first + row[first:last]
            seq.num_hashed_pages[g] = last
            seq.num_released_pages[g] = first
        seq.num_computed_tokens = length
        seq.num_cached_tokens = length
        return length
