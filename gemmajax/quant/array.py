"""QuantArray: a quantized weight that goes wherever a weight array goes (a pytree of two arrays).

Design choices: (1) every kind keeps Hugging Face's row-major [..., out, in] layout, so one array serves row
gathers (embedding tables), the tied LM head, the CPU's fast matrix-vector fusion and the TPU kernels alike;
(2) int4 packs column j with column j + in_p/2 into one byte (low / high nibble), so unpacking is two shifts
and no lane interleave on any backend; (3) an int4 weight *is* the bf16 number bf16(level * scale): every path
(dequantize, XLA, Pallas) rounds the product to bf16, which makes the QAT repack exact and all paths agree.

Physical layouts (logical weight [..., out, in]):
  int8: values int8 [..., out_p, in]; scale float32 [..., out_p] = max|w_row| / 127; levels -127..127.
        act_group (static) says how the w8a8 matmul quantizes the activations it meets: 0 one int8 scale per
        token, G one per token per G input columns (G divides in_p, a multiple of 32; see int8_matmul.py).
  int4: values uint8 [..., out_p, in_p // 2]; byte j = (q[j] + 8) | (q[j + in_p // 2] + 8) << 4 (biased nibbles,
        levels -8..7); scale bfloat16 or float32 [..., out_p, in_p // group], one per group along `in`.
        The CPU word layout (int4_to_words; what the engine gives a CPU's dense int4 weights): values uint32
        [..., out_p, in_p // 8], bits 4i..4i+3 of word d = q[8d + i] + 8. XLA:CPU's one-row dot then broadcasts a
        word to the 8 lanes of a vector and shifts each lane by its own amount, all 8 columns under one group
        scale: 1.3x the half-split bytes' speed (int4_matmul.py). The value dtype says which layout an array has.
  out_p = out, except out > 4096 and not a multiple of 128: then padded to 128 (the TPU kernels use a full-width
  block below that size). in_p = in rounded up to 2 * group (int4) so each half holds whole groups; tables pad
  further (see `quantize_table`). Padding is zero levels; the logical shape is static metadata.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

KINDS = ("int8", "int4")
INT8_MAX = 127
INT4_MIN, INT4_MAX = -8, 7
# Scale dtypes that hold a 5-significant-bit scale (normal, >= 2**-100) exactly: quantize() marks its int4 weights
# short_scales for these (float16's range would flush the smallest scales).
SHORT_SCALE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_FULL_BLOCK_OUT = 4096  # out sizes up to this need no padding: the kernels take them as one block


@dataclasses.dataclass(frozen=True)
class QuantArray:
    """A quantized weight (see the module docstring for the layouts).

    values / scale are the pytree children; kind, shape (logical), group, dtype (the dtype the weight had, and
    the default of `dequantize`), act_group (int8: activation scales per token per act_group input columns,
    0 = one per token), tp (the tensor-parallel split, inside a sharded step only) and act_axis (inside a row-parallel
    shard) are static metadata.
    """

    values: Any  # int8 [..., out_p, in] | int4: uint8 [..., out_p, in_p // 2] or uint32 [..., out_p, in_p // 8] (words)
    scale: Any  # int8: f32 [..., out_p] | int4: bf16/f32 [..., out_p, in_p // group]
    kind: str = dataclasses.field(metadata={"static": True})
    shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})  # logical [..., out, in]
    group: int = dataclasses.field(default=0, metadata={"static": True})  # int4 group along `in`; 0 for int8
    dtype: Any = dataclasses.field(default=jnp.dtype(jnp.bfloat16), metadata={"static": True})
    act_group: int = dataclasses.field(default=0, metadata={"static": True})  # int8 only; 0 = per token
    # int4 only: every scale is 0 or a normal number with at most 5 significant bits (quantize() picks its scales
    # that way), so level * scale is exact in bf16 for every level in -8..7 and bf16(level * scale) needs no
    # rounding: the CPU forms then skip it (int4_matmul.py). False promises nothing (QAT scales from a checkpoint).
    short_scales: bool = dataclasses.field(default=False, metadata={"static": True})
    # Set only while a tensor-parallel step is traced (ShardPlan.annotate): a quant.sharded.TPSplit saying how the
    # weight is split, so that linear / gmm run their kernel per shard under shard_map. None everywhere else.
    tp: Any = dataclasses.field(default=None, metadata={"static": True, "runtime": True})
    # int8 inside a row-parallel shard only: the mesh axis its `in` columns are split over, so that a per-token
    # activation scale takes the whole row's maximum (int8_matmul.quantize_activations). Static, so a program traced
    # for a shard is never reused for a whole weight (JAX caches the traces of lax.platform_dependent's branches).
    act_axis: str | None = dataclasses.field(default=None, metadata={"static": True, "runtime": True})

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"QuantArray kind must be one of {KINDS}, got {self.kind!r}")
        if len(self.shape) < 2:
            raise ValueError(f"QuantArray needs a logical shape [..., out, in], got {self.shape}")
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "act_group", int(self.act_group))
        object.__setattr__(self, "short_scales", bool(self.short_scales))
        if self.short_scales and self.kind != "int4":
            raise ValueError(f"QuantArray {self.kind} {self.shape}: short_scales applies to int4 only")
        if self.act_group and (self.kind != "int8" or self.act_group < 0 or self.act_group % 32):
            raise ValueError(f"QuantArray {self.kind} {self.shape}: act_group must be 0 or (int8 only) a positive "
                             f"multiple of 32, got {self.act_group}")
        if not hasattr(self.values, "shape"):  # pytree machinery may rebuild us around placeholder leaves
            return
        vshape, sshape = tuple(self.values.shape), tuple(self.scale.shape)
        *lead, out, inp = self.shape
        out_p = vshape[-2] if len(vshape) >= 2 else -1
        if self.kind == "int4" and jnp.dtype(self.values.dtype) not in (jnp.uint8, jnp.uint32):
            raise ValueError(f"QuantArray int4 {self.shape}: values must be uint8 (two columns a byte) or uint32 (the "
                             f"CPU word layout, eight columns a word), got {jnp.dtype(self.values.dtype)}")
        per = _columns_per_value(self.kind, self.values.dtype)
        if per == WORD and self.group % WORD:
            raise ValueError(f"QuantArray int4 {self.shape}: the CPU word layout (values uint32, {WORD} columns a "
                             f"word under one scale) needs a group that is a multiple of {WORD}, got {self.group}")
        in_p = vshape[-1] * per if vshape else -1
        exp_s = (*lead, out_p) if self.kind == "int8" else (*lead, out_p, in_p // max(self.group, 1))
        bad = (len(vshape) != len(self.shape) or vshape[:-2] != tuple(lead) or out_p < out or in_p < inp
               or sshape != exp_s or (self.kind == "int4" and (self.group <= 0 or in_p % (2 * self.group))))
        if bad:
            raise ValueError(f"QuantArray {self.kind} {self.shape} (group {self.group}): values shape {vshape} / "
                             f"scale shape {sshape} do not match the layout (values [..., >= out, >= in"
                             f"{f' / {per} ({jnp.dtype(self.values.dtype)})' if self.kind == 'int4' else ''}], "
                             f"scale {exp_s})")
        if self.act_group and in_p % self.act_group:
            raise ValueError(f"QuantArray int8 {self.shape}: act_group {self.act_group} does not divide the "
                             f"(padded) input width {in_p}")

    # --- shapes -------------------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def out_features(self) -> int:
        return self.shape[-2]

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def padded_out(self) -> int:
        return int(self.values.shape[-2])

    @property
    def padded_in(self) -> int:
        return int(self.values.shape[-1]) * _columns_per_value(self.kind, self.values.dtype)

    @property
    def words(self) -> bool:
        """int4 in the CPU word layout (values uint32, see the module docstring; int4_to_words)."""
        return self.kind == "int4" and jnp.dtype(self.values.dtype) == jnp.uint32

    @property
    def nbytes(self) -> int:
        """Bytes held by values and scale (works on abstract arrays too)."""
        return _nbytes(self.values) + _nbytes(self.scale)

    def __getitem__(self, idx) -> QuantArray:
        """Index the leading (non-matrix) dims, e.g. experts[e] -> one expert's [out, in] weight."""
        lead = self.shape[:-2]
        if not lead:
            raise IndexError(f"QuantArray {self.shape} has no leading dims to index")
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) > len(lead) or any(i is Ellipsis or i is None for i in idx):
            raise IndexError(f"QuantArray {self.shape}: only integer / slice indices into the leading dims {lead}")
        new_lead = np.empty(lead, dtype=np.int8)[idx].shape  # numpy works out the resulting leading shape
        return dataclasses.replace(self, values=self.values[idx], scale=self.scale[idx],
                                   shape=tuple(new_lead) + self.shape[-2:])

    def __repr__(self) -> str:
        g = f", group={self.group}" if self.kind == "int4" else ""
        g += f", act_group={self.act_group}" if self.act_group else ""
        g += ", short_scales" if self.short_scales else ""
        return (f"QuantArray({self.kind}, shape={self.shape}{g}, dtype={self.dtype.name}, "
                f"values={getattr(self.values, 'dtype', '?')}{tuple(self.values.shape)}, "
                f"scale={getattr(self.scale, 'dtype', '?')}{tuple(self.scale.shape)})")

    # --- constructors -------------------------------------------------------------------------------------------
    @classmethod
    def abstract(cls, shape, kind: str, *, group: int = 32, dtype=jnp.bfloat16, scale_dtype=None,
                 sharding=None, pad_in_to: int | None = None, act_group: int = 0,
                 short_scales: bool | None = None) -> QuantArray:
        """The QuantArray of jax.ShapeDtypeStruct that `quantize(w, kind, ...)` would give for a weight of `shape`
        (short_scales: None = what quantize() gives).

        For jax.eval_shape, deviceless TPU AOT compiles and loaders: no memory is touched. `sharding` (optional)
        is attached to both children.
        """
        return abstract_quant(shape, kind, group=group, dtype=dtype, scale_dtype=scale_dtype, sharding=sharding,
                              pad_in_to=pad_in_to, act_group=act_group, short_scales=short_scales)


jax.tree_util.register_dataclass(QuantArray)


def _nbytes(a) -> int:
    return int(math.prod(a.shape)) * jnp.dtype(a.dtype).itemsize


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def padded_out(out: int) -> int:
    """Physical row count for `out` logical rows (padding only large sizes that are not a multiple of 128)."""
    return out if out % 128 == 0 or out <= _FULL_BLOCK_OUT else _round_up(out, 128)


def padded_in(inp: int, kind: str, group: int = 32, pad_in_to: int | None = None) -> int:
    """Physical column count (int4: a multiple of 2 * group; `pad_in_to` rounds up further, e.g. 128 / 256)."""
    m = 2 * group if kind == "int4" else 1
    if pad_in_to:
        m = math.lcm(m, pad_in_to)
    return _round_up(inp, m)


def abstract_quant(shape, kind: str, *, group: int = 32, dtype=jnp.bfloat16, scale_dtype=None, sharding=None,
                   pad_in_to: int | None = None, act_group: int = 0, short_scales: bool | None = None) -> QuantArray:
    """Shapes-only QuantArray for a logical weight `shape` [..., out, in] (see QuantArray.abstract).
    act_group: int8 only (0 = per-token activation scales). short_scales: int4 only; None = what quantize() gives
    for this scale dtype (SHORT_SCALE_DTYPES)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    *lead, out, inp = (int(d) for d in shape)
    group = group if kind == "int4" else 0
    in_p, out_p = padded_in(inp, kind, group, pad_in_to), padded_out(out)
    if kind == "int8":
        vals = jax.ShapeDtypeStruct((*lead, out_p, in_p), jnp.int8, sharding=sharding)
        sc = jax.ShapeDtypeStruct((*lead, out_p), scale_dtype or jnp.float32, sharding=sharding)
    else:
        vals = jax.ShapeDtypeStruct((*lead, out_p, in_p // 2), jnp.uint8, sharding=sharding)
        sc = jax.ShapeDtypeStruct((*lead, out_p, in_p // group), scale_dtype or jnp.bfloat16, sharding=sharding)
    if short_scales is None:
        short_scales = kind == "int4" and jnp.dtype(sc.dtype) in SHORT_SCALE_DTYPES
    return QuantArray(vals, sc, kind, (*lead, out, inp), group, jnp.dtype(dtype), act_group, short_scales)


# --- int4 packing ---------------------------------------------------------------------------------------------------
def pack_int4(q: jax.Array) -> jax.Array:
    """Levels int [..., in_p] in -8..7 (in_p even) -> uint8 [..., in_p // 2]: low nibble col j, high col j + in_p/2."""
    h = q.shape[-1] // 2
    u = (q.astype(jnp.int32) + 8).astype(jnp.uint8)
    return u[..., :h] | (u[..., h:] << 4)


def unpack_int4(v: jax.Array) -> jax.Array:
    """Packed int4 values -> int8 levels [..., in_p]: uint8 [..., in_p / 2] (inverse of pack_int4) or uint32
    [..., in_p / 8] (the CPU word layout, inverse of pack_int4_words)."""
    if jnp.dtype(v.dtype) == jnp.uint32:
        nib = (v[..., None] >> (4 * lax.iota(jnp.uint32, WORD))) & jnp.uint32(15)
        return nib.reshape(*v.shape[:-1], v.shape[-1] * WORD).astype(jnp.int8) - 8
    lo = (v & 15).astype(jnp.int8) - 8
    hi = (v >> 4).astype(jnp.int8) - 8
    return jnp.concatenate([lo, hi], axis=-1)


WORD = 8  # int4 columns per uint32 word of the CPU layout


def pack_int4_words(q: jax.Array) -> jax.Array:
    """Levels int [..., in_p] in -8..7 (in_p a multiple of 8) -> uint32 [..., in_p / 8]: bits 4i..4i+3 of word d
    hold column 8d + i, biased by 8 (the CPU word layout)."""
    u = (q.astype(jnp.int32) + 8).astype(jnp.uint32).reshape(*q.shape[:-1], q.shape[-1] // WORD, WORD)
    return jnp.sum(u << (4 * lax.iota(jnp.uint32, WORD)), axis=-1, dtype=jnp.uint32)  # disjoint bits: the sum is an or


def int4_to_words(w: QuantArray) -> QuantArray:
    """An int4 QuantArray in the CPU word layout (the same levels and scales). Other kinds, and int4 groups that are
    not a multiple of 8 columns (a word would straddle two scales), are returned as they are."""
    if w.kind != "int4" or w.words or w.group % WORD:
        return w
    return dataclasses.replace(w, values=_repack(_words_of, w.values))


def int4_words_tree(tree: Any) -> Any:
    """`tree` with every 2-D int4 QuantArray in the CPU word layout (int4_to_words; stacks of experts, which the
    grouped matmul reads in half-split bytes, and everything else unchanged)."""
    def conv(x):
        return int4_to_words(x) if isinstance(x, QuantArray) and x.kind == "int4" and x.ndim == 2 else x

    return jax.tree.map(conv, tree, is_leaf=lambda x: isinstance(x, QuantArray))


def int4_halves_tree(tree: Any) -> Any:
    """`tree` with every int4 QuantArray in the standard half-split layout (int4_to_halves)."""
    return jax.tree.map(lambda x: int4_to_halves(x) if isinstance(x, QuantArray) else x, tree,
                        is_leaf=lambda x: isinstance(x, QuantArray))


def int4_to_halves(w: QuantArray) -> QuantArray:
    """An int4 QuantArray in the standard half-split byte layout (the TPU / GPU kernels' and checkpoints')."""
    if not (w.kind == "int4" and w.words):
        return w
    return dataclasses.replace(w, values=_repack(_halves_of, w.values))


_REPACK_ROWS = 1 << 12  # rows a repack outside a trace handles at once: a bounded temporary for any table


@jax.jit
def _words_of(v: jax.Array) -> jax.Array:
    return pack_int4_words(unpack_int4(v))


@jax.jit
def _halves_of(v: jax.Array) -> jax.Array:
    return pack_int4(unpack_int4(v))


def _repack(f, v: jax.Array) -> jax.Array:
    """f (a compiled repack) over v's rows in chunks of _REPACK_ROWS (a whole table at once would hold its levels and
    their int32 widening, 2-8 bytes a column: gigabytes for a per-layer-embedding table); inside a trace, at once
    (XLA fuses it)."""
    if isinstance(v, jax.core.Tracer) or v.shape[-2] <= _REPACK_ROWS:
        return f(v)
    n = v.shape[-2]
    return jnp.concatenate([f(v[..., i:i + _REPACK_ROWS, :]) for i in range(0, n, _REPACK_ROWS)], axis=-2)


def _columns_per_value(kind: str, dtype) -> int:
    if kind != "int4":
        return 1
    return WORD if jnp.dtype(dtype) == jnp.uint32 else 2


def group_scales(scale: jax.Array, group: int) -> jax.Array:
    """Per-group scales [..., G] -> per-column f32 [..., G * group]."""
    return jnp.repeat(scale.astype(jnp.float32), group, axis=-1)


# --- weights joined along `out` (the CPU engine's fused projections) -------------------------------------------------
def concat_out(parts: list) -> Any:
    """2-D weights [out_i, in] -> one weight [sum of out_i, in] whose rows are theirs in order, or None where they
    cannot be joined exactly: plain arrays of one dtype and width, or QuantArrays alike in everything but `out`
    (kind, in, group, dtype, act_group, short_scales, layouts and scale dtype) with no padded rows, no
    tensor-parallel metadata, and a total that the layout would not pad (`padded_out`). Each output of a matmul by
    the joined weight is made from its own row of it, as by the part (the forms of int8_matmul, int4_matmul, ops)."""
    if len(parts) < 2 or any(p is None or len(p.shape) != 2 for p in parts):
        return None
    first = parts[0]
    if not isinstance(first, QuantArray):
        if any(isinstance(p, QuantArray) or p.dtype != first.dtype or p.shape[1] != first.shape[1] for p in parts):
            return None
        return jnp.concatenate(parts, axis=0)

    def key(p):
        return (p.kind, p.shape[1], p.group, p.dtype, p.act_group, p.values.dtype, p.values.shape[1],
                p.scale.dtype, p.scale.shape[1:], p.short_scales, p.tp, p.act_axis)

    if any(not isinstance(p, QuantArray) or key(p) != key(first) or p.padded_out != p.out_features for p in parts):
        return None
    out = sum(p.out_features for p in parts)
    if padded_out(out) != out:
        return None   # the joined rows would need the padding the layout gives a weight of that size
    return dataclasses.replace(first, values=jnp.concatenate([p.values for p in parts], axis=0),
                               scale=jnp.concatenate([p.scale for p in parts], axis=0), shape=(out, first.in_features))


def split_out(w: Any, sizes: list[int]) -> list:
    """The inverse of `concat_out`: rows [o, o + size) of w for each size in turn (a QuantArray's rows of values
    and scales, its metadata kept)."""
    if sum(sizes) != w.shape[0]:
        raise ValueError(f"split_out: the sizes {sizes} add up to {sum(sizes)}, the weight has {w.shape[0]} rows")
    out, o = [], 0
    for n in sizes:
        if isinstance(w, QuantArray):
            out.append(dataclasses.replace(w, values=w.values[o:o + n], scale=w.scale[o:o + n],
                                           shape=(n, w.in_features)))
        else:
            out.append(w[o:o + n])
        o += n
    return out
