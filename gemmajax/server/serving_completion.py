"""Generation plumbing shared by both endpoints (`ServingBase`) and the text-completions endpoint.

A request becomes one engine generation per choice (distinct request ids, seed + i), merged into one stream
of (choice index, RequestOutput). Every generation that ends without `finished` (client gone, server
shutting down, a sibling failed) is aborted in the engine at once, under a cancellation shield. Handlers
return a pydantic response, or an async iterator of SSE lines that the app streams.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import anyio

from gemmajax.server.metrics import GenerationTimer, ServerMetrics
from gemmajax.server.protocol import (
    APIError,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionTokensDetails,
    PromptTokensDetails,
    UsageInfo,
    now,
    random_id,
    short_repr,
)

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_error(exc: BaseException) -> str:
    err = exc if isinstance(exc, APIError) else APIError(500, f"generation failed: {type(exc).__name__}: {exc}",
                                                         type="server_error")
    return sse(err.body())


def import_optional(module: str, what: str) -> Any:
    """Import a sibling module written in parallel; a clear 501 when it is not there yet."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise APIError(501, f"{what} is not available in this build ({module}: {e})", type="server_error") from e


@dataclass
class Choice:
    """One engine generation of a request: choice `index`, its own request id and sampling params."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: Any
    count_prompt: bool = True  # count the prompt's tokens in metrics/usage once per prompt, not once per choice
    after: str | None = None   # the request id of the prompt's first choice, whose prompt pages this one reuses
    media: list | None = None  # processed images / audio of the prompt (chat)
    grammar_param: str | None = None  # the request field a grammar came from, to name it when it fails
    prompt_param: str | None = None  # the request field the prompt came from, to name it when the engine refuses it
    last: Any = None  # the latest RequestOutput
    logprobs: list[dict] = field(default_factory=list)


async def merge_streams(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave async iterators as (position, item) in arrival order; close them all on exit."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    queue.put_nowait((i, item, None))
            queue.put_nowait((i, end, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 -- handed to the consumer, who re-raises it
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is end:
                left -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


class ServingBase:
    """What both endpoints share: model check, length check, SamplingParams, running the choices."""

    def __init__(self, engine: Any, metrics: ServerMetrics, *, sampling_params_cls: Callable[..., Any] | None = None
                 ) -> None:
        self.engine = engine
        self.metrics = metrics
        self._sampling_params_cls = sampling_params_cls

    # ------------------------------------------------------------------------------------------ request checks
    def check_model(self, name: str | None) -> str:
        served = self.engine.model_name
        if name is not None and name != served:
            raise APIError(404, f"the model {short_repr(name)} does not exist; this server serves {served!r}",
                           param="model", code="model_not_found")
        return served

    def room_for_output(self, prompt_len: int, param: str) -> int:
        """Tokens left for output. vLLM's rule: reject a prompt that fills the context (callers then cap
        max_tokens to the room left instead of rejecting)."""
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but the {param} has "
                                f"{prompt_len} tokens (it must be shorter than {limit} to leave room for output)",
                           param=param, code="context_length_exceeded")
        return limit - prompt_len

    def sampling_params(self, req: Any, *, max_tokens: int, seed: int | None, logprobs: int | None,
                        skip_special_tokens: bool, grammar: str | None) -> Any:
        cls = self._sampling_params_cls
        if cls is None:
            cls = import_optional("gemmajax.engine.sampling_params", "the sampling engine").SamplingParams
        defaults = getattr(self.engine, "sampling_defaults", None) or {}

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(req, name)
            return value if value is not None else defaults.get(name, fallback)

        try:
            return cls(max_tokens=max_tokens, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
                       top_k=pick("top_k", 0), min_p=pick("min_p", 0.0), seed=seed, stop=req.stop_list(),
                       stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                       presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                       repetition_penalty=req.repetition_penalty, logprobs=logprobs,
                       skip_special_tokens=skip_special_tokens, grammar=grammar,
                       thinking_token_budget=pick("thinking_token_budget", None))
        except ValueError as e:  # SamplingParams' own validation names the field
            field = re.search(r"SamplingParams\.(\w+)", str(e))
            raise APIError(400, f"invalid sampling parameters: {e}", param=field.group(1) if field else None) from e

    def make_choices(self, base_id: str, prompts: list[list[int]], params_for: Callable[[int | None], Any],
                     n: int, seed: int | None) -> list[Choice]:
        """n choices per prompt, index = prompt_i * n + j; seeds seed + j so the choices differ. Choices j > 0
        start from choice 0's cached prompt pages (`after`), so the prompt is computed once."""
        choices = []
        for p, ids in enumerate(prompts):
            for j in range(n):
                index = p * n + j
                rid = base_id if len(prompts) * n == 1 else f"{base_id}-{index}"
                choices.append(Choice(index, rid, ids, params_for(None if seed is None else seed + j),
                                      count_prompt=(j == 0), after=choices[-j].request_id if j else None))
        return choices

    # ------------------------------------------------------------------------------------------ running
    async def _run_one(self, choice: Choice) -> AsyncIterator[Any]:
        """The engine's outputs of one choice; aborts it in the engine unless it finished.

        A request the engine rejects before its first output (a ValueError such as llguidance's GrammarError, or
        a finish_reason "error" with no tokens) becomes a 400; an error after tokens were produced stays a 500.
        """
        timer = GenerationTimer(self.metrics)
        kw = {"media": choice.media} if choice.media else {}
        stream = self.engine.generate(choice.request_id, choice.prompt_ids, choice.params, after=choice.after, **kw)
        finished = False
        try:
            async for out in stream:
                if out.finished and out.finish_reason == "error":
                    finished = True
                    reason = getattr(out, "error", None) or "no reason given"
                    if out.token_ids:
                        raise APIError(500, f"generation failed after {len(out.token_ids)} tokens: {reason}",
                                       type="server_error")
                    raise APIError(400, f"the engine rejected the request: {reason}")
                timer.on_tokens(len(out.new_token_ids))
                if out.logprobs:
                    choice.logprobs.extend(out.logprobs)
                choice.last = out
                if out.finished:
                    finished = True
                    timer.on_finish(len(choice.prompt_ids) if choice.count_prompt else 0)
                yield out
                if finished:
                    break
        except ValueError as e:
            if choice.last is not None:
                raise
            if type(e).__name__ == "GrammarError":
                param = choice.grammar_param
            else:  # the engine's own checks at admission are of the prompt (empty, token ids outside the vocabulary)
                param = choice.prompt_param if "prompt" in str(e) else None
            raise APIError(400, f"the engine rejected the request: {type(e).__name__}: {e}", param=param) from e
        finally:
            with anyio.CancelScope(shield=True):
                if not finished:
                    logger.info("aborting request %s", choice.request_id)
                    try:
                        await self.engine.abort(choice.request_id)
                    except Exception:
                        logger.exception("engine.abort(%r) failed", choice.request_id)
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()

    def run(self, choices: list[Choice]) -> AsyncIterator[tuple[int, Any]]:
        """(position in `choices`, RequestOutput) as the engine produces them."""
        return merge_streams([self._run_one(c) for c in choices])

    # ------------------------------------------------------------------------------------------ tokens and usage
    def token_text(self, token_id: int) -> str:
        """A token's text for logprobs: engine.token_text(id) or engine.tokenizer.decode([id]) if offered."""
        fn = getattr(self.engine, "token_text", None)
        if fn is not None:
            return fn(token_id)
        tok = getattr(self.engine, "tokenizer", None)
        if tok is not None:
            return tok.decode([token_id])
        return f"token_id:{token_id}"

    def decode(self, token_ids: list[int], param: str) -> str:
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            raise APIError(400, "this server cannot decode token-id prompts (the engine offers no tokenizer)",
                           param=param)
        try:
            return tok.decode(token_ids)
        except (ValueError, IndexError, OverflowError) as e:  # an id outside the vocabulary
            raise APIError(400, f"{param} cannot be decoded: {e}", param=param) from e

    @staticmethod
    def usage(choices: list[Choice]) -> UsageInfo:
        prompt = sum(len(c.prompt_ids) for c in choices if c.count_prompt)
        completion = sum(len(c.last.token_ids) for c in choices if c.last is not None)
        cached = sum(getattr(c.last, "num_cached_tokens", 0) or 0 for c in choices if c.count_prompt and c.last)
        reasoning = sum(getattr(c.last, "num_reasoning_tokens", 0) or 0 for c in choices if c.last is not None)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                         completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning))


class CompletionServing(ServingBase):
    """POST /v1/completions: prompts as text or token ids, echo, logprobs, n, streaming."""

    async def create(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        model = self.check_model(req.model)
        prompts = req.prompts()
        prompt_ids, prompt_texts, rooms = [], [], []
        for i, p in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            if isinstance(p, str):
                ids = self.engine.encode_prompt(p)
                text = p
            else:
                ids = list(p)
                text = self.decode(ids, param) if req.echo else ""
            rooms.append(self.room_for_output(len(ids), param))
            prompt_ids.append(ids)
            prompt_texts.append(text)
        max_tokens = min(rooms) if req.max_tokens is None else min(req.max_tokens, *rooms)

        def params_for(seed: int | None) -> Any:
            return self.sampling_params(req, max_tokens=max_tokens, seed=seed, logprobs=req.logprobs,
                                        skip_special_tokens=req.skip_special_tokens, grammar=None)

        rid = random_id("cmpl")
        choices = self.make_choices(rid, prompt_ids, params_for, req.n, req.seed)
        for c in choices:
            c.prompt_param = "prompt" if len(prompts) == 1 else f"prompt.{c.index // req.n}"
        echo = [prompt_texts[c.index // req.n] if req.echo else "" for c in choices]
        if req.stream:
            return self._stream(req, rid, model, choices, echo)
        return await self._full(req, rid, model, choices, echo)

    def _logprobs(self, entries: list[dict], offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for e in entries:
            text = self.token_text(e["token_id"])
            tokens.append(text)
            token_lps.append(e["logprob"])
            tops.append({self.token_text(t): lp for t, lp in e.get("top") or []})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def _full(self, req: CompletionRequest, rid: str, model: str, choices: list[Choice], echo: list[str]
                    ) -> CompletionResponse:
        async with aclosing(self.run(choices)) as outputs:
            async for _ in outputs:
                pass
        out_choices = []
        for c, prefix in zip(choices, echo, strict=True):
            lp = self._logprobs(c.logprobs, len(prefix)) if req.logprobs is not None else None
            out_choices.append(CompletionChoice(index=c.index, text=prefix + c.last.text, logprobs=lp,
                                                finish_reason=c.last.finish_reason))
        return CompletionResponse(id=rid, created=now(), model=model, choices=out_choices, usage=self.usage(choices))

    async def _stream(self, req: CompletionRequest, rid: str, model: str, choices: list[Choice], echo: list[str]
                      ) -> AsyncIterator[str]:
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        offsets = [len(e) for e in echo]

        def chunk(index: int, text: str, logprobs: dict | None = None, finish: str | None = None) -> str:
            payload: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                                       "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                                    "finish_reason": finish}]}
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        try:
            for c, prefix in zip(choices, echo, strict=True):
                if prefix:
                    yield chunk(c.index, prefix)
            async with aclosing(self.run(choices)) as outputs:
                async for pos, out in outputs:
                    c = choices[pos]
                    lp = None
                    if req.logprobs is not None and out.logprobs:
                        lp = self._logprobs(out.logprobs, offsets[pos])
                        offsets[pos] += sum(len(t) for t in lp["tokens"])
                    if out.delta_text or lp is not None or out.finished:
                        yield chunk(c.index, out.delta_text, lp, out.finish_reason if out.finished else None)
            if include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": self.usage(choices).model_dump()})
        except Exception as e:
            logger.exception("completion stream %s failed", rid)
            yield sse_error(e)
        yield DONE
