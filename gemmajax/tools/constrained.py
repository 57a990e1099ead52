"""Constrained decoding with llguidance: per-request token masks from grammars over the Gemma vocabulary.

Design: every grammar is a Lark source string in llguidance's dialect, so grammars compose (`thinking_then` wraps any
of them behind a free thought channel). JSON schemas are compiled by llguidance itself (`%json`); tool-call arguments
in Gemma 4 syntax are translated here from each tool's JSON schema into Lark rules. Special tokens (`<|tool_call>`,
`<|"|>`, `<|channel>`, ...) are single special tokens in the grammar, never their spelling in ordinary text.

Subset of JSON schema enforced inside tool arguments (`tool_call_grammar`): type (one or a list), properties in a
fixed order (required keys present, optional keys may be left out, no other keys; by default sorted
case-insensitively, the order in which the Gemma 4 chat template writes arguments, `dictsort`), required keys
without a property schema (any value), additionalProperties for objects without properties (a schema, or false for
`{}`), items, minItems/maxItems, enum, const, anyOf/oneOf, allOf (merged shallowly), local $ref (`#/...`, recursion
allowed), booleans `true`/`false` schemas. Not enforced (any value of the type is accepted): string
minLength/maxLength/pattern/format, numeric minimum/maximum/multipleOf, uniqueItems, prefixItems, patternProperties,
dependencies, if/then/else, not. Keys are written bare when they look like identifiers, else wrapped in `<|"|>`.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import llguidance
import llguidance.numpy
import numpy as np

from gemmajax.tools.parser import SPECIAL_TAG_RE, STOP_TAGS

__all__ = [
    "GrammarConstraint",
    "GrammarError",
    "batch_bitmask",
    "expand_bitmask",
    "json_object_grammar",
    "json_schema_grammar",
    "make_ll_tokenizer",
    "thinking_then",
    "tool_call_grammar",
]


class GrammarError(ValueError):
    """A grammar or schema that cannot be compiled (the server answers HTTP 400 with this message)."""


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer

_HTML_TAG_RE = re.compile(r"</?[a-z][a-z0-9]*>")  # `<table>`, `</b>`: ordinary text tokens in the Gemma vocabulary
_LL_CACHE: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()


def _token_name(tokenizer: Any, i: int) -> str:
    if hasattr(tokenizer, "id_to_piece"):
        return tokenizer.id_to_piece(i)
    return tokenizer.token_bytes(i).decode("utf-8", errors="replace")


def make_ll_tokenizer(tokenizer: Any, *, eos_ids: Iterable[int] | None = None) -> llguidance.LLTokenizer:
    """Wrap our Tokenizer for llguidance (cached per tokenizer object; building takes about a second).

    Args:
        tokenizer: provides `vocab_size`, `token_bytes(i) -> bytes`, `eos_id`, `special_ids`, `encode(text,
            add_bos=False)`, and optionally `id_to_piece(i)` and `stop_ids`.
        eos_ids: the tokens that end a grammar's output. Default: `eos_id` plus the tokenizer's `stop_ids` except
            `<|tool_response>` (which tool grammars name explicitly), e.g. `<eos>` and `<turn|>`.
    Returns:
        llguidance.LLTokenizer with vocab_size == tokenizer.vocab_size. Special tokens are those whose name is a Gemma
        special tag (`<|x>`, `<x|>`, `<|x|>`, `<eos>`, `<unusedN>`, ...) or that the tokenizer lists in special_ids,
        except whitespace and HTML tags (ordinary text in this vocabulary); grammars name them as `<|tool_call>` or
        `<[48]>`.
    """
    if eos_ids is None:
        try:
            return _LL_CACHE[tokenizer]
        except (KeyError, TypeError):
            pass
    vocab_size = int(tokenizer.vocab_size)
    listed = set(getattr(tokenizer, "special_ids", ()) or ())
    tokens: list[bytes] = []
    special: list[int] = []
    for i in range(vocab_size):
        name = _token_name(tokenizer, i)
        if SPECIAL_TAG_RE.fullmatch(name) or (i in listed and name.strip() and not _HTML_TAG_RE.fullmatch(name)):
            special.append(i)
            tokens.append(name.encode("utf-8"))
        else:
            tokens.append(bytes(tokenizer.token_bytes(i)))
    if eos_ids is None:
        stop = [tokenizer.eos_id] + sorted(getattr(tokenizer, "stop_ids", ()) or ())
        eos_ids = [i for i in dict.fromkeys(stop) if _token_name(tokenizer, i) != "<|tool_response>"]
    eos_ids = [int(i) for i in eos_ids]

    class _Wrapped:  # the duck type llguidance.TokenizerWrapper reads
        eos_token_id = eos_ids[0]
        bos_token_id = getattr(tokenizer, "bos_id", None)
        special_token_ids = special

        def __call__(self, text: str | bytes) -> list[int]:
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            return list(tokenizer.encode(text, add_bos=False))

    wrapped = _Wrapped()
    wrapped.tokens = tokens
    ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapped), n_vocab=vocab_size, eos_token=eos_ids)
    try:
        _LL_CACHE[tokenizer] = ll
    except TypeError:  # not weak-referenceable: no cache
        pass
    return ll


# --------------------------------------------------------------------------------------------------------------------
# Grammars (Lark source strings)


def json_object_grammar(*, max_whitespace: int | None = 32) -> str:
    """Any JSON object (OpenAI `response_format: {"type": "json_object"}`); see json_schema_grammar."""
    return json_schema_grammar({"type": "object"}, max_whitespace=max_whitespace)


def json_schema_grammar(schema: dict | bool | str, *, lenient: bool = False, max_whitespace: int | None = 32) -> str:
    """JSON text valid against `schema` (compiled by llguidance when the constraint is built).

    Args:
        schema: a JSON schema as a dict (or bool), or its JSON text.
        lenient: ignore keywords llguidance does not implement instead of failing (sets `x-guidance.lenient`).
        max_whitespace: the most whitespace characters allowed between two JSON tokens (0: compact JSON; None:
            unbounded, llguidance's default). Bounded by default so a weak model cannot loop on whitespace; room for
            pretty-printed JSON. An `x-guidance` object in the schema overrides these options.
    Raises:
        GrammarError: schema is not JSON or not an object/boolean. Unsupported or invalid schema contents are
        reported by GrammarConstraint, where llguidance compiles it.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"json_schema: expected a JSON schema, got text that is not JSON ({e})") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError(f"json_schema: expected a JSON object or boolean, got {type(schema).__name__}")
    options: dict[str, Any] = {}
    if lenient:
        options["lenient"] = True
    if max_whitespace == 0:
        options["whitespace_flexible"] = False
    elif max_whitespace is not None:
        options["whitespace_pattern"] = f"[\\x20\\x0A\\x0D\\x09]{{0,{int(max_whitespace)}}}"
    if options:
        schema = {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}
    return "start: %json " + json.dumps(schema, ensure_ascii=False)


def _text_without(tags: list[str]) -> str:
    """A Lark terminal body: non-empty text that does not spell any of `tags` (so that parse_gemma4 reads the
    output exactly as the grammar built it, even when a model spells a tag with ordinary tokens)."""
    return "/(?s:.+)/ & ~/(?s:.*)(" + "|".join(re.escape(t) for t in tags) + ")(?s:.*)/"


# Inside the thought channel parse_gemma4 acts on `<channel|>`, `<|tool_call>` and the stop tags; inside a `<|"|>`
# string on `<|"|>` and the stop tags.
_THOUGHT_RULES = (
    'start: <|channel> "thought\\n" GJ_THOUGHT? <channel|> gj_answer\n'
    f"GJ_THOUGHT: {_text_without(['<channel|>', '<|tool_call>', *sorted(STOP_TAGS)])}\n"
)


def thinking_then(grammar: str) -> str:
    """A free thought channel `<|channel>thought\\n...<channel|>`, then `grammar` (a Lark grammar whose `start`
    rule is defined at the start of a line and not referenced elsewhere). The constraint of `grammar` starts where
    the thought channel closes."""
    if not re.search(r"^start\s*:", grammar, flags=re.MULTILINE):
        raise GrammarError("thinking_then: expected a Lark grammar with a `start:` rule")
    if re.search(r"\bgj_answer\b|\bGJ_THOUGHT\b", grammar):
        raise GrammarError("thinking_then: the grammar already has a thinking prefix")
    body = re.sub(r"^start(\s*):", r"gj_answer\1:", grammar, count=1, flags=re.MULTILINE)
    return body.rstrip("\n") + "\n" + _THOUGHT_RULES


_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_\-.]*")
_NAME_RE = re.compile(r"[A-Za-z0-9_\-.]+")

_GEMMA_VALUE_RULES = r"""
gj_any: gj_str | GJ_NUM | "true" | "false" | "null" | gj_obj | gj_arr
gj_str: <|"|> GJ_STR_TEXT? <|"|>
gj_obj: "{" (gj_pair ("," gj_pair)*)? "}"
gj_pair: (GJ_KEY | <|"|> GJ_STR_TEXT <|"|>) ":" gj_any
gj_arr: "[" (gj_any ("," gj_any)*)? "]"
gj_bool: "true" | "false"
GJ_KEY: /[A-Za-z_][A-Za-z0-9_\-.]*/
GJ_INT: /-?(0|[1-9][0-9]*)/
# Bounded digits so that every number the grammar allows is a finite float (|x| < 1e122).
GJ_NUM: /-?(0|[1-9][0-9]{0,20})(\.[0-9]{1,20})?([eE][+-]?[0-9]{1,2})?/
GJ_STR_TEXT: """ + _text_without(['<|"|>', *sorted(STOP_TAGS)]) + "\n"


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


class _ToolArgsLark:
    """Translates JSON schemas into Lark rules for Gemma 4 argument syntax (see the module docstring)."""

    def __init__(self, key_order: str = "sorted") -> None:
        if key_order not in ("sorted", "schema"):
            raise GrammarError(f"key_order must be 'sorted' or 'schema', got {key_order!r}")
        self.key_order = key_order
        self.rules: list[str] = []
        self._n = 0
        self._refs: dict[tuple[int, str], str] = {}

    def _rule(self, body: str, hint: str = "v") -> str:
        name = f"gj_{hint}_{self._n}"
        self._n += 1
        self.rules.append(f"{name}: {body}")
        return name

    def _err(self, where: str, msg: str) -> GrammarError:
        return GrammarError(f"tool parameters at {where}: {msg}")

    def _resolve(self, ref: str, root: dict, where: str) -> Any:
        if not ref.startswith("#"):
            raise self._err(where, f"only local $ref ('#/...') is supported, got {ref!r}")
        node: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise self._err(where, f"$ref {ref!r} does not resolve")
        return node

    def literal(self, v: Any, where: str) -> str:
        """A Lark sequence spelling one JSON value in Gemma syntax (for enum/const)."""
        if isinstance(v, bool):
            return '"true"' if v else '"false"'
        if v is None:
            return '"null"'
        if isinstance(v, (int, float)):
            return _lark_str(json.dumps(v))
        if isinstance(v, str):
            if '<|"|>' in v:
                raise self._err(where, f"enum/const string {v!r} contains the string delimiter <|\"|>")
            return f"<|\"|> {_lark_str(v)} <|\"|>" if v else '<|"|> <|"|>'
        if isinstance(v, list):
            return '"[" ' + ' "," '.join(self.literal(x, where) for x in v) + ' "]"'
        if isinstance(v, dict):
            keys = sorted(v, key=str.lower) if self.key_order == "sorted" else list(v)
            items = [f"{self.key(k)} \":\" {self.literal(v[k], where)}" for k in keys]
            return '"{" ' + ' "," '.join(items) + ' "}"'
        raise self._err(where, f"cannot spell {type(v).__name__} value {v!r}")

    @staticmethod
    def key(k: str) -> str:
        if _KEY_RE.fullmatch(k):
            return _lark_str(k)
        if '<|"|>' in k or not k:
            raise GrammarError(f"tool parameters: property name {k!r} cannot be written in Gemma 4 syntax")
        return f"<|\"|> {_lark_str(k)} <|\"|>"

    def value(self, schema: Any, root: dict, where: str) -> str:
        """A Lark expression (rule name or parenthesized alternatives) for a value valid against `schema`."""
        if schema is True or schema is None or schema == {}:
            return "gj_any"
        if schema is False:
            raise self._err(where, "schema `false` accepts no value")
        if not isinstance(schema, dict):
            raise self._err(where, f"expected a schema object, got {type(schema).__name__}")
        if "$ref" in schema:
            key = (id(root), schema["$ref"])
            if key not in self._refs:
                target = self._resolve(schema["$ref"], root, where)
                name = f"gj_ref_{self._n}"
                self._n += 1
                self._refs[key] = name
                self.rules.append(f"{name}: {self.value(target, root, schema['$ref'])}")
            return self._refs[key]
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for sub in schema["allOf"]:
                if isinstance(sub, dict) and "$ref" in sub:
                    sub = self._resolve(sub["$ref"], root, where)
                if not isinstance(sub, dict):
                    continue
                for k, v in sub.items():
                    if k == "properties":
                        merged["properties"] = {**merged.get("properties", {}), **v}
                    elif k == "required":
                        merged["required"] = list(dict.fromkeys([*merged.get("required", []), *v]))
                    else:
                        merged.setdefault(k, v)
            return self.value(merged, root, where)
        if "const" in schema:
            return self.literal(schema["const"], where)
        if "enum" in schema:
            if not schema["enum"]:
                raise self._err(where, "empty enum accepts no value")
            return "(" + " | ".join(self.literal(v, where) for v in schema["enum"]) + ")"
        for k in ("anyOf", "oneOf"):
            if k in schema:
                rest = {kk: vv for kk, vv in schema.items() if kk != k}
                alts = [self.value({**rest, **s} if isinstance(s, dict) else s, root, f"{where}/{k}/{i}")
                        for i, s in enumerate(schema[k])]
                return "(" + " | ".join(alts) + ")"
        t = schema.get("type")
        if isinstance(t, list):
            return "(" + " | ".join(self.value({**schema, "type": tt}, root, where) for tt in t) + ")"
        if t is None:
            if "properties" in schema or "required" in schema or "additionalProperties" in schema:
                t = "object"
            elif "items" in schema:
                t = "array"
            else:
                return "gj_any"
        if t == "string":
            return "gj_str"
        if t == "integer":
            return "GJ_INT"
        if t == "number":
            return "GJ_NUM"
        if t == "boolean":
            return "gj_bool"
        if t == "null":
            return '"null"'
        if t == "array":
            return self._array(schema, root, where)
        if t == "object":
            return self._object(schema, root, where)
        raise self._err(where, f"unknown type {t!r}")

    def _array(self, schema: dict, root: dict, where: str) -> str:
        item = self.value(schema.get("items", True), root, f"{where}/items")
        lo, hi = int(schema.get("minItems", 0)), schema.get("maxItems")
        hi = None if hi is None else int(hi)
        if hi is not None and hi < lo:
            raise self._err(where, f"maxItems {hi} < minItems {lo}")
        if hi == 0:
            return self._rule('"[" "]"', "arr")
        more_lo, more_hi = max(lo - 1, 0), (None if hi is None else hi - 1)
        if more_lo == 0 and more_hi is None:
            rep = "*"
        else:
            rep = f"{{{more_lo},{'' if more_hi is None else more_hi}}}"
        seq = f'{item} ("," {item}){rep}'
        return self._rule(f'"[" {seq} "]"' if lo >= 1 else f'"[" ({seq})? "]"', "arr")

    def _object(self, schema: dict, root: dict, where: str) -> str:
        props = dict(schema.get("properties") or {})
        required = list(schema.get("required") or [])
        for k in required:
            props.setdefault(k, True)
        if not props:
            # `properties: {}` given means no arguments; no `properties` at all means any keys
            extra = schema.get("additionalProperties", "properties" not in schema)
            if extra is False:
                return self._rule('"{" "}"', "obj")
            if extra is True or extra == {}:
                return "gj_obj"
            val = self.value(extra, root, f"{where}/additionalProperties")
            pair = f'(GJ_KEY | <|"|> GJ_STR_TEXT <|"|>) ":" {val}'
            return self._rule(f'"{{" ({pair} ("," {pair})*)? "}}"', "obj")
        keys = sorted(props, key=str.lower) if self.key_order == "sorted" else list(props)
        items = [(k, f'{self.key(k)} ":" {self.value(props[k], root, f"{where}/properties/{k}")}', k in required)
                 for k in keys]
        # members(k, first): the members from index k on; `first` says no member was written before (no comma).
        memo: dict[tuple[int, bool], str] = {}

        def members(k: int, first: bool) -> str:
            if k == len(items):
                return ""
            if (k, first) in memo:
                return memo[(k, first)]
            _, item, req = items[k]
            here = (item if first else f'"," {item}') + " " + members(k + 1, False)
            if req:
                body = here
            else:
                skip = members(k + 1, first)
                body = f"({here})?" if not skip else f"{here} | {skip}"
            memo[(k, first)] = name = self._rule(body, "mem")
            return name

        return self._rule(f'"{{" {members(0, True)} "}}"', "obj")


def _tool_function(tool: dict) -> dict:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise GrammarError(f"tools: expected {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r}")
    return fn


def tool_call_grammar(
    tools: list[dict],
    mode: Literal["required", "named"] = "required",
    name: str | None = None,
    *,
    parallel: bool = True,
    thinking: bool = False,
    key_order: Literal["sorted", "schema"] = "sorted",
) -> str:
    """Output that is one or more Gemma 4 tool calls, then `<|tool_response>`.

    Each call is `<|tool_call>call:NAME{ARGS}<tool_call|>` with ARGS following the tool's JSON-schema parameters in
    Gemma 4 syntax (subset in the module docstring).

    Args:
        tools: OpenAI tool list ([{"type": "function", "function": {"name", "parameters"?}}]; bare function dicts are
            accepted too).
        mode: "required" (any of the tools) or "named" (only `name`).
        name: the function to call when mode == "named".
        parallel: allow several calls in a row (else exactly one).
        thinking: put a free thought channel before the calls (see thinking_then).
        key_order: "sorted": object keys in case-insensitive alphabetical order, as the Gemma 4 chat template renders
            tool-call arguments (jinja `dictsort`), so the order the model was shown; "schema": declaration order.
    Raises:
        GrammarError: no tools, unknown name or mode, a name or schema that cannot be written in Gemma 4 syntax.
    """
    fns = [_tool_function(t) for t in tools or []]
    if not fns:
        raise GrammarError("tool_call_grammar: no tools given")
    if mode == "named":
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise GrammarError(f"tool_choice names function {name!r}, which is not among the tools "
                               f"{[_tool_function(t)['name'] for t in tools]}")
    elif mode != "required":
        raise GrammarError(f"tool_call_grammar: mode must be 'required' or 'named', got {mode!r}")
    conv = _ToolArgsLark(key_order)
    calls = []
    for fn in fns:
        if not _NAME_RE.fullmatch(fn["name"]):
            raise GrammarError(f"tool name {fn['name']!r} must match [A-Za-z0-9_.-]+ to be called in Gemma 4 syntax")
        params = fn.get("parameters")
        if params is None or params == {}:
            args = "gj_obj"
        else:
            if not isinstance(params, dict):
                raise GrammarError(f"tool {fn['name']}: parameters must be a JSON schema object")
            args = conv.value({"type": "object", **params}, params, f"{fn['name']}")
        calls.append(conv._rule(f'<|tool_call> {_lark_str("call:" + fn["name"])} {args} <tool_call|>', "call"))
    lines = [
        f"start: gj_call{'+' if parallel else ''} <|tool_response>",
        "gj_call: " + " | ".join(calls),
        *conv.rules,
    ]
    grammar = "\n".join(lines) + _GEMMA_VALUE_RULES
    return thinking_then(grammar) if thinking else grammar


# --------------------------------------------------------------------------------------------------------------------
# Per-request constraint


def expand_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Packed llguidance bitmask int32 [..., W] (bit k of word w is token 32*w + k) -> bool [..., vocab_size].
    Tokens past 32*W (model vocabulary padding) are False. Assumes a little-endian host (x86, ARM)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=-1, bitorder="little").astype(bool)
    n = bits.shape[-1]
    if n >= vocab_size:
        return bits[..., :vocab_size]
    pad = np.zeros(bits.shape[:-1] + (vocab_size - n,), dtype=bool)
    return np.concatenate([bits, pad], axis=-1)


class GrammarConstraint:
    """One request's grammar state: which tokens may come next, advanced token by token.

    Args:
        ll_tokenizer: from make_ll_tokenizer.
        grammar: a Lark grammar string (from the functions above, or any llguidance grammar).
    Raises:
        GrammarError: with llguidance's message when the grammar (or an embedded JSON schema) does not compile.
    """

    def __init__(self, ll_tokenizer: llguidance.LLTokenizer, grammar: str):
        self._matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self.vocab_size = ll_tokenizer.vocab_size
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        self._num_tokens = 0

    def bitmask(self) -> np.ndarray:
        """The next-token mask packed as int32 [ceil(V / 32)] (llguidance layout; see expand_bitmask)."""
        self._check()
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        self._check()
        return self._bitmask[0].copy()

    def allowed_mask(self, vocab_size: int | None = None) -> np.ndarray:
        """bool [vocab_size]: True where the token may come next. vocab_size defaults to the tokenizer's; model
        vocabulary padding beyond it is False. Once the grammar is done only end tokens (`<eos>`, `<turn|>`) are
        allowed."""
        return expand_bitmask(self.bitmask(), vocab_size or self.vocab_size)

    def advance(self, token_id: int) -> None:
        """Consume one sampled token. Raises ValueError if the grammar does not allow it (the matcher is then
        unusable: sample from allowed_mask)."""
        if not self._matcher.consume_token(int(token_id)):
            raise ValueError(f"token {int(token_id)} is not allowed by the grammar after {self._num_tokens} tokens: "
                             f"{self._matcher.get_error()}")
        self._num_tokens += 1

    def is_done(self) -> bool:
        """True when the grammar is complete and admits no more tokens except an end token."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """True when the output so far is a complete sentence of the grammar (it may still be extended)."""
        return self._matcher.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens advances (e.g. rejected speculative tokens)."""
        if num_tokens > self._num_tokens or not self._matcher.rollback(int(num_tokens)):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._num_tokens} consumed "
                             f"{self._matcher.get_error()}")
        self._num_tokens -= num_tokens

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ValueError(f"grammar matcher is in an error state: {self._matcher.get_error()}")


_EXECUTOR: llguidance.LLExecutor | None = None


def batch_bitmask(constraints: Sequence[GrammarConstraint | None], num_words: int) -> np.ndarray:
    """Next-token masks of a batch, computed in parallel by llguidance's thread pool.

    Args:
        constraints: one per sequence; None for an unconstrained sequence.
        num_words: W = ceil(V / 32) of the tokenizer vocabulary.
    Returns:
        int32 [B, W] packed masks (see expand_bitmask); rows of unconstrained sequences are all ones.
    """
    global _EXECUTOR
    out = llguidance.numpy.allocate_token_bitmask(len(constraints), num_words * 32)
    rows = [(c._matcher, b) for b, c in enumerate(constraints) if c is not None]
    if rows:
        for b, c in enumerate(constraints):
            if c is not None:
                c._check()
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        llguidance.numpy.fill_next_token_bitmask_par(_EXECUTOR, rows, out)
    return out
