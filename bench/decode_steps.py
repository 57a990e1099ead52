"""Programs of several decode steps (EngineConfig.num_scheduler_steps) against one step a program, in one process.

Design choices: one LLM (compare_cpu's gemmajax child builds it the same way: the default Gemma 3 270M, greedy, EOS
ignored, compare_cpu's prompts), its engine's num_scheduler_steps switched between the settings compared, each
setting's decode rate taken in interleaved rounds (the machine's speed drifts over minutes; two processes' bests need
not share a state), the rate as compare_cpu.decode_rate measures it (best of --reps calls a round). Every setting
must give the same tokens as the first, or the script fails before timing anything.

    .venv/bin/python bench/decode_steps.py                                  # w8a8+emb8, 1 and 16 streams, 1 vs 8
    .venv/bin/python bench/decode_steps.py --mode none --steps 1 4 8 --rounds 8

Measured (2-core AMD EPYC Zen 4, jax 0.10.2, 2026-12-07): see docs/cpu_notes_2026-12-07_j.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")   # libtpu's slow mode otherwise (docs/cpu_notes_2026-12-07_f.md)

import compare_cpu  # bench/ on sys.path: this script runs as bench/decode_steps.py


def measure(mode: str, streams: list[int], steps: list[int], rounds: int, reps: int, new_tokens: int) -> dict:
    """{streams: {steps: [tok/s of each round]}}; raises if a setting's tokens differ from the first's."""
    import gemmajax
    from gemmajax.model.gguf import default_model_path
    args = argparse.Namespace(model_path=default_model_path(), streams=streams, new_tokens=new_tokens)
    llm, run = compare_cpu.gemmajax_runner(mode, args)
    eng = llm.engine
    prompts = compare_cpu.prompt_ids(max(streams), 24)

    def use(k):
        eng.config = dataclasses.replace(eng.config, num_scheduler_steps=k)

    params = gemmajax.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for s in streams:
        seen = {}
        for k in steps:
            use(k)
            seen[k] = [o.token_ids for o in llm.generate(prompts[:s], params)]
            if seen[k] != seen[steps[0]]:
                raise AssertionError(f"{s} streams: num_scheduler_steps={k} gave other tokens than {steps[0]}")
    out = {}
    for s in streams:
        out[s] = {k: [] for k in steps}
        for _ in range(rounds):
            for k in steps:
                use(k)
                out[s][k].append(compare_cpu.decode_rate(run, prompts[:s], new_tokens, reps)[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="w8a8+emb8", help="quant mode (none = bf16)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 8], help="num_scheduler_steps settings compared")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    print(compare_cpu.cpu_description())
    print(f"load average {os.getloadavg()[0]:.2f} before the run", flush=True)
    res = measure(a.mode, a.streams, a.steps, a.rounds, a.reps, a.new_tokens)
    print(f"load average {os.getloadavg()[0]:.2f} after the run; mode {a.mode}, {a.new_tokens} new tokens, greedy, "
          f"{a.rounds} interleaved rounds; tokens identical for every setting")
    for s, by in res.items():
        base = by[a.steps[0]]
        for k, v in by.items():
            ratios = [x / b for x, b in zip(v, base)]
            print(f"{s:>2} streams, num_scheduler_steps={k}: tok/s median {statistics.median(v):.1f}, best "
                  f"{max(v):.1f}; over steps={a.steps[0]} in the same round: median {statistics.median(ratios):.3f} "
                  f"(rounds {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
