"""Decode-steps programs on a TPU: the engine's one step per program (num_scheduler_steps 1) against programs of 8
greedy decode steps (num_scheduler_steps 8, the default), with the tokens of both compared.

On the CPU the 8-step program gained 3-5 % a token (bench/decode_steps.py). On a TPU the device step is shorter and the
host's share larger, but the loop (and the weights riding its carry through an optimization barrier) might also cost
on the chip: this measures it. Both paths run the way the engine drives them in its steady decode state: each step's
inputs are built on the host (`build_step_inputs`) while the previous program runs, its token ids gathered on the
device from the previous program's tokens (`_take`), and the previous program's tokens read back after the next is
dispatched. The scheduler's own Python is not modelled. Also timed: the bare one-step program (same inputs every call,
no host work), the chip's floor.

Weights are random with the real model's leaves and shapes (bench/device_tpu.py's `random_tree`); the KV cache holds
`--context` tokens of zeros per stream before the timed tokens. Tokens: the first program of 8 against the first 8
one-step programs from the same state, every stream.

Run (TPU machine): python3 bench/device_tpu_steps.py | CPU smoke test: JAX_PLATFORMS=cpu python bench/device_tpu_steps.py
--tiny.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import numpy as np
from device_tpu import (
    PAGE,
    abstract_weights,
    free_tree,
    log,
    make_spec,
    mem_line,
    now,
    random_tree,
    tables_for,
    tiny_e2b,
)

from gemmajax.config import ModelConfig
from gemmajax.engine.runner import ModelRunner, build_step_inputs, kv_groups


def _take(tokens: jax.Array, src: np.ndarray) -> jax.Array:
    """llm_engine._take (not imported: llm_engine pulls in packages the TPU machine lacks): a lookahead step's token
    ids, gathered on the device from the previous program's tokens."""
    return tokens[src]


def make_runner(cfg, quant: str, max_streams: int, context: int, tokens: int, max_model_len: int) -> ModelRunner:
    """Random weights of `quant` and a bf16 cache with pages for max_streams streams of context + tokens positions."""
    need = 1 + max_streams * math.ceil((context + tokens) / PAGE)
    spec = make_spec(cfg, (need,) * len(kv_groups(cfg)), "bf16", max_model_len, "auto")
    return ModelRunner(random_tree(abstract_weights(cfg, quant)), spec)


class Case:
    """One model, quant and stream count: a runner, its first tokens and page tables (through context + tokens)."""

    def __init__(self, runner: ModelRunner, streams: int, context: int, tokens: int, k: int, seed: int):
        self.runner, self.s, self.ctx, self.k = runner, streams, context, k
        cfg = runner.spec.cfg
        rng = np.random.default_rng(seed)
        self.ids0 = rng.choice(np.arange(3, cfg.vocab_size), size=streams, replace=False).astype(np.int32)
        self.tables, _ = tables_for(runner.spec, streams, math.ceil((context + tokens) / PAGE))
        self.src = np.arange(streams, dtype=np.int32)

    def inputs(self, i: int, prev):
        """Step inputs at context + i, token ids from the device array `prev` (None: the first ids)."""
        entries = [([int(self.ids0[j])], self.ctx + i, 1, self.tables[j]) for j in range(self.s)]
        inp = build_step_inputs(self.runner.spec, entries, self.s, self.s)
        return inp if prev is None else dataclasses.replace(inp, token_ids=_take(prev, self.src))

    def one_step_round(self, n: int) -> np.ndarray:
        """n tokens a stream, one program each, the engine's lookahead: tokens [n, S]."""
        out, prev, pending = [], None, None
        for i in range(n):
            tok = self.runner.forward_greedy(self.inputs(i, prev))
            if pending is not None:
                out.append(np.asarray(pending)[:self.s])
            pending = prev = tok
        out.append(np.asarray(pending)[:self.s])
        return np.stack(out)

    def steps_round(self, n: int) -> np.ndarray:
        """n tokens a stream in programs of k steps, dispatched ahead the same way: tokens [n, S]."""
        out, last, pending = [], None, None
        for j in range(n // self.k):
            res, last = self.runner.forward_decode_steps(self.inputs(j * self.k, last), self.k, self.k)
            if pending is not None:
                out.append(np.asarray(pending)[:, :self.s])
            pending = res
        out.append(np.asarray(pending)[:, :self.s])
        return np.concatenate(out)

    def bare(self, calls: int) -> float:
        """Seconds a call of the one-step program, the same inputs every call (device-resident), no host work."""
        inp = jax.device_put(self.inputs(0, None))
        tok = self.runner.forward_greedy(inp)
        jax.block_until_ready(tok)
        t = time.perf_counter()
        for _ in range(calls):
            tok = self.runner.forward_greedy(inp)
        jax.block_until_ready(tok)
        return (time.perf_counter() - t) / calls


def run_case(name: str, c: Case, rounds: int, n: int) -> dict:
    t = time.perf_counter()
    a = c.one_step_round(c.k)
    t1 = time.perf_counter()
    b = c.steps_round(c.k)
    log(f"  {name}: first round (compiles) one-step {t1 - t:.1f} s, {c.k}-step {time.perf_counter() - t1:.1f} s")
    same = int(np.sum(a == b))
    first_diff = next((i for i in range(c.k) if not np.array_equal(a[i], b[i])), None)
    ta, tb = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        c.one_step_round(n)
        ta.append((time.perf_counter() - t) / n)
        t = time.perf_counter()
        c.steps_round(n)
        tb.append((time.perf_counter() - t) / n)
    bare = c.bare(n)
    ma, mb = statistics.median(ta), statistics.median(tb)
    ratio = ma / mb
    log(f"RESULT {name}: tokens equal {same} of {a.size} (first differing step: {first_diff}); ms a token, median of "
        f"{rounds} rounds of {n}: one-step programs {1e3 * ma:.3f} (min {1e3 * min(ta):.3f}), {c.k}-step programs "
        f"{1e3 * mb:.3f} (min {1e3 * min(tb):.3f}) -> {ratio:.3f}x the one-step rate; bare one-step program "
        f"{1e3 * bare:.3f} ms; {c.s / mb:.0f} tok/s with {c.k}-step programs, {c.s / ma:.0f} with one-step; "
        f"{mem_line()}")
    return {"same": same, "size": a.size, "ratio": ratio}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="toy shapes: a CPU smoke test")
    p.add_argument("--quants", default="w8a8+emb4,none")
    p.add_argument("--streams", default="1,16")
    p.add_argument("--context", type=int, default=None, help="tokens already in each stream's cache (default 1024)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds of each path (default 7)")
    p.add_argument("--tokens", type=int, default=None, help="tokens a stream per round (default 64)")
    p.add_argument("--steps", type=int, default=8, help="steps of a decode-steps program")
    p.add_argument("--deadline", type=float, default=520.0, help="no new case starts after this many seconds")
    a = p.parse_args(argv)
    t = a.tiny
    ctx = a.context or (40 if t else 1024)
    rounds = a.rounds or (2 if t else 7)
    n = a.tokens or (16 if t else 64)
    if n % a.steps:
        p.error(f"--tokens {n} must be a multiple of --steps {a.steps}")
    log(f"jax {jax.__version__}, backend {jax.default_backend()}, device {jax.devices()[0].device_kind!r}")
    cfg = tiny_e2b() if t else ModelConfig.preset("e2b")
    streams = [int(s) for s in a.streams.split(",")]
    results, ok = {}, True
    for quant in a.quants.split(","):
        if now() > a.deadline:
            log(f"SKIP {quant}: past the deadline")
            continue
        runner = make_runner(cfg, quant, max(streams), ctx, n, 512 if t else 8192)
        log(f"{cfg.name} {quant}: weights and cache built; {mem_line()}")
        for s in streams:
            if now() > a.deadline:
                log(f"SKIP {quant} x{s}: past the deadline")
                continue
            try:
                results[(quant, s)] = r = run_case(f"{cfg.name} {quant} x{s} ctx {ctx}", Case(runner, s, ctx, n, a.steps,
                                                                                              seed=s), rounds, n)
                ok &= r["same"] == r["size"]
            except Exception as e:  # noqa: BLE001 -- the other cases still run
                log(f"ERROR {quant} x{s}: {type(e).__name__}: {str(e)[:400]}")
                ok = False
        free_tree(runner.kv)
        free_tree(runner.weights)
    log("SUMMARY " + "; ".join(f"{q} x{s}: {r['ratio']:.3f}x, tokens {r['same']}/{r['size']}"
                               for (q, s), r in results.items()))
    return 0 if ok and results else 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)
