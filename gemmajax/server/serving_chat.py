"""POST /v1/chat/completions: chat template, Gemma 4 tool calls and reasoning, structured output, streaming.

Reasoning is active iff `chat_template_kwargs.enable_thinking`. Whenever tools are active or reasoning is,
the engine keeps special tokens in its text so the Gemma 4 parser sees `<|tool_call>` and `<|channel>`
(vLLM #45832: tool calls must work with thinking off too). Forced tool calls and response_format become an
llguidance grammar on the SamplingParams, behind a free thought channel when thinking is on.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from gemmajax.server.protocol import (
    APIError,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    NamedToolChoice,
    ResponseMessage,
    ResponseToolCall,
    now,
    random_id,
)
from gemmajax.engine.chat import chat_finish_reason, chat_grammar, chat_params
from gemmajax.server.serving_completion import DONE, Choice, ServingBase, import_optional, sse, sse_error

logger = logging.getLogger(__name__)


def _template_errors() -> tuple[type[BaseException], ...]:
    try:
        import jinja2

        return (ValueError, TypeError, KeyError, jinja2.TemplateError)
    except ImportError:
        return (ValueError, TypeError, KeyError)


class ChatServing(ServingBase):
    """Chat completions over an EngineClient (see gemmajax/server/app.py for the interface)."""

    async def create(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        model = self.check_model(req.model)
        thinking = req.enable_thinking
        parse = req.tools_active or thinking
        prompt_ids, media = self._render(req, thinking)
        room = self.room_for_output(len(prompt_ids), "messages")
        max_tokens = room if req.requested_max_tokens is None else min(req.requested_max_tokens, room)
        grammar, grammar_param = self._grammar(req, thinking)
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        gemma4 = getattr(getattr(self.engine, "tokenizer", None), "family", "gemma4") == "gemma4"

        def params_for(seed: int | None) -> Any:
            p = self.sampling_params(req, max_tokens=max_tokens, seed=seed, logprobs=num_logprobs,
                                     skip_special_tokens=not parse, grammar=None)
            return chat_params(p, gemma4=gemma4, parse=parse, thinking=thinking, grammar=grammar)

        rid = random_id("chatcmpl")
        choices = self.make_choices(rid, [prompt_ids], params_for, req.n, req.seed)
        for c in choices:
            c.grammar_param = grammar_param
            c.media = media
        parser_kw = {"reasoning": thinking, "prompt_in_reasoning": thinking and self._prompt_in_reasoning(prompt_ids)}
        if req.stream:
            return self._stream(req, rid, model, choices, parse, parser_kw)
        return await self._full(req, rid, model, choices, parse, parser_kw)

    # ------------------------------------------------------------------------------------------ prompt
    def _messages(self, req: ChatCompletionRequest) -> list[dict[str, Any]]:
        """OpenAI messages as plain dicts for the chat template: content as one string, tool-call arguments
        as dicts (the HF convention), a tool message's `name` filled in from the call it answers."""
        names_by_id: dict[str, str] = {}
        out = []
        for i, m in enumerate(req.messages):
            d: dict[str, Any] = {"role": m.role,
                                 "content": [p.as_dict() for p in m.content] if m.has_media else m.text()}
            if m.name is not None:
                d["name"] = m.name
            if m.reasoning_content is not None:
                d["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                calls = []
                for j, tc in enumerate(m.tool_calls):
                    args = tc.function.arguments
                    where = f"messages.{i}.tool_calls.{j}.function.arguments"
                    if isinstance(args, str):
                        try:
                            args = json.loads(args) if args.strip() else {}
                        except (ValueError, RecursionError) as e:  # also too deep, or an int of too many digits
                            reason = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
                            raise APIError(400, f"{where} must be a JSON object string, got {args[:80]!r} ({reason})",
                                           param=where) from None
                        if not isinstance(args, dict):
                            raise APIError(400, f"{where} must encode a JSON object, got {type(args).__name__}",
                                           param=where)
                    call = {"type": "function", "function": {"name": tc.function.name, "arguments": args}}
                    if tc.id is not None:
                        call["id"] = tc.id
                        names_by_id[tc.id] = tc.function.name
                    calls.append(call)
                d["tool_calls"] = calls
            if m.role == "tool":
                if m.tool_call_id is not None:
                    d["tool_call_id"] = m.tool_call_id
                if m.name is None and m.tool_call_id in names_by_id:
                    d["name"] = names_by_id[m.tool_call_id]
            out.append(d)
        return out

    def _render(self, req: ChatCompletionRequest, thinking: bool) -> tuple[list[int], list]:
        """(prompt ids, processed media in prompt order). Media parts are decoded by the engine client's
        `chat_prompt` (engine/chat.py prepare_media: data URLs, allow-listed http(s) URLs, base64 WAV); a bad
        medium is a 400 naming its part, an engine without media support refuses them."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools_active else None
        kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "enable_thinking"}
        messages = self._messages(req)
        media_used = any(m.has_media for m in req.messages)
        chat_prompt = getattr(self.engine, "chat_prompt", None)
        try:
            if chat_prompt is not None:
                ids, media = chat_prompt(messages, tools=tools, enable_thinking=thinking,
                                         add_generation_prompt=req.add_generation_prompt, **kwargs)
                return list(ids), media
            if media_used:
                i = next(k for k, m in enumerate(req.messages) if m.has_media)
                j = next(k for k, p in enumerate(req.messages[i].content) if p.type != "text")
                raise APIError(400, f"messages.{i}.content.{j}: this server takes text only",
                               param=f"messages.{i}.content.{j}")
            return list(self.engine.render_chat(messages, tools=tools, enable_thinking=thinking,
                                                add_generation_prompt=req.add_generation_prompt, **kwargs)), []
        except _template_errors() as e:
            where = re.match(r"messages\.\d+\.content\.\d+", str(e))
            if where is not None:   # a medium that does not decode, or that this checkpoint cannot see
                raise APIError(400, str(e), param=where.group(0)) from e
            raise APIError(400, f"the chat template could not render these messages: {type(e).__name__}: {e}",
                           param="messages") from e

    _CLOSES_CHANNEL = frozenset({"<channel|>", "<|turn>", "<turn|>", "<|tool_response>", "<tool_response|>"})

    def _prompt_in_reasoning(self, prompt_ids: list[int], lookback: int = 64) -> bool:
        """Does the prompt end inside an open thought channel (templates that open `<|channel>thought\n` after a
        tool response)? Scans back from the end to the nearest channel or turn tag."""
        for tid in reversed(prompt_ids[-lookback:]):
            text = self.token_text(tid)
            if text == "<|channel>":
                return True
            if text in self._CLOSES_CHANNEL:
                return False
        return False

    def _grammar(self, req: ChatCompletionRequest, thinking: bool) -> tuple[str | None, str | None]:
        """The llguidance grammar for forced tool calls or response_format, and the field it came from
        (engine/chat.py's rule, shared with LLM.chat)."""
        fmt = req.response_format if req.response_format is not None and req.response_format.type != "text" else None
        forced = req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)
        if not forced and fmt is None:
            return None, None
        if forced and fmt is not None:
            raise APIError(400, f"response_format {fmt.type!r} cannot be combined with tool_choice "
                                f"{req._tool_choice_str()}: the output is either a tool call or the format",
                           param="response_format")
        constrained = import_optional("gemmajax.tools.constrained", "structured output (llguidance)")
        try:
            return chat_grammar(
                json_schema=fmt.json_schema.schema_ if fmt is not None and fmt.type == "json_schema" else None,
                json_object=fmt is not None and fmt.type == "json_object",
                tools=[t.model_dump(exclude_none=True) for t in req.tools or []], tool_choice=req.tool_choice,
                parallel_tool_calls=req.parallel_tool_calls is not False, thinking=thinking)
        except constrained.GrammarError as e:
            param = "response_format" if fmt is not None else "tools"
            raise APIError(400, f"cannot build a grammar from {param}: {e}", param=param) from e

    # ------------------------------------------------------------------------------------------ output
    def _parser(self, parser_kw: dict[str, bool]) -> Any:
        return import_optional("gemmajax.tools.parser", "the Gemma 4 output parser").Gemma4StreamParser(**parser_kw)

    def _logprobs(self, entries: list[dict]) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [item(e["token_id"], e["logprob"]) | {"top_logprobs": [item(t, lp) for t, lp in
                                                                                   e.get("top") or []]}
                            for e in entries]}

    @staticmethod
    def _finish_reason(out: Any, has_tool_calls: bool) -> str | None:
        return chat_finish_reason(out.finish_reason, has_tool_calls)

    async def _full(self, req: ChatCompletionRequest, rid: str, model: str, choices: list[Choice], parse: bool,
                    parser_kw: dict[str, bool]) -> ChatCompletionResponse:
        async with aclosing(self.run(choices)) as outputs:
            async for _ in outputs:
                pass
        out_choices = []
        for c in choices:
            text = c.last.text
            if parse:
                parser = import_optional("gemmajax.tools.parser", "the Gemma 4 output parser")
                msg = parser.parse_gemma4(text, **parser_kw)
                calls = msg.tool_calls[:1] if not req.parallel_tool_calls else msg.tool_calls
                message = ResponseMessage(content=msg.content, reasoning_content=msg.reasoning_content,
                                          tool_calls=[ResponseToolCall.model_validate(tc) for tc in calls])
            else:
                message = ResponseMessage(content=text)
            lp = self._logprobs(c.logprobs) if req.logprobs else None
            out_choices.append(ChatCompletionChoice(index=c.index, message=message, logprobs=lp,
                                                    finish_reason=self._finish_reason(c.last,
                                                                                      bool(message.tool_calls))))
        return ChatCompletionResponse(id=rid, created=now(), model=model, choices=out_choices,
                                      usage=self.usage(choices))

    async def _stream(self, req: ChatCompletionRequest, rid: str, model: str, choices: list[Choice], parse: bool,
                      parser_kw: dict[str, bool]) -> AsyncIterator[str]:
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(index: int, delta: dict[str, Any], logprobs: dict | None = None, finish: str | None = None
                  ) -> str:
            payload: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                       "model": model, "choices": [{"index": index, "delta": delta,
                                                                    "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        try:
            parsers = [self._parser(parser_kw) if parse else None for _ in choices]
            saw_tool_call = [False] * len(choices)
            for c in choices:
                yield chunk(c.index, {"role": "assistant", "content": ""})
            async with aclosing(self.run(choices)) as outputs:
                async for pos, out in outputs:
                    c, parser = choices[pos], parsers[pos]
                    if parser is not None:
                        deltas = parser.feed(out.delta_text) if out.delta_text else []
                        if out.finished:
                            deltas += parser.close()
                    else:
                        deltas = [{"content": out.delta_text}] if out.delta_text else []
                    if not req.parallel_tool_calls:
                        deltas = _first_tool_call_only(deltas)
                    saw_tool_call[pos] |= any("tool_calls" in d for d in deltas)
                    lp = self._logprobs(out.logprobs) if req.logprobs and out.logprobs else None
                    if lp is not None and not deltas:
                        deltas = [{}]
                    for k, delta in enumerate(deltas):
                        yield chunk(c.index, delta, lp if k == 0 else None)
                    if out.finished:
                        yield chunk(c.index, {}, finish=self._finish_reason(out, saw_tool_call[pos]))
            if include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [], "usage": self.usage(choices).model_dump()})
        except Exception as e:
            logger.exception("chat stream %s failed", rid)
            yield sse_error(e)
        yield DONE


def _first_tool_call_only(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """parallel_tool_calls=false: drop the deltas of every tool call but the first (index 0)."""
    kept = []
    for d in deltas:
        if "tool_calls" in d:
            calls = [tc for tc in d["tool_calls"] if tc.get("index", 0) == 0]
            if not calls:
                continue
            d = d | {"tool_calls": calls}
        kept.append(d)
    return kept
