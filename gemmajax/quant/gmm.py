"""Grouped expert matmul (megablox-style gmm): rows sorted by expert, each multiplied by its own expert's weight,
reading only the experts that have rows, in place (int8 / int4 QuantArrays stay packed; nothing dequantizes a stack).

Design choices:
- One call: x [M, K] (rows sorted by expert), an expert stack w [E, N, K] in Hugging Face's [out, in] layout (plain,
  int8 or int4 QuantArray: array.py) and group_sizes [E] (rows per expert, in order; their sum may be < M: the rows
  past it are padding, anything, NaN included, and come out as zeros). Row r of the result is the 2-D matmul of the
  QuantArray's kind (int8_matmul.py w8a8: int8 activations per token or per token per act_group columns; int4_matmul.py
  w4a16: activations in the model's dtype, weights bf16(level * scale)) of row r with its expert: `gmm_ref` says
  exactly that, expert by expert, with the 2-D references.
- Pallas TPU kernel: the rows are cut into tiles of tm; a work item is a (row tile, expert) pair that shares rows,
  in expert order, so an expert whose rows span tiles has consecutive items and one tile may hold several experts.
  The items (`GroupMetadata`, scalar-prefetched into SMEM) drive the index maps: each item DMAs its expert's weight
  block into VMEM (a block index that does not change between grid steps is not fetched again: an expert spanning
  tiles is read once per N block), dequantizes it in VMEM (int4: the tile transposed so groups run along sublanes,
  as int4_matmul does) and accumulates in float32 (int8: int32 per activation group), then stores only its own rows
  of the output tile. Tiles past the rows' end get a "padding" item that stores zeros; grid slots past the last item
  repeat its block indices (no DMA) and compute nothing. So the weights read are the routed experts' blocks only.
  Blocks are large (whole K and N up to a few MiB of weights) so that a decode step has about one grid step per
  routed expert; int4 dequantizes a block in column chunks to bound its VMEM temporaries.
- XLA path (CPU, GPU): a loop over the same kind of work items, each calling the 2-D XLA forms of int8_matmul.py /
  int4_matmul.py (the measured CPU forms) on one expert taken by a dynamic index: no stack is dequantized, no routed
  weight is gathered into a copy. Measured on the CPU (2 shared cores, load 4-9, jax 0.10.2, Gemma 4 26B-A4B expert
  shapes E 128, gate_up in 2816 x out 1408; /tmp prototypes, ms per call, min of 5 round-robin calls):

  | rows M (tokens x 8) | int8 w8a8 rows / C=2 / C=8 / C=32 | int4 rows / C=4 / C=8 / C=32 | dense, same bytes   |
  |---------------------|-----------------------------------|------------------------------|---------------------|
  | 8 (1 token)         | **1.35** / 4.4 / - / -            | **3.8** (unrolled) / 78 / 136 | int8 1.44, int4 3.5 |
  | 128 (16 tokens)     | **27** / 66 / - / -               | **166** / 316 / 403 / 332     | int8 101, int4 2027 |
  | 1024 (128 tokens)   | 430 / - / **247** / 287           | 991 / 889 / 683 / **671**    |                     |

  ("rows": one item per row, XLA:CPU's one-row fusion reading the expert at memory speed, consecutive rows of one
  expert hitting the cache; C = n: items of n rows through the 2-D forms' "int" / "bf16" GEMMs; dense: one 2-D
  matmul over the routed experts' weights as one matrix, at 1 and 16 rows.) Hence "rows" while M <= 2 E (about
  one row per routed expert), unrolled up to 32 rows (a while loop costs 1.5-3x at 8 rows), else items of 8 rows.
  Each item reads its expert in place (`_expert`: XLA:CPU would otherwise widen a bf16 stack or int4 scale stack
  to float32 whole, outside the loop: 50 ms instead of 5 at 8 rows). GPUs take items of 64 rows (few loop
  iterations; not measured there).
  Plain (bf16 / float32) stacks on TPU and GPU go through lax.ragged_dot in the orientation XLA:TPU lays the
  stack out (`gmm_ragged`: no relayout copy); `jax.lax.ragged_dot` on the CPU computes every expert for every row
  (a dense [E, M, K] copy of x), so plain stacks take the item loop there too.
- impl="auto" is decided at lowering time (lax.platform_dependent), as in int8_matmul / int4_matmul.

Letters: M rows (tokens x top-k, sorted by expert), K in, N out, E experts, I work items.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gemmajax.quant.array import QuantArray
from gemmajax.quant.int4_matmul import (
    _compute_dtype,
    _dequant_t,
    _precision,
    int4_matmul_cpu,
    int4_matmul_gpu,
    int4_matmul_ref,
)
from gemmajax.quant.int8_matmul import (
    WIDE_MIN_ROWS,
    after_init,
    int8_matmul_cpu,
    int8_matmul_ref,
    int8_matmul_xla,
    materialize,
    quantize_activations,
)
from gemmajax.quant.ops import dense_matmul, dense_matmul_cpu
from gemmajax.quant.sharded import gmm_tp

Weight = Any  # jax.Array [E, N, K] | QuantArray [E, N, K]
_UNROLL_ROWS = 32  # CPU "rows" form: unrolled up to this many rows, a while loop beyond (module docstring)
_CPU_TILE = 8  # CPU rows per work item beyond "rows"
_GPU_TILE = 64  # GPU rows per work item (few iterations; not measured)


def _check(x: jax.Array, w: Weight, group_sizes: jax.Array, who: str) -> None:
    if x.ndim != 2:
        raise ValueError(f"{who}: x must be [M, K] (rows sorted by expert), got shape {x.shape}")
    if len(w.shape) != 3:
        raise ValueError(f"{who}: w must be an expert stack [E, N, K], got shape {tuple(w.shape)}")
    if x.shape[1] != w.shape[2]:
        raise ValueError(f"{who}: x has {x.shape[1]} features, the experts {tuple(w.shape)} expect {w.shape[2]}")
    if tuple(group_sizes.shape) != (w.shape[0],):
        raise ValueError(f"{who}: group_sizes must be [E] = [{w.shape[0]}] (rows per expert), got shape "
                         f"{tuple(group_sizes.shape)}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{who}: group_sizes must be integers, got {group_sizes.dtype}")


def _row_groups(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """(group of each row int32 [M] (E for rows past the groups' end), rows in groups int32 [])."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    g = jnp.sum(ends[None, :] <= jnp.arange(m, dtype=jnp.int32)[:, None], axis=1, dtype=jnp.int32)
    return g, ends[-1]


# --- reference ------------------------------------------------------------------------------------------------------
def _dense_ref(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w[N, K].T with float32 accumulation at HIGHEST precision, in x.dtype."""
    y = jnp.dot(x, w.astype(x.dtype).T, preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def gmm_ref(x: jax.Array, w: Weight, group_sizes: jax.Array) -> jax.Array:
    """Grouped matmul reference in jnp: expert by expert, the 2-D reference of w's kind on all rows, kept where the
    rows belong to that expert.

    x [M, K] float, rows sorted by expert; w [E, N, K] plain or QuantArray; group_sizes int [E] (sum <= M).
    Returns [M, N] in x.dtype: row r = matmul(x[r], w[e_r]) for the expert e_r whose rows hold r (int8: w8a8,
    int8_matmul_ref; int4: w4a16, int4_matmul_ref; plain: float32-accumulated dot), 0 for rows past the groups.
    """
    _check(x, w, group_sizes, "gmm_ref")
    m, n = x.shape[0], w.shape[1]
    rows, _ = _row_groups(group_sizes, m)
    y = jnp.zeros((m, n), x.dtype)
    for e in range(w.shape[0]):
        if isinstance(w, QuantArray):
            ye = (int8_matmul_ref if w.kind == "int8" else int4_matmul_ref)(x, w[e])
        else:
            ye = _dense_ref(x, w[e])
        y = jnp.where((rows == e)[:, None], ye, y)
    return y


# --- Pallas TPU kernel ----------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupMetadata:
    """The kernel's work items (scalar-prefetched), built on device from group_sizes by `group_metadata`.

    Item i multiplies row tile mids[i] by expert gids[i] (E = the padding group: rows past the groups' end, stored
    as zeros). Items run in expert order, so row tiles never decrease; slots i >= num_items repeat the last item's
    tile with gids E and compute nothing.
    """

    offsets: jax.Array  # int32 [E + 2]: first row of each group (E = padding group), then the padded row count
    gids: jax.Array  # int32 [I]: the item's group (E: padding group, or an unused slot)
    mids: jax.Array  # int32 [I]: the item's row tile
    wgids: jax.Array  # int32 [I]: expert whose weight block the item's index map names: its own, or (padding
    #                   items and unused slots) the last routed expert's, whose block is already in VMEM
    num_items: jax.Array  # int32 [1]


def max_items(m_padded: int, tm: int, num_experts: int) -> int:
    """Static bound on work items: row tiles + experts (each group adds at most one tile boundary it shares)."""
    return m_padded // tm + num_experts


def group_metadata(group_sizes: jax.Array, m_padded: int, tm: int) -> GroupMetadata:
    """Work items of the kernel for rows [0, m_padded) cut into tiles of tm (see GroupMetadata). jnp, on device."""
    e = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    total = jnp.sum(sizes)
    ext = jnp.concatenate([sizes, (m_padded - total)[None]])  # [E + 1]: the padding group last
    ends = jnp.cumsum(ext)
    starts = ends - ext
    first = starts // tm
    tiles = jnp.where(ext > 0, (ends - 1) // tm - first + 1, 0)  # row tiles each group touches
    cum = jnp.cumsum(tiles)
    n_items = cum[-1]
    i = jnp.arange(max_items(m_padded, tm, e), dtype=jnp.int32)
    g = jnp.minimum(jnp.sum(cum[None, :] <= i[:, None], axis=1, dtype=jnp.int32), e)
    mids = first[g] + i - (cum - tiles)[g]
    last = jnp.maximum(n_items - 1, 0)
    active = i < n_items
    mids = jnp.where(active, mids, mids[last])
    gids = jnp.where(active, g, e)
    routed = jnp.arange(e, dtype=jnp.int32)
    hold = jnp.max(jnp.where(sizes > 0, routed, 0))  # the last routed expert: its block stays in VMEM
    wgids = jnp.where(gids < e, gids, hold)
    offsets = jnp.concatenate([starts, jnp.asarray([m_padded], jnp.int32)])
    return GroupMetadata(offsets.astype(jnp.int32), gids.astype(jnp.int32), mids.astype(jnp.int32),
                         wgids.astype(jnp.int32), n_items.astype(jnp.int32)[None])


def _store(o_ref, y, i, g, mids_ref, offs_ref, tm: int, cols=slice(None)) -> None:
    """Write item i's rows (those of group g in its tile) of y [tm, cols] into the output tile, keeping the others.
    Every row of a tile belongs to exactly one item of that tile (the padding group takes the rows past the groups'
    end), so what the tile's buffer held before its first item is overwritten row by row before it is written back."""
    rows = mids_ref[i] * tm + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    mine = (rows >= offs_ref[g]) & (rows < offs_ref[g + 1])
    o_ref[:, cols] = jnp.where(mine, y, o_ref[:, cols].astype(jnp.float32)).astype(o_ref.dtype)


def _gmm_int8_kernel(offs_ref, gids_ref, mids_ref, wgids_ref, nitems_ref, xq_ref, xs_ref, w_ref, ws_ref, o_ref,
                     *scratch, nk: int, ag: int, tm: int, num_experts: int):
    """One (j, i, k) step: N block j, item i, K block k. xq [tm, tk] int8; xs [tm, 1] f32 (per token) or
    [tm, tk // ag] (this K block's group scales); w [tn, tk] int8 of expert wgids[i]; ws [1, tn] f32; o [tm, tn]."""
    i, k = pl.program_id(1), pl.program_id(2)
    g = gids_ref[i]
    active = i < nitems_ref[0]
    routed = active & (g < num_experts)

    def partial_product():
        if not ag:
            return lax.dot_general(xq_ref[...], w_ref[...], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.int32)
        acc = None
        for s in range(xq_ref.shape[1] // ag):  # one int32 partial per activation group, scaled into float32
            p = lax.dot_general(xq_ref[:, s * ag:(s + 1) * ag], w_ref[:, s * ag:(s + 1) * ag], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.int32)
            t = p.astype(jnp.float32) * xs_ref[:, s:s + 1]
            acc = t if acc is None else acc + t
        return acc

    def finish(acc):
        y = acc.astype(jnp.float32) * (1.0 if ag else xs_ref[...]) * ws_ref[...]
        _store(o_ref, y, i, g, mids_ref, offs_ref, tm)

    @pl.when(routed)
    def _():
        part = partial_product()
        if nk == 1:
            finish(part)
            return
        (acc_ref,) = scratch
        _accumulate(acc_ref, part, k)

        @pl.when(k == nk - 1)
        def _():
            finish(acc_ref[...])

    @pl.when(active & (g == num_experts) & (k == nk - 1))
    def _():  # the padding group: zeros for rows past the groups' end
        _store(o_ref, jnp.zeros(o_ref.shape, jnp.float32), i, g, mids_ref, offs_ref, tm)


def _accumulate(acc_ref, part, k, cols=slice(None)) -> None:
    """acc[:, cols] = part at the first K block, += part after."""
    @pl.when(k == 0)
    def _():
        acc_ref[:, cols] = part

    @pl.when(k > 0)
    def _():
        acc_ref[:, cols] += part


def _gmm_int4_kernel(offs_ref, gids_ref, mids_ref, wgids_ref, nitems_ref, xl_ref, xh_ref, w_ref, s_ref, o_ref, st_ref,
                     *scratch, nk: int, group: int, sub: int, tm: int, num_experts: int):
    """One (j, i, k) step. xl / xh [tm, tkp] (compute dtype): columns k*tkp.. of the low / high half of x; w [tn, tkp]
    uint8 of expert wgids[i]; s [tn, G] its scales (whole rows); o [tm, tn]; st [2, G / 2, tn] f32 scratch: the scales
    transposed (once per item). The block is dequantized and multiplied in column chunks of `sub` (static)."""
    i, k = pl.program_id(1), pl.program_id(2)
    g = gids_ref[i]
    active = i < nitems_ref[0]
    routed = active & (g < num_experts)
    g2 = st_ref.shape[1]
    tkp = w_ref.shape[1]
    gk = tkp // group
    cd = jnp.dtype(xl_ref.dtype)
    prec = _precision(cd)

    @pl.when(routed & (k == 0))
    def _():
        s = s_ref[...].astype(jnp.float32)
        st_ref[0] = s[:, :g2].T
        st_ref[1] = s[:, g2:].T

    @pl.when(routed)
    def _():
        for c in range(w_ref.shape[0] // sub):  # static column chunks of the N block
            cols = slice(c * sub, (c + 1) * sub)
            if nk == 1:
                s_lo, s_hi = st_ref[0, :, cols], st_ref[1, :, cols]
            else:
                start = pl.multiple_of(k * gk, gk)
                s_lo, s_hi = st_ref[0, pl.ds(start, gk), cols], st_ref[1, pl.ds(start, gk), cols]
            wt = w_ref[cols, :].astype(jnp.int32).T  # [tkp, sub]: groups along sublanes
            lo = _dequant_t(wt & 15, s_lo, group, cd)
            hi = _dequant_t(wt >> 4, s_hi, group, cd)
            part = (jnp.dot(xl_ref[...], lo, preferred_element_type=jnp.float32, precision=prec)
                    + jnp.dot(xh_ref[...], hi, preferred_element_type=jnp.float32, precision=prec))
            if nk == 1:
                _store(o_ref, part, i, g, mids_ref, offs_ref, tm, cols)
            else:
                _accumulate(scratch[0], part, k, cols)

        if nk > 1:
            @pl.when(k == nk - 1)
            def _():
                _store(o_ref, scratch[0][...], i, g, mids_ref, offs_ref, tm)

    @pl.when(active & (g == num_experts) & (k == nk - 1))
    def _():
        _store(o_ref, jnp.zeros(o_ref.shape, jnp.float32), i, g, mids_ref, offs_ref, tm)


def _divisor(n: int, step: int, limit: int) -> int:
    """Largest multiple of `step` dividing n and at most `limit`; n itself when n <= limit or none exists."""
    if n <= limit:
        return n
    return next((t for t in range(limit // step * step, step - 1, -step) if n % t == 0), n)


_INT8_BLOCK_BYTES = 4 << 20  # weight bytes per block: 26B-A4B's gate_up (1408 x 2816) and down in one block each
_INT4_BLOCK_BYTES = 2 << 20
_INT4_CHUNK_ELEMS = 1 << 18  # dequantized elements per in-kernel chunk (bounds the VMEM temporaries)


def row_tile(m: int) -> int:
    """The kernel's row tile for m rows: m padded to 32 up to 128 (one tile), else 128."""
    return -(-m // 32) * 32 if m <= 128 else 128


def gmm_blocks(m: int, w: QuantArray) -> tuple[int, int, int, int]:
    """(tm, tn, tk, m_padded) for x [m, K] against the stack w. tk counts bytes of a row for int4 (a half's columns).

    tm: rows padded to 32 up to 128 (one tile: a decode step reads each routed expert once), else 128. tk: the whole
    K (one block, so an expert spanning row tiles keeps its block) unless 128 rows of it exceed the block budget;
    then a multiple of 128 (int8 with act_group: of lcm(act_group, 128), at most 32 groups; int4: 8 groups) dividing
    it. tn: the whole N within the budget, else a multiple of 128 dividing it."""
    tm = row_tile(m)
    mp = -(-m // tm) * tm
    n = w.padded_out
    if w.kind == "int8":
        k, ag = w.padded_in, w.act_group
        step = math.lcm(ag, 128) if ag else 128
        tk = _divisor(k, step, min(_INT8_BLOCK_BYTES // 128, 32 * ag if ag else 1 << 30))
        tn = _divisor(n, 128, max(128, _INT8_BLOCK_BYTES // tk))
    else:
        half = w.padded_in // 2
        step = math.lcm(128, 8 * w.group)  # a K block of a half: lane-aligned, a multiple of 8 groups
        tk = _divisor(half, step, _INT4_BLOCK_BYTES // 128)
        tn = _divisor(n, 128, max(128, _INT4_BLOCK_BYTES // tk))
    return tm, tn, tk, mp


def _int4_chunk(tn: int, tkp: int) -> int:
    """Columns of an int4 N block dequantized at a time: the largest of 512 / 256 / 128 dividing tn within
    _INT4_CHUNK_ELEMS, or the whole block when it is not lane-aligned."""
    if tn % 128:
        return tn
    return next((c for c in (512, 256, 128) if tn % c == 0 and c * tkp <= _INT4_CHUNK_ELEMS), 128)


def _pad_cols(x: jax.Array, k: int) -> jax.Array:
    return x if x.shape[1] == k else jnp.pad(x, ((0, 0), (0, k - x.shape[1])))


def gmm_pallas(x: jax.Array, w: QuantArray, group_sizes: jax.Array, *, interpret=False,
               blocks: tuple[int, int, int] | None = None) -> jax.Array:
    """Pallas TPU grouped matmul. x [M, K] float (rows sorted by expert), w int8 / int4 QuantArray [E, N, K],
    group_sizes int [E] -> [M, N] in x.dtype (rows past the groups' end: 0). Same numbers as gmm_ref.

    interpret: False (compile for TPU) | True | pltpu.InterpretParams(...). blocks: optional (tm, tn, tk) override
    (tm a multiple of 32; tn of 128 dividing N or N; tk as gmm_blocks: int8 columns, int4 bytes of a half)."""
    _check(x, w, group_sizes, "gmm_pallas")
    if not isinstance(w, QuantArray):
        raise TypeError(f"gmm_pallas: the kernel takes int8 / int4 QuantArray experts, got a plain {w.dtype} stack "
                        f"{tuple(w.shape)}; plain stacks go through lax.ragged_dot_general (gmm impl 'auto' / 'xla')")
    m = x.shape[0]
    e, n = w.shape[0], w.padded_out
    tm, tn, tk, mp = gmm_blocks(m, w)
    if blocks is not None:
        tm, tn, tk = blocks
        mp = -(-m // tm) * tm
        kdim = w.padded_in if w.kind == "int8" else w.padded_in // 2
        if tm % 32 or n % tn or (tn % 128 and tn != n) or kdim % tk or (tk % 128 and tk != kdim):
            raise ValueError(f"gmm_pallas: blocks {blocks} do not tile x [{m}, {w.padded_in}] against experts "
                             f"[{e}, {n}, {kdim}{' bytes' if w.kind == 'int4' else ''}] (tm % 32; tn | {n}, tn % 128; "
                             f"tk | {kdim}, tk % 128; or the whole dimension)")
    meta = group_metadata(group_sizes, mp, tm)
    n_items = meta.gids.shape[0]
    out_dtype = x.dtype
    ob = jnp.dtype(out_dtype).itemsize
    prefetch = (meta.offsets, meta.gids, meta.mids, meta.wgids, meta.num_items)

    def k_eff(i, k, gids, nitems):  # padding items and unused slots keep the last K block: no new DMA
        return jnp.where((i < nitems[0]) & (gids[i] < e), k, nk - 1)

    if w.kind == "int8":
        k_all, ag = w.padded_in, w.act_group
        nk = k_all // tk
        if ag and tk % ag:
            raise ValueError(f"gmm_pallas: tk {tk} must hold whole activation groups of {ag}")
        xq, xs = quantize_activations(_pad_cols(x, k_all), ag, w.act_axis)
        if mp != m:
            xq, xs = jnp.pad(xq, ((0, mp - m), (0, 0))), jnp.pad(xs, ((0, mp - m), (0, 0)))
        if ag:  # one K block's group scales as a block whose last dim is the array's own (any width)
            xs = xs.reshape(mp, nk, tk // ag).transpose(1, 0, 2)
            xs_spec = pl.BlockSpec((None, tm, tk // ag),
                                   lambda j, i, k, offs, gids, mids, wg, ni: (k_eff(i, k, gids, ni), mids[i], 0))
        else:
            xs_spec = pl.BlockSpec((tm, 1), lambda j, i, k, offs, gids, mids, wg, ni: (mids[i], 0))
        in_specs = [
            pl.BlockSpec((tm, tk), lambda j, i, k, offs, gids, mids, wg, ni: (mids[i], k_eff(i, k, gids, ni))),
            xs_spec,
            pl.BlockSpec((None, tn, tk), lambda j, i, k, offs, gids, mids, wg, ni: (wg[i], j, k_eff(i, k, gids, ni))),
            pl.BlockSpec((None, 1, tn), lambda j, i, k, offs, gids, mids, wg, ni: (wg[i], 0, j)),
        ]
        args = (xq, xs, w.values, w.scale.astype(jnp.float32).reshape(e, 1, n))
        kernel = functools.partial(_gmm_int8_kernel, nk=nk, ag=ag, tm=tm, num_experts=e)
        scratch = [pltpu.VMEM((tm, tn), jnp.float32 if ag else jnp.int32)] if nk > 1 else []
        vmem = 2 * (tm * tk + tn * tk + tm * tn * ob + tm * 128 * 4 + 8 * tn * 4) + 4 * tm * tn * 4
        flops, wbytes, xbytes = 2 * m * n * k_all, w.values.size // e, xq.size + xs.size * 4
    else:
        half, group = w.padded_in // 2, w.group
        gs = w.padded_in // group
        nk = half // tk
        if tk != half and (tk // group) % 8:
            raise ValueError(f"gmm_pallas: int4 tk {tk} must hold a multiple of 8 groups of {group}")
        x2 = _pad_cols(x.astype(_compute_dtype(x)), w.padded_in)
        if mp != m:
            x2 = jnp.pad(x2, ((0, mp - m), (0, 0)))
        if tk % 128 == 0:  # both halves are blocks of the one x array
            xs_args = (x2, x2)
            x_specs = [
                pl.BlockSpec((tm, tk), lambda j, i, k, offs, gids, mids, wg, ni: (mids[i], k_eff(i, k, gids, ni))),
                pl.BlockSpec((tm, tk), lambda j, i, k, offs, gids, mids, wg, ni: (mids[i],
                                                                                  k_eff(i, k, gids, ni) + nk)),
            ]
        else:  # a half that is not lane-aligned: split x (a copy of the activations only)
            xs_args = (x2[:, :half], x2[:, half:])
            x_specs = [pl.BlockSpec((tm, tk), lambda j, i, k, offs, gids, mids, wg, ni: (
                mids[i], k_eff(i, k, gids, ni)))] * 2
        in_specs = x_specs + [
            pl.BlockSpec((None, tn, tk), lambda j, i, k, offs, gids, mids, wg, ni: (wg[i], j, k_eff(i, k, gids, ni))),
            pl.BlockSpec((None, tn, gs), lambda j, i, k, offs, gids, mids, wg, ni: (wg[i], j, 0)),
        ]
        args = (*xs_args, w.values, w.scale)
        sub = _int4_chunk(tn, tk)
        kernel = functools.partial(_gmm_int4_kernel, nk=nk, group=group, sub=sub, tm=tm, num_experts=e)
        scratch = [pltpu.VMEM((2, gs // 2, tn), jnp.float32)] + ([pltpu.VMEM((tm, tn), jnp.float32)] if nk > 1 else [])
        xb, sb = jnp.dtype(x2.dtype).itemsize, jnp.dtype(w.scale.dtype).itemsize
        vmem = (2 * (2 * tm * tk * xb + tn * tk + tn * max(gs, 128) * sb + tm * tn * ob) + gs * tn * 4
                + (tm * tn * 4 if nk > 1 else 0) + 6 * tk * sub * 4 + 2 * tm * sub * 4)
        flops, wbytes, xbytes = 2 * m * n * w.padded_in, (w.values.size + w.scale.size * sb) // e, x2.size * xb
    out_spec = pl.BlockSpec((tm, tn), lambda j, i, k, offs, gids, mids, wg, ni: (mids[i], j))
    routed = min(e, m)  # an upper bound on the experts a call reads (the cost estimate is static)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=(n // tn, n_items, nk), in_specs=in_specs, out_specs=out_spec,
            scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=int(min(max(2 * vmem, 32 << 20), 100 << 20))),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0,
                                      bytes_accessed=routed * wbytes + (n // tn) * xbytes + mp * n * ob),
        interpret=interpret,
        name=f"gmm_{w.kind}",
    )(*prefetch, *args)
    return y[:m, : w.out_features]


# --- XLA paths ------------------------------------------------------------------------------------------------------
def _expert(w: Weight, e: jax.Array) -> Weight:
    """Expert e (traced) of a stack: a 2-D array / QuantArray [N, K], read in place inside a loop.

    XLA:CPU widens a bf16 dynamic-slice to float32 by converting its operand, and loop-invariant code motion then
    hoists that conversion of the whole stack out of the loop (a float32 copy of the stack per call: 50 ms instead of
    5 at 26B-A4B's int4 scales); a bitcast to uint16 alone is hoisted the same way (a uint16 copy). Tying the stack
    to the loop index with an optimization barrier makes it loop-variant, so the bitcast fuses into the slice and
    only the one expert is read (temporaries: one expert, see tests/quant/test_gmm.py)."""
    leaves = (w.values, w.scale) if isinstance(w, QuantArray) else (w,)
    *leaves, e = lax.optimization_barrier((*leaves, e))

    def take(a):
        if jnp.dtype(a.dtype).itemsize == 2 and jnp.issubdtype(a.dtype, jnp.floating):
            bits = lax.dynamic_index_in_dim(lax.bitcast_convert_type(a, jnp.uint16), e, 0, keepdims=False)
            return lax.bitcast_convert_type(bits, a.dtype)
        return lax.dynamic_index_in_dim(a, e, 0, keepdims=False)

    if isinstance(w, QuantArray):
        return dataclasses.replace(w, values=take(leaves[0]), scale=take(leaves[1]), shape=w.shape[1:])
    return take(leaves[0])


def _matmul_cpu(x: jax.Array, w: Weight) -> jax.Array:
    """The CPU's 2-D forms for one expert: x [C, K] @ w [N, K].T -> [C, N] in x.dtype."""
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    if isinstance(w, QuantArray):
        if w.kind == "int4":
            return int4_matmul_cpu(x, w)
        # 2-63 rows keep the group loop: "wide" from 2 rows (int8_matmul.wide_pays) was measured for dense layers,
        # not for one expert's item inside the expert loop
        return int8_matmul_cpu(x, w, form="int" if 1 < rows < WIDE_MIN_ROWS else "auto")
    if jnp.dtype(x.dtype).itemsize != 2:
        return dense_matmul(x, w)
    # not "tiles" (ops.dense_matmul_cpu): an expert is a dynamic slice of its stack, and XLA:CPU widens a sliced
    # bf16 array to float32 whole; the float32 tiles were measured for static dense weights only
    return dense_matmul_cpu(x, w, form="vector" if rows == 1 else "gemm")


def _matmul_gpu(x: jax.Array, w: Weight) -> jax.Array:
    """GPU forms for one expert (as int8_matmul / int4_matmul pick for CUDA / ROCm)."""
    if isinstance(w, QuantArray):
        if w.kind == "int8":
            return int8_matmul_xla(x, w, form="batch" if w.act_group else "int")
        return int4_matmul_gpu(x, w)
    return dense_matmul(x, w)


def _int8_rows_cpu(x: jax.Array, w: QuantArray):
    """int8 "rows" on the CPU with the activations quantized (and materialized) once for all rows: int8_matmul's
    "vector" form, dot(xf, w_e.astype(f32).T) * x_scale * w_scale, per row (with act_group: on the dequantized
    activations, as that form does). Saves a quantization fusion and a conditional per row (0.1 ms a row at
    26B-A4B's down_proj, as much as the row's dot). Returns (xf f32 [M, K_p], row scale f32 [M, 1], mm(x_row, w_e))."""
    xq, xs = quantize_activations(_pad_cols(x, w.padded_in), w.act_group, w.act_axis)
    m, k = xq.shape
    if w.act_group:
        xf = (xq.astype(jnp.float32).reshape(m, k // w.act_group, w.act_group) * xs[..., None]).reshape(m, k)
        xs = jnp.ones((m, 1), jnp.float32)
    else:
        xf = xq.astype(jnp.float32)
    xf = materialize(xf)

    def mm(xr: jax.Array, sr: jax.Array, we: QuantArray) -> jax.Array:
        y = jnp.dot(xr, we.values.astype(jnp.float32).T) * sr * we.scale.astype(jnp.float32)[None, :]
        return y[:, : we.out_features].astype(x.dtype)

    return xf, xs, mm


def _gmm_rows(x: jax.Array, w: Weight, group_sizes: jax.Array, mm) -> jax.Array:
    """One work item per row: row r times its expert (XLA:CPU's one-row fusion reads the expert once; the next row
    of the same expert finds it in cache). Unrolled up to _UNROLL_ROWS rows, else a loop over the rows in groups."""
    m, e, n = x.shape[0], w.shape[0], w.shape[1]
    g, total = _row_groups(group_sizes, m)
    if mm is _matmul_cpu and isinstance(w, QuantArray) and w.kind == "int8":
        xf, xs, mm8 = _int8_rows_cpu(x, w)
        rows = (xf, xs)

        def one(xr, we):
            return mm8(xr[0], xr[1], we)
    else:
        rows = (x,)

        def one(xr, we):
            return mm(xr[0], we)

    if m <= _UNROLL_ROWS:
        ys = [one([a[r:r + 1] for a in rows], _expert(w, jnp.minimum(g[r], e - 1))) for r in range(m)]
        return jnp.where((jnp.arange(m) < total)[:, None], jnp.concatenate(ys, axis=0), 0).astype(x.dtype)

    def row(r, y):
        yr = one([lax.dynamic_slice_in_dim(a, r, 1, 0) for a in rows], _expert(w, g[r]))
        return lax.dynamic_update_slice_in_dim(y, yr.astype(y.dtype), r, 0)

    return lax.fori_loop(0, total, row, after_init(x, jnp.zeros((m, n), x.dtype)))


def _gmm_tiles(x: jax.Array, w: Weight, group_sizes: jax.Array, mm, c: int) -> jax.Array:
    """Work items of c rows within one group (a group of s rows takes ceil(s / c)), each through the 2-D form `mm`;
    a loop over the items there are (a dynamic trip count)."""
    m, e, n = x.shape[0], w.shape[0], w.shape[1]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    per = (sizes + c - 1) // c
    cum = jnp.cumsum(per)
    i = jnp.arange(-(-m // c) + e, dtype=jnp.int32)  # sum of ceil(s / c) <= ceil(M / c) + E
    g = jnp.minimum(jnp.sum(cum[None, :] <= i[:, None], axis=1, dtype=jnp.int32), e - 1)
    start = starts[g] + (i - (cum - per)[g]) * c
    rows = jnp.minimum(c, ends[g] - start)
    xp = jnp.pad(x, ((0, c), (0, 0)))  # an item's slice never runs past the end (dynamic_slice would shift it)

    def item(t, y):
        s = start[t]
        yb = mm(lax.dynamic_slice_in_dim(xp, s, c, 0), _expert(w, g[t])).astype(y.dtype)
        keep = (jnp.arange(c) < rows[t])[:, None]
        return lax.dynamic_update_slice_in_dim(y, jnp.where(keep, yb, lax.dynamic_slice_in_dim(y, s, c, 0)), s, 0)

    return lax.fori_loop(0, cum[-1], item, after_init(x, jnp.zeros((m + c, n), x.dtype)))[:m]


def gmm_xla(x: jax.Array, w: Weight, group_sizes: jax.Array, *, rows_per_item: int | None = None,
            gpu: bool = False) -> jax.Array:
    """XLA grouped matmul (CPU; gpu=True: the GPU's 2-D forms). x [M, K], w [E, N, K] plain or QuantArray,
    group_sizes int [E] -> [M, N] in x.dtype (rows past the groups' end: 0).

    rows_per_item: 1 = one item per row ("rows"), c > 1 = items of c rows of one group; None = the measured choice
    (module docstring): CPU "rows" while M <= 2 E, else 8; GPU 64."""
    _check(x, w, group_sizes, "gmm_xla")
    m, e = x.shape[0], w.shape[0]
    mm = _matmul_gpu if gpu else _matmul_cpu
    c = rows_per_item or (_GPU_TILE if gpu else 1 if m <= 2 * e else _CPU_TILE)
    if c == 1:
        return _gmm_rows(x, w, group_sizes, mm)
    return _gmm_tiles(x, w, group_sizes, mm, c)


def gmm_ragged(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Plain stacks on TPU / GPU: lax.ragged_dot_general, float32 accumulation. x [M, K], w [E, N, K] -> [M, N] in
    x.dtype.

    XLA:TPU wants the stack it multiplies row-major; it lays out a stack whose K is not a multiple of 128 with N
    minor (less padding), so such a stack is handed over as its [E, K, N] view (a bitcast of that layout) and one
    with K aligned as it is. The other way round copies the stack per call (26B-A4B bf16, deviceless v5e compile:
    968 MiB of temporaries for gate_up [128, 1408, 2816], 528 MiB for down [128, 2816, 704]; 16 KiB this way)."""
    sizes = group_sizes.astype(jnp.int32)
    if w.shape[2] % 128 and not w.shape[1] % 128:
        return lax.ragged_dot(x, jnp.swapaxes(w, 1, 2).astype(x.dtype), sizes,
                              preferred_element_type=jnp.float32).astype(x.dtype)
    dn = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                       rhs_group_dimensions=[0])
    return lax.ragged_dot_general(x, w.astype(x.dtype), sizes, dn, preferred_element_type=jnp.float32).astype(x.dtype)


IMPLS = ("auto", "xla", "pallas", "pallas_interpret")


def gmm(x: jax.Array, w: Weight, group_sizes: jax.Array, impl: str = "auto") -> jax.Array:
    """Grouped expert matmul: row r of x [M, K] (rows sorted by expert) times its expert of w [E, N, K] (plain array
    or int8 / int4 QuantArray, [out, in] per expert); group_sizes int [E] rows per expert, sum <= M. Returns [M, N]
    in x.dtype, zeros past the groups' end.

    impl: "auto" (decided at lowering time: QuantArrays take the Pallas kernel on TPU, plain stacks ragged_dot on
    TPU / GPU; the item loop with the GPU's or the CPU's 2-D forms otherwise) | "xla" (the same without the
    kernel) | "pallas" | "pallas_interpret" (QuantArrays only)."""
    _check(x, w, group_sizes, "gmm")
    if impl not in IMPLS:
        raise ValueError(f"gmm: impl must be one of {IMPLS}, got {impl!r}")
    if isinstance(w, QuantArray) and w.tp is not None:  # a tensor-parallel step: per shard (quant/sharded.py)
        return gmm_tp(x, w, group_sizes, functools.partial(gmm, impl=impl))
    gpu = functools.partial(gmm_xla, gpu=True)
    if not isinstance(w, QuantArray):
        if impl in ("pallas", "pallas_interpret"):
            raise ValueError(f"gmm: impl {impl!r} takes int8 / int4 QuantArray experts; this stack is a plain "
                             f"{w.dtype} array {tuple(w.shape)}")
        return lax.platform_dependent(x, w, group_sizes, tpu=gmm_ragged, cuda=gmm_ragged, rocm=gmm_ragged,
                                      default=gmm_xla)
    if impl == "auto":
        return lax.platform_dependent(x, w, group_sizes, tpu=gmm_pallas, cuda=gpu, rocm=gpu, default=gmm_xla)
    if impl == "xla":
        return lax.platform_dependent(x, w, group_sizes, cuda=gpu, rocm=gpu, default=gmm_xla)
    if impl == "pallas":
        return gmm_pallas(x, w, group_sizes)
    return gmm_pallas(x, w, group_sizes, interpret=pltpu.InterpretParams())
