"""Where a decode step's time goes on this machine, and how fast XLA:CPU's GEMM runs by number of rows.

Design choices: each part is timed by removing it from the compiled step (the LM head replaced by a 128-column
matmul, attention by the identity), in a fresh process per variant so every program compiles the same way; the
step time is (t(49 tokens) - t(1 token)) / 48 of `LLM.generate`, best of 3. The GEMM sweep is a plain bf16
`jnp.dot` with float32 accumulation at the LM head's K = 640.

    .venv/bin/python bench/step_breakdown.py                 # bf16 and w8a8+emb8 at 1 and 16 streams (~6 min)
    .venv/bin/python bench/step_breakdown.py --modes none --streams 16
    .venv/bin/python bench/step_breakdown.py --constants --modes none --streams 16 --rounds 2   # weights as constants

Measured with --constants (2-core AMD EPYC, AVX-512 bf16, 2026-12-03, load 1.04 before the run from a compile
paused for it: not quiet, the two variants alternate in the same run):

| mode | streams | step ms, args | step ms, constants | TTFT ms, args / constants | first generate s, args / constants | peak RSS MB, args / constants |
|---|---:|---:|---:|---:|---:|---:|
| none | 16 | 66.3 | 65.7 | 176 / 175 | 7.0 / 142.6 | 3320 / 5245 |

Constants cost 20x the compile time and 1.9 GB of memory for 1 % of the step: the engine keeps weights as arguments.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

from compare_cpu import best_of  # bench/ is on sys.path: this script runs as bench/step_breakdown.py

VARIANTS = ("full", "no-head", "no-attention", "no-head-no-attention")


def close_over_weights(weights) -> None:
    """Make every step program of this process close over `weights` (HLO constants) instead of taking them as an
    argument: runner.compiled_step is wrapped so that the jitted function it returns is replaced by one that calls
    the same step function with these weights baked in (the runner's call keeps passing them; they are ignored).
    The hope was that YNNPACK would then pack each weight once, when the program is built; measured, the step was no
    faster (module docstring), nor a lone LM head (bench/ynn_gemm.py's docstring)."""
    import functools

    import jax

    from gemmajax.engine import runner
    plain = runner.compiled_step

    @functools.cache
    def with_constants(*key):
        step = plain(*key).__wrapped__  # step(weights, kv, inp), the function compiled_step jits

        def baked(kv, inp):
            return step(weights, kv, inp)
        jitted = jax.jit(baked, donate_argnums=(0,))
        return lambda _weights, kv, inp: jitted(kv, inp)

    runner.compiled_step = with_constants


def child(mode: str, streams: int, variant: str) -> None:
    import resource

    import jax.numpy as jnp

    import gemmajax
    from gemmajax.engine import runner
    from gemmajax.model import gemma
    from gemmajax.model.gguf import default_model_path
    if "no-head" in variant:  # greedy steps of a plain table skip lm_head (runner.greedy_tokens): replace both
        gemma.lm_head = lambda w, cfg, h: h @ jnp.ones((h.shape[-1], 128), h.dtype)
        runner.greedy_tokens = lambda w, cfg, h: jnp.argmax(gemma.lm_head(w, cfg, h), axis=-1).astype(jnp.int32)
    if "no-attention" in variant:
        runner.ragged_paged_attention = lambda q, k, v, pages, meta, **kw: (q, pages)
    path = default_model_path()
    llm = gemmajax.LLM(path, quant=mode, dtype="bfloat16", kv_dtype="bf16", max_model_len=512,
                       max_num_seqs=16, kv_cache_memory=256 << 20, enable_prefix_caching=False)
    # one step a program in every variant: what this script takes apart is one step (and close_over_weights wraps
    # compiled_step, which a decode-steps program does not call)
    llm.engine.config = dataclasses.replace(llm.engine.config, num_scheduler_steps=1)
    if variant == "constants":
        close_over_weights(llm.engine.runner.weights)   # the tree the steps take (runner.stack_layers)
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tok = gemmajax.load_tokenizer(path)
    prompts = [tok.encode(f"Once upon a time number {i} there was") for i in range(streams)]
    p1 = gemmajax.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    pn = gemmajax.SamplingParams(max_tokens=49, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, pn)
    first = time.perf_counter() - t
    best = ttft = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(prompts, p1)
        t1 = time.perf_counter() - t
        ttft = min(ttft, t1)
        t = time.perf_counter()
        llm.generate(prompts, pn)
        best = min(best, (time.perf_counter() - t - t1) / 48)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"RESULT {best * 1e3:.2f} {first:.2f} {rss_loaded:.0f} {rss:.0f} {ttft * 1e3:.1f}", flush=True)


def run_child(mode: str, streams: int, variant: str, env: dict) -> list[float]:
    """[step ms, first generate s (compiles), peak RSS MB after loading, peak RSS MB at the end, time to the first
    token ms (the prompts' prefill step)] of a fresh process."""
    p = subprocess.run([sys.executable, __file__, "--child", mode, str(streams), variant], capture_output=True,
                       text=True, env=env, check=False)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        raise SystemExit(f"{mode} {streams} {variant} failed: {p.stderr.strip().splitlines()[-3:]}")
    return [float(v) for v in line[-1].split()[1:]]


def constants_table(modes: list[str], streams: list[int], rounds: int, env: dict) -> None:
    """Weights as jit arguments (the engine today) vs closed over as HLO constants (close_over_weights), each in
    fresh processes, alternating, `rounds` of each (best step, first call and RSS of the best round's process)."""
    print(f"load average {os.getloadavg()[0]:.2f} before the run")
    print("| mode | streams | step ms, args | step ms, constants | TTFT ms, args / constants | first generate s, args "
          "/ constants | peak RSS MB, args / constants |\n|---|---:|---:|---:|---:|---:|---:|")
    for mode in modes:
        for s in streams:
            best = {}
            for _ in range(rounds):
                for v in ("full", "constants"):
                    r = run_child(mode, s, v, env)
                    if v not in best or r[0] < best[v][0]:
                        best[v] = r
            a, c = best["full"], best["constants"]
            print(f"| {mode} | {s} | {a[0]:.1f} | {c[0]:.1f} | {a[4]:.0f} / {c[4]:.0f} | {a[1]:.1f} / {c[1]:.1f} | "
                  f"{a[3]:.0f} / {c[3]:.0f} |",
                  flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


def gemm_sweep() -> list[str]:
    import jax
    import jax.numpy as jnp
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    out = []
    for m, k, n in ((1, 640, 16384), (16, 640, 16384), (64, 640, 16384), (256, 640, 16384), (16, 640, 262144),
                    (2048, 2048, 2048)):
        a, b = jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16)
        f(a, b).block_until_ready()
        best = best_of(lambda a=a, b=b: f(a, b).block_until_ready(), 5)
        out.append(f"| {m} x {k} x {n} | {best * 1e3:.2f} | {2 * m * k * n / best / 1e9:.0f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="none,w8a8+emb8", type=lambda s: s.split(","))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--constants", action="store_true",
                    help="compare weights as jit arguments with weights closed over as constants (step, compile, RSS)")
    ap.add_argument("--rounds", type=int, default=2, help="--constants: fresh processes per variant (best taken)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2])
        return
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    if args.constants:
        constants_table(args.modes, args.streams, args.rounds, env)
        return
    print(f"load average {os.getloadavg()[0]:.2f} before the run")
    print("| mode | streams | step ms | LM head ms | attention ms | rest ms |\n|---|---:|---:|---:|---:|---:|")
    for mode in args.modes:
        for s in args.streams:
            t = {v: run_child(mode, s, v, env)[0] for v in VARIANTS}
            print(f"| {mode} | {s} | {t['full']:.1f} | {t['full'] - t['no-head']:.1f} | "
                  f"{t['full'] - t['no-attention']:.1f} | {t['no-head-no-attention']:.1f} |", flush=True)
    print("\n| bf16 GEMM M x K x N | ms | GFLOP/s |\n|---|---:|---:|")
    print("\n".join(gemm_sweep()))


if __name__ == "__main__":
    main()
