"""Gemma tokenizer: SentencePiece for the BPE itself, Python for special tokens and decoding.

Design: text is first split on special tokens (leftmost-longest, as HF does), the pieces between go to
SentencePiece; `decode` is ours (per-id text tables, SentencePiece's byte-fallback and leading-space rules,
special tokens rendered as their piece like HF) so that the incremental detokenizer can match it exactly.
A GGUF carries no tokenizer.model: we rebuild the SentencePiece model from its vocabulary metadata.
"""

from __future__ import annotations

import codecs
import json
import mmap
import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

_SPACE = "\u2581"  # SentencePiece's visible space, '▁'
_REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_Piece = sp_pb2.ModelProto.SentencePiece

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
# They are SentencePiece's piece types with the same numbers.
_GGUF_TYPE_TO_SP = {1: _Piece.NORMAL, 2: _Piece.UNKNOWN, 3: _Piece.CONTROL, 4: _Piece.USER_DEFINED,
                    5: _Piece.UNUSED, 6: _Piece.BYTE}

# Gemma 4 uses the Gemma 3 vocabulary with these pieces renamed (reference section 12).
GEMMA4_RENAMES: dict[int, str] = {
    46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>",
    51: "<tool_response|>", 52: '<|"|>', 98: "<|think|>", 100: "<|channel>", 101: "<channel|>",
    105: "<|turn>", 106: "<turn|>", 255999: "<|image>", 256000: "<|audio>", 258880: "<|image|>",
    258881: "<|audio|>", 258882: "<image|>", 258883: "<audio|>", 258884: "<|video|>",
}
# Gemma 4 control tokens: special (matched whole in text, dropped by skip_special_tokens) whatever
# piece type a tokenizer.model gives them.
GEMMA4_SPECIAL_PIECES = frozenset(GEMMA4_RENAMES.values()) | {"<mask>"}


class TokenizerError(ValueError):
    """A tokenizer file that cannot be loaded or does not say what we need."""


# ---------------------------------------------------------------------------------------------------
# GGUF metadata
# ---------------------------------------------------------------------------------------------------

def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Read the key/value metadata of a GGUF file (not its tensors).

    gguf.GGUFReader builds numpy views for every array element (~10 s for a 262k vocabulary); this reads
    only the metadata section with `struct`, using the value-type codes of the `gguf` package.

    Returns: {key: value}; strings as str, arrays of strings as list[str], numeric arrays as 1-D numpy
    arrays, scalars as Python int/float/bool.
    """
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            return _GGUFMetadataParser(buf, str(path)).parse()
        finally:
            buf.release()  # the mmap cannot close while a view of it is alive


class _GGUFMetadataParser:
    """Sequential reader of a GGUF header and its key/value section (format version 2 or later)."""

    def __init__(self, buf: memoryview, name: str):
        from gguf import GGUF_MAGIC
        from gguf import GGUFValueType as T

        self.buf, self.name, self.T = buf, name, T
        self.scalar = {T.UINT8: "B", T.INT8: "b", T.UINT16: "H", T.INT16: "h", T.UINT32: "I", T.INT32: "i",
                       T.FLOAT32: "f", T.BOOL: "?", T.UINT64: "Q", T.INT64: "q", T.FLOAT64: "d"}
        magic, version = struct.unpack_from("<II", buf, 0)
        if magic != GGUF_MAGIC:
            raise TokenizerError(f"{name} is not a GGUF file: magic {magic:#x}, expected {GGUF_MAGIC:#x}")
        self.e = "<" if version < 0x10000 else ">"  # a big-endian file reads as a huge little-endian version
        version = struct.unpack_from(self.e + "I", buf, 4)[0]
        if version < 2:
            raise TokenizerError(f"{name}: GGUF version {version} is not supported (need 2 or later)")

    def parse(self) -> dict[str, Any]:
        _, n_kv = struct.unpack_from(self.e + "QQ", self.buf, 8)
        off = 24
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key, off = self.read_str(off)
            (vtype,) = struct.unpack_from(self.e + "I", self.buf, off)
            meta[key], off = self.read_value(vtype, off + 4)
        return meta

    def read_str(self, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from(self.e + "Q", self.buf, off)
        return str(self.buf[off + 8:off + 8 + n], "utf-8"), off + 8 + n

    def read_value(self, vtype: int, off: int) -> tuple[Any, int]:
        T, e = self.T, self.e
        if vtype == T.STRING:
            return self.read_str(off)
        if vtype in self.scalar:
            fmt = e + self.scalar[T(vtype)]
            return struct.unpack_from(fmt, self.buf, off)[0], off + struct.calcsize(fmt)
        if vtype == T.ARRAY:
            etype, n = struct.unpack_from(e + "IQ", self.buf, off)
            off += 12
            if etype in self.scalar:
                dt = np.dtype(self.scalar[T(etype)]).newbyteorder(e)
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=off).astype(dt.newbyteorder("="))
                return arr, off + n * dt.itemsize
            items = []
            for _ in range(n):
                item, off = self.read_value(etype, off)
                items.append(item)
            return items, off
        raise TokenizerError(f"{self.name}: unknown GGUF value type {vtype} at byte {off}")


# ---------------------------------------------------------------------------------------------------
# Building SentencePiece models
# ---------------------------------------------------------------------------------------------------

def build_sp_model(pieces: list[str], scores: Iterable[float], types: Iterable[int], *, unk_id: int, bos_id: int,
                   eos_id: int, pad_id: int, add_dummy_prefix: bool = False) -> bytes:
    """A serialized SentencePiece BPE ModelProto with byte fallback and identity normalization.

    Args:
      pieces, scores, types: one entry per id; types are SentencePiece piece types (1 normal .. 6 byte).
    """
    m = sp_pb2.ModelProto()
    m.trainer_spec.model_type = sp_pb2.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(pieces)
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = (
        unk_id, bos_id, eos_id, pad_id)
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = add_dummy_prefix
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for piece, score, ptype in zip(pieces, scores, types, strict=True):
        p = m.pieces.add()
        p.piece, p.score, p.type = piece, float(score), int(ptype)
    return m.SerializeToString()


def gguf_to_sp(gguf_path: str | os.PathLike, renames: dict[int, str] | None = None) -> bytes:
    """SentencePiece model bytes for the vocabulary of a GGUF file (Gemma 3 keeps its own names).

    llama.cpp writes the pieces of only spaces with real spaces ("  ") and marks them user-defined; HF's
    Gemma tokenizer spells them "▁▁" and reaches them by BPE merges ranked by vocabulary position, ahead of
    every other merge. We respell them and give them the top scores in id order, which reproduces HF
    exactly (also for runs of 32+ spaces, where leftmost-longest matching would differ).
    Renamed pieces (`renames`) become user-defined pieces so SentencePiece keeps them whole.
    """
    meta = read_gguf_metadata(gguf_path)
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("llama", "gemma4"):
        raise TokenizerError(f"{gguf_path}: tokenizer.ggml.model is {kind!r}; only SentencePiece vocabularies "
                             "('llama', 'gemma4', as written for Gemma) are supported")
    pieces = list(meta["tokenizer.ggml.tokens"])
    n = len(pieces)
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:  # merge priority then follows vocabulary order
        scores = -np.arange(n, dtype=np.float32)
    gtypes = meta.get("tokenizer.ggml.token_type", np.ones(n, np.int32))
    if len(scores) != n or len(gtypes) != n:
        raise TokenizerError(f"{gguf_path}: {n} tokens but {len(scores)} scores and {len(gtypes)} token types")
    types = [_GGUF_TYPE_TO_SP.get(int(t), _Piece.NORMAL) for t in gtypes]
    scores = [float(s) for s in scores]
    unk_id = int(meta.get("tokenizer.ggml.unknown_token_id", 3))
    spaces = [i for i, (piece, t) in enumerate(zip(pieces, types))
              if t == _Piece.USER_DEFINED and piece and piece.strip(" ") == ""]
    top = max((s for i, s in enumerate(scores) if types[i] == _Piece.NORMAL), default=0.0)
    for k, i in enumerate(spaces):
        pieces[i] = _SPACE * len(pieces[i])
        types[i], scores[i] = _Piece.NORMAL, top + len(spaces) - k
    types[unk_id] = _Piece.UNKNOWN  # llama.cpp marks <unk> as control
    for i, name in (renames or {}).items():
        pieces[i], types[i] = name, _Piece.USER_DEFINED
    return build_sp_model(
        pieces, scores, types, unk_id=unk_id, bos_id=int(meta.get("tokenizer.ggml.bos_token_id", 2)),
        eos_id=int(meta.get("tokenizer.ggml.eos_token_id", 1)),
        pad_id=int(meta.get("tokenizer.ggml.padding_token_id", 0)),
        add_dummy_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", False)))


def gguf_to_gemma4_sp(gguf_path: str | os.PathLike) -> bytes:
    """The Gemma 3 vocabulary of a GGUF renamed to Gemma 4's special tokens (reference section 12)."""
    return gguf_to_sp(gguf_path, GEMMA4_RENAMES)


def tokenizer_json_to_sp(path: str | os.PathLike) -> tuple[bytes, set[str]]:
    """Convert a Gemma-style HF `tokenizer.json` (BPE, byte fallback, spaces as '▁') to a SentencePiece model.

    SentencePiece BPE merges the adjacent pair whose joined piece scores highest; HF BPE merges the pair
    with the lowest merge rank. Scoring each piece by minus the rank of the first merge that makes it, and
    marking multi-character pieces that no merge makes as unused, gives the same segmentation.

    Returns: (model bytes, pieces that tokenizer.json marks special).
    """
    with open(path, encoding="utf-8") as fh:
        tj = json.load(fh)
    model = tj.get("model") or {}
    norm = tj.get("normalizer") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise TokenizerError(f"{path}: only BPE tokenizer.json with byte_fallback (Gemma) is supported; got model "
                             f"type {model.get('type')!r}, byte_fallback={model.get('byte_fallback')!r}. "
                             "Add a tokenizer.model (SentencePiece) to the checkpoint instead.")
    if norm.get("type") != "Replace" or norm.get("pattern", {}).get("String") != " " or norm.get("content") != _SPACE:
        raise TokenizerError(f"{path}: normalizer {norm!r} is not Gemma's Replace(' ', '▁'); "
                             "add a tokenizer.model (SentencePiece) to the checkpoint instead.")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {int(t["id"]): t for t in tj.get("added_tokens", [])}
    n = max(max(vocab.values(), default=-1), max(added, default=-1)) + 1
    pieces = [""] * n
    for piece, i in vocab.items():
        pieces[i] = piece
    for i, t in added.items():
        pieces[i] = t["content"]
    rank: dict[str, int] = {}
    for r, merge in enumerate(model.get("merges", [])):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(a + b, r)
    unk = model.get("unk_token")
    scores, types = [], []
    for i, piece in enumerate(pieces):
        if i in added:
            t = _Piece.UNKNOWN if piece == unk else _Piece.CONTROL if added[i].get("special") else _Piece.USER_DEFINED
            types.append(t)
            scores.append(0.0)
        elif piece == unk:
            types.append(_Piece.UNKNOWN)
            scores.append(0.0)
        elif _BYTE_PIECE.match(piece):
            types.append(_Piece.BYTE)
            scores.append(0.0)
        elif piece in rank:
            types.append(_Piece.NORMAL)
            scores.append(-float(rank[piece]))
        else:  # single characters are BPE's starting symbols; longer pieces no merge makes must stay unused
            types.append(_Piece.NORMAL if len(piece) == 1 else _Piece.UNUSED)
            scores.append(-float(len(rank) + i))
    if unk not in pieces:
        raise TokenizerError(f"{path}: unk_token {unk!r} is not in the vocabulary")

    def special_id(name: str, default: int) -> int:
        return pieces.index(name) if name in pieces else default

    sp_model = build_sp_model(pieces, scores, types, unk_id=pieces.index(unk), bos_id=special_id("<bos>", -1),
                              eos_id=special_id("<eos>", -1), pad_id=special_id("<pad>", -1))
    return sp_model, {t["content"] for t in added.values() if t.get("special")}


# ---------------------------------------------------------------------------------------------------
# Byte fallback decoding, shared by Tokenizer.decode and the incremental detokenizer
# ---------------------------------------------------------------------------------------------------

def _can_complete(prefix: bytes) -> bool:
    """Whether an incomplete UTF-8 sequence can still become a valid character."""
    try:
        _, used = codecs.utf_8_decode(prefix, "strict", False)
    except UnicodeDecodeError:
        return False
    return used == 0


def decode_byte_run(buf: bytearray, final: bool) -> str:
    """Decode and consume the leading bytes of a run of byte-fallback tokens, as SentencePiece does.

    Greedy, one character at a time: a valid UTF-8 character is emitted; a byte that does not start one
    becomes U+FFFD and decoding resumes at the next byte. With `final=False` an incomplete sequence that
    may still become valid stays in `buf`; with `final=True` (the run has ended) it is replaced too.
    """
    out = []
    i, n = 0, len(buf)
    while i < n:
        b = buf[i]
        need = 1 if b < 0x80 else 2 if 0xC2 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF else 4 if 0xF0 <= b <= 0xF4 else 0
        if need == 0:
            out.append(_REPLACEMENT)
            i += 1
            continue
        chunk = bytes(buf[i:i + need])
        if len(chunk) == need:
            try:
                out.append(chunk.decode("utf-8"))
                i += need
            except UnicodeDecodeError:
                out.append(_REPLACEMENT)
                i += 1
        elif not final and _can_complete(chunk):
            break
        else:
            out.append(_REPLACEMENT)
            i += 1
    del buf[:i]
    return "".join(out)


# ---------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------

class Tokenizer:
    """A SentencePiece tokenizer with HF-style special-token handling.

    Args:
      model: a tokenizer.model path or serialized ModelProto bytes.
      special_pieces: extra pieces to treat as special (matched whole in text, skipped on request), on top
        of control/unknown pieces and the Gemma 4 control tokens.
    """

    def __init__(self, model: str | os.PathLike | bytes, special_pieces: Iterable[str] = ()):
        model_bytes = model if isinstance(model, bytes) else Path(model).read_bytes()
        self._sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        proto = sp_pb2.ModelProto.FromString(model_bytes)
        n = len(proto.pieces)
        self._pieces: list[str] = [p.piece for p in proto.pieces]
        ptypes = [p.type for p in proto.pieces]
        self._piece_ids: dict[str, int] = {}
        for i, p in enumerate(self._pieces):
            self._piece_ids.setdefault(p, i)
        extra = set(special_pieces) | GEMMA4_SPECIAL_PIECES
        self._special = frozenset(i for i, (p, t) in enumerate(zip(self._pieces, ptypes))
                                  if t in (_Piece.CONTROL, _Piece.UNKNOWN) or p in extra)
        # Per-id decode tables: the byte of a byte-fallback piece, or the text of any other piece.
        self._byte_of: dict[int, int] = {}
        self._text: list[str] = []
        for i, (p, t) in enumerate(zip(self._pieces, ptypes)):
            m = _BYTE_PIECE.match(p) if t == _Piece.BYTE else None
            if m:
                self._byte_of[i] = int(m.group(1), 16)
            self._text.append(p if i in self._special else p.replace(_SPACE, " "))
        norm = proto.normalizer_spec
        # SentencePiece drops the '▁' that begins the first piece of a decode when the encoder adds one
        # (add_dummy_prefix), and keeps dropping while the text is still empty with remove_extra_whitespaces.
        self._strip_first = bool(norm.add_dummy_prefix or norm.remove_extra_whitespaces)
        self._strip_while_empty = bool(norm.remove_extra_whitespaces)
        # Special-token splitting: candidate positions are the first characters of special pieces.
        self._split_map = {self._pieces[i]: i for i in sorted(self._special) if self._pieces[i]}
        self._split_lens = sorted({len(p) for p in self._split_map}, reverse=True)
        firsts = "".join(sorted({re.escape(p[0]) for p in self._split_map}))
        self._split_re = re.compile(f"[{firsts}]") if firsts else None
        tspec = proto.trainer_spec
        self.vocab_size: int = n
        self.bos_id: int = tspec.bos_id if 0 <= tspec.bos_id < n else self._piece_ids.get("<bos>", -1)
        self.eos_id: int = tspec.eos_id if 0 <= tspec.eos_id < n else self._piece_ids.get("<eos>", -1)
        self.pad_id: int = tspec.pad_id if 0 <= tspec.pad_id < n else self._piece_ids.get("<pad>", -1)
        self.unk_id: int = tspec.unk_id
        self.family: str = "gemma4" if "<|turn>" in self._piece_ids else "gemma3"
        stops = ("<turn|>", "<|tool_response>") if self.family == "gemma4" else ("<end_of_turn>",)
        self.stop_ids: frozenset[int] = frozenset(
            [self.eos_id] * (self.eos_id >= 0) + [self._piece_ids[s] for s in stops if s in self._piece_ids])

    # -- vocabulary ---------------------------------------------------------------------------------

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids matched whole in text by `encode` and dropped by `decode(..., skip_special_tokens=True)`."""
        return self._special

    def id_to_piece(self, i: int) -> str:
        return self._pieces[i]

    def piece_to_id(self, piece: str) -> int:
        """The id of a piece; KeyError (naming it) if the vocabulary has no such piece."""
        try:
            return self._piece_ids[piece]
        except KeyError:
            raise KeyError(f"piece {piece!r} is not in this {self.family} vocabulary of {self.vocab_size}") from None

    def __contains__(self, piece: str) -> bool:
        return piece in self._piece_ids

    def is_byte(self, i: int) -> bool:
        return i in self._byte_of

    def token_bytes(self, i: int) -> bytes:
        """The raw bytes token `i` stands for: one byte for `<0xAB>`, '▁' as a space, special tokens as
        their piece text (what `decode` renders with skip_special_tokens=False)."""
        b = self._byte_of.get(i)
        return bytes([b]) if b is not None else self._text[i].encode("utf-8")

    # -- encode -------------------------------------------------------------------------------------

    def split_special(self, text: str) -> list[str | int]:
        """Split text on special tokens, leftmost-longest: a list of text segments and special ids."""
        if self._split_re is None:
            return [text] if text else []
        out: list[str | int] = []
        start = pos = 0
        for m in self._split_re.finditer(text):
            p = m.start()
            if p < pos:
                continue
            for n in self._split_lens:
                sid = self._split_map.get(text[p:p + n])
                if sid is not None:
                    if p > start:
                        out.append(text[start:p])
                    out.append(sid)
                    start = pos = p + n
                    break
        if start < len(text):
            out.append(text[start:])
        return out

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their single id."""
        ids = [self.bos_id] if add_bos else []
        for seg in self.split_special(text):
            if isinstance(seg, int):
                ids.append(seg)
            else:
                ids.extend(self._sp.encode(seg))
        return ids

    # -- decode -------------------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Byte-fallback runs decode as SentencePiece does (a bad byte is one U+FFFD);
        special tokens render as their piece unless skipped; SentencePiece's leading-space rule applies."""
        out: list[str] = []
        run = bytearray()
        at_start = True  # still where SentencePiece strips a leading '▁'
        n = self.vocab_size
        for i in ids:
            i = int(i)
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {n})")
            if i in self._special:
                if run:
                    out.append(decode_byte_run(run, final=True))
                if not skip_special_tokens:
                    out.append(self._text[i])
                continue
            b = self._byte_of.get(i)
            if b is not None:
                run.append(b)
                at_start = False
                continue
            if run:
                out.append(decode_byte_run(run, final=True))
            text = self._text[i]
            if at_start:
                if self._strip_first and self._pieces[i].startswith(_SPACE):
                    text = text[1:]
                at_start = self._strip_while_empty and not text
            out.append(text)
        if run:
            out.append(decode_byte_run(run, final=True))
        return "".join(out)

    def __repr__(self) -> str:
        return (f"Tokenizer(family={self.family!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={self.eos_id}, stop_ids={sorted(self.stop_ids)})")

    # -- constructors -------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf_path: str | os.PathLike, gemma4_names: bool = False) -> Tokenizer:
        """The tokenizer stored in a GGUF file; `gemma4_names` renames a Gemma 3 vocabulary to Gemma 4's."""
        return cls(gguf_to_gemma4_sp(gguf_path) if gemma4_names else gguf_to_sp(gguf_path))


def _config_special_pieces(ckpt_dir: Path) -> set[str]:
    """Pieces that tokenizer_config.json marks special (`added_tokens_decoder[*].special`)."""
    cfg_path = ckpt_dir / "tokenizer_config.json"
    if not cfg_path.is_file():
        return set()
    with open(cfg_path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    return {t["content"] for t in (cfg.get("added_tokens_decoder") or {}).values()
            if isinstance(t, dict) and t.get("special") and "content" in t}


def load_tokenizer(ckpt: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a checkpoint: a directory with tokenizer.model (or a Gemma-style tokenizer.json),
    a tokenizer.model file, or a .gguf file (vocabulary rebuilt from its metadata)."""
    path = Path(ckpt)
    if path.is_file():
        if path.suffix == ".gguf":
            return Tokenizer.from_gguf(path)
        if path.name == "tokenizer.json":
            model, specials = tokenizer_json_to_sp(path)
            return Tokenizer(model, specials | _config_special_pieces(path.parent))
        return Tokenizer(path, _config_special_pieces(path.parent))
    if path.is_dir():
        if (path / "tokenizer.model").is_file():
            return Tokenizer(path / "tokenizer.model", _config_special_pieces(path))
        if (path / "tokenizer.json").is_file():
            model, specials = tokenizer_json_to_sp(path / "tokenizer.json")
            return Tokenizer(model, specials | _config_special_pieces(path))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return Tokenizer.from_gguf(ggufs[0])
        raise FileNotFoundError(f"no tokenizer in {path}: expected tokenizer.model, tokenizer.json or one .gguf "
                                f"file; found {sorted(p.name for p in path.iterdir())[:20]}")
    raise FileNotFoundError(f"checkpoint {path} does not exist (expected a directory, tokenizer.model or .gguf)")
