"""Quantized matmuls on tensor-parallel weights: each device runs the kernel on its own shard, under shard_map.

Design choices:
- GSPMD cannot partition a Pallas (Mosaic) call, so a sharded step that met one outside a shard_map did not compile
  for a TPU slice. The plan (gemmajax.parallel.ShardPlan.annotate) marks every QuantArray of the step's weights
  with a `TPSplit` (static: mesh, axis, which logical dim is split) while the step is traced; `linear` and `gmm`
  then call `linear_tp` / `gmm_tp`, which run the same kernel (whichever `impl` chooses: Pallas on TPU, the XLA
  forms elsewhere) per shard. Every backend takes this path, so the CPU tests at tensor_parallel_size 2 / 4 run
  exactly what a TPU slice compiles, only with the other kernel.
- Column-parallel (rows `out` split): x replicated, each device computes its block of outputs; the result stays
  split along its last dim (GSPMD takes it from there, as it does for a plain column-parallel weight).
- Row-parallel (int8 columns `in` split): x split along its last dim, each device a partial product, one psum.
  With one activation scale per token (act_group 0) the scale is the maximum over the whole row, so the local
  quantization takes the pmax of every shard's maximum (the shard's QuantArray carries the axis, `act_axis`, static,
  for `int8_matmul.quantize_activations`): the same int8 activations as on one device. Activation groups never straddle shards
  (parallel._quant_split_problem), so they need nothing.
- Expert-parallel stacks (dim 0 of [E, N, K] split): the rows are sorted by expert, so a device's experts own one
  contiguous run of rows, starting at the rows of the experts before them. Each device rolls x so that its run
  starts at row 0, runs the grouped matmul over its experts' group sizes (rows past their end come out as zeros),
  rolls the result back and one psum adds the devices' disjoint rows (exact: one nonzero term per element).
- A QuantArray that is not split (replicated) runs whole on every device, also under shard_map.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from gemmajax.quant.array import QuantArray
from gemmajax.quant.int8_matmul import _pad_in


@dataclass(frozen=True)
class TPSplit:
    """Where a QuantArray's shards live during a traced step: `mesh`, its `axis`, and `dim`, the logical dim split
    over it (None: replicated). Static metadata of the QuantArray (QuantArray.tp)."""

    mesh: Any
    axis: str
    dim: int | None

    @property
    def size(self) -> int:
        return int(self.mesh.shape[self.axis])


def split_specs(leaf, dims: list[str | None]):
    """PartitionSpec of a plain leaf, or a QuantArray of the PartitionSpecs of its values and scale, for a leaf whose
    logical dims map to `dims` (mesh axis names or None). int8 scales [..., out_p] follow the rows; int4 scales
    [..., out_p, in_p // group] follow rows and columns alike (int4 is never split along `in`)."""
    if not isinstance(leaf, QuantArray):
        return P(*dims)
    *lead, out, inp = dims
    if leaf.kind == "int8":      # values [..., out_p, in]; scale [..., out_p]
        return dataclasses.replace(leaf, values=P(*lead, out, inp), scale=P(*lead, out), tp=None)
    return dataclasses.replace(leaf, values=P(*lead, out, inp), scale=P(*lead, out, inp), tp=None)


def _local(w, s: TPSplit):
    """The QuantArray one device sees inside shard_map, as a function of its (values, scale) shards (its logical
    shape is the shard's physical one along the split dim), and the specs of (values, scale)."""
    nd = len(w.shape)
    dims: list[str | None] = [None] * nd
    shape = list(w.shape)
    if s.dim is not None:
        dims[s.dim] = s.axis
        phys = w.padded_out if s.dim == nd - 2 else w.padded_in if s.dim == nd - 1 else w.shape[s.dim]
        shape[s.dim] = phys // s.size
    specs = split_specs(w, dims)
    # a row-parallel int8 shard quantizes its activations with the whole row's per-token maximum
    act_axis = s.axis if w.kind == "int8" and s.dim == nd - 1 and not w.act_group else None

    def rebuild(children):
        return dataclasses.replace(w, values=children[0], scale=children[1], tp=None, shape=tuple(shape),
                                   act_axis=act_axis)
    return rebuild, (specs.values, specs.scale), tuple(shape)


def _run(s: TPSplit, body, in_specs, out_specs, *args):
    return jax.shard_map(body, mesh=s.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def linear_tp(x: jax.Array, w, matmul: Callable) -> jax.Array:
    """y = matmul(x, w) for a 2-D QuantArray w [out, in] marked with w.tp, run per shard. x [..., in] ->
    [..., out] in x.dtype. matmul(x_local, w_local) is the unsharded 2-D kernel (any impl)."""
    s: TPSplit = w.tp
    rebuild, wspec, _ = _local(w, s)
    lead = (None,) * (x.ndim - 1)
    kids = (w.values, w.scale)
    if s.dim == 1:                                       # row-parallel: partial products, one psum
        def row(xl, wl):
            return lax.psum(matmul(xl, rebuild(wl)), s.axis)
        return _run(s, row, (P(*lead, s.axis), wspec), P(), _pad_in(x, w), kids)

    def body(xl, wl):
        return matmul(xl, rebuild(wl))
    if s.dim is None:                                    # replicated: the whole matmul on every device
        return _run(s, body, (P(), wspec), P(), x, kids)
    y = _run(s, body, (P(), wspec), P(*lead, s.axis), x, kids)
    return y[..., : w.out_features]                      # column-parallel: padded rows (out_p > out) dropped


def gmm_tp(x: jax.Array, w, group_sizes: jax.Array, gmm: Callable) -> jax.Array:
    """gmm(x, w, group_sizes) for an expert stack QuantArray w [E, N, K] marked with w.tp, run per shard (module
    docstring: experts split, `out` split, `in` split or replicated). x [M, K] rows sorted by expert -> [M, N]."""
    s: TPSplit = w.tp
    rebuild, wspec, shape = _local(w, s)
    kids = (w.values, w.scale)
    if s.dim == 0:                                       # expert parallelism
        e_local = shape[0]

        def experts(xl, wl, sizes):
            sizes = sizes.astype(jnp.int32)
            first = lax.axis_index(s.axis) * e_local
            start = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < first, sizes, 0))
            mine = lax.dynamic_slice_in_dim(sizes, first, e_local)
            y = gmm(jnp.roll(xl, -start, axis=0), rebuild(wl), mine)
            return lax.psum(jnp.roll(y, start, axis=0), s.axis)
        return _run(s, experts, (P(), wspec, P()), P(), x, kids, group_sizes)
    if s.dim == 2:                                       # row-parallel experts (their `in` split)
        def row(xl, wl, sizes):
            return lax.psum(gmm(xl, rebuild(wl), sizes), s.axis)
        return _run(s, row, (P(None, s.axis), wspec, P()), P(), _pad_in(x, w), kids, group_sizes)

    def body(xl, wl, sizes):
        return gmm(xl, rebuild(wl), sizes)
    if s.dim is None:
        return _run(s, body, (P(), wspec, P()), P(), x, kids, group_sizes)
    y = _run(s, body, (P(), wspec, P()), P(None, s.axis), x, kids, group_sizes)
    return y[:, : w.out_features]
