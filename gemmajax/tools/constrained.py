r"""Constrained decoding with llguidance: per-request token masks from grammars over the Gemma vocabulary.

Design: every grammar is a Lark source string in llguidance's dialect, so grammars compose (`thinking_then` wraps any
of them behind a free thought channel). JSON schemas are translated here into Lark rules, by one compiler for both
spellings: JSON text (`json_schema_grammar`, response_format) and Gemma 4 tool-call arguments (`tool_call_grammar`:
bare keys, `<|"|>` strings). Translating them ourselves (rather than llguidance's `%json`) is what lets every grammar
end: numbers, whitespace and free values are bounded by the grammar itself, so even a model that emits noise reaches
the end of a valid value in a bounded number of tokens (strings excepted, see below). Special tokens (`<|tool_call>`,
`<|"|>`, `<|channel>`, ...) are single special tokens in the grammar, never their spelling in ordinary text.

Schema subset enforced (both spellings): type (one or a list; OpenAPI `nullable`), enum, const, anyOf, oneOf (read as
anyOf: exact when the branches are disjoint, e.g. discriminated unions), allOf (intersected: types, bounds, lengths,
required, properties, patterns, enums), local $ref (`#/...`, recursion allowed, sibling keywords intersected),
`true`/`false` schemas; objects: properties in a fixed order (JSON: declaration order; Gemma: case-insensitively
sorted by default, the order of the chat template's `dictsort`), required keys present, optional keys may be left
out, additionalProperties (a schema, true or false; extra keys come after the declared ones and never repeat a
declared name), unevaluatedProperties as additionalProperties; arrays: items, prefixItems (and the older tuple
`items` with additionalItems), minItems, maxItems; strings: minLength, maxLength (code points: an escape is one),
pattern (ECMA `^`/`$` at the ends, `\d` / `\w` as ASCII; a JSON string with a pattern is written without
escapes, so that the pattern sees the value), format date, time, date-time, uuid, ipv4, email (other formats are
annotations, as JSON Schema 2020-12 reads `format`); numbers: minimum, maximum, exclusiveMinimum, exclusiveMaximum
(numbers or draft-4 booleans), multipleOf 10^-k (at most k fraction digits), other multipleOf values spelled out
when at most 256 values remain; minProperties / maxProperties when every declared property is required (or where
they cannot fail). Rejected with a GrammarError naming the JSON path (`lenient=True` ignores them instead): not,
if/then/else, patternProperties, propertyNames, dependencies, dependentRequired/Schemas, contains, uniqueItems,
unevaluatedItems, $dynamicRef. Other keywords are annotations (title, description, default, x-..., unknown ones).

Bounds where the schema sets none (explicit bounds are never narrowed, and always leave room for their values):
- Whitespace: none outside strings (compact JSON, as OpenAI's structured outputs; the Gemma chat template writes
  tool arguments compactly too); `whitespace="flexible"` allows at most `max_whitespace` characters at each place
  JSON allows whitespace.
- Integers: at most INT_DIGITS (16) digits on a side without a bound (a side's default bound moves out with an
  explicit bound on the other side, e.g. minimum 10^20 allows up to 10^20 + 10^16 - 1). Numbers: the same integer
  part, at most FRAC_DIGITS (12) fraction digits (or one more than the bounds' own digits), an exponent of at most
  EXP_DIGITS (2) digits only when the number has no bound at all (the decimal range regexes cannot see exponents).
  Never `-0`.
- Free values (`{}`, `true`, items of an array without `items`, values of an object without properties): any JSON
  value nested at most FREE_DEPTH (8) arrays/objects deep, numbers bounded as above.
- Objects with a `properties` keyword (even `{}`) and no additionalProperties get no extra keys (strict, as
  OpenAI's structured outputs require; a noise model would otherwise add keys forever). A tool without parameters
  takes no arguments (`{}`), as OpenAI reads an omitted `parameters`.
- Strings are not capped without maxLength: once minLength and pattern are met, the closing quote (`<|"|>` in Gemma
  syntax) is allowed after every character, so a model that wants to end can, and no whitespace run stands in its
  way; a cap would silently cut legitimate long text.
"""

from __future__ import annotations

import json
import math
import re
import weakref
from collections.abc import Iterable, Sequence
from decimal import Decimal
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
# Bounds that apply where a schema sets none (see the module docstring)

INT_DIGITS = 16  # an integer (or a number's integer part) with no bound on a side has at most 16 digits on that side
FRAC_DIGITS = 12  # a number has at most 12 fraction digits (more when its bounds need them)
EXP_DIGITS = 2  # a number with no bounds at all may carry an exponent of at most 2 digits
FREE_DEPTH = 8  # a value the schema leaves free (`{}`, `true`, items/values of free arrays/objects) nests <= 8 deep
MAX_ENUMERATED = 256  # a multipleOf that no regex expresses is enumerated when it leaves at most this many values

# --------------------------------------------------------------------------------------------------------------------
# Number regexes: decimal spellings of integers and numbers in a range (Python `re` and llguidance read them alike:
# only [0-9] classes, (?:...) groups, alternation and counted repetition).


def _digits(a: int, b: int) -> str:
    return str(a) if a == b else f"[{a}-{b}]"


def _run(n: int) -> str:
    """n more digits of any value."""
    return "" if n <= 0 else "[0-9]" if n == 1 else f"[0-9]{{{n}}}"


def _same_length(x: str, y: str) -> str:
    """Digit strings s with len(s) == len(x) == len(y) and x <= s <= y (as numbers)."""
    k = 0
    while k < len(x) and x[k] == y[k]:
        k += 1
    if k == len(x):
        return x
    prefix, x0, y0, xr, yr = x[:k], int(x[k]), int(y[k]), x[k + 1 :], y[k + 1 :]
    m = len(xr)
    if m == 0:
        return prefix + _digits(x0, y0)
    low_full, high_full = xr == "0" * m, yr == "9" * m  # x0 / y0 may be followed by anything
    parts = []
    if not low_full:
        parts.append(f"{x0}(?:{_same_length(xr, '9' * m)})")
    a, b = (x0 if low_full else x0 + 1), (y0 if high_full else y0 - 1)
    if a <= b:
        parts.append(_digits(a, b) + _run(m))
    if not high_full:
        parts.append(f"{y0}(?:{_same_length('0' * m, yr)})")
    return prefix + (parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")")


def _uint_range(a: int, b: int) -> str:
    """Decimal spellings (no leading zeros) of the integers a..b, 0 <= a <= b."""
    parts, full = [], []  # full: lengths whose every value is in range, written as one counted run
    for length in range(len(str(a)), len(str(b)) + 1):
        lo, hi = max(a, 10 ** (length - 1) if length > 1 else 0), min(b, 10**length - 1)
        if length > 1 and lo == 10 ** (length - 1) and hi == 10**length - 1:
            full.append(length)
        else:
            parts.append(_same_length(str(lo), str(hi)))
    if full:
        p, q = full[0] - 1, full[-1] - 1
        parts.append("[1-9]" + ("[0-9]" if p == q == 1 else f"[0-9]{{{p}}}" if p == q else f"[0-9]{{{p},{q}}}"))
    return "|".join(parts)


def _int_range(lo: int, hi: int) -> str:
    """Spellings of the integers lo..hi (never `-0`)."""
    parts = []
    if lo < 0:
        parts.append(f"-(?:{_uint_range(max(1, -hi), -lo)})")
    if hi >= 0:
        parts.append(_uint_range(max(0, lo), hi))
    return "|".join(parts)


# Fraction digit strings f (len(f) <= n, "" included) compared by the value 0.f: each helper returns (regex of the
# non-empty members or None, whether "" is a member). "" stands for a number written without a fraction.
_Frac = tuple[str | None, bool]


def _frac_join(parts: list[str], empty: bool) -> _Frac:
    return ("|".join(parts) or None), empty


def _then(d: str, rest: _Frac) -> list[str]:
    rx, empty = rest
    return ([d] if empty else []) + ([f"{d}(?:{rx})"] if rx else [])


def _frac_any(n: int) -> str | None:
    return None if n <= 0 else "[0-9]" if n == 1 else f"[0-9]{{1,{n}}}"


def _frac_nonzero(n: int) -> str | None:
    if n <= 0:
        return None
    rest = _frac_nonzero(n - 1)
    return "|".join([f"[1-9][0-9]{{0,{n - 1}}}" if n > 1 else "[1-9]"] + ([f"0(?:{rest})"] if rest else []))


def _frac_ge(lo: str, n: int, strict: bool) -> _Frac:
    lo = lo.rstrip("0")
    if not lo:
        return (_frac_nonzero(n), False) if strict else (_frac_any(n), True)
    if n == 0:
        return None, False
    d = int(lo[0])
    tail = f"[0-9]{{0,{n - 1}}}" if n > 1 else ""
    parts = [_digits(d + 1, 9) + tail] if d < 9 else []
    return _frac_join(parts + _then(str(d), _frac_ge(lo[1:], n - 1, strict)), False)


def _frac_le(hi: str, n: int, strict: bool) -> _Frac:
    hi = hi.rstrip("0")
    if not hi:
        return (None, False) if strict else ((f"0{{1,{n}}}" if n > 1 else "0" if n == 1 else None), True)
    if n == 0:
        return None, True
    d = int(hi[0])
    tail = f"[0-9]{{0,{n - 1}}}" if n > 1 else ""
    parts = [_digits(0, d - 1) + tail] if d > 0 else []
    return _frac_join(parts + _then(str(d), _frac_le(hi[1:], n - 1, strict)), True)


def _frac_between(lo: str, hi: str, n: int, lo_strict: bool, hi_strict: bool) -> _Frac:
    """0.lo <(=) 0.f <(=) 0.hi, given 0.lo <= 0.hi."""
    lo, hi = lo.rstrip("0"), hi.rstrip("0")
    empty = not lo and not lo_strict and (bool(hi) or not hi_strict)
    if n == 0:
        return None, empty
    dl, dh = (int(lo[0]) if lo else 0), (int(hi[0]) if hi else 0)
    if dl == dh:
        return _frac_join(_then(str(dl), _frac_between(lo[1:], hi[1:], n - 1, lo_strict, hi_strict)), empty)
    parts = _then(str(dl), _frac_ge(lo[1:], n - 1, lo_strict))
    if dl + 1 <= dh - 1:
        parts.append(_digits(dl + 1, dh - 1) + (f"[0-9]{{0,{n - 1}}}" if n > 1 else ""))
    parts += _then(str(dh), _frac_le(hi[1:], n - 1, hi_strict))
    return _frac_join(parts, empty)


def _with_fraction(int_rx: str, frac: _Frac) -> str | None:
    rx, empty = frac
    if rx is None:
        return int_rx if empty else None
    return f"{int_rx}(?:\\.(?:{rx}))?" if empty else f"{int_rx}\\.(?:{rx})"


def _split_decimal(d: Decimal) -> tuple[int, str]:
    """A non-negative Decimal -> (integer part, fraction digits without trailing zeros)."""
    i, _, f = format(d, "f").partition(".")
    return int(i), f.rstrip("0")


def _udec_range(lo: Decimal, lo_strict: bool, hi: Decimal, hi_strict: bool, n: int) -> str | None:
    """Spellings of the decimals lo <(=) x <(=) hi, 0 <= lo <= hi, with at most n fraction digits."""
    a, lo_f = _split_decimal(lo)
    b, hi_f = _split_decimal(hi)
    if a == b:
        parts = [_with_fraction(str(a), _frac_between(lo_f, hi_f, n, lo_strict, hi_strict))]
    else:
        parts = [_with_fraction(str(a), _frac_ge(lo_f, n, lo_strict))]
        if a + 1 <= b - 1:
            parts.append(_with_fraction(f"(?:{_uint_range(a + 1, b - 1)})", (_frac_any(n), True)))
        parts.append(_with_fraction(str(b), _frac_le(hi_f, n, hi_strict)))
    return "|".join(p for p in parts if p) or None


def _dec_range(lo: Decimal, lo_strict: bool, hi: Decimal, hi_strict: bool, n: int) -> str | None:
    """Spellings of the decimals lo <(=) x <(=) hi with at most n fraction digits (never a negative zero); None when
    there are none."""
    parts = []
    if lo < 0:  # x = -y, y in (max(-hi, 0), -lo], never y == 0 ("-0")
        y_lo, y_strict = (-hi, hi_strict) if hi < 0 else (Decimal(0), True)
        r = _udec_range(y_lo, y_strict, -lo, lo_strict, n)
        if r:
            parts.append(f"-(?:{r})")
    if hi > 0 or (hi == 0 and not hi_strict):
        r = _udec_range(*((lo, lo_strict) if lo >= 0 else (Decimal(0), False)), hi, hi_strict, n)
        if r:
            parts.append(r)
    return "|".join(parts) or None


def _frac_digits(d: Decimal) -> int:
    return max(0, -d.normalize().as_tuple().exponent)


def _decimal_places(step: Decimal) -> int | None:
    """k when step == 10^-k (k >= 0), else None."""
    t = step.normalize().as_tuple()
    return -t.exponent if t.digits == (1,) and t.exponent <= 0 else None


def _rx_escape(s: str) -> str:
    """s as a regex literal (only metacharacters escaped: llguidance's regex syntax rejects other escapes)."""
    return re.sub(r"([\\.+*?()|\[\]{}^$#&~/-])", r"\\\1", s)


# --------------------------------------------------------------------------------------------------------------------
# Strings

_JSON_CHAR = (  # one JSON string character; every escape decodes to one code point (a surrogate pair is one unit)
    r'(?:[^"\\\x00-\x1F\x7F]|\\["\\\/bfnrt]|\\u(?:[0-9a-ce-fA-CE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})'
    r"|\\u[dD][89aAbB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})"
)
_JSON_RAW_CHAR = r'[^"\\\x00-\x1F\x7F]'  # unescaped: the text is the value (used where a pattern must see the value)
_FORMATS = {  # string formats enforced (others are annotations, as JSON Schema 2020-12 treats `format` by default)
    "date": (  # calendar-exact: years 0001-9999, month lengths, February 29 in leap years only
        r"(?:(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
        r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
        r"|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)-02-29)"),
    "time": r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": r"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])",
    "email": r"[A-Za-z0-9._%+\-]{1,64}@[A-Za-z0-9\-]{1,63}(?:\.[A-Za-z0-9\-]{1,63})+",
}
_FORMATS["date-time"] = _FORMATS["date"] + "T" + _FORMATS["time"]


def _ecma_pattern(pattern: str) -> tuple[str, bool, bool]:
    """A JSON-schema (ECMA-262) pattern -> (regex body for llguidance, anchored at start, anchored at end).

    `^` / `$` are honoured only at the very ends (an unanchored side may have any text). `\\d` and `\\w` are narrowed
    to ASCII as in ECMA-262 (llguidance's Rust syntax would read them as Unicode classes); `/` is escaped for the
    `/.../` literal."""
    start = pattern.startswith("^")
    body = pattern[1:] if start else pattern
    end = body.endswith("$") and not body.endswith("\\$")
    body = body[:-1] if end else body
    out, i, in_class = [], 0, False
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            e = body[i + 1]
            if e == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif e == "w":
                out.append("A-Za-z0-9_" if in_class else "[A-Za-z0-9_]")
            elif e == "/":
                out.append("\\/")
            else:
                out.append(c + e)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append("\\/" if c == "/" else c)
        i += 1
    return "".join(out), start, end


def _python_pattern_allows_empty(pattern: str) -> bool:
    try:
        return re.search(pattern, "") is not None
    except re.error:  # not Python syntax: assume not (a non-empty string must then match)
        return False


# --------------------------------------------------------------------------------------------------------------------
# JSON schema -> Lark

_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "$schema", "$id", "$anchor", "$dynamicAnchor",
    "$vocabulary", "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "contentSchema",
    "discriminator", "$defs", "definitions", "format",  # format: enforced for the _FORMATS names, else an annotation
})
_UNSUPPORTED = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "patternProperties",
    "propertyNames", "unevaluatedItems", "contains", "minContains", "maxContains", "uniqueItems", "$dynamicRef",
    "$recursiveRef", "$recursiveAnchor",
})  # minProperties / maxProperties: accepted where they cannot fail (see _object)
_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
_OBJECT_KEYS = ("properties", "required", "additionalProperties", "unevaluatedProperties")
_ARRAY_KEYS = ("items", "prefixItems", "additionalItems", "minItems", "maxItems")
_STRING_KEYS = ("minLength", "maxLength", "pattern")
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


class _Unsatisfiable(GrammarError):
    """No value satisfies the (sub)schema; an anyOf branch that raises it is dropped."""


def _is_annotation(k: str) -> bool:
    return k in _ANNOTATIONS or k.startswith("x-")


def _pointer(path: str, *parts: Any) -> str:
    return path + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _json_text(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def _type_ok(v: Any, t: str) -> bool:
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool) or (isinstance(v, float) and v.is_integer())
    return {"null": v is None, "boolean": isinstance(v, bool), "object": isinstance(v, dict),
            "array": isinstance(v, list), "string": isinstance(v, str),
            "number": isinstance(v, (int, float)) and not isinstance(v, bool)}[t]


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _text_without(tags: list[str]) -> str:
    """A Lark terminal body: non-empty text that does not spell any of `tags` (so that parse_gemma4 reads the
    output exactly as the grammar built it, even when a model spells a tag with ordinary tokens)."""
    return "/(?s:.+)/ & ~/(?s:.*)(" + "|".join(re.escape(t) for t in tags) + ")(?s:.*)/"


_GEMMA_TEXT_TAGS = ['<|"|>', *sorted(STOP_TAGS)]  # what a `<|"|>` string may not spell (parse_gemma4 acts on them)
_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_\-.]*")
_NAME_RE = re.compile(r"[A-Za-z0-9_\-.]+")


class _SchemaLark:
    """Translates JSON schemas into Lark rules, for JSON text or for Gemma 4 tool-call argument syntax.

    One instance builds one grammar (rules accumulate in `rules`); `value(schema, root, path)` returns a Lark
    expression for the values valid against `schema` (the module docstring lists the subset and the bounds)."""

    def __init__(self, syntax: Literal["json", "gemma"], *, where: str, key_order: str, lenient: bool = False,
                 whitespace: str = "compact", max_whitespace: int = 32) -> None:
        if key_order not in ("sorted", "schema"):
            raise GrammarError(f"key_order must be 'sorted' or 'schema', got {key_order!r}")
        if whitespace not in ("compact", "flexible"):
            raise GrammarError(f"whitespace must be 'compact' or 'flexible', got {whitespace!r}")
        if whitespace == "flexible" and (not isinstance(max_whitespace, int) or max_whitespace < 1):
            raise GrammarError(f"max_whitespace must be an int >= 1 with flexible whitespace, got {max_whitespace!r}")
        self.syntax, self.where, self.key_order, self.lenient = syntax, where, key_order, lenient
        self.rules: list[str] = []
        self._n = 0
        self._refs: dict[tuple[int, str], str] = {}
        self._terminals: dict[str, str] = {}
        self._any: dict[int, str] = {}
        self._ws = ""
        if syntax == "json" and whitespace == "flexible":
            self._ws = self.terminal(f"/[\\x20\\x0A\\x0D\\x09]{{1,{max_whitespace}}}/", "ws") + "?"

    # -- plumbing ------------------------------------------------------------------------------------------------

    def rule(self, body: str, hint: str = "v") -> str:
        name = f"gj_{hint}_{self._n}"
        self._n += 1
        self.rules.append(f"{name}: {body}")
        return name

    def terminal(self, body: str, hint: str = "t") -> str:
        if body not in self._terminals:
            name = f"GJ_{hint.upper()}_{len(self._terminals)}"
            self._terminals[body] = name
            self.rules.append(f"{name}: {body}")
        return self._terminals[body]

    def _err(self, path: str, msg: str, cls: type[GrammarError] = GrammarError) -> GrammarError:
        return cls(f"{self.where} at {path or '#'}: {msg}")

    # Optional whitespace (JSON, flexible) goes before every member and around separators, and once before a
    # closing bracket: never two optional runs side by side, so `max_whitespace` bounds each gap.

    def _sep(self, lit: str) -> str:
        return " ".join(filter(None, [self._ws, _lark_str(lit), self._ws]))

    def _lead(self, item: str) -> str:
        return " ".join(filter(None, [self._ws, item]))

    def _close(self, lit: str) -> str:
        return " ".join(filter(None, [self._ws, _lark_str(lit)]))

    def _resolve(self, ref: Any, root: Any, path: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self._err(path, f"only local $ref ('#/...') is supported, got {ref!r}")
        node: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise self._err(path, f"$ref {ref!r} does not resolve")
        return node

    # -- schema algebra --------------------------------------------------------------------------------------------

    def _normalize(self, schema: Any, root: Any, path: str) -> Any:
        """The schema with a top-level $ref (that has sibling keywords) and allOf merged away; a bare $ref, True,
        False and dicts without $ref/allOf come back as they are."""
        for _ in range(64):
            if not isinstance(schema, dict):
                return schema
            if "$ref" in schema:
                rest = {k: v for k, v in schema.items() if k != "$ref"}
                if all(_is_annotation(k) for k in rest):
                    return schema
                schema = self._merge(self._resolve(schema["$ref"], root, path), rest, root, path)
                continue
            if "allOf" in schema:
                subs = schema["allOf"]
                if not isinstance(subs, list) or not subs:
                    raise self._err(path, f"allOf must be a non-empty list, got {subs!r}")
                merged: Any = {k: v for k, v in schema.items() if k != "allOf"}
                for i, sub in enumerate(subs):
                    merged = self._merge(merged, self._deref(sub, root, _pointer(path, "allOf", i)), root, path)
                schema = merged
                continue
            return schema
        raise self._err(path, "$ref / allOf nesting deeper than 64 levels (a $ref cycle?)")

    def _deref(self, schema: Any, root: Any, path: str) -> Any:
        for _ in range(64):
            if isinstance(schema, dict) and "$ref" in schema:
                rest = {k: v for k, v in schema.items() if k != "$ref"}
                target = self._resolve(schema["$ref"], root, path)
                schema = self._merge(target, rest, root, path) if rest else target
            else:
                return self._normalize(schema, root, path)
        raise self._err(path, "$ref chain longer than 64 (a $ref cycle?)")

    def _merge(self, a: Any, b: Any, root: Any, path: str) -> Any:
        """The intersection of two schemas (allOf), for the keywords this compiler enforces."""
        a, b = self._deref(a, root, path), self._deref(b, root, path)
        if a is False or b is False:
            return False
        if a is True or a == {}:
            return b
        if b is True or b == {}:
            return a
        if not isinstance(a, dict) or not isinstance(b, dict):
            raise self._err(path, f"expected schema objects in allOf, got {a!r} and {b!r}")
        out = dict(a)
        for k, v in b.items():
            if k not in out:
                out[k] = v
                continue
            u = out[k]
            if u == v or _is_annotation(k):
                continue
            if k == "type":
                tu, tv = (u if isinstance(u, list) else [u]), (v if isinstance(v, list) else [v])
                both = [t for t in tu if t in tv or (t == "integer" and "number" in tv)]
                both += [t for t in tv if t == "integer" and "number" in tu and t not in both]
                if not both:
                    raise self._err(path, f"allOf: types {u!r} and {v!r} have no value in common", _Unsatisfiable)
                out[k] = both if len(both) > 1 else both[0]
            elif k in ("minimum", "minLength", "minItems"):
                out[k] = max(u, v)
            elif k in ("maximum", "maxLength", "maxItems"):
                out[k] = min(u, v)
            elif k in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(u, bool) and not isinstance(v, bool):
                out[k] = max(u, v) if k == "exclusiveMinimum" else min(u, v)
            elif k == "required":
                out[k] = list(dict.fromkeys([*u, *v]))
            elif k == "pattern":
                out[k] = [*(u if isinstance(u, list) else [u]), *(v if isinstance(v, list) else [v])]
            elif k == "enum":
                keep = {_json_text(x) for x in v}
                out[k] = [x for x in u if _json_text(x) in keep]
                if not out[k]:
                    raise self._err(path, f"allOf: enums {u!r} and {v!r} share no value", _Unsatisfiable)
            elif k == "const":
                raise self._err(path, f"allOf: const {u!r} != const {v!r}", _Unsatisfiable)
            elif k in ("items", "additionalItems", "additionalProperties", "unevaluatedProperties"):
                out[k] = {"allOf": [u, v]}
            elif k == "prefixItems":
                n = max(len(u), len(v))
                out[k] = [{"allOf": [u[i] if i < len(u) else True, v[i] if i < len(v) else True]} for i in range(n)]
            elif k in ("anyOf", "oneOf"):
                out[k] = [{"allOf": [x, y]} for x in u for y in v]
            elif k == "properties":
                pass  # below, together with additionalProperties
            elif k in _UNSUPPORTED and self.lenient:
                continue  # ignored anyway
            else:
                raise self._err(path, f"allOf: cannot intersect {k!r} values {u!r} and {v!r}")
        if "properties" in a and "properties" in b:
            pa, pb = a["properties"], b["properties"]
            aa, ab = a.get("additionalProperties", True), b.get("additionalProperties", True)
            out["properties"] = {p: {"allOf": [pa.get(p, aa), pb.get(p, ab)]} for p in {**pa, **pb}}
        elif "properties" in b and "additionalProperties" in a:  # a's extra-key schema applies to b's properties
            out["properties"] = {p: {"allOf": [s, a["additionalProperties"]]} for p, s in b["properties"].items()}
        elif "properties" in a and "additionalProperties" in b:
            out["properties"] = {p: {"allOf": [s, b["additionalProperties"]]} for p, s in a["properties"].items()}
        return out

    # -- values ----------------------------------------------------------------------------------------------------

    def value(self, schema: Any, root: Any, path: str = "#") -> str:
        """A Lark expression (rule name, terminal or parenthesized alternatives) for the values valid against
        `schema` (its local $refs resolve against `root`)."""
        schema = self._normalize(schema, root, path)
        if schema is True or schema is None:
            return self.any(0)
        if schema is False:
            raise self._err(path, "schema `false` accepts no value", _Unsatisfiable)
        if not isinstance(schema, dict):
            raise self._err(path, f"expected a schema object or boolean, got {type(schema).__name__}")
        if "$ref" in schema:  # a bare $ref (annotations aside): one rule per target, so recursion works
            key = (id(root), schema["$ref"])
            if key not in self._refs:
                target = self._resolve(schema["$ref"], root, path)
                name = self._refs[key] = f"gj_ref_{self._n}"
                self._n += 1
                self.rules.append(f"{name}: {self.value(target, root, schema['$ref'])}")
            return self._refs[key]
        for k in schema:
            if k in _UNSUPPORTED and not self.lenient and not (k == "uniqueItems" and schema[k] is False):
                raise self._err(_pointer(path, k), f"keyword {k!r} is not supported (pass lenient=True to ignore it)")
        for k in ("anyOf", "oneOf"):  # oneOf is read as anyOf (exact when the branches are disjoint)
            if k in schema:
                rest = {kk: vv for kk, vv in schema.items() if kk != k}
                if not isinstance(schema[k], list) or not schema[k]:
                    raise self._err(_pointer(path, k), f"expected a non-empty list, got {schema[k]!r}")
                alts, why = [], []
                for i, sub in enumerate(schema[k]):
                    try:
                        merged = self._merge(rest, sub, root, path) if rest else sub
                        alts.append(self.value(merged, root, _pointer(path, k, i)))
                    except _Unsatisfiable as e:
                        why.append(str(e))
                if not alts:
                    raise self._err(path, f"no {k} branch can be satisfied: {'; '.join(why)}", _Unsatisfiable)
                return alts[0] if len(alts) == 1 else "(" + " | ".join(dict.fromkeys(alts)) + ")"
        types = self._types(schema, path)
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list):
                raise self._err(_pointer(path, "enum"), f"expected a list, got {values!r}")
            keep = [v for v in values if self._literal_ok(v, schema, types)]
            if not keep:
                raise self._err(path, f"no value of {values!r} satisfies the rest of the schema", _Unsatisfiable)
            return "(" + " | ".join(dict.fromkeys(self.literal(v, path) for v in keep)) + ")"
        if types is None:
            return self.any(0)
        alts = [self._typed(t, schema, root, path) for t in types]
        return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"

    def _types(self, schema: dict, path: str) -> list[str] | None:
        t = schema.get("type")
        if t is None:
            implied = [name for name, keys in (("object", _OBJECT_KEYS), ("array", _ARRAY_KEYS),
                                               ("string", _STRING_KEYS), ("number", _NUMBER_KEYS))
                       if any(k in schema for k in keys)]
            if not implied:
                return None
            types = implied
        else:
            types = t if isinstance(t, list) else [t]
        for x in types:
            if x not in _TYPES:
                raise self._err(_pointer(path, "type"), f"unknown type {x!r} (expected one of {list(_TYPES)})")
        if "integer" in types and "number" in types:
            types = [x for x in types if x != "integer"]
        if schema.get("nullable") is True and "null" not in types:  # OpenAPI 3.0
            types = [*types, "null"]
        return list(dict.fromkeys(types))

    def _literal_ok(self, v: Any, schema: dict, types: list[str] | None) -> bool:
        """Does an enum/const value satisfy the schema's other keywords (type, bounds, lengths, pattern)?"""
        if types is not None and not any(_type_ok(v, t) for t in types):
            return False
        if isinstance(v, str):
            if len(v) < schema.get("minLength", 0) or len(v) > schema.get("maxLength", len(v)):
                return False
            pats = schema.get("pattern", [])
            for p in pats if isinstance(pats, list) else [pats]:
                try:
                    if re.search(p, v) is None:
                        return False
                except re.error:
                    pass
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            lo, lo_s, hi, hi_s = self._bounds(schema, "#")
            if lo is not None and (v < lo or (lo_s and v == lo)) or hi is not None and (v > hi or (hi_s and v == hi)):
                return False
        return True

    def literal(self, v: Any, path: str) -> str:
        """A Lark sequence spelling one JSON value (for enum/const)."""
        if self.syntax == "json":
            if isinstance(v, float) and not math.isfinite(v):
                raise self._err(path, f"enum/const value {v!r} is not JSON")
            return _lark_str(_json_text(v))
        if isinstance(v, bool):
            return '"true"' if v else '"false"'
        if v is None:
            return '"null"'
        if isinstance(v, (int, float)):
            return _lark_str(json.dumps(v))
        if isinstance(v, str):
            if any(t in v for t in _GEMMA_TEXT_TAGS):
                raise self._err(path, f"enum/const string {v!r} contains a Gemma 4 string delimiter or stop tag")
            return f"<|\"|> {_lark_str(v)} <|\"|>" if v else '<|"|> <|"|>'
        if isinstance(v, list):
            return '"[" ' + ' "," '.join(self.literal(x, path) for x in v) + ' "]"'
        if isinstance(v, dict):
            keys = sorted(v, key=str.lower) if self.key_order == "sorted" else list(v)
            items = [f"{self.key(k, path)} \":\" {self.literal(v[k], path)}" for k in keys]
            return '"{" ' + ' "," '.join(items) + ' "}"'
        raise self._err(path, f"cannot spell {type(v).__name__} value {v!r}")

    def key(self, k: str, path: str) -> str:
        if self.syntax == "json":
            return _lark_str(json.dumps(k, ensure_ascii=False))
        if _KEY_RE.fullmatch(k):
            return _lark_str(k)
        if not k or any(t in k for t in _GEMMA_TEXT_TAGS):
            raise self._err(path, f"property name {k!r} cannot be written in Gemma 4 syntax")
        return f"<|\"|> {_lark_str(k)} <|\"|>"

    def _typed(self, t: str, schema: dict, root: Any, path: str) -> str:
        if t == "string":
            return self._string(schema, path)
        if t in ("integer", "number"):
            return self._number(schema, t == "integer", path)
        if t == "boolean":
            return '("true" | "false")'
        if t == "null":
            return '"null"'
        if t == "array":
            return self._array(schema, root, path)
        return self._object(schema, root, path)

    # -- free values -----------------------------------------------------------------------------------------------

    def any(self, depth: int) -> str:
        """Any JSON value nesting at most FREE_DEPTH - depth arrays/objects deep, numbers with the default bounds."""
        if depth in self._any:
            return self._any[depth]
        name = self._any[depth] = f"gj_any_{depth}"
        scalars = [self._string({}, "#"), self._number({}, False, "#"), '"true"', '"false"', '"null"']
        if depth >= FREE_DEPTH:
            self.rules.append(f"{name}: " + " | ".join(scalars))
            return name
        inner = self.any(depth + 1)
        arr = self.rule(self._seq("[", "]", inner, 0, None), "arr")
        obj = self.rule(self._seq("{", "}", self._pair(self._free_key([]), inner), 0, None), "obj")
        self.rules.append(f"{name}: " + " | ".join([*scalars, arr, obj]))
        return name

    def _free_key(self, exclude: list[str]) -> str:
        """A key not among `exclude` (the declared properties), for extra members."""
        if self.syntax == "json":
            if not exclude:
                return self.terminal(f'/"{_JSON_CHAR}*"/', "key")
            no = "|".join(_rx_escape(json.dumps(k, ensure_ascii=False)) for k in exclude)
            return self.terminal(f'/"{_JSON_RAW_CHAR}*"/ & ~/{no}/', "key")  # unescaped: no spelling of a declared one
        no = "|".join(_rx_escape(k) for k in exclude)
        bare = "/[A-Za-z_][A-Za-z0-9_\\-.]*/" + (f" & ~/{no}/" if exclude else "")
        text = _text_without(_GEMMA_TEXT_TAGS) + (f" & ~/{no}/" if exclude else "")
        return f'({self.terminal(bare, "key")} | <|"|> {self.terminal(text, "keytext")} <|"|>)'

    def _pair(self, key: str, val: str) -> str:
        return f"{key} {self._sep(':')} {val}"

    def _seq(self, open_: str, close: str, item: str, lo: int, hi: int | None) -> str:
        """open item ("," item)* close with lo..hi items."""
        o, c, comma = _lark_str(open_), self._close(close), self._sep(",")
        if hi == 0:
            return f"{o} {c}"
        more_lo, more_hi = max(lo - 1, 0), (None if hi is None else hi - 1)
        rep = "*" if more_lo == 0 and more_hi is None else f"{{{more_lo},{'' if more_hi is None else more_hi}}}"
        if more_hi == 0:
            seq = item
        else:
            seq = f"{item} ({comma} {item}){rep}"
        return f"{o} {self._lead(seq)} {c}" if lo >= 1 else f"{o} ({self._lead(seq)})? {c}"

    # -- strings ---------------------------------------------------------------------------------------------------

    def _string(self, schema: dict, path: str) -> str:
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        for k, v in (("minLength", lo), ("maxLength", hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise self._err(_pointer(path, k), f"expected a non-negative integer, got {v!r}")
        if hi is not None and hi < lo:
            raise self._err(path, f"maxLength {hi} < minLength {lo}", _Unsatisfiable)
        pats = schema.get("pattern", [])
        pats = list(pats) if isinstance(pats, list) else [pats]
        fmt = schema.get("format")
        regexes = []  # (body, anchored start, anchored end, python pattern or None)
        for p in pats:
            if not isinstance(p, str):
                raise self._err(_pointer(path, "pattern"), f"expected a string, got {p!r}")
            regexes.append((*_ecma_pattern(p), p))
        if fmt in _FORMATS:
            regexes.append((_FORMATS[fmt], True, True, "^(?:" + _FORMATS[fmt] + ")$"))
        constraints = []
        for body, a, b, _ in regexes:
            rx = ("" if a else "(?s:.*)") + f"(?:{body})" + ("" if b else "(?s:.*)")
            self._check_regex(rx, path, body)
            constraints.append(f"/{rx}/")
        count = "*" if (lo, hi) == (0, None) else f"{{{lo},{'' if hi is None else hi}}}"
        if self.syntax == "json":
            if not constraints:
                return self.terminal(f'/"(?:{_JSON_CHAR}){count}"/', "str")
            content = f"/(?:{_JSON_RAW_CHAR}){count}/"  # a pattern sees the value: no escapes then
            return self.terminal(f'"\\"" ({content} & {" & ".join(constraints)}) "\\""', "str")
        if hi == 0:
            return '<|"|> <|"|>'
        text = " & ".join([_text_without(_GEMMA_TEXT_TAGS)]
                          + ([f"/(?s:.{{{max(lo, 1)},{'' if hi is None else hi}}})/"] if (lo > 1 or hi) else [])
                          + constraints)
        term = self.terminal(text, "text")
        empty_ok = lo == 0 and all(py is not None and _python_pattern_allows_empty(py) for *_, py in regexes)
        return f"<|\"|> {term}{'?' if empty_ok else ''} <|\"|>"

    def _check_regex(self, rx: str, path: str, shown: str) -> None:
        err = llguidance.LLMatcher.validate_grammar(f"start: T\nT: /{rx}/")
        if err and not err.startswith("WARNING"):
            raise self._err(_pointer(path, "pattern"), f"pattern {shown!r} is not supported: {err.strip()}")

    # -- numbers ---------------------------------------------------------------------------------------------------

    def _bounds(self, schema: dict, path: str) -> tuple[Decimal | None, bool, Decimal | None, bool]:
        """(lower, lower exclusive, upper, upper exclusive) from minimum/maximum/exclusive* (draft 4 booleans too)."""
        def dec(k: str) -> Decimal | None:
            v = schema.get(k)
            if v is None or isinstance(v, bool):
                return None
            if not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
                raise self._err(_pointer(path, k), f"expected a finite number, got {v!r}")
            return Decimal(v) if isinstance(v, int) else Decimal(repr(v))

        lo, hi, xlo, xhi = dec("minimum"), dec("maximum"), dec("exclusiveMinimum"), dec("exclusiveMaximum")
        lo_s = schema.get("exclusiveMinimum") is True
        hi_s = schema.get("exclusiveMaximum") is True
        if xlo is not None and (lo is None or xlo >= lo):
            lo, lo_s = xlo, True
        if xhi is not None and (hi is None or xhi <= hi):
            hi, hi_s = xhi, True
        return lo, lo_s, hi, hi_s

    def _number(self, schema: dict, integer: bool, path: str) -> str:
        lo, lo_s, hi, hi_s = self._bounds(schema, path)
        if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_s or hi_s))):
            raise self._err(path, f"no number lies between the bounds {lo} and {hi}", _Unsatisfiable)
        step = schema.get("multipleOf")
        if step is not None:
            if isinstance(step, bool) or not isinstance(step, (int, float)) or not step > 0:
                raise self._err(_pointer(path, "multipleOf"), f"expected a positive number, got {step!r}")
            step = Decimal(step) if isinstance(step, int) else Decimal(repr(step))
        cap = Decimal(10**INT_DIGITS)  # a default bound is exclusive: at most INT_DIGITS integer digits
        free = lo is None and hi is None
        if hi is None:
            hi, hi_s = (cap if lo is None else max(cap, lo + cap)), True
        if lo is None:
            lo, lo_s = min(-cap, hi - cap), True
        places = None if step is None else _decimal_places(step)  # multipleOf 10^-k: at most k fraction digits
        if integer or places == 0:
            a = math.floor(lo) + 1 if lo_s and lo == math.floor(lo) else math.ceil(lo)
            b = math.ceil(hi) - 1 if hi_s and hi == math.ceil(hi) else math.floor(hi)
            if a > b:
                raise self._err(path, f"no integer lies between the bounds {lo} and {hi}", _Unsatisfiable)
            if step is None or places is not None or (1 / step) == (1 / step).to_integral_value():
                return self.terminal(f"/{_int_range(a, b)}/", "int")
            return self._enumerate(Decimal(a), False, Decimal(b), False, step, path, integer=True)
        if step is not None and places is None:
            return self._enumerate(lo, lo_s, hi, hi_s, step, path, integer=False)
        n = max(FRAC_DIGITS, _frac_digits(lo) + 1, _frac_digits(hi) + 1) if places is None else places
        rx = _dec_range(lo, lo_s, hi, hi_s, n)
        if rx is None:
            raise self._err(path, f"no number with at most {n} fraction digits lies between {lo} and {hi}",
                            _Unsatisfiable)
        if free:  # no bounds at all: an exponent may widen the range (finite floats: < 1e116)
            rx = f"(?:{rx})(?:[eE][+-]?[0-9]{{1,{EXP_DIGITS}}})?"
        return self.terminal(f"/{rx}/", "num")

    def _enumerate(self, lo: Decimal, lo_s: bool, hi: Decimal, hi_s: bool, step: Decimal, path: str, *,
                   integer: bool) -> str:
        """The multiples of `step` in the range, spelled out (when there are few enough)."""
        first = math.floor(lo / step) + 1 if lo_s and lo / step == math.floor(lo / step) else math.ceil(lo / step)
        last = math.ceil(hi / step) - 1 if hi_s and hi / step == math.ceil(hi / step) else math.floor(hi / step)
        values = [step * i for i in range(first, last + 1)] if last - first < MAX_ENUMERATED else None
        if values is not None and integer:
            values = [v for v in values if v == v.to_integral_value()]
        if values is None:
            raise self._err(_pointer(path, "multipleOf"), f"multipleOf {step} leaves {last - first + 1} values "
                                                          f"between {lo} and {hi}; at most {MAX_ENUMERATED} are "
                                                          "spelled out (set tighter bounds)")
        if not values:
            raise self._err(path, f"no multiple of {step} lies between {lo} and {hi}", _Unsatisfiable)
        spelled = [str(int(v)) if v == v.to_integral_value() else format(v.normalize(), "f") for v in values]
        return "(" + " | ".join(_lark_str(s) for s in spelled) + ")"

    # -- arrays ----------------------------------------------------------------------------------------------------

    def _array(self, schema: dict, root: Any, path: str) -> str:
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if hi is not None and hi < lo:
            raise self._err(path, f"maxItems {hi} < minItems {lo}", _Unsatisfiable)
        items = schema.get("items")
        if isinstance(items, list):  # draft 4-2019 tuple form
            prefix, extra = items, schema.get("additionalItems", True)
        else:
            prefix, extra = schema.get("prefixItems", []), (True if items is None else items)
        if hi is not None:
            prefix = prefix[:hi]
        if lo > len(prefix) and extra is False:
            raise self._err(path, f"minItems {lo} > {len(prefix)} items allowed", _Unsatisfiable)
        if not prefix:
            item = self.any(1) if extra is True else self.value(extra, root, _pointer(path, "items"))
            return self.rule(self._seq("[", "]", item, lo, hi), "arr")
        comma = self._sep(",")
        tail = ""  # items after the prefix: all optional past minItems
        if extra is not False and (hi is None or hi > len(prefix)):
            item = self.any(1) if extra is True else self.value(extra, root, _pointer(path, "items"))
            more_lo = max(lo - len(prefix), 0)
            more_hi = None if hi is None else hi - len(prefix)
            tail = f"({comma} {item}){{{more_lo},{'' if more_hi is None else more_hi}}}".replace("{0,}", "*")
        body = tail
        for i in reversed(range(len(prefix))):
            here = self.value(prefix[i], root, _pointer(path, "prefixItems", i))
            seq = (self._lead(here) if i == 0 else f"{comma} {here}") + (f" {body}" if body else "")
            body = seq if i < lo else f"({seq})?"
        return self.rule(f"{_lark_str('[')} {body} {self._close(']')}", "arr")

    # -- objects ---------------------------------------------------------------------------------------------------

    def _object(self, schema: dict, root: Any, path: str) -> str:
        props = dict(schema.get("properties") or {})
        required = list(schema.get("required") or [])
        extra = schema.get("additionalProperties", schema.get("unevaluatedProperties"))
        for k in required:
            if k not in props:
                props[k] = extra if extra is not None else True
        for k in [k for k, s in props.items() if self._normalize(s, root, path) is False]:
            if k in required:
                raise self._err(_pointer(path, "properties", k), "required property whose schema is false",
                                _Unsatisfiable)
            del props[k]
        if extra is None:  # absent: free keys without a `properties` keyword, else none (strict, as OpenAI's)
            extra = "properties" not in schema
        elif extra == {}:
            extra = True
        extra_lo, extra_hi = self._extra_count(schema, props, required, extra, path)
        keys = sorted(props, key=str.lower) if self.key_order == "sorted" else list(props)
        items = [(self._pair(self.key(k, path), self.value(props[k], root, _pointer(path, "properties", k))),
                  k in required) for k in keys]
        comma = self._sep(",")
        extra_pair = None
        if extra is not False and extra_hi != 0:
            val = self.any(1) if extra is True else self.value(extra, root, _pointer(path, "additionalProperties"))
            extra_pair = self._pair(self._free_key(list(props)), val)
        # members(k, first): the members from index k on; `first`: nothing was written before (no comma).
        memo: dict[tuple[int, bool], str] = {}

        def members(k: int, first: bool) -> str:
            if (k, first) in memo:
                return memo[(k, first)]
            if k == len(items):
                if extra_pair is None:
                    return ""
                lo, hi = (max(extra_lo - 1, 0), None if extra_hi is None else extra_hi - 1) if first else (
                    extra_lo, extra_hi)
                rest = "" if hi == 0 else f"({comma} {extra_pair}){{{lo},{'' if hi is None else hi}}}".replace(
                    "{0,}", "*")
                body = rest
                if first:
                    body = f"{self._lead(extra_pair)} {rest}"
                    body = body if extra_lo >= 1 else f"({body})?"
            else:
                item, req = items[k]
                here = (self._lead(item) if first else f"{comma} {item}") + " " + members(k + 1, False)
                skip = "" if req else members(k + 1, first)
                body = here if req else (f"({here})?" if not skip else f"{here} | {skip}")
            memo[(k, first)] = name = self.rule(body, "mem")
            return name

        inner = members(0, True)
        return self.rule(f"{_lark_str('{')} {inner} {self._close('}')}", "obj")

    def _extra_count(self, schema: dict, props: dict, required: list, extra: Any, path: str) -> tuple[int, int | None]:
        """minProperties / maxProperties as bounds on the number of extra members: exact when every declared
        property is required (the count of declared members is then fixed), else accepted only where they cannot
        fail."""
        lo_p, hi_p = schema.get("minProperties", 0), schema.get("maxProperties")
        for k, v in (("minProperties", lo_p), ("maxProperties", hi_p)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise self._err(_pointer(path, k), f"expected a non-negative integer, got {v!r}")
        if len(required) == len(props):
            n = len(props)
            if extra is False:
                if n < lo_p or (hi_p is not None and n > hi_p):
                    raise self._err(path, f"{n} properties, outside minProperties {lo_p} / maxProperties {hi_p}",
                                    _Unsatisfiable)
                return 0, 0
            if hi_p is not None and hi_p < max(n, lo_p):
                raise self._err(path, f"maxProperties {hi_p} < {max(n, lo_p)} properties needed", _Unsatisfiable)
            return max(lo_p - n, 0), (None if hi_p is None else hi_p - n)
        if not self.lenient and (lo_p > len(required) or (hi_p is not None and (extra is not False or
                                                                                 hi_p < len(props)))):
            k = "minProperties" if lo_p > len(required) else "maxProperties"
            raise self._err(_pointer(path, k), f"keyword {k!r} is supported only when every declared property is "
                                               "required, or where it cannot fail (pass lenient=True to ignore it)")
        return 0, None


# --------------------------------------------------------------------------------------------------------------------
# Grammars (Lark source strings)


def json_object_grammar(*, whitespace: Literal["compact", "flexible"] = "compact", max_whitespace: int = 32) -> str:
    """Any JSON object (OpenAI `response_format: {"type": "json_object"}`), with the free-value bounds of the module
    docstring; see json_schema_grammar for the arguments."""
    return json_schema_grammar({"type": "object"}, whitespace=whitespace, max_whitespace=max_whitespace)


def json_schema_grammar(schema: dict | bool | str, *, lenient: bool = False,
                        whitespace: Literal["compact", "flexible"] = "compact", max_whitespace: int = 32) -> str:
    """JSON text valid against `schema` (a Lark grammar; subset and bounds in the module docstring).

    Args:
        schema: a JSON schema as a dict (or bool), or its JSON text.
        lenient: ignore keywords this compiler does not enforce (the output may then violate them) instead of
            failing.
        whitespace: "compact" (default): no whitespace outside strings, as OpenAI's structured outputs write JSON,
            so a weak model cannot spend its tokens on it; "flexible": at most `max_whitespace` whitespace
            characters wherever JSON allows whitespace between tokens (room for pretty-printing), never before or
            after the value.
        max_whitespace: the bound of "flexible" whitespace (>= 1).
    Raises:
        GrammarError: the schema is not JSON, uses an unsupported keyword (naming its JSON path), or admits no value.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"json_schema: expected a JSON schema, got text that is not JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"json_schema: expected a JSON object or boolean, got {type(schema).__name__}")
    conv = _SchemaLark("json", where="json_schema", key_order="schema", lenient=lenient, whitespace=whitespace,
                       max_whitespace=max_whitespace)
    try:
        start = conv.value(schema, schema)
    except RecursionError:
        raise GrammarError("json_schema: nested too deeply (or a cycle of $ref / allOf)") from None
    return "\n".join([f"start: {start}", *conv.rules]) + "\n"


# Inside the thought channel parse_gemma4 acts on `<channel|>`, `<|tool_call>` and the stop tags.
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
    lenient: bool = False,
) -> str:
    """Output that is one or more Gemma 4 tool calls, then `<|tool_response>`.

    Each call is `<|tool_call>call:NAME{ARGS}<tool_call|>` with ARGS following the tool's JSON-schema parameters in
    Gemma 4 syntax (subset and bounds in the module docstring), compact as the chat template writes them. Every call
    of a parallel response is held to its own tool's schema: the calls are repetitions of one alternation of
    per-tool rules.

    Args:
        tools: OpenAI tool list ([{"type": "function", "function": {"name", "parameters"?}}]; bare function dicts are
            accepted too).
        mode: "required" (any of the tools) or "named" (only `name`).
        name: the function to call when mode == "named".
        parallel: allow several calls in a row (else exactly one).
        thinking: put a free thought channel before the calls (see thinking_then).
        key_order: "sorted": object keys in case-insensitive alphabetical order, as the Gemma 4 chat template renders
            tool-call arguments (jinja `dictsort`), so the order the model was shown; "schema": declaration order.
        lenient: ignore schema keywords that are not enforced instead of failing.
    Raises:
        GrammarError: no tools, unknown name or mode, a name or schema that cannot be written in Gemma 4 syntax or
        uses an unsupported keyword (the message names the tool and the JSON path).
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
    conv = _SchemaLark("gemma", where="tool parameters", key_order=key_order, lenient=lenient)
    calls = []
    for fn in fns:
        if not _NAME_RE.fullmatch(fn["name"]):
            raise GrammarError(f"tool name {fn['name']!r} must match [A-Za-z0-9_.-]+ to be called in Gemma 4 syntax")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise GrammarError(f"tool {fn['name']}: parameters must be a JSON schema of type object, got {params!r}")
        conv.where = f"tool {fn['name']} parameters"
        if not params:  # no (or empty) parameters: the function takes no arguments, as OpenAI reads it
            params = {"type": "object", "properties": {}}
        try:
            args = conv.value({"type": "object", **params}, params)
        except RecursionError:
            raise GrammarError(f"tool {fn['name']}: parameters nested too deeply (or a cycle of $ref / allOf)") from None
        calls.append(conv.rule(f"<|tool_call> {_lark_str('call:' + fn['name'])} {args} <tool_call|>", "call"))
    lines = [f"start: gj_call{'+' if parallel else ''} <|tool_response>", "gj_call: " + " | ".join(calls)]
    grammar = "\n".join(lines + conv.rules) + "\n"
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
