"""N-gram (prompt lookup) speculative decoding on the real Gemma 3 270M: tok/s with and without drafting, at 1 and
16 streams, for bf16 and w8a8, with the acceptance rate, in one run.

Prompts invite copying (a code edit that repeats a function, a list to repeat, a text to quote back), as prompt
lookup is meant for; greedy, EOS ignored, so every configuration decodes the same tokens (checked: drafting is
lossless). tok/s = streams x new tokens / wall time of the whole generate (prefill included, the same for both),
best of --rounds after one warm-up pass (compiles excluded). Prints the load average: figures taken while other
work shares the cores are not measurements.

    .venv/bin/python bench/spec_decode.py                 # bf16 and w8a8, k = 4, 64 new tokens
    .venv/bin/python bench/spec_decode.py --modes none --streams 1 --new-tokens 32
"""
from __future__ import annotations

import argparse
import os
import time

import gemmajax

CODE = '''def area(w, h):
    return w * h


def perimeter(w, h):
    return 2 * (w + h)


def describe(w, h):
    return f"{w} x {h}: area {area(w, h)}, perimeter {perimeter(w, h)}"
'''
PROMPTS = [
    "Rename the function perimeter to around in this code and print the whole file again:\n\n" + CODE + "\n",
    "Repeat this list three times: red, green, blue, yellow, purple, orange, red, green, blue,",
    "Quote back exactly: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over",
    "Continue the table:\n| n | n squared |\n|---|---|\n| 1 | 1 |\n| 2 | 4 |\n| 3 | 9 |\n| 4 | 16 |\n",
]


def run(llm, prompts, params, rounds: int) -> tuple[float, list]:
    llm.generate(prompts, params)                     # warm-up: every step shape compiled
    best, outs = float("inf"), None
    for _ in range(rounds):
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        best = min(best, time.perf_counter() - t)
    return best, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="none,w8a8")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} (figures above 0.5 are not measurements); "
          f"{args.new_tokens} new tokens, greedy, n-gram k={args.num_speculative_tokens}")
    print("| mode | streams | tok/s plain | tok/s n-gram | speed-up | accepted / drafted | tokens equal |")
    print("|---|---:|---:|---:|---:|---:|---|")
    params = gemmajax.SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    for mode in args.modes.split(","):
        kw = dict(quant=mode, dtype="bfloat16", max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512,
                  enable_prefix_caching=False)   # every round the same steps (a cache hit would change shapes)
        plain = gemmajax.LLM(None, **kw)
        spec = gemmajax.LLM(None, speculative_config={"method": "ngram", "num_speculative_tokens":
                                                      args.num_speculative_tokens}, **kw)
        for s in map(int, args.streams.split(",")):
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(s)]
            t0, a = run(plain, prompts, params, args.rounds)
            before = spec.spec_decode_stats()
            t1, b = run(spec, prompts, params, args.rounds)
            st = {k: v - before[k] for k, v in spec.spec_decode_stats().items()}
            n = s * args.new_tokens
            same = [x.token_ids for x in a] == [y.token_ids for y in b]
            print(f"| {'bf16' if mode == 'none' else mode} | {s} | {n / t0:.1f} | {n / t1:.1f} | {t0 / t1:.2f}x | "
                  f"{st['num_accepted_tokens']} / {st['num_draft_tokens']} "
                  f"({st['num_accepted_tokens'] / max(1, st['num_draft_tokens']):.0%}) | {same} |")
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
