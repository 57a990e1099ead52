"""The GEMM floor of one decode step on this machine: every weight matmul of the model's step, run alone.

A decode step of S streams multiplies S rows by every weight matrix (the 7 projections of each layer and the tied
LM head; for XLA:CPU the 4 matmuls a layer of the CPU engine runs, q / k / v and gate / up joined:
gemma.fuse_projections). This script runs exactly that sequence of GEMMs, with bf16 weights of the model's shapes
(random values, each matrix its own buffer, so nothing stays in cache between layers as in the real step), and
nothing else: no attention, norms, sampling or dispatch. The time it prints is a floor for the whole step with that GEMM
library, and S / time the most tokens/s any engine built on it can decode. It runs through XLA:CPU (what
gemmajax's CPU step compiles to: `dense_matmul_cpu`, YNNPACK GEMMs from 2 rows) and through torch (oneDNN: what
transformers' step calls), each in processes of its own so their thread pools do not compete.

With --kinds the XLA child also runs the same GEMMs with the weights as the quantized modes store them (int8: w8a8
layers and the +emb8 table; int4: w4a16 layers and the +emb4 table) through the engine's own `linear`, activation
quantization and per-call conversions included; a mode's floor is its layers' kind plus its head's, and
bench/compare_cpu.py prints each target's ceiling from them. Each GEMM reads the latest output of its input width,
the step's data flow (q / k / v the previous layer's down_proj, o_proj q's, gate / up o_proj's, down_proj up's): with
every GEMM reading the same input, XLA scheduled every int8 layer's per-call conversion at the program's start
(int8 at 16 rows 69.7 ms against 17.7-18.2 chained). The table below predates the chain (independent GEMMs).

    .venv/bin/python bench/gemm_floor.py --rows 1 2 16 64    # Gemma 3 270M (the GGUF's config); ~2 min
    .venv/bin/python bench/gemm_floor.py --rows 1 16 --kinds bf16,int8,int4 --rounds 3    # ~3 min

Measured here (2-core AMD EPYC, AVX-512 bf16, jax 0.10.2, torch 2.13.0; best of 3 rounds x 5 calls):

| rows | XLA:CPU layers ms | XLA:CPU LM head ms | XLA:CPU step floor ms | tok/s bound | torch layers ms | torch LM head ms | torch step floor ms | tok/s bound |
|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| 1 | 6.4 | 10.8 | 17.2 | 58 | 14.1 | 19.7 | 33.7 | 30 |
| 2 | 13.6 | 20.6 | 34.2 | 59 | 14.1 | 20.7 | 34.8 | 57 |
| 16 | 20.7 | 31.5 | 52.2 | 307 | 21.1 | 31.5 | 52.6 | 304 |
| 64 | 48.4 | 103.7 | 152.1 | 421 | 42.5 | 76.5 | 118.9 | 538 |

(126 layer GEMMs and the 262144 x 640 LM head, 536 MB of bf16 weights; one row runs gemmajax's one-row form,
a loop fusion that reads bf16 weights at memory speed, which is why XLA:CPU is ahead there.) What it means for the
16-stream targets of bench/compare_cpu.py: the GEMMs alone take 52.2 ms a step, a bound of 307 tok/s for a step
that did nothing else, and oneDNN's bound is the same (304). 2x transformers' 150.4 tok/s needs 301 tok/s, a
53.2 ms step: 1.0 ms left for 18 layers of attention, norms, RoPE, sampling and dispatch. 4x llama.cpp's 73.0
needs 292 tok/s, 54.8 ms: 2.6 ms left. gemmajax's bf16 step spends about 9 ms on them (attention 5.7 ms).

Why the floor is there: at 16 rows the 536 MB are read at about 10 GB/s, a third of this machine's bandwidth,
while the multiplies need 14 ms at the bf16 dot-product peak. The LM head costs 20.6 ms at 2 rows and 31.5 at 16:
a fixed ~19 ms, about three passes over its 335 MB, which fits YNNPACK packing the weight into its kernels' tile
layout inside every call (its bf16 dot-product kernels take k in interleaved pairs, its kernels that read an
unpacked weight run on the half-speed f32 FMA path, and a jit argument is never a constant it could pack once:
ynnpack/subgraph/dot.cc, should_pack_b). Tried and measured slower or equal: the weight as the streamed operand
(weight x activations^T, 27-29 ms, at the f32 FMA rate), int8 x int8 (26.8 ms; u8 x s8, the VNNI form, falls off
YNNPACK to a 300 ms path), f32 weights (0.42 against 0.30 ms for a 2048 x 640 projection), vocabulary chunks as a
batched dot (32-52 ms), and XLA's other GEMM paths (its own emitter, the XNNPACK and oneDNN flags: 10x slower).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys

from compare_cpu import best_of  # bench/ is on sys.path: this script runs as bench/gemm_floor.py


def shapes(cfg, fused: bool = False) -> tuple[list[tuple[int, int, int, int]], tuple[int, int]]:
    """([out, in, feeds, halves] of every layer projection in step order, [out, in] of the LM head). `feeds` is the
    width of the output's first columns that the next GEMM reads: all of them, except for the engine's joined weights
    (fused: q / k / v and gate / up, gemma.fuse_projections, which the CPU engine multiplies): q / k / v's q part
    feeds o_proj, and gate / up's two halves multiplied (`halves` 1) feed down_proj. KV-shared layers have no k / v."""
    d, n = cfg.hidden_size, cfg.num_heads
    layers = []
    for spec in cfg.layers:
        q, kv, f = n * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.mlp_dim
        qkv = [(q, d, q, 0)] + ([] if not spec.owns_kv else [(kv, d, kv, 0)] * (1 if spec.k_eq_v else 2))
        if fused and spec.owns_kv:   # a KV-shared layer runs its q_proj alone
            qkv = [(sum(o[0] for o in qkv), d, q, 0)]
        mlp = [(2 * f, d, f, 1)] if fused else [(f, d, f, 0), (f, d, f, 0)]
        layers += qkv + [(d, q, d, 0)] + mlp + [(d, f, d, 0)]
    return layers, (cfg.vocab_size, d)


def warm_best(reps: int, fn, *args) -> float:
    """Seconds of the fastest of `reps` calls of fn(*args), after one untimed call (compiles, warms caches)."""
    fn(*args)
    return best_of(functools.partial(fn, *args), reps)


KINDS = ("bf16", "int8", "int4")  # weight kinds of the XLA child: the bf16 weight, w8a8's int8, w4a16's int4


def quantized(kind: str, w, table: bool = False):
    """A bf16 weight [out, in] as the engine stores it for `kind` on the CPU: bf16 as is; int8 per output row with
    the w8a8 activation groups the loaders give (quantize.default_act_group), int4 in groups of 32 in the CPU word
    layout; a vocabulary table (`table`) as quantize_table makes the +emb8 / +emb4 tables."""
    from gemmajax.quant.quantize import default_act_group, quantize, quantize_table
    if kind == "bf16":
        return w
    from gemmajax.quant.array import int4_to_words  # the engine's CPU layout of int4 (LLMEngine: int4_words_tree)
    if table:
        return int4_to_words(quantize_table(w, 8 if kind == "int8" else 4))
    if kind == "int8":
        return quantize(w, "int8", act_group=default_act_group(w.shape[1]))
    return int4_to_words(quantize(w, "int4", 32))


def child_xla(layer_shapes, head, rows, reps, kinds=("bf16",)) -> dict:
    """{kind: {rows: (layers s, LM head s)}} through the engine's own matmuls (`linear`: dense_matmul_cpu for bf16,
    the int8 / int4 CPU forms for quantized weights), each kind's weights built from the same bf16 values."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gemmajax.quant.ops import linear

    rng = np.random.default_rng(0)  # std 1 / sqrt(in): each product keeps its input's scale along the chain
    ws16 = [jnp.asarray(rng.standard_normal(s[:2], np.float32) / np.sqrt(s[1]), jnp.bfloat16) for s in layer_shapes]
    feeds = tuple((s[2], s[3]) for s in layer_shapes)
    head16 = jnp.asarray(rng.standard_normal(head, np.float32) / np.sqrt(head[1]), jnp.bfloat16)
    out: dict = {}

    def ready(f, *a):
        return jax.block_until_ready(f(*a))

    @jax.jit
    def layers(xs, ws):
        """The step's data flow: each GEMM reads the latest output of its input width (q / k / v the previous
        layer's down_proj, o_proj q's, gate / up o_proj's, down_proj up's; a joined weight's first columns), so
        that, as in the model, a weight's per-call conversion cannot be scheduled before its input exists
        (int8_matmul.after); every product is kept (one element of each summed), so none is dead code."""
        acc, latest = jnp.zeros((), jnp.float32), dict(xs)
        for w, (feed, halves) in zip(ws, feeds):
            y = linear(latest[w.shape[1]], w)
            # gate / up joined (`halves`): the product of its halves, as the model's; q / k / v joined: the q part,
            # its last column kept below
            latest[feed] = y[:, :feed] * y[:, feed:] if halves else y[:, :feed]
            acc += y[0, 0].astype(jnp.float32) + y[0, -1].astype(jnp.float32)
        return acc

    lm = jax.jit(linear)
    widths = {s[1] for s in layer_shapes} | {head[1]}
    xs = {m: {k: jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16) for k in widths} for m in rows}
    for kind in kinds:
        ws = [quantized(kind, w) for w in ws16]
        w_head = quantized(kind, head16, table=True)
        jax.block_until_ready((ws, w_head))
        out[kind] = {m: (warm_best(reps, ready, layers, xs[m], ws), warm_best(reps, ready, lm, xs[m][head[1]], w_head))
                     for m in rows}
        del ws, w_head
    return out


def child_torch(layer_shapes, head, rows, reps) -> dict:
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(s[:2], generator=g) * 0.05).bfloat16() for s in layer_shapes]
    w_head = (torch.randn(head, generator=g) * 0.05).bfloat16()
    out = {}
    with torch.inference_mode():
        for m in rows:
            xs = {k: torch.ones(m, k).bfloat16() for k in {s[1] for s in layer_shapes} | {head[1]}}

            def layers(xs, ws):
                for w in ws:
                    torch.nn.functional.linear(xs[w.shape[1]], w)
            out[m] = (warm_best(reps, layers, xs, ws), warm_best(reps, torch.nn.functional.linear, xs[head[1]], w_head))
    return out


def measure(model_path: str | None = None, rows=(1, 16), reps: int = 5, rounds: int = 3,
            engines=("xla", "torch"), kinds=("bf16",)) -> dict:
    """The floor for each engine and row count, each process a fresh one, rounds alternating between engines (best
    of all rounds). Returns {"layers": [[out, in, feeds, halves], ...] (`shapes`; torch's), "fused_layers": the
    same with q / k / v and gate / up joined (XLA's), "head": [V, D], engine: {rows: (layers s, LM head s)}}
    (bf16 weights), and for XLA {"xla_kinds": {kind: {rows: (layers s, LM head s)}}} for each of `kinds` (KINDS:
    the layers' and the tied head's weights as w8a8 / w4a16 and +emb8 / +emb4 store them; a mode's floor is its
    layers' kind plus its head's: compare_cpu.mode_floor)."""
    from gemmajax.model.gguf import default_model_path
    from gemmajax.model.loader import open_checkpoint
    cfg = open_checkpoint(model_path or default_model_path()).config
    (layer_shapes, head), fused = shapes(cfg), shapes(cfg, fused=True)[0]
    kinds = tuple(dict.fromkeys(("bf16", *kinds)))
    res: dict = {"layers": layer_shapes, "fused_layers": fused, "head": head, **{e: {} for e in engines},
                 "xla_kinds": {}}
    for _ in range(rounds):  # alternating rounds, best of all: other tenants of the machine come and go
        for engine in engines:   # XLA: the CPU engine's joined weights; torch: transformers' projections
            spec = json.dumps({"engine": engine, "layers": fused if engine == "xla" else layer_shapes, "head": head,
                               "rows": list(rows), "reps": reps, "kinds": list(kinds)})
            env = dict(os.environ, JAX_PLATFORMS="cpu")
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec], capture_output=True,
                               text=True, env=env, check=False)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if not line:
                raise RuntimeError(f"gemm_floor {engine} failed: {p.stderr.strip().splitlines()[-3:]}")
            got = json.loads(line[-1][7:])
            for kind, by_rows in (got if engine == "xla" else {"bf16": got}).items():
                dst = res["xla_kinds"].setdefault(kind, {}) if engine == "xla" else res[engine]
                for k, (lay, lm) in by_rows.items():
                    old = dst.get(int(k), (float("inf"), float("inf")))
                    dst[int(k)] = (min(old[0], lay), min(old[1], lm))
    if "xla" in engines:  # XLA's bf16 floor is its bf16 kind
        res["xla"] = res["xla_kinds"]["bf16"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="rows per GEMM (decode streams)")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per process (best taken)")
    ap.add_argument("--rounds", type=int, default=3, help="processes per library, alternating (best taken)")
    ap.add_argument("--model-path", default=None, help="a checkpoint gemmajax loads (default: the Gemma 3 270M GGUF)")
    ap.add_argument("--kinds", default="bf16", type=lambda v: [k.strip() for k in v.split(",") if k.strip()],
                    help=f"XLA weight kinds, some of {','.join(KINDS)} (int8 / int4: w8a8 / w4a16 layers and the "
                         "+emb8 / +emb4 head)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        shapes_, head_ = [tuple(s) for s in spec["layers"]], tuple(spec["head"])
        if spec["engine"] == "xla":
            res = child_xla(shapes_, head_, spec["rows"], spec["reps"], tuple(spec.get("kinds", ("bf16",))))
        else:
            res = child_torch(shapes_, head_, spec["rows"], spec["reps"])
        print("RESULT " + json.dumps(res), flush=True)
        return
    bad = [k for k in args.kinds if k not in KINDS]
    if bad:
        raise SystemExit(f"--kinds: unknown {bad}; expected some of {KINDS}")
    print(f"load average {os.getloadavg()[0]:.2f} before the run", flush=True)
    res = measure(args.model_path, args.rows, args.reps, args.rounds, kinds=args.kinds)
    layer_shapes, head = res["layers"], res["head"]
    print(f"{len(res['fused_layers'])} layer GEMMs for XLA:CPU (the engine's joined q / k / v and gate / up), "
          f"{len(layer_shapes)} for torch, + LM head {head[0]} x {head[1]}; bf16 weights "
          f"{(sum(s[0] * s[1] for s in layer_shapes) + head[0] * head[1]) * 2 / 1e6:.0f} MB; load average at the end "
          f"{os.getloadavg()[0]:.2f}")
    print("| rows | XLA:CPU layers ms | XLA:CPU LM head ms | XLA:CPU step floor ms | tok/s bound | torch layers ms "
          "| torch LM head ms | torch step floor ms | tok/s bound |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in args.rows:
        cells = []
        for engine in ("xla", "torch"):
            lay, lm = res[engine][m]
            cells += [f"{lay * 1e3:.1f}", f"{lm * 1e3:.1f}", f"{(lay + lm) * 1e3:.1f}", f"{m / (lay + lm):.0f}"]
        print(f"| {m} | " + " | ".join(cells) + " |")
    if len(res["xla_kinds"]) > 1:
        print("\nXLA:CPU by weight kind (the engine's matmul for each: `linear`), ms:\n\n| rows | kind | layers | "
              "LM head |\n|---:|---|---:|---:|")
        for m in args.rows:
            for kind, by_rows in res["xla_kinds"].items():
                print(f"| {m} | {kind} | {1e3 * by_rows[m][0]:.2f} | {1e3 * by_rows[m][1]:.2f} |")


if __name__ == "__main__":
    main()
