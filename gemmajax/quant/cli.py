"""`gemmajax quantize --ckpt SRC --quant Q --out DIR [--dtype D]`: convert and quantize once, load fast afterwards.

Design choices: the conversion is exactly `load_model(SRC, dtype, quant)` (the same code that quantizes on the
fly, so a converted directory and an on-the-fly load hold the same bits) followed by `orbax_io.save_converted`;
the summary says what was quantized and how many bytes it saves, and the output is loaded back once, timed, the
way `load_model`, `LLM` and `serve` will load it. Model code is imported lazily (quant/ itself needs only jax).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_GIB = float(1 << 30)


def _fmt_bytes(n: int) -> str:
    return f"{n / _GIB:.3f} GiB" if n >= (1 << 27) else f"{n / (1 << 20):.2f} MiB"


def format_summary(stats: dict[str, dict[str, int]]) -> list[str]:
    """Lines for `orbax_io.summarize` output: per storage kind, tensors and bytes before -> after, and the total."""
    lines = []
    labels = {"int8": "int8 (w8a8 / +emb8)", "int4": "int4 (w4a16 / +emb4)", "plain": "unquantized"}
    for key in ("int8", "int4", "plain"):
        if key in stats:
            d = stats[key]
            lines.append(f"  {labels[key]:<22} {d['tensors']:5d} tensors  {_fmt_bytes(d['bytes_before']):>12} -> "
                         f"{_fmt_bytes(d['bytes']):>12}")
    before = sum(d["bytes_before"] for d in stats.values())
    after = sum(d["bytes"] for d in stats.values())
    lines.append(f"  {'total':<22} {sum(d['tensors'] for d in stats.values()):5d} tensors  {_fmt_bytes(before):>12} "
                 f"-> {_fmt_bytes(after):>12}  ({after / max(before, 1):.1%})")
    return lines


def run(args: argparse.Namespace) -> int:
    """args.ckpt (source: HF dir, .gguf, compressed-tensors dir), args.quant, args.out, args.dtype. Returns 0, or 1
    with a message on stderr when the source cannot be converted."""
    import jax

    from gemmajax.config import ConfigError
    from gemmajax.model.loader import CheckpointError, load_model
    from gemmajax.model.orbax_io import load_converted, save_converted, summarize

    out = os.path.abspath(args.out)
    dtype = getattr(args, "dtype", None) or "bfloat16"
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        print(f"gemmajax quantize: --out {out} exists and is not an empty directory; choose a new one",
              file=sys.stderr)
        return 1
    try:
        t0 = time.perf_counter()
        model = load_model(args.ckpt, dtype=dtype, quant=args.quant)
        jax.block_until_ready(model.weights)
        t_load = time.perf_counter() - t0
        stats = summarize(model.config, model.weights)
        t0 = time.perf_counter()
        save_converted(out, model, args.ckpt)
        t_save = time.perf_counter() - t0
    except (CheckpointError, ConfigError, FileNotFoundError, FileExistsError) as e:
        print(f"gemmajax quantize: {e}", file=sys.stderr)
        return 1
    cfg_name, quant = model.config.name or model.config.model_type, model.quant
    del model  # free the weights before timing the load the way users will run it
    t0 = time.perf_counter()
    _, weights, meta = load_converted(out)
    jax.block_until_ready(weights)
    t_reload = time.perf_counter() - t0
    print(f"gemmajax quantize: {args.ckpt} -> {out}")
    print(f"  model {cfg_name}, quant {quant}, dtype {dtype}; loaded and quantized in {t_load:.1f} s, "
          f"written in {t_save:.1f} s")
    print("\n".join(format_summary(stats)))
    if meta.get("files"):
        print(f"  beside the weights: config.json, {', '.join(meta['files'])}")
    print(f"  the converted checkpoint loads in {t_reload:.2f} s (load_model / LLM / serve --ckpt {out})")
    return 0
