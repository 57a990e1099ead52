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


def quant(w, kind, ag, pad_in_to=None):
    if kind == "int8":
        return quantize(w, "int8", act_group=ag, pad_in_to=pad_in_to)
    return quantize(w, "int4", group=32, pad_in_to=pad_in_to)


# every (kind, act_group, split dim) a 2-D weight / an expert stack can have: the first trials take them in turn
LINEAR_COMBOS = [(k, a, d) for k, a in KINDS for d in ([None, 0, 1] if k == "int8" else [None, 0])]
GMM_COMBOS = [(k, a, d) for k, a in KINDS for d in ([None, 0, 1, 2] if k == "int8" else [None, 0, 1])]


def _combo(rng, combos, i):
    return combos[i] if i < len(combos) else combos[rng.integers(len(combos))]


def err(y, ref) -> tuple[float, float]:
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(y - ref))), float(np.max(np.abs(ref)))


def linear_trial(rng, meshes, i):
    impl = "xla"
    n = int(rng.choice([2, 4]))
    kind, ag, dim = _combo(rng, LINEAR_COMBOS, i)
    j = i - len(LINEAR_COMBOS)               # then one padded-rows split and one padded-columns split for certain
    if j in (0, 1):
        kind, ag, dim = ("int8", 0, j) if j else (("int8", "int4")[int(rng.integers(2))], 0, 0)
    r = 0.0 if j == 0 else 0.5 if j == 1 else rng.random()
    if r < 0.25:      # > 4096 rows, not a multiple of 128: stored padded to 128 (QuantArray.padded_out)
        out = 4096 + 4 * n * int(rng.integers(1, 9))
    elif r < 0.6:
        out = 128 * int(rng.integers(1, 4)) * n // 2
    else:
        out = 4 * n * int(rng.integers(3, 40))
    pad_in_to = 128 * n if j == 1 or rng.random() < 0.35 else None   # columns padded (as +emb tables are)
    inp = 128 * n * int(rng.integers(1, 3)) - (32 if pad_in_to else 0)
    lead = tuple(int(v) for v in rng.integers(1, 6, size=int(rng.integers(1, 3))))
    dtype = jnp.float32 if rng.random() < 0.75 else jnp.bfloat16
    w = jnp.asarray(rng.standard_normal((out, inp)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((*lead, inp)) * rng.uniform(0.1, 5), dtype)
    q = quant(w, kind, ag, pad_in_to)
    ref = linear(x, q, impl)
    mesh = meshes[n]
    y = jax.jit(lambda x, qs: linear(x, mark(qs, mesh, dim), impl))(x, place(q, mesh, dim))
    e, m = err(y, ref)
    return dict(devices=n, kind=kind, act_group=ag, out=out, inp=inp, dim=dim, x_shape=list(x.shape),
                dtype=jnp.dtype(dtype).name, impl=impl, shape_ok=list(y.shape) == list(ref.shape), err=e, max=m,
                padded_out=q.padded_out > out, padded_in=q.padded_in > inp)


def gmm_trial(rng, meshes, i):
    n = int(rng.choice([2, 4]))
    kind, ag, dim = _combo(rng, GMM_COMBOS, i)
    if i == len(GMM_COMBOS):                               # then a padded, per-token, `in`-split stack for certain
        kind, ag, dim = "int8", 0, 2
    e = n * int(rng.integers(1, 4))
    nn, k = 32 * n * int(rng.integers(1, 3)), 128 * n // 2 * int(rng.integers(1, 3))
    pad_in_to = 128 * n if i == len(GMM_COMBOS) or rng.random() < 0.35 else None  # padded along `in` (as loaded)
    k_logical = k - (32 if pad_in_to else 0)
    dtype = jnp.float32 if rng.random() < 0.75 else jnp.bfloat16
    sizes = rng.integers(0, 5, size=e)
    sizes[rng.random(e) < 0.3] = 0                       # empty experts
    if not sizes.sum():
        sizes[rng.integers(e)] = 3
    pad = int(rng.integers(0, 4))                        # rows past the groups' end (NaN: they must come out 0)
    m = max(1, int(sizes.sum()) + pad)
    impl = "xla"
    w = jnp.asarray(rng.standard_normal((e, nn, k_logical)), jnp.float32)
    xn = rng.standard_normal((m, k_logical)).astype(np.float32)
    xn[int(sizes.sum()):] = np.nan
    x, gs = jnp.asarray(xn, dtype), jnp.asarray(sizes, jnp.int32)
    q = quant(w, kind, ag, pad_in_to)
    ref = gmm(x, q, gs, impl)
    mesh = meshes[n]
    y = jax.jit(lambda x, qs, s: gmm(x, mark(qs, mesh, dim), s, impl))(x, place(q, mesh, dim), gs)
    er, mx = err(y[: int(sizes.sum())], ref[: int(sizes.sum())])
    return dict(devices=n, kind=kind, act_group=ag, experts=e, n=nn, k=k_logical, dim=dim, sizes=sizes.tolist(),
                rows=m, dtype=jnp.dtype(dtype).name, padded_in=q.padded_in > k_logical,
                impl=impl, err=er, max=mx, tail_zero=bool(np.all(np.asarray(y[int(sizes.sum()):]) == 0)),
                finite=bool(np.all(np.isfinite(np.asarray(y)))))


def control(meshes) -> dict:
    """Row-parallel int8 with one activation scale per token, with the cross-shard maximum switched off (the shard's
    act_axis dropped): each shard then quantizes with its own scale, which must be visibly off (so the trials above
    can fail). The same for the experts' `in` split (gmm)."""
    rng = np.random.default_rng(7)
    mesh = meshes[4]
    w = jnp.asarray(rng.standard_normal((256, 512)), jnp.float32)
    xs = rng.standard_normal((4, 512)).astype(np.float32)
    xs[:, :128] *= 20                                     # shard 0 holds the row's largest values
    x, q = jnp.asarray(xs), quant(w, "int8", 0)
    ref = linear(x, q, "xla")
    with_pmax = err(jax.jit(lambda x, qs: linear(x, mark(qs, mesh, 1), "xla"))(x, place(q, mesh, 1)), ref)

    def own_scale(xl, wl):  # the shard's matmul, with its act_axis dropped
        return linear(xl, dataclasses.replace(wl, act_axis=None), "xla")
    g = jax.jit(lambda x, qs: sharded.linear_tp(x, mark(qs, mesh, 1), own_scale))
    without = err(g(x, place(q, mesh, 1)), ref)

    we = jnp.asarray(rng.standard_normal((4, 64, 512)), jnp.float32)
    qe, gs = quant(we, "int8", 0), jnp.array([1, 0, 2, 1], jnp.int32)
    ref_e = gmm(x, qe, gs, "xla")
    with_e = err(jax.jit(lambda x, qs, s: gmm(x, mark(qs, mesh, 2), s, "xla"))(x, place(qe, mesh, 2), gs), ref_e)

    def own_scale_e(xl, wl, s):
        return gmm(xl, dataclasses.replace(wl, act_axis=None), s, "xla")
    ge = jax.jit(lambda x, qs, s: sharded.gmm_tp(x, mark(qs, mesh, 2), s, own_scale_e))
    without_e = err(ge(x, place(qe, mesh, 2), gs), ref_e)
    return {"with_pmax": with_pmax, "without_pmax": without, "gmm_with_pmax": with_e, "gmm_without_pmax": without_e}


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
    res = {"linear": [linear_trial(rng, meshes, i) for i in range(trials)],
           "gmm": [gmm_trial(rng, meshes, i) for i in range(trials)],
           "control": control(meshes), "local_shapes": local_shapes(meshes)}
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
