"""Tokenizer vs HF transformers on the real Gemma 3 vocabulary (GGUF), and on it renamed to Gemma 4.

References: HF's GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) for Gemma 3 names;
HF's `GemmaTokenizer` converted from our Gemma 4 tokenizer.model for Gemma 4 names; SentencePiece itself
for byte-fallback decoding and the leading-space rule.
"""

import random

import numpy as np
import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

from gemmajax.tools.tokenizer import (
    GEMMA4_RENAMES,
    Tokenizer,
    TokenizerError,
    build_sp_model,
    gguf_to_sp,
    load_tokenizer,
    read_gguf_metadata,
)

PLAIN = [
    "Hello world",
    "The capital of France is **Paris**.",
    "def add(a, b):\n    if a:\n        return a + b\n\treturn None  # tab\n",
    "class Foo:\n\n    def __init__(self):\n        self.x = {'k': [1, 2.5, None]}\n",
    "a  b   c    d" + " " * 17 + "e" + " " * 32 + "f" + " " * 45 + "g",  # runs of spaces, 32+ included
    "\n\n\nline\n \n  \n\t\n" + "\n" * 40 + "end\r\n",
    "   leading spaces and trailing   ",
    "Grüße aus München! Die Straße ist schön, Ärger über Öl.",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "Emoji: 😀🤖👨‍👩‍👧‍👦 🏳️‍🌈 🫠🦩 and symbols ∮ E⋅da = Q, ½ ﷺ",
    "Byte fallback: 𠀋 ꙮ 𓀀 \U0010ffff \x00\x07 ᚠ\u2028",
    "<table><tr><td>html</td></tr></table> [multimodal] <b>x</b>",
    "<<bos>> <bos<eos> <unused5x <unused5> <start_of_turn",  # near-misses and real specials mixed
    "",
]
GEMMA3_SPECIAL = [
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><mask><unk><unused0><unused98>",
    "text<start_of_turn>glued<end_of_turn>text",
]
GEMMA4_SPECIAL = [
    "<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>",
    '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>',
    "<|turn>system\n<|think|>\n<|tool>declaration:f{}<tool|><turn|>\n",
    "<|image><|image|><image|> <|audio><|audio|><audio|> <|video|> <bos><eos>",
    '<|"|><|"|<|"|>>',
]


def test_gguf_metadata_reader_matches_gguf_package(tmp_path):
    gguf = pytest.importorskip("gguf")
    for endian in (gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG):
        path = tmp_path / f"meta_{endian.name}.gguf"
        w = gguf.GGUFWriter(str(path), "gemma3", endianess=endian)
        w.add_string("tokenizer.ggml.model", "llama")
        w.add_array("tokenizer.ggml.tokens", ["<pad>", "▁a", "ünï", "", "😀"])
        w.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25, -1000.0, 3.0])
        w.add_array("tokenizer.ggml.token_type", [3, 1, 1, 4, 6])
        w.add_uint32("tokenizer.ggml.bos_token_id", 2)
        w.add_bool("tokenizer.ggml.add_bos_token", True)
        w.add_float64("some.f64", 0.125)
        w.add_int64("some.i64", -7)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        ours = read_gguf_metadata(path)
        ref = gguf.GGUFReader(str(path))
        for key, field in ref.fields.items():
            if key.startswith("GGUF."):
                continue
            assert key in ours, f"{endian.name}: key {key} missing from read_gguf_metadata"
            vals = [field.parts[i] for i in field.data]
            if field.types[-1] == gguf.GGUFValueType.STRING:
                vals = [bytes(v).decode("utf-8") for v in vals]
                expect = vals if field.types[0] == gguf.GGUFValueType.ARRAY else vals[0]
                assert ours[key] == expect, f"{endian.name} {key}: {ours[key]!r} != {expect!r}"
            else:
                flat = np.concatenate([np.asarray(v).reshape(-1) for v in vals])
                got = np.asarray(ours[key]).reshape(-1)
                np.testing.assert_array_equal(got, flat, err_msg=f"{endian.name} {key}")


def test_encode_matches_hf_gguf_tokenizer(gemma3_tok, hf_gemma3):
    assert gemma3_tok.family == "gemma3"
    for text in PLAIN + GEMMA3_SPECIAL:
        ours = gemma3_tok.encode(text)
        ref = hf_gemma3.encode(text, add_special_tokens=False)
        assert ours == ref, f"{text!r}: ours {ours} != HF {ref}"
    # the text set must exercise byte fallback, multi-space pieces and special tokens
    all_ids = {i for t in PLAIN + GEMMA3_SPECIAL for i in gemma3_tok.encode(t)}
    assert any(gemma3_tok.is_byte(i) for i in all_ids)
    assert {138, 152, 105, 106}.issubset(all_ids)
    assert gemma3_tok.encode("Hi", add_bos=True) == [2] + hf_gemma3.encode("Hi", add_special_tokens=False)


def test_random_text_matches_hf_gguf_tokenizer(gemma3_tok, hf_gemma3):
    rng = random.Random(0)
    alphabet = list(" \n\t  abcXYZ_-:<>|\"'{}[]0123456789äß你好😀\u2581") + ["<start_of_turn>", "<eos>", "  "]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        assert gemma3_tok.encode(text) == hf_gemma3.encode(text, add_special_tokens=False), repr(text)


def test_decode_round_trip_matches_hf(gemma3_tok, hf_gemma3):
    for text in PLAIN + GEMMA3_SPECIAL:
        ids = gemma3_tok.encode(text)
        assert gemma3_tok.decode(ids) == text
        assert gemma3_tok.decode(ids) == hf_gemma3.decode(ids)
        skipped = gemma3_tok.decode(ids, skip_special_tokens=True)
        assert skipped == hf_gemma3.decode(ids, skip_special_tokens=True), repr(text)
    ids = gemma3_tok.encode("<start_of_turn>user\nHi<end_of_turn>")
    assert gemma3_tok.decode(ids, skip_special_tokens=True) == "user\nHi"


def test_gemma4_names_match_hf(gemma4_tok, hf_gemma4):
    assert gemma4_tok.family == "gemma4"
    for text in PLAIN + GEMMA4_SPECIAL:
        ours = gemma4_tok.encode(text)
        assert ours == hf_gemma4.encode(text, add_special_tokens=False), repr(text)
        assert gemma4_tok.decode(ours) == text == hf_gemma4.decode(ours)
    expect = {"<|turn>": 105, "<turn|>": 106, "<|tool_call>": 48, "<tool_call|>": 49, '<|"|>': 52,
              "<|channel>": 100, "<channel|>": 101, "<|think|>": 98, "<|tool_response>": 50, "<|video|>": 258884}
    for piece, i in expect.items():
        assert gemma4_tok.encode(piece) == [i], piece
        assert gemma4_tok.encode(f"x{piece}y") == gemma4_tok.encode("x") + [i] + gemma4_tok.encode("y"), piece
        assert i in gemma4_tok.special_ids
    ids = gemma4_tok.encode("<|turn>model\n<|channel>thought\n<channel|>Hi<turn|>")
    assert ids == [105, 4368, 107, 100, 45518, 107, 101] + gemma4_tok.encode("Hi") + [106]
    assert gemma4_tok.decode(ids, skip_special_tokens=True) == "model\nthought\nHi"


def test_properties(gemma3_tok, gemma4_tok):
    for tok in (gemma3_tok, gemma4_tok):
        assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (2, 1, 0, 262144)
        assert tok.id_to_piece(5279) == "▁capital" and tok.piece_to_id("▁capital") == 5279
        assert tok.token_bytes(5279) == b" capital"
        assert tok.token_bytes(tok.piece_to_id("<0xE4>")) == b"\xe4"
        assert tok.token_bytes(107) == b"\n" and tok.token_bytes(138) == b"  "
        assert tok.token_bytes(2) == b"<bos>"
        assert {0, 1, 2, 3}.issubset(tok.special_ids) and 107 not in tok.special_ids
        with pytest.raises(KeyError, match="not-a-piece"):
            tok.piece_to_id("not-a-piece")
    assert gemma3_tok.stop_ids == {1, 106} and gemma3_tok.id_to_piece(105) == "<start_of_turn>"
    assert gemma4_tok.stop_ids == {1, 106, 50}
    assert all(gemma4_tok.id_to_piece(i) == name for i, name in GEMMA4_RENAMES.items())


def test_tokenizer_json_checkpoint(gemma3_tok, hf_gemma3, tmp_path):
    """A checkpoint with only tokenizer.json (HF's, saved from the GGUF tokenizer) loads and agrees."""
    hf_gemma3.save_pretrained(str(tmp_path))
    (tmp_path / "tokenizer.model").unlink(missing_ok=True)
    tok = load_tokenizer(tmp_path)
    assert tok.special_ids == gemma3_tok.special_ids
    for text in PLAIN + GEMMA3_SPECIAL:
        assert tok.encode(text) == hf_gemma3.encode(text, add_special_tokens=False), repr(text)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.model"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "Unigram"}, "normalizer": null}')
    with pytest.raises(TokenizerError, match="Unigram"):
        load_tokenizer(tmp_path)


def test_small_gguf_vocabulary(tmp_path):
    """gguf_to_sp on a hand-made GGUF: respelled space pieces, <unk> made UNKNOWN, renames applied."""
    gguf = pytest.importorskip("gguf")
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<ctl>", "  ", "   ", "▁", "a", "▁a"]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 3, 3, 4, 4, 1, 1, 1] + [6] * 256
    scores = [0.0] * 7 + [-3.0, -2.0, -1.0] + [0.0] * 256
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_array("tokenizer.ggml.token_type", types)
    for key, val in (("bos", 2), ("eos", 1), ("unknown", 3), ("padding", 0)):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", val)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    proto = pb.ModelProto.FromString(gguf_to_sp(path, {4: "<|turn>"}))
    assert [p.piece for p in proto.pieces[:7]] == ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "▁▁", "▁▁▁"]
    assert proto.pieces[3].type == pb.ModelProto.SentencePiece.UNKNOWN
    tok = Tokenizer(gguf_to_sp(path, {4: "<|turn>"}))
    assert tok.family == "gemma4" and tok.stop_ids == {1}
    assert tok.encode("     a<|turn>a") == [5, 6, 8, 4, 8]  # BPE merges ▁▁ pairs first, then ▁▁+▁ -> ▁▁▁
    assert tok.decode([5, 6, 8, 4, 8]) == "     a<|turn>a"
    assert tok.encode("é") == [10 + 0xC3, 10 + 0xA9]


def _tiny_sp_model(add_dummy_prefix: bool, remove_extra_whitespaces: bool) -> bytes:
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "a", "b", "▁a", "▁b", "<u>"]
    types = [2, 3, 3] + [6] * 256 + [1, 1, 1, 1, 1, 4]
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, 0.0]
    proto = pb.ModelProto.FromString(build_sp_model(pieces, scores, types, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                                    add_dummy_prefix=add_dummy_prefix))
    proto.normalizer_spec.remove_extra_whitespaces = remove_extra_whitespaces
    return proto.SerializeToString()


@pytest.mark.parametrize("adp,rew", [(False, False), (True, False), (False, True)])
def test_decode_matches_sentencepiece_leading_space_rule(adp, rew):
    """SentencePiece strips the '▁' of the first piece when the encoder adds a dummy prefix (and, with
    remove_extra_whitespaces, while the text is empty); control tokens do not count as the first piece."""
    model = _tiny_sp_model(adp, rew)
    tok, sp = Tokenizer(model), spm.SentencePieceProcessor(model_proto=model)
    ids = {p: tok.piece_to_id(p) for p in ["▁", "a", "▁a", "▁b", "<s>", "<0x20>", "<0xE4>", "<0xBD>", "<0xA0>", "<u>"]}
    cases = [["▁a", "▁b"], ["<s>", "▁a"], ["<0x20>", "▁a"], ["▁", "▁a"], ["▁", "▁", "a"], ["<u>", "▁a"],
             ["a", "▁a"], ["<0xE4>", "<0xBD>", "<0xA0>", "▁a"], ["<s>", "▁", "▁b", "<s>"]]
    for case in cases:
        seq = [ids[p] for p in case]
        assert tok.decode(seq, skip_special_tokens=True) == sp.decode(seq), f"adp={adp} rew={rew} {case}"
    if adp or rew:
        assert tok.decode([ids["▁a"], ids["▁b"]]) == "a b"
    else:
        assert tok.decode([ids["▁a"], ids["▁b"]]) == " a b"


def test_byte_fallback_decode_matches_sentencepiece(gemma3_tok):
    """Random byte-token runs (valid and invalid UTF-8) mixed with text pieces decode as SentencePiece does."""
    sp = gemma3_tok._sp
    rng = random.Random(1)
    byte_ids = [gemma3_tok.piece_to_id(f"<0x{b:02X}>") for b in range(256)]
    utf8_ids = [gemma3_tok.piece_to_id(f"<0x{b:02X}>") for b in "你😀é".encode()]
    pool = byte_ids + utf8_ids * 20 + [5279, 236743, 107, 138, 10979]
    for _ in range(3000):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 10))]
        assert gemma3_tok.decode(ids) == sp.decode(ids), [gemma3_tok.id_to_piece(i) for i in ids]
    cases = {("<0xE4>", "<0xBD>", "<0xA0>"): "你", ("<0xE4>", "<0xBD>"): "\ufffd\ufffd",
             ("<0xE4>", "<0xBD>", "<0xA0>", "<0xE4>"): "你\ufffd", ("<0xFF>", "<0x41>"): "\ufffdA"}
    for pieces, text in cases.items():
        assert gemma3_tok.decode([gemma3_tok.piece_to_id(p) for p in pieces]) == text
    # a special token ends a byte run, as in SentencePiece, whether it is kept or skipped
    run = [gemma3_tok.piece_to_id(p) for p in ("<0xE4>", "<0xBD>")] + [106, gemma3_tok.piece_to_id("<0xA0>")]
    assert gemma3_tok.decode(run) == "\ufffd\ufffd<end_of_turn>\ufffd"
    assert gemma3_tok.decode(run, skip_special_tokens=True) == "\ufffd\ufffd\ufffd"
