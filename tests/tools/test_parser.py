"""Gemma 4 output parsing: hand-written texts with expected results, and the streaming property
(deltas of any split of a text, joined, equal parse_gemma4 of the whole text)."""

import json
import random

import pytest

from gemmajax.tools.parser import (
    SPECIAL_TAG_RE,
    Gemma4StreamParser,
    merge_deltas,
    parse_gemma4,
    parse_gemma4_args,
)

S = '<|"|>'  # the string delimiter token, as text
PFX = "A1b2C3d4E5f6G7h8I9j0"  # a fixed 20-character id prefix


def call(name, args):
    return (name, args)


# (text, reasoning, expected content, expected reasoning_content, expected [(name, arguments dict)])
CASES = [
    # plain text, special tokens stripped, HTML-like ordinary tokens kept
    ("Hello, world!<turn|>", False, "Hello, world!", None, []),
    ("Hi there.<eos>", False, "Hi there.", None, []),
    (f"A{S}B<bos>C<|turn>D<tool_response|>E<|think|>F<|image|>G<end_of_turn>", False, "ABCDEFG", None, []),
    ("Use <b>bold</b>, <table> and a < b > c <- arrows", False,
     "Use <b>bold</b>, <table> and a < b > c <- arrows", None, []),
    ("", False, "", None, []),
    ("   \n", False, "", None, []),
    # every value type
    ((f"<|tool_call>call:set{{s:{S}x{S},i:42,neg:-7,f:3.25,e:1e-3,E:-2.5E+2,t:true,fa:false,nu:null,z:0}}"
     "<tool_call|><|tool_response>"), False, None, None,
     [call("set", {"s": "x", "i": 42, "neg": -7, "f": 3.25, "e": 0.001, "E": -250.0, "t": True, "fa": False,
                   "nu": None, "z": 0})]),
    # nested objects and arrays
    ((f"<|tool_call>call:plan{{steps:[{{id:1,tags:[{S}a{S},{S}b{S}]}},{{id:2,tags:[]}}],"
     f"meta:{{owner:{{name:{S}Ann{S}}},empty:{{}}}},grid:[[1,2],[3]]}}<tool_call|>"), False, None, None,
     [call("plan", {"steps": [{"id": 1, "tags": ["a", "b"]}, {"id": 2, "tags": []}],
                    "meta": {"owner": {"name": "Ann"}, "empty": {}}, "grid": [[1, 2], [3]]})]),
    # two calls after some content
    ((f"Checking both.<|tool_call>call:get_weather{{city:{S}Paris{S}}}<tool_call|>"
     f"<|tool_call>call:get_weather{{city:{S}Tokyo{S},unit:{S}c{S}}}<tool_call|><|tool_response>"), False,
     "Checking both.", None,
     [call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "Tokyo", "unit": "c"})]),
    # strings holding braces, commas, colons, quotes, newlines, a closing tag and brackets
    ((f"<|tool_call>call:run{{code:{S}def f(x):\n    return {{\"a\": [1, 2]}}, 'q'{S},"
     f"note:{S}a:b, c}}d]<tool_call|>e{S}}}<tool_call|>"), False, None, None,
     [call("run", {"code": "def f(x):\n    return {\"a\": [1, 2]}, 'q'", "note": "a:b, c}d]<tool_call|>e"})]),
    # keys wrapped in the string token
    (f"<|tool_call>call:k{{{S}my key{S}:1,{S}x:y{S}:{S}v{S}}}<tool_call|>", False, None, None,
     [call("k", {"my key": 1, "x:y": "v"})]),
    # reasoning + tool call
    ((f"<|channel>thought\nNeed weather.<channel|><|tool_call>call:get_weather{{city:{S}Oslo{S}}}<tool_call|>"
     "<|tool_response>"), True, None, "Need weather.", [call("get_weather", {"city": "Oslo"})]),
    # reasoning ends at <|tool_call> when <channel|> is missing
    ("<|channel>thought\nNeed it<|tool_call>call:f{}<tool_call|>", True, None, "Need it", [call("f", {})]),
    # reasoning + content, with reasoning on and off
    ("<|channel>thought\nThe user greets.\n<channel|>Hello!<turn|>", True, "Hello!", "The user greets.\n", []),
    ("<|channel>thought\nThe user greets.\n<channel|>Hello!<turn|>", False, "Hello!", None, []),
    # a stray channel block in the middle is hidden with reasoning off
    ("Before<|channel>thought\nsecret<channel|>After", False, "BeforeAfter", None, []),
    ("Before<|channel>thought\nsecret<channel|>After", True, "BeforeAfter", "secret", []),
    # bare `thought\n` at the very start
    ("thought\nShort plan<channel|>Done.<turn|>", True, "Done.", "Short plan", []),
    ("thought\nDone.<turn|>", False, "Done.", None, []),
    ("thoughtful answer", True, "thoughtful answer", None, []),
    ("I had a thought\nthen more", True, "I had a thought\nthen more", None, []),
    # empty thought block, label without newline
    ("<|channel>thought\n<channel|>Answer", True, "Answer", None, []),
    ("<|channel>thought<channel|>Answer", True, "Answer", None, []),
    # missing <tool_call|> after a closed argument object: the call is whole
    ("<|tool_call>call:f{a:1}<|tool_response>", False, None, None, [call("f", {"a": 1})]),
    ("<|tool_call>call:f{a:1}<|tool_call>call:g{}", False, None, None, [call("f", {"a": 1}), call("g", {})]),
    # an argument object that never closes (cut by the end of the text, or broken off by a tag) is not a call,
    # and its text is not content either; the calls around it keep their places and ids
    ("<|tool_call>call:f{a:1,b:[1,2<turn|>", False, "", None, []),
    (f"<|tool_call>call:f{{a:{S}unterminated", False, "", None, []),
    (f"<|tool_call>call:f{{a:{S}cut<turn|>", False, "", None, []),
    ("<|tool_call>call:f{a:1<|tool_call>call:g{b:2}<tool_call|>", False, None, None, [call("g", {"b": 2})]),
    (f"Let me check.<|tool_call>call:g{{b:2}}<tool_call|><|tool_call>call:f{{city:{S}Par", False, "Let me check.",
     None, [call("g", {"b": 2})]),
    ("<|tool_call>call:f{a:{b:1}", False, "", None, []),
    ("<|tool_call>call:f", False, "", None, []),  # cut in the header
    ("<|tool_call>call:f<turn|>", False, "", None, []),  # broken off before any arguments
    ("<|tool_call>call:f{a:1}<tool_call|>After<|tool_call>call:g{", False, "After", None, [call("f", {"a": 1})]),
    # variants of the header
    (f"<|tool_call>:lookup{{q:{S}x{S}}}<tool_call|>", False, None, None, [call("lookup", {"q": "x"})]),
    ("<|tool_call>call:get_time<tool_call|>", False, None, None, [call("get_time", {})]),
    ("<|tool_call>call:ns.tool-v2{}<tool_call|>", False, None, None, [call("ns.tool-v2", {})]),
    ("<|tool_call>Sorry, no tool.<turn|>", False, "Sorry, no tool.", None, []),
    # whitespace-only content next to tool calls is dropped; text after a call is content
    ("\n<|tool_call>call:f{}<tool_call|>\n", False, None, None, [call("f", {})]),
    ("<|tool_call>call:f{}<tool_call|>Done", False, "Done", None, [call("f", {})]),
    # unicode
    ("Grüße, 你好 👋<turn|>", False, "Grüße, 你好 👋", None, []),
    (f"<|tool_call>call:w{{city:{S}東京{S},emoji:{S}🌧️{S},k:{S}naïve{S}}}<tool_call|>", False, None, None,
     [call("w", {"city": "東京", "emoji": "🌧️", "k": "naïve"})]),
    # lenient bare values
    ('<|tool_call>call:f{a:None,b:True,c:"q,r",d:007,e:abc def,f:}<tool_call|>', False, None, None,
     [call("f", {"a": None, "b": True, "c": "q,r", "d": "007", "e": "abc def", "f": None})]),
]


def _check(msg, content, reasoning_content, calls):
    assert msg.content == content, f"content: expected {content!r}, got {msg.content!r}"
    assert msg.reasoning_content == reasoning_content, (
        f"reasoning_content: expected {reasoning_content!r}, got {msg.reasoning_content!r}")
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.tool_calls]
    assert got == calls, f"tool calls: expected {calls}, got {got}"
    for i, c in enumerate(msg.tool_calls):
        assert c["id"] == f"call_{PFX}{i:04d}" and c["type"] == "function", c
        # JSON values keep their types exactly (json.loads(1.0) == 1 would hide a float/int mix-up)
        assert json.dumps(json.loads(c["function"]["arguments"])) == json.dumps(calls[i][1])
    if msg.content is not None:
        assert not SPECIAL_TAG_RE.search(msg.content), f"special tag leaked into content: {msg.content!r}"


@pytest.mark.parametrize("text,reasoning,content,reasoning_content,calls", CASES)
def test_parse_cases(text, reasoning, content, reasoning_content, calls):
    _check(parse_gemma4(text, reasoning, id_prefix=PFX), content, reasoning_content, calls)


def test_arguments_json_string_exact():
    msg = parse_gemma4(f"<|tool_call>call:get_weather{{city:{S}Paris{S},n:2}}<tool_call|>")
    assert msg.tool_calls[0]["function"]["arguments"] == '{"city": "Paris", "n": 2}'
    msg = parse_gemma4(f"<|tool_call>call:w{{city:{S}東京{S}}}<tool_call|>")
    assert msg.tool_calls[0]["function"]["arguments"] == '{"city": "東京"}'  # not \\u escapes


def test_prompt_in_reasoning():
    m = parse_gemma4("still thinking<channel|>Answer", True, prompt_in_reasoning=True)
    assert (m.reasoning_content, m.content) == ("still thinking", "Answer")
    m = parse_gemma4("thought\nX<channel|>Y", True, prompt_in_reasoning=True)
    assert (m.reasoning_content, m.content) == ("X", "Y")
    m = parse_gemma4("hidden<channel|>Y", False, prompt_in_reasoning=True)
    assert (m.reasoning_content, m.content) == (None, "Y")
    # without the flag the same text is content (the closing tag is stripped)
    m = parse_gemma4("still thinking<channel|>Answer", True)
    assert (m.reasoning_content, m.content) == (None, "still thinkingAnswer")


def test_ids_random_unique_and_well_formed():
    ids = {parse_gemma4("<|tool_call>call:f{}<tool_call|>").tool_calls[0]["id"] for _ in range(50)}
    assert len(ids) == 50
    for i in ids:
        assert i.startswith("call_") and len(i) == 5 + 24 and i[5:].isalnum(), i
    p = Gemma4StreamParser()
    deltas = p.feed("<|tool_call>call:f{}<tool_call|><|tool_call>call:g{}<tool_call|>") + p.close()
    m = merge_deltas(deltas)
    assert [c["id"] for c in m.tool_calls] == [f"call_{p.id_prefix}0000", f"call_{p.id_prefix}0001"]


def test_parse_args_direct():
    assert parse_gemma4_args(f"{{a:{S}x{S},b:[1,-2.5,{{c:null}}]}}") == {"a": "x", "b": [1, -2.5, {"c": None}]}
    assert parse_gemma4_args("{}") == {}
    assert parse_gemma4_args("{a:{b:{c:[") == {"a": {"b": {"c": []}}}
    assert parse_gemma4_args(" { x : 1 , y : true } ") == {"x": 1, "y": True}


# --------------------------------------------------------------------------------------------------------------------
# Streaming


def stream(text, pieces, reasoning, **kw):
    p = Gemma4StreamParser(reasoning, id_prefix=PFX, **kw)
    deltas = []
    for piece in pieces:
        deltas += p.feed(piece)
    deltas += p.close()
    return deltas


def split_at(text, cuts):
    cuts = sorted(set(cuts))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def assert_stream_equals_parse(text, reasoning, pieces):
    whole = parse_gemma4(text, reasoning, id_prefix=PFX)
    deltas = stream(text, pieces, reasoning)
    got = merge_deltas(deltas)
    assert got == whole, f"pieces {pieces!r}:\n stream {got}\n parse  {whole}"
    _check_delta_shapes(deltas)


def _check_delta_shapes(deltas):
    seen = set()
    for d in deltas:
        assert len(d) == 1, d
        if "tool_calls" in d:
            (tc,) = d["tool_calls"]
            if tc["index"] not in seen:  # first delta of a call: everything but the arguments
                seen.add(tc["index"])
                assert tc["type"] == "function" and tc["id"].startswith("call_"), tc
                assert tc["function"]["name"] and tc["function"]["arguments"] == "", tc
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                json.loads(tc["function"]["arguments"])
        else:
            (v,) = d.values()
            assert isinstance(v, str) and v, d


TEXTS = sorted({(c[0], c[1]) for c in CASES})


@pytest.mark.parametrize("text,reasoning", TEXTS)
def test_stream_every_split(text, reasoning):
    for k in range(len(text) + 1):
        assert_stream_equals_parse(text, reasoning, [text[:k], text[k:]])
    assert_stream_equals_parse(text, reasoning, list(text))  # one character at a time
    rng = random.Random(hash(text) & 0xFFFF)
    for _ in range(20):
        cuts = [rng.randrange(len(text) + 1) for _ in range(rng.randint(2, 8))]
        assert_stream_equals_parse(text, reasoning, split_at(text, cuts))


FRAGMENTS = [
    "<|tool_call>", "<tool_call|>", "call:", ":", "get_w", "{", "}", "[", "]", ",", S, "<|channel>", "<channel|>",
    "thought\n", "thought", "<turn|>", "<eos>", "<|tool_response>", "<|", "<", "|>", ">", "a:", "b:1", "-2.5e3",
    "true", "null", " ", "\n", "hello", "你好", "🌧️", "<b>", "<|tur", "x", '"q"', "<|\"|", "<bos>",
]


def test_stream_random_texts():
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 25)))
        reasoning = rng.random() < 0.5
        for _ in range(3):
            cuts = [rng.randrange(len(text) + 1) for _ in range(rng.randint(1, 10))]
            assert_stream_equals_parse(text, reasoning, split_at(text, cuts))
        assert_stream_equals_parse(text, reasoning, list(text))


def test_stream_emits_early_and_holds_partial_tags():
    p = Gemma4StreamParser(reasoning=True, id_prefix=PFX)
    assert p.feed("Hello") == [{"content": "Hello"}]
    assert p.feed(" there <|tool") == [{"content": " there "}]  # "<|tool" held back
    assert p.feed("_call>call:get_weather{city:") == []  # a call is shown only once it is complete
    assert p.feed(f"{S}Par") == []
    assert p.feed(f"is{S}}}") == [
        {"tool_calls": [{"index": 0, "id": f"call_{PFX}0000", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}]
    assert p.feed("<tool_call|><|tool_response>") == []
    assert p.close() == []

    p = Gemma4StreamParser(reasoning=True)
    assert p.feed("<|cha") == []
    assert p.feed("nnel>thou") == []
    assert p.feed("ght\nLet me") == [{"reasoning_content": "Let me"}]
    assert p.feed(" see<chan") == [{"reasoning_content": " see"}]
    assert p.feed("nel|>4") == [{"content": "4"}]
    assert p.close() == []

    p = Gemma4StreamParser()
    assert p.feed("a <") == [{"content": "a "}]
    assert p.feed("b>") == [{"content": "<b>"}]
    assert p.feed(" <|no") == [{"content": " "}]
    assert p.close() == [{"content": "<|no"}]  # never completed: it was text

    p = Gemma4StreamParser()
    p.close()
    with pytest.raises(RuntimeError, match="after close"):
        p.feed("x")


# --------------------------------------------------------------------------------------------------------------------
# Honest endings: a cut tool call is never reported as a complete one


def test_cut_call_is_not_a_call():
    """Every prefix of a text with two complete calls, cut anywhere: the calls reported are exactly the complete
    ones (never one with repaired arguments), whole and streamed in any pieces alike."""
    first = f"<|tool_call>call:get_weather{{city:{S}Paris, {{FR}}{S},days:3,nested:{{k:[1,2]}}}}<tool_call|>"
    second = f"<|tool_call>call:get_time{{tz:{S}CET{S}}}<tool_call|>"
    text = "Checking." + first + second + "<|tool_response>"
    whole_first = text.index(first) + first.index("}<tool_call|>") + 1  # the first call's object closes here
    whole_second = text.index(second) + second.index("}<tool_call|>") + 1
    inside_tags = {i for m in SPECIAL_TAG_RE.finditer(text) for i in range(m.start() + 1, m.end())}
    rng = random.Random(0)
    for k in range(len(text) + 1):
        if k in inside_tags:  # a special tag is one token: a cut never splits it
            continue
        cut = text[:k]
        msg = parse_gemma4(cut, id_prefix=PFX)
        names = [c["function"]["name"] for c in msg.tool_calls]
        expected = ["get_weather"] * (k >= whole_first) + ["get_time"] * (k >= whole_second)
        assert names == expected, f"cut at {k} ({cut[-20:]!r}): calls {names}, expected {expected}"
        if names:
            assert json.loads(msg.tool_calls[0]["function"]["arguments"]) == {
                "city": "Paris, {FR}", "days": 3, "nested": {"k": [1, 2]}}
        assert msg.content is None or "Checking.".startswith(msg.content), (
            f"cut at {k}: call text leaked into content {msg.content!r}")
        assert_stream_equals_parse(cut, False, split_at(cut, [rng.randrange(k + 1) for _ in range(4)]))
        assert_stream_equals_parse(cut, False, list(cut))


def test_cut_call_stream_emits_nothing_for_it():
    p = Gemma4StreamParser(id_prefix=PFX)
    deltas = p.feed(f"<|tool_call>call:f{{a:1}}<tool_call|><|tool_call>call:g{{city:{S}Paris") + p.close()
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 0], deltas
    assert p.num_tool_calls == 1
