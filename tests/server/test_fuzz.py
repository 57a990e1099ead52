"""Fuzzing the request parser: 500 seeded bad bodies, generated from the request models' JSON schemas, against a
real server. None may get a 5xx or reach the engine; each gets a 4xx in OpenAI's error shape that names the bad
field (where there is one) in `param` and in the message, and the server keeps serving afterwards.

Each case breaks exactly one thing (so the field to name is known), with harmless unknown fields mixed in:
a wrong type, a bad list item, a number out of range (huge magnitudes included), NaN / Infinity, a missing
required field, deep nesting (typed fields, and 10,000 nested lists that no JSON parser should recurse into),
integers of thousands of digits, invalid UTF-8 and lone surrogates inside a string, top-level non-objects,
non-JSON, and two 10 MB bodies.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import re
from typing import Any

import httpx

from gemmajax.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.conftest import make_app, running_server
from tests.server.fake_engine import FakeEngineClient

NUM_CASES = 500
SEED = 20261201
USER = [{"role": "user", "content": "Hi"}]
BASE = {"chat": {"messages": USER}, "completion": {"prompt": "Hi"}}
ROUTE = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
SCHEMA = {"chat": ChatCompletionRequest.model_json_schema(), "completion": CompletionRequest.model_json_schema()}

# Objects inside a request whose own fields are fuzzed too: path -> (a valid body holding it, its $defs name).
NESTED = {
    "chat": {
        "messages.0": ({"messages": [{"role": "assistant", "content": "Hi"}]}, "ChatMessage"),
        "messages.0.content.0": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
                                 "ContentPart"),
        "messages.0.tool_calls.0.function": ({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "FunctionCall"),
        "tools.0": ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "Tool"),
        "tools.0.function": ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
                             "FunctionDefinition"),
        "response_format": ({"messages": USER, "response_format": {"type": "text"}}, "ResponseFormat"),
        "stream_options": ({"messages": USER, "stream": True, "stream_options": {"include_usage": True}},
                           "StreamOptions"),
    },
    "completion": {
        "stream_options": ({"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}},
                           "StreamOptions"),
    },
}

# One value of each JSON kind that pydantic's lax mode cannot coerce to a field that does not accept that kind.
WRONG = {"string": "not-a-valid-value", "integer": 7, "number": 12.5, "boolean": True,
         "object": {"nested": {"x": [1]}}, "array": [1, "two", None], "null": None}


@dataclasses.dataclass
class Case:
    kind: str          # what was broken
    endpoint: str      # "chat" | "completion"
    body: bytes
    status: int        # the expected status
    param: str | None  # the field the error must name (None: there is none, e.g. not JSON)


# --------------------------------------------------------------------------------------------- schema reading
def _deref(s: dict, defs: dict) -> dict:
    while "$ref" in s:
        s = defs[s["$ref"].rsplit("/", 1)[-1]]
    return s


def _alternatives(s: dict, defs: dict) -> list[dict]:
    s = _deref(s, defs)
    if "anyOf" in s:
        return [a for x in s["anyOf"] for a in _alternatives(x, defs)]
    return [s]


def _kinds(s: dict, defs: dict) -> set[str]:
    """The JSON kinds a schema accepts ('enum' for a closed set of strings; everything for Any)."""
    kinds: set[str] = set()
    for alt in _alternatives(s, defs):
        if "enum" in alt or "const" in alt:
            kinds.add("enum")
        elif "type" in alt:
            kinds.add("object" if "properties" in alt else alt["type"])
        else:
            kinds |= set(WRONG) | {"enum"}
    if "properties" in _deref(s, defs):
        kinds.add("object")
    return kinds


def _wrong_values(s: dict, defs: dict) -> list[Any]:
    """Values of a kind the schema rejects (lax coercions — "5" to int, 1 to bool, int to float — excluded)."""
    kinds = _kinds(s, defs)
    out = []
    for kind, value in WRONG.items():
        if kind in kinds or (kind == "string" and "enum" not in kinds and "string" in kinds):
            continue
        if kind == "integer" and "number" in kinds:
            continue
        if kind == "boolean" and kinds & {"integer", "number"}:
            continue
        out.append(value)
    if "enum" in kinds and "string" not in kinds:
        out.append("not-one-of-the-choices")
    return out


def _bad_numbers(s: dict, defs: dict) -> list[Any]:
    """Numbers (and list / string lengths) outside the schema's bounds, huge magnitudes included."""
    out: list[Any] = []
    for alt in _alternatives(s, defs):
        t = alt.get("type")
        if t in ("integer", "number"):
            big = 10**30 if t == "integer" else 1e308
            if "minimum" in alt or "exclusiveMinimum" in alt:
                lo = alt.get("minimum", alt.get("exclusiveMinimum"))
                out += [-big, lo - 1 if t == "integer" else (lo - 0.5 if "minimum" in alt else lo)]
            if "maximum" in alt or "exclusiveMaximum" in alt:
                hi = alt.get("maximum", alt.get("exclusiveMaximum"))
                out += [big, hi + 1 if t == "integer" else hi + 0.5]
        if t == "array" and alt.get("minItems"):
            out.append([])
        if t == "string" and alt.get("minLength"):
            out.append("")
    return out


def _number_fields(s: dict, defs: dict) -> bool:
    return any(alt.get("type") == "number" for alt in _alternatives(s, defs))


def _containers(endpoint: str) -> list[tuple[str, dict, dict]]:
    """(path, valid base body, schema of the object at path): the request itself and its NESTED objects."""
    schema = SCHEMA[endpoint]
    defs = schema.get("$defs", {})
    out = [("", BASE[endpoint], schema)]
    out += [(path, base, defs[name]) for path, (base, name) in NESTED[endpoint].items()]
    return out


# --------------------------------------------------------------------------------------------- body building
def _set(body: dict, path: str, value: Any) -> dict:
    """A deep copy of body with `value` at the dotted path (numeric parts index lists)."""
    body = json.loads(json.dumps(body))
    parts = path.split(".")
    node: Any = body
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return body


def _delete(body: dict, path: str) -> dict:
    body = json.loads(json.dumps(body))
    parts = path.split(".")
    node: Any = body
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    del node[parts[-1]]
    return body


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _with_extras(rng: random.Random, body: dict) -> dict:
    """Add 0-3 unknown fields (they are ignored, so they must not change the outcome)."""
    for _ in range(rng.randrange(4)):
        body[f"x_unknown_{rng.randrange(1000)}"] = rng.choice(list(WRONG.values()) + [list(range(50))])
    return body


def _placeholder_body(rng: random.Random, endpoint: str, path: str | None = None) -> tuple[dict, str]:
    """A valid body and a string field in it (where a raw value is spliced in)."""
    if endpoint == "chat":
        choices = [("messages.0.content", {"messages": [{"role": "user", "content": "@@"}]}),
                   ("model", {"messages": USER, "model": "@@"}),
                   ("messages.0.name", {"messages": [{"role": "user", "content": "Hi", "name": "@@"}]}),
                   ("stop", {"messages": USER, "stop": "@@"})]
    else:
        choices = [("prompt", {"prompt": "@@"}), ("model", {"prompt": "Hi", "model": "@@"}),
                   ("stop", {"prompt": "Hi", "stop": "@@"})]
    where, body = rng.choice(choices) if path is None else next(c for c in choices if c[0] == path)
    return _with_extras(rng, json.loads(json.dumps(body))), where


def _splice(body: dict, raw: bytes) -> bytes:
    """Serialize `body` and put `raw` (bytes) in place of the string "@@"."""
    text = json.dumps(body).encode()
    assert text.count(b'"@@"') == 1, text
    return text.replace(b'"@@"', raw)


def _json_case(rng: random.Random, endpoint: str, kind: str) -> Case:
    """One body with one thing of `kind` broken, in a field (of the request or a nested object) where that
    kind applies."""
    defs = SCHEMA[endpoint].get("$defs", {})
    for _ in range(1000):
        path, base, schema = rng.choice(_containers(endpoint))
        if kind == "missing":
            if not schema.get("required"):
                continue
            where = _join(path, rng.choice(schema["required"]))
            return Case(kind, endpoint, json.dumps(_with_extras(rng, _delete(base, where))).encode(), 400, where)
        name = rng.choice(sorted(schema["properties"]))
        where, field = _join(path, name), schema["properties"][name]
        raw = None
        if kind == "wrong_type":
            values = _wrong_values(field, defs)
        elif kind == "bad_item":  # a list whose item is of a kind the list does not take
            items = {"anyOf": [alt["items"] for alt in _alternatives(field, defs) if alt.get("type") == "array"]}
            values = [[v] for v in _wrong_values(items, defs)] if items["anyOf"] else []
            where = _join(where, "0")
        elif kind == "out_of_range":
            values = _bad_numbers(field, defs)
        elif kind == "non_finite":
            values = ["@@"] if _number_fields(field, defs) else []
            raw = rng.choice([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999"])
        elif kind == "deep_typed":  # nesting the parser takes, where a scalar belongs
            values = [] if _kinds(field, defs) & {"array", "object"} else [
                json.loads("[" * (d := rng.choice([50, 300, 700])) + "1" + "]" * d)]
        else:
            raise AssertionError(kind)
        if not values:
            continue
        body = _with_extras(rng, _set(base, _join(path, name), rng.choice(values)))
        data = json.dumps(body).encode() if raw is None else _splice(body, raw)
        return Case(kind, endpoint, data, 400, where)
    raise AssertionError(f"no field of the {endpoint} request takes a {kind} mutation")


def _raw_case(rng: random.Random, endpoint: str, kind: str) -> Case:
    if kind == "invalid_utf8":
        body, where = _placeholder_body(rng, endpoint)
        bad = rng.choice([b"\xff", b"\xc3\x28", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"])
        return Case(kind, endpoint, _splice(body, b'"ok ' + bad + b' ok"'), 400, where)
    if kind == "lone_surrogate":
        body, where = _placeholder_body(rng, endpoint)
        bad = rng.choice([b"\\ud800", b"\\udfff", b"x\\udc80y", b"\\ud83d"])
        return Case(kind, endpoint, _splice(body, b'"' + bad + b'"'), 400, where)
    if kind == "deep_raw":  # 10,000 nested lists in a field: no parser may recurse that deep
        body, _ = _placeholder_body(rng, endpoint)
        depth = rng.choice([2000, 10_000])
        return Case(kind, endpoint, _splice(body, b"[" * depth + b"]" * depth), 400, None)
    if kind == "huge_digits":  # 5,000 digits: Python's int() refuses them (CVE-2020-10735's limit)
        field = rng.choice(["max_tokens", "seed", "n"])
        body = dict(BASE[endpoint], **{field: "@@"})
        return Case(kind, endpoint, _splice(_with_extras(rng, body), b"9" * rng.choice([4301, 5000, 20000])), 400,
                    None)
    if kind == "bad_arguments":  # a tool call's `arguments` string that is not a JSON object
        raw = rng.choice(["[1, 2]", "5", "null", '"text"', "{bad", "[" * 5000 + "]" * 5000, "9" * 5000, "{\"a\": 1} x"])
        body = {"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": raw}}]}]}
        return Case(kind, "chat", json.dumps(_with_extras(rng, body)).encode(), 400,
                    "messages.0.tool_calls.0.function.arguments")
    if kind == "not_object":
        raw = rng.choice([b"[1, 2]", b'"a string"', b"42", b"null", b"true", b"[]", b'[{"messages": []}]'])
        return Case(kind, endpoint, raw, 400, None)
    if kind == "not_json":
        raw = rng.choice([
            b"", b"   ", b"hello", b"{not json", b'{"messages": [', b"{'single': 'quotes'}", b"messages=hi&n=1",
            b"<xml/>", b'{"a": 1} trailing', b'{"a": 1,}', b"\x00\x01\x02", rng.randbytes(64), rng.randbytes(700),
            b'{"prompt": "unterminated}', b"\xef\xbb\xbf", b"{}" * 3])
        return Case(kind, endpoint, raw, 400, None)
    raise AssertionError(kind)


JSON_KINDS = ["wrong_type", "bad_item", "out_of_range", "non_finite", "missing", "deep_typed"]
RAW_KINDS = ["invalid_utf8", "lone_surrogate", "deep_raw", "huge_digits", "bad_arguments", "not_object", "not_json"]


def fuzz_cases(seed: int = SEED, count: int = NUM_CASES) -> list[Case]:
    rng = random.Random(seed)
    cases = [  # two 10 MB bodies: not JSON at all, and valid JSON whose one bad field is next to 10 MB of text
        Case("10mb", "chat", b"x" * (10 << 20), 400, None),
        Case("10mb", "completion",
             json.dumps({"prompt": "p" * (10 << 20), "temperature": "hot"}).encode(), 400, "temperature"),
    ]
    while len(cases) < count:
        endpoint = rng.choice(["chat", "completion"])
        kind = rng.choice(JSON_KINDS + RAW_KINDS)
        cases.append(_json_case(rng, endpoint, kind) if kind in JSON_KINDS else _raw_case(rng, endpoint, kind))
    return cases


def test_generator_is_seeded_and_covers_every_kind() -> None:
    a, b = fuzz_cases(), fuzz_cases()
    assert [(c.kind, c.body) for c in a] == [(c.kind, c.body) for c in b]
    assert len(a) == NUM_CASES
    assert {c.kind for c in a} == set(JSON_KINDS + RAW_KINDS + ["10mb"])
    assert {c.endpoint for c in a} == {"chat", "completion"}


def test_fuzzed_bodies_get_a_4xx_naming_the_field() -> None:
    engine = FakeEngineClient(max_model_len=1 << 30)  # no prompt is too long: every 400 is the parser's
    outcomes: collections.Counter = collections.Counter()
    failures = []
    with running_server(make_app(engine)) as url, httpx.Client(base_url=url, timeout=60) as http:
        for i, case in enumerate(fuzz_cases()):
            try:
                r = http.post(ROUTE[case.endpoint], content=case.body, headers={"content-type": "application/json"})
            except httpx.HTTPError as e:  # the server dropped the connection: as bad as a 5xx
                failures.append((i, case.kind, case.body[:200], f"{type(e).__name__}: {e}"))
                outcomes[(case.kind, "connection error")] += 1
                continue
            outcomes[(case.kind, r.status_code)] += 1
            problem = _check(case, r)
            if problem:
                failures.append((i, case.kind, case.body[:200], problem))
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/chat/completions", json={"messages": USER})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "Hello there!"
    print("\nfuzz outcomes (kind, status): count")
    for key, n in sorted(outcomes.items(), key=str):
        print(f"  {key}: {n}")
    assert not failures, f"{len(failures)} of {NUM_CASES} cases failed; the first ones:\n" + "\n".join(
        map(repr, failures[:15]))
    assert len(engine.calls) == 1, "a fuzzed body reached the engine"  # only the valid request above


def _check(case: Case, r: httpx.Response) -> str | None:
    """What is wrong with the response to one case, or None."""
    if r.status_code != case.status:
        return f"status {r.status_code}, expected {case.status}: {r.text[:300]}"
    try:
        body = r.json()
    except ValueError:
        return f"not JSON: {r.text[:200]}"
    if set(body) != {"error"} or set(body["error"]) != {"message", "type", "param", "code"}:
        return f"not OpenAI's error shape: {body}"
    err = body["error"]
    if not isinstance(err["message"], str) or not err["message"] or len(err["message"]) > 2000:
        return f"message missing or too long ({len(str(err['message']))} chars)"
    if err["param"] is not None and not re.fullmatch(r"[a-z_]+[a-z0-9_]*(\.([a-z_]+[a-z0-9_]*|[0-9]+))*",
                                                     err["param"]):
        return f"param {err['param']!r} is not a field path"
    if case.param is not None:
        if err["param"] != case.param and not (err["param"] or "").startswith(case.param + "."):
            return f"param {err['param']!r}, expected {case.param!r}: {err['message']}"
        if case.param.split(".")[-1] not in err["message"]:
            return f"message does not name {case.param!r}: {err['message']}"
    return None
