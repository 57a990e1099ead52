"""E2B-shaped decode on one GPU (written for a lent H200): bf16 and w8a8 at 1, 16 and 64 streams against the HBM
roofline, plus the kernels underneath (weight matmuls, paged attention, a plain copy).

Design choices: weights are random (no checkpoint can reach the device machine) but have exactly the shapes and
dtypes `gemmajax.aot.abstract_model_weights` gives, so the bytes moved per step are the real model's; the step is
the engine's own `model_step` with the paged cache donated, the attention on its XLA path (`impl="ref"`: Pallas
TPU kernels do not run on a GPU). Every speed is printed next to the roofline tokens/s = bandwidth / bytes read per
step (gemmajax.aot.decode_bytes_read) at the nominal 4.8 TB/s and at the copy bandwidth measured in the same run.
A deadline keeps the whole run inside one device call: items past it are skipped and said so.

Run: bash bench/device_h200.sh (on the device) | python bench/device_h200.py --tiny (CPU smoke test)
"""
from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gemmajax import aot  # noqa: E402
from gemmajax.config import ModelConfig, _g4  # noqa: E402
from gemmajax.engine.runner import (  # noqa: E402
    RunnerSpec,
    bucket,
    build_step_inputs,
    kv_groups,
    model_step,
    pow2_buckets,
)
from gemmajax.kv.attention import make_ragged_meta, ragged_paged_attention  # noqa: E402
from gemmajax.quant import QuantArray, linear  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def timeit(fn, *args, reps: int = 10, warmup: int = 2) -> float:
    """Mean seconds per call of a jitted fn (results blocked on after the last call only)."""
    out = None
    for _ in range(warmup):
        out = fn(*args)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps


# ---------------------------------------------------------------------------------------------- random weights

@functools.cache
def _filler(shape: tuple[int, ...], dtype: str):
    """One jitted fill per (shape, dtype): the model's ~100 leaves have a few dozen distinct shapes."""
    dt = jnp.dtype(dtype)
    if jnp.issubdtype(dt, jnp.floating):
        return jax.jit(lambda k: (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dt))
    lo, hi = (-127, 128) if dt == jnp.int8 else (0, 256)
    return jax.jit(lambda k: jax.random.randint(k, shape, lo, hi, jnp.int32).astype(dt))


def random_tree(tree, seed: int = 0):
    """Device arrays with the shapes and dtypes of an abstract tree: floats ~ N(0, 0.02), int8 in [-127, 127],
    uint8 (packed int4) uniform. Numbers are meaningless; bytes and shapes are the model's."""
    leaves, treedef = jax.tree.flatten(tree)
    key = jax.random.key(seed)
    out = [_filler(tuple(a.shape), jnp.dtype(a.dtype).name)(jax.random.fold_in(key, i)) for i, a in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


# ---------------------------------------------------------------------------------------------- measurements

def copy_bandwidth(gib: float) -> float:
    """Bytes/s of x + 1 over a bf16 array of `gib` GiB (read once, written once)."""
    n = int(gib * aot.GiB) // 2
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    dt = timeit(f, x, reps=10)
    del x
    return 2 * n * 2 / dt


def bench_linear(out_f: int, in_f: int, m: int, quant: str, min_bytes: int) -> tuple[float, int]:
    """Seconds and bytes of one y = x @ W.T, measured over a scan of R distinct weights (R x bytes >= min_bytes,
    so the L2 cache cannot hold them)."""
    dense_bytes = out_f * in_f * (1 if quant == "w8a8" else 2)
    reps = max(1, math.ceil(min_bytes / dense_bytes))
    key = jax.random.key(1)
    x = jax.random.normal(key, (m, in_f), jnp.float32).astype(jnp.bfloat16)
    if quant == "w8a8":
        vals = jax.jit(lambda k: jax.random.randint(k, (reps, out_f, in_f), -127, 128, jnp.int32).astype(jnp.int8))(key)
        scale = jnp.full((reps, out_f), 0.02 / 127, jnp.float32)

        def body(c, vs):
            w = QuantArray(vs[0], vs[1], "int8", (out_f, in_f), 0, jnp.bfloat16)
            return c + jnp.sum(linear(x, w).astype(jnp.float32)), None  # all of y: nothing to simplify away

        f = jax.jit(lambda v, s: jax.lax.scan(body, jnp.float32(0), (v, s))[0])
        args = (vals, scale)
        nbytes = out_f * in_f + out_f * 4
    else:
        normal = jax.jit(lambda k: (0.02 * jax.random.normal(k, (reps, out_f, in_f), jnp.float32)).astype(jnp.bfloat16))
        vals = normal(key)

        def body(c, w):
            return c + jnp.sum(linear(x, w).astype(jnp.float32)), None

        f = jax.jit(lambda v: jax.lax.scan(body, jnp.float32(0), v)[0])
        args = (vals,)
        nbytes = out_f * in_f * 2
    dt = timeit(f, *args, reps=5) / reps
    del vals, args
    return dt, nbytes + m * (in_f + out_f) * 2


def bench_attention(batch: int, context: int, head_dim: int, kv_heads: int, q_heads: int, window: int | None,
                    page_size: int = 32) -> tuple[float, int]:
    """Seconds and KV bytes read of one decode call of ragged_paged_attention(impl='ref') for `batch` sequences."""
    ppseq = math.ceil(context / page_size)
    num_pages = 1 + batch * ppseq
    pages = jnp.zeros((num_pages, 2 * kv_heads, page_size, head_dim), jnp.bfloat16)
    tables = [list(range(1 + i * ppseq, 1 + (i + 1) * ppseq)) for i in range(batch)]
    meta = make_ragged_meta([1] * batch, [context] * batch, tables, max_num_seqs=batch, pages_per_seq=ppseq)
    q = jax.random.normal(jax.random.key(2), (batch, q_heads, head_dim), jnp.float32).astype(jnp.bfloat16)
    k = v = jnp.zeros((batch, kv_heads, head_dim), jnp.bfloat16)
    f = jax.jit(lambda q, k, v, p, m: ragged_paged_attention(q, k, v, p, m, sliding_window=window, impl="ref"),
                donate_argnums=(3,))
    out = None
    for _ in range(3):
        out, pages = f(q, k, v, pages, meta)
    jax.block_until_ready(out)
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        out, pages = f(q, k, v, pages, meta)
    jax.block_until_ready(out)
    dt = (time.perf_counter() - t) / reps
    toks = min(context, window) if window else context
    return dt, batch * toks * 2 * kv_heads * head_dim * 2


def decode_case(cfg: ModelConfig, weights, abstract, batch: int, context: int, page_size: int = 32,
                steps: int = 20) -> tuple[float, float]:
    """Seconds per decode step of `batch` sequences at `context` tokens (the engine's model_step, cache donated),
    and the bytes such a step reads (weights per decode_bytes_read + the KV of every layer)."""
    groups = kv_groups(cfg)
    ppseq = math.ceil((context + 1) / page_size)
    num_pages = tuple(1 + batch * ppseq for _ in groups)
    spec = RunnerSpec(cfg, groups, page_size, num_pages, ppseq, "bf16", attn_impl="ref")
    kv = tuple(jnp.zeros(lay.shape(spec.num_pages[spec.group_of(li)]), lay.jnp_dtype)
               for li, lay in zip(cfg.kv_layers, spec.layouts()))
    table = [list(range(1 + i * ppseq, 1 + (i + 1) * ppseq)) for i in range(batch)]
    entries = [([7], context, 1, [table[i]] * len(groups)) for i in range(batch)]
    t_pad = bucket(batch, pow2_buckets(16, 512))  # the engine pads a decode step's tokens to its buckets
    inp = jax.device_put(build_step_inputs(spec, entries, t_pad, batch))
    step = jax.jit(lambda w, kv, inp: model_step(w, spec, kv, inp), donate_argnums=(1,))
    t = time.perf_counter()
    logits, kv = step(weights, kv, inp)
    jax.block_until_ready(logits)
    log(f"    compiled + first step in {time.perf_counter() - t:.1f} s")
    for _ in range(2):
        logits, kv = step(weights, kv, inp)
    jax.block_until_ready(logits)
    t = time.perf_counter()
    for _ in range(steps):
        logits, kv = step(weights, kv, inp)
    jax.block_until_ready(logits)
    dt = (time.perf_counter() - t) / steps
    if not bool(jnp.all(jnp.isfinite(logits[:batch]))):
        raise FloatingPointError(f"non-finite logits at batch {batch}")
    w_bytes, kv_bytes = aot.decode_bytes_read(cfg, abstract, batch, context + 1, "bf16")
    del kv, logits
    return dt, w_bytes + batch * kv_bytes


# ---------------------------------------------------------------------------------------------- main

def tiny_config() -> ModelConfig:
    cfg = ModelConfig.from_hf(_g4(256, 4, 2, 1, None, 512, 2, 64, ple=64, shared=2, double=True), name="tiny")
    return cfg.replace(vocab_size=1024, ple_vocab_size=1024)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="toy model, small sizes: a CPU smoke test of this script")
    p.add_argument("--streams", default="1,16,64")
    p.add_argument("--quants", default="none,w8a8")
    p.add_argument("--context", type=int, default=1024, help="tokens already in each sequence's cache")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--peak-bw", type=float, default=4.8e12, help="nominal HBM bandwidth, bytes/s (H200: 4.8 TB/s)")
    p.add_argument("--deadline", type=float, default=500.0, help="seconds; later items are skipped")
    a = p.parse_args(argv)
    streams = [int(s) for s in a.streams.split(",")]
    quants = a.quants.split(",")
    dev = jax.devices()[0]
    log(f"jax {jax.__version__}, backend {jax.default_backend()}, device {dev.device_kind}, "
        f"{len(jax.devices())} device(s)")
    if not a.tiny and jax.default_backend() != "gpu":
        log("no GPU backend: run with --tiny for a CPU smoke test")
        return 2
    cfg = tiny_config() if a.tiny else ModelConfig.preset("e2b")
    context = 64 if a.tiny else a.context
    big = 8 * aot.MiB if a.tiny else 512 * aot.MiB

    def over() -> bool:
        return time.perf_counter() - T0 > a.deadline

    # 1. the achievable ceiling: a plain streaming op
    copy_bw = copy_bandwidth(0.01 if a.tiny else 4.0)
    log(f"copy (x + 1, bf16, read + write): {copy_bw / 1e12:.2f} TB/s = {100 * copy_bw / a.peak_bw:.0f}% of "
        f"{a.peak_bw / 1e12:.1f} TB/s")

    # 2. end-to-end decode
    hdr = (f"{'what':<34}{'streams':>8}{'ms/step':>10}{'tok/s':>10}{'GB/step':>9}{'GB/s':>8}{'%4.8TB/s':>9}"
           f"{'roofline tok/s @4.8TB/s':>25}{'@copy bw':>10}")
    table = [hdr]
    for quant in quants:
        if over():
            table.append(f"decode {quant}: skipped (deadline)")
            continue
        abstract = aot.abstract_model_weights(cfg, quant)
        log(f"building random {cfg.name} weights, quant {quant}: {aot.tree_bytes(abstract) / aot.GiB:.2f} GiB")
        weights = random_tree(abstract)
        for b in streams:
            if over():
                table.append(f"decode {cfg.name} {quant} x{b}: skipped (deadline)")
                continue
            log(f"  decode {quant} at {b} stream(s), context {context}")
            try:
                dt, nbytes = decode_case(cfg, weights, abstract, b, context, steps=3 if a.tiny else a.steps)
            except Exception as e:  # noqa: BLE001 -- report and go on to the next item
                table.append(f"decode {cfg.name} {quant} x{b}: FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            table.append(f"{'decode ' + cfg.name + ' ' + quant:<34}{b:>8}{dt * 1e3:>10.2f}{b / dt:>10.0f}"
                         f"{nbytes / 1e9:>9.3f}{nbytes / dt / 1e9:>8.0f}{100 * nbytes / dt / a.peak_bw:>8.0f}%"
                         f"{b * a.peak_bw / nbytes:>25.0f}{b * copy_bw / nbytes:>10.0f}")
        del weights
        gc.collect()

    # 3. kernels
    ktable = [f"{'kernel':<52}{'us/call':>10}{'MB read':>10}{'GB/s':>8}{'%4.8TB/s':>9}"]
    shapes = [("q_proj", 2048, 1536), ("mlp up (x2 wide)", 12288, 1536), ("mlp down", 1536, 6144),
              ("LM head", 262144, 1536)]
    if a.tiny:
        shapes = [("q_proj", 512, 256), ("LM head", 1024, 256)]
    for name, o, i in shapes:
        for quant in quants:
            for m in streams:
                if over():
                    continue
                try:
                    dt, nbytes = bench_linear(o, i, m, quant, big)
                except Exception as e:  # noqa: BLE001
                    ktable.append(f"linear {name} {quant} M={m}: FAILED {type(e).__name__}: {str(e)[:150]}")
                    continue
                ktable.append(f"{f'linear {name} [{o}x{i}] {quant} M={m}':<52}{dt * 1e6:>10.1f}{nbytes / 1e6:>10.1f}"
                              f"{nbytes / dt / 1e9:>8.0f}{100 * nbytes / dt / a.peak_bw:>8.0f}%")
    att = [(1, 32768 if not a.tiny else 256), (16, 4096 if not a.tiny else 128), (64, 4096 if not a.tiny else 64)]
    for b, ctx in att:
        for hd, win in ((512, None), (256, 32 if a.tiny else 512)):
            kind = f"full H={hd}" if win is None else f"sliding H={hd} W={win}"
            if over():
                continue
            try:
                dt, nbytes = bench_attention(b, ctx, hd, 1, 8, win)
            except Exception as e:  # noqa: BLE001
                ktable.append(f"attention {kind} x{b}: FAILED {type(e).__name__}: {str(e)[:150]}")
                continue
            ktable.append(f"{f'paged attention ref {kind} S={b} ctx={ctx}':<52}{dt * 1e6:>10.1f}{nbytes / 1e6:>10.1f}"
                          f"{nbytes / dt / 1e9:>8.0f}{100 * nbytes / dt / a.peak_bw:>8.0f}%")
    print()
    print(f"== decode, {cfg.name}-shaped random weights, context {context}, bf16 KV, attention impl=ref "
          f"(tok/s = streams / step time; GB/step = bytes a step must read; roofline = PROJECTION)")
    print("\n".join(table))
    print()
    print(f"== kernels (weights streamed from HBM: each timed over >= {big / aot.MiB:.0f} MiB of distinct weights)")
    print("\n".join(ktable))
    print()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; total {time.perf_counter() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
