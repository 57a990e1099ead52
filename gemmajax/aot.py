"""`gemmajax aot`: does model X fit TPU chip Y? Deviceless compiles of the serving step through libtpu, no TPU.

Design choices: weights, paged caches and step inputs are ShapeDtypeStructs placed on a device of a TPU topology
description, so nothing is allocated and the real TPU compiler (Mosaic for the Pallas kernels, XLA:TPU for the
rest) enforces the chip's HBM: a RESOURCE_EXHAUSTED compile means "does not fit", with the compiler's numbers.
The programs compiled are the ones the engine runs (`programs`: the shapes of `LLMEngine.step_shapes` by the same rule,
`step_shapes`, with its decode_only flags, each as the greedy-token and the logits variant of `runner.compiled_step`).
The KV budget is what is left of the compiler's HBM limit after weights, the compiled steps' temporaries (measured
with a small cache) and a margin; the cache it buys is proven by compiling the step again at that size. A
checkpoint's vision / audio towers (`tower_preset`; --no-mm: text only) are held beside the text weights, so they
come out of the KV budget, and each encoder is compiled on one of its largest inputs (`compile_encoders`); the
encoders run in their own programs, so the peak takes the larger of a step's buffers and an encoder's. Speed is a
roofline projection (bytes read per decode step over HBM bandwidth) and is printed as a projection, never as a
measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# libtpu takes a machine-wide lock file unless told otherwise; deviceless compiles never touch a TPU, so several
# processes (this one, tests, other tools) may load it at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gemmajax.config import ModelConfig  # noqa: E402
from gemmajax.engine.llm_engine import EngineConfig  # noqa: E402
from gemmajax.engine.runner import (  # noqa: E402
    PagePlan,
    RunnerSpec,
    StepInputs,
    abstract_caches,
    bucket,
    build_step_inputs,
    compiled_decode_steps,
    compiled_step,
    kv_groups,
    pow2_buckets,
    seq_pages,
    step_shapes,
    token_buckets,
)
from gemmajax.kv.attention import kernel_supports  # noqa: E402
from gemmajax.kv.layout import kv_dtype as resolve_kv_dtype  # noqa: E402
from gemmajax.kv.layout import resolve_auto  # noqa: E402
from gemmajax.model import gemma  # noqa: E402
from gemmajax.quant.gmm import row_tile  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
MODELS = ("e2b", "e4b", "12b", "26b-a4b", "31b")
# The encoders' largest inputs: soft tokens per image (what engine.chat.prepare_media asks tools.media for) and the
# longest clip (tools.media.audio_features truncates Gemma 4 audio at 30 s).
MAX_SOFT_TOKENS = 280
AUDIO_SECONDS = 30.0
EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_UNSUPPORTED, EXIT_COMPILE_ERROR = 0, 1, 2, 3
# The programs `analyze` can compile (see `programs`): the largest all-decode step and the largest mixed step, each
# as the engine's greedy variant (tokens out) and its logits variant.
STEPS = ("decode", "decode-greedy", "prefill", "prefill-greedy")
# With a drafter (speculative decoding) the engine also runs the verification step (each sequence's newest token and
# its k drafts in one ragged step, logits at every row) and the drafter's own k-step program.
SPEC_STEPS = ("verify", "verify-greedy")
# Slices `--topology` takes (chips along x by y): one chip, or tensor parallelism over every chip of the slice.
TOPOLOGIES = ("1x1", "2x2", "2x4")


def topology_chips(topology: str) -> int:
    """Chips in a supported topology string ("2x4" -> 8); ValueError naming the accepted ones otherwise."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology {topology!r} is not supported; expected one of {list(TOPOLOGIES)} (chips along "
                         f"x by y: one chip, or tensor parallelism over a 4- or 8-chip slice)")
    return math.prod(int(x) for x in topology.split("x"))


@dataclass(frozen=True)
class Chip:
    """One TPU chip: HBM as sold, the HBM a compiled program may use (the compiler's own limit, read from its
    RESOURCE_EXHAUSTED message with libtpu 0.0.52) and the HBM bandwidth used for the roofline projection."""

    name: str
    hbm_bytes: int
    hbm_limit: int
    bandwidth: float  # bytes / s


CHIPS: dict[str, Chip] = {
    "v5e": Chip("v5e", 16 * GiB, int(15.75 * GiB), 819e9),
    "v6e": Chip("v6e", 32 * GiB, int(31.24 * GiB), 1640e9),
}


@dataclass(frozen=True)
class AotRequest:
    """What to check. `cfg` is a preset's config or any ModelConfig (tests use tiny ones through the same path)."""

    cfg: ModelConfig
    chip: str = "v5e"
    topology: str = "1x1"               # TOPOLOGIES; tensor parallel size = its number of chips
    expert_parallel: bool = False        # MoE expert stacks split on E across the chips (else along their width)
    quant: str = "none"
    kv_dtype: str = "auto"               # "auto" = the model's dtype, as the engine
    max_model_len: int = 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    page_size: int = 32
    margin_bytes: int = 256 * MiB
    proj_context: int | None = None      # context length of the roofline projection (default: max_model_len)
    dtype: str = "bfloat16"              # weight / activation dtype of the unquantized parts
    attn_impl: str = "pallas"            # "pallas" (TPU kernel) | "ref" (the jnp path); pallas falls back to ref
    probe: bool = True                   # compile every step with a small cache first to measure temporaries
    steps: tuple[str, ...] = STEPS       # which of STEPS (+ SPEC_STEPS with a drafter) to compile
    # decode-greedy as the engine runs it: a program of this many decode steps (runner.model_decode_steps; the
    # engine's num_scheduler_steps), or the one-step program with 1 (and always with a drafter)
    num_scheduler_steps: int = EngineConfig.num_scheduler_steps
    # Speculative decoding with a gemma4_assistant drafter (model.assistant.AssistantConfig; one chip only): every
    # step then also returns the hidden state (the engine's hidden=True programs), the verify steps and the drafter
    # are compiled, the drafter's weights join the budget; the projection assumes `assumed_acceptance` per draft.
    draft: Any = None
    num_speculative_tokens: int = 4
    assumed_acceptance: float = 0.7
    # probe=False (the fit table's fast mode): size the cache from weights + overhead_guess, compile every step at
    # that size (the last of `steps` first), then once more at the size their measured overhead allows when the
    # guess was off
    overhead_guess: int = 512 * MiB
    # The checkpoint's vision / audio towers (model.multimodal.MultimodalConfig; `tower_preset` for a published
    # size, None: none). mm=False (--no-mm): text only, the towers not loaded. With towers their weights are held
    # beside the text weights and each encoder is compiled on one of its largest inputs (`encoder_program`).
    towers: Any = None
    mm: bool = True
    max_soft_tokens: int = MAX_SOFT_TOKENS
    audio_seconds: float = AUDIO_SECONDS

    @property
    def model_name(self) -> str:
        return self.cfg.name or "custom"


class _CompiledMemory:
    """What a compile's memory analysis says, for StepCompile and EncoderCompile (fields argument_bytes,
    output_bytes, alias_bytes, temp_bytes, code_bytes, oom, error)."""

    @property
    def ok(self) -> bool:
        return self.oom is None and self.error is None

    @property
    def peak_bytes(self) -> int:
        """HBM the program holds while it runs: arguments + outputs not aliased to arguments + temporaries + code."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes


@dataclass
class StepCompile(_CompiledMemory):
    """One deviceless compile of the serving step: its shape and what the compiler reported (bytes per chip: on a
    slice the program is the one SPMD partition every chip runs)."""

    step: str                 # one of STEPS
    tokens: int               # T (bucketed)
    seqs: int                 # S (bucketed)
    kv_pages: tuple[int, ...]  # pages per KV group in this compile
    kv_bytes: int             # KV pages one chip holds (all of them on 1x1)
    decode_only: bool = False  # the metas' decode_only flag (the attention's all-decode form)
    greedy: bool = False      # the greedy variant (tokens [S] out) rather than logits [S, V]
    decode_steps: int = 0     # a program of this many decode steps (tokens [steps, S] and [S] out); 0: one step
    weight_bytes: int = 0     # of argument_bytes, the weights the program takes (one chip's)
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    seconds: float = 0.0
    attn_impl: str = ""
    pallas_calls: int = 0     # Mosaic (Pallas TPU) kernel calls in the lowered program
    oom: str | None = None    # the compiler's RESOURCE_EXHAUSTED message when it did not fit
    error: str | None = None  # any other compile failure

    @property
    def overhead_bytes(self) -> int:
        """Everything but the KV pages (weights, step inputs, logits, temporaries, code)."""
        return self.peak_bytes - self.kv_bytes


@dataclass
class Projection:
    """Roofline projection of decode speed (NOT a measurement): tokens/s = HBM bandwidth / bytes read per step.
    On a slice every figure is one chip's (the chips read their shards in parallel; the interconnect is not
    counted)."""

    context: int
    bytes_1: float            # bytes read by one decode step with 1 sequence
    bytes_16: float           # ... with 16 sequences
    tok_s_1: float            # tokens/s of the one stream
    tok_s_16: float           # aggregate tokens/s of 16 streams
    weights_read: float       # weight bytes read per step at 1 stream (gathers: rows only; tied head: in full)
    kv_read_per_seq: float    # KV bytes one sequence reads per step at `context`
    # speculative decoding (a drafter): rounds of k draft steps + one verify step, `acceptance` ASSUMED per draft
    spec_k: int = 0
    acceptance: float = 0.0   # assumed, not measured
    tokens_per_round: float = 0.0   # (1 - a^(k+1)) / (1 - a): expected accepted drafts + the target's token
    draft_bytes_1: float = 0.0      # bytes one draft step reads, 1 / 16 streams
    draft_bytes_16: float = 0.0
    spec_tok_s_1: float = 0.0
    spec_tok_s_16: float = 0.0


@dataclass
class AotResult:
    """Everything `gemmajax aot` prints (and `--json` dumps)."""

    model: str
    chip: str
    topology: str
    quant: str
    kv_dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int
    hbm_bytes: int
    hbm_limit: int
    bandwidth: float
    margin_bytes: int
    weight_bytes: int                # the whole model (every chip's share together, replicated leaves once)
    weight_breakdown: dict[str, int]
    num_chips: int = 1               # = tensor parallel size
    expert_parallel: bool = False
    weight_bytes_per_chip: int = 0   # what one chip holds: split leaves' shards + replicated leaves whole
    weight_breakdown_per_chip: dict[str, int] = field(default_factory=dict)
    replicated_bytes_per_chip: int = 0   # of which leaves every chip holds whole (norms, unsplittable leaves)
    draft_model: str = ""            # the drafter (speculative decoding), "" without
    draft_weight_bytes: int = 0
    # the vision / audio towers: "vision+audio" etc., "" for none; mm False: --no-mm (text only, not loaded)
    towers: str = ""
    mm: bool = True
    tower_weight_bytes: int = 0       # per chip (replicated: every chip holds the towers whole); 0 with --no-mm
    tower_weight_bytes_skipped: int = 0   # with --no-mm: what the checkpoint's towers would hold
    encoders: list[EncoderCompile] = field(default_factory=list)
    peak_bytes: int = 0               # per chip: weights + held towers / drafter + KV + max(step's, encoders' extra)
    fits: bool = False
    reason: str = ""
    attn_impl: str = ""
    matmul_impl: str = ""
    kv_budget_bytes: int = 0         # per chip
    kv_cache_bytes: int = 0          # the logical cache (every KV head once)
    kv_cache_bytes_per_chip: int = 0  # what one chip holds of it (KV heads split; repeated where fewer than chips)
    kv_pages: dict[str, int] = field(default_factory=dict)
    kv_tokens: int = 0              # full-attention context tokens across sequences the cache holds (see count_note)
    kv_seqs_at_max_len: float = 0.0  # sequences of max_model_len the cache holds at once
    kv_bytes_per_token_ours: float = 0.0    # at max_model_len: windowed sliding layers, KV sharing
    kv_bytes_per_token_vllm: float = 0.0    # every KV-owning layer keeps the whole context
    kv_tokens_vllm_style: int = 0           # the same budget divided by the vLLM-style bytes per token
    count_note: str = ""
    compiles: list[StepCompile] = field(default_factory=list)
    proof: StepCompile | None = None
    projection: Projection | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def temp_bytes(self) -> dict[str, int]:
        """Per step: the compiled program's temporaries on one chip."""
        return {c.step: c.temp_bytes for c in self.compiles if c.ok}

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["exit_code"] = EXIT_FITS if self.fits else EXIT_DOES_NOT_FIT
        return d


# ---------------------------------------------------------------------------------------------------------------
# Abstract weights (shapes only), quantized per the `quant` scheme
# ---------------------------------------------------------------------------------------------------------------

def abstract_model_weights(cfg: ModelConfig, quant: str = "none", dtype: str = "bfloat16",
                           sharding: Any = None) -> gemma.Weights:
    """The model's weight tree as ShapeDtypeStructs (and abstract QuantArrays), placed on `sharding`.

    Every tensor goes through the loaders' own quantizer (gemmajax.quant.loading.make_quantizer) under
    jax.eval_shape, so the tree has exactly the leaves, layouts and QuantArray metadata a loaded checkpoint has
    (projections in the scheme's linear kind, vocabulary tables only with +emb4 / +emb8, norms float32), with no
    memory touched. qat-w4a16 is sized as w4a16 (the same int4 storage; whether a tensor repacks depends on its
    values, which an abstract tree does not have, so every tensor is assumed on-grid).
    """
    from gemmajax.quant import parse_quant, quantize_table
    from gemmajax.quant.loading import make_quantizer

    scheme = parse_quant(quant)
    storage = scheme.name.replace("qat-", "")
    quantizer = make_quantizer(storage)
    wdt = jnp.dtype(dtype)

    def leaf(name: str, sds: jax.ShapeDtypeStruct) -> Any:
        if quantizer is None:
            return sds
        return jax.eval_shape(lambda w: quantizer(name, w), sds)

    w = gemma.abstract_weights(cfg, wdt, quantize=leaf)
    if scheme.table_bits:  # a build_weights that does not pass the tables through `quantize`
        def table(t):
            if not isinstance(t, jax.ShapeDtypeStruct):
                return t
            return jax.eval_shape(lambda a: quantize_table(a, scheme.table_bits), t)
        w = dataclasses.replace(w, embed=table(w.embed), ple_table=table(w.ple_table))
    if sharding is not None:
        w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), w)
    return w


def _nbytes(a: Any) -> int:
    return int(math.prod(a.shape)) * jnp.dtype(a.dtype).itemsize


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of a (possibly abstract) pytree; QuantArrays count values and scales."""
    return sum(_nbytes(a) for a in jax.tree.leaves(tree))


def chip_bytes(tree: Any) -> int:
    """Bytes of a (possibly abstract) pytree's leaves that one chip holds: each leaf's shard shape under its
    sharding (the whole leaf when it has none or is replicated). Even splits only, so every chip holds the same."""
    def one(a) -> int:
        sh = getattr(a, "sharding", None)
        shape = tuple(a.shape) if sh is None else tuple(sh.shard_shape(tuple(a.shape)))
        return int(math.prod(shape)) * jnp.dtype(a.dtype).itemsize
    return sum(one(a) for a in jax.tree.leaves(tree))


def weight_breakdown(w: gemma.Weights, nbytes=tree_bytes) -> dict[str, int]:
    """Bytes by part: embedding (= tied LM head), per-layer embeddings, MoE experts, everything else. nbytes:
    tree_bytes (the whole model) or chip_bytes (one chip's share of a sharded abstract tree)."""
    total = nbytes(w)
    embed = nbytes(w.embed)
    ple = nbytes(w.ple_table) if w.ple_table is not None else 0
    experts = sum(nbytes((lw.moe.gate_up_proj, lw.moe.down_proj)) for lw in w.layers if lw.moe is not None)
    return {"embedding": embed, "per_layer_embedding": ple, "experts": experts,
            "other": total - embed - ple - experts, "total": total}


# ---------------------------------------------------------------------------------------------------------------
# KV accounting
# ---------------------------------------------------------------------------------------------------------------

def _probe_spec(cfg: ModelConfig, page_size: int, kv_dtype: str, plan: Any = None) -> RunnerSpec:
    groups = kv_groups(cfg)
    return RunnerSpec(cfg, groups, page_size, (1,) * len(groups), 1, kv_dtype, plan=plan)


def chip_page_bytes(spec: RunnerSpec) -> list[int]:
    """Bytes of one page in each group that one chip holds: `spec.page_bytes()` without a plan; with one, each
    layer's stored page (KV heads repeated `kv_repeat` times) divided over the chips when its pages split, whole
    when they do not (replicated)."""
    plan = spec.plan
    if plan is None:
        return spec.page_bytes()
    per = [0] * len(spec.groups)
    for li, lay in zip(spec.cfg.kv_layers, spec.stored_layouts()):
        k = spec.cfg.layers[li].num_kv_heads
        per[spec.group_of(li)] += lay.bytes_per_page() // (plan.size if plan.kv_pages_split(k) else 1)
    return per


@dataclass
class KVPlan:
    """Pages per group for a byte budget, split between groups in the engine's proportion (see plan_kv)."""

    groups: tuple[str, ...]
    num_pages: tuple[int, ...]
    page_bytes: tuple[int, ...]   # per chip (a page's share one chip holds; the whole page on one chip)
    seqs_at_max_len: float    # max_model_len-long sequences the pages hold at once (fractional)
    tokens: int               # context tokens the pages hold when filled with max_model_len-long sequences
    minimum_bytes: int        # per chip: the null and step pages plus one max_model_len-long sequence
    logical_page_bytes: tuple[int, ...] = ()  # every KV head once (= page_bytes on one chip)

    @property
    def fits(self) -> bool:
        return self.seqs_at_max_len >= 1

    @property
    def cache_bytes(self) -> int:
        """Bytes of pages one chip holds."""
        return sum(n * b for n, b in zip(self.num_pages, self.page_bytes))

    @property
    def logical_bytes(self) -> int:
        """Bytes of the cache with every KV head once (what the tokens cost, whatever the split)."""
        return sum(n * b for n, b in zip(self.num_pages, self.logical_page_bytes or self.page_bytes))


def plan_kv(cfg: ModelConfig, budget: int, *, max_model_len: int, chunk: int, page_size: int, kv_dtype: str,
            seqs: float | None = None, plan: Any = None) -> KVPlan:
    """Spend `budget` bytes on KV pages the way the engine does (engine.runner.plan_pages), without its cap.

    Each group first gets its null page and its `step_pages` (a sliding group: one step's chunk of `chunk` tokens,
    shared by all sequences); a max_model_len-long sequence then holds `seq_pages` per group: its whole context in
    full-attention layers, window + 2 positions (plus page rounding) in sliding layers, nothing in KV-shared layers.
    The rest of the budget buys n such sequences; each group gets 1 + its step pages + floor(n x its pages per
    sequence). Counting: KV tokens = n x max_model_len, the context the cache holds when filled with
    max_model_len-long sequences; sequences shorter than the window pay for every token in the sliding layers too
    (as vLLM-TPU's layout does). `seqs` fixes n instead. plan (a gemmajax.parallel.ShardPlan): `budget` is one
    chip's, and pages cost what one chip holds of them (`chip_page_bytes`).
    """
    spec = _probe_spec(cfg, page_size, kv_dtype, plan)
    pp = PagePlan.of(cfg, spec.groups, chip_page_bytes(spec), max_model_len=max_model_len,
                     max_num_batched_tokens=chunk, page_size=page_size)
    pages = pp.pages(seqs if seqs is not None else pp.seqs_for(budget))
    held = min((p - f) / k for p, f, k in zip(pages, pp.fixed, pp.per_seq))
    return KVPlan(spec.groups, pages, pp.page_bytes, held, int(held * max_model_len), pp.fixed_bytes + pp.seq_bytes,
                  tuple(spec.page_bytes()))


def kv_bytes_per_token_ours(cfg: ModelConfig, max_model_len: int, chunk: int, page_size: int, kv_dtype: str) -> float:
    """KV bytes per context token of one max_model_len sequence in our cache: sliding layers hold only their window
    (+ 2 positions and page rounding), KV-shared layers nothing. The step's shared chunk pages (`step_pages`, paid
    once per cache) are not in it; `chunk` is kept for the callers."""
    spec = _probe_spec(cfg, page_size, kv_dtype)
    total = 0.0
    for g, pb in zip(spec.groups, spec.page_bytes()):
        total += seq_pages(cfg, g, max_model_len, page_size) * pb
    return total / max_model_len


def kv_bytes_per_token_vllm(cfg: ModelConfig, kv_dtype: str) -> float:
    """vLLM-TPU-style: every KV-owning layer stores K and V of the whole context (sliding layers not windowed)."""
    return cfg.kv_bytes_per_token(resolve_kv_dtype(kv_dtype).itemsize, windowed=False)


# ---------------------------------------------------------------------------------------------------------------
# Roofline projection
# ---------------------------------------------------------------------------------------------------------------

def decode_bytes_read(cfg: ModelConfig, w: gemma.Weights, batch: int, context: int,
                      kv_dtype: str, plan: Any = None) -> tuple[float, float]:
    """Bytes one decode step reads from HBM for `batch` sequences at `context` tokens each.

    Weights: every leaf once, except the per-layer-embedding table (only the `batch` gathered rows) and the
    embedding (read in full as the tied LM head, plus the gathered rows); MoE experts: what the grouped matmul
    (quant/gmm.py) reads, the blocks of the experts the step routes to: the expected number of distinct experts hit
    by batch x top_k uniform routings, E (1 - (1 - k/E)^batch), each read once, plus one more read per row-tile
    boundary (an expert whose rows straddle two tiles is fetched for each; none up to 128 rows, i.e. 16 streams of
    top-8). KV: every layer (KV-shared layers included: they read their source's pages) reads min(context, window)
    tokens of K and V. Returns (weight bytes, KV bytes per sequence).

    plan (a ShardPlan; `w` then carries its shardings): one chip's reads. Its shard of every leaf; of the split
    vocabulary tables the gathered rows it holds (batch / chips on average); its share of the routed experts (the
    same fraction of its expert bytes); its stored KV heads (`kv_repeat` copies / chips when a layer splits).
    """
    nbytes = tree_bytes if plan is None else chip_bytes

    def row_bytes(t) -> float:
        return nbytes(t) / t.shape[0]

    weights = float(nbytes(w))
    if w.ple_table is not None:
        weights -= nbytes(w.ple_table) - batch * row_bytes(w.ple_table)
    weights += batch * row_bytes(w.embed)
    if cfg.enable_moe:
        E, k = cfg.num_experts, cfg.top_k_experts
        rows = batch * k
        tm = row_tile(rows)
        reads = min(E * (1.0 - (1.0 - k / E) ** batch) + (-(-rows // tm) - 1), rows)
        experts = sum(nbytes((lw.moe.gate_up_proj, lw.moe.down_proj)) for lw in w.layers if lw.moe is not None)
        weights -= experts * (1.0 - reads / E)
    item = resolve_kv_dtype(kv_dtype).itemsize
    kv = 0.0
    for s in cfg.layers:
        src = cfg.layers[s.kv_source]
        toks = min(context, s.window) if s.window is not None else context
        kv += toks * 2 * chip_kv_heads(src.num_kv_heads, plan) * src.head_dim * item
    return weights, kv


def chip_kv_heads(num_kv_heads: int, plan: Any = None) -> float:
    """KV heads of a layer one chip stores: all of them on one chip; with a plan K x kv_repeat / chips when the
    layer's pages split (one head per chip when K < chips), all K when they are replicated."""
    if plan is None:
        return float(num_kv_heads)
    stored = num_kv_heads * plan.kv_repeat(num_kv_heads)
    return stored / plan.size if plan.kv_pages_split(num_kv_heads) else float(stored)


def project(cfg: ModelConfig, w: gemma.Weights, chip: Chip, context: int, kv_dtype: str,
            plan: Any = None) -> Projection:
    """Decode tokens/s at 1 and 16 streams if the step were bound by HBM bandwidth alone (a projection); with a
    plan, by one chip's reads of its shards (`w` sharded by the plan), the interconnect not counted."""
    w1, kv = decode_bytes_read(cfg, w, 1, context, kv_dtype, plan)
    w16, _ = decode_bytes_read(cfg, w, 16, context, kv_dtype, plan)
    b1, b16 = w1 + kv, w16 + 16 * kv
    return Projection(context=context, bytes_1=b1, bytes_16=b16, tok_s_1=chip.bandwidth / b1,
                      tok_s_16=16 * chip.bandwidth / b16, weights_read=w1, kv_read_per_seq=kv)


def draft_bytes_read(acfg: Any, dw: Any, batch: int, context: int, kv_dtype: str) -> float:
    """Bytes one draft step reads for `batch` rows at `context`: the drafter's weights (with centroid masking
    (`use_ordered_embeddings`) its vocabulary table only at the k x V / C rows each row selects; else in full, the
    tied LM head), one target-embedding row per row (its width D_t in the drafter's dtype), and the target K/V its
    layers read: min(context, W + 1) tokens on sliding layers, the whole context on full ones."""
    weights = float(tree_bytes(dw))
    row = tree_bytes(dw.text.embed) / dw.text.embed.shape[0]
    if acfg.use_ordered_embeddings:
        weights -= tree_bytes(dw.text.embed) - batch * acfg.centroid_top_k * acfg.tokens_per_centroid * row
    weights += batch * acfg.backbone_hidden_size * jnp.dtype(dw.pre_projection.dtype).itemsize
    item = resolve_kv_dtype(kv_dtype).itemsize
    kv = 0.0
    for s in acfg.text.layers:
        toks = min(context, s.window) if s.window is not None else context
        kv += toks * 2 * s.num_kv_heads * s.head_dim * item
    return weights + batch * kv


def project_spec(p: Projection, acfg: Any, dw: Any, chip: Chip, kv_dtype: str, k: int, acceptance: float) -> None:
    """Speculative decoding's PROJECTION (an assumed acceptance rate, not a measurement) into `p`: a round is k draft
    steps and one verify step (read like a decode step: the weights once, each row's KV), and yields
    (1 - a^(k+1)) / (1 - a) tokens per sequence when each draft is accepted with probability a given the ones before
    it were. tokens/s = bandwidth x tokens per round / bytes read per round (1 stream, and 16 in aggregate)."""
    a = acceptance
    p.spec_k, p.acceptance = k, a
    p.tokens_per_round = (1.0 - a ** (k + 1)) / (1.0 - a)
    p.draft_bytes_1 = draft_bytes_read(acfg, dw, 1, p.context, kv_dtype)
    p.draft_bytes_16 = draft_bytes_read(acfg, dw, 16, p.context, kv_dtype)
    p.spec_tok_s_1 = chip.bandwidth * p.tokens_per_round / (p.bytes_1 + k * p.draft_bytes_1)
    p.spec_tok_s_16 = 16 * chip.bandwidth * p.tokens_per_round / (p.bytes_16 + k * p.draft_bytes_16)


# ---------------------------------------------------------------------------------------------------------------
# Deviceless compiles
# ---------------------------------------------------------------------------------------------------------------

_UNPARTITIONED = "cannot be automatically partitioned"   # a Pallas call GSPMD met outside a shard_map
_OOM_RE = re.compile(r"\(([\d.]+)([KMGT]?)\)\s*exceeds available HBM\s*\(([\d.]+)([KMGT]?)\)")
# the compiler's other wording, when the arguments and the program together overflow: "Used 15.75G of 15.75G hbm.
# Exceeded hbm capacity by 5.90M." (required = capacity + excess)
_OOM_USED_RE = re.compile(r"Used [\d.]+[KMGT]? of ([\d.]+)([KMGT]?) hbm\.\s*Exceeded hbm capacity by ([\d.]+)([KMGT]?)")
_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_oom(message: str) -> tuple[int, int] | None:
    """(bytes required, bytes available) from a CompileTimeHbmOom message, or None when it has no such numbers."""
    def size(m, i):  # the number in group i with its unit in group i + 1, in bytes
        return int(float(m.group(i)) * _UNIT[m.group(i + 1)])

    if m := _OOM_RE.search(message):
        return size(m, 1), size(m, 3)
    if m := _OOM_USED_RE.search(message):
        return size(m, 1) + size(m, 3), size(m, 1)
    return None


class _DropKernelNoise(logging.Filter):
    """Pallas logs 'AsyncCopyDescriptor was not used' once per kernel trace; it says nothing about the fit."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "AsyncCopyDescriptor was not used" not in record.getMessage()


@dataclass
class Target:
    """A TPU topology to compile for (no TPU needed). On a slice of several chips, `plan` is the engine's own
    ShardPlan (gemmajax.parallel) over the topology's devices, tensor parallel size = the number of chips: the
    weights are placed by its rules, the caches split by KV head, step inputs and outputs replicated."""

    chip: Chip
    topology: str
    devices: Any
    sharding: Any             # of step inputs (and of everything on one chip)
    mesh: Any
    plan: Any = None          # gemmajax.parallel.ShardPlan on a slice, None on one chip

    @classmethod
    def create(cls, chip: str, topology: str = "1x1", cfg: ModelConfig | None = None,
               expert_parallel: bool = False) -> Target:
        """cfg is needed on a slice (the plan's rules depend on the model); expert_parallel: EP for MoE models."""
        from jax.experimental import topologies

        from gemmajax.parallel import ShardPlan

        if chip not in CHIPS:
            raise ValueError(f"chip {chip!r} is not supported; expected one of {sorted(CHIPS)}")
        n = topology_chips(topology)
        topo = topologies.get_topology_desc(f"{chip}:{topology}", platform="tpu")
        devs = np.array(topo.devices)
        if devs.size != n:
            raise ValueError(f"topology {chip}:{topology}: libtpu describes {devs.size} chips, expected {n}")
        if n == 1:
            return cls(CHIPS[chip], topology, devs, jax.sharding.SingleDeviceSharding(devs.flat[0]),
                       jax.sharding.Mesh(devs.reshape(-1), ("x",)))
        if cfg is None:
            raise ValueError(f"topology {topology}: a slice of {n} chips needs the model config to plan the split")
        plan = ShardPlan.create(cfg, n, expert_parallel=expert_parallel, devices=devs)
        return cls(CHIPS[chip], topology, devs, plan.replicated, plan.mesh, plan)

    @property
    def num_chips(self) -> int:
        return int(self.devices.size)

    def abstract(self, tree: Any) -> Any:
        """`tree` as ShapeDtypeStructs on the target's input sharding (one chip, or replicated over the slice)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=self.sharding), tree)

    def abstract_weights(self, w: Any) -> Any:
        """A weight tree as ShapeDtypeStructs where the engine puts them: on the chip, or by the plan's rules."""
        return self.abstract(w) if self.plan is None else self.plan.abstract(w)


def engine_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sequence buckets, token buckets) of an LLMEngine with these limits and default buckets on an accelerator:
    powers of 2 up to max_num_seqs, and `runner.token_buckets` from 16 without the CPU's dense ladder."""
    return pow2_buckets(1, max_num_seqs), token_buckets(16, max_num_batched_tokens)


@dataclass(frozen=True)
class Program:
    """One program the engine runs: a step shape and the variant (greedy: tokens out; else logits)."""

    step: str          # one of STEPS + SPEC_STEPS
    tokens: int        # T
    seqs: int          # S
    decode_only: bool
    greedy: bool
    rows: int | None = None   # R, the padded logits rows (None: S, one per sequence; verify: every verified token)
    hidden: bool = False      # also returns the final-normed hidden of the rows (every program, with a drafter)
    decode_steps: int = 0     # a decode-steps program of this many steps (runner.compiled_decode_steps); 0: one step


def programs(req: AotRequest) -> dict[str, Program]:
    """The largest program of each kind the engine runs for these limits, by name (STEPS): the all-decode step
    (S_max, S_max, decode_only) and the largest mixed step (T_max, S_max), each greedy and with logits. Every other
    shape of `step_shapes` has at most these T and S, so needs no more HBM."""
    s_b, t_b = engine_buckets(req.max_num_seqs, req.max_num_batched_tokens)
    shapes = step_shapes(s_b, t_b)
    dec = max((x for x in shapes if x[2]), key=lambda x: x[:2])
    mixed = max((x for x in shapes if not x[2]), key=lambda x: x[:2])
    h = req.draft is not None
    out = {"decode": Program("decode", *dec, greedy=False, hidden=h),
           "decode-greedy": Program("decode-greedy", *dec, greedy=True, hidden=h,
                                    decode_steps=req.num_scheduler_steps if req.num_scheduler_steps > 1 and not h
                                    else 0),
           "prefill": Program("prefill", *mixed, greedy=False, hidden=h),
           "prefill-greedy": Program("prefill-greedy", *mixed, greedy=True, hidden=h)}
    if h:   # every sequence verifies k drafts: T = R = S (1 + k) tokens, padded as LLMEngine._dispatch pads them
        s = s_b[-1]
        n = min(s * (1 + req.num_speculative_tokens), req.max_num_batched_tokens)
        t = max(bucket(n, t_b), s)
        out["verify"] = Program("verify", t, s, False, greedy=False, rows=t, hidden=True)
        out["verify-greedy"] = Program("verify-greedy", t, s, False, greedy=True, rows=t, hidden=True)
    return out


def program_inputs(spec: RunnerSpec, prog: Program) -> StepInputs:
    """Padding inputs of prog's shape (no sequence: nothing is written) with its decode_only flag set on every
    group's meta, as `LLMEngine.precompile` builds them (KV-shared layers' metas are decode_only by construction)."""
    inp = build_step_inputs(spec, [], prog.tokens, prog.seqs, prog.rows)
    return dataclasses.replace(inp, metas=tuple(dataclasses.replace(m, decode_only=prog.decode_only)
                                                for m in inp.metas))


def compile_step(target: Target, weights: gemma.Weights, spec: RunnerSpec, prog: Program) -> StepCompile:
    """Lower and compile the engine's own jitted step (`runner.compiled_step(spec, prog.greedy)`: caches donated)
    on padding inputs of prog's shape with its decode_only flag, as `LLMEngine.precompile` builds them, for the
    target; never raises for an out-of-memory or lowering failure: they are recorded in the result. On a slice
    `spec.plan` is the target's plan: caches split as the engine allocates them, the figures one chip's."""
    kv = abstract_caches(spec, None if spec.plan is not None else target.sharding)
    res = StepCompile(step=prog.step, tokens=prog.tokens, seqs=prog.seqs, kv_pages=tuple(spec.num_pages),
                      kv_bytes=chip_bytes(kv), decode_only=prog.decode_only, greedy=prog.greedy,
                      weight_bytes=chip_bytes(weights), attn_impl=spec.attn_impl, decode_steps=prog.decode_steps)
    inp = target.abstract(program_inputs(spec, prog))
    if prog.decode_steps:
        steps = target.abstract(np.int32(prog.decode_steps))
        return _compile_into(res, lambda: compiled_decode_steps(spec, prog.decode_steps).lower(weights, kv, inp, steps),
                             target)
    return _compile_into(res, lambda: compiled_step(spec, prog.greedy, prog.hidden).lower(weights, kv, inp), target)


def compile_draft(target: Target, weights: gemma.Weights, draft_w: Any, acfg: Any, spec: RunnerSpec,
                  num_steps: int, seqs: int) -> StepCompile:
    """Lower and compile the engine's drafter program (`spec_decode._draft`: `num_steps` greedy draft steps for
    `seqs` rows, reading the target's embedding and its paged K/V of the store layers read-only) for the target."""
    from gemmajax.engine.spec_decode import _draft
    from gemmajax.model import assistant

    kv = abstract_caches(spec, target.sharding)
    cfg = spec.cfg
    layers = assistant.target_layers(acfg, cfg)
    slots = tuple((kind, cfg.kv_slot[li]) for kind, li in sorted(layers.items()))
    inp = build_step_inputs(spec, [], seqs, seqs)
    metas = target.abstract({kind: inp.metas[spec.groups.index(kind)] for kind, _ in slots})
    d_t = acfg.backbone_hidden_size
    hidden = jax.ShapeDtypeStruct((seqs, d_t), jnp.float32, sharding=target.sharding)
    rows = jax.ShapeDtypeStruct((seqs,), jnp.int32, sharding=target.sharding)
    res = StepCompile(step="draft", tokens=seqs, seqs=seqs, kv_pages=tuple(spec.num_pages), kv_bytes=chip_bytes(kv),
                      decode_only=True, greedy=True, weight_bytes=chip_bytes((draft_w, weights.embed)),
                      attn_impl=spec.attn_impl)
    return _compile_into(res, lambda: _draft.lower(draft_w, acfg, weights.embed, kv, spec, slots, metas, hidden,
                                                   rows, rows, num_steps=num_steps), target)


def _compile_into(res: StepCompile, lower, target: Target) -> StepCompile:
    """Run `lower()` then compile, recording the compiler's memory figures (or its verdict) in `res`."""
    noise = _DropKernelNoise()
    logging.getLogger().addFilter(noise)
    t0 = time.perf_counter()
    try:
        with jax.set_mesh(target.mesh):  # Pallas asks the current mesh which TPU it lowers for
            lowered = lower()
            res.pallas_calls = lowered.as_text().count("@tpu_custom_call")
            compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 -- the compiler's verdict is the result
        msg = f"{type(e).__name__}: {e}"
        if "RESOURCE_EXHAUSTED" in msg or "HbmOom" in msg:
            res.oom = msg.strip().splitlines()[0][:600]
        else:
            res.error = msg[:2000]
        return res
    finally:
        logging.getLogger().removeFilter(noise)
        res.seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    res.argument_bytes = int(m.argument_size_in_bytes)
    res.output_bytes = int(m.output_size_in_bytes)
    res.alias_bytes = int(m.alias_size_in_bytes)
    res.temp_bytes = int(m.temp_size_in_bytes)
    res.code_bytes = int(m.generated_code_size_in_bytes)
    if isinstance(res, EncoderCompile):
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        res.flops = float((cost or {}).get("flops", 0.0))
    return res


# ---------------------------------------------------------------------------------------------------------------
# The vision / audio encoders (the towers of a multimodal checkpoint)
# ---------------------------------------------------------------------------------------------------------------

def tower_preset(model: str) -> Any:
    """The towers a published checkpoint carries (model.multimodal.MultimodalConfig): E2B / E4B a vision tower and
    an audio tower, 12B the unified (encoder-free) vision and audio embedders, 26B-A4B and 31B a vision tower."""
    from gemmajax.model import audio as au
    from gemmajax.model import vision as vi
    from gemmajax.model.multimodal import MultimodalConfig

    if model in ("e2b", "e4b"):
        return MultimodalConfig(vision=vi.VisionConfig.preset(model), audio=au.AudioConfig.preset(model))
    if model == "12b":
        return MultimodalConfig(vision=vi.UNIFIED_VISION_PRESETS["12b"], audio=au.UnifiedAudioConfig())
    if model in ("26b-a4b", "31b"):
        return MultimodalConfig(vision=vi.VisionConfig.preset(model))
    raise ValueError(f"model {model!r}: no tower preset; expected one of {list(MODELS)}")


def tower_names(mm_cfg: Any) -> list[str]:
    """'vision' / 'audio' for the towers a MultimodalConfig has, in that order."""
    return [n for n in ("vision", "audio") if mm_cfg is not None and getattr(mm_cfg, n) is not None]


@dataclass
class EncoderCompile(_CompiledMemory):
    """One deviceless compile of an encoder (a tower's program, run by `model.multimodal.embed_multimodal` between
    steps) on its largest input: bytes per chip (on a slice the towers and their inputs are replicated, as
    `LLM` places them, and every chip runs the whole encoder)."""

    name: str                 # "vision" | "audio"
    tower: str                # the config class (VisionConfig, UnifiedVisionConfig, AudioConfig, UnifiedAudioConfig)
    inputs: str               # what one call encodes
    input_shape: tuple[int, ...]
    soft_tokens: int          # rows of soft tokens the call returns (padding included)
    weight_bytes: int = 0     # the tower's weights (held beside the text weights all along)
    argument_bytes: int = 0   # weights + inputs
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    flops: float = 0.0        # the compiler's cost analysis
    seconds: float = 0.0
    pallas_calls: int = 0
    oom: str | None = None
    error: str | None = None

    @property
    def extra_bytes(self) -> int:
        """What the encoder's program needs besides its weights while it runs: inputs, outputs, temporaries, code."""
        return self.peak_bytes - self.weight_bytes


def encoder_program(tower: Any, max_soft_tokens: int = MAX_SOFT_TOKENS, audio_seconds: float = AUDIO_SECONDS
                    ) -> tuple[Any, tuple[jax.ShapeDtypeStruct, ...], str, int]:
    """The encoder call `embed_multimodal` makes for one of a tower's largest inputs: (fn(weights, *inputs), the
    inputs' shapes, a description, soft-token rows out). Images: one of `max_soft_tokens` soft tokens (T = that x k^2
    16x16 patches; 12B: that many merged patches); audio: one clip of `audio_seconds` through tools.media's own
    feature extractor (Gemma 4: log-mel frames padded to AUDIO_FRAME_BUCKET as embed_multimodal pads them; 12B: raw
    640-sample frames)."""
    from gemmajax.model import audio as au
    from gemmajax.model import vision as vi
    from gemmajax.model.multimodal import AUDIO_FRAME_BUCKET
    from gemmajax.tools import media as md

    f32 = jnp.float32
    if isinstance(tower, (vi.VisionConfig, vi.UnifiedVisionConfig)):
        unified = isinstance(tower, vi.UnifiedVisionConfig)
        T = max_soft_tokens if unified else max_soft_tokens * tower.pooling_kernel_size ** 2
        fn = vi.encode_images_unified if unified else vi.encode_images
        desc = (f"1 image of {max_soft_tokens} soft tokens ({T} "
                f"{'merged ' if unified else ''}patches of {tower.patch_dim} values)")
        return ((lambda w, x, p: fn(w, tower, x, p)),
                (jax.ShapeDtypeStruct((1, T, tower.patch_dim), f32), jax.ShapeDtypeStruct((1, T, 2), jnp.int32)),
                desc, max_soft_tokens)
    if isinstance(tower, (au.AudioConfig, au.UnifiedAudioConfig)):
        unified = isinstance(tower, au.UnifiedAudioConfig)
        wave = np.zeros(round(audio_seconds * md.SAMPLING_RATE), np.float32)
        kw = {"frame_size": tower.frame_size} if unified else {}
        feats = md.audio_features(wave, unified=unified, **kw).features
        n = feats.shape[0] if unified else -(-feats.shape[0] // AUDIO_FRAME_BUCKET) * AUDIO_FRAME_BUCKET
        fn = au.encode_audio_unified if unified else au.encode_audio
        rows = n if unified else math.ceil(math.ceil(n / 2) / 2)   # two stride-2 convolutions
        what = "raw frames" if unified else "log-mel frames"
        return ((lambda w, f, m: fn(w, tower, f, m)),
                (jax.ShapeDtypeStruct((1, n, feats.shape[1]), f32), jax.ShapeDtypeStruct((1, n), jnp.bool_)),
                f"1 clip of {audio_seconds:g} s ({n} {what} of {feats.shape[1]})", rows)
    raise ValueError(f"encoder_program: expected a VisionConfig, UnifiedVisionConfig, AudioConfig or "
                     f"UnifiedAudioConfig, got {type(tower).__name__}")


def abstract_tower_weights(mm_cfg: Any, quant: str = "none", dtype: str = "bfloat16") -> Any:
    """The towers as `LLM` loads them (model.multimodal.load_multimodal): the model dtype, norms float32, the
    projections quantized under the text scheme's linear kind (`+embN` concerns vocabulary tables only)."""
    from gemmajax.model.multimodal import abstract_multimodal_weights

    return abstract_multimodal_weights(mm_cfg, jnp.dtype(dtype), (quant or "none").split("+")[0])


def compile_encoders(target: Target, mm_cfg: Any, weights: Any = None, *, quant: str = "none",
                     dtype: str = "bfloat16", max_soft_tokens: int = MAX_SOFT_TOKENS,
                     audio_seconds: float = AUDIO_SECONDS, log=None) -> list[EncoderCompile]:
    """Compile every tower of `mm_cfg` (a MultimodalConfig) for the target on one of its largest inputs
    (`encoder_program`), batch 1; `weights` (a MultimodalWeights of ShapeDtypeStructs) defaults to
    `abstract_tower_weights(mm_cfg, quant, dtype)`. Weights and inputs are placed on the target's input sharding:
    one chip, or replicated over a slice (each chip holds the towers whole and runs the encoder on its own). Never
    raises for an out-of-memory or lowering failure: they are recorded in the result."""
    say = log or (lambda msg: None)
    if weights is None:
        weights = abstract_tower_weights(mm_cfg, quant, dtype)
    out = []
    for name in tower_names(mm_cfg):
        tower, w = getattr(mm_cfg, name), target.abstract(getattr(weights, name))
        if target.plan is not None:      # on a slice, as LLM places them: replicated, quantized kernels per chip
            w = target.plan.mark_replicated(w)
        fn, inputs, desc, rows = encoder_program(tower, max_soft_tokens, audio_seconds)
        inputs = target.abstract(inputs)
        res = EncoderCompile(name=name, tower=type(tower).__name__, inputs=desc, input_shape=tuple(inputs[0].shape),
                             soft_tokens=rows, weight_bytes=chip_bytes(w))
        say(f"compiling the {name} encoder ({res.tower}, {desc}) for {target.chip.name}:{target.topology}")
        _compile_into(res, lambda fn=fn, w=w, inputs=inputs: jax.jit(fn).lower(w, *inputs), target)
        say(f"  {'ok' if res.ok else 'OOM' if res.oom else 'error'} in {res.seconds:.0f} s"
            + (f": weights {res.weight_bytes / MiB:.0f} MiB, temporaries {res.temp_bytes / MiB:.0f} MiB" if res.ok
               else ""))
        out.append(res)
    return out


def _spec(req: AotRequest, num_pages: tuple[int, ...], attn_impl: str, plan: Any = None) -> RunnerSpec:
    cfg = req.cfg
    return RunnerSpec(cfg, kv_groups(cfg), req.page_size, tuple(num_pages),
                      math.ceil(req.max_model_len / req.page_size),
                      req.kv_dtype, attn_impl=attn_impl, plan=plan,
                      row_q_max=1 + req.num_speculative_tokens if req.draft is not None else 1)   # as LLMEngine


def _attn_impl(req: AotRequest) -> tuple[str, str | None]:
    """The attention implementation to compile, and why the kernel is not used when it is not
    (`gemmajax.kv.attention.kernel_supports` on every KV layer's pages and every program's shapes)."""
    if req.attn_impl != "pallas":
        return req.attn_impl, None
    spec = _spec(req, (2,) * len(kv_groups(req.cfg)), "pallas")
    for prog in programs(req).values():
        meta = build_step_inputs(spec, [], prog.tokens, prog.seqs).metas[0]
        for li, lay in zip(req.cfg.kv_layers, spec.layouts()):
            pages = jax.ShapeDtypeStruct(lay.shape(2), lay.jnp_dtype)
            q = jax.ShapeDtypeStruct((prog.tokens, req.cfg.num_heads, lay.head_dim), jnp.dtype(req.dtype))
            reason = kernel_supports(pages, q, meta)
            if reason is not None:
                return "ref", f"{prog.step} step, layer {li}: {reason}"
    return "pallas", None


# ---------------------------------------------------------------------------------------------------------------
# The analysis
# ---------------------------------------------------------------------------------------------------------------

def analyze(req: AotRequest, log=None) -> AotResult:
    """Weights, temporaries, KV budget, proof compile and projection for one request (see the module docstring)."""
    say = log or (lambda msg: None)
    cfg = req.cfg
    if req.chip not in CHIPS:
        raise ValueError(f"chip {req.chip!r} is not supported; expected one of {sorted(CHIPS)}")
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size", "num_scheduler_steps"):
        if getattr(req, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(req, name)}")
    if req.max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len={req.max_model_len} exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings}")
    if req.max_num_seqs > req.max_num_batched_tokens:
        raise ValueError(f"max_num_seqs={req.max_num_seqs} exceeds max_num_batched_tokens="
                         f"{req.max_num_batched_tokens}: a decode step of every sequence would not fit one step")
    req = dataclasses.replace(req, kv_dtype=resolve_auto(req.kv_dtype, req.dtype))
    chip = CHIPS[req.chip]
    n_chips = topology_chips(req.topology)
    if req.expert_parallel and not cfg.enable_moe:
        raise ValueError(f"enable_expert_parallel: model {req.model_name} has no experts (num_experts=0); drop the "
                         f"flag")
    draft_w = None
    if req.draft is not None:
        from gemmajax.model import assistant

        if n_chips > 1:
            raise ValueError(f"speculative decoding with a drafter: topology {req.topology}; only 1x1 is compiled "
                             f"(the drafter reads the target's pages outside any shard_map)")
        if not req.probe:
            raise ValueError("speculative decoding with a drafter needs probe=True (its program is measured)")
        if req.num_speculative_tokens < 1 or not 0.0 <= req.assumed_acceptance < 1.0:
            raise ValueError(f"num_speculative_tokens must be >= 1 and assumed_acceptance in [0, 1); got "
                             f"{req.num_speculative_tokens} and {req.assumed_acceptance}")
        assistant.target_layers(req.draft, cfg)   # a ConfigError (ValueError) naming the mismatch
        draft_w = assistant.abstract_assistant_weights(req.draft, jnp.dtype(req.dtype))
    w_plain = abstract_model_weights(cfg, req.quant, req.dtype)
    breakdown = weight_breakdown(w_plain)
    # On a slice the plan (and so the libtpu topology) is needed before anything is decided: per-chip bytes.
    target = Target.create(req.chip, req.topology, cfg, req.expert_parallel) if n_chips > 1 else None
    tplan = None if target is None else target.plan
    w_chip = w_plain if target is None else target.abstract_weights(w_plain)
    res = AotResult(
        model=req.model_name, chip=req.chip, topology=req.topology, quant=req.quant, kv_dtype=req.kv_dtype,
        max_model_len=req.max_model_len, max_num_seqs=req.max_num_seqs,
        max_num_batched_tokens=req.max_num_batched_tokens, page_size=req.page_size, hbm_bytes=chip.hbm_bytes,
        hbm_limit=chip.hbm_limit, bandwidth=chip.bandwidth, margin_bytes=req.margin_bytes,
        weight_bytes=breakdown["total"], weight_breakdown=breakdown, num_chips=n_chips,
        expert_parallel=req.expert_parallel,
        weight_breakdown_per_chip=breakdown if tplan is None else weight_breakdown(w_chip, chip_bytes),
        kv_bytes_per_token_ours=kv_bytes_per_token_ours(cfg, req.max_model_len, req.max_num_batched_tokens,
                                                        req.page_size, req.kv_dtype),
        kv_bytes_per_token_vllm=kv_bytes_per_token_vllm(cfg, req.kv_dtype),
        matmul_impl="dense XLA (bf16)" + ("; experts: ragged_dot" if cfg.enable_moe else "") if req.quant == "none"
        else "gemmajax.quant 'auto': Pallas int8/int4 kernels when lowered for TPU"
        + ("; experts: the grouped matmul kernel (gmm), routed experts only" if cfg.enable_moe else ""))
    res.weight_bytes_per_chip = res.weight_breakdown_per_chip["total"]
    res.replicated_bytes_per_chip = (res.weight_bytes if tplan is None else
                                     sum(_nbytes(a) for a in jax.tree.leaves(w_chip) if a.sharding.is_fully_replicated))
    if req.expert_parallel and tplan is None:
        res.notes.append("enable_expert_parallel has no effect on one chip")
    if draft_w is not None:
        res.draft_model = req.draft.name or req.draft.model_type
        res.draft_weight_bytes = tree_bytes(draft_w)
    tower_w = None
    if req.towers is not None:
        res.towers = "+".join(tower_names(req.towers))
        res.mm = req.mm
        nbytes = tree_bytes(abstract_tower_weights(req.towers, req.quant, req.dtype))
        if req.mm:   # replicated on a slice (LLM: plan.replicate): every chip holds them whole
            tower_w = abstract_tower_weights(req.towers, req.quant, req.dtype)
            res.tower_weight_bytes = nbytes
        else:
            res.tower_weight_bytes_skipped = nbytes
    held = res.draft_weight_bytes + res.tower_weight_bytes   # held beside the step's arguments, per chip
    res.projection = project(cfg, w_chip, chip, req.proj_context or req.max_model_len, req.kv_dtype, tplan)
    if draft_w is not None:
        project_spec(res.projection, req.draft, draft_w, chip, req.kv_dtype, req.num_speculative_tokens,
                     req.assumed_acceptance)
    chunk = req.max_num_batched_tokens
    plan_kw = dict(max_model_len=req.max_model_len, chunk=chunk, page_size=req.page_size, kv_dtype=req.kv_dtype,
                   plan=tplan)
    res.count_note = (f"KV tokens = context the cache holds filled with {req.max_model_len}-token sequences, each "
                      f"paying its window (+2) in sliding layers, its whole context in full layers, nothing in "
                      f"KV-shared layers (pages rounded up), beside one step's {chunk}-token chunk of sliding pages "
                      f"shared by all; vLLM-TPU-style = the same bytes / "
                      f"{res.kv_bytes_per_token_vllm / 1024:.1f} KiB per token")

    # 1. The cheap check: weights alone, or weights with the smallest useful cache, exceed the chip.
    small_plan = plan_kv(cfg, 0, seqs=1, **plan_kw)
    minimum = small_plan.minimum_bytes
    if res.weight_bytes_per_chip + held + req.margin_bytes + minimum > chip.hbm_limit:
        tw = ("" if tower_w is None else f" + the {res.towers} towers {_m(res.tower_weight_bytes)}"
              f"{' (replicated on every chip)' if tplan is not None else ''} (--no-mm leaves them out)")
        if draft_w is not None:
            res.reason = (f"does not fit: weights {_g(res.weight_bytes)}{tw} + the drafter's "
                          f"{_g(res.draft_weight_bytes)}"
                          f" + margin {_g(req.margin_bytes)} + the KV of one {req.max_model_len}-token sequence "
                          f"({_g(minimum)}) exceed the {chip.name} compiler limit of {_g(chip.hbm_limit)} (decided "
                          f"without compiling)")
        elif tplan is None:
            res.reason = (f"does not fit: weights {_g(res.weight_bytes)}{tw} + margin {_g(req.margin_bytes)} + the KV "
                          f"of one {req.max_model_len}-token sequence ({_g(minimum)}) exceed the {chip.name} "
                          f"compiler limit of {_g(chip.hbm_limit)} (decided without compiling)")
        else:
            one_seq = plan_kv(cfg, 0, seqs=1, **dict(plan_kw, plan=None)).minimum_bytes
            res.reason = (f"does not fit: per chip, weights {_g(res.weight_bytes_per_chip)} (of "
                          f"{_g(res.weight_bytes)} over {n_chips} chips, {_g(res.replicated_bytes_per_chip)} of it "
                          f"replicated){tw} + margin {_g(req.margin_bytes)} + its share of the KV of one "
                          f"{req.max_model_len}-token sequence ({_g(minimum)} of {_g(one_seq)}) exceed the "
                          f"{chip.name} compiler limit of {_g(chip.hbm_limit)} per chip (decided without compiling)")
        return res

    if target is None:
        target = Target.create(req.chip, req.topology)
    weights = target.abstract_weights(w_plain)
    impl, why = _attn_impl(req)
    if why:
        res.notes.append(f"attention compiled with the jnp reference path (impl='ref'): {why}")
    enc_extra = 0
    if tower_w is not None:
        res.encoders = compile_encoders(target, req.towers, tower_w, max_soft_tokens=req.max_soft_tokens,
                                        audio_seconds=req.audio_seconds, log=say)
        for e in res.encoders:
            if e.error:
                res.reason = f"compile error in the {e.name} encoder ({e.tower}): {e.error.splitlines()[0][:500]}"
                return res
            if e.oom:
                res.reason = f"does not fit: the {e.name} encoder ({e.tower}, {e.inputs}) does not compile: {e.oom}"
                return res
        enc_extra = max(e.extra_bytes for e in res.encoders)
        res.notes.append("the encoders run in their own programs between steps, so the peak counts the weights, the "
                         "towers and the cache once plus the larger of the step's buffers and the largest encoder's "
                         "(temporaries, inputs, outputs, code), not their sum; each encoder is compiled at batch 1 "
                         "(same-shape images of one step run as one batch, whose buffers grow with it)")
        if tplan is not None:
            res.notes.append(f"the towers and their encoders are counted replicated per chip (as LLM places them on "
                             f"a slice: each of the {n_chips} chips holds the towers whole and runs every encoder "
                             f"whole)")
    progs = programs(req)
    steps = list(dict.fromkeys(req.steps + (SPEC_STEPS if draft_w is not None and req.steps == STEPS else ())))
    unknown = [x for x in steps if x not in progs]
    if unknown or not steps:
        raise ValueError(f"steps {list(req.steps)}: expected one or more of {list(progs)}")

    def compile_at(step: str, pages: tuple[int, ...]) -> StepCompile:
        nonlocal impl
        prog = progs[step]
        say(f"compiling {step} (T={prog.tokens}, S={prog.seqs}{', decode-only' if prog.decode_only else ''}, "
            f"{f'{prog.decode_steps} decode steps, ' if prog.decode_steps else ''}"
            f"{'tokens' if prog.greedy else 'logits'} out, attention {impl}, KV pages {pages}) for "
            f"{req.chip}:{req.topology}")
        c = compile_step(target, weights, _spec(req, pages, impl, tplan), prog)
        if c.error and _UNPARTITIONED in c.error and tplan is not None:
            # attention and the quantized matmuls run under shard_map on a slice: some other Pallas call did not
            c.error = (f"a Pallas kernel of the {req.quant} step meets sharded operands outside any shard_map, and "
                       f"Mosaic kernels cannot be partitioned by GSPMD (compiler: {c.error[:300]})")
        elif c.error and impl == "pallas":
            res.notes.append(f"the Pallas attention kernel failed to compile ({c.error.splitlines()[0][:300]}); "
                             "fell back to the jnp reference path (impl='ref')")
            impl = "ref"
            c = compile_step(target, weights, _spec(req, pages, impl, tplan), prog)
        say(f"  {'ok' if c.ok else 'OOM' if c.oom else 'error'} in {c.seconds:.0f} s"
            + (f": temporaries {_g(c.temp_bytes)}, peak {_g(c.peak_bytes)}" if c.ok else ""))
        return c

    def prove(order: list[str], pages: tuple[int, ...]) -> tuple[list[StepCompile], StepCompile]:
        """Compile `order` at `pages`, stopping at the first that does not compile. Returns (the compiles, the
        failed one or else the one with the highest peak)."""
        done = []
        for step in order:
            done.append(compile_at(step, pages))
            if not done[-1].ok:
                return done, done[-1]
        return done, max(done, key=lambda c: c.peak_bytes)

    # 2. Temporaries: compile each step with a small cache (the pool size does not change a step's temporaries).
    small = small_plan.num_pages
    if req.probe:
        for step in steps:
            c = compile_at(step, small)
            res.compiles.append(c)
            if c.error:
                res.attn_impl = impl
                res.reason = f"compile error in the {step} step: {c.error.splitlines()[0][:500]}"
                return res
            if c.oom:
                res.attn_impl = impl
                res.reason = f"does not fit: the {step} step with the smallest cache does not compile: {c.oom}"
                return res
        order = [max(res.compiles, key=lambda c: c.overhead_bytes).step]  # the others need less besides the cache
        if draft_w is not None:   # the drafter's own program, beside the target's (its weights held all along)
            say(f"compiling the drafter's {req.num_speculative_tokens}-step program (S={progs['decode'].seqs}) for "
                f"{req.chip}:{req.topology}")
            c = compile_draft(target, weights, target.abstract(draft_w), req.draft,
                              _spec(req, small, impl, tplan), req.num_speculative_tokens, progs["decode"].seqs)
            say(f"  {'ok' if c.ok else 'OOM' if c.oom else 'error'} in {c.seconds:.0f} s"
                + (f": temporaries {_g(c.temp_bytes)}" if c.ok else ""))
            res.compiles.append(c)
            if not c.ok:
                res.attn_impl = impl
                res.reason = (f"compile error in the drafter's step: {c.error.splitlines()[0][:500]}" if c.error
                              else f"does not fit: the drafter's step with the smallest cache does not compile: "
                                   f"{c.oom}")
                return res
        # weights (the target's, the drafter's, the towers) are held once; each program adds its own buffers, and
        # the programs run one at a time: the encoders' buffers come instead of a step's, not on top of them
        overhead = (res.weight_bytes_per_chip + held
                    + max([c.overhead_bytes - c.weight_bytes for c in res.compiles] + [enc_extra]))
    else:  # no measurements: every step is compiled at full size, the last given first
        overhead = res.weight_bytes_per_chip + held + max(req.overhead_guess, enc_extra)
        order = [steps[-1]] + steps[:-1]

    # 3. The KV budget and the cache it buys; 4. prove it by compiling at that size (shrink on an OOM, twice).
    budget = chip.hbm_limit - req.margin_bytes - overhead
    for attempt in range(3):
        plan = plan_kv(cfg, budget, **plan_kw)
        res.kv_budget_bytes = budget
        smallest = False
        if not plan.fits:
            if req.probe or attempt > 0:  # measured overheads (or the compiler itself) leave no room
                res.attn_impl = impl
                per = "" if tplan is None else " per chip"
                res.reason = (f"does not fit: after weights and step overhead {_g(overhead)}{per} and margin "
                              f"{_g(req.margin_bytes)}, {_g(max(budget, 0))}{per} is left for KV; one "
                              f"{req.max_model_len}-token sequence needs {_g(plan.minimum_bytes)}{per}")
                return res
            plan, smallest = small_plan, True  # only a guess said no: let the compiler decide, smallest cache
        proved, proof = prove(order, plan.num_pages)
        res.proof = proof
        if proof.ok:
            break
        if proof.error:
            res.attn_impl = impl
            res.reason = f"compile error in the {proof.step} step: {proof.error.splitlines()[0][:500]}"
            return res
        need = parse_oom(proof.oom)
        if need is None or attempt == 2 or smallest:
            res.attn_impl = impl
            if not req.probe:
                res.compiles.extend(proved)
            cache = f"the smallest cache (one {req.max_model_len}-token sequence)" if smallest else "its cache"
            res.reason = f"does not fit: the {proof.step} step with {cache} does not compile: {proof.oom}"
            return res
        budget -= (need[0] - need[1]) + req.margin_bytes // 2
        res.notes.append(f"the proof compile of {proof.step} needed {_g(need[0] - need[1])} more than available; "
                         f"cache shrunk")
    if not req.probe:
        # Fast mode sized the cache from a guess; with the proof's own overhead known, one more round takes the
        # rest of the chip when the guess left a visible amount unused (or shrinks it when the margin was eaten).
        exact = chip.hbm_limit - req.margin_bytes - held - max(proof.overhead_bytes,
                                                               proof.weight_bytes + enc_extra)
        if abs(exact - budget) > max(256 * MiB, budget // 20):
            better = plan_kv(cfg, exact, **plan_kw)
            if better.fits:
                again, top = prove(order, better.num_pages)
                if top.ok:
                    plan, proved, proof, budget = better, again, top, exact
                    res.proof, res.kv_budget_bytes = top, exact
                else:
                    res.notes.append(f"resizing the cache to the measured overhead did not compile ({top.step}: "
                                     f"{(top.oom or top.error or '')[:200]}); kept the first proven size")
        res.compiles.extend(proved)
    res.attn_impl = impl
    # the step at full size, or the largest encoder beside the same weights and cache, whichever needs more
    enc_peak = proof.weight_bytes + proof.kv_bytes + enc_extra if res.encoders else 0
    res.peak_bytes = max(proof.peak_bytes, enc_peak) + held
    if res.peak_bytes > chip.hbm_limit:
        what = [f"the proof's peak {_g(proof.peak_bytes)}"]
        if res.encoders and enc_peak > proof.peak_bytes:
            what = [f"the weights and cache {_g(proof.weight_bytes + proof.kv_bytes)} with the largest encoder's "
                    f"buffers {_g(enc_extra)}"]
        if res.draft_weight_bytes:
            what.append(f"the drafter's weights {_g(res.draft_weight_bytes)}")
        if res.tower_weight_bytes:
            what.append(f"the towers' weights {_g(res.tower_weight_bytes)}")
        res.reason = f"does not fit: {' + '.join(what)} exceed {_g(chip.hbm_limit)}"
        return res
    res.fits = True
    if chip.hbm_limit - res.peak_bytes < req.margin_bytes:
        res.notes.append(f"the compiled peak leaves {_g(chip.hbm_limit - res.peak_bytes)} of the "
                         f"{_g(req.margin_bytes)} margin")
    res.kv_cache_bytes = plan.logical_bytes
    res.kv_cache_bytes_per_chip = plan.cache_bytes
    res.kv_pages = dict(zip(plan.groups, plan.num_pages))
    res.kv_tokens = plan.tokens
    res.kv_seqs_at_max_len = plan.seqs_at_max_len
    vllm_bpt = res.kv_bytes_per_token_vllm
    res.kv_tokens_vllm_style = int(plan.logical_bytes // vllm_bpt) if vllm_bpt else 0
    which = f"the {proof.step} step compiles" if len(order) == 1 else f"all {len(order)} steps compile"
    if draft_w is not None:
        res.reason = (f"fits: {which} for {req.chip}:{req.topology} with a {_g(plan.cache_bytes)} KV cache, peak "
                      f"{_g(proof.peak_bytes)} + the drafter's weights {_g(res.draft_weight_bytes)} (held beside it)"
                      f" = {_g(proof.peak_bytes + res.draft_weight_bytes)} of {_g(chip.hbm_limit)}; the drafter's "
                      f"program compiles (temporaries {_g(res.temp_bytes.get('draft', 0))})")
    elif tplan is None:
        res.reason = (f"fits: {which} for {req.chip}:{req.topology} with a {_g(plan.cache_bytes)} KV cache, peak "
                      f"{_g(proof.peak_bytes)} of {_g(chip.hbm_limit)}")
    else:
        res.reason = (f"fits: {which} for {req.chip}:{req.topology} (tensor parallel {n_chips}"
                      f"{', expert parallel' if req.expert_parallel else ''}) with a {_g(plan.logical_bytes)} KV "
                      f"cache ({_g(plan.cache_bytes)} per chip), peak {_g(proof.peak_bytes)} per chip of "
                      f"{_g(chip.hbm_limit)}")
    if res.encoders:
        big = max(res.encoders, key=lambda e: e.extra_bytes)
        res.reason += (f"; the {res.towers} towers' weights {_m(res.tower_weight_bytes)} held beside"
                       f"{' (replicated on every chip)' if tplan is not None else ''} and their encoders compile (the "
                       f"{big.name} encoder's buffers {_m(big.extra_bytes)}, "
                       f"{'under' if enc_peak <= proof.peak_bytes else 'over'} the step's "
                       f"{_m(proof.peak_bytes - proof.weight_bytes - proof.kv_bytes)}): peak {_g(res.peak_bytes)}"
                       f"{' per chip' if tplan is not None else ''}")
    if req.probe and len(steps) > 1:
        other = [c.step for c in res.compiles if c.step not in (proof.step, "draft")]
        res.notes.append(f"{', '.join(other)} need less HBM besides the cache than {proof.step} (same weights and "
                         f"cache), so they fit at this cache size too (compiled with a small cache only)")
    if plan.seqs_at_max_len < req.max_num_seqs:
        res.notes.append(f"the cache holds {plan.seqs_at_max_len:.1f} sequences of {req.max_model_len} tokens at "
                         f"once, fewer than max_num_seqs={req.max_num_seqs}: more sequences run only while shorter")
    return res


# ---------------------------------------------------------------------------------------------------------------
# Output and the command line
# ---------------------------------------------------------------------------------------------------------------

def _g(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _m(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def format_report(r: AotResult) -> str:
    """The human-readable report `gemmajax aot` prints."""
    b = r.weight_breakdown
    lines = [
        f"gemmajax aot: {r.model}  quant {r.quant}  kv {r.kv_dtype}  on {r.chip}:{r.topology}  "
        f"(HBM {_g(r.hbm_bytes)}, compiler limit {_g(r.hbm_limit)}, {r.bandwidth / 1e9:.0f} GB/s)",
        f"  serving: max_model_len {r.max_model_len}, max_num_seqs {r.max_num_seqs}, "
        f"max_num_batched_tokens {r.max_num_batched_tokens}, page_size {r.page_size}",
        f"  kernels: attention {r.attn_impl or '-'}; matmuls {r.matmul_impl}",
        f"  weights         {_g(r.weight_bytes)}  (embedding/LM head {_g(b['embedding'])}, per-layer embeddings "
        f"{_g(b['per_layer_embedding'])}, experts {_g(b['experts'])}, other {_g(b['other'])})",
    ]
    slice_ = r.num_chips > 1
    if slice_:
        c = r.weight_breakdown_per_chip
        lines[2:2] = [f"  sharding: tensor parallel {r.num_chips} over the {r.num_chips} chips of {r.chip}:"
                      f"{r.topology}, expert parallel {'on' if r.expert_parallel else 'off'} (gemmajax.parallel "
                      f"rules); every figure below marked 'per chip' is one chip's"]
        lines.append(f"  weights/chip    {_g(r.weight_bytes_per_chip)}  (embedding/LM head {_g(c['embedding'])}, "
                     f"per-layer embeddings {_g(c['per_layer_embedding'])}, experts {_g(c['experts'])}, other "
                     f"{_g(c['other'])}; replicated on every chip {_g(r.replicated_bytes_per_chip)})")
    if r.draft_model:
        lines.append(f"  drafter         {r.draft_model}: weights {_g(r.draft_weight_bytes)} (bf16, held beside the "
                     f"target's; every target step also returns its hidden state for it)")
    per = " per chip" if slice_ else ""
    if r.towers and not r.mm:
        lines.append(f"  towers          text only (--no-mm): the {r.towers} towers are not loaded and no encoder is "
                     f"compiled (they would hold {_m(r.tower_weight_bytes_skipped)}{per})")
    elif r.towers:
        lines.append(f"  towers          {r.towers}: weights {_m(r.tower_weight_bytes)}{per} (held beside the text "
                     f"weights" + (", replicated on every chip" if slice_ else "") + "; --no-mm leaves them out)")
    for e in r.encoders:
        if e.ok:
            lines.append(f"  encoder {e.name:<7} {e.tower}, {e.inputs} -> {e.soft_tokens} soft tokens: weights "
                         f"{_m(e.weight_bytes)}, temporaries {_m(e.temp_bytes)}{per}, inputs+outputs+code "
                         f"{_m(e.extra_bytes - e.temp_bytes)}, {e.flops / 1e9:.1f} GFLOP, "
                         f"{e.pallas_calls} Pallas kernel calls (compiled in {e.seconds:.0f} s)")
    for c in r.compiles:
        if c.ok:
            lines.append(f"  {c.step:<15} T={c.tokens} S={c.seqs}{' decode-only' if c.decode_only else ''}"
                         f"{' (k draft steps)' if c.step == 'draft' else ''}"
                         f"{f' ({c.decode_steps} decode steps)' if c.decode_steps else ''}: "
                         f"{c.pallas_calls} Pallas kernel calls, "
                         f"temporaries {_g(c.temp_bytes)}{per}, code "
                         f"{c.code_bytes / MiB:.1f} MiB, step inputs+outputs "
                         f"{_g(c.overhead_bytes - c.temp_bytes - c.code_bytes - c.weight_bytes)} "
                         f"(compiled in {c.seconds:.0f} s, KV {_g(c.kv_bytes)}{per})")
    lines.append(f"  margin          {_g(r.margin_bytes)}")
    if r.fits:
        p = r.proof
        lines += [
            f"  KV cache        {_g(r.kv_cache_bytes)}  pages {r.kv_pages}"
            + (f"; per chip {_g(r.kv_cache_bytes_per_chip)}" if slice_ else ""),
            f"  total           {_g(r.peak_bytes or p.peak_bytes)}{per} of {_g(r.hbm_limit)} (proof: {p.step} "
            f"compiled at full size, temporaries {_g(p.temp_bytes)}{per}"
            + (f"; + held beside it: the drafter {_g(r.draft_weight_bytes)}" if r.draft_weight_bytes else "")
            + (f"; + the towers {_m(r.tower_weight_bytes)}, the largest encoder's buffers "
               f"{_m(max(e.extra_bytes for e in r.encoders))} in place of the step's "
               f"{_m(p.peak_bytes - p.weight_bytes - p.kv_bytes)} (the larger counts, not the sum)"
               if r.encoders else "") + ")",
            f"  KV bytes/token  ours {r.kv_bytes_per_token_ours / 1024:.1f} KiB at {r.max_model_len} tokens "
            f"(windowed sliding layers, KV sharing) | vLLM-TPU-style {r.kv_bytes_per_token_vllm / 1024:.1f} KiB",
            f"  KV tokens       ours {r.kv_tokens:,} ({r.kv_seqs_at_max_len:.1f} sequences of {r.max_model_len} "
            f"at once) | "
            f"vLLM-TPU-style {r.kv_tokens_vllm_style:,} in the same {_g(r.kv_cache_bytes)}",
            f"                  ({r.count_note})",
        ]
    if r.projection and r.fits:
        pr = r.projection
        lines.append(f"  PROJECTION (roofline, not a measurement) at context {pr.context}: 1 stream reads "
                     f"{_g(pr.bytes_1)}{per}/step -> {pr.tok_s_1:,.0f} tok/s (projection); 16 streams read "
                     f"{_g(pr.bytes_16)}{per}/step -> {pr.tok_s_16:,.0f} tok/s aggregate (projection)"
                     + ("; the chips read in parallel, the interconnect's all-reduces not counted" if slice_ else ""))
        if pr.spec_k:
            lines.append(f"  PROJECTION with speculative decoding at an ASSUMED acceptance rate {pr.acceptance:.2f} per "
                         f"draft (not measured), k={pr.spec_k}: {pr.tokens_per_round:.2f} tokens per round of {pr.spec_k} "
                         f"draft steps ({_g(pr.draft_bytes_1)} each at 1 stream) + 1 verify step -> "
                         f"{pr.spec_tok_s_1:,.0f} tok/s at 1 stream (projection); "
                         f"{pr.spec_tok_s_16:,.0f} tok/s aggregate at 16 (projection)")
    for n in r.notes:
        lines.append(f"  note: {n}")
    head, _, rest = r.reason.partition(": ")
    if head in ("fits", "does not fit"):
        lines.append(f"{head.upper()}: {rest}")
    else:
        lines.append(("FITS: " if r.fits else "DOES NOT FIT: ") + r.reason)
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `gemmajax aot` (API.md), plus the engine knobs that change the answer."""
    p.add_argument("--model", required=True, choices=MODELS)
    p.add_argument("--chip", required=True, choices=tuple(CHIPS))
    p.add_argument("--topology", default="1x1", choices=TOPOLOGIES,
                   help="chips of the slice (x by y); tensor parallel size = their number (default 1x1)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models on a slice: split the expert stacks by expert (else along their MLP width)")
    p.add_argument("--quant", default="none", help="none | w8a8 | w4a16 | qat-w4a16 [+emb4|+emb8]")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", "bf16", "fp8_e5m2", "fp8_e4m3"),
                   help="KV page dtype; auto = the model's dtype (default)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--margin-mib", type=int, default=256, help="HBM kept free besides what the compiler counts")
    p.add_argument("--proj-context", type=int, default=None, help="context of the projection (default max-model-len)")
    p.add_argument("--attn-impl", default="pallas", choices=("pallas", "ref"))
    p.add_argument("--speculative-model", default=None,
                   help="a gemma4_assistant drafter directory (its config.json only): compile the verify step and the "
                        "drafter, count its weights, project speculative decoding")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--num-scheduler-steps", type=int, default=EngineConfig.num_scheduler_steps,
                   help="decode steps of the engine's decode-steps program (decode-greedy compiles it; 1: one step)")
    p.add_argument("--assumed-acceptance", type=float, default=0.7,
                   help="per-draft acceptance rate the speculative projection ASSUMES (not measured)")
    p.add_argument("--no-mm", action="store_true",
                   help="text only: leave the checkpoint's vision / audio towers out (not loaded, no encoder "
                        "compiled), as serve runs a GGUF or a `gemmajax quantize` directory; serve loads them from an "
                        "HF checkpoint whatever --limit-mm-per-prompt says")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")


def request_from_args(args: argparse.Namespace, cfg: ModelConfig | None = None, draft: Any = None,
                      towers: Any = None) -> AotRequest:
    """An AotRequest from parsed flags; flags the caller's parser lacks take their defaults. `draft`: an
    AssistantConfig replacing --speculative-model (tests). The towers: `towers` (a MultimodalConfig, tests), else
    the preset's (`tower_preset`) when `cfg` is the preset's, else none."""
    def get(name, default):
        v = getattr(args, name, None)
        return default if v is None else v

    if cfg is None:
        cfg = ModelConfig.preset(args.model)
        if towers is None:
            towers = tower_preset(args.model)
    path = get("speculative_model", None)
    if draft is None and path is not None:
        from gemmajax.model.assistant import AssistantConfig

        conf = os.path.join(path, "config.json")
        if not os.path.exists(conf):
            raise ValueError(f"--speculative-model {path!r}: no config.json (a gemma4_assistant checkpoint directory)")
        with open(conf) as f:
            draft = AssistantConfig.from_hf(json.load(f), name=os.path.basename(path.rstrip("/")))
    return AotRequest(
        cfg=cfg, chip=args.chip, topology=get("topology", "1x1"), quant=get("quant", "none"),
        expert_parallel=bool(get("enable_expert_parallel", False)),
        kv_dtype=get("kv_dtype", "auto"), max_model_len=get("max_model_len", 8192),
        max_num_seqs=get("max_num_seqs", 64), max_num_batched_tokens=get("max_num_batched_tokens", 512),
        page_size=get("page_size", 32), margin_bytes=get("margin_mib", 256) * MiB,
        proj_context=get("proj_context", None), attn_impl=get("attn_impl", "pallas"), draft=draft,
        num_speculative_tokens=get("num_speculative_tokens", 4), assumed_acceptance=get("assumed_acceptance", 0.7),
        num_scheduler_steps=get("num_scheduler_steps", EngineConfig.num_scheduler_steps),
        towers=towers, mm=not get("no_mm", False))


def run(args: argparse.Namespace, cfg: ModelConfig | None = None, out=None, draft: Any = None,
        towers: Any = None) -> int:
    """`gemmajax aot`: print the report (or JSON with --json). Returns 0 when it fits, 1 when it does not, 2 for an
    unsupported request, 3 for a compile failure that is not about memory. `cfg` replaces the preset, `draft` (an
    AssistantConfig) the --speculative-model directory, `towers` (a MultimodalConfig) the preset's towers (tests)."""
    out = out or sys.stdout
    try:
        req = request_from_args(args, cfg, draft, towers)
        as_json = bool(getattr(args, "json", False))
        log = None if as_json else (lambda msg: print(msg, file=sys.stderr, flush=True))
        res = analyze(req, log=log)
    except ValueError as e:
        print(f"gemmajax aot: {e}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    if getattr(args, "json", False):
        print(json.dumps(res.to_json(), indent=1), file=out)
    else:
        print(format_report(res), file=out)
    if res.fits:
        return EXIT_FITS
    return EXIT_COMPILE_ERROR if res.reason.startswith("compile error") else EXIT_DOES_NOT_FIT


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gemmajax aot", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
