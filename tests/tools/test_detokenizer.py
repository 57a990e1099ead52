"""Incremental detokenizer: joined deltas equal Tokenizer.decode of all ids (which the tokenizer tests tie
to HF and SentencePiece), characters split over byte-fallback tokens are held until complete."""

import random

import pytest

from gemmajax.tools.detokenizer import IncrementalDetokenizer
from gemmajax.tools.tokenizer import Tokenizer, build_sp_model

TEXTS = [
    "Hello, world! The capital of France is **Paris**.",
    "Grüße aus München, Ärger über Öl — “quotes” … ½",
    "日本語のテキスト、中文文本：你好世界。한국어 문장입니다.",
    "Emoji 😀🤖👨‍👩‍👧‍👦🏳️‍🌈🫠 then 🦩𝔘 (byte fallback) and 𠀋ꙮ𓀀\U0010ffff\x00",
    "code:\n    def f(x):\n\treturn x  # tab\n\n\n" + " " * 40 + "end",
]
SPECIALS = {
    "gemma3": "<bos><start_of_turn>user\n你好🦩<end_of_turn>\n<start_of_turn>model\nꙮ<end_of_turn><eos>",
    "gemma4": '<bos><|turn>model\n<|channel>thought\n🦩<channel|><|tool_call>call:f{a:<|"|>𝔘<|"|>}<tool_call|>'
              "<|tool_response>ꙮ<turn|>",
}


def stream(tok, ids, skip):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_stream_equals_full_decode(family, skip, gemma3_tok, gemma4_tok):
    tok = gemma3_tok if family == "gemma3" else gemma4_tok
    for text in TEXTS + [SPECIALS[family]]:
        ids = tok.encode(text)
        joined = "".join(stream(tok, ids, skip))
        assert joined == tok.decode(ids, skip_special_tokens=skip), f"{family} skip={skip}: {text!r}"
        if not skip:
            assert joined == text
    special_ids = tok.encode(SPECIALS[family])
    assert len(tok.special_ids.intersection(special_ids)) >= 4
    assert any(tok.is_byte(i) for i in special_ids)


def test_byte_fallback_is_held_until_complete(gemma3_tok):
    tok = gemma3_tok
    ids = tok.encode("a你🦩b")  # 你 is one token; 🦩 is <0xF0><0x9F><0xA6><0xA9>
    pieces = [tok.id_to_piece(i) for i in ids]
    assert pieces[-5:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0xA9>", "b"], pieces
    assert stream(tok, ids, False) == ["a", "你", "", "", "", "🦩", "b", ""]
    byte = {b: tok.piece_to_id(f"<0x{b:02X}>") for b in range(256)}
    # 你 spelled in bytes: nothing until the third byte
    assert stream(tok, [byte[0xE4], byte[0xBD], byte[0xA0]], False) == ["", "", "你", ""]
    # an invalid byte is replaced at once; an unfinished character is replaced by flush or the next piece
    assert stream(tok, [byte[0xFF], byte[0xE4], byte[0xBD]], False) == ["\ufffd", "", "", "\ufffd\ufffd"]
    assert stream(tok, [byte[0xE4], 5279], False) == ["", "\ufffd capital", ""]
    # a second lead byte proves the first character is broken: replaced before the run ends
    assert stream(tok, [byte[0xE4], byte[0xE4], byte[0xBD], byte[0xA0]], False) == ["", "\ufffd", "", "你", ""]


def test_random_ids_stream_equals_decode(gemma3_tok, gemma4_tok):
    """Random mixes of byte tokens (valid and broken UTF-8), text pieces and special tokens."""
    rng = random.Random(0)
    for tok in (gemma3_tok, gemma4_tok):
        byte_ids = [tok.piece_to_id(f"<0x{b:02X}>") for b in range(256)]
        utf8 = [tok.piece_to_id(f"<0x{b:02X}>") for b in "你😀éꙮ".encode()]
        pool = byte_ids + utf8 * 30 + [5279, 236743, 107, 138, 0, 1, 2, 3, 105, 106, 48, 52, 100, 101]
        for _ in range(1500):
            ids = [rng.choice(pool) for _ in range(rng.randint(1, 16))]
            for skip in (False, True):
                detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
                deltas = []
                for i in ids:
                    deltas.append(detok.push(i))
                    assert len(detok._run) <= 3  # O(1) state: never more than one unfinished character
                deltas.append(detok.flush())
                assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), (skip, ids)


@pytest.mark.parametrize("adp,rew", [(False, False), (True, False), (False, True)])
def test_leading_space_rule(adp, rew):
    """With a dummy-prefix model the first piece loses its '▁' in the stream as in the full decode."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "a", "b", "▁a", "▁b"]
    types = [2, 3, 3] + [6] * 256 + [1] * 5
    proto = pb.ModelProto.FromString(build_sp_model(pieces, [0.0] * len(pieces), types, unk_id=0, bos_id=1,
                                                    eos_id=2, pad_id=-1, add_dummy_prefix=adp))
    proto.normalizer_spec.remove_extra_whitespaces = rew
    tok = Tokenizer(proto.SerializeToString())
    p = tok.piece_to_id
    for seq in ([p("▁a"), p("▁b")], [p("<s>"), p("▁a"), p("▁b")], [p("▁"), p("▁a")], [p("<0x20>"), p("▁a")],
                [p("<s>"), p("▁"), p("▁"), p("b")]):
        for skip in (False, True):
            assert "".join(stream(tok, seq, skip)) == tok.decode(seq, skip_special_tokens=skip), (adp, rew, seq)
    expect = "a b" if (adp or rew) else " a b"
    assert "".join(stream(tok, [p("<s>"), p("▁a"), p("▁b")], True)) == expect
    # continuing after a prompt: no strip on the first new token
    detok = IncrementalDetokenizer(tok, prompt_ids=[p("▁a")])
    assert detok.push(p("▁b")) == " b" == tok.decode([p("▁a"), p("▁b")])[len(tok.decode([p("▁a")])):]


def test_out_of_range_id_is_an_error(gemma3_tok):
    with pytest.raises(ValueError, match="262144"):
        IncrementalDetokenizer(gemma3_tok).push(262144)
    with pytest.raises(ValueError, match="-1"):
        gemma3_tok.decode([5279, -1])
