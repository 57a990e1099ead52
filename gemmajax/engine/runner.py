"""The model runner: paged KV caches on the device and one jitted step over a flattened, ragged batch.

Design choices:
- The batch is flattened: all scheduled tokens of all sequences form one [T] row (decodes first, then prefill
  chunks), described per KV group by a `RaggedMeta` (cu_q_lens, kv_lens, page table). T and the number of
  sequences are padded to a few buckets, so a handful of programs cover every step.
- One page array per KV-owning layer, grouped by attention kind ("sliding" / "full"): all layers of a group
  share one page table per sequence. KV-shared layers own nothing and read their source layer's pages.
- KV-shared layers write no cache, so only the tokens whose logits are needed (the last of each sequence) go
  through them ("shared band"); for E2B that skips 20 of 35 layers for every other prompt token.
- KV page arrays are donated to the step, so their update happens in place.
- A batch whose every row is plain greedy runs `model_step_greedy`: the sampler's argmax inside the step, so the
  [S, V] logits never leave it (no float32 copy, no log-sum-exp, no second dispatch).
- Tensor parallelism (`RunnerSpec.plan`, a gemmajax.parallel.ShardPlan): caches are allocated split by KV head,
  the step keeps their sharding (so donation still aliases) and returns replicated tokens / logits, and each
  layer's attention runs per shard under shard_map (the Pallas kernel cannot be partitioned by GSPMD).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gemmajax.config import FULL, SLIDING, ModelConfig
from gemmajax.engine.sampler import _argmax as greedy_argmax  # the sampler's own greedy rule: same tokens
from gemmajax.kv.attention import RaggedMeta, ragged_paged_attention
from gemmajax.kv.layout import KVLayout
from gemmajax.model import gemma
from gemmajax.model.gemma import pytree_dataclass
from gemmajax.parallel import AXIS
from gemmajax.quant.array import QuantArray
from gemmajax.quant.ops import dense_argmax_cpu, dense_cpu_form, dense_matmul, dense_matmul_cpu_f32

f32 = jnp.float32


@pytree_dataclass
class StepInputs:
    """Device inputs of one step (shapes are bucketed; T tokens, S sequences)."""

    token_ids: Any        # int32 [T]
    positions: Any        # int32 [T]
    logits_indices: Any   # int32 [R]: rows that get logits (R = S: each sequence's last token; more when verifying)
    metas: tuple          # per KV group: RaggedMeta over the T tokens
    shared_metas: tuple   # per KV group: RaggedMeta over the R logits rows (KV-shared layers compute only those)
    # Image / audio soft tokens (None in text-only steps: another compiled variant only when media are in the step)
    soft_mask: Any = None     # bool [T]: the token's embedding is a soft token (its id is the pad id)
    soft_rows: Any = None     # [T, D] model dtype: the soft token of each such row (zeros elsewhere)
    block_lo: Any = None      # int32 [T]: first / last position of the token's image block (lo > hi: none); the
    block_hi: Any = None      # keys it also sees on bidirectional models (RunnerSpec.block_mode says which layers)


@dataclass(frozen=True)
class RunnerSpec:
    """Static description of the runner's caches (hashable: part of the jit key)."""

    cfg: ModelConfig
    groups: tuple[str, ...]           # KV group names in order, e.g. ("sliding", "full")
    page_size: int
    num_pages: tuple[int, ...]        # per group
    max_pages_per_seq: int            # page-table width (logical pages of max_model_len)
    kv_dtype: str
    k_scale: float = 1.0
    v_scale: float = 1.0
    attn_impl: str = "auto"
    bits: bool = False                # bit-stored pages (XLA:CPU writes bf16/fp8 pools in place only this way)
    # Which layers see a token's whole image block: "sliding" (Gemma 4's generate: sliding layers, the window
    # still applies) or "all" (the 12B's: every layer, past the window). Only steps with image blocks use it.
    block_mode: str = "sliding"
    # Tensor / expert parallelism: a gemmajax.parallel.ShardPlan (its mesh, and how pages split), or None (one device)
    plan: Any = None
    # 1 + k with speculative decoding, else 1: steps mark their verifications in RaggedMeta.by_row (up to row_q_max
    # tokens each), whose tokens the reference attention computes as one-token steps would (the same bits)
    row_q_max: int = 1

    def group_of(self, layer_index: int) -> int:
        return self.groups.index(self.cfg.layers[layer_index].kind)

    def layouts(self) -> list[KVLayout]:
        out = []
        for li in self.cfg.kv_layers:
            s = self.cfg.layers[li]
            out.append(KVLayout(page_size=self.page_size, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                                dtype=self.kv_dtype, bits=self.bits))
        return out

    def stored_layouts(self) -> list[KVLayout]:
        """The layouts of the page arrays as allocated: `layouts()` with each KV head stored `plan.kv_repeat(K)`
        times (tensor parallelism with fewer KV heads than devices; the same as `layouts()` otherwise)."""
        if self.plan is None:
            return self.layouts()
        return [dataclasses.replace(lay, num_kv_heads=lay.num_kv_heads * self.plan.kv_repeat(lay.num_kv_heads))
                for lay in self.layouts()]

    def kv_shardings(self) -> tuple | None:
        """Per KV-owning layer, the sharding of its pages (None without a plan)."""
        if self.plan is None:
            return None
        return tuple(self.plan.kv_sharding(self.cfg.layers[li].num_kv_heads) for li in self.cfg.kv_layers)

    def page_bytes(self) -> list[int]:
        """Bytes of one page in each group (summed over the group's KV-owning layers)."""
        per = [0] * len(self.groups)
        for li, lay in zip(self.cfg.kv_layers, self.layouts()):
            per[self.group_of(li)] += lay.bytes_per_page()
        return per

    def cache_bytes(self) -> int:
        return sum(n * b for n, b in zip(self.num_pages, self.page_bytes()))


def kv_groups(cfg: ModelConfig) -> tuple[str, ...]:
    kinds = {cfg.layers[li].kind for li in cfg.kv_layers}
    return tuple(k for k in (SLIDING, FULL) if k in kinds)


def _window(cfg: ModelConfig, group: str) -> int | None:
    """The widest window of a sliding group's layers; None for a full group (or a sliding one without windows)."""
    if group != SLIDING:
        return None
    return max((s.window for s in cfg.layers if s.kind == group and s.window is not None), default=None)


def seq_pages(cfg: ModelConfig, group: str, max_model_len: int, page_size: int) -> int:
    """Pages one sequence of up to max_model_len tokens holds in a KV group between steps, at most: its whole
    context in a full group; in a sliding group the keys its next query can see, W - 1 positions, plus the new
    token and up to two tokens of lookahead or a drafter's reach (W + 2 positions), one page more for the span's
    page boundary and one for the page the next token may open. The tokens a step adds past that come out of the
    group's shared `step_pages`."""
    w = _window(cfg, group)
    if w is None:
        return math.ceil(max_model_len / page_size) + 1
    return math.ceil(min(max_model_len, w + 2) / page_size) + 2


def step_pages(cfg: ModelConfig, group: str, max_model_len: int, max_num_batched_tokens: int, page_size: int) -> int:
    """Pages of a sliding group that one step's chunks add beyond every sequence's own `seq_pages`: the step
    writes at most max_num_batched_tokens tokens over all its sequences, and out-of-window pages go back after it
    (BlockManager.release_out_of_window), so the chunk is paid once per pool, not once per sequence. 0 for a full
    group (its sequences' pages already cover their whole context)."""
    if _window(cfg, group) is None:
        return 0
    return math.ceil(min(max_num_batched_tokens, max_model_len) / page_size) + 1


@dataclass(frozen=True)
class PagePlan:
    """Per group: the pages every cache holds whatever its sequences (`fixed`: the null page and `step_pages`) and
    the pages each max_model_len sequence adds (`per_seq`: `seq_pages`), with their bytes at `page_bytes` each."""

    fixed: tuple[int, ...]
    per_seq: tuple[int, ...]
    page_bytes: tuple[int, ...]

    @classmethod
    def of(cls, cfg: ModelConfig, groups, page_bytes, *, max_model_len: int, max_num_batched_tokens: int,
           page_size: int) -> PagePlan:
        return cls(tuple(1 + step_pages(cfg, g, max_model_len, max_num_batched_tokens, page_size) for g in groups),
                   tuple(seq_pages(cfg, g, max_model_len, page_size) for g in groups), tuple(page_bytes))

    @property
    def fixed_bytes(self) -> int:
        return sum(n * b for n, b in zip(self.fixed, self.page_bytes))

    @property
    def seq_bytes(self) -> int:
        return sum(n * b for n, b in zip(self.per_seq, self.page_bytes))

    def seqs_for(self, budget: int) -> float:
        """Sequences' worth (fractional) a byte budget buys beside the fixed pages."""
        return max(0.0, (budget - self.fixed_bytes) / self.seq_bytes) if self.seq_bytes else float("inf")

    def pages(self, n: float) -> tuple[int, ...]:
        """Pages per group holding the fixed pages and n sequences' worth (at least 2: the null page and one)."""
        return tuple(max(2, f + math.floor(n * k)) for f, k in zip(self.fixed, self.per_seq))


def plan_pages(cfg: ModelConfig, *, page_size: int, kv_dtype: str, max_model_len: int, max_num_seqs: int,
               max_num_batched_tokens: int, kv_cache_memory: int) -> tuple[int, ...]:
    """Pages per group for a byte budget: each group gets the null page, its `step_pages` (a sliding group: one
    step's chunk, shared) and `seq_pages` for each of max_num_seqs sequences of max_model_len tokens. A smaller
    budget keeps the null and step pages and buys n < max_num_seqs sequences' worth (gemmajax.aot.plan_kv spends a
    budget the same way, without the cap); below one full-length sequence's worth every group shrinks in proportion
    instead. Too few pages never break a step (the scheduler preempts), but a request longer than a group's pool
    is refused at admission."""
    groups = kv_groups(cfg)
    probe = RunnerSpec(cfg, groups, page_size, (1,) * len(groups), 1, kv_dtype)
    pp = PagePlan.of(cfg, groups, probe.page_bytes(), max_model_len=max_model_len,
                     max_num_batched_tokens=max_num_batched_tokens, page_size=page_size)
    n = min(float(max_num_seqs), pp.seqs_for(kv_cache_memory))
    if n < 1:   # less than one full-length sequence: every group shrinks in proportion (the full group keeps its
        need = [f + max_num_seqs * k for f, k in zip(pp.fixed, pp.per_seq)]   # share: a long request still fits)
        frac = kv_cache_memory / sum(m * b for m, b in zip(need, pp.page_bytes))
        return tuple(max(2, int(m * frac)) for m in need)
    return pp.pages(n)


def alloc_caches(spec: RunnerSpec) -> tuple:
    """Zeroed page arrays, one per KV-owning layer; with a plan, created in place on its mesh (split by KV head:
    no device ever holds more than its share)."""
    if spec.plan is None:
        return tuple(lay.alloc_pages(spec.num_pages[spec.group_of(li)])
                     for li, lay in zip(spec.cfg.kv_layers, spec.layouts()))
    return tuple(jax.jit(functools.partial(lay.alloc_pages, spec.num_pages[spec.group_of(li)]), out_shardings=sh)()
                 for li, lay, sh in zip(spec.cfg.kv_layers, spec.stored_layouts(), spec.kv_shardings()))


def abstract_caches(spec: RunnerSpec, sharding=None) -> tuple:
    """Shapes only. sharding: one sharding for every layer, or None (with a plan: each layer's own)."""
    shs = spec.kv_shardings() if sharding is None and spec.plan is not None else (sharding,) * len(spec.cfg.kv_layers)
    return tuple(lay.abstract(spec.num_pages[spec.group_of(li)], sh)
                 for li, lay, sh in zip(spec.cfg.kv_layers, spec.stored_layouts(), shs))


class LayerStack:
    """A model's layers with the leaves that repeat from layer to layer stored once per kind, stacked over the layers:
    what `Weights.layers` holds after `stack_layers`. Iterating (inside the traced step) gives each layer's
    `LayerWeights`, its stacked leaves indexed at the layer (a slice XLA fuses into the matmul reading it).

    Why: a jitted call's dispatch costs per argument. Gemma 3 270M in w8a8+emb8 has 363 weight leaves; its 1-stream step
    spent 1.04-1.18 ms (min; median 1.23-1.90) in each call (2-core AMD EPYC, 2026-12-04), on a machine whose cores run
    the step. An 18-layer w8a8 stack called with its 252 int8 leaves apart or as 14 stacked ones: dispatch 0.68 ->
    0.25 ms, one row 4.75 -> 4.27 ms synced and 4.06 -> 3.82 ms pipelined (docs/cpu_notes_2026-12-04_late.md).

    Stacked: QuantArray projections (`kinds`) and vectors (norms, layer scalars). Plain 16-bit matrices stay one leaf
    per layer: XLA:CPU copies a slice before a YNNPACK GEMM reads it (the same bf16 stack: 16 rows 23.4 -> 81.6 ms).
    Layers are grouped by their tree and leaf shapes (Gemma 4's full-attention layers differ from its sliding ones)."""

    def __init__(self, stacked: tuple, loose: tuple, groups: tuple):
        self.stacked = stacked   # per group: the stacked leaves, [layers of the group, ...] each
        self.loose = loose       # per layer: its leaves that are not stacked
        self.groups = groups     # static, per group: (layer treedef, layer indices, which leaf positions are stacked)

    def __len__(self) -> int:
        return len(self.loose)

    def __iter__(self):
        return iter(self.layers())

    def __getitem__(self, i):
        return self.layers()[i]

    def layers(self) -> tuple:
        """Every layer's LayerWeights. Not cached: outside a trace each call copies the stacked rows it indexes."""
        out = [None] * len(self.loose)
        for stacked, (treedef, members, mask) in zip(self.stacked, self.groups):
            for row, li in enumerate(members):
                st, lo = iter(stacked), iter(self.loose[li])
                out[li] = treedef.unflatten([next(st)[row] if m else next(lo) for m in mask])
        return tuple(out)


jax.tree_util.register_pytree_node(
    LayerStack, lambda ls: ((ls.stacked, ls.loose), ls.groups), lambda groups, ch: LayerStack(ch[0], ch[1], groups))


def _as_leaf(x) -> bool:
    return isinstance(x, QuantArray)


def stack_layers(weights: gemma.Weights, kinds: tuple[str, ...] = ("int8",)) -> gemma.Weights:
    """`weights` with `layers` as a LayerStack (see there): same numbers, fewer jit arguments. Copies the stacked
    leaves (the caller drops its references to the old tree to free them)."""
    if isinstance(weights.layers, LayerStack):
        return weights

    def stackable(x) -> bool:
        if isinstance(x, QuantArray):
            return x.kind in kinds and x.ndim == 2
        return x.ndim <= 1

    def signature(x):
        if isinstance(x, QuantArray):
            return ("q", x.kind, x.shape, x.group, x.dtype, x.act_group, x.values.shape, x.values.dtype,
                    x.scale.shape, x.scale.dtype)
        return (tuple(x.shape), jnp.dtype(x.dtype))

    flat = [jax.tree.flatten(lw, is_leaf=_as_leaf) for lw in weights.layers]
    keys: dict = {}
    for li, (leaves, treedef) in enumerate(flat):
        keys.setdefault((treedef, tuple(signature(x) for x in leaves)), []).append(li)
    stacked, loose, groups = [], [None] * len(flat), []
    for (treedef, _), members in keys.items():
        leaves0 = flat[members[0]][0]
        mask = tuple(len(members) > 1 and stackable(x) for x in leaves0)
        parts = []
        for k, m in enumerate(mask):
            if not m:
                continue
            xs = [flat[li][0][k] for li in members]
            if isinstance(xs[0], QuantArray):
                parts.append(dataclasses.replace(xs[0], values=jnp.stack([x.values for x in xs]),
                                                 scale=jnp.stack([x.scale for x in xs]),
                                                 shape=(len(xs),) + xs[0].shape))
            else:
                parts.append(jnp.stack(xs))
        for li in members:
            loose[li] = tuple(x for x, m in zip(flat[li][0], mask) if not m)
        stacked.append(tuple(parts))
        groups.append((treedef, tuple(members), mask))
    return dataclasses.replace(weights, layers=LayerStack(tuple(stacked), tuple(loose), tuple(groups)))


def unstack_layers(weights: gemma.Weights) -> gemma.Weights:
    """The standard tree (`layers` a tuple of LayerWeights) of weights that `stack_layers` stacked: the stacked
    leaves are copied out per layer. Other weights are returned as they are."""
    if not isinstance(weights.layers, LayerStack):
        return weights
    return dataclasses.replace(weights, layers=weights.layers.layers())


def model_step(weights: gemma.Weights, spec: RunnerSpec, kv: tuple, inp: StepInputs, *, greedy: bool = False,
               hidden: bool = False) -> tuple[Any, tuple]:
    """Run the scheduled tokens through the model. Returns (logits [R, V] float32 of the logits rows: each
    sequence's last token, or its verified tokens; updated kv).

    greedy: the sampler's greedy rule (first index of the row maximum) inside the same program, tokens int32 [R]
    instead of logits: the [R, V] logits never leave the step (no float32 copy, log-sum-exp or second dispatch for
    an all-greedy batch). hidden: ((out, final-normed hidden [R, D]), kv), the drafter's input."""
    if spec.plan is not None:
        weights = spec.plan.annotate(weights)      # quantized kernels per shard (gemmajax.quant.sharded)
    h, kv = model_hidden(weights, spec, kv, inp)
    out = greedy_tokens(weights, spec.cfg, h) if greedy else gemma.lm_head(weights, spec.cfg, h).astype(f32)
    return ((out, h) if hidden else out), kv


def greedy_tokens(weights: gemma.Weights, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """The sampler's greedy rule on `gemma.lm_head(weights, cfg, h)`: int32 [R], the first index of each row's
    maximum, taken on the activation-dtype logits themselves (their float32 copy is exact and order-preserving: the
    same token, without two passes over [R, V]). A plain 16-bit table with no final softcap on the CPU goes one step
    further: the float32 sums are rounded inside the argmax (`_argmax` round_to), so no rounded copy is written either.
    Lone, on XLA:CPU, 16 rows of 262,144 logits: 1.9 ms for the float32 copy's argmax, 1.1 for the bf16 logits',
    0.66 rounding inside. Gemma 3 270M bf16, 16-stream step (bench/step_breakdown.py children, alternating, 3 each,
    load 0.9-1.7, not a quiet machine): the float32 copy 61.7-71.9 ms (best of 4 61.7), the bf16 logits' 57.8-63.1 (4)
    and 59.2-63.0 (3), rounding inside 57.1-59.5 (3). Where `dense_matmul_cpu` would take its "tiles" (no bf16
    hardware, 8 to 128 rows), the argmax is taken tile by tile as each tile's product is made (ops.dense_argmax_cpu):
    no [R, V] logits at all."""
    e = weights.embed
    if cfg.final_logit_softcap or isinstance(e, QuantArray) or jnp.dtype(h.dtype).itemsize != 2:
        return greedy_argmax(gemma.lm_head(weights, cfg, h))

    def cpu(h, e):
        if dense_cpu_form(math.prod(h.shape[:-1]), e) == "tiles":
            return dense_argmax_cpu(h, e, round_to=h.dtype)
        return greedy_argmax(dense_matmul_cpu_f32(h, e), round_to=h.dtype)
    return jax.lax.platform_dependent(h, e, cpu=cpu, default=lambda h, e: greedy_argmax(dense_matmul(h, e)))


def model_step_greedy(weights: gemma.Weights, spec: RunnerSpec, kv: tuple, inp: StepInputs) -> tuple[Any, tuple]:
    """`model_step` with greedy=True: (tokens int32 [R], updated kv)."""
    return model_step(weights, spec, kv, inp, greedy=True)


def model_decode_steps(weights: gemma.Weights, spec: RunnerSpec, kv: tuple, inp: StepInputs, steps: jax.Array,
                       max_steps: int) -> tuple[Any, tuple]:
    """Up to `max_steps` greedy decode steps in one program (a `while` on the device), of which the first `steps`
    (int32 scalar, 1 <= steps <= max_steps; traced: one program for every count) run. `inp` is a decode-only step
    (one token and one logits row per sequence slot); step i > 0 feeds each real sequence the token step i - 1 picked,
    at the next position (its kv_lens and position one further: its pages must already cover it). Each step is
    `model_step(greedy=True)` itself, so the tokens are those of `steps` separate calls wherever the
    compiler gives the loop body the one-step program's bits (on XLA:CPU every test and bench so far; on a TPU v5e
    bf16 E2B's did, w8a8+emb4's did not: near-tied tokens came out second-ranked, README "On a real TPU v5e
    (2026-12-08)").

    Returns ((tokens int32 [max_steps, R]: row i the tokens of step i, rows >= steps zero; the last step's tokens
    [R]), updated kv).

    The weights ride in the loop's carry through an optimization barrier. Closed over by the loop body instead, they
    are loop invariants, and XLA:CPU hoists what it derives from them out of the `while`: every int8 weight widened
    to float32 for the one-row matrix-vector products, materialized (about 1 GB for Gemma 3 270M w8a8+emb8) once per
    call. Measured (2-core Zen 4, 1 stream): 55-106 ms a token without the barrier, 8.6-9.3 with it."""
    real = jnp.arange(inp.metas[0].kv_lens.shape[0]) < inp.metas[0].num_seqs[0]

    def advanced(i):
        d = jnp.where(real, i, 0).astype(jnp.int32)   # padding slots stay empty (kv_len 0: nothing written)

        def meta(m):
            return dataclasses.replace(m, kv_lens=m.kv_lens + d)
        return d, tuple(meta(m) for m in inp.metas), tuple(meta(m) for m in inp.shared_metas)

    def body(i, carry):
        kv, tok, w, out = carry
        w = jax.lax.optimization_barrier(w)
        d, metas, shared = advanced(i)
        x = dataclasses.replace(inp, token_ids=tok, positions=inp.positions + d, metas=metas, shared_metas=shared)
        new, kv = model_step(w, spec, kv, x, greedy=True)
        return kv, new, w, jax.lax.dynamic_update_index_in_dim(out, new, i, 0)

    tok0 = jnp.asarray(inp.token_ids, jnp.int32)
    out0 = jnp.zeros((max_steps, tok0.shape[0]), jnp.int32)
    kv, last, _, out = jax.lax.fori_loop(0, jnp.clip(steps, 1, max_steps), body, (kv, tok0, weights, out0))
    return (out, last), kv


def model_hidden(weights: gemma.Weights, spec: RunnerSpec, kv: tuple, inp: StepInputs) -> tuple[jax.Array, tuple]:
    """The decoder part of `model_step`: (final-normed hidden [S, D] of each sequence's last token, kv). With a plan,
    `weights` are as model_step passes them: annotated (ShardPlan.annotate)."""
    cfg = spec.cfg

    def make_attend(metas, blocks=None):
        def attend(lspec, q, k, v, pages):
            meta = metas[spec.groups.index(lspec.kind)]
            if blocks is not None and (spec.block_mode == "all" or lspec.window is not None):   # image blocks
                meta = dataclasses.replace(meta, block_lo=blocks[0], block_hi=blocks[1],
                                           block_in_window=spec.block_mode != "all")
            out, pages = _attention(spec, lspec, q[0], None if k is None else k[0], None if v is None else v[0],
                                    pages, meta)
            return out[None], pages
        return attend

    def shared_band(x, positions, ple):
        idx = inp.logits_indices
        ple = None if ple is None else ple[:, idx]
        return x[:, idx], positions[:, idx], ple, make_attend(inp.shared_metas)

    has_shared = cfg.first_shared_layer < cfg.num_layers
    # Without KV-shared layers, the last layer carries only the logits rows past its attention (`last_rows`): with
    # prompt tokens in the step that skips its o_proj and MLP for every other token (most of the last of Gemma 3
    # 270M's 18 layers: its q / k / v projections still run on every token). A step with as many tokens as logits
    # rows (all decode) has nothing to skip and keeps the plain gather.
    tail = not has_shared and inp.token_ids.shape[0] > inp.logits_indices.shape[0]
    soft = None if inp.soft_mask is None else (inp.soft_mask[None], inp.soft_rows[None])
    h, kv = gemma.decoder(weights, cfg, inp.token_ids[None], inp.positions[None],
                          make_attend(inp.metas, None if inp.block_lo is None else (inp.block_lo, inp.block_hi)), kv,
                          shared_band=shared_band if has_shared else None, soft_tokens=soft,
                          last_rows=inp.logits_indices if tail else None)
    h = h[0] if has_shared or tail else h[0, inp.logits_indices]      # [S, D]
    return h, kv


def _attention(spec: RunnerSpec, lspec, q, k, v, pages, meta):
    """One layer's ragged paged attention. q [T, N, H]; k, v [T, K, H] or None (KV-shared layer); pages
    [P, 2K', page_size, H]. With a plan that splits the layer's pages, K/V are repeated to the stored K' heads and
    the call runs per shard (local heads, local pages: no gather, and the Pallas kernel sees plain arrays); pages
    that do not split run whole on every device, also under shard_map (Mosaic kernels cannot be partitioned)."""
    cfg = spec.cfg
    kw = {"sm_scale": cfg.attn_scale, "sliding_window": lspec.window, "soft_cap": cfg.attn_logit_softcap,
          "k_scale": spec.k_scale, "v_scale": spec.v_scale, "impl": spec.attn_impl, "kv_dtype": spec.kv_dtype}

    def call(q, k, v, pages, meta):
        return ragged_paged_attention(q, k, v, pages, meta, **kw)

    plan = spec.plan
    if plan is None:
        return call(q, k, v, pages, meta)
    num_kv = cfg.layers[lspec.kv_source].num_kv_heads
    r = plan.kv_repeat(num_kv)
    if k is not None and r > 1:     # head j stored as heads j*r .. j*r + r - 1: query head n still reads n // (N/K)
        k, v = jnp.repeat(k, r, axis=1), jnp.repeat(v, r, axis=1)
    if plan.kv_pages_split(num_kv):
        heads, pg = P(None, AXIS, None), P(None, AXIS, None, None)
    else:   # replicated pages: every device runs the whole layer (a Pallas call still needs a shard_map around it)
        heads, pg = P(), P()
    if k is None:
        return jax.shard_map(lambda q, pages, meta: call(q, None, None, pages, meta), mesh=plan.mesh,
                             in_specs=(heads, pg, P()), out_specs=(heads, pg), check_vma=False)(q, pages, meta)
    return jax.shard_map(call, mesh=plan.mesh, in_specs=(heads, heads, heads, pg, P()), out_specs=(heads, pg),
                         check_vma=False)(q, k, v, pages, meta)


# ---------------------------------------------------------------------------- host-side batch building

def bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


def token_buckets(lo: int, hi: int, dense: bool = False) -> tuple[int, ...]:
    """Step token counts to compile for: powers of 2 from lo, then hi; dense adds the midpoints 3 x 2^k from 24.

    A step pays for its whole bucket, so a power-of-2 ladder wastes up to half a step. On XLA:CPU the GEMMs cost
    in proportion to their rows from about 16 up and a compile takes seconds, so the CPU engine uses the dense
    ladder. Measured on Gemma 3 270M, 2 cores, time to first token, powers of 2 -> dense: one 24-token prompt
    47.5 -> 42.4 ms, one of 40 68.2 -> 57.7 ms, 16 of 24 (384 tokens) 388 -> 300 ms, one of 300 392 -> 307 ms.
    Accelerators keep powers of 2: every bucket is a compile of minutes and host memory (vLLM-TPU cut its token
    buckets to four for that reason, ../shared/reference/anchors.md)."""
    mids = [3 << k for k in range(3, hi.bit_length()) if lo <= (3 << k) < hi] if dense else []  # 24, 48, 96, ...
    return tuple(sorted(set(pow2_buckets(lo, hi)) | set(mids)))


def step_shapes(s_buckets: tuple[int, ...], t_buckets: tuple[int, ...]) -> list[tuple[int, int, bool]]:
    """Every (tokens T, sequences S, decode_only) shape an engine with these buckets runs: all-decode steps padded
    to a sequence bucket (T = S, decode_only), mixed steps to max(token bucket, sequence bucket) (the rule of
    `LLMEngine._dispatch`; `gemmajax aot` compiles the largest of each). Speculative verification steps add a
    padded number of logits rows on top (not listed)."""
    shapes = [(s, s, True) for s in s_buckets]
    shapes += sorted({(max(t, s), s, False) for s in s_buckets for t in t_buckets})
    return shapes


def build_step_inputs(spec: RunnerSpec, entries: list[tuple], t_pad: int, s_pad: int,
                      r_pad: int | None = None) -> StepInputs:
    """entries: per sequence (token ids to compute, start position, num tokens, page tables per group[, logits
    rows]): the last `logits rows` tokens of the entry (default 1) get logits, e.g. 1 + k for a speculative
    verification of k drafted tokens. r_pad: the padded number of logits rows (default s_pad, one per sequence).

    Returns numpy-backed StepInputs padded to t_pad tokens, s_pad sequences and r_pad logits rows."""
    n = len(entries)
    r_pad = s_pad if r_pad is None else r_pad
    tok = np.zeros(t_pad, np.int32)
    pos = np.zeros(t_pad, np.int32)
    cu = np.zeros(s_pad + 1, np.int32)
    kv_lens = np.zeros(s_pad, np.int32)
    rows = np.zeros(r_pad, np.int32)
    cu_rows = np.zeros(s_pad + 1, np.int32)
    tables = [np.zeros((s_pad, spec.max_pages_per_seq), np.int32) for _ in spec.groups]
    t = r = 0
    for i, (ids, start, num, pts, *more) in enumerate(entries):
        nr = more[0] if more else 1
        tok[t:t + num] = ids
        pos[t:t + num] = np.arange(start, start + num)
        t += num
        cu[i + 1] = t
        kv_lens[i] = start + num
        rows[r:r + nr] = np.arange(t - nr, t)
        r += nr
        cu_rows[i + 1] = r
        for g, pt in enumerate(pts):
            tables[g][i, :len(pt)] = pt
    if r > r_pad:
        raise ValueError(f"build_step_inputs: {r} logits rows do not fit r_pad={r_pad}")
    cu[n + 1:] = t
    cu_rows[n + 1:] = r
    num = np.array([n], np.int32)
    dec = t == n and t_pad == s_pad  # one token per sequence: the attention's decode-only form
    # verifications (every token gets logits): computed token by token in the reference attention
    by_row = (np.diff(cu_rows) > 1) if spec.row_q_max > 1 else None
    metas = tuple(RaggedMeta(cu_q_lens=cu, kv_lens=kv_lens, page_indices=tab, num_seqs=num, decode_only=dec,
                             by_row=by_row, row_q_max=spec.row_q_max) for tab in tables)
    # KV-shared layers: only the tokens that get logits (the last of each sequence, or its verified tokens)
    one = r == n and r_pad == s_pad
    shared = tuple(RaggedMeta(cu_q_lens=cu_rows, kv_lens=kv_lens, page_indices=tab, num_seqs=num, decode_only=one,
                              by_row=by_row, row_q_max=spec.row_q_max) for tab in tables)
    return StepInputs(token_ids=tok, positions=pos, logits_indices=rows, metas=metas, shared_metas=shared)


def compiled_step(spec: RunnerSpec, greedy: bool = False, hidden: bool = False):
    """The jitted step for a runner spec, shared by every runner (engine) with the same spec, so a second engine
    over the same model reuses the compiled programs. greedy: `model_step_greedy` (tokens) instead of logits;
    hidden: also return the final-normed hidden [R, D] of the logits rows (a drafter's input): ((out, h), kv).
    One jitted function per (spec, greedy, hidden), however the flags are passed (positional, keyword, defaulted)."""
    return _compiled_step(spec, bool(greedy), bool(hidden))


@functools.lru_cache(maxsize=16)
def _compiled_step(spec: RunnerSpec, greedy: bool, hidden: bool):
    def step(weights, kv, inp):
        return model_step(weights, spec, kv, inp, greedy=greedy, hidden=hidden)
    if spec.plan is None:
        return jax.jit(step, donate_argnums=(1,))
    # Inputs replicated (numpy or a lookahead step's device tokens: one program for both), pages kept where they are
    # (so donation aliases), tokens / logits replicated (the host reads them; every process holds them).
    rep = spec.plan.replicated
    return jax.jit(step, donate_argnums=(1,), in_shardings=(None, spec.kv_shardings(), rep),
                   out_shardings=(rep, spec.kv_shardings()))


@functools.lru_cache(maxsize=16)
def compiled_decode_steps(spec: RunnerSpec, max_steps: int):
    """The jitted `model_decode_steps` for a runner spec and a most number of steps (shared like `compiled_step`):
    f(weights, kv, inp, steps) -> ((tokens [max_steps, R], last tokens [R]), kv)."""
    def step(weights, kv, inp, steps):
        return model_decode_steps(weights, spec, kv, inp, steps, max_steps)
    if spec.plan is None:
        return jax.jit(step, donate_argnums=(1,))
    rep = spec.plan.replicated
    return jax.jit(step, donate_argnums=(1,), in_shardings=(None, spec.kv_shardings(), rep, rep),
                   out_shardings=((rep, rep), spec.kv_shardings()))


class ModelRunner:
    """Owns the device caches and the compiled step functions for one model."""

    def __init__(self, weights: gemma.Weights, spec: RunnerSpec, sample_fn=None):
        self.weights = weights
        self.spec = spec
        self.kv = alloc_caches(spec)
        self._sample_fn = sample_fn

    def forward(self, inp: StepInputs, hidden: bool = False):
        """Run one step; updates the caches in place (donated). Returns logits [R_pad, V] float32 (on device), or
        with hidden (logits, final-normed hidden [R_pad, D])."""
        out, self.kv = compiled_step(self.spec, False, hidden)(self.weights, self.kv, inp)
        return out

    def forward_greedy(self, inp: StepInputs, hidden: bool = False):
        """Run one step and pick every row's greedy token on device. Returns tokens int32 [R_pad] (on device), or
        with hidden (tokens, hidden [R_pad, D])."""
        out, self.kv = compiled_step(self.spec, True, hidden)(self.weights, self.kv, inp)
        return out

    def forward_decode_steps(self, inp: StepInputs, steps: int, max_steps: int):
        """Run `steps` greedy decode steps (1 <= steps <= max_steps) of a decode-only batch in one program
        (`model_decode_steps`). Returns (tokens int32 [max_steps, R_pad], the last step's tokens [R_pad]), on
        device."""
        if not 1 <= steps <= max_steps:
            raise ValueError(f"forward_decode_steps: steps must be in [1, {max_steps}], got {steps}")
        out, self.kv = compiled_decode_steps(self.spec, max_steps)(self.weights, self.kv, inp, np.int32(steps))
        return out
