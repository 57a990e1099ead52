"""Tensor and expert parallelism: where every weight leaf and KV page lives, decided once at load time.

Design choices:
- One 1-D mesh, axis "model", over the first N devices (of every process: multi-host meshes are the same thing).
  Every weight has logical axis names (`LOGICAL_AXES`, keyed by its field in `gemma.Weights`); `ShardPlan` maps
  each name to "model" or to None (replicated) after checking that the split gives every device whole units
  (heads, KV heads, experts, int8 activation groups). A leaf that cannot be split is replicated and the reason
  is logged once: the model still runs, only with more memory per device.
- Megatron's layout: q / k / v and gate / up split along `out` (column-parallel), o / down along `in`
  (row-parallel), so each attention and MLP block ends in one partial sum; the vocabulary (embedding, tied LM
  head, PLE table) splits along its rows. GSPMD inserts the collectives (one all-reduce per block) from the
  weights' NamedShardings; the model code knows nothing of devices. The residual stream D is never split.
- KV pages `[P, 2K, page_size, H]` split on the 2K axis, whole KV heads per device (row 2k / 2k + 1 of head k stay
  together). With fewer KV heads than devices (N_dev % K == 0), each head's pages are stored N_dev / K times
  (`kv_repeat`), so every device holds exactly the one head its query heads read: attention then runs per shard
  with no gather (runner.py wraps it in shard_map, which is also what lets the Pallas kernel run on TPU).
- QuantArrays split values and scale together: rows (`out`) with their scales; int8 columns (`in`) with the
  per-row scale replicated; int4 never along `in` (byte j packs columns j and j + in/2, so a contiguous split of
  the bytes is not a contiguous split of the columns its group scales cover).
- Expert parallelism (`expert_parallel=True`): the expert stacks [E, ...] split on E (whole experts per device);
  without it they split along the expert MLP width like the dense MLP.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gemmajax.config import ModelConfig
from gemmajax.quant.array import QuantArray
from gemmajax.quant.sharded import TPSplit, split_specs

logger = logging.getLogger(__name__)

AXIS = "model"

# Logical axes of every split-able weight, in Hugging Face's [..., out, in] layout. Keys are the field path in
# gemma.Weights without the layer index. Names: vocab V, heads N*H, kv_heads K*H, mlp F, expert E, expert_mlp
# (the expert's F; gate_up's 2F), embed D (never split). Leaves not listed (norms, scalars, router scales,
# q_norm / k_norm) are replicated. The PLE projections stay whole: P = 256 columns, and splitting them would add
# an all-reduce per layer for a few MB; ple_model_proj [L*P, D] feeds a per-layer slice of its output.
LOGICAL_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "ple_table": ("vocab", None),
    "ple_model_proj": (None, "embed"),
    "attn.q_proj": ("heads", "embed"),
    "attn.k_proj": ("kv_heads", "embed"),
    "attn.v_proj": ("kv_heads", "embed"),
    "attn.o_proj": ("embed", "heads"),
    "mlp.gate_proj": ("mlp", "embed"),
    "mlp.up_proj": ("mlp", "embed"),
    "mlp.down_proj": ("embed", "mlp"),
    "moe.router_proj": (None, "embed"),
    "moe.gate_up_proj": ("expert", "expert_mlp", "embed"),
    "moe.down_proj": ("expert", "embed", "expert_mlp"),
    "ple_gate": (None, "embed"),
    "ple_proj": ("embed", None),
}

_LOGGED: set[str] = set()


def _log_once(msg: str) -> None:
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        logger.info(msg)


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """The 1-D "model" mesh over the first `tensor_parallel_size` devices (`jax.devices()` by default: every
    process's, in process order, so a multi-host mesh spans hosts). `devices`: e.g. a TPU topology's devices for
    a deviceless AOT compile."""
    devs = list(jax.devices() if devices is None else np.asarray(devices).reshape(-1))
    n = int(tensor_parallel_size)
    if n < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if n > len(devs):
        kind = devs[0].platform if devs else "?"
        hint = (" (on the CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N devices)"
                if kind == "cpu" else "")
        raise ValueError(f"tensor_parallel_size={n} needs {n} devices, but only {len(devs)} {kind} device(s) exist"
                         f"{hint}")
    if devices is None and jax.process_count() > 1 and n != len(devs):
        raise ValueError(f"tensor_parallel_size={n} on {jax.process_count()} hosts: the mesh must span every host's "
                         f"devices, so tensor_parallel_size must be jax.device_count()={len(devs)}")
    return Mesh(np.array(devs[:n]), (AXIS,))


def _path_names(path) -> tuple[str, int | None]:
    """A tree_util key path -> ("attn.q_proj", layer index or None)."""
    names, layer = [], None
    for k in path:
        if isinstance(k, jax.tree_util.SequenceKey):
            layer = k.idx
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name != "layers":
                names.append(k.name)
        else:
            names.append(str(k))
    return ".".join(names), layer


@dataclass(frozen=True)
class ShardPlan:
    """Where every weight leaf and KV page of one model lives on one mesh (hashable: part of the runner's jit key).

    Build it with `ShardPlan.create(cfg, tensor_parallel_size, expert_parallel)`; `shardings(weights)` gives the
    NamedSharding tree of a (possibly abstract) weight tree, `place(weights)` puts the weights there,
    `kv_sharding(num_kv_heads)` and `kv_repeat(num_kv_heads)` say how a layer's pages are stored."""

    mesh: Mesh
    cfg: ModelConfig
    expert_parallel: bool = False

    @classmethod
    def create(cls, cfg: ModelConfig, tensor_parallel_size: int, expert_parallel: bool = False,
               devices=None) -> ShardPlan:
        if expert_parallel and not cfg.enable_moe:
            raise ValueError(f"enable_expert_parallel=True: model {cfg.name or cfg.model_type} has no experts "
                             f"(num_experts=0); drop the flag")
        plan = cls(make_mesh(tensor_parallel_size, devices), cfg, bool(expert_parallel))
        plan._check_rules()
        return plan

    @property
    def size(self) -> int:
        return int(self.mesh.size)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    # ------------------------------------------------------------------ rules
    def heads_split(self) -> bool:
        """Attention splits by query head: N divisible by the device count."""
        return self.cfg.num_heads % self.size == 0

    def kv_heads_split(self, num_kv_heads: int) -> bool:
        """k_proj / v_proj split by KV head (K divisible by the device count)."""
        return self.heads_split() and num_kv_heads % self.size == 0

    def kv_repeat(self, num_kv_heads: int) -> int:
        """How many copies of each KV head the pages store: size // K when K < size divides it (each device then
        holds the one head its query heads read), else 1."""
        n = self.size
        if n > 1 and self.heads_split() and num_kv_heads % n and n % num_kv_heads == 0:
            return n // num_kv_heads
        return 1

    def kv_pages_split(self, num_kv_heads: int) -> bool:
        """The layer's pages split by (stored) KV head, and its attention runs per shard."""
        return self.size > 1 and self.heads_split() and (num_kv_heads * self.kv_repeat(num_kv_heads)) % self.size == 0

    def kv_sharding(self, num_kv_heads: int) -> NamedSharding:
        """Sharding of a layer's pages [P, 2K', page_size, H] (K' = K * kv_repeat(K))."""
        return NamedSharding(self.mesh, P(None, AXIS) if self.kv_pages_split(num_kv_heads) else P())

    def _check_rules(self) -> None:
        """Log, once, what does not split and why (the model still runs: those leaves are replicated)."""
        cfg, n = self.cfg, self.size
        if n == 1:
            return
        if not self.heads_split():
            _log_once(f"tensor_parallel_size {n}: {cfg.num_heads} query heads do not divide over {n} devices; "
                      f"attention weights and KV pages are replicated")
        for k in sorted({cfg.layers[li].num_kv_heads for li in cfg.kv_layers}):
            if self.heads_split() and not self.kv_pages_split(k):
                _log_once(f"tensor_parallel_size {n}: {k} KV heads neither divide nor are a divisor of {n} devices; "
                          f"those layers' K/V projections and pages are replicated")
            elif self.kv_repeat(k) > 1:
                _log_once(f"tensor_parallel_size {n}: {k} KV head(s) < {n} devices: K/V projections replicated, "
                          f"each head's pages stored {self.kv_repeat(k)} times (one head per device)")
        if cfg.enable_moe and self.expert_parallel and cfg.num_experts % n:
            _log_once(f"enable_expert_parallel: {cfg.num_experts} experts do not divide over {n} devices; "
                      f"the expert stacks are split along their MLP width instead")

    def _axis_ok(self, name: str | None, layer: int | None, size: int) -> str | None:
        """Why logical axis `name` of physical size `size` cannot split (None: it can)."""
        cfg, n = self.cfg, self.size
        if name is None or name == "embed":
            return "not split by design"
        if size % n:
            return f"{name} size {size} does not divide over {n} devices"
        if name == "heads" and not self.heads_split():
            return f"{cfg.num_heads} query heads do not divide over {n} devices"
        if name == "kv_heads" and not self.kv_heads_split(cfg.layers[layer].num_kv_heads):
            return f"{cfg.layers[layer].num_kv_heads} KV heads do not divide over {n} devices"
        if name == "expert":
            if not self.expert_parallel:
                return "expert parallelism is off"
            if cfg.num_experts % n:
                return f"{cfg.num_experts} experts do not divide over {n} devices"
        if name == "expert_mlp" and self.expert_parallel and cfg.num_experts % n == 0:
            return "experts are split instead (expert parallelism)"
        return None

    def leaf_spec(self, key: str, layer: int | None, leaf: Any) -> Any:
        """PartitionSpec of one leaf (a QuantArray of two PartitionSpecs for a QuantArray leaf)."""
        axes = LOGICAL_AXES.get(key)
        if self.size == 1 or axes is None or leaf is None:
            return _replicated_like(leaf)
        shape = tuple(leaf.shape)       # logical [..., out, in] (a QuantArray's too)
        if len(axes) != len(shape):
            raise ValueError(f"parallel: weight {key} has shape {shape}, but its logical axes are {axes}")
        dims: list[str | None] = [None] * len(shape)
        reasons = []
        for d, name in enumerate(axes):
            why = self._axis_ok(name, layer, _physical_size(leaf, d))
            if why is None and isinstance(leaf, QuantArray):
                why = _quant_split_problem(leaf, d, self.size)
            if why is None:
                dims[d] = AXIS
                break                                   # one mesh axis: at most one split dim per leaf
            if name not in (None, "embed"):
                reasons.append(f"not along {name}: {why}")
        if all(x is None for x in dims) and reasons:
            where = key + (f" (layer {layer})" if layer is not None else "")
            _log_once(f"tensor_parallel_size {self.size}: {where} {shape} replicated ({'; '.join(reasons)})")
        return split_specs(leaf, dims)

    def specs(self, weights: Any) -> Any:
        """The PartitionSpec tree of a (possibly abstract) weight tree (QuantArrays: specs of values and scale)."""
        def one(path, leaf):
            key, layer = _path_names(path)
            return self.leaf_spec(key, layer, leaf)
        return jax.tree_util.tree_map_with_path(one, weights, is_leaf=lambda x: isinstance(x, QuantArray))

    def shardings(self, weights: Any) -> Any:
        """NamedSharding per array leaf of `weights` (same tree structure, QuantArray children included)."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs(weights),
                            is_leaf=lambda x: isinstance(x, P))

    def abstract(self, weights: Any) -> Any:
        """`weights` (arrays or ShapeDtypeStructs) as ShapeDtypeStructs carrying their shardings: what a deviceless
        AOT compile of the sharded step takes (e.g. on a TPU topology's devices, ShardPlan.create(devices=...))."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), weights,
                            self.shardings(weights))

    def annotate(self, weights: Any) -> Any:
        """Inside a traced step: every QuantArray of `weights` marked with its split (QuantArray.tp), so that the
        quantized kernels run per shard under shard_map (gemmajax.quant.sharded; GSPMD cannot partition a Pallas
        call). Plain arrays are left to GSPMD. A no-op on one device."""
        if self.size == 1:
            return weights

        def one(path, leaf):
            if not isinstance(leaf, QuantArray):
                return leaf
            key, layer = _path_names(path)
            spec = self.leaf_spec(key, layer, leaf).values
            dim = next((d for d, a in enumerate(spec) if a == AXIS), None)
            return dataclasses.replace(leaf, tp=TPSplit(self.mesh, AXIS, dim))
        return jax.tree_util.tree_map_with_path(one, weights, is_leaf=lambda x: isinstance(x, QuantArray))

    def place(self, weights: Any) -> Any:
        """Put every leaf of `weights` where `shardings` says (works across processes: each process passes the
        same values, e.g. the same checkpoint; only its own devices' shards are kept)."""
        shardings = self.shardings(weights)
        if jax.process_count() == 1:
            return jax.device_put(weights, shardings)
        return jax.tree.map(lambda a, s: jax.device_put(np.asarray(a), s), weights, shardings)

    def replicate(self, tree: Any) -> Any:
        """Every leaf replicated on the mesh (e.g. the vision / audio towers, which the step's inputs come from), its
        QuantArrays marked replicated (`mark_replicated`)."""
        if jax.process_count() == 1:
            placed = jax.device_put(tree, self.replicated)
        else:
            placed = jax.tree.map(lambda a: jax.device_put(np.asarray(a), self.replicated), tree)
        return self.mark_replicated(placed)

    def mark_replicated(self, tree: Any) -> Any:
        """`tree` with every QuantArray marked as held whole on every device (QuantArray.tp, dim None): whatever
        jitted program multiplies by it runs the kernel on each device under shard_map (a Pallas call GSPMD meets
        on a mesh does not compile, replicated or not). A no-op on one device."""
        if self.size == 1:
            return tree
        return jax.tree.map(lambda q: dataclasses.replace(q, tp=TPSplit(self.mesh, AXIS, None))
                            if isinstance(q, QuantArray) else q, tree, is_leaf=lambda x: isinstance(x, QuantArray))

    # ------------------------------------------------------------------ KV memory
    def kv_device_fraction(self) -> float:
        """Bytes of KV pages one device holds / bytes of the logical cache (K heads per layer, unrepeated): a
        per-device budget B buys B / fraction bytes of logical cache."""
        cfg = self.cfg
        logical = per_dev = 0.0
        for li in cfg.kv_layers:
            s = cfg.layers[li]
            k = s.num_kv_heads
            logical += k * s.head_dim
            stored = k * self.kv_repeat(k) * s.head_dim
            per_dev += stored / self.size if self.kv_pages_split(k) else stored
        return per_dev / logical if logical else 1.0

    def describe(self, weights: Any) -> list[str]:
        """One line per distinct (leaf, split) for logs and reports: which leaves are split how."""
        out = {}
        specs = self.specs(weights)

        def one(path, leaf, spec):
            key, _ = _path_names(path)
            out.setdefault(key, (tuple(leaf.shape), spec))
        jax.tree_util.tree_map_with_path(one, weights, specs, is_leaf=lambda x: isinstance(x, QuantArray))
        return [f"{k}: {shape} -> {_spec_str(spec)}" for k, (shape, spec) in out.items()]


def _replicated_like(leaf):
    if isinstance(leaf, QuantArray):
        return dataclasses.replace(leaf, values=P(), scale=P())
    return P()


def _physical_size(leaf, d: int) -> int:
    """The stored size of logical dim d (QuantArray rows may be padded; int4 columns are half as many bytes)."""
    if not isinstance(leaf, QuantArray):
        return int(leaf.shape[d])
    nd = len(leaf.shape)
    if d == nd - 2:
        return int(leaf.values.shape[-2])
    if d == nd - 1:
        return leaf.padded_in
    return int(leaf.shape[d])


def _quant_split_problem(q: QuantArray, d: int, n: int) -> str | None:
    """Why splitting logical dim d of QuantArray q over n devices would not give every device whole columns /
    groups with their scales (None: fine)."""
    nd = len(q.shape)
    if d != nd - 1:
        return None                       # rows and leading (expert) dims split values and scales alike
    if q.kind == "int4":
        return ("int4 packs column j with column j + in/2 in one byte, so a split of the bytes is not a split of "
                "the columns (and of the groups of 32 their scales cover)")
    in_p = q.padded_in
    if in_p % n:
        return f"int8 padded in {in_p} does not divide over {n} devices"
    if q.act_group and (in_p // n) % q.act_group:
        return f"int8 activation groups of {q.act_group} would straddle shards of {in_p // n} columns"
    return None


def _spec_str(spec) -> str:
    if isinstance(spec, QuantArray):
        return f"values {tuple(spec.values)}, scale {tuple(spec.scale)}"
    return "replicated" if all(s is None for s in spec) else str(tuple(spec))


def device_bytes(tree: Any) -> dict[int, int]:
    """Bytes of `tree`'s array leaves held by each addressable device (a split leaf counts its shard only)."""
    out: dict[int, int] = {}
    for a in jax.tree.leaves(tree):
        for sh in a.addressable_shards:
            out[sh.device.id] = out.get(sh.device.id, 0) + int(math.prod(sh.data.shape)) * a.dtype.itemsize
    return out


def init_distributed(coordinator: str, num_hosts: int, host_index: int) -> None:
    """Join a multi-host run: `jax.distributed.initialize` so that `jax.devices()` lists every host's devices (and a
    mesh over them spans hosts). Call before anything touches a JAX backend. On the CPU the cross-process
    collectives go through gloo (XLA:CPU has no other implementation)."""
    if num_hosts < 1 or not 0 <= host_index < num_hosts:
        raise ValueError(f"multi-host: host_index must be in [0, num_hosts); got host_index={host_index}, "
                         f"num_hosts={num_hosts}")
    if num_hosts == 1:
        return
    if not coordinator:
        raise ValueError(f"multi-host: num_hosts={num_hosts} needs a coordinator address (host 0's HOST:PORT)")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_hosts, process_id=host_index)


def shutdown_distributed() -> None:
    """Leave a multi-host run cleanly: every process waits here for the others (a shutdown barrier), so none
    loses the coordinator (host 0) while it is still running."""
    if jax.process_count() > 1:
        jax.distributed.shutdown()


def agree_min(value: int) -> int:
    """The smallest of `value` over all processes (e.g. a KV budget measured per host: every host must plan the
    same cache, or their programs differ)."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils
    return int(np.min(multihost_utils.process_allgather(np.array([value], np.int64))))
