"""A scripted EngineClient for the server tests: a character tokenizer with Gemma 4's special tags as single
tokens, and a generator that emits a scripted reply one token per step (optionally slowly, held at a gate, or
failing), recording every call, its SamplingParams, and every abort."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>",
            "<channel|>", "<|tool_response>", "<tool_response|>", "<|tool>", "<tool|>", "<|think|>"]
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIALS))
CHAR_OFFSET = 100  # ordinary characters are ids ord(c) + 100; specials are 0..len(SPECIALS)-1


class CharTokenizer:
    """One token per character, except the special tags, which are one token each."""

    def encode(self, text: str) -> list[int]:
        ids, pos = [], 0
        for m in _SPECIAL_RE.finditer(text):
            ids += [ord(c) + CHAR_OFFSET for c in text[pos:m.start()]]
            ids.append(SPECIALS.index(m.group()))
            pos = m.end()
        return ids + [ord(c) + CHAR_OFFSET for c in text[pos:]]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join((("" if skip_special_tokens else SPECIALS[i]) if i < CHAR_OFFSET else chr(i - CHAR_OFFSET))
                       for i in ids)


@dataclasses.dataclass
class RequestOutput:
    """The fields of the engine's RequestOutput that the server reads."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    delta_text: str
    text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[dict] | None = None
    num_cached_tokens: int = 0
    error: str | None = None


@dataclasses.dataclass
class FakeStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int = 0
    kv_pages_used: int = 7


class FakeEngineClient:
    """EngineClient over a scripted reply.

    reply: the text every generation produces (special tags included), or a function (prompt_text, params) -> text.
    token_delay: seconds between tokens. gate: generation waits before each token while the gate is clear.
    fail_after: raise RuntimeError after this many tokens (engine failure).
    reject: an exception raised before the first output (the engine refusing the request).
    error_after: finish with finish_reason "error" after this many tokens.
    """

    def __init__(self, reply: str | Callable[[str, Any], str] = "Hello there!", *, model_name: str = "fake-gemma",
                 max_model_len: int = 200) -> None:
        self.model_name, self.max_model_len = model_name, max_model_len
        self.tokenizer = CharTokenizer()
        self.reply = reply
        self.token_delay = 0.0
        self.gate = threading.Event()
        self.gate.set()
        self.fail_after: int | None = None
        self.reject: Exception | None = None
        self.error_after: int | None = None
        self.healthy = True
        self.calls: list[tuple[str, list[int], Any]] = []  # (request_id, prompt ids, SamplingParams)
        self.render_calls: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.active: set[str] = set()  # generations currently inside generate()
        self.tokens_emitted: dict[str, int] = {}
        self.started = threading.Event()  # set when a generation emitted its first token

    def reset(self, reply: str | Callable[[str, Any], str] = "Hello there!") -> None:
        self.__init__(reply, model_name=self.model_name, max_model_len=self.max_model_len)

    # ------------------------------------------------------------------------------------------ EngineClient
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def render_chat(self, messages: list[dict], *, tools: list[dict] | None, enable_thinking: bool,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        self.render_calls.append({"messages": messages, "tools": tools, "enable_thinking": enable_thinking,
                                  "add_generation_prompt": add_generation_prompt, "kwargs": template_kwargs})
        text = "<bos>" + "".join(f"<|turn>{m['role']}\n{m.get('content') or ''}<turn|>\n" for m in messages)
        text += ("<|turn>model\n" if add_generation_prompt else "") + template_kwargs.get("fake_suffix", "")
        return self.tokenizer.encode(text)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: Any, after: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        self.calls.append((request_id, list(prompt_token_ids), params))
        prompt_text = self.tokenizer.decode(prompt_token_ids)
        reply = self.reply(prompt_text, params) if callable(self.reply) else self.reply
        script = self.tokenizer.encode(reply)
        self.active.add(request_id)
        self.tokens_emitted[request_id] = 0
        out_ids: list[int] = []
        text = ""
        try:
            if self.reject is not None:
                raise self.reject
            for i, tid in enumerate(script):
                while not self.gate.is_set():
                    await asyncio.sleep(0.002)
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                else:
                    await asyncio.sleep(0)
                if request_id in self.aborted:
                    return
                if self.fail_after is not None and i >= self.fail_after:
                    raise RuntimeError("fake engine failure (device lost)")
                if self.error_after is not None and i >= self.error_after:
                    yield RequestOutput(request_id, list(prompt_token_ids), list(out_ids), [], "", text, True, "error",
                                        error="needs more KV pages than the pool has")
                    return
                out_ids.append(tid)
                delta = self.tokenizer.decode([tid], skip_special_tokens=params.skip_special_tokens)
                text += delta
                self.tokens_emitted[request_id] += 1
                self.started.set()
                finished_len = len(out_ids) >= params.max_tokens
                finished = finished_len or i == len(script) - 1
                logprobs = None
                if params.logprobs is not None:
                    lp = -0.1 * (i + 1)
                    top = [(tid, lp), (CHAR_OFFSET + ord("?"), lp - 1.0)][:params.logprobs]
                    logprobs = [{"token_id": tid, "logprob": lp, "top": top}]
                yield RequestOutput(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                                    token_ids=list(out_ids), new_token_ids=[tid], delta_text=delta, text=text,
                                    finished=finished, finish_reason=("length" if finished_len else "stop")
                                    if finished else None, logprobs=logprobs, num_cached_tokens=3)
                if finished:
                    return
        finally:
            self.active.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def check_health(self) -> bool:
        return self.healthy

    def stats(self) -> FakeStats:
        return FakeStats(num_running=len(self.active), num_waiting=0, kv_cache_usage=0.25, num_preemptions=2)
