"""The real server over the real engine: a tiny random Gemma 4 with the real 262,144-token vocabulary, the
official openai client, and constrained decoding that must hold even for a model that emits noise."""
from __future__ import annotations

import json
import os

import openai
import pytest

from gemmajax.engine.async_engine import AsyncEngineClient
from gemmajax.engine.llm import LLM
from gemmajax.server.app import build_app
from tests.server.conftest import running_server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}]
SCHEMA = {"type": "object", "properties": {  # bounded, so that even a noise model must finish the object
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, gguf_file):
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from gemmajax.tools.tokenizer import gguf_to_gemma4_sp
    from tests.golden.hf_models import _period, _randomize
    cfg = Gemma4TextConfig(vocab_size=262144, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, global_head_dim=64,
                           sliding_window=16, layer_types=_period(4, 2), hidden_size_per_layer_input=0,
                           final_logit_softcapping=30.0, eos_token_id=[1, 106])
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg)
    _randomize(model, 0)
    d = tmp_path_factory.mktemp("tiny_real_vocab")
    model.save_pretrained(d)
    (d / "tokenizer.model").write_bytes(gguf_to_gemma4_sp(gguf_file))
    return str(d)


@pytest.fixture(scope="module")
def server(ckpt):
    llm = LLM(ckpt, dtype="float32", kv_dtype="float32", max_model_len=512, max_num_seqs=4,
              max_num_batched_tokens=128, kv_cache_memory=1 << 24)
    client = AsyncEngineClient(llm.engine, model_name="tiny-gemma4", chat_template=llm.chat_template(),
                               tokenizer=llm.tokenizer)
    with running_server(build_app(client)) as url:
        yield url, llm, client
    client.shutdown()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0, timeout=120)


def _valid(obj, schema):
    assert isinstance(obj, dict)
    for k in schema.get("required", []):
        assert k in obj, (k, obj)
    for k, v in obj.items():
        t = schema["properties"][k]
        if t["type"] == "string":
            assert isinstance(v, str) and len(v) <= t.get("maxLength", len(v))
            if "enum" in t:
                assert v in t["enum"]
        elif t["type"] == "integer":
            assert isinstance(v, int) and not isinstance(v, bool)
            assert t.get("minimum", v) <= v <= t.get("maximum", v)
        elif t["type"] == "array":
            assert isinstance(v, list) and all(isinstance(x, str) for x in v)


def test_models_chat_stream_and_completions(server, oai):
    url, llm, _ = server
    assert [m.id for m in oai.models.list().data] == ["tiny-gemma4"]
    r = oai.chat.completions.create(model="tiny-gemma4", messages=[{"role": "user", "content": "Hi"}],
                                    max_tokens=8, temperature=0)
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 5
    assert r.choices[0].finish_reason == "length"
    # greedy through the server equals greedy through the offline engine on the same prompt
    ids = llm.render_chat([{"role": "user", "content": "Hi"}])
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(oai.chat.completions.create(model="tiny-gemma4", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=8, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8
    c = oai.completions.create(model="tiny-gemma4", prompt="The capital of France is", max_tokens=5, temperature=0)
    assert c.usage.completion_tokens == 5 and c.choices[0].finish_reason == "length"


def _free_thought_only(r):
    """With thinking on, a random model never closes its (unconstrained) thought channel: all it may produce
    is reasoning, never content or a malformed call outside the grammar."""
    ch = r.choices[0]
    assert ch.finish_reason == "length", ch
    assert not ch.message.content and not ch.message.tool_calls, ch
    assert ch.message.model_extra.get("reasoning_content"), ch


def test_tool_choice_required_gives_a_valid_call_even_from_noise(oai):
    for seed in (1, 2):
        r = oai.chat.completions.create(
            model="tiny-gemma4", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
            tool_choice="required", max_tokens=200, temperature=0.8, seed=seed, parallel_tool_calls=False)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        assert len(ch.message.tool_calls) == 1
        call = ch.message.tool_calls[0]
        assert call.function.name == "get_weather"
        _valid(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    r = oai.chat.completions.create(
        model="tiny-gemma4", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice="required", max_tokens=24, temperature=0.8, seed=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    _free_thought_only(r)


def test_json_schema_enforced_with_thinking_off_and_on(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    for seed in (2, 3):
        r = oai.chat.completions.create(
            model="tiny-gemma4", messages=[{"role": "user", "content": "A person as JSON"}], max_tokens=500,
            temperature=0.7, seed=seed, response_format=fmt)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", msg
        _valid(json.loads(msg.content), SCHEMA)
    r = oai.chat.completions.create(
        model="tiny-gemma4", messages=[{"role": "user", "content": "A person as JSON"}], max_tokens=24,
        temperature=0.7, seed=2, response_format=fmt, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    _free_thought_only(r)


def test_bad_requests_do_not_hurt_the_server(server, oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny-gemma4", messages=[{"role": "user", "content": "x " * 600}],
                                    max_tokens=4)
    assert "512" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="tiny-gemma4", messages=[{"role": "user", "content": "x"}],
                                    temperature=-1)
    r = oai.chat.completions.create(model="tiny-gemma4", messages=[{"role": "user", "content": "ok"}], max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_named_tool_choice(oai):
    r = oai.chat.completions.create(
        model="tiny-gemma4", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS + [
            {"type": "function", "function": {"name": "get_time", "parameters": {
                "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["tz"]}}}],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=100, temperature=0.9, seed=4,
        parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls[0].function.name == "get_time"
    assert json.loads(ch.message.tool_calls[0].function.arguments)["tz"] in ("UTC", "CET")


def test_sixteen_concurrent_streams_and_a_disconnect(server, oai):
    import threading
    import time

    import httpx
    url, llm, client = server
    results, errors = {}, []

    def one(i):
        try:
            chunks = list(oai.chat.completions.create(
                model="tiny-gemma4", messages=[{"role": "user", "content": f"Story number {i}"}], max_tokens=12,
                temperature=0.5, seed=i, stream=True))
            results[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    # a client that goes away mid-stream
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-gemma4", "messages": [{"role": "user", "content": "long"}], "max_tokens": 400,
            "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(results) == 16
    eng = llm.engine
    deadline = time.time() + 30
    while time.time() < deadline and (eng.scheduler.has_unfinished() or eng._reqs):
        time.sleep(0.1)
    assert not eng.scheduler.has_unfinished()
    bm = eng.block_manager
    assert all(bm.num_free_pages(g.name) == g.num_pages - 1 for g in bm.groups)
    r = oai.chat.completions.create(model="tiny-gemma4", messages=[{"role": "user", "content": "still here?"}],
                                    max_tokens=3)
    assert r.usage.completion_tokens == 3
