"""Chat completions through a real uvicorn server and the official openai client, over a scripted fake engine."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.fake_engine import FakeEngineClient

TOOL_REPLY = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|><|tool_response>'
TWO_CALLS = (TOOL_REPLY.removesuffix("<|tool_response>")
             + '<|tool_call>call:get_time{tz:<|"|>CET<|"|>}<tool_call|><|tool_response>')
THINK_REPLY = "<|channel>thought\nLet me think.<channel|>The answer is 4.<turn|>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"},
                                                                         "days": {"type": "integer"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
             "tz": {"type": "string"}}}}}]
USER = [{"role": "user", "content": "Hi"}]


def _stream(client: openai.OpenAI, **kw) -> list:
    return list(client.chat.completions.create(model="fake-gemma", stream=True, **kw))


def _join_tool_calls(chunks: list) -> dict[int, dict]:
    calls: dict[int, dict] = {}
    for ch in chunks:
        for choice in ch.choices:
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    call["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
    return calls


def test_models_and_health(client: openai.OpenAI, base_url: str) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-gemma"]
    import httpx

    assert httpx.get(f"{base_url}/health").status_code == 200


def test_chat_plain(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    r = client.chat.completions.create(model="fake-gemma", messages=messages)
    assert r.object == "chat.completion" and r.model == "fake-gemma"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "Hello there!"
    assert r.choices[0].finish_reason == "stop"
    prompt_ids = engine.render_chat([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi\nthere"}], tools=None, enable_thinking=False)
    _, sent_ids, params = engine.calls[0]
    assert sent_ids == prompt_ids  # text parts joined by newlines, nothing else added
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len("Hello there!")
    assert r.usage.total_tokens == len(prompt_ids) + len("Hello there!")
    assert r.usage.prompt_tokens_details.cached_tokens == 3
    # no tools, no thinking: special tokens skipped, OpenAI's default temperature, max_tokens = what fits
    assert params.skip_special_tokens is True and params.grammar is None
    assert params.temperature == 1.0
    assert params.max_tokens == engine.max_model_len - len(prompt_ids)
    assert engine.render_calls[0]["enable_thinking"] is False and engine.render_calls[0]["tools"] is None


def test_chat_sampling_fields_reach_params(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    r = client.chat.completions.create(model="fake-gemma", messages=USER, max_tokens=5, temperature=0.3, top_p=0.9,
                                       seed=7, stop=["xyz"], presence_penalty=0.5, frequency_penalty=-0.5,
                                       extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.2,
                                                   "unknown_field": 1})
    assert r.choices[0].message.content == "Hello"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    p = engine.calls[0][2]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (5, 0.3, 0.9, 40, 0.05, 7)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert list(p.stop) == ["xyz"]
    # max_completion_tokens wins over max_tokens
    client.chat.completions.create(model="fake-gemma", messages=USER, max_tokens=5, max_completion_tokens=3)
    assert engine.calls[1][2].max_tokens == 3


def test_chat_stream_and_usage(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    chunks = _stream(client, messages=USER, stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello there!"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len("Hello there!")
    assert chunks[-1].usage.prompt_tokens == len(engine.calls[0][1])
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage there is no usage chunk
    chunks = _stream(client, messages=USER)
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_tool_calls_thinking_off(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    engine.reply = TWO_CALLS
    r = client.chat.completions.create(model="fake-gemma", messages=USER, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content is None
    assert [tc.function.name for tc in msg.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert json.loads(msg.tool_calls[1].function.arguments) == {"tz": "CET"}
    assert all(tc.id and tc.type == "function" for tc in msg.tool_calls)
    # tools active => special tokens kept for the parser even with thinking off (vLLM #45832)
    assert engine.calls[0][2].skip_special_tokens is False
    assert engine.render_calls[0]["enable_thinking"] is False
    assert [t["function"]["name"] for t in engine.render_calls[0]["tools"]] == ["get_weather", "get_time"]
    # parallel_tool_calls=false keeps the first call only
    r = client.chat.completions.create(model="fake-gemma", messages=USER, tools=TOOLS, parallel_tool_calls=False)
    assert [tc.function.name for tc in r.choices[0].message.tool_calls] == ["get_weather"]


def test_tool_calls_streamed(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    engine.reply = "Checking." + TWO_CALLS
    chunks = _stream(client, messages=USER, tools=TOOLS)
    calls = _join_tool_calls(chunks)
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}
    assert json.loads(calls[1]["arguments"]) == {"tz": "CET"}
    assert calls[0]["id"] and calls[1]["id"] and calls[0]["id"] != calls[1]["id"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking."
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    # no special tag leaks into any delta
    raw = json.dumps([c.model_dump() for c in chunks])
    assert "<|tool_call>" not in raw and '<|\\"|>' not in raw


def test_tool_calls_streamed_parallel_false_keeps_the_first_call(client: openai.OpenAI,
                                                                 engine: FakeEngineClient) -> None:
    """parallel_tool_calls=false on a stream: every delta of the first call, none of the second, one finish."""
    engine.reply = "Checking." + TWO_CALLS
    chunks = _stream(client, messages=USER, tools=TOOLS, parallel_tool_calls=False)
    calls = _join_tool_calls(chunks)
    assert list(calls) == [0], calls
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}
    assert calls[0]["id"]
    deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert deltas and all(tc.index == 0 for tc in deltas)
    raw = json.dumps([c.model_dump() for c in chunks])
    assert "get_time" not in raw and "CET" not in raw  # nothing of the second call, not even its name
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking."
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    # the same reply with parallel calls allowed streams both (so the test above can tell the two apart)
    assert sorted(_join_tool_calls(_stream(client, messages=USER, tools=TOOLS))) == [0, 1]


def test_tool_choice_none_disables_tools(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    r = client.chat.completions.create(model="fake-gemma", messages=USER, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == "Hello there!" and not r.choices[0].message.tool_calls
    assert engine.calls[0][2].skip_special_tokens is True
    assert engine.render_calls[0]["tools"] is None


def test_reasoning_thinking_on(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    engine.reply = THINK_REPLY
    kw = {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    r = client.chat.completions.create(model="fake-gemma", messages=USER, **kw)
    msg = r.choices[0].message
    assert msg.content == "The answer is 4."
    assert msg.reasoning_content == "Let me think."
    assert r.choices[0].finish_reason == "stop"
    assert engine.render_calls[0]["enable_thinking"] is True
    assert engine.calls[0][2].skip_special_tokens is False

    chunks = _stream(client, messages=USER, **kw)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == ("Let me think.", "The answer is 4.")


def test_prompt_ending_inside_thought_channel(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    engine.reply = "still thinking<channel|>Done.<turn|>"
    kw = {"chat_template_kwargs": {"enable_thinking": True, "fake_suffix": "<|channel>thought\n"}}
    r = client.chat.completions.create(model="fake-gemma", messages=USER, extra_body=kw)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("still thinking", "Done.")
    assert engine.render_calls[0]["kwargs"] == {"fake_suffix": "<|channel>thought\n"}  # other kwargs pass through
    chunks = _stream(client, messages=USER, extra_body=kw)
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == "still thinking"
    # a closed channel in the prompt does not count
    kw["chat_template_kwargs"]["fake_suffix"] = "<|channel>thought\nx<channel|>"
    engine.reply = "Plain.<turn|>"
    r = client.chat.completions.create(model="fake-gemma", messages=USER, extra_body=kw)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (None, "Plain.")


def test_thinking_off_hides_thought_and_parses_tools(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    engine.reply = "<|channel>thought\nhmm<channel|>" + TOOL_REPLY
    r = client.chat.completions.create(model="fake-gemma", messages=USER, tools=TOOLS,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None) is None and msg.content is None
    assert msg.tool_calls[0].function.name == "get_weather"


def test_history_with_tool_calls_reaches_template(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    messages = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "need weather",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'},
    ]
    client.chat.completions.create(model="fake-gemma", messages=messages, tools=TOOLS)
    sent = engine.render_calls[0]["messages"]
    assert sent[0] == {"role": "developer", "content": "Use tools."}
    assert sent[2]["tool_calls"] == [{"type": "function", "id": "call_1",
                                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert sent[2]["reasoning_content"] == "need weather"
    assert sent[3] == {"role": "tool", "content": '{"temp": 20}', "tool_call_id": "call_1", "name": "get_weather"}


def test_n_choices_and_seeds(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    r = client.chat.completions.create(model="fake-gemma", messages=USER, n=3, seed=10, max_tokens=4)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == "Hell" for c in r.choices)
    assert len({rid for rid, _, _ in engine.calls}) == 3
    assert sorted(p.seed for _, _, p in engine.calls) == [10, 11, 12]
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(engine.calls[0][1])
    chunks = _stream(client, messages=USER, n=2, max_tokens=4)
    for i in range(2):
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) == "Hell"


def test_chat_logprobs(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    r = client.chat.completions.create(model="fake-gemma", messages=USER, max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ["H", "e", "l"]
    assert [t.logprob for t in content] == pytest.approx([-0.1, -0.2, -0.3])
    assert [[x.token for x in t.top_logprobs] for t in content] == [["H", "?"], ["e", "?"], ["l", "?"]]
    assert content[0].bytes == [ord("H")]
    assert engine.calls[0][2].logprobs == 2
    chunks = _stream(client, messages=USER, max_tokens=3, logprobs=True)
    toks = [t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert toks == ["H", "e", "l"]


class _FakeConstrained:
    """Stands in for gemmajax.tools.constrained: records calls, returns marker grammars."""

    class GrammarError(ValueError):
        pass

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def json_object_grammar(self) -> str:
        self.calls.append(("json_object",))
        return "G:json_object"

    def json_schema_grammar(self, schema: dict) -> str:
        self.calls.append(("json_schema", schema))
        if schema.get("type") == "bogus":
            raise self.GrammarError("unknown type 'bogus'")
        return f"G:schema:{json.dumps(schema, sort_keys=True)}"

    def thinking_then(self, grammar: str) -> str:
        return f"G:think+{grammar}"

    def tool_call_grammar(self, tools: list[dict], mode: str, name: str | None, parallel: bool = True) -> str:
        self.calls.append(("tools", [t["function"]["name"] for t in tools], mode, name))
        return f"G:tools:{mode}:{name}"


@pytest.fixture
def fake_constrained(monkeypatch: pytest.MonkeyPatch) -> _FakeConstrained:
    import sys

    import gemmajax.tools
    fake = _FakeConstrained()
    monkeypatch.setitem(sys.modules, "gemmajax.tools.constrained", fake)
    # `from gemmajax.tools import constrained` reads the package attribute once the real module was imported
    monkeypatch.setattr(gemmajax.tools, "constrained", fake, raising=False)
    return fake


def test_grammars_on_sampling_params(client: openai.OpenAI, engine: FakeEngineClient,
                                     fake_constrained: _FakeConstrained) -> None:
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [
        ({"tools": TOOLS, "tool_choice": "required"}, "G:tools:required:None"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "G:tools:named:get_time"),
        ({"tools": TOOLS, "tool_choice": "required", "extra_body": think}, "G:think+G:tools:required:None"),
        ({"response_format": {"type": "json_object"}}, "G:json_object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
         f"G:schema:{json.dumps(schema, sort_keys=True)}"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
          "extra_body": think}, f"G:think+G:schema:{json.dumps(schema, sort_keys=True)}"),
        ({"tools": TOOLS, "tool_choice": "auto"}, None),
        ({"response_format": {"type": "text"}}, None),
    ]
    for i, (kw, expected) in enumerate(cases):
        client.chat.completions.create(model="fake-gemma", messages=USER, **kw)
        assert engine.calls[i][2].grammar == expected, kw
    assert ("tools", ["get_weather", "get_time"], "named", "get_time") in fake_constrained.calls
    assert ("json_schema", schema) in fake_constrained.calls


def test_grammar_errors_are_400(client: openai.OpenAI, fake_constrained: _FakeConstrained) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-gemma", messages=USER, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}})
    assert e.value.body["param"] == "response_format" and "bogus" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-gemma", messages=USER, tools=TOOLS, tool_choice="required",
                                       response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-gemma", messages=USER, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice" and "nope" in e.value.body["message"]


def test_real_constrained_grammar_when_available(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    constrained = pytest.importorskip("gemmajax.tools.constrained")
    client.chat.completions.create(model="fake-gemma", messages=USER, tools=TOOLS, tool_choice="required")
    tools = [json.loads(json.dumps(t)) for t in TOOLS]
    assert engine.calls[0][2].grammar == constrained.tool_call_grammar(tools, "required", None)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.chat.completions.create(model="fake-gemma", messages=USER, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert engine.calls[1][2].grammar == constrained.json_schema_grammar(schema)
