"""`gemmajax generate`: one prompt through the offline engine, the continuation streamed to the terminal."""
from __future__ import annotations

import sys
import time


def run(args) -> int:
    from gemmajax.engine.llm import LLM
    from gemmajax.engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.ckpt, quant=args.quant, kv_dtype=args.kv_dtype, dtype=args.dtype,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    if getattr(args, "chat", False):
        ids = llm.render_chat([{"role": "user", "content": args.prompt}])
    else:
        ids = llm.tokenizer.encode(args.prompt, add_bos=True)
    eng = llm.engine
    eng.add_request("cli", ids, params)
    t1 = time.perf_counter()
    first = None
    n = 0
    out = None
    while out is None or not out.finished:
        for o in eng.step():
            if o.request_id != "cli":
                continue
            if o.delta_text:
                if first is None:
                    first = time.perf_counter() - t1
                sys.stdout.write(o.delta_text)
                sys.stdout.flush()
            n = len(o.token_ids)
            out = o
    dt = time.perf_counter() - t1
    sys.stdout.write("\n")
    rate = (n - 1) / (dt - first) if first is not None and n > 1 and dt > first else float("nan")
    print(f"[{n} tokens, finish_reason={out.finish_reason}, load {load_s:.1f} s, first token {first or 0:.2f} s, "
          f"{rate:.1f} tok/s after it]", file=sys.stderr)
    return 0
