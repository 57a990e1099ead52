"""One request as the scheduler sees it: token ids, progress, pages and how it ended.

Prompt and output tokens live in one list (`token_ids`), so a chunk of work is always the slice
`token_ids[num_computed_tokens : num_computed_tokens + n]`, whether it is a prompt chunk, a decode step or
the recompute of a preempted request. Page tables are plain per-group lists owned by the BlockManager.
"""

from __future__ import annotations

import enum
import itertools
import time

from gemmajax.engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"  # the client went away / abort()
    FINISHED_ERROR = "finished_error"  # could never run (too long for the model or the page pool)

    @property
    def is_finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


FINISH_REASONS = {
    "stop": SequenceStatus.FINISHED_STOPPED,
    "length": SequenceStatus.FINISHED_LENGTH,
    "abort": SequenceStatus.FINISHED_ABORTED,
    "error": SequenceStatus.FINISHED_ERROR,
}


class Sequence:
    """A request in the engine (compared and hashed by identity).

    Attributes:
      request_id: the caller's id (unique among unfinished sequences of one scheduler).
      token_ids: prompt token ids followed by the output token ids.
      num_prompt_tokens: how many of `token_ids` are the prompt.
      params: sampling settings.
      seq_id: engine-wide unique int, the key of `sampled_token_ids` dicts.
      status: WAITING / RUNNING / FINISHED_*.
      num_computed_tokens: tokens whose K/V are in the cache (the next position to compute).
      num_cached_tokens: of those, how many came from the prefix cache at the last admission.
      page_tables: per KV group, the physical page of each logical page (0 = null page: released or unused).
      finish_reason: "stop" | "length" | "abort" | "error" once finished.
      stop_reason: the stop token id or stop string that ended it (None for EOS and other reasons).
      error: a message for people when finish_reason == "error".
      arrival_time: time.monotonic() at creation unless given.
      num_preemptions: how often the sequence was preempted (and recomputed).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                 arrival_time: float | None = None) -> None:
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt must hold at least one token, got none")
        self.request_id = request_id
        self.token_ids: list[int] = prompt
        self.num_prompt_tokens = len(prompt)
        self.params = params if params is not None else SamplingParams()
        self.seq_id: int = next(_seq_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.page_tables: list[list[int]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.num_preemptions = 0
        # BlockManager bookkeeping: per group, logical pages already offered to the prefix cache and pages
        # already released by the sliding window; per page size, the chained hashes of the full pages so far.
        self.num_hashed_pages: list[int] = []
        self.num_released_pages: list[int] = []
        self.page_hashes: dict[int, list[bytes]] = {}
        # Speculative decoding: tokens drafted after token_ids, verified by the next step (never in token_ids
        # until accepted, so preemption, prefix hashes and stop checks only ever see real tokens).
        self.spec_tokens: list[int] = []
        # Image / audio soft tokens: the prefix cache hashes these values in place of the placeholder ids (so a
        # page holding an image is found only for the same image), and spans [start, end) of positions computed
        # in one step (an image block whose tokens attend to each other).
        self.hash_overrides: dict[int, int] = {}
        self.atomic_spans: list[tuple[int, int]] = []

    # -- token views -------------------------------------------------------------------------------------
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output tokens (the live list: do not mutate)."""
        return self.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_new_tokens_to_compute(self) -> int:
        """Tokens whose K/V are not yet written: the whole prompt at first, then 1 per decode step."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

    def banned_token_ids(self, eos_token_ids: tuple[int, ...] | list[int] = ()) -> list[int]:
        """Token ids the sampler must not pick for the next token: the stop ids (and EOS unless
        ignore_eos) while fewer than `params.min_tokens` tokens were generated; else none."""
        if self.num_output_tokens >= self.params.min_tokens:
            return []
        ids = list(self.params.stop_token_ids or [])
        if not self.params.ignore_eos:
            ids += [t for t in eos_token_ids if t not in ids]
        return ids

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request_id={self.request_id!r}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")
