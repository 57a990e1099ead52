"""Round-to-nearest quantization, dequantization, vocabulary tables and the `quant` scheme strings.

Design choices: quantization is symmetric round-to-nearest with no calibration data (int8 per output row, int4
per group of 32 along `in`, its scale searched among short candidates: `int4_scales`); vocabulary tables are
ordinary QuantArrays [V, D] with per-row (int8) or per-row-per-group (int4) scales, so the embedding gather and the tied LM head share one packed copy; the scheme
string ("w8a8+emb4", ...) is parsed once into a frozen QuantScheme that the loaders consult.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from gemmajax.quant.array import (
    INT4_MAX,
    INT4_MIN,
    INT8_MAX,
    KINDS,
    SHORT_SCALE_DTYPES,
    QuantArray,
    group_scales,
    pack_int4,
    padded_in,
    padded_out,
    unpack_int4,
)

_SHORT_MASK = 0xFFF80000  # float32 bits of a 5-significant-bit number: sign, exponent, 4 explicit mantissa bits
_SHORT_ULP = 1 << 19  # one unit in the 4th explicit mantissa bit
_SHORT_MIN = 2.0 ** -100  # smaller groups quantize to zero (|w| < 7 * 2**-100): every scale stays a normal bf16
INT4_SCALE_CANDIDATES = 8


def _int4_levels(g: jax.Array, c: jax.Array) -> jax.Array:
    """Groups g float32 [..., G, group] and a scale per group c [..., G, 1] -> levels round(g / c) clipped to -8..7
    (float32; a zero scale gives levels 0)."""
    return jnp.clip(jnp.round(g / jnp.where(c == 0, 1, c)), INT4_MIN, INT4_MAX)


@jax.jit
def int4_scales(g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Groups g float32 [..., G, group] -> (scales float32 [..., G], levels float32 [..., G, group] in -8..7).

    Each scale has at most 5 significant bits (QuantArray.short_scales: level * scale is then exact in bf16, so no
    path rounds the product and the CPU forms skip that work), chosen per group as the one of INT4_SCALE_CANDIDATES
    that gives the least squared error: max|g| / 7 rounded up to 5 bits, then each next-lower 5-bit number (steps
    of 3-6 %, down to about 0.65-0.8 of it), levels round-to-nearest clipped to -8..7 (a smaller scale clips the
    group's largest weights and rounds the rest finer). The first candidate alone never clips; the search keeps it
    unless another is better for that group. A group with max|g| < 7 * 2**-100 gets scale 0 and levels 0."""
    s0 = jnp.max(jnp.abs(g), axis=-1) / INT4_MAX
    bits = lax.bitcast_convert_type(s0, jnp.uint32)
    top = (bits + jnp.uint32(_SHORT_ULP - 1)) & jnp.uint32(_SHORT_MASK)  # s0 rounded up to 5 significant bits
    floor = lax.bitcast_convert_type(jnp.float32(_SHORT_MIN), jnp.uint32)
    best_s = best_err = None
    for k in range(INT4_SCALE_CANDIDATES):
        c = lax.bitcast_convert_type(jnp.maximum(top - jnp.uint32(k * _SHORT_ULP), floor), jnp.float32)
        c = jnp.where(s0 >= _SHORT_MIN, c, 0.0)
        cc = c[..., None]
        q = _int4_levels(g, cc)
        err = jnp.sum(jnp.square(g - q * cc), axis=-1)
        if best_s is None:
            best_s, best_err = c, err
        else:
            take = err < best_err
            best_s, best_err = jnp.where(take, c, best_s), jnp.where(take, err, best_err)
    return best_s, _int4_levels(g, best_s[..., None])


def _pad_to(w: jax.Array, out_p: int, in_p: int) -> jax.Array:
    pads = [(0, 0)] * (w.ndim - 2) + [(0, out_p - w.shape[-2]), (0, in_p - w.shape[-1])]
    return jnp.pad(w, pads) if any(p[1] for p in pads) else w


W8A8_ACT_GROUP = 128  # activation scales per token per 128 input columns (int8_matmul.py: accuracy and cost)


def default_act_group(in_features: int) -> int:
    """The activation group a w8a8 projection with `in_features` inputs gets: W8A8_ACT_GROUP (128) when it divides
    the width, else 0 (one scale per token; e.g. Gemma 4 26B-A4B's dense down_proj, in 2112). Measured on Gemma 3
    270M (111 tokens teacher-forced vs float32): per token KL 0.041 / top-1 92.8 %; G = 128 KL 0.011 / 95.5 %."""
    return W8A8_ACT_GROUP if in_features % W8A8_ACT_GROUP == 0 else 0


def quantize(w: jax.Array, kind: str, group: int = 32, *, scale_dtype=None, pad_in_to: int | None = None,
             act_group: int = 0) -> QuantArray:
    """Round-to-nearest symmetric quantization of a weight w [..., out, in] (Hugging Face layout).

    int8: scale = max|w_row| / 127 per output row (float32 unless scale_dtype says otherwise; the levels are
    derived from the stored, rounded scale), levels -127..127.
    int4: one scale per group of `group` columns (bfloat16 by default), searched by `int4_scales` (5 significant
    bits, the least squared error of the group), levels -8..7. A scale dtype of SHORT_SCALE_DTYPES holds those
    scales exactly (the QuantArray is marked short_scales); another (float16) has its levels derived from the
    stored, rounded scale, unmarked.
    pad_in_to: pad `in` to a multiple of this (tables: 128 int8 / 256 int4, i.e. 128-byte rows).
    act_group: int8 only, static: the w8a8 matmul quantizes activations per token per act_group input columns
    (a multiple of 32 dividing the padded `in`; 0 = one scale per token). The weight itself is the same.
    Returns a QuantArray with dequantize(q) ~= w.
    """
    if kind not in KINDS:
        raise ValueError(f"quantize: kind must be one of {KINDS}, got {kind!r}")
    w = jnp.asarray(w)
    if w.ndim < 2:
        raise ValueError(f"quantize: weight must be [..., out, in], got shape {w.shape}")
    if kind == "int4" and (group <= 0 or group % 8):
        raise ValueError(f"quantize: int4 group must be a positive multiple of 8, got {group}")
    if act_group and kind != "int8":
        raise ValueError(f"quantize: act_group applies to int8 (w8a8) only, got act_group={act_group} for {kind}")
    shape, dtype = tuple(w.shape), w.dtype
    in_p = padded_in(shape[-1], kind, group, pad_in_to)
    out_p = padded_out(shape[-2])
    sdt = jnp.dtype(scale_dtype or (jnp.float32 if kind == "int8" else jnp.bfloat16))
    rows = _pad_to(w, out_p, shape[-1]).reshape(-1, shape[-1])
    step = rows.shape[0] if isinstance(w, jax.core.Tracer) else _chunk_rows(in_p)
    parts = [_quantize_rows(rows[i:i + step], kind, in_p, group, sdt) for i in range(0, max(rows.shape[0], 1), step)]
    vals, s = (jnp.concatenate(p, axis=0) if len(parts) > 1 else p[0] for p in zip(*parts))
    vals, s = vals.reshape(*shape[:-2], out_p, -1), s.reshape(*shape[:-2], out_p, -1)
    if kind == "int8":
        return QuantArray(vals, s[..., 0], "int8", shape, 0, dtype, act_group)
    return QuantArray(vals, s, "int4", shape, group, dtype, short_scales=sdt in SHORT_SCALE_DTYPES)


QUANTIZE_CHUNK = 1 << 22  # elements a quantize() call handles at once: its float32 temporaries stay ~16 MiB each


def _chunk_rows(in_p: int) -> int:
    """Rows per quantize() chunk: a power of two (few distinct shapes to compile) of at most QUANTIZE_CHUNK
    elements, at least one row."""
    return 1 << max(0, (QUANTIZE_CHUNK // in_p).bit_length() - 1)


@functools.partial(jax.jit, static_argnames=("kind", "in_p", "group", "sdt"))
def _quantize_rows(w: jax.Array, kind: str, in_p: int, group: int, sdt) -> tuple[jax.Array, jax.Array]:
    """Rows w [R, in] (any float dtype) -> (values [R, in_p] int8 or [R, in_p // 2] packed uint8, scales [R, 1]
    int8 or [R, in_p // group] int4, in sdt). quantize() calls it on row chunks, so that the whole weight is never
    held in float32 nor searched at once (the int4 search's temporaries for a 262,144 x 640 table took 6 GB)."""
    wf = _pad_to(w.astype(jnp.float32), w.shape[0], in_p)
    if kind == "int8":
        s = (jnp.max(jnp.abs(wf), axis=-1, keepdims=True) / INT8_MAX).astype(sdt)
        sf = s.astype(jnp.float32)
        return jnp.clip(jnp.round(wf / jnp.where(sf == 0, 1, sf)), -INT8_MAX, INT8_MAX).astype(jnp.int8), s
    g = wf.reshape(w.shape[0], in_p // group, group)
    s32, q = int4_scales(g)
    s = s32.astype(sdt)
    if sdt not in SHORT_SCALE_DTYPES:  # a dtype that may not hold the scale: levels from the stored one
        q = _int4_levels(g, s.astype(jnp.float32)[..., None])
    return pack_int4(q.reshape(wf.shape)), s


def dequantize(q: QuantArray, dtype=None) -> jax.Array:
    """QuantArray -> dense [..., out, in] (the logical shape) in `dtype` (default: the weight's original dtype).

    int8: level * scale in float32. int4: bf16(level * scale) -- the stored weight is that bf16 number.
    """
    dtype = q.dtype if dtype is None else dtype
    if q.kind == "int8":
        w = q.values.astype(jnp.float32) * q.scale.astype(jnp.float32)[..., None]
    else:
        w = (unpack_int4(q.values).astype(jnp.float32) * group_scales(q.scale, q.group)).astype(jnp.bfloat16)
    return w[..., : q.out_features, : q.in_features].astype(dtype)


def dequantize_rows(q: QuantArray, ids: jax.Array, dtype=None) -> jax.Array:
    """Rows `ids` (int [...]) of a 2-D QuantArray [V, D], dequantized: [..., D]. Gathers and unpacks only those
    rows (values and scales), never the table."""
    if q.ndim != 2:
        raise ValueError(f"take_rows needs a 2-D table [V, D], got QuantArray {q.shape}")
    dtype = q.dtype if dtype is None else dtype
    vals = jnp.take(q.values, ids, axis=0)
    sc = jnp.take(q.scale, ids, axis=0)
    if q.kind == "int8":
        rows = vals.astype(jnp.float32) * sc.astype(jnp.float32)[..., None]
    else:
        rows = (unpack_int4(vals).astype(jnp.float32) * group_scales(sc, q.group)).astype(jnp.bfloat16)
    return rows[..., : q.in_features].astype(dtype)


def quantize_table(table: jax.Array, bits: int, group: int = 32) -> QuantArray:
    """Vocabulary table [V, D] (embeddings, per-layer embeddings, tied LM head) -> QuantArray [V, D].

    bits 8: int8, one float32 scale per row, D padded to a multiple of 128.
    bits 4: int4, one bf16 scale per row per `group` columns, D padded to a multiple of 256 (128 packed bytes),
    so that row gathers stay aligned. take_rows / linear read the packed table directly.
    """
    if table.ndim != 2:
        raise ValueError(f"quantize_table: table must be [V, D], got shape {table.shape}")
    if bits == 8:
        return quantize(table, "int8", pad_in_to=128)
    if bits == 4:
        return quantize(table, "int4", group, pad_in_to=256)
    raise ValueError(f"quantize_table: bits must be 4 or 8, got {bits}")


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """A parsed `quant` string. linear: None | "int8" | "int4"; qat: exact repack of QAT weights (int4 only);
    table_bits: None | 4 | 8 for the vocabulary tables."""

    linear: str | None = None
    qat: bool = False
    table_bits: int | None = None

    @property
    def name(self) -> str:
        base = {None: "none", "int8": "w8a8", "int4": "qat-w4a16" if self.qat else "w4a16"}[self.linear]
        return base + (f"+emb{self.table_bits}" if self.table_bits else "")


_BASES = {"none": (None, False), "w8a8": ("int8", False), "w4a16": ("int4", False), "qat-w4a16": ("int4", True)}


def parse_quant(quant: str) -> QuantScheme:
    """"none" | "w8a8" | "w4a16" | "qat-w4a16", optionally with "+emb4" / "+emb8" -> QuantScheme."""
    base, _, emb = (quant or "none").strip().lower().partition("+")
    if base not in _BASES or emb not in ("", "emb4", "emb8"):
        raise ValueError(f"unknown quant {quant!r}: expected one of {sorted(_BASES)} with an optional "
                         f"'+emb4' or '+emb8' suffix, e.g. 'w8a8+emb4'")
    linear, qat = _BASES[base]
    return QuantScheme(linear, qat, int(emb[3:]) if emb else None)
