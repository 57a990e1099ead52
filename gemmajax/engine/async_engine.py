"""AsyncEngineClient: the engine behind the HTTP server.

One background thread owns the LLMEngine and loops `step()` while there is work; requests and aborts arrive
through a thread-safe inbox, and each request's outputs go back to its asyncio queue with
`loop.call_soon_threadsafe`. The device step never runs on the event loop, so the server stays responsive,
and an exception in one step fails the requests in it, never the server.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator

from gemmajax.engine.llm_engine import LLMEngine, RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


class AsyncEngineClient:
    def __init__(self, engine: LLMEngine, *, model_name: str, chat_template=None, tokenizer=None,
                 sampling_defaults: dict | None = None):
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.chat_template = chat_template
        self.sampling_defaults = sampling_defaults or {}
        self.media_fetch = None          # url -> bytes for http(s) images (off unless --allowed-media-domains)
        self.media_limits: dict[str, int] | None = None   # most images / audios per prompt
        self._inbox: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="gemmajax-engine", daemon=True)
        self._thread.start()
        self._last_error: str | None = None

    # ------------------------------------------------------------------ construction from the CLI
    @classmethod
    def from_args(cls, args) -> "AsyncEngineClient":
        llm = _llm_from_args(args)
        if getattr(args, "num_hosts", 1) > 1:   # host 0: broadcast every step to the other hosts
            from gemmajax.engine.multihost import lead
            lead(llm.engine)
        if getattr(args, "precompile", False):
            shapes = len(llm.engine.step_shapes())
            logger.info("precompiled %d step shapes in %.0f s", shapes, llm.engine.precompile())
        name = args.served_model_name or _model_name(llm.ckpt)
        budget = getattr(args, "default_thinking_token_budget", None)
        client = cls(llm.engine, model_name=name, chat_template=llm.chat_template(), tokenizer=llm.tokenizer,
                     sampling_defaults={} if budget is None else {"thinking_token_budget": budget})
        client._llm = llm
        client.media_limits = getattr(args, "limit_mm_per_prompt", None)
        return client

    # ------------------------------------------------------------------ EngineClient protocol
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_bos=True)
        return [int(t) for t in prompt]

    def render_chat(self, messages: list[dict], *, tools: list[dict] | None, enable_thinking: bool,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        text = self.chat_template.render(messages, tools=tools, enable_thinking=enable_thinking,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs)
        return self.tokenizer.encode(text, add_bos=False)

    def chat_prompt(self, messages: list[dict], *, tools: list[dict] | None, enable_thinking: bool,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> tuple[list[int], list]:
        """(prompt ids, processed media) of a conversation with image / audio parts (engine/chat.py rules: the
        server's allow-listed fetcher for http(s) images, its per-prompt limits)."""
        from gemmajax.engine.chat import expand_media_prompt, prepare_media
        messages, items = prepare_media(messages, getattr(self.engine, "mm_config", None), fetch=self.media_fetch,
                                        limits=self.media_limits)
        text = self.chat_template.render(messages, tools=tools, enable_thinking=enable_thinking,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs)
        if items:
            text = expand_media_prompt(text, items)
        return self.tokenizer.encode(text, add_bos=False), items

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def generate(self, request_id: str, prompt_token_ids: list[int], params, after: str | None = None,
                       media: list | None = None) -> AsyncIterator[RequestOutput]:
        """The outputs of one generation as the engine makes them. after: a sibling choice's request id (same
        prompt), whose prompt pages this one reuses; media: the prompt's processed images / audio
        (LLMEngine.add_request)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (loop, q)
        self._post(("add", (request_id, prompt_token_ids, params, after, media)))
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if self._queues.pop(request_id, None) is not None:
                self._post(("abort", request_id))   # the consumer went away (client disconnect / cancel)

    async def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def stats(self) -> EngineStats:
        s = self.engine.scheduler
        spec = self.engine.spec_decode_stats()
        return EngineStats(num_running=s.num_running, num_waiting=s.num_waiting,
                           kv_cache_usage=self.engine.block_manager.usage(), num_preemptions=s.num_preemptions,
                           prefix_cache_hit_tokens=s.num_prefix_cache_hit_tokens,
                           spec_num_drafts=spec["num_drafts"], spec_num_draft_tokens=spec["num_draft_tokens"],
                           spec_num_accepted_tokens=spec["num_accepted_tokens"])

    def check_health(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the engine thread
    def _post(self, msg) -> None:
        with self._lock:
            self._inbox.append(msg)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        entry = self._queues.get(request_id)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop:
            with self._lock:
                inbox, self._inbox = self._inbox, []
            for kind, payload in inbox:
                if kind == "add":
                    rid, ids, params, after, media = payload
                    try:
                        eng.add_request(rid, ids, params, after=after, media=media)
                    except Exception as e:  # noqa: BLE001 — a bad request fails alone
                        self._deliver(rid, e)
                else:
                    eng.abort_request(payload)
            if not eng.has_unfinished() and not eng._reqs:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outs = eng.step()
            except Exception as e:  # noqa: BLE001 — fail the step's requests, keep serving
                logger.exception("engine step failed")
                for rid in list(eng._reqs):
                    eng.abort_request(rid)
                    self._deliver(rid, RuntimeError(f"engine step failed: {e}"))
                eng._reqs.clear()
                continue
            for o in outs:
                self._deliver(o.request_id, o)


def _llm_from_args(args):
    """The LLM of `gemmajax serve`'s flags (joining the multi-host run first when --num-hosts > 1)."""
    from gemmajax.engine.llm import LLM
    if getattr(args, "num_hosts", 1) > 1:
        from gemmajax.parallel import init_distributed
        init_distributed(args.coordinator, args.num_hosts, args.host_index)
    return LLM(args.ckpt, quant=args.quant, kv_dtype=args.kv_dtype, dtype=getattr(args, "dtype", "bfloat16"),
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens or 512,
               enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
               kv_cache_memory=getattr(args, "kv_cache_memory", None),
               speculative_config=getattr(args, "speculative_config", None),
               tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
               enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
               **({"num_scheduler_steps": args.num_scheduler_steps}
                  if getattr(args, "num_scheduler_steps", None) is not None else {}))


def follow_from_args(args) -> int:
    """`gemmajax serve --num-hosts N --host-index i` for i > 0: build the same LLM, then run host 0's steps until
    it stops (engine/multihost.py). Returns the exit status."""
    from gemmajax.engine.multihost import follow
    from gemmajax.parallel import shutdown_distributed
    llm = _llm_from_args(args)
    steps = follow(llm.engine.runner)
    logger.info("host %d: host 0 stopped after %d steps", args.host_index, steps)
    shutdown_distributed()
    return 0


def _model_name(ckpt: str) -> str:
    import os
    base = os.path.basename(os.path.normpath(ckpt))
    return base[:-5] if base.endswith(".gguf") else base
