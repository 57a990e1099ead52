"""Grammars that always end: random token walks (tests/tools/walks.py) over the real 262k Gemma vocabulary, on ~20
JSON schemas and on forced tool calls. Every walk must end within 256 tokens, parse, validate against its schema
with the `jsonschema` package (multipleOf read in decimal, see _decimal_multiple_of) and, for compact JSON, hold no
whitespace outside strings. Number, whitespace and free-value bounds are checked where only the grammar can enforce
them: walks that avoid closing (anti_close), and token-by-token masks."""

import datetime
import json
import re
from decimal import Decimal

import jsonschema
import numpy as np
import pytest

from gemmajax.tools import constrained
from gemmajax.tools.constrained import (
    GrammarConstraint,
    GrammarError,
    json_object_grammar,
    json_schema_grammar,
    make_ll_tokenizer,
    tool_call_grammar,
)
from gemmajax.tools.parser import parse_gemma4
from tests.tools.walks import closer_mask, text_of, walk, whitespace_outside_strings

SEEDS = (0, 1, 2)
BUDGET = 256


@pytest.fixture(scope="module")
def tok(gemma4_tokenizer):
    return gemma4_tokenizer


@pytest.fixture(scope="module")
def llt(tok):
    return make_ll_tokenizer(tok)


@pytest.fixture(scope="module")
def closers(tok):
    return closer_mask(tok)


def _decimal_multiple_of(validator, step, instance, schema):
    """multipleOf in decimal arithmetic: jsonschema divides floats (9.99 / 0.01 = 998.99...), which fails values
    that are exact multiples in the JSON text."""
    if validator.is_type(instance, "number") and Decimal(repr(instance)) % Decimal(repr(step)) != 0:
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {step}")


_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"multipleOf": _decimal_multiple_of})


_FORMATS = jsonschema.FormatChecker()  # every format whose checker is importable, plus date-time (RFC 3339)


@_FORMATS.checks("date-time", raises=ValueError)
def _date_time(text):
    if not isinstance(text, str):
        return True
    if not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})", text):
        return False
    datetime.datetime.fromisoformat(text)
    return True


def _openapi(schema):
    """OpenAPI's `nullable: true` as JSON Schema (a null alternative), for the validator."""
    if isinstance(schema, list):
        return [_openapi(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _openapi(v) for k, v in schema.items() if k != "nullable"}
    return {"anyOf": [out, {"type": "null"}]} if schema.get("nullable") is True else out


def _validate(value, schema):
    _Validator(_openapi(schema), format_checker=_FORMATS).validate(value)


def _loads_unique(text):
    """json.loads that fails on a repeated key (a repeat would hide an invalid first value)."""
    def pairs(items):
        keys = [k for k, _ in items]
        assert len(keys) == len(set(keys)), f"repeated key in {text!r}"
        return dict(items)

    return json.loads(text, object_pairs_hook=pairs)


NODE = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                   "maxItems": 2}},
        "required": ["v"]}
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"}}, "required": ["name", "age", "tags", "address"]},
    "weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["city", "unit"]},
    "unbounded_numbers": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "number"}, "c": {"type": "array", "items": {"type": "number"},
                                                                 "maxItems": 4}}, "required": ["a", "b", "c"]},
    "bounded_floats": {"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180},
        "kelvin": {"type": "number", "exclusiveMinimum": -273.15, "maximum": 1e4},
        "p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}, "required": ["lat", "lon", "kelvin", "p"]},
    "enum_const": {"type": "object", "properties": {
        "kind": {"const": "point"}, "color": {"enum": ["red", "green", 1, None, True, {"rgb": [1, 2, 3]}]}},
        "required": ["kind", "color"]},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "string", "maxLength": 5}, {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}},
        "required": ["value"]},
    "one_of_tagged": {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "exclusiveMinimum": 0,
                                                                               "maximum": 100}},
         "required": ["kind", "r"]},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1}},
         "required": ["kind", "side"]}]}}, "required": ["shape"]},
    "ref_tree": {"$defs": {"node": NODE}, "$ref": "#/$defs/node"},
    "string_bounds": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
        "nick": {"type": "string", "minLength": 3, "maxLength": 8},
        "slug": {"type": "string", "pattern": "^[a-z0-9-]+$", "maxLength": 12},
        "note": {"type": "string", "pattern": "^ok"}}, "required": ["code", "nick", "slug", "note"]},
    "all_optional": {"type": "object", "properties": {
        "a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"}}},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1}, "label": {"type": "string",
                                                                                              "maxLength": 8}},
        "required": ["id", "label"]}},
    "matrix": {"type": "object", "properties": {"m": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}},
        "required": ["m"]},
    "tuple": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 6}, {"type": "integer"},
                                               {"type": "boolean"}], "items": False, "minItems": 2},
    "type_lists": {"type": "object", "properties": {"x": {"type": ["string", "null"], "maxLength": 4},
                                                    "y": {"type": ["integer", "boolean"]}}, "required": ["x", "y"]},
    "all_of": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}},
                          "required": ["a"]},
                         {"properties": {"a": {"maximum": 10}, "b": {"type": "string", "maxLength": 3}}}]},
    "free_map": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 99}},
    "json_object": {"type": "object"},
    "formats": {"type": "object", "properties": {
        "day": {"type": "string", "format": "date"}, "at": {"type": "string", "format": "date-time"},
        "id": {"type": "string", "format": "uuid"}}, "required": ["day", "at", "id"]},
    "multiples": {"type": "object", "properties": {
        "price": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.01},
        "qty": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5},
        "half": {"type": "number", "minimum": -2, "maximum": 2, "multipleOf": 0.5}}, "required": ["price", "qty",
                                                                                                   "half"]},
    "top_level_integer": {"type": "integer", "minimum": -1000, "maximum": 1000},
    "required_without_properties": {"type": "object", "required": ["id"], "maxProperties": 3,
                                    "additionalProperties": {"type": "string", "maxLength": 4}},
    "nullable_extra": {"type": "object", "properties": {"n": {"type": "integer", "nullable": True}},
                       "required": ["n"], "additionalProperties": True},
}


def _check_json(text: str, schema, whitespace="compact"):
    value = _loads_unique(text)
    _validate(value, schema)
    if whitespace == "compact":
        assert not whitespace_outside_strings(text), f"whitespace outside strings in {text!r}"
    return value


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_walks_end_valid(tok, llt, closers, name):
    schema = SCHEMAS[name]
    grammar = json_schema_grammar(schema)
    for seed in SEEDS:
        c = GrammarConstraint(llt, grammar)
        ids, ended = walk(c, closers, seed, budget=BUDGET)
        text = text_of(tok, ids)
        assert ended, f"{name} seed {seed}: no end within {BUDGET} tokens: {text[:300]!r}"
        try:
            _check_json(text, schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{name} seed {seed}: {text!r} is not valid: {e}") from None


def test_nullable_is_honoured(llt, tok):
    """The walks above need not pick null for an OpenAPI `nullable` field; the grammar must allow it."""
    c = GrammarConstraint(llt, json_schema_grammar(SCHEMAS["nullable_extra"]))
    for t in tok.encode('{"n":null}'):
        assert c.allowed_mask()[t]
        c.advance(t)


@pytest.mark.parametrize("name", ["person", "bounded_floats", "any_of", "array_of_objects"])
def test_flexible_whitespace_walks(tok, llt, closers, name):
    """Opt-in whitespace stays within max_whitespace at every gap and the output is still valid."""
    schema = SCHEMAS[name]
    grammar = json_schema_grammar(schema, whitespace="flexible", max_whitespace=3)
    for seed in SEEDS:
        c = GrammarConstraint(llt, grammar)
        ids, ended = walk(c, closers, seed, budget=BUDGET)
        text = text_of(tok, ids)
        assert ended, f"{name} seed {seed}: no end within {BUDGET} tokens: {text[:300]!r}"
        _check_json(text, schema, whitespace="flexible")
        runs = [len(m.group()) for m in re.finditer(r"\s+", _strip_strings(text))]
        assert max(runs, default=0) <= 3, f"{name}: a whitespace run longer than 3 in {text!r}"


def _strip_strings(text):
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


# --------------------------------------------------------------------------------------------------------------------
# Bounds that only the grammar can enforce

# Schemas where everything is bounded except what the defaults bound: numbers, whitespace, nesting (no strings).
BOUNDED = {
    "numbers": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"},
                                                 "c": {"type": "number", "minimum": 0}},
                "required": ["a", "b", "c"]},
    "number_array": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    "nested": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": {
        "type": "integer", "maximum": 10**20}}},
}


@pytest.mark.parametrize("name", sorted(BOUNDED))
@pytest.mark.parametrize("whitespace", ["compact", "flexible"])
def test_anti_closing_walks_still_end(tok, llt, closers, name, whitespace):
    """A walk that never closes while it can continue ends only because digits and whitespace are bounded."""
    schema = BOUNDED[name]
    for seed in SEEDS:
        c = GrammarConstraint(llt, json_schema_grammar(schema, whitespace=whitespace, max_whitespace=4))
        ids, ended = walk(c, closers, seed, budget=1024, anti_close=True)
        text = text_of(tok, ids)
        assert ended, f"{name} ({whitespace}): no end within 1024 tokens: {text[:300]!r}"
        _check_json(text, schema, whitespace)


def _longest_run(llt, tok, grammar, prefix, piece):
    """How many `piece` tokens the grammar accepts in a row after `prefix` (up to 300)."""
    c = GrammarConstraint(llt, grammar)
    for t in tok.encode(prefix):
        c.advance(t)
    (t,) = tok.encode(piece)
    n = 0
    while n < 300 and c.allowed_mask()[t]:
        c.advance(t)
        n += 1
    return n


@pytest.mark.parametrize("schema,prefix,piece,expected", [
    ({"type": "integer"}, "", "9", constrained.INT_DIGITS),
    ({"type": "integer"}, "-", "9", constrained.INT_DIGITS),
    ({"type": "integer", "minimum": 10**20}, "1", "0", 20),  # an explicit bound moves the other side's default
    ({"type": "integer", "maximum": 10**30}, "", "9", 30),
    ({"type": "number"}, "", "9", constrained.INT_DIGITS),
    ({"type": "number"}, "0.", "3", constrained.FRAC_DIGITS),
    ({"type": "number", "minimum": 0, "maximum": 1e-15}, "0.", "0", 16),  # room for the bound's digits, + 1
    ({"type": "number"}, "1e", "9", constrained.EXP_DIGITS),
    ({"type": "number", "minimum": 0}, "1", "e", 0),  # no exponent with a bound
    ({"type": "number", "multipleOf": 0.01}, "0.", "5", 2),
    ({"type": "object"}, '{"a":', "[", constrained.FREE_DEPTH - 1),  # the object is the first level
    ({"type": "array"}, "", "[", constrained.FREE_DEPTH),
    ({"type": "object"}, "{", "\u2581", 0),
])
def test_grammar_bounds(llt, tok, schema, prefix, piece, expected):
    got = _longest_run(llt, tok, json_schema_grammar(schema), prefix, piece)
    assert got == expected, f"{schema} after {prefix!r}: {got} x {piece!r} allowed, expected {expected}"


def test_tool_argument_bounds(llt, tok):
    S = '<|"|>'
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number", "maximum": 5}, "s": {"type": "string", "maxLength": 24},
        "free": {}}, "required": ["n", "x", "s", "free"]}}}]
    g = tool_call_grammar(tools)
    assert _longest_run(llt, tok, g, "<|tool_call>call:f{free:0,n:", "9") == constrained.INT_DIGITS
    assert _longest_run(llt, tok, g, "<|tool_call>call:f{free:0,n:1,s:" + S, "a") == 24
    assert _longest_run(llt, tok, g, "<|tool_call>call:f{free:0,n:1,s:" + S + S + ",x:-", "9") == \
        constrained.INT_DIGITS
    assert _longest_run(llt, tok, g, "<|tool_call>call:f{free:", "[") == constrained.FREE_DEPTH
    assert _longest_run(llt, tok, g, "<|tool_call>call:f{", "\u2581") == 0  # no whitespace anywhere


# --------------------------------------------------------------------------------------------------------------------
# Tool calls: every call of every response checked against its own tool's schema

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "unit"]}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "properties": {
        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
        "repeat": {"type": "array", "items": {"enum": ["mon", "tue", "sun"]}, "minItems": 1, "maxItems": 2},
        "options": {"$ref": "#/$defs/options"},
        "label": {"anyOf": [{"type": "string", "minLength": 2, "maxLength": 8}, {"type": "null"}]},
        "my key": {"type": "boolean"}},
    "required": ["time", "repeat", "options", "my key"],
    "$defs": {"options": {"type": "object", "properties": {
        "volume": {"type": "number", "minimum": 0, "maximum": 1}, "vibrate": {"type": "boolean"},
        "level": {"const": 3}}, "required": ["volume", "vibrate", "level"]}}}}}
NOARGS = {"type": "function", "function": {"name": "get_time"}}  # no parameters: `{}` only
LOG = {"type": "function", "function": {"name": "log", "parameters": {"type": "object"}}}  # any arguments
TOOLS = [WEATHER, ALARM, NOARGS, LOG]
PARAMS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "additionalProperties": False})
          for t in TOOLS}


def check_tool_text(text: str, names: set[str], parallel: bool) -> int:
    """Parse a tool-call output and validate every call; returns the number of calls."""
    assert text.endswith("<|tool_response>"), f"no <|tool_response> at the end of {text[-120:]!r}"
    msg = parse_gemma4(text)
    assert msg.tool_calls, f"no tool call parsed from {text!r}"
    assert msg.content is None, f"content {msg.content!r} beside the calls in {text!r}"
    assert text.count("<|tool_call>") == len(msg.tool_calls), f"calls lost by the parser in {text!r}"
    if not parallel:
        assert len(msg.tool_calls) == 1, f"{len(msg.tool_calls)} calls with parallel=False: {text!r}"
    for i, tc in enumerate(msg.tool_calls):
        name = tc["function"]["name"]
        assert name in names, f"call {i}: tool {name!r} not in {sorted(names)}"
        try:
            _validate(json.loads(tc["function"]["arguments"]), PARAMS[name])
        except jsonschema.ValidationError as e:
            raise AssertionError(f"call {i} ({name}) of {text!r} breaks its schema: {e.message}") from None
    return len(msg.tool_calls)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("mode,name", [("required", None), ("named", "get_weather"), ("named", "set_alarm"),
                                       ("named", "log")])
def test_tool_call_walks(tok, llt, closers, mode, name, parallel):
    grammar = tool_call_grammar(TOOLS, mode, name, parallel=parallel)
    names = {name} if name else set(PARAMS)
    # Parallel: the number of calls is the model's choice (for this walk a coin flip after each call, 3 in 8 make
    # another), so more seeds and a budget of 4 x 256 for all the calls together.
    counts, budget = [], 4 * BUDGET if parallel else BUDGET
    for seed in range(8) if parallel else SEEDS:
        c = GrammarConstraint(llt, grammar)
        ids, ended = walk(c, closers, seed, budget=budget, p_close=0.25)
        text = text_of(tok, ids)
        assert ended, f"{mode} {name} parallel={parallel} seed {seed}: no end within {budget}: {text[:300]!r}"
        counts.append(check_tool_text(text, names, parallel))
    if parallel:
        assert max(counts) > 1, f"parallel walks never made a second call: {counts}"


def test_second_call_held_to_schema(llt, tok):
    """The repetition of calls is a repetition of the per-tool rules: a second call cannot drop a required key or
    overrun a bound even after a valid first call."""
    S = '<|"|>'
    g = tool_call_grammar([WEATHER])
    ok = f"<|tool_call>call:get_weather{{city:{S}Paris{S},unit:{S}celsius{S}}}<tool_call|>"
    for second in (f"<|tool_call>call:get_weather{{city:{S}Oslo{S}}}<tool_call|>",
                   f"<|tool_call>call:get_weather{{city:{S}{'x' * 25}{S},unit:{S}celsius{S}}}<tool_call|>",
                   f"<|tool_call>call:get_weather{{city:{S}Oslo{S},days:15,unit:{S}celsius{S}}}<tool_call|>"):
        c = GrammarConstraint(llt, g)
        ids = tok.encode(ok + second + "<|tool_response>")
        accepted = True
        for t in ids:
            if not c.allowed_mask()[t]:
                accepted = False
                break
            c.advance(t)
        assert not accepted, f"second call accepted: {second!r}"


# --------------------------------------------------------------------------------------------------------------------
# Number regexes against brute force (Python re reads them as llguidance does)


def test_int_range_regex():
    rng = np.random.default_rng(0)
    cases = [(0, 0), (-5, 5), (-100, -7), (7, 1000), (-999, 0), (19, 2001)]
    cases += [tuple(sorted(rng.integers(-3000, 3000, 2).tolist())) for _ in range(200)]
    for lo, hi in cases:
        rx = re.compile(f"(?:{constrained._int_range(lo, hi)})")
        for v in range(-3100, 3100):
            assert bool(rx.fullmatch(str(v))) == (lo <= v <= hi), (lo, hi, v)
        assert not rx.fullmatch("-0") and not rx.fullmatch("01")


def test_decimal_range_regex():
    texts = ["0", "-0", "-0.0"]
    for i in range(13):
        for sign in ("", "-"):
            texts.append(f"{sign}{i}")
            texts += [f"{sign}{i}.{f:0{k}d}" for k in (1, 2, 3) for f in range(10**k)]
    bounds = ["0", "1", "2", "11", "0.5", "0.25", "0.05", "0.001", "1.999", "2.5", "3.14", "10.01", "12"]
    rng = np.random.default_rng(1)
    for _ in range(60):
        lo, hi = sorted([Decimal(str(rng.choice(bounds))) * int(rng.choice([1, -1])) for _ in range(2)])
        lo_s, hi_s, n = bool(rng.random() < 0.5), bool(rng.random() < 0.5), int(rng.choice([2, 3]))
        r = constrained._dec_range(lo, lo_s, hi, hi_s, n)
        rx = re.compile(f"(?:{r})") if r else None
        for t in texts:
            v = Decimal(t)
            frac = len(t.partition(".")[2])
            want = ((lo < v) if lo_s else (lo <= v)) and ((v < hi) if hi_s else (v <= hi)) and frac <= n and not (
                t.startswith("-") and v == 0)
            assert bool(rx and rx.fullmatch(t)) == want, (str(lo), lo_s, str(hi), hi_s, n, t)


# --------------------------------------------------------------------------------------------------------------------
# Errors name the JSON path


@pytest.mark.parametrize("schema,path,what", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "#/properties/a/not", "'not'"),
    ({"type": "array", "items": {"type": "string", "pattern": "(?<=a)b"}}, "#/items/pattern", "(?<=a)b"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 4}}}, "#/properties/a",
     "between"),
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "#/properties/a/type", "strin"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "#/patternProperties", "patternProperties"),
    ({"type": "integer", "multipleOf": 7}, "#/multipleOf", "multipleOf"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "#/properties/a", "does not resolve"),
])
def test_unsupported_schema_names_path(schema, path, what):
    with pytest.raises(GrammarError) as e:
        json_schema_grammar(schema)
    assert f"at {path}:" in str(e.value) and what in str(e.value), str(e.value)
    params = {"type": "object", "properties": {"p": schema}}
    with pytest.raises(GrammarError, match=re.escape(f"tool t parameters at #/properties/p{path[1:]}:")):
        tool_call_grammar([{"type": "function", "function": {"name": "t", "parameters": params}}])


def test_lenient_ignores_unsupported(llt):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 3}}}, "required": ["a"]}
    GrammarConstraint(llt, json_schema_grammar(schema, lenient=True))


def test_json_object_grammar_is_bounded_schema():
    assert json_object_grammar() == json_schema_grammar({"type": "object"})
