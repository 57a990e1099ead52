"""Ragged paged attention: the jnp reference against a dense float64 numpy attention, the Pallas kernel (TPU
interpret mode on CPU) against the reference. Unused pages, out-of-window pages, padding rows and garbage page-table
entries are NaN or out of range, so that any read of them shows up in the output."""

from __future__ import annotations

import dataclasses
import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmajax.kv import (
    KVLayout,
    alloc_pages,
    bytes_per_page,
    make_ragged_meta,
    ragged_paged_attention,
    read_kv,
    write_kv,
)
from gemmajax.kv.attention import kernel_supports, ragged_paged_attention_ref
from gemmajax.kv.layout import storage_dtype

DTYPES = {
    "f32": jnp.float32,
    "bf16": jnp.bfloat16,
    "e5m2": jnp.float8_e5m2,
    "e4m3": jnp.float8_e4m3fn,
}


def _stored(x: np.ndarray, dtype, scale: float) -> np.ndarray:
    """The value a page of `dtype` stores for x (as float32), computed in numpy: clip(x / scale) rounded to dtype."""
    y = x.astype(np.float32) / np.float32(scale)
    if jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e5m2), jnp.dtype(jnp.float8_e4m3fn)):
        fmax = float(jnp.finfo(dtype).max)
        y = np.clip(y, -fmax, fmax)
    return y.astype(jnp.dtype(dtype)).astype(np.float32)  # ml_dtypes casts: round to nearest even


def _roundtrip(x: np.ndarray, dtype, scale: float) -> np.ndarray:
    """What reading a value back from a page of `dtype` gives, in float64."""
    return _stored(x, dtype, scale).astype(np.float64) * scale


@dataclasses.dataclass
class Case:
    q: jax.Array  # [T_pad, N, H]
    k_new: jax.Array  # [T_pad, K, H]
    v_new: jax.Array
    kv_pages: jax.Array  # [P, 2K, ps, H]
    meta: object
    k_full: list  # per sequence: float64 [kv_len, K, H] as read back from the cache (cached + new)
    v_full: list
    q_lens: list
    kv_lens: list
    slots: list  # per sequence: slot ids of the new tokens
    stale_pages: list  # page ids filled with NaN because they are out of every query's window
    dtype: object  # the KV dtype (the pages may be bit-stored)


def make_case(
    seqs: list[tuple[int, int]],
    *,
    n: int,
    nk: int,
    h: int,
    ps: int,
    dtype,
    window: int | None = None,
    t_pad: int | None = None,
    s_max: int | None = None,
    p_max: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    q_dtype=jnp.float32,
    garbage_out_of_window_ids: bool = False,
    bits: bool = False,
    seed: int = 0,
) -> Case:
    """seqs: (cached_len, q_len) per sequence. Every unused page and every page wholly before the window of all
    of a sequence's queries holds NaN; page-table entries past a sequence's pages are garbage ids."""
    rng = np.random.default_rng(seed)
    q_lens = [ql for _, ql in seqs]
    kv_lens = [c + ql for c, ql in seqs]
    t_real = sum(q_lens)
    t_pad = t_pad or t_real + 3
    s_max = s_max or len(seqs) + 2
    p_max = p_max or max(-(-kv // ps) for kv in kv_lens) + 2
    need = [-(-kv // ps) for kv in kv_lens]
    num_pages = sum(need) + 5
    perm = rng.permutation(np.arange(1, num_pages))  # page 0: null page, never assigned
    tables, at = [], 0
    for cnt in need:
        tables.append(list(perm[at : at + cnt]))
        at += cnt

    amp = 2.0  # values in a few units: fp8 round-off visible but finite
    pages = np.full((num_pages, 2 * nk, ps, h), np.nan, np.float32)  # stored values, before the cast to dtype
    k_full, v_full, slots, stale = [], [], [], []
    q = np.full((t_pad, n, h), np.nan, np.float32)
    k_new = np.full((t_pad, nk, h), np.nan, np.float32)
    v_new = np.full((t_pad, nk, h), np.nan, np.float32)
    t0 = 0
    tables_for_meta = []
    for s, (cached, ql) in enumerate(seqs):
        kv_len = cached + ql
        # K/V values representable in q_dtype: the new ones reach the cache through a q_dtype array.
        k = np.asarray(jnp.asarray(rng.normal(size=(kv_len, nk, h)) * amp, q_dtype).astype(jnp.float32))
        v = np.asarray(jnp.asarray(rng.normal(size=(kv_len, nk, h)) * amp, q_dtype).astype(jnp.float32))
        sl = KVLayout.slots(np.asarray(tables[s]), np.arange(cached), ps)
        pages[sl // ps, 0::2, sl % ps] = _stored(k[:cached], dtype, k_scale)  # row 2k = K head k
        pages[sl // ps, 1::2, sl % ps] = _stored(v[:cached], dtype, v_scale)  # row 2k+1 = V head k
        q[t0 : t0 + ql] = rng.normal(size=(ql, n, h)) * amp
        k_new[t0 : t0 + ql] = k[cached:]
        v_new[t0 : t0 + ql] = v[cached:]
        k_full.append(_roundtrip(k, dtype, k_scale))
        v_full.append(_roundtrip(v, dtype, v_scale))
        slots.append(KVLayout.slots(np.asarray(tables[s]), np.arange(cached, kv_len), ps))
        table = list(tables[s])
        if window is not None:
            first_q = cached  # earliest query position of this sequence
            lo = max(0, first_q - window + 1)
            for lp in range(lo // ps):  # pages wholly before every query's window: freed, may hold anything
                stale.append(table[lp])
                pages[table[lp]] = np.nan
                if garbage_out_of_window_ids:
                    table[lp] = 10**6 + lp
        tables_for_meta.append(table + [int(x) for x in rng.integers(-(10**6), 10**6, size=p_max - len(table))])
        t0 += ql
    kv_pages = jnp.asarray(pages).astype(dtype)
    if bits:  # bit-stored pool: the same bytes in an unsigned int array
        kv_pages = jax.lax.bitcast_convert_type(kv_pages, storage_dtype(dtype, bits=True))
    meta = make_ragged_meta(q_lens, kv_lens, tables_for_meta, max_num_seqs=s_max, pages_per_seq=p_max)
    return Case(
        q=jnp.asarray(q).astype(q_dtype), k_new=jnp.asarray(k_new).astype(q_dtype),
        v_new=jnp.asarray(v_new).astype(q_dtype), kv_pages=kv_pages, meta=meta, k_full=k_full, v_full=v_full,
        q_lens=q_lens, kv_lens=kv_lens, slots=slots, stale_pages=stale, dtype=jnp.dtype(dtype),
    )  # fmt: skip


def naive_attention(case: Case, *, sm_scale=1.0, window=None, soft_cap=None) -> np.ndarray:
    """Dense per-sequence attention in float64 over the K/V as they read back from the cache. [T_real, N, H]."""
    q = np.asarray(case.q.astype(jnp.float32), np.float64)
    n, _h = q.shape[1:]
    nk = case.k_full[0].shape[1]
    g = n // nk
    outs, t0 = [], 0
    for s, ql in enumerate(case.q_lens):
        kv_len = case.kv_lens[s]
        qs = q[t0 : t0 + ql]  # [Q, N, H]
        k = np.repeat(case.k_full[s], g, axis=1)  # [L, N, H]: query head n uses KV head n // g
        v = np.repeat(case.v_full[s], g, axis=1)
        sc = np.einsum("qnh,lnh->nql", qs, k) * sm_scale
        if soft_cap is not None:
            sc = np.tanh(sc / soft_cap) * soft_cap
        qpos = kv_len - ql + np.arange(ql)
        kpos = np.arange(kv_len)
        mask = kpos[None, :] <= qpos[:, None]
        if window is not None:
            mask &= qpos[:, None] - kpos[None, :] < window
        sc = np.where(mask[None], sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        outs.append(np.einsum("nql,lnh->qnh", p, v))
        t0 += ql
    return np.concatenate(outs, 0)


_STATIC = ("impl", "sm_scale", "sliding_window", "soft_cap", "k_scale", "v_scale", "block_q", "block_kv", "kv_dtype")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _run(q, k, v, pages, meta, **kw):
    return ragged_paged_attention(q, k, v, pages, meta, **kw)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _run_read_only(q, pages, meta, **kw):
    return ragged_paged_attention(q, None, None, pages, meta, **kw)


def run(case: Case, impl: str, read_only: bool = False, **kw):
    """Runs the op under jit; read_only: the producer layer's write is done first here, the op gets k/v = None."""
    if read_only:
        rows = np.concatenate(
            [np.arange(sum(case.q_lens[:i]), sum(case.q_lens[: i + 1])) for i in range(len(case.q_lens))]
        )
        pages = write_kv(
            case.kv_pages,
            case.k_new[rows],
            case.v_new[rows],
            jnp.asarray(np.concatenate(case.slots)),
            k_scale=kw.get("k_scale", 1.0),
            v_scale=kw.get("v_scale", 1.0),
            kv_dtype=case.dtype,
        )
        out, pages_out = _run_read_only(case.q, pages, case.meta, impl=impl, **kw)
        np.testing.assert_array_equal(
            np.asarray(_as_float(pages_out, case.dtype)), np.asarray(_as_float(pages, case.dtype))
        )
        return out, pages_out
    if case.kv_pages.dtype == jnp.uint8:  # uint16 pages are bf16 without being told
        kw["kv_dtype"] = str(case.dtype)
    return _run(case.q, case.k_new, case.v_new, case.kv_pages, case.meta, impl=impl, **kw)


def check_pages_written(case: Case, pages_out, k_scale=1.0, v_scale=1.0):
    """The new tokens read back from their slots; every other slot is bit-identical to before (NaN included)."""
    before, after = (np.asarray(_as_float(p, case.dtype)) for p in (case.kv_pages, pages_out))
    ps = before.shape[2]
    written = np.zeros(before.shape, bool)
    for s, sl in enumerate(case.slots):
        written[sl // ps, :, sl % ps] = True
        rows = after[sl // ps, :, sl % ps].astype(np.float64)  # [Q, 2K, H]
        ql = case.q_lens[s]
        np.testing.assert_array_equal(rows[:, 0::2] * k_scale, case.k_full[s][-ql:])
        np.testing.assert_array_equal(rows[:, 1::2] * v_scale, case.v_full[s][-ql:])
    np.testing.assert_array_equal(after[~written], before[~written])


def _as_float(pages, dtype) -> jax.Array:
    """Pages as float32, whether float or bit-stored."""
    if not jnp.issubdtype(pages.dtype, jnp.floating):
        pages = jax.lax.bitcast_convert_type(pages, dtype)
    return pages.astype(jnp.float32)


def _real_rows(case: Case) -> int:
    return sum(case.q_lens)


# ---------------------------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------------------------


def test_layout_helpers():
    lay = KVLayout(page_size=16, num_kv_heads=2, head_dim=128, dtype="fp8_e5m2")
    assert lay.shape(10) == (10, 4, 16, 128)
    assert lay.bytes_per_page() == bytes_per_page(16, 2, 128, "fp8_e5m2") == 4 * 16 * 128
    assert bytes_per_page(16, 2, 128, "bf16") == 2 * 4 * 16 * 128
    assert lay.alloc_pages(3).dtype == jnp.float8_e5m2
    assert lay.abstract(7).shape == (7, 4, 16, 128)
    assert lay.tile_aligned() is False  # an fp8 tile has 32 rows
    assert KVLayout(32, 2, 128, "fp8_e4m3").tile_aligned() is True
    with pytest.raises(ValueError, match="int8"):
        alloc_pages(2, 16, 1, 128, "int8")
    assert KVLayout(16, 1, 128, "bf16", bits=True).alloc_pages(2).dtype == jnp.uint16
    assert alloc_pages(2, 32, 1, 128, "fp8_e4m3", bits=True).dtype == jnp.uint8


def test_write_read_roundtrip_and_interleave():
    ps, nk, h = 8, 2, 64
    pages = alloc_pages(4, ps, nk, h, jnp.float32)
    rng = np.random.default_rng(1)
    k = rng.normal(size=(3, nk, h)).astype(np.float32)
    v = rng.normal(size=(3, nk, h)).astype(np.float32)
    slots = np.array([2 * ps + 5, -1, 3 * ps + 0])  # token 1 is padding: skipped
    out = write_kv(pages, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    o = np.asarray(out)
    np.testing.assert_array_equal(o[2, 0, 5], k[0, 0])  # row 2k = K head k
    np.testing.assert_array_equal(o[2, 1, 5], v[0, 0])  # row 2k+1 = V head k
    np.testing.assert_array_equal(o[2, 3, 5], v[0, 1])
    np.testing.assert_array_equal(o[3, 2, 0], k[2, 1])
    assert np.count_nonzero(o) == 2 * 2 * nk * h  # nothing else touched (token 1 dropped, not wrapped)
    rk, rv = read_kv(out, jnp.asarray(slots[[0, 2]]))
    np.testing.assert_array_equal(np.asarray(rk), k[[0, 2]])
    np.testing.assert_array_equal(np.asarray(rv), v[[0, 2]])


@pytest.mark.parametrize("dt", ["e5m2", "e4m3"])
def test_fp8_scale_and_saturation(dt):
    pages = alloc_pages(2, 4, 1, 32, DTYPES[dt])
    x = np.full((1, 1, 32), 3.0, np.float32)
    x[0, 0, 0] = 1e9  # saturates to the dtype's max instead of inf / NaN
    out = write_kv(pages, jnp.asarray(x), jnp.asarray(x), jnp.asarray([5]), k_scale=0.5, v_scale=2.0)
    k, v = read_kv(out, jnp.asarray([5]), k_scale=0.5, v_scale=2.0)
    fmax = float(jnp.finfo(DTYPES[dt]).max)
    assert float(k[0, 0, 0]) == fmax * 0.5 and float(v[0, 0, 0]) == fmax * 2.0
    np.testing.assert_allclose(np.asarray(k)[0, 0, 1:], 3.0, rtol=0.13)
    assert np.asarray(out.astype(jnp.float32))[1, 0, 1, 1] == 6.0  # stored = x / k_scale


# ---------------------------------------------------------------------------------------------------------------
# reference vs naive float64
# ---------------------------------------------------------------------------------------------------------------

# (cached, q_len): fresh prefills, cached prefix + chunk, decodes, a long decode; 109 KV positions at most.
MIXED = [(0, 7), (5, 1), (37, 19), (0, 1), (100, 1), (20, 33)]

REF_CASES = [
    # dt, G, K, H, window, soft_cap, q dtype, blocks (block_q, block_kv) or None for the defaults, bit-stored pages
    pytest.param("f32", 1, 2, 128, None, None, jnp.float32, None, False, id="f32-mha-h128"),
    pytest.param("f32", 2, 2, 64, 5, None, jnp.float32, (8, 32), False, id="f32-gqa2-h64-w5-in-page"),
    pytest.param("f32", 4, 1, 256, 40, 30.0, jnp.float32, (16, 16), False, id="f32-gqa4-h256-w40-softcap"),
    pytest.param("bf16", 8, 1, 128, 17, None, jnp.bfloat16, (4, 48), True, id="bf16bits-gqa8-w17-bf16q"),
    pytest.param("e5m2", 4, 2, 128, None, None, jnp.float32, (8, 32), False, id="e5m2-gqa4"),
    pytest.param("e4m3", 8, 1, 32, 24, None, jnp.float32, None, True, id="e4m3bits-gqa8-h32-w24"),
    pytest.param("bf16", 2, 1, 512, 33, None, jnp.float32, (32, 64), False, id="bf16-gqa2-h512-w33"),
]


@pytest.mark.parametrize("dt, g, nk, h, window, soft_cap, qdt, blocks, bits", REF_CASES)
def test_ref_matches_naive(dt, g, nk, h, window, soft_cap, qdt, blocks, bits):
    ks, vs = (0.5, 2.0) if dt in ("e5m2", "e4m3") else (1.0, 1.0)
    case = make_case(
        MIXED,
        n=g * nk,
        nk=nk,
        h=h,
        ps=16,
        dtype=DTYPES[dt],
        window=window,
        k_scale=ks,
        v_scale=vs,
        q_dtype=qdt,
        garbage_out_of_window_ids=g % 4 == 0,
        bits=bits,
        seed=g * 7 + h,
    )
    sm = h**-0.5
    bq, bkv = blocks or (None, None)
    out, pages = run(
        case,
        "ref",
        sm_scale=sm,
        sliding_window=window,
        soft_cap=soft_cap,
        k_scale=ks,
        v_scale=vs,
        block_q=bq,
        block_kv=bkv,
    )
    assert out.dtype == qdt and pages.dtype == case.kv_pages.dtype
    out = np.asarray(out.astype(jnp.float32))
    want = naive_attention(case, sm_scale=sm, window=window, soft_cap=soft_cap)
    t = _real_rows(case)
    tol = 2e-4 if qdt == jnp.float32 else 2e-2  # bf16 output rounding
    np.testing.assert_allclose(out[:t], want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(out[t:], 0.0)  # padding rows: zeros, not NaN
    check_pages_written(case, pages, ks, vs)


def test_ref_read_only_mode():
    """k_new = v_new = None: the pages come back untouched; queries attend over what the owner layer wrote."""
    case = make_case(MIXED, n=4, nk=2, h=128, ps=16, dtype=jnp.bfloat16, window=30, seed=5)
    out, _ = run(case, "ref", read_only=True, sliding_window=30, block_kv=32)
    want = naive_attention(case, window=30)
    np.testing.assert_allclose(np.asarray(out)[: _real_rows(case)], want, rtol=2e-4, atol=2e-4)


def test_oracle_and_ref_are_sensitive():
    """A wrong window or a wrong GQA head mapping changes the answer by far more than the tolerance."""
    case = make_case(MIXED, n=2, nk=2, h=128, ps=16, dtype=jnp.float32, seed=9)  # same shapes as f32-mha-h128
    out, _ = run(case, "ref")
    t = _real_rows(case)
    assert np.abs(np.asarray(out)[:t] - naive_attention(case, window=4)).max() > 0.1
    swapped = dataclasses.replace(case, k_full=[k[:, ::-1] for k in case.k_full])
    assert np.abs(np.asarray(out)[:t] - naive_attention(swapped)).max() > 0.1


def test_bad_arguments_name_the_value():
    case = make_case([(0, 2)], n=4, nk=2, h=128, ps=16, dtype=jnp.float32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ragged_paged_attention(case.q[:, :3], None, None, case.kv_pages, case.meta)
    with pytest.raises(ValueError, match="both be None"):
        ragged_paged_attention(case.q, case.k_new, None, case.kv_pages, case.meta)
    with pytest.raises(ValueError, match="impl"):
        ragged_paged_attention(case.q, None, None, case.kv_pages, case.meta, impl="cuda")
    bits = jax.lax.bitcast_convert_type(case.kv_pages.astype(jnp.bfloat16), jnp.uint16)
    with pytest.raises(ValueError, match="bit-stored: pass kv_dtype"):
        ragged_paged_attention(case.q, None, None, bits.astype(jnp.uint8), case.meta, impl="ref")
    with pytest.raises(ValueError, match="stored as uint8, but the pages are uint16"):
        ragged_paged_attention(case.q, None, None, bits, case.meta, impl="ref", kv_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kernel needs float pages"):
        ragged_paged_attention(case.q, None, None, bits, case.meta, impl="pallas", kv_dtype="bf16")
    big = dataclasses.replace(case.meta, page_indices=jnp.zeros((case.meta.kv_lens.shape[0], 300_000), jnp.int32))
    with pytest.raises(ValueError, match=r"page table \[S_max=3, P_max=300000\].*SMEM"):
        ragged_paged_attention(case.q, None, None, case.kv_pages, big, impl="pallas")


# ---------------------------------------------------------------------------------------------------------------
# Pallas kernel in TPU interpret mode (about 6 s each: lowering + compiling the interpreted program)
# ---------------------------------------------------------------------------------------------------------------

KERNEL_CASES = [
    # seqs, dt, G, K, H, page size, window, soft_cap, q dtype, read_only, block_q (tokens)
    # Rows of a q block = block_q * G; the decode row window (16 rows for G = 2..8) is used where it is smaller.
    pytest.param(MIXED, "f32", 2, 2, 128, 16, None, None, jnp.float32, False, 16, id="f32-mixed-gqa2"),
    pytest.param(
        [(40, 1), (0, 5), (100, 1), (31, 1), (9, 1)],
        "bf16",
        8,
        1,
        256,
        16,
        24,
        30.0,
        jnp.bfloat16,
        False,
        8,
        id="bf16-decodes-gqa8-w24-softcap",
    ),
    pytest.param([(3, 1), (70, 12), (33, 1)], "e5m2", 4, 1, 128, 32, 40, None, jnp.bfloat16, False, 8, id="e5m2-w40"),
    pytest.param([(15, 20), (64, 1)], "e4m3", 1, 2, 128, 32, None, None, jnp.float32, False, 8, id="e4m3-mha"),
    pytest.param(
        [(20, 1), (7, 9), (50, 3)], "f32", 2, 2, 64, 8, 8, None, jnp.float32, True, 8, id="f32-read-only-h64-ps8-w8"
    ),
]


@pytest.mark.parametrize("seqs, dt, g, nk, h, ps, window, soft_cap, qdt, read_only, block_q", KERNEL_CASES)
def test_kernel_interpret(seqs, dt, g, nk, h, ps, window, soft_cap, qdt, read_only, block_q):
    """Kernel vs the float64 oracle (the reference meets the same oracle above), with small blocks so that each
    sequence spans several KV blocks and q blocks hold several sequences; the first case also vs the reference."""
    ks, vs = (0.5, 2.0) if dt in ("e5m2", "e4m3") else (1.0, 1.0)
    case = make_case(
        seqs,
        n=g * nk,
        nk=nk,
        h=h,
        ps=ps,
        dtype=DTYPES[dt],
        window=window,
        k_scale=ks,
        v_scale=vs,
        q_dtype=qdt,
        garbage_out_of_window_ids=window is not None,
        seed=11,
    )
    kw = {
        "sm_scale": h**-0.5,
        "sliding_window": window,
        "soft_cap": soft_cap,
        "k_scale": ks,
        "v_scale": vs,
        "block_kv": 2 * ps,
    }
    out, pages = run(case, "pallas_interpret", read_only=read_only, block_q=block_q, **kw)
    t = _real_rows(case)
    got = np.asarray(out.astype(jnp.float32))
    # f32 runs the MXU in f32; otherwise q, K, V and the probabilities enter the matmuls in bf16.
    tol = 1e-4 if dt == "f32" and qdt == jnp.float32 else 3e-2
    want = naive_attention(case, sm_scale=h**-0.5, window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(got[:t], want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(got[t:], 0.0)
    if not read_only:
        check_pages_written(case, pages, ks, vs)
    if seqs is MIXED and not read_only:
        ref_out, ref_pages = run(case, "ref", **kw)
        np.testing.assert_allclose(got[:t], np.asarray(ref_out)[:t], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(pages), np.asarray(ref_pages))  # NaN where both are NaN


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("dt, window, bits", [("f32", None, False), ("bf16", 17, True), ("e4m3", 24, True)])
def test_ref_decode_only_form(dt, window, bits, read_only):
    """A decode_only RaggedMeta (token i is sequence i's one query; the engine's all-decode steps and KV-shared
    layers) gives what the naive oracle gives, writes the same slots, and zero rows for padding sequences."""
    seqs = [(0, 1), (30, 1), (7, 1), (64, 1), (15, 1)]
    ks, vs = (0.5, 2.0) if dt == "e4m3" else (1.0, 1.0)
    case = make_case(seqs, n=4, nk=2, h=64, ps=16, dtype=DTYPES[dt], window=window, t_pad=7, s_max=7,
                     k_scale=ks, v_scale=vs, garbage_out_of_window_ids=True, bits=bits, seed=3)
    case = dataclasses.replace(case, meta=dataclasses.replace(case.meta, decode_only=True))
    kw = {"kv_dtype": "fp8_e4m3"} if dt == "e4m3" else {}
    out, pages = run(case, "ref", read_only=read_only, sliding_window=window, k_scale=ks, v_scale=vs, block_kv=32,
                     **kw)
    out = np.asarray(out.astype(jnp.float32))
    want = naive_attention(case, window=window)
    np.testing.assert_allclose(out[:5], want, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(out[5:], 0.0)
    if not read_only:
        check_pages_written(case, pages, ks, vs)
    with pytest.raises(ValueError, match="decode_only"):
        bad = dataclasses.replace(case, q=case.q[:6], k_new=case.k_new[:6], v_new=case.v_new[:6])
        run(bad, "ref", sliding_window=window, k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("in_window", [True, False])
@pytest.mark.parametrize("window, block_q, marked", [(None, None, False), (6, 4, False), (24, None, False),
                                                     (6, 4, True), (None, None, True)])
def test_ref_bidirectional_blocks(window, block_q, in_window, marked):
    """Image blocks (block_lo / block_hi): a query inside a block also sees the block's keys; Gemma 4's rule keeps
    the sliding window on them (AND(window, OR(causal, block))), the 12B's does not (OR(AND(causal, window),
    block)); tokens outside any block stay causal. Against the dense oracle with the same mask, and the causal
    result differs (the mask matters). marked: every sequence is marked for decode rows (RaggedMeta.by_row, room
    for all their tokens); the ones holding a block still take the chunk path, which sees the block."""
    seqs = [(5, 14), (0, 9), (3, 1)]              # (cached, new): the third is a decode row
    case = make_case(seqs, n=4, nk=2, h=32, ps=8, dtype=jnp.float32, window=None, seed=3)
    blocks = {0: (8, 16), 1: (2, 5)}             # absolute positions [a, b] of one block per prefill sequence
    t_pad = case.q.shape[0]
    lo, hi, t0 = np.full(t_pad, 1 << 30, np.int32), np.full(t_pad, -1, np.int32), 0
    for s_, (cached, ql) in enumerate(seqs):
        a, b = blocks.get(s_, (-1, -2))
        for i in range(ql):
            if a <= cached + i <= b:
                lo[t0 + i], hi[t0 + i] = a, b
        t0 += ql
    meta = dataclasses.replace(case.meta, block_lo=jnp.asarray(lo), block_hi=jnp.asarray(hi),
                               block_in_window=in_window)
    if marked:
        meta = dataclasses.replace(meta, by_row=jnp.ones(case.meta.kv_lens.shape, bool), row_q_max=16)
    out, _ = _run(case.q, case.k_new, case.v_new, case.kv_pages, meta, impl="ref", sliding_window=window,
                  block_q=block_q)
    q = np.asarray(case.q, np.float64)
    want, t0 = [], 0
    for s_, (cached, ql) in enumerate(seqs):
        kv_len = cached + ql
        k, v = np.repeat(case.k_full[s_], 2, axis=1), np.repeat(case.v_full[s_], 2, axis=1)
        qpos, kpos = (cached + np.arange(ql))[:, None], np.arange(kv_len)[None]
        blk = (kpos >= lo[t0:t0 + ql, None]) & (kpos <= hi[t0:t0 + ql, None])
        win = (qpos - kpos < window) if window is not None else True
        mask = ((kpos <= qpos) | blk) & win if in_window else ((kpos <= qpos) & win) | blk
        sc = np.where(mask[None], np.einsum("qnh,lnh->nql", q[t0:t0 + ql], k), -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        want.append(np.einsum("nql,lnh->qnh", p / p.sum(-1, keepdims=True), v))
        t0 += ql
    want = np.concatenate(want)
    np.testing.assert_allclose(np.asarray(out)[:t0], want, rtol=2e-4, atol=2e-4)
    causal, _ = _run(case.q, case.k_new, case.v_new, case.kv_pages, case.meta, impl="ref", sliding_window=window,
                     block_q=block_q)
    assert np.abs(np.asarray(causal)[:t0] - want).max() > 1e-2
    assert kernel_supports(case.kv_pages, case.q, meta) is not None   # the kernel does not take it: reference


@pytest.mark.parametrize("items", [1, 3, 32])
def test_ref_prefill_items_batching(items):
    """Prefill chunks batched `items` per loop iteration (a count that does not divide the chunks, and one larger
    than all of them) give the naive attention, with a window that cuts some chunks' ranges and not others."""
    case = make_case(MIXED, n=4, nk=2, h=64, ps=16, dtype=jnp.float32, window=20, seed=11)
    fn = jax.jit(functools.partial(ragged_paged_attention_ref, sm_scale=0.125, sliding_window=20, block_q=4,
                                   block_kv=16, prefill_items=items))
    out, _ = fn(case.q, case.k_new, case.v_new, case.kv_pages, case.meta)
    want = naive_attention(case, sm_scale=0.125, window=20)
    t = _real_rows(case)
    np.testing.assert_allclose(np.asarray(out)[:t], want, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(np.asarray(out)[t:], 0.0)


@pytest.mark.parametrize("seqs, want_bkv", [
    ([(0, 7), (0, 24), (3, 5), (0, 1), (40, 18)], 32),    # 55 tokens (58 padded) over 7 sequence slots
    ([(0, 100), (10, 80), (0, 1)], 64),                  # 181 tokens (184 padded) over 5 slots
])
def test_ref_default_prefill_block_follows_tokens_per_sequence(monkeypatch, seqs, want_bkv):
    """With no block_kv given, prefill chunks take 32-token KV blocks when the step averages at most 32 tokens a
    sequence slot and 64 otherwise (`_prefill_block_kv`), and either gives the naive attention (windowed, a cached
    prefix, a decode row beside the chunks)."""
    import gemmajax.kv.attention as attn
    assert [attn._prefill_block_kv(t, s) for t, s in ((512, 16), (513, 16), (32, 1), (33, 1))] == [32, 64, 32, 64]
    seen = []
    chunks = attn._ref_prefill_chunks

    def spy(*a, block_kv, **kw):
        seen.append(block_kv)
        return chunks(*a, block_kv=block_kv, **kw)
    monkeypatch.setattr(attn, "_ref_prefill_chunks", spy)
    case = make_case(seqs, n=4, nk=2, h=64, ps=16, dtype=jnp.float32, window=40, seed=len(seqs))
    fn = jax.jit(functools.partial(ragged_paged_attention_ref, sm_scale=0.125, sliding_window=40))
    out, _ = fn(case.q, case.k_new, case.v_new, case.kv_pages, case.meta)
    assert seen == [want_bkv]
    want = naive_attention(case, sm_scale=0.125, window=40)
    t = _real_rows(case)
    np.testing.assert_allclose(np.asarray(out)[:t], want, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(np.asarray(out)[t:], 0.0)


def _verify_draws(n: int, seed: int) -> list[dict]:
    """Random verification steps: KV dtype and storage, heads, head size, page size, window, soft cap, k, and per
    sequence a cached length and 0..k drafts (so 1..1 + k tokens, some sequences with none)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        dt = str(rng.choice(["f32", "bf16", "e5m2", "e4m3"]))
        k = int(rng.integers(1, 6))
        seqs = [(int(rng.integers(0, 120)), 1 + int(rng.integers(0, k + 1))) for _ in range(int(rng.integers(1, 5)))]
        out.append({"dt": dt, "bits": dt != "f32" and bool(rng.integers(2)), "g": int(rng.choice([1, 2, 4, 8])),
                    "nk": int(rng.choice([1, 2])), "h": int(rng.choice([32, 64, 128, 256])),
                    "ps": int(rng.choice([8, 16])), "window": [None, int(rng.integers(3, 70))][int(rng.integers(2))],
                    "soft_cap": [None, 30.0][int(rng.integers(2))], "k": k, "seqs": seqs,
                    "s_max": len(seqs) + int(rng.integers(0, 3)), "seed": int(rng.integers(1 << 16))})
    return out


@pytest.mark.parametrize("d", _verify_draws(10, seed=2026), ids=lambda d: f"{d['dt']}-h{d['h']}-k{d['k']}")
def test_ref_verification_rows_have_decode_bits(d):
    """A speculative verification (sequences of 1 + k tokens marked in RaggedMeta.by_row) gives every token the
    exact bits a one-token step of the same sequence slots gives it (decode_only, S_max rows), and what the naive
    oracle gives. The engine's plain decoding equals speculative decoding through this (seeded sampling included);
    the prefill-chunk form of the same tokens differed in the last bits on XLA:CPU."""
    ks, vs = (0.5, 2.0) if d["dt"] in ("e5m2", "e4m3") else (1.0, 1.0)
    case = make_case(d["seqs"], n=d["g"] * d["nk"], nk=d["nk"], h=d["h"], ps=d["ps"], dtype=DTYPES[d["dt"]],
                     window=d["window"], s_max=d["s_max"], bits=d["bits"], seed=d["seed"], k_scale=ks, v_scale=vs,
                     t_pad=sum(q for _, q in d["seqs"]) + 5)
    kw = {"sm_scale": d["h"] ** -0.5, "sliding_window": d["window"], "soft_cap": d["soft_cap"], "k_scale": ks,
          "v_scale": vs}
    if case.kv_pages.dtype == jnp.uint8:
        kw["kv_dtype"] = str(case.dtype)
    marks = np.zeros(d["s_max"], bool)
    marks[:len(d["seqs"])] = [q > 1 for _, q in d["seqs"]]
    meta = dataclasses.replace(case.meta, by_row=jnp.asarray(marks), row_q_max=1 + d["k"])
    out, pages = _run(case.q, case.k_new, case.v_new, case.kv_pages, meta, impl="ref", **kw)
    out = np.asarray(out)
    t = _real_rows(case)
    np.testing.assert_allclose(out[:t], naive_attention(case, sm_scale=kw["sm_scale"], window=d["window"],
                                                        soft_cap=d["soft_cap"]), rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(out[t:], 0.0)
    check_pages_written(case, pages, ks, vs)
    # token j of every sequence that has one, as the one query of a decode step over the same S_max slots
    firsts = np.cumsum([0] + [q for _, q in d["seqs"]])
    compared = 0
    for j in range(1 + d["k"]):
        live = [s for s, (_, q) in enumerate(d["seqs"]) if q > j]
        if not live:
            break
        tables = [np.asarray(case.meta.page_indices[s]) for s in live]
        dec = make_ragged_meta([1] * len(live), [d["seqs"][s][0] + j + 1 for s in live], tables,
                               max_num_seqs=d["s_max"], pages_per_seq=case.meta.page_indices.shape[1])
        dec = dataclasses.replace(dec, decode_only=True)
        q = np.zeros((d["s_max"],) + case.q.shape[1:], np.float32)
        q[:len(live)] = np.asarray(case.q)[[firsts[s] + j for s in live]]
        got, _ = _run_read_only(jnp.asarray(q), pages, dec, impl="ref", **kw)
        np.testing.assert_array_equal(np.asarray(got)[:len(live)], out[[firsts[s] + j for s in live]],
                                      err_msg=f"token {j} of sequences {live}")
        compared += len(live)
    assert compared == t
