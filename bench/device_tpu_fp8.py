"""fp8 KV on a real TPU v5e: is an fp8 page cache slower than bf16, and where? One device call (device_tpu_fp8.sh).

The first real-chip runs (docs/device_tpu_v5e_2026-12-04*.log) timed 26B-A4B decode with fp8_e4m3 pages at 3-4x the
bf16 step, while other Python threads were lowering programs (they hold the GIL the timing loop dispatches with).
Here nothing compiles while anything is timed:

- item "attn": the ragged paged attention kernel alone at 26B-A4B's two layer shapes (global: 16 query heads over 2
  KV heads of 512; sliding: 16 over 8 of 256, window 1024), decode steps of 1 and 16 sequences at 1024 and 4096
  tokens of context, on a large pool, for bf16 pages and for fp8_e4m3 (and with --all-modes fp8_e5m2) pages; each
  fp8 output is checked against the bf16 pages holding the same (dequantized) values.
- item "e2b" / "26b": the engine's whole decode step (gemmajax.engine.runner.model_step) of E2B (bf16 weights) and
  of 26B-A4B (qat-w4a16+emb4) at 1 and 16 streams, bf16 KV against fp8_e4m3 KV.

A session of 2026-12-04 also timed an integer decode of the fp8 bits inside the kernel against Mosaic's conversion:
bit-identical, no faster at one sequence and 1.3-1.5x slower at 16 x 4096 tokens, so it was not kept.

Every program of an item is compiled first (in parallel threads), then each is timed alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import gc
import math
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
from device_h200 import timeit
from device_tpu import (
    CLOCK,
    PAGE,
    GiB,
    Prog,
    abstract_caches,
    abstract_weights,
    alloc_caches,
    free_tree,
    kv_alive,
    log,
    make_spec,
    mem_line,
    print_summary,
    prog_inputs,
    random_tree,
    record,
    run_item,
    run_steps,
    step_jit,
    tiny_26b,
    tiny_e2b,
    watchdog,
)

from gemmajax import aot
from gemmajax.config import ModelConfig
from gemmajax.engine.runner import kv_groups
from gemmajax.kv.attention import make_ragged_meta, ragged_paged_attention_pallas

FP8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
MODES = ("bf16", "fp8_e4m3", "fp8_e5m2")


def _pool(num_pages: int, two_k: int, h: int, dtype) -> jax.Array:
    fill = jax.jit(lambda k: (2.0 * jax.random.normal(k, (num_pages, two_k, PAGE, h), jnp.float32)).astype(dtype))
    return fill(jax.random.key(7))


def item_attn(a, interpret: bool) -> None:
    shapes = [("global", 16, 2, 512, None), ("sliding", 16, 8, 256, 1024)]
    cases = [(1, 1024), (16, 4096)] if not a.tiny else [(1, 64), (4, 64)]
    modes = MODES if a.all_modes else MODES[:2]
    for name, n, nk, h, window in shapes:
        for s, ctx in cases:
            if CLOCK.over(30):
                record("attn", f"{name} x{s} ctx {ctx}", "skipped: deadline", "SKIP")
                continue
            need = math.ceil((ctx + 1) / PAGE)
            num_pages = max(a.pool_pages, s * need + 2)
            p_max = math.ceil(8192 / PAGE) if not a.tiny else need
            rng = np.random.default_rng(s)
            tables = [list(1 + rng.permutation(num_pages - 1)[:need]) for _ in range(s)]
            meta = make_ragged_meta([1] * s, [ctx + 1] * s, tables, max_num_seqs=s, pages_per_seq=p_max)
            key = jax.random.key(s)
            q = jax.random.normal(key, (s, n, h), jnp.float32).astype(jnp.bfloat16)
            kn = jax.random.normal(jax.random.fold_in(key, 1), (s, nk, h), jnp.float32).astype(jnp.bfloat16)
            vn = jax.random.normal(jax.random.fold_in(key, 2), (s, nk, h), jnp.float32).astype(jnp.bfloat16)
            times = {}
            for kv in modes:
                dt = jnp.bfloat16 if kv == "bf16" else FP8[kv]
                ks, vs = (1.0, 1.0) if kv == "bf16" else (0.5, 2.0)
                f = functools.partial(ragged_paged_attention_pallas, sliding_window=window, k_scale=ks,
                                      v_scale=vs, sm_scale=h**-0.5, interpret=interpret)
                # Write mode donates the pool (updated in place, as in the engine); read-only returns only the
                # output (returning the undonated pool would time a copy of it).
                fw = jax.jit(f, donate_argnums=(3,))
                fr = jax.jit(lambda q, pool, meta, f=f: f(q, None, None, pool, meta)[0])
                pool = _pool(num_pages, 2 * nk, h, dt)
                try:
                    o = fr(q, pool, meta)  # compile + the checked call
                    if kv != "bf16":  # the same values as bf16 pages (exact), through the bf16 kernel
                        ref = jax.jit(lambda q, pool, meta, f=f: f(q, None, None, pool.astype(jnp.bfloat16),
                                                                     meta)[0])(q, pool, meta)
                        err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref.astype(jnp.float32))))
                        scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
                        record("attn", f"{name} x{s} ctx {ctx} {kv} == its values as bf16 pages",
                               f"max |diff| {err:.3g} (max |out| {scale:.3g})",
                               "PASS" if err <= 1e-2 * max(scale, 1.0) else "FAIL")
                    dt_s = timeit(fr, q, pool, meta, reps=a.reps)
                    for _ in range(2):
                        o, pool = fw(q, kn, vn, pool, meta)
                    jax.block_until_ready(o)
                    t = time.perf_counter()
                    for _ in range(a.reps):
                        o, pool = fw(q, kn, vn, pool, meta)
                    jax.block_until_ready(o)
                    times[kv] = (dt_s, (time.perf_counter() - t) / a.reps)
                except Exception as e:  # noqa: BLE001
                    record("attn", f"{name} x{s} ctx {ctx} {kv}", f"{type(e).__name__}: {str(e)[:300]}", "ERROR")
                finally:
                    free_tree(pool)
            base = times.get("bf16")
            for kv, (dt_s, dt_w) in times.items():
                rel = f"; x{dt_w / base[1]:.2f} of bf16" if base else ""
                read = s * need * PAGE * 2 * nk * h * (2 if kv == "bf16" else 1)
                record("attn", f"{name} H={h} K={nk} x{s} ctx {ctx} {kv}",
                       f"read-only {dt_s * 1e6:.0f} us, with write {dt_w * 1e6:.0f} us{rel}; "
                       f"{read / dt_s / 1e9:.0f} GB/s of pages read")


def _progs(cfg, quant, kv, streams, ctx, mml, budget=None):
    if budget is None:
        need = 1 + max(streams) * math.ceil((ctx + 1) / PAGE)
        pages = (need,) * len(kv_groups(cfg))
    else:
        pages = aot.plan_kv(cfg, budget, max_model_len=mml, chunk=512, page_size=PAGE, kv_dtype=kv).num_pages
    spec = make_spec(cfg, pages, kv, mml, "auto")
    return spec, {s: Prog(f"{cfg.name} {quant} {kv} decode x{s}", cfg, quant, spec, "decode", streams=s, context=ctx)
                  for s in streams}


def item_model(a, which: str) -> None:
    tiny = a.tiny
    if which == "e2b":
        cfg, quant, budget = (tiny_e2b() if tiny else ModelConfig.preset("e2b")), "none", None
    else:
        cfg, quant = (tiny_26b() if tiny else ModelConfig.preset("26b-a4b")), ("none" if tiny else a.quant_26b)
        budget = int((0.02 if tiny else a.kv_gib_26b) * GiB)
    ctx, mml = (64, 512) if tiny else (1024, 8192)
    streams = (1, 4) if tiny else ((1, 16) if which == "e2b" else tuple(int(x) for x in a.streams_26b.split(",")))
    modes = ("bf16", "fp8_e4m3")
    specs, compiled = {}, {}
    t0 = time.perf_counter()
    jobs = []
    for kv in modes:  # compile everything first (threads: XLA's compile releases the GIL); then time alone
        spec, progs = _progs(cfg, quant, kv, streams, ctx, mml, budget)
        specs[kv] = spec
        jobs += [(kv, s, p) for s, p in progs.items()]

    def compile_one(job):
        p = job[2]
        return step_jit(p.spec).lower(abstract_weights(p.cfg, p.quant), abstract_caches(p.spec),
                                      prog_inputs(p)).compile()

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        futs = {ex.submit(compile_one, j): j for j in jobs}
        for fut in concurrent.futures.as_completed(futs, timeout=max(1.0, CLOCK.left() - 60)):
            kv, s, p = futs[fut]
            try:
                compiled[(kv, s)] = (p, fut.result())
            except Exception as e:  # noqa: BLE001
                record(which, p.name, f"compile {type(e).__name__}: {str(e)[:300]}", "ERROR")
    log(f"  {len(compiled)} {which} programs compiled in {time.perf_counter() - t0:.0f} s")
    weights = random_tree(abstract_weights(cfg, quant))
    log(f"  weights {aot.tree_bytes(weights) / GiB:.2f} GiB; {mem_line()}")
    base = {}
    try:
        for kv in modes:
            kvc = alloc_caches(specs[kv])
            log(f"  {kv} cache {aot.tree_bytes(kvc) / GiB:.3f} GiB; {mem_line()}")
            for (kv2, s), (p, c) in sorted(compiled.items(), key=lambda t: t[0][1]):
                if kv2 != kv:
                    continue
                if CLOCK.over(10):
                    record(which, p.name, "skipped: deadline", "SKIP")
                    continue
                try:
                    if not kv_alive(kvc):
                        kvc = alloc_caches(specs[kv])
                    dt, kvc, _, h = run_steps(c, weights, kvc, jax.device_put(prog_inputs(p)), a.steps)
                    ok = bool(jnp.all(jnp.isfinite(h[:s].astype(jnp.float32))))
                    if kv == "bf16":
                        base[s] = dt
                    rel = f"; x{dt / base[s]:.2f} of the bf16 step" if s in base and kv != "bf16" else ""
                    record(which, p.name,
                           f"{s / dt:.1f} tok/s ({dt * 1e3:.2f} ms/step){rel}; hidden finite {ok}",
                           "PASS" if ok else "FAIL")
                except Exception as e:  # noqa: BLE001
                    record(which, p.name, f"{type(e).__name__}: {str(e)[:300]}", "ERROR")
            free_tree(kvc)
            gc.collect()
    finally:
        free_tree(weights)
        gc.collect()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="toy shapes, interpret mode: a CPU smoke test")
    p.add_argument("--only", default="attn,e2b", help="comma list of attn, e2b, 26b")
    p.add_argument("--deadline", type=float, default=500.0)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--all-modes", action="store_true", help="attn: fp8_e5m2 too")
    p.add_argument("--streams-26b", default="1,16", help="comma list of 26B decode stream counts")
    p.add_argument("--pool-pages", type=int, default=6000, help="pages in the attention item's pool")
    p.add_argument("--quant-26b", default="qat-w4a16+emb4")
    p.add_argument("--kv-gib-26b", type=float, default=1.46)
    a = p.parse_args(argv)
    if a.tiny:
        a.pool_pages, a.reps, a.steps = 16, 2, 2
    CLOCK.deadline = a.deadline
    threading.Thread(target=watchdog, args=(a.deadline + 20,), daemon=True).start()
    on_tpu = jax.default_backend() == "tpu"
    if not on_tpu and not a.tiny:
        log("not on a TPU: run with --tiny for a CPU smoke test")
        return 2
    log(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    only = set(a.only.split(","))
    run_item("26b", "26B-A4B decode step: bf16 vs fp8 KV", lambda: item_model(a, "26b"), need=120,
             enabled="26b" in only)
    run_item("attn", "attention kernel alone: bf16 vs fp8 pages", lambda: item_attn(a, not on_tpu), need=30,
             enabled="attn" in only)
    run_item("e2b", "E2B decode step: bf16 vs fp8 KV", lambda: item_model(a, "e2b"), need=60,
             enabled="e2b" in only)
    print_summary()
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)
