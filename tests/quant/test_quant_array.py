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


def _short_candidates(g: np.ndarray) -> np.ndarray:
    """The scales quantize() chooses among, by hand: max|g| / 7 rounded up to 5 significant bits (float32 bits),
    then each next-lower 5-bit number. g [..., group] -> [..., 8]."""
    s0 = (np.max(np.abs(g), axis=-1) / np.float32(7)).astype(np.float32)
    top = (s0.view(np.uint32).astype(np.int64) + (1 << 19) - 1) & 0xFFF80000
    return (top[..., None] - (np.arange(8) << 19)).astype(np.uint32).view(np.float32)


def _sse(g: np.ndarray, c: np.ndarray) -> np.ndarray:
    q = np.clip(np.rint(g / c[..., None]), -8, 7)
    return np.sum(np.square(g - q * c[..., None], dtype=np.float64), axis=-1)


@pytest.mark.parametrize("dist", ["normal", "student_t3", "outlier_columns"])
def test_int4_scales_are_short_and_the_least_squared_error(dist):
    """int4 quantization: every scale has at most 5 significant bits (QuantArray.short_scales: level x scale exact in
    bf16, dequantize() rounds nothing), each group's is the candidate of least squared error (checked against all
    eight, computed here in numpy), and over the weight the error is below plain max|g| / 7 scales' (the former
    scheme), on data drawn three ways."""
    rng = np.random.default_rng({"normal": 3, "student_t3": 4, "outlier_columns": 5}[dist])
    w = rng.standard_t(3, (96, 256)) if dist == "student_t3" else rng.standard_normal((96, 256))
    if dist == "outlier_columns":
        w[:, ::37] *= 20
    w = w.astype(np.float32)
    q = quantize(jnp.asarray(w), "int4")
    assert q.short_scales and q.scale.dtype == jnp.bfloat16
    s = np.asarray(q.scale, np.float32)
    assert not np.any(s.view(np.uint32) & 0x7FFFF), "a scale has more than 5 significant bits"
    d = np.asarray(dequantize(q, jnp.float32))
    levels = np.asarray(unpack_int4(q.values)).astype(np.float32)
    assert np.array_equal(d, (levels.reshape(96, 8, 32) * s[..., None]).reshape(96, 256))  # no rounding anywhere
    g = w.reshape(96, 8, 32)
    cands = _short_candidates(g)
    errs = np.stack([_sse(g, cands[..., k]) for k in range(8)], -1)
    got = np.sum(np.square(g - d.reshape(96, 8, 32), dtype=np.float64), axis=-1)
    assert np.all(np.any(s[..., None] == cands, axis=-1))  # each group's scale is one of its own candidates
    np.testing.assert_allclose(got, errs.min(-1), rtol=1e-6)  # the best candidate of each group
    old_s = (np.max(np.abs(g), axis=-1) / 7).astype(jnp.bfloat16).astype(np.float32)
    old = (np.clip(np.rint(g / old_s[..., None]), -8, 7) * old_s[..., None]).astype(jnp.bfloat16).astype(np.float32)
    assert got.sum() < np.sum(np.square(g - old, dtype=np.float64))
    inner = (levels > -8) & (levels < 7)  # not at the clip: within half a step of the weight
    assert np.all(np.abs(d - w)[inner] <= np.repeat(s, 32, axis=1)[inner] / 2)


def test_int4_round_trip_exact_grid_and_tiny_groups():
    w = _w((96, 256), seed=3).at[0, :32].multiply(1e-32).at[1, :32].set(0.0)
    q = quantize(w, "int4")
    s = np.asarray(q.scale, np.float32)
    assert s[0, 0] == 0 and s[1, 0] == 0 and np.all(s[2:] > 2.0**-100)  # |w| < 7 * 2**-100 quantizes to zero
    # the dequantized weight lies on a 4-bit grid per group: the exact QAT repack recovers it bit for bit
    d_bf = dequantize(q, jnp.bfloat16)
    r = repack_qat(d_bf)
    assert r is not None and not r.short_scales  # scales read from a checkpoint promise nothing
    assert np.array_equal(np.asarray(dequantize(r)).view(np.uint16), np.asarray(d_bf).view(np.uint16))
    for sd, short in ((jnp.float32, True), (jnp.float16, False)):  # float16 cannot hold every short scale
        qs = quantize(w, "int4", scale_dtype=sd)
        assert qs.short_scales == short and qs.scale.dtype == sd
        assert qs.short_scales == QuantArray.abstract(w.shape, "int4", scale_dtype=sd).short_scales
    with pytest.raises(ValueError, match="short_scales applies to int4 only"):
        dataclasses.replace(quantize(w, "int8"), short_scales=True)


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


@pytest.mark.parametrize("trial", range(6))
def test_chunked_quantize_equals_one_call(trial, monkeypatch):
    """quantize() works on row chunks (QUANTIZE_CHUNK elements); any chunking gives the one-call result bit for bit.
    Shapes, kinds, dtypes and chunk sizes drawn at random (seeded): leading expert dims, out padded (> 4096 rows,
    not a multiple of 128), in padded, a ragged last chunk, chunks of one row."""
    import importlib

    qmod = importlib.import_module("gemmajax.quant.quantize")  # the module (the package exports a function so named)
    rng = np.random.default_rng(20261205 + trial)
    lead = tuple(rng.integers(1, 4, rng.integers(0, 2)))
    out = int(rng.choice([7, 96, 300, 4097]))
    inp = int(rng.choice([40, 64, 200, 640]))
    kind = str(rng.choice(["int8", "int4"]))
    dtype = [jnp.float32, jnp.bfloat16, jnp.float16][trial % 3]
    sds = {"int8": [None, jnp.bfloat16], "int4": [None, jnp.float16, jnp.float32]}[kind]
    sd = sds[trial % len(sds)]
    pad = int(rng.choice([0, 128, 256])) or None
    w = _w((*lead, out, inp), seed=trial, dtype=dtype) * float(rng.choice([0.02, 1.0, 30.0]))
    monkeypatch.setattr(qmod, "QUANTIZE_CHUNK", 1 << 40)
    whole = quantize(w, kind, scale_dtype=sd, pad_in_to=pad)
    in_p, rows = whole.padded_in, whole.values.size // whole.values.shape[-1]
    chunks = [int(rng.integers(rows * in_p // 40 + 1, rows * in_p // 2 + 2)), 4096] + ([1] if rows <= 400 else [])
    for chunk in chunks:  # elements: a ragged last chunk, a power of two, one row per chunk
        monkeypatch.setattr(qmod, "QUANTIZE_CHUNK", chunk)
        q = quantize(w, kind, scale_dtype=sd, pad_in_to=pad)
        assert (q.kind, q.shape, q.group, q.dtype, q.short_scales) == (whole.kind, whole.shape, whole.group,
                                                                       whole.dtype, whole.short_scales)
        assert q.values.shape == whole.values.shape and q.scale.shape == whole.scale.shape, chunk
        assert np.array_equal(np.asarray(q.values), np.asarray(whole.values)), chunk
        assert np.array_equal(np.asarray(q.scale, np.float32), np.asarray(whole.scale, np.float32)), chunk
    # and under tracing (aot's eval_shape of quantize_table): one call, the same shapes
    a = jax.eval_shape(lambda x: quantize(x, kind, scale_dtype=sd, pad_in_to=pad), w)
    assert (a.values.shape, a.scale.shape, a.scale.dtype) == (whole.values.shape, whole.scale.shape, whole.scale.dtype)


_QUANTIZE_MEMORY = """
import resource, sys
import numpy as np, ml_dtypes, jax, jax.numpy as jnp
from gemmajax.quant import quantize_table
t = jnp.asarray(np.random.default_rng(0).standard_normal((131072, 640), np.float32).astype(ml_dtypes.bfloat16))
jax.block_until_ready(t)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
q = quantize_table(t, int(sys.argv[1]))
jax.block_until_ready((q.values, q.scale))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_table_memory_stays_near_its_output(bits):
    """Quantizing a 131,072 x 640 bf16 table (168 MB) must not hold it in float32 nor search it at once: the peak
    RSS may rise by less than 256 MB above the table (the packed output is 42 / 101 MB). Measured: before the
    chunking the int4 table's scale search rose by about 3 GB (6.3 GB for the 262,144-row Gemma vocabulary)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _QUANTIZE_MEMORY, str(bits)], check=False, capture_output=True,
                       text=True, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rise = float(p.stdout.strip().splitlines()[-1])
    assert rise < 256, f"int{bits} quantize_table raised peak RSS by {rise:.0f} MB"
