"""LLMEngine: the synchronous serving loop (schedule -> build batch -> device step -> sample -> update).

It owns the scheduler, the block manager, the model runner and one incremental detokenizer per request, and
turns each step into `RequestOutput`s. The offline `LLM` and the server's async client both drive it.
Stop strings are checked here, on the detokenized text, so a request stops (and frees its pages) at once.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from gemmajax.config import ModelConfig
from gemmajax.engine import media_inputs
from gemmajax.engine.block_manager import BlockManager, KVGroupSpec
from gemmajax.engine.cpu_malloc import huge_pages, keep_freed_memory
from gemmajax.engine.runner import ModelRunner, RunnerSpec, build_step_inputs, bucket, kv_groups, plan_pages, \
    pow2_buckets, stack_layers, step_shapes, token_buckets
from gemmajax.engine.sample_batch import SamplerBatch, plain_greedy, sample_step
from gemmajax.engine.sampler import fold_keys, request_key_data, sample, sampling_arrays
from gemmajax.engine.sampling_params import SamplingParams
from gemmajax.engine.scheduler import Scheduler, SchedulerConfig
from gemmajax.engine.sequence import Sequence, SequenceStatus
from gemmajax.engine.media_inputs import MediaState
from gemmajax.engine.spec_decode import Drafter, SpecConfig, accepted_tokens, ngram_propose
from gemmajax.engine.thinking import ThoughtTracker
from gemmajax.kv.layout import resolve_auto
from gemmajax.model import gemma
from gemmajax.quant.array import int4_words_tree

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one request produced so far (or in total, once finished)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    delta_text: str
    text: str
    finished: bool
    finish_reason: str | None          # "stop" | "length" | "abort" | "error" | None
    logprobs: list[dict] | None = None  # per new token: {"token_id", "logprob", "top": [(id, logprob), ...]}
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    num_reasoning_tokens: int = 0       # output tokens inside thought channels so far


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    page_size: int = 32
    kv_dtype: str = "auto"                  # "auto" = the model's dtype; "bf16" / "float32" / "fp8_e5m2" / "fp8_e4m3"
    kv_cache_memory: int = 2 << 30          # bytes for all KV pages
    enable_prefix_caching: bool = True
    attn_impl: str = "auto"
    seed: int = 0
    token_buckets: tuple[int, ...] | None = None   # step token counts compiled for (default: runner.token_buckets)
    async_scheduling: bool = True                  # dispatch decode step N+1 before reading step N's tokens
    # With async_scheduling, a lookahead of plain-greedy decodes runs up to this many decode steps in one device
    # program (vLLM's name; runner.model_decode_steps), so the host schedules, dispatches and reads once per
    # program. Tokens then arrive in bursts of up to this many, and a request that arrives meanwhile waits for the
    # program to end. 1 = one step a program.
    num_scheduler_steps: int = 8
    seq_buckets: tuple[int, ...] | None = None     # step sequence counts compiled for (default: powers of 2)
    speculative: SpecConfig | None = None          # speculative decoding (engine/spec_decode.py)
    parallel: Any = None                           # gemmajax.parallel.ShardPlan: caches split on its mesh (LLM)
    # Quantized projections and norms stacked over the layers (runner.stack_layers: fewer jit arguments a step);
    # None = on XLA:CPU without a parallel plan
    stack_layers: bool | None = None
    # q / k / v and gate / up projections each joined into one weight (gemma.fuse_projections: fewer, larger matmuls
    # a step); None = on XLA:CPU without a parallel plan, where it was measured. True with a plan is an error.
    fuse_projections: bool | None = None


@dataclass
class _Pending:
    """A step on the device: what was scheduled and where its result (tokens or logits) will be."""

    scheduled: list                 # ScheduledSeq entries, in row order
    samples: list[bool]             # per entry: the step samples its next token
    s_pad: int
    greedy: bool                    # result: tokens [R_pad] (argmax in the step) | logits [R_pad, V]
    result: Any
    drafts: list[list[int]] = field(default_factory=list)   # per entry: the drafted tokens it verifies
    masks: list = field(default_factory=list)              # per entry: grammar masks of its k + 1 rows, or None
    hidden: Any = None                                     # [R_pad, D] final-normed hidden of the rows (drafter)
    steps: int = 1          # decode steps the program runs; > 1 or `last` set: result is tokens [max_steps, R_pad]
    last: Any = None        # a decode-steps program's last step's tokens [R_pad]

    @property
    def next_input(self) -> Any:
        """Tokens [R_pad] a lookahead step after this one takes as its input: the last step's."""
        return self.result if self.last is None else self.last

    @property
    def rows(self) -> list[int]:
        """Entries that sample."""
        return [i for i, ok in enumerate(self.samples) if ok]

    @property
    def first_rows(self) -> list[int]:
        """Per entry, its first logits row (an entry has 1 + len(drafts) rows)."""
        return np.cumsum([0] + [1 + len(d) for d in self.drafts[:-1]]).tolist() if self.drafts else \
            list(range(len(self.scheduled)))


@jax.jit
def _take(tokens: jax.Array, src: np.ndarray) -> jax.Array:
    """A lookahead step's input token ids, gathered on device from the previous step's sampled tokens."""
    return tokens[src]


@dataclass
class _ReqState:
    seq: Sequence
    detok: Any
    text: str = ""                                    # the output's text so far (held-back characters included)
    sent_chars: int = 0                               # characters of it already emitted
    sent_tokens: int = 0
    constraint: Any = None
    logprobs: list = field(default_factory=list)
    thought: ThoughtTracker | None = None
    spec_masks: list = field(default_factory=list)   # grammar masks of the drafts being verified
    media: MediaState | None = None                   # images / audio of the prompt
    draft_hidden: np.ndarray | None = None            # the target's hidden state before the newest token (drafter)

    def forced_token(self) -> int | None:
        """The token the next sample must be, if any: `<channel|>` once the thought is at its budget (unless the
        grammar does not allow it yet, e.g. before its `thought\n` label: the grammar leads there)."""
        t = self.thought
        if t is None or not t.must_close():
            return None
        if self.constraint is not None and not self.constraint.allowed_mask()[t.close_id]:
            return None
        return t.close_id


class LLMEngine:
    def __init__(self, cfg: ModelConfig, weights: gemma.Weights, tokenizer, config: EngineConfig = EngineConfig(),
                 multimodal: tuple | None = None):
        """multimodal: (MultimodalConfig, MultimodalWeights) of the checkpoint's vision / audio towers, or None."""
        if not isinstance(config.num_scheduler_steps, int) or config.num_scheduler_steps < 1:
            raise ValueError(f"EngineConfig.num_scheduler_steps must be an int >= 1 (decode steps one device "
                             f"program may run), got {config.num_scheduler_steps!r}")
        if config.stack_layers and config.parallel is not None:
            raise ValueError("EngineConfig.stack_layers=True with a parallel plan: the plan shards the weights by "
                             "their per-layer names, which a stacked tree does not have; leave stack_layers None "
                             "(off with a plan) or set it False")
        if config.fuse_projections and config.parallel is not None:
            raise ValueError("EngineConfig.fuse_projections=True with a parallel plan: the plan splits q, k, v, gate "
                             "and up by their own names and heads, which a joined weight does not have; leave "
                             "fuse_projections None (off with a plan) or set it False")
        if jax.default_backend() == "cpu":
            keep_freed_memory()  # steady step times: the step's temporaries are not page-faulted in every step
        self.model_config = cfg
        self.mm_config, self.mm_weights = multimodal if multimodal is not None else (None, None)
        config = dataclasses.replace(config, kv_dtype=resolve_auto(config.kv_dtype, gemma.compute_dtype(weights)))
        self.config = config
        self.tokenizer = tokenizer
        max_len = min(config.max_model_len, cfg.max_position_embeddings)
        self.max_model_len = max_len
        groups = kv_groups(cfg)
        num_pages = plan_pages(cfg, page_size=config.page_size, kv_dtype=config.kv_dtype, max_model_len=max_len,
                               max_num_seqs=config.max_num_seqs,
                               max_num_batched_tokens=config.max_num_batched_tokens,
                               kv_cache_memory=config.kv_cache_memory)
        spec_cfg = SpecConfig.parse(config.speculative)
        self.spec = RunnerSpec(cfg, groups, config.page_size, num_pages, math.ceil(max_len / config.page_size),
                               config.kv_dtype, attn_impl=config.attn_impl,
                               bits=jax.default_backend() == "cpu" and config.attn_impl in ("auto", "ref"),
                               block_mode="all" if self.mm_config is not None and self.mm_config.unified else "sliding",
                               plan=config.parallel,
                               row_q_max=1 + spec_cfg.num_speculative_tokens if spec_cfg is not None else 1)
        self.drafter = None
        if spec_cfg is not None and spec_cfg.method == "draft_model":
            self.drafter = Drafter(spec_cfg.model, cfg, str(gemma.compute_dtype(weights)), groups)
        windows = {}
        for s in cfg.layers:
            if s.window is not None:   # a drafter reads 2 positions more of the target's sliding K/V
                windows[s.kind] = max(windows.get(s.kind, 0), s.window + (2 if self.drafter is not None else 0))
        self.block_manager = BlockManager(
            [KVGroupSpec(name=g, num_pages=n, page_size=config.page_size, window=windows.get(g))
             for g, n in zip(groups, num_pages)], enable_prefix_caching=config.enable_prefix_caching)
        eos = set(cfg.eos_token_ids) | set(getattr(tokenizer, "stop_ids", ()) or ())
        self.eos_token_ids = tuple(sorted(eos))
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_len, eos_token_ids=self.eos_token_ids), self.block_manager)
        cpu_alone = jax.default_backend() == "cpu" and config.parallel is None
        stack = cpu_alone if config.stack_layers is None else config.stack_layers
        if cpu_alone if config.fuse_projections is None else config.fuse_projections:
            weights = gemma.fuse_projections(weights)
        if cpu_alone:
            # the CPU's int4 layout: faster one-row and tile forms (quant/array); the per-layer-embedding table is only
            # gathered from, so it keeps its bytes
            words = int4_words_tree(dataclasses.replace(weights, ple_table=None))
            weights = dataclasses.replace(words, ple_table=weights.ple_table)
        self.runner = ModelRunner(stack_layers(weights) if stack else weights, self.spec)
        if cpu_alone:  # every step streams the weights: 2 MiB pages, far fewer page walks (cpu_malloc.huge_pages)
            huge_pages((self.runner.weights, self.runner.kv))
        logger.info(self.kv_summary())
        self.t_buckets = config.token_buckets or token_buckets(16, config.max_num_batched_tokens,
                                                                dense=jax.default_backend() == "cpu")
        self.s_buckets = config.seq_buckets or pow2_buckets(1, config.max_num_seqs)
        self._reqs: dict[str, _ReqState] = {}
        self._held: dict[str, list[Sequence]] = {}   # parent request id -> siblings waiting for its prompt's pages
        self._unseeded = np.random.default_rng(config.seed)   # seeds of unseeded requests: this engine's alone
        self.stats_counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "preemptions": 0,
                               "lookahead_steps": 0, "multi_steps": 0}
        self._inflight: _Pending | None = None   # a dispatched lookahead step whose tokens are not read yet
        self.spec_config = SpecConfig.parse(config.speculative)
        self.spec_stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}

    def kv_summary(self) -> str:
        """KV bytes per token and per sequence, and pages per group (sliding layers windowed, shared layers free)."""
        cfg, spec = self.model_config, self.spec
        item = spec.layouts()[0].bytes_per_page() / (spec.page_size * 2 * cfg.layers[cfg.kv_layers[0]].num_kv_heads
                                                      * cfg.layers[cfg.kv_layers[0]].head_dim)
        L = self.max_model_len
        ours = cfg.kv_bytes_per_token(item, windowed=True, context=L)
        flat = sum(2 * s.num_kv_heads * s.head_dim * item for s in cfg.layers)  # every layer, full context
        pages = ", ".join(f"{g}: {n - 1} pages of {b / 1024:.0f} KiB" for g, n, b in
                          zip(spec.groups, spec.num_pages, spec.page_bytes()))
        return (f"KV cache {spec.cache_bytes() / 2**20:.1f} MiB ({spec.kv_dtype}; {pages}); "
                f"{ours / 1024:.1f} KiB/token at {L} tokens ({ours * L / 2**20:.1f} MiB per full-length sequence) vs "
                f"{flat / 1024:.1f} KiB/token with every layer caching the full context")

    def step_shapes(self) -> list[tuple[int, int, bool]]:
        """Every (tokens, sequences, decode_only) shape a step of this engine can take (runner.step_shapes)."""
        return step_shapes(self.s_buckets, self.t_buckets)

    def precompile(self, greedy_only: bool = False) -> float:
        """Compile (and run once, on padding) the step of every shape in `step_shapes`, so no request waits for a
        compile later; with the persistent compilation cache a restart mostly loads them. Both step variants
        (greedy tokens, a decode-steps program for decode-only shapes when num_scheduler_steps > 1, and full
        logits) unless greedy_only; a decode-only shape's greedy one also as a lookahead calls it (its token ids
        on the device). Nothing is written: every slot of a padding step is
        skipped. Returns the seconds it took."""
        if self.has_unfinished():
            raise RuntimeError("precompile() must run before any request is added")
        t0 = time.perf_counter()
        shapes = self.step_shapes()
        for i, (t_pad, s_pad, dec) in enumerate(shapes):
            inp = build_step_inputs(self.spec, [], t_pad, s_pad)
            inp = dataclasses.replace(inp, metas=tuple(dataclasses.replace(m, decode_only=dec) for m in inp.metas))
            if dec and self._decode_steps_program():
                def greedy(x):
                    return self.runner.forward_decode_steps(x, 1, self.config.num_scheduler_steps)[1]
            else:
                greedy = self.runner.forward_greedy
            outs = [greedy(inp)] + ([] if greedy_only else [self.runner.forward(inp)])
            if dec:   # as a lookahead step takes its token ids: a device array, the previous step's tokens
                outs.append(greedy(dataclasses.replace(inp, token_ids=_take(outs[0], np.zeros(t_pad, np.int32)))))
            jax.block_until_ready(outs)
            logger.info("precompiled step %d/%d: %d tokens, %d sequences%s", i + 1, len(shapes), t_pad, s_pad,
                        " (decode)" if dec else "")
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    after: str | None = None, media: list | None = None) -> None:
        """Queue one generation (params.n must be 1: callers run n requests, see LLM.generate).

        after: the id of a request with the same prompt (a sibling choice of an n > 1 request). With prefix
        caching on, this one waits until that request's prompt is computed and then starts from its cached pages,
        so n choices compute the prompt once.
        media: processed images / audio clips (gemmajax.tools.media) in prompt order, whose soft-token
        placeholders the prompt holds (expanded: `<|image>` + `<|image|>` x N + `<image|>`)."""
        from gemmajax.tools.detokenizer import IncrementalDetokenizer
        if params.n != 1:
            raise ValueError(f"request {request_id!r}: LLMEngine.add_request takes SamplingParams.n == 1, got "
                             f"{params.n}; add n requests (LLM.generate and the server do)")
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty (0 tokens)")
        if request_id in self._reqs:
            raise ValueError(f"request_id {request_id!r} is already queued or running")
        V = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < V]
        if bad:
            raise ValueError(f"request {request_id!r}: prompt token ids must be in [0, {V}), got {bad[:5]}")
        seq = Sequence(request_id, list(map(int, prompt_token_ids)), params)
        seq.sample_seed = int(self._unseeded.integers(2**63)) if params.seed is None else int(params.seed)
        ms = None
        if media:
            if self.mm_config is None or self.mm_weights is None:
                raise ValueError(f"request {request_id!r}: {len(media)} image / audio input(s), but this checkpoint "
                                 f"has no vision or audio tower")
            ms = media_inputs.media_state(seq.token_ids, media, self.mm_config)
            seq.hash_overrides = media_inputs.hash_overrides(ms)
            seq.atomic_spans = media_inputs.atomic_spans(ms)
        constraint = None
        grammar = params.grammar
        if grammar is None and params.json_schema is not None:
            from gemmajax.engine.chat import chat_grammar
            grammar, _ = chat_grammar(json_schema=params.json_schema)
        if grammar is not None:
            from gemmajax.tools.constrained import GrammarConstraint, make_ll_tokenizer
            if not hasattr(self, "_ll_tok"):
                self._ll_tok = make_ll_tokenizer(self.tokenizer)
            constraint = GrammarConstraint(self._ll_tok, grammar)
        st = _ReqState(seq, IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens),
                       constraint=constraint,
                       thought=ThoughtTracker.for_request(self.tokenizer, seq.token_ids, params.thinking_token_budget),
                       media=ms)
        parent = self._reqs.get(after) if after is not None else None
        if (parent is not None and self.config.enable_prefix_caching and not parent.seq.is_finished
                and parent.seq.prompt_token_ids == seq.prompt_token_ids):
            self._held.setdefault(after, []).append(seq)
        else:
            self.scheduler.add(seq)
        self._reqs[request_id] = st
        self.stats_counters["prompt_tokens"] += len(prompt_token_ids)

    def _release_held(self) -> None:
        """Queue the siblings whose parent computed its prompt (its full pages are now prefix-cache hits), or
        finished without doing so."""
        for parent_id in list(self._held):
            p = self._reqs.get(parent_id)
            if p is None or p.seq.is_finished or p.seq.num_computed_tokens >= p.seq.num_prompt_tokens:
                for seq in self._held.pop(parent_id):
                    self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        for held in self._held.values():
            for seq in held:
                if seq.request_id == request_id:
                    held.remove(seq)
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED_ABORTED, "abort"
                    return
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or self._inflight is not None or bool(self._held)
                or any(st.seq.is_finished for st in self._reqs.values()))

    def stats(self) -> dict:
        return {"num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
                "kv_cache_usage": self.block_manager.usage(), **self.stats_counters}

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one step and return what it produced. With `async_scheduling`, a plain-greedy decode step is
        dispatched before the previous one's tokens are read (its token ids are the previous step's device
        result), so the host's scheduling, input building and dispatch overlap the device's work. A step's outputs
        are returned by the call that waits for its tokens (the one that dispatched the step after it)."""
        try:
            return self._step()
        except BaseException:
            self._inflight = None   # its results are lost with the failed step; the caller aborts the requests
            raise

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        pending = self._inflight
        self._inflight = None
        if pending is None:
            self._release_held()
            if self.spec_config is not None:
                self._propose()
            sched = self.scheduler.schedule()
            self.stats_counters["preemptions"] = self.scheduler.num_preemptions
            for seq in sched.finished:
                outputs.append(self._finish_output(seq))
            if not sched.scheduled:
                return outputs + self._flush_finished()
            pending = self._dispatch(sched.scheduled)
        k = self._lookahead_steps(pending) if self.config.async_scheduling and self.spec_config is None \
            and pending.greedy and all(pending.samples) and not self._held else 0
        if k:
            ahead = self.scheduler.schedule_ahead(pending.scheduled, pending.steps, k)
            if ahead is not None:
                self._inflight = self._dispatch(ahead[0], prev=pending, steps=ahead[1])
                self.stats_counters["lookahead_steps"] += 1
                self.stats_counters["multi_steps"] += ahead[1] > 1
        outputs += self._complete(pending)
        if self._inflight is not None and not any(s.seq.status == SequenceStatus.RUNNING
                                                  for s in self._inflight.scheduled):
            self._inflight = None   # every sequence in it stopped on pending's token: nothing to read
        return outputs

    def _lookahead_steps(self, pending: _Pending) -> int:
        """How many decode steps a lookahead after `pending` may run (0: none): the most, up to
        num_scheduler_steps (1 unless the decode-steps program is in use), for which no host decision is due on
        any of its sequences' tokens, pending's included (a forced end of thought)."""
        k = self.config.num_scheduler_steps if self._decode_steps_program() else 1
        for e in pending.scheduled:
            st = self._reqs.get(e.seq.request_id)
            if st is None or st.seq is not e.seq or st.thought is None:
                continue
            while k and not st.thought.safe_to_look_ahead(pending.steps + k):
                k -= 1
        return k

    def _decode_steps_program(self) -> bool:
        """Plain-greedy decode-only steps run as `runner.model_decode_steps` (one program, 1 or more steps): only
        where programs of several steps can run (async scheduling, no speculative decoding)."""
        return self.config.num_scheduler_steps > 1 and self.config.async_scheduling and self.spec_config is None

    def _dispatch(self, scheduled: list, prev: _Pending | None = None, steps: int = 1) -> _Pending:
        """Build the step's inputs and start it on the device (nothing here waits for the device).

        prev: the step still running whose (last) sampled tokens are this step's input tokens (a lookahead step:
        one decode token per sequence, each sequence in prev's batch). steps: decode steps to run in one program
        (a lookahead's, `Scheduler.schedule_ahead`)."""
        entries, drafts, masks, media = [], [], [], []
        for e in scheduled:
            seq, n = e
            c = seq.num_computed_tokens
            if prev is None:   # a verifying decode computes its last token and its drafts
                d = seq.spec_tokens[:e.num_spec]
                ids = (seq.token_ids + d)[c:c + n]
                st = self._reqs.get(seq.request_id)
                ms = st.media if st is not None and media_inputs.covers(st.media, c) else None
                if ms is not None:   # the model sees the pad id at placeholders (HF), the soft token replaces it
                    ids = [self.mm_config.pad_token_id if c + j in seq.hash_overrides else t for j, t in
                           enumerate(ids)]
                media.append((ms, c, n))
                entries.append((ids, c, n, [list(pt) for pt in seq.page_tables], 1 + len(d)))
                st = self._reqs.get(seq.request_id)
                masks.append(st.spec_masks[:1 + len(d)] if d and st is not None and st.constraint is not None
                             else None)
                drafts.append(d)
            else:  # the last token prev is sampling, at position seq.num_tokens + prev.steps - 1
                entries.append(([0], seq.num_tokens + prev.steps - 1, 1, [list(pt) for pt in seq.page_tables]))
        T = sum(n for _, n in scheduled)
        S = len(scheduled)
        R = S + sum(len(d) for d in drafts)
        s_pad = bucket(S, self.s_buckets)
        # an all-decode step is padded to its sequence bucket (one token each), a mixed one to a token bucket
        t_pad = s_pad if T == S else max(bucket(T, self.t_buckets), s_pad)
        r_pad = s_pad if R == S else max(bucket(R, self.t_buckets), s_pad)
        inp = build_step_inputs(self.spec, entries, t_pad, s_pad, r_pad)
        if any(ms is not None for ms, _, _ in media):
            inp = self._with_soft_tokens(inp, media, t_pad)
        if prev is not None:
            row = {s.seq.seq_id: i for i, s in enumerate(prev.scheduled)}
            src = np.zeros(t_pad, np.int32)
            src[:S] = [row[s.seq.seq_id] for s in scheduled]
            inp = dataclasses.replace(inp, token_ids=_take(prev.next_input, src))
        samples = [s.samples if prev is None else True for s in scheduled]
        seqs = [s.seq for s, ok in zip(scheduled, samples) if ok]
        states = [self._reqs[s.request_id] for s in seqs]
        greedy = prev is not None or plain_greedy(seqs, [st.constraint for st in states], self.eos_token_ids,
                                                  [st.forced_token() for st in states])
        want_h = self.drafter is not None
        if greedy and R == T == S and t_pad == s_pad and self._decode_steps_program() and inp.soft_mask is None \
                and inp.block_lo is None:   # (soft tokens and image blocks are one step's own)
            result, last = self.runner.forward_decode_steps(inp, steps, self.config.num_scheduler_steps)
            return _Pending(list(scheduled), samples, s_pad, greedy, result, steps=steps, last=last)
        if steps != 1:
            raise ValueError(f"_dispatch: {steps} decode steps asked of a step that is not a plain-greedy decode")
        # greedy: argmax inside the step, no [S, V] float32 logits, no sampler dispatch (same tokens as the sampler)
        result = (self.runner.forward_greedy if greedy else self.runner.forward)(inp, hidden=want_h)
        hidden = None
        if want_h:
            result, hidden = result
        return _Pending(list(scheduled), samples, s_pad, greedy, result, drafts if R > S else [], masks, hidden)

    def _with_soft_tokens(self, inp, media: list, t_pad: int):
        """The step's image / audio rows (media_inputs.step_inputs), encoding the media of requests seen for the
        first time (all of this step's together)."""
        media_inputs.encode([ms for ms, _, _ in media if ms is not None], self.mm_weights, self.mm_config,
                            gemma.compute_dtype(self.runner.weights))
        arrays = media_inputs.step_inputs(media, t_pad, self.model_config.hidden_size,
                                          gemma.compute_dtype(self.runner.weights), self.mm_config.bidirectional_vision)
        if arrays is None:
            return inp
        mask, rows, lo, hi = arrays
        return dataclasses.replace(inp, soft_mask=mask, soft_rows=rows, block_lo=lo, block_hi=hi)

    def _complete(self, p: _Pending) -> list[RequestOutput]:
        """Wait for a dispatched step's tokens, then update the scheduler and emit the outputs."""
        outputs: list[RequestOutput] = []
        sched = p.scheduled
        sampled: dict[int, int | list[int]] = {}
        lp_rows: dict[int, dict] = {}
        first = p.first_rows
        verifying = [i for i in p.rows if p.drafts and p.drafts[i]]
        plain = [i for i in p.rows if not (p.drafts and p.drafts[i])]
        if p.greedy and p.last is not None:   # a decode-steps program: row j holds step j's tokens
            toks_all = np.asarray(p.result)[:p.steps]
            for i in plain:
                sampled[sched[i].seq.seq_id] = toks_all[:, first[i]].tolist()
        elif p.greedy:
            toks_all = np.asarray(p.result)
            for i in plain:
                sampled[sched[i].seq.seq_id] = int(toks_all[first[i]])
            for i in verifying:
                d = p.drafts[i]
                sampled[sched[i].seq.seq_id] = self._accept(d, toks_all[first[i]:first[i] + 1 + len(d)])
        else:
            if plain:
                toks, lps = self._sample(p.result, [sched[i].seq for i in plain], [first[i] for i in plain])
                for j, i in enumerate(plain):
                    seq = sched[i].seq
                    sampled[seq.seq_id] = int(toks[j])
                    if lps is not None:
                        lp_rows[seq.seq_id] = lps[j]
            if verifying:
                toks = self._verify(p, verifying, first)
                for i in verifying:
                    d, r = p.drafts[i], first[i]
                    sampled[sched[i].seq.seq_id] = self._accept(d, toks[r:r + 1 + len(d)])
        if p.hidden is not None:   # the drafter's next input: the hidden state of the row that gave the newest token
            h = np.asarray(p.hidden, np.float32)
            for i in p.rows:
                st = self._reqs.get(sched[i].seq.request_id)
                new = sampled[sched[i].seq.seq_id]
                if st is not None:
                    st.draft_hidden = h[first[i] + (len(new) - 1 if isinstance(new, list) else 0)]
        self.scheduler.update_after_step(sched, sampled, steps=p.steps)
        self.stats_counters["steps"] += 1
        for seq, _ in sched:
            if seq.seq_id not in sampled:
                continue
            st = self._reqs.get(seq.request_id)
            if st is None or st.seq is not seq or len(seq.output_token_ids) <= st.sent_tokens:
                continue  # gone, or finished before this (lookahead) step's first token was appended
            new = sampled[seq.seq_id]
            new = new[:len(seq.output_token_ids) - st.sent_tokens] if isinstance(new, list) else [new]
            self.stats_counters["generation_tokens"] += len(new)
            thought0 = copy.copy(st.thought) if st.thought is not None and len(new) > 1 else None
            for tok in new:   # several with accepted drafts or decode steps (cut where the sequence stopped)
                if st.thought is not None:
                    st.thought.advance(tok)
                if st.constraint is not None and not st.constraint.is_done():
                    try:
                        st.constraint.advance(tok)
                    except ValueError as e:   # a token its mask did not allow (e.g. a mask with no token of
                        # the model's vocabulary, as with a tokenizer larger than the model): this request fails,
                        # the others in the batch go on
                        logger.warning("request %r: %s", seq.request_id, e)
                        if not seq.is_finished:
                            seq.error = f"request {seq.request_id!r}: {str(e).splitlines()[0]}"
                            self.scheduler.finish(seq, "error")
                        break
                    if st.constraint.is_done() and not seq.is_finished:
                        self.scheduler.finish(seq, "stop")   # the grammar admits nothing more
            if seq.seq_id in lp_rows:
                st.logprobs.append(lp_rows[seq.seq_id])
            appended = len(seq.output_token_ids)
            out = self._emit(st)
            cut = appended - len(seq.output_token_ids)   # tokens after a stop string, dropped by _emit
            if cut > 0:   # count only what the output keeps (generation tokens, usage's reasoning tokens)
                self.stats_counters["generation_tokens"] -= cut
                if thought0 is not None:
                    st.thought = thought0
                    for tok in new[:len(new) - cut]:
                        st.thought.advance(tok)
                    out.num_reasoning_tokens = st.thought.total
            outputs.append(out)
        outputs += self._flush_finished(exclude={o.request_id for o in outputs})
        return outputs

    def _accept(self, drafts: list[int], tokens: np.ndarray) -> list[int]:
        new, m = accepted_tokens(drafts, tokens)
        self.spec_stats["num_drafts"] += 1
        self.spec_stats["num_draft_tokens"] += len(drafts)
        self.spec_stats["num_accepted_tokens"] += m
        return new

    def _verify(self, p: _Pending, entries: list[int], first: list[int]) -> np.ndarray:
        """Sample every row of the verifying entries as if it were a plain decode step: row j of an entry draws
        with the key of output token num_output_tokens + j (and the grammar's mask after j drafts). A draft is
        kept iff it equals that row's token (`accepted_tokens`), so the output is the very sequence plain decoding
        draws with the same keys: exactly the target's distribution, and the same tokens with or without
        drafting. (For a one-hot proposal this is rejection sampling coupled through the shared uniform: a draft
        d is kept with probability p(d), and a rejected row's token is distributed as p without d.)"""
        R = p.result.shape[0]
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        params, seeds, nout = [greedy] * R, [0] * R, [0] * R
        masks = None
        for i in entries:
            seq, d, r = p.scheduled[i].seq, p.drafts[i], first[i]
            for j in range(1 + len(d)):
                params[r + j], seeds[r + j], nout[r + j] = seq.params, seq.sample_seed, seq.num_output_tokens + j
            if p.masks[i] is not None:
                if masks is None:
                    masks = np.ones((R, self.model_config.vocab_size), bool)
                for j, m in enumerate(p.masks[i]):
                    masks[r + j] = False
                    masks[r + j, :len(m)] = m[:self.model_config.vocab_size]
        a = sampling_arrays(params)
        base, data = request_key_data(seeds, nout)
        out = sample(p.result, a["temps"], a["top_ks"], a["top_ps"], a["min_ps"], a["presence"], a["frequency"],
                     a["repetition"], None, None, fold_keys(base, data), masks)
        return np.asarray(out.tokens)

    def _propose(self) -> None:
        """Draft tokens for every decoding sequence that can verify them (engine/spec_decode.py). Not drafted:
        requests with logprobs, penalties, stop strings, min_tokens still to go or a thinking budget (each needs
        the host between two tokens); never past max_tokens or max_model_len."""
        cfg = self.spec_config
        rows = []   # (seq, state, k) of the sequences that draft this step
        for seq in self.scheduler.running:
            seq.spec_tokens = []
            st = self._reqs.get(seq.request_id)
            p = seq.params
            if (st is None or seq.num_new_tokens_to_compute != 1 or p.logprobs is not None or p.uses_penalties
                    or p.stop or seq.num_output_tokens < p.min_tokens or p.thinking_token_budget is not None
                    or (self.drafter is not None and st.draft_hidden is None)):
                continue
            k = min(cfg.num_speculative_tokens, p.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1)
            if k > 0:
                rows.append((seq, st, k))
        if self.drafter is not None and rows:
            k_max = max(k for _, _, k in rows)
            entries = [(seq.last_token_id, seq.num_computed_tokens, [list(pt) for pt in seq.page_tables],
                        st.draft_hidden) for seq, st, _ in rows]
            drafted = self.drafter.draft(self.runner, entries, k_max, bucket(len(rows), self.s_buckets))
        for i, (seq, st, k) in enumerate(rows):
            if self.drafter is not None:
                d = [int(t) for t in drafted[i, :k]]
            else:
                d = ngram_propose(seq.token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            if d and st.constraint is not None:
                d, st.spec_masks = self._grammar_masks(st.constraint, d)
            seq.spec_tokens = d

    def _grammar_masks(self, c, drafts: list[int]) -> tuple[list[int], list[np.ndarray]]:
        """The drafts the grammar allows (cut at the first it forbids) and the grammar's masks at each verified
        row (the k + 1 rows: after 0..k drafts). The matcher is rolled back to where it was."""
        V = self.model_config.vocab_size
        masks, kept = [], 0
        for t in drafts:
            masks.append(c.allowed_mask(V))
            if not masks[-1][t]:
                break
            c.advance(t)
            kept += 1
        else:
            masks.append(c.allowed_mask(V))
        if kept:
            c.rollback(kept)
        return drafts[:kept], masks

    def spec_decode_stats(self) -> dict[str, int]:
        """Cumulative {"num_drafts", "num_draft_tokens", "num_accepted_tokens"} (vLLM's names)."""
        return dict(self.spec_stats)

    def _sample(self, logits: jax.Array, seqs: list[Sequence], rows: list[int]):
        states = [self._reqs[s.request_id] for s in seqs]
        batch = SamplerBatch.build(seqs, rows, logits.shape[0], self.model_config.vocab_size,
                                   [st.constraint for st in states], self.eos_token_ids,
                                   [st.forced_token() for st in states])
        return sample_step(logits, batch)

    def _emit(self, st: _ReqState) -> RequestOutput:
        """The request's output for the tokens appended since the last one. Stop strings are checked token by
        token (a step may append several: drafts, lookahead), also on a sequence that just reached max_tokens (a
        stop string its last token completes still counts, as in vLLM) and on one that ended on a stop token: at
        the first token that completes one the output ends there (later tokens dropped), its text cut right before
        the string (after it with include_stop_str_in_output). Until the request ends, the last (longest stop
        string - 1) characters are held back when the string is cut out, as vLLM does, so no streamed text is
        ever part of a stop string."""
        seq = st.seq
        params = seq.params
        new_ids = seq.output_token_ids[st.sent_tokens:]
        finished = seq.is_finished
        check = bool(params.stop) and seq.finish_reason in (None, "length", "stop")
        new_lps = st.logprobs[-len(new_ids):] if (params.logprobs is not None and new_ids) else None
        keep, hit = len(new_ids), None
        for j, t in enumerate(new_ids):
            piece = st.detok.push(t)
            st.text += piece
            if check and piece:
                hit = _find_stop(st.text, params.stop, len(st.text) - len(piece))
                if hit is not None:
                    keep = j + 1
                    break
        if hit is not None:
            pos, stop = hit
            st.text = st.text[:pos + len(stop) if params.include_stop_str_in_output else pos]
            del seq.token_ids[seq.num_prompt_tokens + st.sent_tokens + keep:]
            if finished:   # at max_tokens or on a stop token: the stop string is what ended it
                seq.finish_reason, seq.stop_reason = "stop", stop
            else:
                self.scheduler.finish(seq, "stop", stop)
            finished = True
        elif finished:
            st.text += st.detok.flush()
        hold = 0
        if params.stop and not params.include_stop_str_in_output and not finished:
            hold = max(len(x) for x in params.stop) - 1
        shown = st.text[:max(len(st.text) - hold, st.sent_chars)]
        delta, st.sent_chars = shown[st.sent_chars:], len(shown)
        new_ids, lps = new_ids[:keep], new_lps[:keep] if new_lps is not None else None
        st.sent_tokens += keep
        out = RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids), list(new_ids), delta,
                            shown, finished, seq.finish_reason if finished else None, lps, seq.num_cached_tokens,
                            seq.stop_reason, getattr(seq, "error", None),
                            st.thought.total if st.thought is not None else 0)
        if finished:
            self._reqs.pop(seq.request_id, None)
        return out

    def _finish_output(self, seq: Sequence) -> RequestOutput:
        self._reqs.pop(seq.request_id, None)
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids), [], "", "", True,
                             seq.finish_reason, None, 0, seq.stop_reason, getattr(seq, "error", None))

    def _flush_finished(self, exclude: set | None = None) -> list[RequestOutput]:
        """Requests finished outside a step (aborts) get their final output."""
        out = []
        for rid, st in list(self._reqs.items()):
            if st.seq.is_finished and (not exclude or rid not in exclude):
                out.append(self._emit(st))
        return out


def _find_stop(text: str, stops: list[str], new_from: int) -> tuple[int, str] | None:
    """Earliest stop string that ends in the new part of `text`."""
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
