"""Continuous-batching scheduler: which sequences run this step, and how many tokens each.

Each step fills a token budget in a fixed order: running decodes (1 token each), then running partial
prefills, then waiting requests in FIFO order (after a prefix-cache match), a prefill chunked to what is left.
Out of pages, the most recently admitted running sequence is preempted by recompute: its pages are freed and
it goes back to the front of the queue with its output kept. The scheduled list is decode-first, which is
the order the ragged paged attention kernel wants.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

from gemmajax.engine.block_manager import BlockManager
from gemmajax.engine.sequence import FINISH_REASONS, Sequence, SequenceStatus


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduler.

    Attributes:
      max_num_seqs: most running sequences (and so most sequences in one step).
      max_num_batched_tokens: token budget of one step (all sequences together).
      max_model_len: most tokens (prompt + output) of one sequence.
      enable_chunked_prefill: split a prompt over several steps to fit the budget; off, a prompt longer than
        the budget is rejected (the recompute of a preempted sequence is always chunked).
      long_prefill_token_threshold: most tokens one prefill may take in a step (0 = the whole budget).
      eos_token_ids: the model's end-of-sequence ids (a request stops on them unless ignore_eos).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"SchedulerConfig.long_prefill_token_threshold must be >= 0 (0 = off), "
                             f"got {self.long_prefill_token_threshold}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def max_chunk(self) -> int:
        """Most tokens one sequence computes in one step."""
        t = self.long_prefill_token_threshold
        return min(t, self.max_num_batched_tokens) if t else self.max_num_batched_tokens


class ScheduledSeq(NamedTuple):
    """One sequence of a step: compute (token_ids + spec_tokens)[c : c + num_new_tokens] at positions c.., where
    c = seq.num_computed_tokens (until update_after_step advances it). A decode that verifies k drafted tokens
    (seq.spec_tokens) has num_new_tokens = 1 + k."""

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step completes the sequence's known tokens, so the step samples its next token
        (false for a partial prefill chunk). Valid until update_after_step."""
        return self.seq.num_computed_tokens + self.num_new_tokens >= self.seq.num_tokens

    @property
    def num_spec(self) -> int:
        """Drafted tokens this step verifies."""
        return self.seq.num_computed_tokens + self.num_new_tokens - self.seq.num_tokens if self.samples else 0


@dataclasses.dataclass
class SchedulerOutput:
    """The work of one step.

    Attributes:
      scheduled: (seq, num_new_tokens) pairs, decodes (num_new_tokens == 1) first.
      preempted: sequences preempted while scheduling this step (back in the waiting queue).
      finished: sequences finished outside a step since the last schedule(): requests that can never fit
        (finish_reason "error", set at add() or here). Aborted ones are returned by abort() instead.
    """

    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    finished: list[Sequence]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        """Length of the leading run of 1-token entries."""
        n = 0
        for s in self.scheduled:
            if s.num_new_tokens != 1:
                break
            n += 1
        return n

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _fit_spans(seq: Sequence, n: int) -> int:
    """The most tokens (<= n) a chunk from seq.num_computed_tokens may take without ending inside an atomic span
    (an image block computed in one step); 0 when the span it starts in does not fit in n."""
    c = seq.num_computed_tokens
    for a, b in seq.atomic_spans:
        if a < c + n < b:
            n = a - c if a > c else 0
    return n


class Scheduler:
    """Queues of waiting and running sequences over one BlockManager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self._unfinished: dict[str, Sequence] = {}
        self._finished_outside_step: list[Sequence] = []
        # Counters for metrics.
        self.num_preemptions = 0
        self.num_prompt_tokens_admitted = 0
        self.num_prefix_cache_hit_tokens = 0

    # -- queue state -------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Sequence | None:
        return self._unfinished.get(request_id)

    # -- requests ----------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. One that can never run (prompt longer than max_model_len, or needing more
        pages than a pool holds) is finished at once with finish_reason "error" and seq.error set; it is
        also reported in the next SchedulerOutput.finished."""
        if seq.status != SequenceStatus.WAITING or seq.page_tables or seq.num_computed_tokens:
            raise ValueError(f"Scheduler.add({seq!r}): expected a new WAITING sequence without pages")
        if seq.request_id in self._unfinished:
            raise ValueError(f"Scheduler.add: request_id {seq.request_id!r} is already queued or running")
        error = self._why_impossible(seq)
        if error is not None:
            seq.error = error
            self._set_finished(seq, "error")
            self._finished_outside_step.append(seq)
            return
        self._unfinished[seq.request_id] = seq
        self.waiting.append(seq)

    def _why_impossible(self, seq: Sequence) -> str | None:
        cfg = self.config
        prompt_len = seq.num_prompt_tokens
        if prompt_len > cfg.max_model_len:
            return (f"request {seq.request_id!r}: the prompt has {prompt_len} tokens, more than "
                    f"max_model_len={cfg.max_model_len}; shorten the prompt or raise max_model_len")
        if not cfg.enable_chunked_prefill and prompt_len > cfg.max_chunk:
            return (f"request {seq.request_id!r}: the prompt has {prompt_len} tokens, more than one step's "
                    f"budget ({cfg.max_chunk}) with chunked prefill off; enable chunked prefill or raise "
                    f"max_num_batched_tokens")
        for a, b in seq.atomic_spans:
            if b - a > cfg.max_chunk:
                return (f"request {seq.request_id!r}: an image block of {b - a} tokens must be computed in one "
                        f"step, more than its budget ({cfg.max_chunk}); raise max_num_batched_tokens or use "
                        f"images with fewer soft tokens")
        # Tokens whose K/V get written at most: all but the last of the longest possible sequence.
        total = min(prompt_len + seq.params.max_tokens, cfg.max_model_len)
        kv_tokens = max(prompt_len, total - 1)
        needed = self.block_manager.max_pages_needed(kv_tokens, cfg.max_chunk)
        for spec, n in zip(self.block_manager.groups, needed):
            if n > spec.num_pages - 1:
                return (f"request {seq.request_id!r}: needs up to {n} pages of KV group {spec.name!r} "
                        f"({kv_tokens} tokens), the pool has {spec.num_pages - 1}; lower max_tokens or "
                        f"give the KV cache more memory")
        return None

    def abort(self, request_id: str) -> Sequence | None:
        """Finish an unfinished request with finish_reason "abort" and free its pages at once. Returns the
        sequence, or None when no unfinished request has this id."""
        seq = self._unfinished.get(request_id)
        if seq is None:
            return None
        self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End `seq` now: `reason` is "stop" | "length" | "abort" | "error" (e.g. "stop" with the matched stop
        string, from the runner's detokenizer). Removes it from the queues and frees its pages."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {sorted(FINISH_REASONS)}, got {reason!r}")
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self._set_finished(seq, reason, stop_reason)

    def _set_finished(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.status = FINISH_REASONS[reason]
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self._unfinished.pop(seq.request_id, None)

    # -- one step ----------------------------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.spec_tokens.clear()
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running decodes, then running partial prefills, then new admissions (none
        in a step that had to preempt)."""
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        in_step: set[int] = set()
        preempted: list[Sequence] = []
        finished, self._finished_outside_step = self._finished_outside_step, []

        for decodes in (True, False):
            i = 0
            while i < len(self.running) and budget > 0:
                seq = self.running[i]
                remaining = seq.num_new_tokens_to_compute
                if seq.seq_id in in_step or (remaining == 1) != decodes:
                    i += 1
                    continue
                n = _fit_spans(seq, min(remaining, budget, cfg.max_chunk))
                if n == 0:
                    i += 1
                    continue
                if decodes and seq.spec_tokens:   # verify the drafts too, as far as the budget allows
                    del seq.spec_tokens[max(0, min(budget, cfg.max_chunk) - 1):]
                    n = 1 + len(seq.spec_tokens)
                while not bm.allocate(seq, n, ahead=len(seq.spec_tokens) if decodes else 0):
                    if decodes and seq.spec_tokens:   # short of pages: verify no drafts rather than preempt
                        seq.spec_tokens.clear()
                        n = 1
                        continue
                    victim = next(s for s in reversed(self.running) if s.seq_id not in in_step)
                    if victim is seq and len(self.running) == 1:
                        # Alone and still short of pages: cannot happen for requests that passed add().
                        seq.error = (f"request {seq.request_id!r}: out of KV pages with no other sequence to "
                                     f"preempt ({seq.num_tokens} tokens)")
                        self.finish(seq, "error")
                        finished.append(seq)
                        break
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        break
                else:
                    scheduled.append(ScheduledSeq(seq, n))
                    in_step.add(seq.seq_id)
                    budget -= n
                    i += 1

        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and not preempted:
            seq = self.waiting[0]
            bm.match_prefix(seq)
            remaining = seq.num_new_tokens_to_compute
            chunkable = cfg.enable_chunked_prefill or seq.num_preemptions > 0
            n = _fit_spans(seq, min(remaining, budget, cfg.max_chunk))
            if n == 0 or (n < remaining and not chunkable) or not bm.allocate(seq, n):
                bm.free(seq)  # undo the prefix match; retry next step
                seq.num_computed_tokens = seq.num_cached_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            in_step.add(seq.seq_id)
            budget -= n
            if seq.num_preemptions == 0:
                self.num_prompt_tokens_admitted += seq.num_prompt_tokens
                self.num_prefix_cache_hit_tokens += seq.num_cached_tokens

        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # stable: decodes first
        return SchedulerOutput(scheduled=scheduled, preempted=preempted, finished=finished)

    def schedule_lookahead(self, prev: list[ScheduledSeq]) -> list[ScheduledSeq] | None:
        """`schedule_ahead` for a one-step lookahead after a one-step `prev`: its entries, or None."""
        ahead = self.schedule_ahead(prev, 1, 1)
        return None if ahead is None else ahead[0]

    def schedule_ahead(self, prev: list[ScheduledSeq], prev_steps: int = 1,
                       max_steps: int = 1) -> tuple[list[ScheduledSeq], int] | None:
        """The next step's work while step `prev` is still on the device, or None when it cannot be known yet:
        (entries, k), k decode steps of every entry (1 <= k <= max_steps) to run in one program.

        Known only in the steady decode state: every entry of `prev` samples a token, every running sequence is
        in `prev`, and no waiting request could be admitted. `prev` samples `prev_steps` tokens per sequence
        (a multi-step program; 1 for a plain step), not appended yet. Each sequence of `prev` that will not reach
        max_tokens / max_model_len with them decodes next: (seq, 1) at position seq.num_tokens + prev_steps - 1
        (prev's last token), then k - 1 more positions, its pages allocated ahead. k is the most steps no entry
        can go past its max_tokens / max_model_len in, capped at max_steps. The input token is the device result
        of `prev` (the engine feeds it on device); a sequence that stops within prev's tokens is skipped by
        update_after_step, its result discarded, and so are the tokens after the one it stops on. Allocation
        never preempts: out of pages for k steps this plans the most steps the free pages cover for every entry
        (counted before any is taken); out of pages for one, it returns None, allocating nothing, and the engine
        schedules normally once `prev` is done."""
        cfg, bm = self.config, self.block_manager
        if prev_steps < 1 or max_steps < 1:
            raise ValueError(f"schedule_ahead: prev_steps and max_steps must be >= 1, got {prev_steps}, {max_steps}")
        if not prev or self._finished_outside_step or (self.waiting and len(self.running) < cfg.max_num_seqs):
            return None
        ids = {s.seq.seq_id for s in prev}
        if any(not s.samples for s in prev) or any(seq.seq_id not in ids for seq in self.running):
            return None
        room = {}
        for seq, _ in prev:
            if seq.status != SequenceStatus.RUNNING:
                continue
            r = min(seq.params.max_tokens - seq.num_output_tokens, cfg.max_model_len - seq.num_tokens) - prev_steps
            if r > 0:   # else it stops by length on one of prev's tokens
                room[seq.seq_id] = (seq, r)
        if not room:
            return None
        k = min(max_steps, min(r for _, r in room.values()))
        seqs = [seq for seq, _ in room.values()]

        def args(seq, steps):  # (seq, tokens to allocate, ahead) for pages through the steps-th position
            return seq, seq.num_tokens + prev_steps - 1 + steps - seq.num_computed_tokens, prev_steps - 1 + steps

        free = [bm.num_free_pages(g) for g in range(len(bm.groups))]
        for steps in range(k, 0, -1):   # short of pages for k steps: the most that fit (counted before taking any)
            need = [sum(col) for col in zip(*(bm.new_pages(*args(seq, steps)) for seq in seqs))]
            if all(n <= f for n, f in zip(need, free)):
                for seq in seqs:
                    if not bm.allocate(*args(seq, steps)):
                        raise RuntimeError(f"schedule_ahead: {seq!r} got no pages for {steps} steps after they "
                                           f"were counted free")
                return [ScheduledSeq(seq, 1) for seq in seqs], steps
        return None

    def update_after_step(self, scheduled: SchedulerOutput | list[ScheduledSeq] | list[tuple[Sequence, int]],
                          sampled_token_ids: dict[int, int | None], steps: int = 1) -> list[Sequence]:
        """Record a finished step: advance num_computed_tokens, append the sampled token of every sequence
        whose known tokens are now all computed (partial prefill chunks sample nothing), stop sequences on
        EOS / stop_token_ids (not before min_tokens), max_tokens or max_model_len, free finished ones and
        release pages that left the sliding window.

        Args:
          scheduled: the SchedulerOutput (or its `scheduled` list) of the step.
          sampled_token_ids: seq_id -> sampled token (None or absent for partial prefills), or for a sequence that
            verified drafts, the list of its new tokens: the accepted drafts, then the token sampled after them.
        Returns:
          the sequences that finished in this step.
        """
        if isinstance(scheduled, SchedulerOutput):
            scheduled = scheduled.scheduled
        bm = self.block_manager
        finished = []
        for seq, n in scheduled:
            if seq.status != SequenceStatus.RUNNING:
                continue  # aborted (or finished by the runner) since schedule()
            num_spec = ScheduledSeq(seq, n).num_spec
            seq.spec_tokens.clear()
            if num_spec:
                n -= num_spec   # the drafts' K/V count once accepted (below); rejected ones are overwritten later
            seq.num_computed_tokens += n
            if seq.num_computed_tokens > seq.num_tokens:
                raise RuntimeError(f"{seq!r}: {n} tokens were scheduled past the end of the sequence")
            if seq.num_computed_tokens < seq.num_tokens:
                bm.cache_full_pages(seq)
                bm.release_out_of_window(seq)
                continue
            tokens = sampled_token_ids.get(seq.seq_id)
            if tokens is None:
                raise ValueError(f"update_after_step: no sampled token for {seq!r}, whose prefill is complete")
            tokens = [tokens] if isinstance(tokens, int) or not hasattr(tokens, "__len__") else list(tokens)
            if len(tokens) > max(1 + num_spec, steps):
                raise ValueError(f"update_after_step: {len(tokens)} new tokens for {seq!r}, which verified "
                                 f"{num_spec} drafts in a step of {steps} decode steps")
            reason = None
            for i, token in enumerate(tokens):
                if i:   # an accepted draft, or a later decode step's token: its K/V were written by this step
                    seq.num_computed_tokens += 1
                seq.append_token(token)
                reason, stop_reason = self._stop_reason(seq, int(token))
                if reason is not None:
                    break
            bm.cache_full_pages(seq)
            if reason is None:
                bm.release_out_of_window(seq)
            else:
                self.finish(seq, reason, stop_reason)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        p = seq.params
        if seq.num_output_tokens > p.min_tokens:
            if token in p.stop_token_ids:
                return "stop", token
            if not p.ignore_eos and token in self.config.eos_token_ids:
                return "stop", None
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length", None
        return None, None
