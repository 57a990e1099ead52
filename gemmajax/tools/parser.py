"""Gemma 4 output parsing: the thought channel, tool calls, and special-token stripping.

Design: one streaming state machine (`Gemma4StreamParser`) consumes text only once its meaning is certain (a
possible partial special tag at the end of a piece is held back), and `parse_gemma4` runs the same machine over the
whole text and joins its deltas, so streaming and one-shot results agree by construction for any split. A tool call
is emitted (a delta with its name, then one with its whole arguments JSON) only once it is complete, because only
then is it certain to be a call at all: a call cut off by max_tokens or broken off by a stop tag is never shown as
one (see below).

Format (gemma4-architecture.md section 7): `<|channel>thought\\n...<channel|>` is reasoning, and
`<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3,b:true,xs:[...]}<tool_call|>` is a tool call.
Choices where the format leaves room, each tested in tests/tools/test_parser.py:
- reasoning=False: a stray `<|channel>...<channel|>` block is removed from the content (never shown), and a bare
  `thought\\n` at the very start of the output is dropped (the answer that follows is content).
- reasoning=True: a bare `thought\\n` at the very start opens the reasoning as if `<|channel>` preceded it.
  Reasoning ends at `<channel|>`, at `<|tool_call>`, or at a stop tag (`<turn|>`, `<eos>`, `<|tool_response>`).
- Whitespace-only content is dropped (content is "" then, or None when there are tool calls); whitespace-only
  reasoning gives reasoning_content None. Otherwise text is kept byte for byte (no strip).
- A tool call is complete when its argument object closes (the `}` matching its `{`; a missing `<tool_call|>`
  after it is forgiven, the arguments are whole) or, without arguments, at `<tool_call|>`
  (`<|tool_call>call:NAME<tool_call|>` is a call with `{}` arguments). A call that is not complete when the text
  ends (max_tokens), or when a stop tag (`<turn|>`, `<eos>`, `<|tool_response>`), another `<|tool_call>` or any other
  special tag outside a string breaks it off, is dropped: no tool call, and its text is not shown as content
  either (it is a fragment of call syntax, and repaired arguments would be a guess presented as the model's call).
  The server reports finish_reason "length" for a cut output, so a client sees that something was cut.
  `<|tool_call>:NAME{` (no `call`) and `<|tool_call>NAME{` are accepted. A header that cannot be a call (e.g.
  `<|tool_call>` followed by prose) is given back to the content without the tag.
- Inside a `<|"|>` string only `<|"|>` closes it (braces, commas, quotes, newlines and `<tool_call|>` are text); the
  stop tags `<turn|>`, `<eos>`, `<|tool_response>` end the call even there.
- Tool call ids are `call_` + 20 alphanumerics of a per-parser prefix + the call index as 4 digits (24 characters for
  fewer than 10,000 calls); the prefix is random unless `id_prefix` is given, which makes ids reproducible.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
import string
from typing import Any

__all__ = [
    "SPECIAL_TAG_RE",
    "STOP_TAGS",
    "Gemma4StreamParser",
    "ParsedMessage",
    "merge_deltas",
    "parse_gemma4",
    "parse_gemma4_args",
]

# Every Gemma 4 special token is `<|name>`, `<name|>` or `<|name|>`; the bar-less ones (and Gemma 3 names) are listed
# by name so that HTML tags such as `<b>` or `<table>` (ordinary tokens of the vocabulary) stay text.
SPECIAL_TAG_RE = re.compile(
    r'<\|[a-z_"]+\|?>|<[a-z_"]+\|>'
    r"|<(?:bos|eos|pad|unk|mask|start_of_turn|end_of_turn|start_of_image|end_of_image|unused[0-9]+)>"
)
# A string that may still grow into a special tag (only checked on a suffix that starts with "<").
_PARTIAL_TAG_RE = re.compile(r'<\|?[a-z0-9_"]*\|?')
# Tags after which the model has stopped: they end the thought channel and a tool call (even inside a string).
STOP_TAGS = frozenset({"<turn|>", "<eos>", "<|tool_response>", "<end_of_turn>"})
_STR = '<|"|>'
_LABEL = "thought\n"
_HEADER_CHARS_RE = re.compile(r"[A-Za-z0-9_\-.:]*")
_HEADER_RE = re.compile(r"(?:call:|:)?([A-Za-z0-9_\-.]+)")
_INT_RE = re.compile(r"-?(?:0|[1-9][0-9]*)")
_FLOAT_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_JSON_STR_RE = re.compile(r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"')
_ALNUM = string.ascii_letters + string.digits

_START, _CONTENT, _LABEL_STATE, _CHANNEL, _HEADER, _BODY = "start", "content", "label", "channel", "header", "body"


@dataclasses.dataclass
class ParsedMessage:
    """One parsed model response.

    content: the visible answer; None when it is empty and there are tool calls (OpenAI behaviour), else a str.
    reasoning_content: the thought-channel text (label stripped), None when empty or when reasoning=False.
    tool_calls: [{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}], in output order.
    """

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict] = dataclasses.field(default_factory=list)


# --------------------------------------------------------------------------------------------------------------------
# Tool-call arguments


class _ArgReader:
    """Lenient recursive-descent reader of Gemma 4 argument syntax: it never raises, and an unterminated object,
    array or string simply ends at the end of the text."""

    def __init__(self, text: str):
        self.s = text
        self.i = 0

    def _skip(self, chars: str) -> None:
        while self.i < len(self.s) and self.s[self.i] in chars:
            self.i += 1

    def _until_str(self) -> str:
        """At a `<|"|>` opener: the raw text up to the closing `<|"|>` (or the end), consumed."""
        start = self.i + len(_STR)
        end = self.s.find(_STR, start)
        if end < 0:
            self.i = len(self.s)
            return self.s[start:]
        self.i = end + len(_STR)
        return self.s[start:end]

    def object(self) -> dict:
        self.i += 1  # "{"
        out: dict[str, Any] = {}
        while True:
            self._skip(" \t\r\n,")
            if self.i >= len(self.s):
                return out
            c = self.s[self.i]
            if c in "}]":
                self.i += 1
                return out
            start = self.i
            if self.s.startswith(_STR, self.i):
                key = self._until_str()
            else:
                j = self.i
                while j < len(self.s) and self.s[j] not in ":,{}[]":
                    j += 1
                key = self.s[self.i : j].strip()
                self.i = j
            self._skip(" \t\r\n")
            if self.i < len(self.s) and self.s[self.i] == ":":
                self.i += 1
                out[key] = self.value()
            elif key:
                out[key] = None
            if self.i == start:  # no progress (e.g. a stray "{" where a key belongs): skip one character
                self.i += 1

    def array(self) -> list:
        self.i += 1  # "["
        out: list[Any] = []
        while True:
            self._skip(" \t\r\n,")
            if self.i >= len(self.s):
                return out
            if self.s[self.i] in "]}":
                self.i += 1
                return out
            start = self.i
            out.append(self.value())
            if self.i == start:
                self.i += 1

    def value(self) -> Any:
        self._skip(" \t\r\n")
        if self.i >= len(self.s):
            return None
        if self.s.startswith(_STR, self.i):
            return self._until_str()
        c = self.s[self.i]
        if c == "{":
            return self.object()
        if c == "[":
            return self.array()
        if c == '"':  # a JSON-quoted string (not Gemma syntax, but models slip into it): may hold commas
            m = _JSON_STR_RE.match(self.s, self.i)
            if m:
                self.i = m.end()
                return json.loads(m.group())
        j = self.i
        while j < len(self.s) and self.s[j] not in ",}]":
            j += 1
        token = self.s[self.i : j].strip()
        self.i = j
        return _bare_value(token)


def _bare_value(token: str) -> Any:
    """A value written without `<|"|>`: true/false, null (also none/nil), a JSON number, else the raw text."""
    low = token.lower()
    if low == "true":
        return True
    if low == "false":
        return False
    if low in ("", "null", "none", "nil"):
        return None
    if _INT_RE.fullmatch(token):
        return int(token)
    if _FLOAT_RE.fullmatch(token):
        f = float(token)
        if math.isfinite(f):
            return f
    if len(token) >= 2 and token[0] == token[-1] == '"':
        try:
            return json.loads(token)
        except ValueError:
            pass
    return token


def parse_gemma4_args(body: str) -> dict:
    """Parse a Gemma 4 argument object `{key:value,...}` (the braces included) into a dict.

    Keys are bare or wrapped in `<|"|>`; values are `<|"|>` strings (raw, no escapes), numbers, true/false, null,
    nested objects and arrays. Lenient: a missing closer ends at the end of the text; never raises.
    """
    body = body.strip()
    if not body.startswith("{"):
        body = "{" + body
    return _ArgReader(body).object()


# --------------------------------------------------------------------------------------------------------------------
# Streaming parser


class Gemma4StreamParser:
    """Incremental Gemma 4 output parser producing OpenAI chat-completion delta dicts.

    Usage: one parser per response; `feed(piece)` for each detokenized piece (special tokens kept), then `close()`.
    Deltas: {"content": str}, {"reasoning_content": str}, or {"tool_calls": [{"index", "id"?, "type"?,
    "function": {"name"?, "arguments"?}}]}. A call comes as two deltas in the same feed, once it is complete: the
    first carries index, id, type, name and arguments "", the second the whole arguments JSON. A call that never
    completes yields no delta (module docstring).

    Args:
        reasoning: parse the thought channel into reasoning_content (else channel blocks are dropped).
        prompt_in_reasoning: the prompt ended inside an open `<|channel>`, so the output starts in the channel
            (a leading `thought\\n` label is still stripped).
        id_prefix: the part of every tool-call id between `call_` and the 4-digit call index; random
            (20 alphanumerics) when None.
    """

    def __init__(self, reasoning: bool = False, *, prompt_in_reasoning: bool = False, id_prefix: str | None = None):
        self.reasoning = reasoning
        self.id_prefix = id_prefix if id_prefix is not None else "".join(secrets.choice(_ALNUM) for _ in range(20))
        self._state = _LABEL_STATE if prompt_in_reasoning else _START
        self._buf = ""
        self._closed = False
        self._n_calls = 0
        self._name = ""  # of the call whose arguments are being read
        self._body = ""
        self._depth = 0
        self._in_str = False
        self._held = {"content": "", "reasoning_content": ""}  # whitespace not yet known to be followed by text
        self._started = {"content": False, "reasoning_content": False}

    @property
    def num_tool_calls(self) -> int:
        """Number of complete tool calls emitted so far."""
        return self._n_calls

    def feed(self, text_piece: str) -> list[dict]:
        """Add one piece of output text; returns the deltas that became certain."""
        if self._closed:
            raise RuntimeError("Gemma4StreamParser.feed called after close(); use one parser per response")
        self._buf += text_piece
        out: list[dict] = []
        self._run(out, final=False)
        return out

    def close(self) -> list[dict]:
        """End of output: flush held-back text; a tool call still open is dropped (it was cut)."""
        if self._closed:
            return []
        out: list[dict] = []
        self._run(out, final=True)
        self._closed = True
        return out

    # -- machinery ---------------------------------------------------------------------------------------------------

    def _run(self, out: list[dict], final: bool) -> None:
        steps = {
            _START: self._step_start,
            _CONTENT: self._step_text,
            _CHANNEL: self._step_text,
            _LABEL_STATE: self._step_label,
            _HEADER: self._step_header,
            _BODY: self._step_body,
        }
        while steps[self._state](out, final):
            pass

    def _emit_text(self, out: list[dict], kind: str, text: str) -> None:
        if not text or (kind == "reasoning_content" and not self.reasoning):
            return
        if not self._started[kind]:
            self._held[kind] += text
            if not self._held[kind].strip():
                return
            text, self._held[kind] = self._held[kind], ""
            self._started[kind] = True
        if out and list(out[-1]) == [kind]:
            out[-1][kind] += text
        else:
            out.append({kind: text})

    def _step_start(self, out: list[dict], final: bool) -> bool:
        buf = self._buf
        if buf.startswith(_LABEL):
            self._buf = buf[len(_LABEL) :]
            self._state = _CHANNEL if self.reasoning else _CONTENT
            return True
        if _LABEL.startswith(buf) and not final:
            return False
        self._state = _CONTENT
        return True

    def _step_label(self, out: list[dict], final: bool) -> bool:
        buf = self._buf
        if buf.startswith(_LABEL):
            self._buf = buf[len(_LABEL) :]
        elif _LABEL.startswith(buf) and not final:
            return False
        elif buf.startswith("thought<"):  # label without newline, directly followed by a tag
            rest = buf[len("thought") :]
            if SPECIAL_TAG_RE.match(rest):
                self._buf = rest
            elif not final and _PARTIAL_TAG_RE.fullmatch(rest):
                return False
        elif final and buf == "thought":
            self._buf = ""
        self._state = _CHANNEL
        return True

    def _step_text(self, out: list[dict], final: bool) -> bool:
        kind = "content" if self._state == _CONTENT else "reasoning_content"
        buf = self._buf
        if not buf:
            return False
        i = buf.find("<")
        if i < 0:
            self._emit_text(out, kind, buf)
            self._buf = ""
            return True
        if i > 0:
            self._emit_text(out, kind, buf[:i])
            buf = self._buf = buf[i:]
        m = SPECIAL_TAG_RE.match(buf)
        if m:
            self._buf = buf[m.end() :]
            self._on_tag(m.group())
            return True
        if not final and _PARTIAL_TAG_RE.fullmatch(buf):
            return False
        self._emit_text(out, kind, "<")
        self._buf = buf[1:]
        return True

    def _on_tag(self, tag: str) -> None:
        if tag == "<|tool_call>":
            self._state = _HEADER
        elif self._state == _CONTENT:
            if tag == "<|channel>":
                self._state = _LABEL_STATE
        elif tag == "<channel|>" or tag in STOP_TAGS:
            self._state = _CONTENT
        # any other special tag is dropped

    def _step_header(self, out: list[dict], final: bool) -> bool:
        buf = self._buf
        j = _HEADER_CHARS_RE.match(buf).end()
        header = buf[:j]
        m = _HEADER_RE.fullmatch(header)
        if j == len(buf):
            if not final:
                return False
            if not _HEADER_RE.fullmatch(header + "x"):  # cannot grow into `call:NAME`: text, e.g. `a:b:c`
                self._emit_text(out, "content", header)
            self._buf = ""  # else a header cut off by the end of the text: an incomplete call, dropped
            self._state = _CONTENT
            return True
        c = buf[j]
        if c == "{" and m:
            self._name = m.group(1)
            self._buf = buf[j + 1 :]
            self._body, self._depth, self._in_str = "{", 1, False
            self._state = _BODY
            return True
        if c == "<":
            rest = buf[j:]
            tag = SPECIAL_TAG_RE.match(rest)
            if tag and m:
                if tag.group() == "<tool_call|>":  # `call:NAME<tool_call|>`: a call without arguments
                    self._emit_call(out, m.group(1), "{}")
                # any other tag breaks the call off before its arguments: dropped; the tag is read as content's
                self._buf = rest
                self._state = _CONTENT
                return True
            if not tag and not final and _PARTIAL_TAG_RE.fullmatch(rest):
                return False
        # Not a tool call: give the header text back to the content.
        self._emit_text(out, "content", header)
        self._buf = buf[j:]
        self._state = _CONTENT
        return True

    def _step_body(self, out: list[dict], final: bool) -> bool:
        buf, i, n = self._buf, 0, len(self._buf)
        end = None  # index in buf where the call ends (exclusive), when it ends in this step
        closed = False  # it ends because its argument object closed (else a tag broke it off)
        while i < n:
            if self._in_str:
                k = buf.find("<", i)
                if k < 0:
                    i = n
                    break
                i = k
                if buf.startswith(_STR, i):
                    self._in_str = False
                    i += len(_STR)
                    continue
                m = SPECIAL_TAG_RE.match(buf, i)
                if m:
                    if m.group() in STOP_TAGS:
                        end = i
                        break
                    i = m.end()
                    continue
                if not final and _PARTIAL_TAG_RE.fullmatch(buf, i):
                    break
                i += 1
                continue
            c = buf[i]
            if c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end, closed = i + 1, True
                    break
            elif c == "<":
                m = SPECIAL_TAG_RE.match(buf, i)
                if m:
                    if m.group() == _STR:
                        self._in_str = True
                        i = m.end()
                        continue
                    end = i  # any other special tag outside a string ends the call
                    break
                if not final and _PARTIAL_TAG_RE.fullmatch(buf, i):
                    break
            i += 1
        if end is not None:
            self._body += buf[:end]
            self._buf = buf[end:]
        else:
            self._body += buf[:i]
            self._buf = buf[i:]
            if not final:
                return i > 0
        if closed:
            self._emit_call(out, self._name, json.dumps(parse_gemma4_args(self._body), ensure_ascii=False))
        self._body = ""  # else the call was cut or broken off: dropped (module docstring)
        self._state = _CONTENT
        return True

    def _emit_call(self, out: list[dict], name: str, arguments: str) -> None:
        """A complete call: a delta with index, id, type and name (arguments ""), then one with the arguments."""
        index = self._n_calls
        self._n_calls += 1
        call_id = f"call_{self.id_prefix}{index:04d}"
        out.append(
            {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                             "function": {"name": name, "arguments": ""}}]}
        )
        out.append({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})


def merge_deltas(deltas: list[dict]) -> ParsedMessage:
    """Join stream deltas into one message: text concatenated, tool calls gathered per index (name and arguments
    concatenated). Content is None when it is empty and there are tool calls; reasoning_content None when empty."""
    content, reasoning = [], []
    calls: dict[int, dict] = {}
    for d in deltas:
        if "content" in d:
            content.append(d["content"])
        if "reasoning_content" in d:
            reasoning.append(d["reasoning_content"])
        for tc in d.get("tool_calls", ()):
            call = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            if tc.get("id"):
                call["id"] = tc["id"]
            if tc.get("type"):
                call["type"] = tc["type"]
            fn = tc.get("function", {})
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
    tool_calls = [calls[i] for i in sorted(calls)]
    text = "".join(content)
    return ParsedMessage(
        content=None if (not text and tool_calls) else text,
        reasoning_content="".join(reasoning) or None,
        tool_calls=tool_calls,
    )


def parse_gemma4(
    text: str, reasoning: bool = False, *, prompt_in_reasoning: bool = False, id_prefix: str | None = None
) -> ParsedMessage:
    """Parse one whole Gemma 4 response (detokenized with special tokens kept).

    Args:
        text: the model output, e.g. `<|channel>thought\\n...<channel|>Answer<turn|>`.
        reasoning: split the thought channel into reasoning_content (else it is dropped).
        prompt_in_reasoning: the prompt ended inside an open `<|channel>`.
        id_prefix: tool-call id prefix (see Gemma4StreamParser); random when None.
    Returns:
        ParsedMessage, equal to merge_deltas of a Gemma4StreamParser fed the same text in any pieces.
    """
    p = Gemma4StreamParser(reasoning, prompt_in_reasoning=prompt_in_reasoning, id_prefix=id_prefix)
    return merge_deltas(p.feed(text) + p.close())
