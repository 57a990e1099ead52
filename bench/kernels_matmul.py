"""CPU microbenchmark of the XLA forms behind gemmajax.quant.linear (the tables in int8_matmul.py / int4_matmul.py).

Usage: JAX_PLATFORMS=cpu python bench/kernels_matmul.py [--shapes 640x2048,1536x6144,640x262144] [--ms 1,16]
Prints ms per call (min of --reps, forms called round-robin) and weight bytes read per second for each form.
"""
from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from gemmajax.quant import quantize
from gemmajax.quant.int4_matmul import int4_matmul_xla
from gemmajax.quant.int8_matmul import int8_matmul_xla


def interleaved(forms: dict, x, reps: int) -> dict[str, float]:
    """ms per call (min over reps) of each form, calling the forms round-robin so that the load of a shared
    machine drifts over all of them alike."""
    jitted = {name: (jax.jit(f), w) for name, (f, w, _) in forms.items()}
    for f, w in jitted.values():
        f(x, w).block_until_ready()
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(reps):
        for name, (f, w) in jitted.items():
            t = time.perf_counter()
            f(x, w).block_until_ready()
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: v * 1e3 for name, v in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="640x2048,1536x6144,640x262144", help="in x out, comma separated")
    ap.add_argument("--ms", default="1,16", help="row counts M")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip", default="", help="comma-separated form names to skip")
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, load average {os.getloadavg()[0]:.2f} (timings "
          f"under load are relative figures, not measurements)")
    for shape in a.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)
        q8, q4 = quantize(w, "int8"), quantize(w, "int4")
        for m in (int(v) for v in a.ms.split(",")):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            forms = {
                "bf16 dense dot(x, W.astype(f32).T)": (lambda x, w: jnp.dot(x, w.astype(jnp.float32).T), w, w.nbytes),
                "int8 vector": (lambda x, q: int8_matmul_xla(x, q, form="vector"), q8, q8.nbytes),
                "int8 int": (lambda x, q: int8_matmul_xla(x, q, form="int"), q8, q8.nbytes),
                "int4 rows": (lambda x, q: int4_matmul_xla(x, q, form="rows"), q4, q4.nbytes),
                "int4 tiles": (lambda x, q: int4_matmul_xla(x, q, form="tiles"), q4, q4.nbytes),
            }
            forms = {k: v for k, v in forms.items() if k not in skip}
            for name, ms in interleaved(forms, x, a.reps).items():
                nbytes = forms[name][2]
                print(f"in {k:6d} x out {n:6d}  M={m:3d}  {name:36s} {ms:9.2f} ms  {nbytes / ms / 1e6:6.1f} GB/s  "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
