"""LLMEngine: the synchronous serving loop (schedule -> build batch -> device step -> sample -> update).

It owns the scheduler, the block manager, the model runner and one incremental detokenizer per request, and
turns each step into `RequestOutput`s. The offline `LLM` and the server's async client both drive it.
Stop strings are checked here, on the detokenized text, so a request stops (and frees its pages) at once.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemmajax.config import ModelConfig
from gemmajax.engine.block_manager import BlockManager, KVGroupSpec
from gemmajax.engine.runner import ModelRunner, RunnerSpec, build_step_inputs, bucket, kv_groups, plan_pages, \
    pow2_buckets, token_buckets
from gemmajax.engine.sample_batch import SamplerBatch, plain_greedy, sample_step, skip_rows
from gemmajax.engine.sampling_params import SamplingParams
from gemmajax.engine.scheduler import Scheduler, SchedulerConfig
from gemmajax.engine.sequence import Sequence, SequenceStatus
from gemmajax.model import gemma

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


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    page_size: int = 32
    kv_dtype: str = "bf16"
    kv_cache_memory: int = 2 << 30          # bytes for all KV pages
    enable_prefix_caching: bool = True
    attn_impl: str = "auto"
    seed: int = 0
    token_buckets: tuple[int, ...] | None = None   # step token counts compiled for (default: runner.token_buckets)
    async_scheduling: bool = True                  # dispatch decode step N+1 before reading step N's tokens
    seq_buckets: tuple[int, ...] | None = None     # step sequence counts compiled for (default: powers of 2)


@dataclass
class _Pending:
    """A step on the device: what was scheduled and where its result (tokens or logits) will be."""

    scheduled: list                 # ScheduledSeq entries, in row order
    samples: list[bool]             # per entry: the step samples its next token
    s_pad: int
    greedy: bool                    # result: tokens [s_pad] (argmax in the step) | logits [s_pad, V]
    result: Any

    @property
    def rows(self) -> list[int]:
        """Entries that sample."""
        return [i for i, ok in enumerate(self.samples) if ok]


@jax.jit
def _take(tokens: jax.Array, src: np.ndarray) -> jax.Array:
    """A lookahead step's input token ids, gathered on device from the previous step's sampled tokens."""
    return tokens[src]


@dataclass
class _ReqState:
    seq: Sequence
    detok: Any
    text: str = ""
    sent_tokens: int = 0
    constraint: Any = None
    logprobs: list = field(default_factory=list)


class LLMEngine:
    def __init__(self, cfg: ModelConfig, weights: gemma.Weights, tokenizer, config: EngineConfig = EngineConfig()):
        self.model_config = cfg
        self.config = config
        self.tokenizer = tokenizer
        max_len = min(config.max_model_len, cfg.max_position_embeddings)
        self.max_model_len = max_len
        groups = kv_groups(cfg)
        num_pages = plan_pages(cfg, page_size=config.page_size, kv_dtype=config.kv_dtype, max_model_len=max_len,
                               max_num_seqs=config.max_num_seqs,
                               max_num_batched_tokens=config.max_num_batched_tokens,
                               kv_cache_memory=config.kv_cache_memory)
        self.spec = RunnerSpec(cfg, groups, config.page_size, num_pages, math.ceil(max_len / config.page_size),
                               config.kv_dtype, attn_impl=config.attn_impl,
                               bits=jax.default_backend() == "cpu" and config.attn_impl in ("auto", "ref"))
        windows = {}
        for s in cfg.layers:
            if s.window is not None:
                windows[s.kind] = max(windows.get(s.kind, 0), s.window)
        self.block_manager = BlockManager(
            [KVGroupSpec(name=g, num_pages=n, page_size=config.page_size, window=windows.get(g))
             for g, n in zip(groups, num_pages)], enable_prefix_caching=config.enable_prefix_caching)
        eos = set(cfg.eos_token_ids) | set(getattr(tokenizer, "stop_ids", ()) or ())
        self.eos_token_ids = tuple(sorted(eos))
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_len, eos_token_ids=self.eos_token_ids), self.block_manager)
        self.runner = ModelRunner(weights, self.spec)
        logger.info(self.kv_summary())
        self.t_buckets = config.token_buckets or token_buckets(16, config.max_num_batched_tokens,
                                                                dense=jax.default_backend() == "cpu")
        self.s_buckets = config.seq_buckets or pow2_buckets(1, config.max_num_seqs)
        self._reqs: dict[str, _ReqState] = {}
        self._seed_counter = itertools.count(config.seed * 1000003)
        self.stats_counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "preemptions": 0,
                               "lookahead_steps": 0}
        self._inflight: _Pending | None = None   # a dispatched lookahead step whose tokens are not read yet

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
        """Every (tokens, sequences, decode_only) shape a step of this engine can take: all-decode steps padded to
        a sequence bucket, and mixed steps padded to max(token bucket, sequence bucket)."""
        shapes = [(s, s, True) for s in self.s_buckets]
        shapes += sorted({(max(t, s), s, False) for s in self.s_buckets for t in self.t_buckets})
        return shapes

    def precompile(self, greedy_only: bool = False) -> float:
        """Compile (and run once, on padding) the step of every shape in `step_shapes`, so no request waits for a
        compile later; with the persistent compilation cache a restart mostly loads them. Both step variants
        (greedy tokens and full logits) unless greedy_only. Nothing is written: every slot of a padding step is
        skipped. Returns the seconds it took."""
        if self.has_unfinished():
            raise RuntimeError("precompile() must run before any request is added")
        t0 = time.perf_counter()
        shapes = self.step_shapes()
        for i, (t_pad, s_pad, dec) in enumerate(shapes):
            inp = build_step_inputs(self.spec, [], t_pad, s_pad)
            inp = dataclasses.replace(inp, metas=tuple(dataclasses.replace(m, decode_only=dec) for m in inp.metas))
            outs = [self.runner.forward_greedy(inp)] + ([] if greedy_only else [self.runner.forward(inp)])
            jax.block_until_ready(outs)
            logger.info("precompiled step %d/%d: %d tokens, %d sequences%s", i + 1, len(shapes), t_pad, s_pad,
                        " (decode)" if dec else "")
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        from gemmajax.tools.detokenizer import IncrementalDetokenizer
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty (0 tokens)")
        V = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < V]
        if bad:
            raise ValueError(f"request {request_id!r}: prompt token ids must be in [0, {V}), got {bad[:5]}")
        seq = Sequence(request_id, list(map(int, prompt_token_ids)), params)
        if params.seed is None:
            seq.sample_seed = next(self._seed_counter)
        else:
            seq.sample_seed = int(params.seed)
        constraint = None
        grammar = getattr(params, "grammar", None)
        if grammar is None and getattr(params, "json_schema", None) is not None:
            from gemmajax.tools.constrained import json_schema_grammar
            grammar = json_schema_grammar(params.json_schema)
        if grammar is not None:
            from gemmajax.tools.constrained import GrammarConstraint, make_ll_tokenizer
            if not hasattr(self, "_ll_tok"):
                self._ll_tok = make_ll_tokenizer(self.tokenizer)
            constraint = GrammarConstraint(self._ll_tok, grammar)
        st = _ReqState(seq, IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens),
                       constraint=constraint)
        self.scheduler.add(seq)   # raises on a duplicate id before any state is kept
        self._reqs[request_id] = st
        self.stats_counters["prompt_tokens"] += len(prompt_token_ids)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or self._inflight is not None
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
            sched = self.scheduler.schedule()
            self.stats_counters["preemptions"] = self.scheduler.num_preemptions
            for seq in sched.finished:
                outputs.append(self._finish_output(seq))
            if not sched.scheduled:
                return outputs + self._flush_finished()
            pending = self._dispatch(sched.scheduled)
        if self.config.async_scheduling and pending.greedy and all(pending.samples):
            ahead = self.scheduler.schedule_lookahead(pending.scheduled)
            if ahead is not None:
                self._inflight = self._dispatch(ahead, prev=pending)
                self.stats_counters["lookahead_steps"] += 1
        outputs += self._complete(pending)
        if self._inflight is not None and not any(s.seq.status == SequenceStatus.RUNNING
                                                  for s in self._inflight.scheduled):
            self._inflight = None   # every sequence in it stopped on pending's token: nothing to read
        return outputs

    def _dispatch(self, scheduled: list, prev: _Pending | None = None) -> _Pending:
        """Build the step's inputs and start it on the device (nothing here waits for the device).

        prev: the step still running whose sampled tokens are this step's input tokens (a lookahead step: one
        decode token per sequence, each sequence in prev's batch)."""
        entries = []
        for seq, n in scheduled:
            c = seq.num_computed_tokens
            if prev is None:
                entries.append((seq.token_ids[c:c + n], c, n, [list(pt) for pt in seq.page_tables]))
            else:  # position seq.num_tokens: the token prev is sampling
                entries.append(([0], seq.num_tokens, 1, [list(pt) for pt in seq.page_tables]))
        T = sum(n for _, n in scheduled)
        S = len(scheduled)
        s_pad = bucket(S, self.s_buckets)
        # an all-decode step is padded to its sequence bucket (one token each), a mixed one to a token bucket
        t_pad = s_pad if T == S else max(bucket(T, self.t_buckets), s_pad)
        inp = build_step_inputs(self.spec, entries, t_pad, s_pad)
        if prev is not None:
            row = {s.seq.seq_id: i for i, s in enumerate(prev.scheduled)}
            src = np.zeros(t_pad, np.int32)
            src[:S] = [row[s.seq.seq_id] for s in scheduled]
            inp = dataclasses.replace(inp, token_ids=_take(prev.result, src))
        samples = [s.samples if prev is None else True for s in scheduled]
        seqs = [s.seq for s, ok in zip(scheduled, samples) if ok]
        greedy = prev is not None or plain_greedy(
            seqs, [self._reqs[s.request_id].constraint for s in seqs], self.eos_token_ids)
        if greedy:
            # argmax inside the step: no [S, V] float32 logits, no sampler dispatch (same tokens as the sampler)
            result = self.runner.forward_greedy(inp)
        else:
            result = self.runner.forward(inp)
        return _Pending(list(scheduled), samples, s_pad, greedy, result)

    def _complete(self, p: _Pending) -> list[RequestOutput]:
        """Wait for a dispatched step's tokens, then update the scheduler and emit the outputs."""
        outputs: list[RequestOutput] = []
        sched = p.scheduled
        sampled: dict[int, int | None] = {}
        lp_rows: dict[int, dict] = {}
        rows = p.rows
        if p.greedy:
            toks_all = np.asarray(p.result)
            skip_rows(p.s_pad)
            for r in rows:
                sampled[sched[r].seq.seq_id] = int(toks_all[r])
        else:
            seqs = [sched[r].seq for r in rows]
            toks, lps = self._sample(p.result, seqs, rows)
            for i, r in enumerate(rows):
                seq = sched[r].seq
                sampled[seq.seq_id] = int(toks[i])
                if lps is not None:
                    lp_rows[seq.seq_id] = lps[i]
        self.scheduler.update_after_step(sched, sampled)
        self.stats_counters["steps"] += 1
        for seq, _ in sched:
            if seq.seq_id not in sampled:
                continue
            st = self._reqs.get(seq.request_id)
            if st is None or st.seq is not seq or len(seq.output_token_ids) <= st.sent_tokens:
                continue  # gone, or finished before this (lookahead) step's token was appended
            tok = sampled[seq.seq_id]
            self.stats_counters["generation_tokens"] += 1
            if st.constraint is not None and not st.constraint.is_done():
                st.constraint.advance(tok)
                if st.constraint.is_done() and not seq.is_finished:
                    self.scheduler.finish(seq, "stop")   # the grammar admits nothing more
            if seq.seq_id in lp_rows:
                st.logprobs.append(lp_rows[seq.seq_id])
            outputs.append(self._emit(st))
        outputs += self._flush_finished(exclude={o.request_id for o in outputs})
        return outputs

    def _sample(self, logits: jax.Array, seqs: list[Sequence], rows: list[int]):
        batch = SamplerBatch.build(seqs, rows, logits.shape[0], self.model_config.vocab_size,
                                   [self._reqs[s.request_id].constraint for s in seqs], self.eos_token_ids)
        return sample_step(logits, batch)

    def _emit(self, st: _ReqState) -> RequestOutput:
        seq = st.seq
        out_ids = seq.output_token_ids
        new_ids = out_ids[st.sent_tokens:]
        delta = "".join(st.detok.push(t) for t in new_ids)
        params = seq.params
        finished = seq.is_finished
        if not finished and params.stop:
            full = st.text + delta
            hit = _find_stop(full, params.stop, len(st.text))
            if hit is not None:
                pos, s = hit
                end = pos + len(s) if params.include_stop_str_in_output else pos
                delta = full[len(st.text):end] if end >= len(st.text) else ""
                self.scheduler.finish(seq, "stop", s)
                finished = True
        if finished and not params.stop or finished and seq.stop_reason not in (params.stop or []):
            delta += st.detok.flush()
        st.text += delta
        st.sent_tokens = len(out_ids)
        lps = st.logprobs[-len(new_ids):] if (params.logprobs is not None and new_ids) else None
        out = RequestOutput(seq.request_id, seq.prompt_token_ids, list(out_ids), list(new_ids), delta, st.text,
                            finished, seq.finish_reason if finished else None, lps, seq.num_cached_tokens,
                            seq.stop_reason, getattr(seq, "error", None))
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
