"""Microbenchmark of ragged paged attention on the local backend (the jnp reference on CPU/GPU; the kernel on TPU).

Prints, per scenario: milliseconds per call (median of --iters after a warm-up), query tokens/s, and the KV bytes a
perfect kernel must read (each sequence's own K/V once) over the time, in GB/s, next to the machine's ceiling given
with --bandwidth-gbs (default 27, a numpy sum on the 2-core dev machines of cpu-xla-notes.md).

  .venv/bin/python bench/kernels_attention.py [--impl ref] [--dtype bf16] [--bits] [--iters 5]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from gemmajax.kv import alloc_pages, bytes_per_page, make_ragged_meta, ragged_paged_attention
from gemmajax.kv.layout import storage_dtype

# (name, [(cached, q_len) per sequence], sliding window)
SCENARIOS = [
    ("decode 16 x 1k", [(1023, 1)] * 16, None),
    ("decode 16 x 1k, W=512", [(1023, 1)] * 16, 512),
    ("decode 64 x 256", [(255, 1)] * 64, None),
    ("prefill 1 x 512", [(0, 512)], None),
    ("chunk 256 after 2k + 8 decodes", [(2048, 256)] + [(511, 1)] * 8, None),
]


def run(name, seqs, window, *, n, nk, h, ps, dtype, impl, iters, bandwidth, bits):
    rng = np.random.default_rng(0)
    q_lens = [ql for _, ql in seqs]
    kv_lens = [c + ql for c, ql in seqs]
    t = sum(q_lens)
    t_pad = 1 << (t - 1).bit_length()
    need = [-(-kv // ps) for kv in kv_lens]
    num_pages = sum(need) + 1
    p_max = max(need)
    tables, at = [], 1
    for cnt in need:
        tables.append(list(range(at, at + cnt)))
        at += cnt
    meta = make_ragged_meta(q_lens, kv_lens, tables, max_num_seqs=max(len(seqs), 8), pages_per_seq=p_max)
    pages = alloc_pages(num_pages, ps, nk, h, dtype)
    pages = (jnp.asarray(rng.normal(size=pages.shape), jnp.float32)).astype(pages.dtype)
    if bits:
        pages = jax.lax.bitcast_convert_type(pages, storage_dtype(dtype, bits=True))
    q = jnp.asarray(rng.normal(size=(t_pad, n, h)), jnp.bfloat16)
    kn = jnp.asarray(rng.normal(size=(t_pad, nk, h)), jnp.bfloat16)

    @functools.partial(jax.jit, donate_argnums=(3,))
    def step(q, k, v, pages, meta):
        return ragged_paged_attention(
            q, k, v, pages, meta, sm_scale=h**-0.5, sliding_window=window, impl=impl, kv_dtype=dtype if bits else None
        )

    out, pages = step(q, kn, kn, pages, meta)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out, pages = step(q, kn, kn, pages, meta)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    sec = float(np.median(times))
    span = [min(kv, window + ql - 1) if window else kv for kv, ql in zip(kv_lens, q_lens)]
    kv_bytes = sum(span) * bytes_per_page(1, nk, h, dtype)
    print(
        f"{name:34s} {sec * 1e3:9.2f} ms  {t / sec:10.0f} tok/s  {kv_bytes / sec / 1e9:7.2f} GB/s KV"
        f"  ({100 * kv_bytes / sec / 1e9 / bandwidth:5.1f}% of {bandwidth:.0f} GB/s)"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--heads", default="4,1,256", help="N,K,H (default: Gemma 3 270M)")
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--bandwidth-gbs", type=float, default=27.0)
    ap.add_argument("--bits", action="store_true", help="bit-stored pages (the fast layout on XLA:CPU)")
    args = ap.parse_args()
    n, nk, h = (int(x) for x in args.heads.split(","))
    print(
        f"backend {jax.default_backend()}, impl {args.impl}, N={n} K={nk} H={h}, "
        f"pages {args.dtype}{' bit-stored' if args.bits else ''} x {args.page_size} tokens"
    )
    for name, seqs, window in SCENARIOS:
        run(
            name,
            seqs,
            window,
            n=n,
            nk=nk,
            h=h,
            ps=args.page_size,
            dtype=args.dtype,
            impl=args.impl,
            iters=args.iters,
            bandwidth=args.bandwidth_gbs,
            bits=args.bits,
        )


if __name__ == "__main__":
    main()
