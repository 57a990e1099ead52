"""KV bytes per token and how many 8k-token sequences fit in a KV budget: gemmajax vs vLLM-TPU's allocation.

    python bench/kv_capacity.py [--budget-gib 4] [--context 8192] [--kv-dtype bf16]

gemmajax: KV-shared layers own no cache; sliding-window layers keep at most window + one step's chunk of tokens (an upper
bound: the engine's planner, runner.seq_pages / step_pages, pays the chunk once per cache, not per sequence)
(whole pages); full-attention layers keep the whole context. vLLM-TPU (tpu-inference, Aug 2026): sliding-window KV
disabled for Gemma 4, so every KV-owning layer stores the whole context (anchors.md sections 1.1 and 2.4: 12B
allocates 336 KiB per token). Pure arithmetic over the published configs: nothing is run.
"""
from __future__ import annotations

import argparse
import math

from gemmajax.config import PRESETS, SLIDING, ModelConfig


def per_sequence_bytes(cfg: ModelConfig, context: int, bytes_per_value: float, page: int, chunk: int,
                       windowed: bool) -> int:
    total = 0
    for li in cfg.kv_layers:
        s = cfg.layers[li]
        tokens = context
        if windowed and s.kind == SLIDING:
            tokens = min(context, s.window + chunk)
        pages = math.ceil(tokens / page)
        total += pages * page * 2 * s.num_kv_heads * s.head_dim * bytes_per_value
    return int(total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gib", type=float, default=4.0)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (a prefill chunk)")
    args = ap.parse_args()
    b = 2.0 if args.kv_dtype == "bf16" else 1.0
    budget = args.budget_gib * 2**30
    print(f"KV budget {args.budget_gib} GiB, {args.context}-token sequences, {args.kv_dtype} KV, "
          f"page {args.page_size}, chunk {args.chunk}")
    print(f"{'model':>8} {'KiB/tok ours':>13} {'KiB/tok vLLM':>13} {'MiB/seq ours':>13} {'MiB/seq vLLM':>13} "
          f"{'seqs ours':>10} {'seqs vLLM':>10} {'ratio':>6}")
    for name in PRESETS:
        cfg = ModelConfig.preset(name)
        ours = per_sequence_bytes(cfg, args.context, b, args.page_size, args.chunk, windowed=True)
        vllm = per_sequence_bytes(cfg, args.context, b, args.page_size, args.chunk, windowed=False)
        n_ours, n_vllm = int(budget // ours), int(budget // vllm)
        print(f"{name:>8} {ours / args.context / 1024:>13.1f} {vllm / args.context / 1024:>13.1f} "
              f"{ours / 2**20:>13.1f} {vllm / 2**20:>13.1f} {n_ours:>10} {n_vllm:>10} "
              f"{(n_ours / n_vllm if n_vllm else float('inf')):>6.1f}")


if __name__ == "__main__":
    main()
