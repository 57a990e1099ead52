"""Why the decode-steps program's greedy tokens differ from the one-step program's on a TPU (w8a8+emb4): step 0 of
both from the same state, against the one-step program's own float32 logits (forward): is the program's token a
near-tie of the argmax, or far from it?"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import numpy as np
from device_tpu import free_tree, log, tiny_e2b
from device_tpu_steps import Case, make_runner

from gemmajax.config import ModelConfig


def main():
    tiny = "--tiny" in sys.argv
    quants = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--quants=")]
    quants = quants[0].split(",") if quants else ["w8a8+emb4"]
    models = [("tiny", tiny_e2b())] + ([] if tiny or "--no-full" in sys.argv else [("e2b", ModelConfig.preset("e2b"))])
    s = 16
    for name, cfg in models:
        ctx = 40 if name == "tiny" else 1024
        for quant in quants:
            r = make_runner(cfg, quant, s, ctx, 1, 512 if name == "tiny" else 8192)
            inp = Case(r, s, ctx, 1, 8, seed=s).inputs(0, None)   # device_tpu_steps' first step of s streams
            logits = np.asarray(r.forward(inp))[:s]
            single = np.asarray(r.forward_greedy(inp))[:s]
            prog8 = np.asarray(r.forward_decode_steps(inp, 1, 8)[0])[0, :s]
            prog1 = np.asarray(r.forward_decode_steps(inp, 1, 1)[0])[0, :s]
            top = np.sort(logits, axis=1)[:, ::-1]
            am = logits.argmax(1)
            gap = top[:, 0] - top[:, 1]
            lost8 = top[:, 0] - logits[np.arange(s), prog8]
            log(f"{name} {quant}: logits max {np.abs(logits).max():.4g}, row std {logits.std(1).mean():.4g}; "
                f"argmax==single {int(np.sum(am == single))}/{s}, prog8==single {int(np.sum(prog8 == single))}/{s}, "
                f"prog1==single {int(np.sum(prog1 == single))}/{s}, prog8==prog1 {int(np.sum(prog8 == prog1))}/{s}; "
                f"top1-top2 gap median {np.median(gap):.4g} (min {gap.min():.4g}); logit the program's token loses "
                f"to the max: median {np.median(lost8):.4g}, max {lost8.max():.4g}; rank of prog8's token: "
                f"{[int(np.sum(logits[j] > logits[j, prog8[j]])) for j in range(s)]}")
            free_tree(r.kv)
            free_tree(r.weights)


if __name__ == "__main__":
    main()
    if "--no-barrier" in sys.argv:   # the same without the loop's optimization barrier on the weights
        import gemmajax.engine.runner as R
        jax.lax.optimization_barrier = lambda x: x
        R.compiled_decode_steps.cache_clear()
        log("without the optimization barrier:")
        main()
    sys.stdout.flush()
    os._exit(0)
