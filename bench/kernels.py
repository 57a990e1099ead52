"""Microbenchmarks at real layer shapes: every projection of a model through `quant.linear` (the path the model takes)
and its alternative forms, and ragged paged attention, with achieved GB/s against the memory-read bandwidth of the
machine it runs on (measured here: a numpy sum over a 1 GB array).

Design choices: the forms are called round-robin and the minimum of --reps calls is kept, so the load of a shared
machine drifts over all of them alike; weights are random at the model's exact shapes (the speed of a form does not
depend on the values) and a small weight is cycled through copies larger than the last-level cache, as a model step
streams it from memory; GB/s counts the bytes a perfect kernel must read (the weight once; each sequence's own K/V
once), so a form that re-reads or copies its weight shows up below the bandwidth line.

    .venv/bin/python bench/kernels.py                        # Gemma 3 270M shapes (the default model), M = 1 and 16
    .venv/bin/python bench/kernels.py --model e2b --ms 1,4,16 --only matmul
    .venv/bin/python bench/kernels.py --only gmm --tokens 1,16  # 26B-A4B experts: grouped matmul vs dense, same bytes

The grouped expert matmul (`--only gmm`) runs `quant.gmm` on one layer's expert stacks of Gemma 4 26B-A4B as the
loaders quantize them (w8a8 with its activation groups, w4a16; stacks padded as loaded), tokens routed to top-k
random experts (a new routing every call, so the experts read are cold), and prints its GB/s over the routed
experts' bytes next to `quant.linear` on one dense weight holding the same bytes (the routed experts' rows stacked)
at one row per token: at one token both read the same bytes and do the same FLOPs.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from gemmajax.config import ModelConfig
from gemmajax.quant import QuantArray, gmm, linear
from gemmajax.quant.gmm import gmm_xla
from gemmajax.quant.int4_matmul import int4_matmul_xla
from gemmajax.quant.int8_matmul import int8_matmul_xla
from gemmajax.quant.loading import make_quantizer
from gemmajax.quant.ops import dense_matmul, dense_matmul_cpu

# per model: hidden D, query heads N, KV heads K, head dim H, MLP F, vocab V, sliding window
MODELS = {
    "gemma3-270m": {"D": 640, "N": 4, "K": 1, "H": 256, "F": 2048, "V": 262144, "window": 512},
    "e2b": {"D": 1536, "N": 8, "K": 1, "H": 256, "F": 6144, "V": 262144, "window": 512},
}


def measure_bandwidth(gb: float = 1.0, reps: int = 5) -> float:
    """Memory-read bandwidth, GB/s: best of `reps` numpy sums over `gb` GB of float32."""
    a = np.ones(int(gb * 1e9) // 4, np.float32)
    a.sum()
    best = min(_timed(a.sum) for _ in range(reps))
    return a.nbytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def round_robin(calls: dict, reps: int) -> dict[str, float]:
    """{name: zero-argument callable} -> {name: best seconds}, after one warm-up call each."""
    for fn in calls.values():
        jax.block_until_ready(fn())
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(reps):
        for name, fn in calls.items():
            best[name] = min(best[name], _timed(fn))
    return best


# ------------------------------------------------------------------------------------------------ matmuls
def projections(m: dict) -> list[tuple[str, str, int, int]]:
    """(label, HF tensor name, in, out) of one decoder layer's projections and the tied LM head."""
    d, n, k, h, f = m["D"], m["N"], m["K"], m["H"], m["F"]
    a, p = "layers.0.self_attn.", "layers.0.mlp."
    return [("q_proj", a + "q_proj.weight", d, n * h), ("k_proj / v_proj", a + "k_proj.weight", d, k * h),
            ("o_proj", a + "o_proj.weight", n * h, d), ("gate / up_proj", p + "gate_proj.weight", d, f),
            ("down_proj", p + "down_proj.weight", f, d), ("lm_head (tied)", "embed_tokens.weight", d, m["V"])]


def matmul_forms(tensor: str, w_bf16: jax.Array) -> dict[str, tuple]:
    """{label: (fn(x, w), w, weight bytes)}: `linear` on the weight as each load-time quantization leaves it (the
    loader's own quantizer, so act_group / table padding are the model's), plus the plain-array CPU forms."""
    table = tensor == "embed_tokens.weight"
    modes = ("w8a8+emb8", "w4a16+emb4") if table else ("w8a8", "w4a16")
    forms = {
        "bf16 linear": (linear, w_bf16),
        "  bf16 vector form": (functools.partial(dense_matmul_cpu, form="vector"), w_bf16),
        "  bf16 gemm form": (functools.partial(dense_matmul_cpu, form="gemm"), w_bf16),
        "  bf16 jnp.dot(x, w.T)": (dense_matmul, w_bf16),
    }
    for mode in modes:
        q = make_quantizer(mode)(tensor, w_bf16)
        extra = f", act_group {q.act_group}" if getattr(q, "act_group", 0) else ""
        forms[f"{q.kind} linear ({mode}{extra})"] = (linear, q)
        xla = int8_matmul_xla if q.kind == "int8" else int4_matmul_xla
        for form in ("vector", "int") if q.kind == "int8" else ("rows", "tiles"):
            forms[f"  {q.kind} {form} form"] = (functools.partial(xla, form=form), q)
    return {name: (fn, w, w.nbytes) for name, (fn, w) in forms.items()}


COLD_BYTES = 96 << 20  # more than the last-level cache: each call reads a weight copy no other call left in cache


def cycling(fn, x, w):
    """A zero-argument call of fn(x, w_i) that moves to the next of enough copies of w to span COLD_BYTES, so a
    small weight is read from memory as in a model step (repeated calls on one copy would hit the cache)."""
    n = max(1, min(64, COLD_BYTES // max(1, jax.tree.reduce(lambda a, b: a + b, jax.tree.map(lambda a: a.nbytes, w)))))
    copies = [w] + [jax.tree.map(lambda a: a.copy(), w) for _ in range(n - 1)]
    it = iter(range(1 << 62))
    return lambda: fn(x, copies[next(it) % n])


def bench_matmuls(model: dict, ms: list[int], reps: int, bw: float, skip_head: bool) -> None:
    rng = np.random.default_rng(0)
    print(f"\n## matmuls: ms per call (min of {reps}), GB/s of weight bytes read, % of {bw:.1f} GB/s, GFLOP/s")
    for name, tensor, k, n in projections(model):
        if skip_head and name.startswith("lm_head"):
            continue
        w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)
        all_forms = matmul_forms(tensor, w)
        for m in ms:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            forms = dict(all_forms)
            if name.startswith("lm_head") and m > 1:  # one-row forms re-read the table per row: minutes
                for slow in ("  bf16 vector form", "  int8 vector form", "  int4 rows form"):
                    forms.pop(slow, None)
            jitted = {label: cycling(jax.jit(fn), x, wt) for label, (fn, wt, _) in forms.items()}
            best = round_robin(jitted, reps)
            for label, sec in best.items():
                nbytes = forms[label][2]
                gbs = nbytes / sec / 1e9
                print(f"{name:16s} {k:5d} x {n:6d}  M={m:3d}  {label:34s} {sec * 1e3:9.3f} ms {gbs:7.1f} GB/s "
                      f"{100 * gbs / bw:5.1f}%  {2 * m * k * n / sec / 1e9:7.1f} GFLOP/s  load {os.getloadavg()[0]:.1f}",
                      flush=True)


# ------------------------------------------------------------------------------------------------ grouped matmul
def _random_like(a: jax.ShapeDtypeStruct, rng: np.random.Generator) -> jax.Array:
    """Random contents for an abstract leaf: any bytes for integer levels, small positive scales."""
    if jnp.issubdtype(a.dtype, jnp.integer):
        info = np.iinfo(a.dtype)
        return jnp.asarray(rng.integers(info.min, info.max, a.shape, endpoint=True, dtype=a.dtype))
    return jnp.asarray(rng.uniform(0.5e-3, 2e-3, a.shape).astype(np.float32), a.dtype)


def expert_stack(mode: str, name: str, shape: tuple[int, int, int], rng: np.random.Generator) -> QuantArray:
    """The QuantArray the loader's quantizer makes of an expert stack (padding, act_group), with random contents."""
    abstract = jax.eval_shape(lambda w: make_quantizer(mode)(name, w), jax.ShapeDtypeStruct(shape, jnp.bfloat16))
    return jax.tree.map(lambda a: _random_like(a, rng), abstract)


def rotating(fn, x, w, cases):
    """A zero-argument call of fn(x, w, case_i) that moves to the next routing each call."""
    it = iter(range(1 << 62))
    return lambda: fn(x, w, cases[next(it) % len(cases)])


def bench_gmm(tokens: list[int], reps: int, bw: float, forms: list[int], routings: int = 8) -> None:
    """quant.gmm at 26B-A4B expert shapes vs quant.linear at the same bytes (module docstring)."""
    cfg = ModelConfig.preset("26b-a4b")
    e, d, f, k = cfg.num_experts, cfg.hidden_size, cfg.moe_dim, cfg.top_k_experts
    print(f"\n## grouped expert matmul, 26B-A4B (E {e}, top-{k}, D {d}, F {f}): ms per call (min of {reps}), GB/s "
          f"of the routed experts' bytes, % of {bw:.1f} GB/s; dense = linear on one weight of the same bytes")
    rng = np.random.default_rng(0)
    for label, name, (n, kk) in (("gate_up", "layers.0.experts.gate_up_proj", (2 * f, d)),
                                 ("down", "layers.0.experts.down_proj", (d, f))):
        for mode in ("w8a8", "w4a16"):
            q = expert_stack(mode, name, (e, n, kk), rng)
            per_expert = q.nbytes / e
            for t in tokens:
                m = t * k
                cases = []
                for _ in range(routings):  # sorted rows of t tokens, each to k distinct random experts
                    top = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
                    cases.append(jnp.asarray(np.bincount(top.reshape(-1), minlength=e), jnp.int32))
                hit = float(np.mean([int((np.asarray(c) > 0).sum()) for c in cases]))
                x = jnp.asarray(rng.standard_normal((m, kk)), jnp.bfloat16)
                h = round(hit)  # the dense weight: h experts' rows as one [h * N, K] matrix
                dense = dataclasses.replace(q, values=q.values[:h].reshape(h * q.padded_out, -1),
                                            scale=q.scale[:h].reshape(h * q.padded_out, *q.scale.shape[2:]),
                                            shape=(h * n, kk))
                calls = {"gmm": rotating(jax.jit(gmm), x, q, cases),
                         f"dense linear, M={t}": cycling(jax.jit(linear), x[:t], dense)}
                for c in forms:  # the CPU's item sizes (gmm.py's table): one row per item, or c rows
                    fn = jax.jit(functools.partial(gmm_xla, rows_per_item=c))
                    calls[f"  gmm rows/item {c}"] = rotating(fn, x, q, cases)
                best = round_robin(calls, reps)
                for what, sec in best.items():
                    nbytes = dense.nbytes if what.startswith("dense") else hit * per_expert
                    gbs = nbytes / sec / 1e9
                    print(f"{label:8s} {kk:5d} x {n:5d} {mode:6s} tokens={t:3d} rows={m:4d} experts hit {hit:5.1f}  "
                          f"{what:18s} {sec * 1e3:9.3f} ms {gbs:7.1f} GB/s {100 * gbs / bw:5.1f}%", flush=True)


# ------------------------------------------------------------------------------------------------ attention
def attention_scenarios(window: int) -> list[tuple[str, list[tuple[int, int]], int | None]]:
    """(name, [(cached tokens, new tokens) per sequence], sliding window)."""
    return [
        ("decode 1 x 128", [(127, 1)], None),
        ("decode 16 x 128", [(127, 1)] * 16, None),
        ("decode 1 x 1k", [(1023, 1)], None),
        ("decode 16 x 1k", [(1023, 1)] * 16, None),
        (f"decode 16 x 1k, window {window}", [(1023, 1)] * 16, window),
        ("prefill 1 x 24", [(0, 24)], None),
        ("prefill 16 x 24", [(0, 24)] * 16, None),
        ("prefill 1 x 512", [(0, 512)], None),
    ]


def bench_attention(model: dict, reps: int, bw: float, page_size: int = 32) -> None:
    from gemmajax.kv import alloc_pages, bytes_per_page, make_ragged_meta, ragged_paged_attention
    from gemmajax.kv.layout import storage_dtype
    n, nk, h = model["N"], model["K"], model["H"]
    print(f"\n## ragged paged attention (N={n} K={nk} H={h}, bf16 pages bit-stored, {page_size}-token pages; the "
          f"engine's CPU layout): ms per call, GB/s of K/V bytes each sequence must read, % of {bw:.1f} GB/s")
    rng = np.random.default_rng(0)
    for name, seqs, window in attention_scenarios(model["window"]):
        q_lens = [ql for _, ql in seqs]
        kv_lens = [c + ql for c, ql in seqs]
        t = sum(q_lens)
        t_pad = max(16, 1 << (t - 1).bit_length()) if t > len(seqs) else len(seqs)
        need = [-(-kv // page_size) for kv in kv_lens]
        tables, at = [], 1
        for cnt in need:
            tables.append(list(range(at, at + cnt)))
            at += cnt
        p_max = 1024 // page_size  # the engine's page-table width for max_model_len 1024
        meta = make_ragged_meta(q_lens, kv_lens, tables, max_num_seqs=max(len(seqs), 1), pages_per_seq=p_max)
        pages = alloc_pages(at, page_size, nk, h, "bf16")
        pages = jnp.asarray(rng.normal(size=pages.shape), jnp.float32).astype(pages.dtype)
        pages = jax.lax.bitcast_convert_type(pages, storage_dtype("bf16", bits=True))
        q = jnp.asarray(rng.normal(size=(t_pad, n, h)), jnp.bfloat16)
        kn = jnp.asarray(rng.normal(size=(t_pad, nk, h)), jnp.bfloat16)

        @functools.partial(jax.jit, donate_argnums=(3,))
        def step(q, k, v, pages, meta, window=window):
            return ragged_paged_attention(q, k, v, pages, meta, sm_scale=h ** -0.5, sliding_window=window,
                                          kv_dtype="bf16")

        state = {"pages": pages}

        def call(state=state, q=q, kn=kn, meta=meta, step=step):
            out, state["pages"] = step(q, kn, kn, state["pages"], meta)
            return out

        sec = round_robin({name: call}, reps)[name]
        span = [min(kv, window + ql - 1) if window else kv for kv, ql in zip(kv_lens, q_lens)]
        kv_bytes = sum(span) * bytes_per_page(1, nk, h, "bf16")
        gbs = kv_bytes / sec / 1e9
        print(f"{name:34s} {sec * 1e3:9.3f} ms  {t / sec:9.0f} q tok/s  {gbs:7.2f} GB/s K/V  {100 * gbs / bw:5.1f}%",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m", choices=sorted(MODELS))
    ap.add_argument("--ms", default="1,16", help="activation rows M, comma separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", choices=("matmul", "attention", "gmm"))
    ap.add_argument("--tokens", default="1,16", help="gmm: tokens per call (each routed to top-k experts)")
    ap.add_argument("--gmm-forms", default="", help="gmm: also time the CPU forms with these rows per item, e.g. 1,8")
    ap.add_argument("--skip-head", action="store_true", help="leave out the (slow to build) LM head shapes")
    a = ap.parse_args()
    model = MODELS[a.model]
    bw = measure_bandwidth()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; numpy-sum bandwidth {bw:.1f} GB/s; model {a.model} {model}")
    if a.only in (None, "matmul"):
        bench_matmuls(model, [int(v) for v in a.ms.split(",")], a.reps, bw, a.skip_head)
    if a.only in (None, "attention"):
        bench_attention(model, a.reps, bw)
    if a.only == "gmm":  # not in the default run: one layer's 26B-A4B stacks take 1-2 GB
        bench_gmm([int(v) for v in a.tokens.split(",")], a.reps, bw, [int(v) for v in a.gmm_forms.split(",") if v])
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
