"""QuantArray layout, pytree behaviour, abstract shapes, quantize / dequantize round trips, tables, scheme strings."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmajax.quant import (
    QuantArray,
    QuantScheme,
    abstract_quant,
    dequantize,
    parse_quant,
    quantize,
    quantize_table,
    repack_qat,
    take_rows,
)
from gemmajax.quant.array import pack_int4, unpack_int4


def _w(shape, seed=0, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def test_pack_unpack_inverse_and_nibble_layout():
    q = jnp.asarray(np.random.default_rng(1).integers(-8, 8, (5, 64)), jnp.int8)
    v = pack_int4(q)
    assert v.dtype == jnp.uint8 and v.shape == (5, 32)
    assert np.array_equal(np.asarray(unpack_int4(v)), np.asarray(q))
    # byte j = (q[j] + 8) | (q[j + 32] + 8) << 4, by hand for one row
    row = np.asarray(q[0]).astype(np.int32) + 8
    assert np.array_equal(np.asarray(v[0]), (row[:32] | (row[32:] << 4)).astype(np.uint8))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_pytree_jit_and_abstract_match_quantize(kind):
    w = _w((3, 1000, 640), dtype=jnp.bfloat16)  # experts [E, out, in]
    q = quantize(w, kind)
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 2 and leaves[0] is q.values and leaves[1] is q.scale
    q2 = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (q2.kind, q2.shape, q2.group, q2.dtype) == (q.kind, q.shape, q.group, q.dtype)
    # jit traces through it; static metadata survives
    assert jax.jit(lambda q: dequantize(q)).lower(q).out_info.shape == (3, 1000, 640)
    a = QuantArray.abstract((3, 1000, 640), kind)
    assert a == abstract_quant((3, 1000, 640), kind)
    assert (a.values.shape, a.values.dtype, a.scale.shape, a.scale.dtype) == (
        q.values.shape, q.values.dtype, q.scale.shape, q.scale.dtype)
    assert a.nbytes == q.nbytes == q.values.nbytes + q.scale.nbytes
    # eval_shape on the abstract tree needs no memory
    out = jax.eval_shape(lambda q: dequantize(q, jnp.float32), a)
    assert out.shape == (3, 1000, 640) and out.dtype == jnp.float32


def test_layout_shapes_and_padding():
    q8 = quantize(_w((1000, 640)), "int8")
    assert q8.values.shape == (1000, 640) and q8.scale.shape == (1000,) and q8.scale.dtype == jnp.float32
    q4 = quantize(_w((1000, 640)), "int4")
    assert q4.values.shape == (1000, 320) and q4.scale.shape == (1000, 20) and q4.scale.dtype == jnp.bfloat16
    big = QuantArray.abstract((5000, 100), "int4")  # out > 4096, not a multiple of 128 -> padded; in -> 128
    assert big.values.shape == (5120, 64) and big.scale.shape == (5120, 4)
    assert big.padded_out == 5120 and big.padded_in == 128 and big.out_features == 5000
    with pytest.raises(ValueError, match="values shape"):
        QuantArray(jnp.zeros((10, 7), jnp.int8), jnp.zeros((10,)), "int8", (10, 8))
    with pytest.raises(ValueError, match="kind"):
        quantize(_w((4, 8)), "int3")


def test_int8_round_trip_bound():
    w = _w((300, 640), seed=2)
    q = quantize(w, "int8")
    d = dequantize(q, jnp.float32)
    s = jnp.max(jnp.abs(w), axis=1, keepdims=True) / 127
    err = jnp.abs(d - w)
    assert bool(jnp.all(err <= s / 2 * (1 + 1e-5)))  # round-to-nearest: half a step per value
    assert float(jnp.max(err)) > 0.1 * float(jnp.max(s))  # and the data is really quantized
    assert np.array_equal(np.asarray(quantize(d, "int8").values), np.asarray(q.values))  # re-quantize is a fixpoint


def test_int4_round_trip_bound_and_exact_grid():
    w = _w((96, 256), seed=3)
    q = quantize(w, "int4")
    d = dequantize(q, jnp.float32)
    g = w.reshape(96, 8, 32)
    s = (jnp.max(jnp.abs(g), axis=-1) / 7).astype(jnp.bfloat16).astype(jnp.float32)
    bound = jnp.repeat(s, 32, axis=1) / 2 + jnp.abs(w) * 2.0**-8  # half a step + the bf16 rounding of the product
    assert bool(jnp.all(jnp.abs(d - w) <= bound))
    # the dequantized weight lies on a 4-bit grid per group: the exact QAT repack recovers it bit for bit
    d_bf = dequantize(q, jnp.bfloat16)
    r = repack_qat(d_bf)
    assert r is not None
    assert np.array_equal(np.asarray(dequantize(r)).view(np.uint16), np.asarray(d_bf).view(np.uint16))


def test_zero_rows_and_groups():
    w = _w((8, 64)).at[2].set(0.0).at[5, :32].set(0.0)
    for kind in ("int8", "int4"):
        d = dequantize(quantize(w, kind), jnp.float32)
        assert bool(jnp.all(jnp.isfinite(d))) and bool(jnp.all(d[2] == 0)) and bool(jnp.all(d[5, :32] == 0))


def test_getitem_selects_expert():
    w = _w((4, 64, 128), seed=4)
    for kind in ("int8", "int4"):
        q = quantize(w, kind)
        e = q[2]
        assert e.shape == (64, 128)
        assert np.array_equal(np.asarray(dequantize(e)), np.asarray(dequantize(q)[2]))
        assert q[1:3].shape == (2, 64, 128)
        with pytest.raises(IndexError):
            e[0]


@pytest.mark.parametrize("bits", [8, 4])
def test_tables_take_rows_equal_dequantized_rows(bits):
    table = _w((777, 640), seed=5, dtype=jnp.bfloat16)
    q = quantize_table(table, bits)
    assert (q.values.shape[-1] % 128) == 0  # 128-byte aligned rows
    assert q.padded_in == (640 if bits == 8 else 768)
    ids = jnp.asarray([[0, 776, 5], [5, 3, 100]])
    dense = dequantize(q, jnp.float32)
    rows = take_rows(q, ids, jnp.float32)
    assert rows.shape == (2, 3, 640)
    assert np.array_equal(np.asarray(rows), np.asarray(dense[ids]))
    assert take_rows(q, ids).dtype == jnp.bfloat16  # defaults to the table's dtype
    # the gather reads the packed rows: no [V, D] intermediate appears in the jitted program
    hlo = jax.jit(lambda q, i: take_rows(q, i)).lower(q, ids).as_text()
    whole = {(int(c), t) for c, t in re.findall(r"tensor<777x(\d+)x(\w+)>", hlo)}
    assert whole <= {(q.values.shape[1], "i8" if bits == 8 else "ui8"), (24, "bf16")}, whole


def test_take_rows_dense_unchanged():
    t = _w((10, 4))
    ids = jnp.asarray([3, 1])
    assert np.array_equal(np.asarray(take_rows(t, ids)), np.asarray(t[ids]))
    assert take_rows(t, ids, jnp.bfloat16).dtype == jnp.bfloat16


def test_parse_quant():
    assert parse_quant("none") == QuantScheme()
    assert parse_quant("w8a8+emb4") == QuantScheme("int8", False, 4)
    assert parse_quant("qat-w4a16") == QuantScheme("int4", True, None)
    assert parse_quant("w4a16+emb8").name == "w4a16+emb8"
    with pytest.raises(ValueError, match="unknown quant"):
        parse_quant("w4a8")
    with pytest.raises(ValueError, match="unknown quant"):
        parse_quant("w8a8+emb2")
    assert dataclasses.is_dataclass(parse_quant("w8a8"))
