"""Subprocess entry point of tests/quant/test_sharded.py: the quantized matmuls per shard (gemmajax.quant.sharded)
against the same matmul on one device, over configurations drawn at random (seeded), on 4 forced CPU devices.

The XLA forms only: Pallas TPU interpret mode under a multi-device shard_map synchronizes every device's kernel
with thread barriers, and on this 2-core XLA:CPU it hung (seen twice in the grouped matmul). The Pallas kernels
per shard are proven by the deviceless v5e 2x2 compiles (tests/test_aot.py), their numerics by the one-device
interpret-mode tests of each kernel (tests/quant/); what differs per shard is the wrapper, tested here.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.parallel.run_sharded_quant SEED TRIALS OUT.json

OUT.json: {"linear": [...], "gmm": [...], "control": {...}, "local_shapes": {...}}; each trial records its
configuration, the largest |sharded - unsharded| and the largest |unsharded| (the parent test asserts).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from gemmajax.quant import gmm, linear, quantize, sharded
from gemmajax.quant.sharded import TPSplit, split_specs

KINDS = (("int8", 0), ("int8", 32), ("int4", 0))


def place(q, mesh, dim):
    """q with values / scale put on `mesh` split along logical dim `dim` (None: replicated), marked with its split."""
    dims = [None] * len(q.shape)
    if dim is not None:
        dims[dim] = "model"
    sp = split_specs(q, dims)
    return dataclasses.replace(q, values=jax.device_put(q.values, NamedSharding(mesh, sp.values)),
                               scale=jax.device_put(q.scale, NamedSharding(mesh, sp.scale)))


def mark(q, mesh, dim):
    return dataclasses.replace(q, tp=TPSplit(mesh, "model", dim))


def quant(w, kind, ag):
    return quantize(w, "int8", act_group=ag) if kind == "int8" else quantize(w, "int4", group=32)


def err(y, ref) -> tuple[float, float]:
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(y - ref))), float(np.max(np.abs(ref)))


def linear_trial(rng, meshes):
    impl = "xla"
    n = int(rng.choice([2, 4]))
    kind, ag = KINDS[rng.integers(len(KINDS))]
    out = 128 * int(rng.integers(1, 4)) * n // 2 if rng.random() < 0.7 else 4 * n * int(rng.integers(3, 40))
    inp = 128 * n * int(rng.integers(1, 3))
    dims = [None, 0] + ([1] if kind == "int8" else [])   # int4 never splits along `in`
    dim = dims[rng.integers(len(dims))]
    lead = tuple(int(v) for v in rng.integers(1, 6, size=int(rng.integers(1, 3))))
    dtype = jnp.float32 if rng.random() < 0.75 else jnp.bfloat16
    w = jnp.asarray(rng.standard_normal((out, inp)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((*lead, inp)) * rng.uniform(0.1, 5), dtype)
    q = quant(w, kind, ag)
    ref = linear(x, q, impl)
    mesh = meshes[n]
    y = jax.jit(lambda x, qs: linear(x, mark(qs, mesh, dim), impl))(x, place(q, mesh, dim))
    e, m = err(y, ref)
    return dict(devices=n, kind=kind, act_group=ag, out=out, inp=inp, dim=dim, x_shape=list(x.shape),
                dtype=jnp.dtype(dtype).name, impl=impl, shape_ok=list(y.shape) == list(ref.shape), err=e, max=m)


def gmm_trial(rng, meshes):
    n = int(rng.choice([2, 4]))
    kind, ag = KINDS[rng.integers(len(KINDS))]
    e = n * int(rng.integers(1, 4))
    nn, k = 32 * n * int(rng.integers(1, 3)), 128 * n // 2 * int(rng.integers(1, 3))
    dims = [None, 0, 1] + ([2] if kind == "int8" else [])
    dim = dims[rng.integers(len(dims))]
    sizes = rng.integers(0, 5, size=e)
    sizes[rng.random(e) < 0.3] = 0                       # empty experts
    if not sizes.sum():
        sizes[rng.integers(e)] = 3
    pad = int(rng.integers(0, 4))                        # rows past the groups' end (NaN: they must come out 0)
    m = max(1, int(sizes.sum()) + pad)
    impl = "xla"
    w = jnp.asarray(rng.standard_normal((e, nn, k)), jnp.float32)
    xn = rng.standard_normal((m, k)).astype(np.float32)
    xn[int(sizes.sum()):] = np.nan
    x, gs = jnp.asarray(xn), jnp.asarray(sizes, jnp.int32)
    q = quant(w, kind, ag)
    ref = gmm(x, q, gs, impl)
    mesh = meshes[n]
    y = jax.jit(lambda x, qs, s: gmm(x, mark(qs, mesh, dim), s, impl))(x, place(q, mesh, dim), gs)
    er, mx = err(y[: int(sizes.sum())], ref[: int(sizes.sum())])
    return dict(devices=n, kind=kind, act_group=ag, experts=e, n=nn, k=k, dim=dim, sizes=sizes.tolist(), rows=m,
                impl=impl, err=er, max=mx, tail_zero=bool(np.all(np.asarray(y[int(sizes.sum()):]) == 0)),
                finite=bool(np.all(np.isfinite(np.asarray(y)))))


def control(meshes) -> dict:
    """Row-parallel int8 with one activation scale per token, with the cross-shard maximum switched off: each shard
    then quantizes with its own scale, which must be visibly off (so the trials above can fail)."""
    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((256, 512)), jnp.float32)
    xs = rng.standard_normal((4, 512)).astype(np.float32)
    xs[:, :128] *= 20                                     # shard 0 holds the row's largest values
    x, q, mesh = jnp.asarray(xs), quant(w, "int8", 0), meshes[4]
    ref = linear(x, q, "xla")
    f = jax.jit(lambda x, qs: linear(x, mark(qs, mesh, 1), "xla"))
    with_pmax = err(f(x, place(q, mesh, 1)), ref)

    def own_scale(xl, wl):  # the shard's matmul, with its act_axis dropped
        return linear(xl, dataclasses.replace(wl, act_axis=None), "xla")
    g = jax.jit(lambda x, qs: sharded.linear_tp(x, mark(qs, mesh, 1), own_scale))
    without = err(g(x, place(q, mesh, 1)), ref)
    return {"with_pmax": with_pmax, "without_pmax": without}


def local_shapes(meshes) -> dict:
    """The shapes the kernel sees inside shard_map: a shard, not the whole weight."""
    seen = {}
    mesh = meshes[4]
    w = jnp.asarray(np.random.default_rng(3).standard_normal((512, 256)), jnp.float32)
    x = jnp.ones((3, 256), jnp.float32)
    for kind, dim in (("int8", 0), ("int8", 1), ("int4", 0), ("int8", None)):
        q = quant(w, kind, 0)

        def mm(xl, wl, kind=kind, dim=dim):
            seen[f"{kind}/{dim}"] = {"x": list(xl.shape), "values": list(wl.values.shape), "shape": list(wl.shape)}
            return linear(xl, wl, "xla")
        jax.jit(lambda x, qs, dim=dim, mm=mm: sharded.linear_tp(x, mark(qs, mesh, dim), mm))(x, place(q, mesh, dim))
    return seen


def main() -> None:
    seed, trials, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    devs = jax.devices()
    meshes = {n: Mesh(np.array(devs[:n]), ("model",)) for n in (2, 4)}
    rng = np.random.default_rng(seed)
    res = {"linear": [linear_trial(rng, meshes) for _ in range(trials)],
           "gmm": [gmm_trial(rng, meshes) for _ in range(trials)],
           "control": control(meshes), "local_shapes": local_shapes(meshes)}
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
