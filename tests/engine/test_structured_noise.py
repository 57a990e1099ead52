"""Structured output always completes, thinking on or off: a tiny random Gemma 4 over the real 262,144-token
vocabulary is a noise model (anything valid it emits is the constraint's doing), sampled at temperature 1.0.

20 schemas x thinking off / on x 3 seeds through LLM.chat (the server's chat rules, engine/chat.py): every answer
is valid JSON for its schema with finish_reason "stop" within max_tokens 256. With thinking on the thought is
closed at half of max_tokens (no budget given), so the answer gets the other half. Tool calls: tool_choice
auto / required / named x parallel on / off x thinking off / on, every call validated against its own tool's
schema. The schemas are bounded (every string has a maxLength, an enum, a format or a closed pattern), so the
grammar alone guarantees an end within the budget: a noise model left an unbounded string never closes it (it
picks the closing quote with probability ~1 / 262,144), which no constraint can change.
"""
import json

import jsonschema
import pytest

import gemmajax
from tests.golden.hf_models import save_real_vocab_checkpoint
from tests.tools.test_bounded_walks import ALARM, NOARGS, PARAMS, SCHEMAS, WEATHER, _validate

UNBOUNDED = ("string_bounds", "all_optional", "free_map", "json_object", "required_without_properties",
             "nullable_extra", "unbounded_numbers")
MORE = {
    "order": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 6}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"]}},
        "paid": {"type": "boolean"}}, "required": ["id", "items", "paid"]},
    "event": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 16}, "when": {"type": "string", "format": "date"},
        "priority": {"enum": ["low", "mid", "high"]},
        "notes": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 10}}},
        "required": ["title", "when"]},
    "optional_fields": {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 5}, "b": {"type": "integer", "minimum": 0, "maximum": 50},
        "c": {"type": "boolean"}, "d": {"enum": [1, 2, 3]}}, "additionalProperties": False},
    "nested_any_of": {"type": "object", "properties": {"result": {"anyOf": [
        {"type": "object", "properties": {"ok": {"const": True}, "value": {"type": "number", "minimum": 0,
                                                                             "maximum": 1}},
         "required": ["ok", "value"]},
        {"type": "object", "properties": {"ok": {"const": False}, "error": {"type": "string", "maxLength": 12}},
         "required": ["ok", "error"]}]}}, "required": ["result"]},
    "coords": {"type": "array", "minItems": 2, "maxItems": 5, "items": {
        "type": "array", "prefixItems": [{"type": "number", "minimum": -90, "maximum": 90},
                                         {"type": "number", "minimum": -180, "maximum": 180}],
        "items": False, "minItems": 2}},
}
NOISE_SCHEMAS = {**{k: v for k, v in SCHEMAS.items() if k not in UNBOUNDED}, **MORE}
TOOLS = [WEATHER, ALARM, NOARGS]


@pytest.fixture(scope="module")
def llm(tmp_path_factory, gguf_file):
    d = save_real_vocab_checkpoint(str(tmp_path_factory.mktemp("noise")), gguf_file, "31b", seed=3)
    return gemmajax.LLM(d, dtype="float32", max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256,
                        page_size=16, kv_cache_memory=1 << 27, token_buckets=(64, 256), seq_buckets=(8, 32))


@pytest.mark.parametrize("seeds", [pytest.param((0,), id="one-seed"),   # make test: 40 answers
                                   pytest.param((0, 1, 2), id="three-seeds", marks=pytest.mark.slow)])  # 120
def test_twenty_schemas_always_complete(llm, seeds):
    assert len(NOISE_SCHEMAS) == 20
    names = [n for n in NOISE_SCHEMAS for _ in seeds]
    convs = [[{"role": "user", "content": f"Give me a {n} as JSON"}] for n in names]
    params = [gemmajax.SamplingParams(max_tokens=256, temperature=1.0, seed=seeds[i % len(seeds)],
                                      json_schema=NOISE_SCHEMAS[n]) for i, n in enumerate(names)]
    bad = []
    for thinking in (False, True):
        for n, o in zip(names, llm.chat(convs, params, enable_thinking=thinking)):
            try:
                assert o.finish_reason == "stop", f"finish_reason {o.finish_reason}"
                _validate(json.loads(o.content), NOISE_SCHEMAS[n])
                if thinking:   # the thought came first and was closed at half of max_tokens
                    assert o.reasoning_content is not None and o.num_reasoning_tokens == 128, o.num_reasoning_tokens
            except (AssertionError, ValueError, jsonschema.ValidationError) as e:
                bad.append((n, thinking, str(e)[:200], (o.content or "")[:200]))
    assert not bad, f"{len(bad)} of {2 * len(names)} answers invalid: {bad}"


def _check_calls(o, names, parallel):
    calls = o.tool_calls
    assert o.finish_reason == "tool_calls" and calls, (o.finish_reason, o.text[:300])
    if not parallel:
        assert len(calls) == 1, len(calls)
    for c in calls:
        assert c["function"]["name"] in names, c
        _validate(json.loads(c["function"]["arguments"]), PARAMS[c["function"]["name"]])


@pytest.mark.parametrize("thinking", [pytest.param(False, marks=pytest.mark.slow), True])
def test_tool_calls_hold_every_schema(llm, thinking):
    """required / named: a call (exactly one without parallel calls) valid for its own tool, every call of a
    parallel answer too. auto: free to answer in text (a noise model does), and the answer ends."""
    conv = [{"role": "user", "content": "Set an alarm and tell me the weather in Oslo"}]
    bad = []
    for mode, name in (("auto", None), ("required", None), ("named", "set_alarm")):
        for parallel in (True, False):
            tc = {"type": "function", "function": {"name": name}} if mode == "named" else mode
            outs = llm.chat([conv, conv], [gemmajax.SamplingParams(max_tokens=256, temperature=1.0, seed=s)
                                           for s in (0, 1)],
                            tools=TOOLS, enable_thinking=thinking, tool_choice=tc, parallel_tool_calls=parallel)
            for o in outs:
                try:
                    if mode == "auto":
                        assert o.finish_reason in ("stop", "length", "tool_calls"), o.finish_reason
                        continue
                    _check_calls(o, {name} if name else {t["function"]["name"] for t in TOOLS}, parallel)
                    if thinking:
                        assert o.reasoning_content is not None and o.num_reasoning_tokens == 128
                except (AssertionError, ValueError, jsonschema.ValidationError) as e:
                    bad.append((mode, name, parallel, str(e)[:200], o.text[:200]))
    assert not bad, f"{len(bad)} invalid: {bad}"
