"""Subprocess entry point of tests/test_parallel.py: run greedy generation through `gemmajax.LLM` at several
tensor-parallel sizes and report tokens, where every leaf lives and the collectives of the compiled step, as JSON.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=N (the parent test process keeps one device). With
--num-hosts 2 --host-index i --coordinator ADDR it is one of two processes of a multi-host mesh (gloo on the CPU).

    python -m tests.parallel.run_tp CASES.json OUT.json [--num-hosts H --host-index I --coordinator ADDR]

CASES.json: {"prompts": [[ids...], ...], "max_tokens": n, "cases": [{"name", "ckpt", "tp", "ep", "quant",
"hlo"}]}. OUT.json: {name: {"tokens", "texts", "leaves", "kv", "devices", "processes", "collectives"}} (host 0 writes
it). Across processes every one makes the same generate calls (the offline form of a multi-host run).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ENGINE = dict(dtype="float32", kv_dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
              page_size=4, kv_cache_memory=1 << 20, token_buckets=(16,), seq_buckets=(2,))


def leaf_report(tree) -> list[dict]:
    """Per array leaf: its path, global shape, PartitionSpec and the shapes of the shards this process holds."""
    import jax
    out = []
    for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]:
        spec = getattr(a.sharding, "spec", None)
        out.append({"path": jax.tree_util.keystr(path), "shape": list(a.shape),
                    "spec": None if spec is None else [None if s is None else str(s) for s in spec],
                    "shards": sorted({tuple(s.data.shape) for s in a.addressable_shards}),
                    "num_shards": len(a.addressable_shards)})
    return out


def collectives(llm) -> dict:
    """Collective ops in the compiled decode step (greedy, all sequences decoding) of the LLM's engine."""
    import dataclasses

    from gemmajax.engine.runner import build_step_inputs, compiled_step
    eng = llm.engine
    s = eng.s_buckets[-1]
    inp = build_step_inputs(eng.spec, [], s, s)
    inp = dataclasses.replace(inp, metas=tuple(dataclasses.replace(m, decode_only=True) for m in inp.metas))
    text = compiled_step(eng.spec, True).lower(eng.runner.weights, eng.runner.kv, inp).compile().as_text()
    ops = re.findall(r"\s(all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)(?:-start)?\(", text)
    return {k: ops.count(k) for k in sorted(set(ops))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases")
    ap.add_argument("out")
    ap.add_argument("--num-hosts", type=int, default=1)
    ap.add_argument("--host-index", type=int, default=0)
    ap.add_argument("--coordinator", default="")
    args = ap.parse_args()
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("gemmajax.parallel").setLevel(logging.INFO)   # what is replicated and why (the test reads it)

    from gemmajax.parallel import init_distributed
    init_distributed(args.coordinator, args.num_hosts, args.host_index)

    import jax

    import gemmajax
    from gemmajax.model.gguf import default_model_path
    from gemmajax.tools.tokenizer import Tokenizer, gguf_to_gemma4_sp

    with open(args.cases) as f:
        spec = json.load(f)
    tok = Tokenizer(gguf_to_gemma4_sp(default_model_path()))
    params = gemmajax.SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    results = {}
    for case in spec["cases"]:
        t0 = time.perf_counter()
        llm = gemmajax.LLM(case["ckpt"], quant=case.get("quant", "none"), tokenizer=tok,
                           tensor_parallel_size=case["tp"], enable_expert_parallel=case.get("ep", False), **ENGINE)
        outs = llm.generate(spec["prompts"], params)
        r = {"tokens": [o.token_ids for o in outs], "texts": [o.text for o in outs], "leaves": leaf_report(llm.model.weights),
             "kv": leaf_report(llm.engine.runner.kv), "devices": [d.id for d in jax.devices()],
             "processes": jax.process_count()}
        if case.get("hlo"):
            r["collectives"] = collectives(llm)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results[case["name"]] = r
        print(f"{case['name']}: {r['seconds']} s", file=sys.stderr, flush=True)
    if args.host_index == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
