"""Concurrency sweep against a live gemmajax server: output tok/s, time to first token, time per output token.

    python bench/serve.py                       # starts `gemmajax serve` on the default model (Gemma 3 270M)
    python bench/serve.py --url http://127.0.0.1:8000 --levels 1 4 16 64

Each level sends `level` streaming chat requests at once (greedy, ignore_eos so every request makes exactly
--max-tokens tokens) and waits for all of them; the figures are per level. Each level runs twice and reports the
second pass (other prompts of the same length, so the same step shapes and no prefix-cache hits), so compile time
does not count; the first pass's worst TTFT is printed beside it (the step shapes a level needs compile on first
use).

Measured 2026-11-29 on the 2-core CPU box, nothing else running (`python bench/serve.py`, default model, bf16,
64 output tokens; the server's defaults otherwise, --max-num-seqs 64):

| streams | out tok/s | TTFT p50 s | TTFT max s | TPOT p50 ms | first pass TTFT max s |
|---:|---:|---:|---:|---:|---:|
| 1 | 51.1 | 0.06 | 0.06 | 18.9 | 3.25 |
| 4 | 74.3 | 0.30 | 0.30 | 49.9 | 3.22 |
| 16 | 209.7 | 0.58 | 0.59 | 68.0 | 3.65 |
| 64 | 265.0 | 1.44 | 2.06 | 219.5 | 7.97 |

The first pass at each level pays the compiles of that level's new step shapes (3-8 s here): the engine compiles a
(tokens, sequences) bucket on first use. With `--serve-args=--precompile` the server compiled all 46 shapes first
(543 s here) and the first-pass worst TTFT was 0.15 / 0.34 / 0.73 / 2.26 s at 1 / 4 / 16 / 64 streams; the second
pass gave 50.6 / 88.7 / 226.7 / 275.6 tok/s.

These figures predate two later changes and were not re-measured: the CPU engine's token buckets gained the
midpoints 3 x 2^k (78 step shapes at these settings instead of 46, so --precompile takes longer and more first
requests compile; prefill steps pad less), and decode attention uses smaller KV blocks at many streams (the same
64-stream decode went from 293 to 351 tok/s in LLM.generate).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one(client, model: str, i: int, max_tokens: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first = None
    n = 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Tell me a story about the number {i}."}],
        max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - t0
        if chunk.usage:
            n = chunk.usage.completion_tokens
    total = time.perf_counter() - t0
    return first or total, total, n


async def level(client, model: str, c: int, max_tokens: int, first: int = 0) -> dict:
    """c concurrent requests with prompts first .. first + c - 1 (new prompts: no prefix-cache hits)."""
    t0 = time.perf_counter()
    res = await asyncio.gather(*[one(client, model, first + i, max_tokens) for i in range(c)])
    wall = time.perf_counter() - t0
    toks = sum(r[2] for r in res)
    ttft = [r[0] for r in res]
    tpot = [(r[1] - r[0]) / max(r[2] - 1, 1) for r in res]
    return {"streams": c, "out_tok_s": toks / wall, "ttft_p50": statistics.median(ttft), "ttft_max": max(ttft),
            "tpot_p50_ms": 1000 * statistics.median(tpot), "wall_s": wall}


async def main_async(args) -> None:
    import openai
    client = openai.AsyncOpenAI(base_url=args.url + "/v1", api_key=args.api_key or "x", timeout=3600, max_retries=0)
    model = (await client.models.list()).data[0].id
    print(f"model {model}, {args.max_tokens} output tokens per request, greedy")
    print(f"{'streams':>7} {'out tok/s':>10} {'TTFT p50 s':>11} {'TTFT max s':>11} {'TPOT p50 ms':>12}"
          f" {'first pass TTFT max s':>22}")
    for c in args.levels:
        w = await level(client, model, c, args.max_tokens, 1000 * c)  # first pass: compiles the step shapes
        r = await level(client, model, c, args.max_tokens, 1000 * c + 500)
        print(f"{r['streams']:>7} {r['out_tok_s']:>10.1f} {r['ttft_p50']:>11.2f} {r['ttft_max']:>11.2f} "
              f"{r['tpot_p50_ms']:>12.1f} {w['ttft_max']:>22.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server; default: start one here")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--serve-args", default="", help="extra flags for the server this script starts")
    args = ap.parse_args()
    proc = None
    if args.url is None:
        port = free_port()
        args.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "gemmajax.server.cli", "serve", "--port", str(port),
               "--max-num-seqs", str(max(args.levels)), *args.serve_args.split()]
        proc = subprocess.Popen(cmd, env=dict(os.environ))
        import httpx
        deadline = time.time() + 600
        while True:
            try:
                if httpx.get(args.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or proc.poll() is not None:
                raise SystemExit("the server did not come up")
            time.sleep(1)
    try:
        asyncio.run(main_async(args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
