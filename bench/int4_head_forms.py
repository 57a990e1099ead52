"""The one-row int4 LM head (Gemma 3 270M's tied table, 262,144 x 640, emb4) on XLA:CPU: today's "rows" form against
the single-pass and cache-tiled forms tried for it, and what the GEMV costs by what it computes per weight.

Design choices: every form is checked against int4_matmul_ref before it is timed (a fast wrong form is no result);
each form's --reps calls back to back, twice, the min kept, in one process. The table is random (the head's cost
does not depend on its values). Why "rows" reads the packed bytes twice: XLA:CPU fuses a one-row dot over an elementwise operand
into one loop that computes one weight per element of that operand, so a byte's two nibbles need two operands
(two passes); each form below tries to get both from one pass.

    .venv/bin/python bench/int4_head_forms.py [--reps 15] [--skip complex,int4-dtype]

Measured 2026-12-05 (`--reps 10`; 2-core AMD EPYC Zen 4, load 0.22 before, jax 0.10.2; ms): rows (today) 7.55;
interleaved 132.5; complex 89.3; reduce 332.7; tiled 8192 9.48; int4-dtype 35.1; lo pass, no scale 2.74 (the bytes
at 37 GB/s); both passes, no scale 5.76; int8 table vector 4.80; bf16 table 9.64. The rows form's level arithmetic
was also tried (integer subtract, or-bits as in _levels, signed bytes), in another script: 7.36-7.49 against 7.52.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gemmajax.quant.array import unpack_int4
from gemmajax.quant.int8_matmul import int8_matmul_xla, materialize
from gemmajax.quant.quantize import quantize_table

M = importlib.import_module("gemmajax.quant.int4_matmul")  # the package re-exports the function of the same name
V, D = 262144, 640


def forms_for(q4, q8, w) -> dict:
    """name -> (fn(x, *args), args, is_int4: checked against int4_matmul_ref). q4 / q8: `w` [V, D] as quantize_table
    gives it (V a multiple of 8,192, or below it, for the tiled form)."""
    V, D = q4.padded_out, q4.in_features  # the stored rows and the width (shadowing the module's constants)
    tile = min(8192, V)
    h, (l0, l1) = q4.padded_in // 2, M._live(q4)
    g = q4.group
    v, s = q4.values, q4.scale

    def padded_x(x):  # float32 [1, 2h]: x padded to the table's stored width
        return materialize(jnp.pad(x.astype(jnp.float32), ((0, 0), (0, 2 * h - x.shape[1]))))

    def halves_x(x):
        xp = padded_x(x)
        return xp[:, :h], xp[:, h:]

    def scaled_levels(v, s):  # float32 [V, h/g, g] each: the low and the high nibbles' level x scale
        sf = s.astype(jnp.float32)
        lo = ((v & 15).astype(jnp.float32) - 8.0).reshape(V, h // g, g) * sf[:, :h // g, None]
        hi = ((v >> 4).astype(jnp.float32) - 8.0).reshape(V, h // g, g) * sf[:, h // g:, None]
        return lo, hi

    def interleaved(x, v, s):  # one [V, 2h] operand: element 2j + b is nibble b of byte j (select on the parity)
        xl, xh = halves_x(x)
        x2 = materialize(jnp.stack([xl, xh], axis=-1).reshape(1, 2 * h))
        odd = lax.broadcasted_iota(jnp.int32, (V, h, 2), 2) == 1
        vb = jnp.broadcast_to(v[:, :, None], (V, h, 2))
        lv = jnp.where(odd, vb >> 4, vb & 15).astype(jnp.float32) - 8.0
        sc = jnp.stack([s[:, :h // g], s[:, h // g:]], axis=-1).astype(jnp.float32)  # [V, h/g, 2]
        wf = (lv.reshape(V, h // g, g, 2) * sc[:, :, None, :]).reshape(V, 2 * h)
        return jnp.dot(x2, wf.T)

    def complex_form(x, v, s):  # Re((x_lo + i x_hi) . (w_lo - i w_hi)) = x_lo . w_lo + x_hi . w_hi
        xl, xh = halves_x(x)
        lo, hi = scaled_levels(v, s)
        wc = lax.complex(lo, -hi).reshape(V, h)
        return jnp.real(jnp.dot(materialize(lax.complex(xl, xh)), wc.T))

    def reduce_form(x, v, s):  # both nibbles in one elementwise expression, summed by a reduction
        xl, xh = halves_x(x)
        lo, hi = scaled_levels(v, s)
        return jnp.sum(xl.reshape(1, h // g, g) * lo + xh.reshape(1, h // g, g) * hi, axis=(1, 2))[None]

    def tiled(x, v, s):  # "rows" on tiles, so that the high nibbles' pass reads the tile from cache
        xf = padded_x(x)
        s16 = lax.bitcast_convert_type(s, jnp.uint16)

        def body(i, y):
            vt = lax.dynamic_slice_in_dim(v, i * tile, tile, 0)
            st = lax.bitcast_convert_type(lax.dynamic_slice_in_dim(s16, i * tile, tile, 0), jnp.bfloat16)
            lo, hi = M._halves(vt, st, g, (l0, l1), True)
            a, b = lax.optimization_barrier((jnp.dot(xf[:, :l0], lo.T), jnp.dot(xf[:, h:h + l1], hi.T)))
            return lax.dynamic_update_slice_in_dim(y, a + b, i * tile, 1)
        return lax.fori_loop(0, V // tile, body, jnp.zeros((1, V), jnp.float32))

    def lo_pass_only(x, v, s):  # the low nibbles' pass, no scales: what one pass over the bytes costs
        return jnp.dot(materialize(x.astype(jnp.float32)[:, :l0]), (v[:, :l0] & 15).astype(jnp.float32).T)

    def both_passes_no_scale(x, v, s):
        xf = padded_x(x)
        a = jnp.dot(xf[:, :l0], (v[:, :l0] & 15).astype(jnp.float32).T)
        a, b = lax.optimization_barrier((a, jnp.dot(xf[:, h:h + l1], (v[:, :l1] >> 4).astype(jnp.float32).T)))
        return a + b

    w4 = jax.device_put(unpack_int4(v)[:, :D].astype(jnp.int4))
    s20 = s[:, :D // g]

    def int4_dtype(x, w4, s20):  # XLA's own int4 type
        wf = (w4.astype(jnp.float32).reshape(V, D // g, g) * s20.astype(jnp.float32)[:, :, None]).reshape(V, D)
        return jnp.dot(materialize(x.astype(jnp.float32)), wf.T)

    return {
        "rows (today)": (lambda x, v, s: M.int4_matmul_xla(x, dataclasses.replace(q4, values=v, scale=s), form="rows"), (v, s), True),
        "interleaved": (interleaved, (v, s), True),
        "complex": (complex_form, (v, s), True),
        "reduce": (reduce_form, (v, s), True),
        "tiled 8192": (tiled, (v, s), True),
        "int4-dtype": (int4_dtype, (w4, s20), True),
        "lo pass, no scale": (lo_pass_only, (v, s), False),
        "both passes, no scale": (both_passes_no_scale, (v, s), False),
        "int8 table vector": (lambda x, q: int8_matmul_xla(x, q, form="vector"), (q8,), False),
        "bf16 table": (lambda x, w: x @ w.T, (w,), False),
    }


def checked(forms: dict, x, q4) -> dict:
    """name -> (jitted fn, args), after each int4 form's output is checked against int4_matmul_ref: within 1/128 of
    the largest output (the reference rounds to bf16, 8 significant bits). A form that misses raises ValueError."""
    ref = np.asarray(M.int4_matmul_ref(x, q4), np.float32)
    tol = float(np.max(np.abs(ref))) / 128
    jitted = {}
    for name, (f, args, check) in forms.items():
        jf = jax.jit(f)
        y = np.asarray(jf(x, *args), np.float32).reshape(1, -1)[:, :q4.shape[0]]
        if check:
            err = float(np.max(np.abs(y - ref)))
            if not err <= tol:
                raise ValueError(f"{name}: max error {err:.4g} against int4_matmul_ref (tolerance {tol:.3g})")
        jitted[name] = (jf, args)
    return jitted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--skip", default="", help="comma-separated substrings of form names to skip")
    a = ap.parse_args()
    skip = [t for t in a.skip.split(",") if t]
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, load average {os.getloadavg()[0]:.2f} before")
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((V, D)) * 0.05, jnp.bfloat16)
    q4, q8 = quantize_table(w, 4), quantize_table(w, 8)
    x = jnp.asarray(rng.standard_normal((1, D)), jnp.bfloat16)
    forms = {k: f for k, f in forms_for(q4, q8, w).items() if not any(t in k for t in skip)}
    jitted = checked(forms, x, q4)
    best = dict.fromkeys(jitted, float("inf"))
    for _ in range(2):  # each form's calls back to back (a slow form's big temporaries slowed the next call by up to
        for name, (jf, args) in jitted.items():  # 1.7x when they alternated call by call), the sequence twice
            for _ in range(a.reps):
                t = time.perf_counter()
                jf(x, *args).block_until_ready()
                best[name] = min(best[name], time.perf_counter() - t)
    for name, t in best.items():
        print(f"{name:24s} {t * 1e3:9.3f} ms")
    print(f"load average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
