"""Block sizes of the quantized kernels on a real TPU v5e: which (tn, tk) streams the weights fastest? One device call
per kind (bench/device_tpu_tiles.sh --only int8 | --only int4,gmm).

The first real-chip run (docs/device_tpu_v5e_2026-12-04.log) measured the int8 / int4 matmuls and the grouped int4
expert matmul far below the chip's bandwidth with the blocks their heuristics pick (int8 down_proj [2112 x 2816]
87 GB/s: one block, so nothing overlaps its DMA; int4 100-200 GB/s). Here every kernel runs at the layer shapes that
carry E2B's and 26B-A4B's bytes, 16 rows (a 16-stream decode step; int8 pads 1 and 16 rows to the same 32-row tile,
int4 to the same 16), over each legal (tn, tk) in a grid of candidates and the default, and a bf16 XLA dot of the
same shape beside them. Each program is a scan over distinct weights of >= --min-mib MiB in all (every call starts
its pipeline cold, as a layer's matmul does in the step), so GB/s counts weight bytes read from HBM. The last
weight's output of every candidate is checked against the kernel's jnp reference on the chip.

Every program of a shape is compiled first (threads: the compiles release the GIL), then each is timed alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
from device_h200 import timeit
from device_tpu import CLOCK, MiB, _filler, _normal, free_tree, log, print_summary, record, run_item, watchdog
from jax import lax

from gemmajax.quant.array import QuantArray
from gemmajax.quant.gmm import gmm_blocks, gmm_pallas, gmm_ref
from gemmajax.quant.int4_matmul import int4_blocks, int4_matmul_pallas, int4_matmul_ref
from gemmajax.quant.int8_matmul import int8_blocks, int8_matmul_pallas, int8_matmul_ref
from gemmajax.quant.quantize import default_act_group

# (name, out, in): the projections that carry the bytes (E2B: 40 gate / up of 12288 x 1536, 20 down of 1536 x 12288,
# 30 of 6144 x 1536, q / o 2048 x 1536; 26B-A4B: 60 gate / up of 2112 x 2816, 30 down 2816 x 2112, q 4096 x 2816)
SHAPES = [("e2b gate/up", 12288, 1536), ("e2b down", 1536, 12288), ("e2b q", 2048, 1536),
          ("26b gate/up", 2112, 2816), ("26b down", 2816, 2112), ("26b q", 4096, 2816),
          ("e2b LM head", 262144, 1536),
          # 26B-A4B's 2112 is 16.5 lanes: padded, its projections could be tiled (is it worth the bytes?)
          ("26b gate/up out padded", 2304, 2816), ("26b down in padded", 2816, 2560),
          ("26b down in 2176", 2816, 2176), ("26b down in 2304", 2816, 2304)]
TINY_SHAPES = [("tiny a", 512, 256), ("tiny b", 256, 512)]
TN = (128, 256, 512, 768, 1024, 1152, 1408, 2048, 4096)
TK = (256, 512, 768, 1024, 1280, 1408, 1536, 2048, 3072, 4096)
ROWS = 16
INTERPRET = False  # main(): True off the TPU (the --tiny smoke test)
DIRECT = False  # main(): --direct


def _divides(t: int, n: int, step: int) -> bool:
    return n % t == 0 and (t % step == 0 or t == n)


def int8_candidates(n: int, k: int, ag: int) -> list[tuple[int, int, int]]:
    tm = int8_blocks(ROWS, n, k, ag)[0]
    tns = sorted({t for t in (*TN, n) if t <= n and _divides(t, n, 128)})
    tks = sorted({t for t in (*TK, k) if t <= k and _divides(t, k, 128) and (not ag or t % ag == 0)
                  and t <= 32 * (ag or k)})
    return [(tm, tn, tk) for tn in tns for tk in tks if 128 * 1024 <= tn * tk <= 12 * MiB]


def int4_candidates(n: int, half: int, group: int) -> list[tuple[int, int, int]]:
    tm = int4_blocks(ROWS, n, half, group)[0]
    tns = sorted({t for t in (*TN, n) if t <= n and _divides(t, n, 128)})
    tks = sorted({t for t in (*TK, 128, half) if t <= half and _divides(t, half, 128)
                  and (t == half or (t // group) % 8 == 0)})
    return [(tm, tn, tk) for tn in tns for tk in tks if 64 * 1024 <= tn * tk <= 6 * MiB]


def _weights(kind: str, n: int, k: int, reps: int, seed: int):
    if kind == "bf16":
        return (_filler((reps, n, k), "bfloat16")(jnp.uint32(seed)),)
    if kind == "int8":
        return (_filler((reps, n, k), "int8")(jnp.uint32(seed)), jnp.full((reps, n), 0.01 / 127, jnp.float32))
    return (_filler((reps, n, k // 2), "uint8")(jnp.uint32(seed)),
            _filler((reps, n, k // 32), "bfloat16")(jnp.uint32(seed + 1)))


def _quant(kind: str, w, n: int, k: int) -> QuantArray:
    if kind == "int8":
        return QuantArray(w[0], w[1], "int8", (n, k), 0, jnp.bfloat16, default_act_group(k))
    return QuantArray(w[0], w[1], "int4", (n, k), 32, jnp.bfloat16)


def _program(kind: str, x, n: int, k: int, blocks):
    """A jitted scan over the stacked weights: (sum of every output, the last weight's output)."""
    def body(c, w):
        if kind == "bf16":
            y = lax.dot_general(x, w[0], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            y = y.astype(jnp.bfloat16)
        elif kind == "int8":
            y = int8_matmul_pallas(x, _quant(kind, w, n, k), blocks=blocks, interpret=INTERPRET)
        else:
            y = int4_matmul_pallas(x, _quant(kind, w, n, k), blocks=blocks, interpret=INTERPRET)
        return (c[0] + jnp.sum(y.astype(jnp.float32)), y), None

    init = (jnp.float32(0), jnp.zeros((x.shape[0], n), x.dtype))
    return _scan_or_direct(body, init)


def _scan_or_direct(body, init):
    """The scan over the stacked weights, or with --direct one call on the one weight (its leading axis of 1
    reshaped away: a bitcast, where a slice of a scan's operand might be copied before a custom call)."""
    if DIRECT:
        return jax.jit(lambda *ws: body(init, tuple(v.reshape(v.shape[1:]) for v in ws))[0])
    return jax.jit(lambda *ws: lax.scan(body, init, ws)[0])


def _compile_all(progs: dict, args) -> dict:
    """name -> compiled, compiled in threads; failures recorded by the caller (value: the exception)."""
    out = {}
    with concurrent.futures.ThreadPoolExecutor(min(12, len(progs))) as ex:
        futs = {ex.submit(lambda f: f.lower(*args).compile(), f): key for key, f in progs.items()}
        for fut in concurrent.futures.as_completed(futs, timeout=max(1.0, CLOCK.left() - 30)):
            try:
                out[futs[fut]] = fut.result()
            except Exception as e:  # noqa: BLE001
                out[futs[fut]] = e
    return out


def _time_all(item: str, name: str, compiled: dict, args, ref, calls: int, reps: int) -> list:
    """[(seconds per weight, key, max |y - ref|)] of each compiled candidate (a program of `calls` weights returning
    (sum, the last weight's output)), checked against ref (8e-3 of max |ref|: one bf16 rounding apart)."""
    tol = 8e-3 * float(jnp.max(jnp.abs(ref)))
    rows = []
    for key, c in compiled.items():
        what = f"{name} blocks {key[1]}"
        if CLOCK.over(15):
            record(item, what, "skipped: deadline", "SKIP")
            continue
        if isinstance(c, Exception):
            record(item, what, f"compile {type(c).__name__}: {str(c)[:160]}", "ERROR")
            continue
        try:
            _, y = c(*args)
            err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)))
            dt = timeit(c, *args, reps=reps) / calls
        except Exception as e:  # noqa: BLE001
            record(item, what, f"{type(e).__name__}: {str(e)[:160]}", "ERROR")
            continue
        rows.append((dt, key, err))
        if err > tol:
            record(item, what, f"max |y - ref| {err:.3g} > {tol:.3g}", "FAIL")
    return rows


def sweep_linear(a, kind: str) -> None:
    shapes = [sh for sh in (TINY_SHAPES if a.tiny else SHAPES) if not a.shapes or any(t in sh[0] for t in a.shapes)]
    peak = a.peak_bw
    for name, n, k in shapes:
        if CLOCK.over(40):
            record(kind, name, "skipped: deadline", "SKIP")
            continue
        per = n * k + n * 4 if kind == "int8" else n * k // 2 + n * (k // 32) * 2
        reps = 1 if DIRECT else max(2, math.ceil(a.min_mib * MiB / per))
        x = _normal((ROWS, k), 5, 1.0, jnp.bfloat16)
        if kind == "int8":
            ag = default_act_group(k)
            default = int8_blocks(ROWS, n, k, ag)[:3]
            cands = int8_candidates(n, k, ag)
        else:
            default = int4_blocks(ROWS, n, k // 2, 32)[:3]
            cands = int4_candidates(n, k // 2, 32)
        progs = {("default", default): _program(kind, x, n, k, None)}
        progs.update({("cand", b): _program(kind, x, n, k, b) for b in cands if b != default})
        t0 = time.perf_counter()
        w = _weights(kind, n, k, reps, 3)
        compiled = _compile_all(progs, w)
        log(f"  {name} [{n} x {k}] {kind}: {len(compiled)} programs compiled in {time.perf_counter() - t0:.0f} s")
        last = _quant(kind, jax.tree.map(lambda v: v[-1], w), n, k)
        ref = (int8_matmul_ref if kind == "int8" else int4_matmul_ref)(x, last).astype(jnp.float32)
        rows = _time_all(kind, name, compiled, w, ref, reps, a.reps)
        free_tree(w)
        bw = _weights("bf16", n, k, 1 if DIRECT else max(2, math.ceil(a.min_mib * MiB / (2 * n * k))), 4)
        try:
            bdt = timeit(_program("bf16", x, n, k, None), *bw, reps=a.reps) / bw[0].shape[0]
            record(kind, f"{name} [{n} x {k}] bf16 XLA dot",
                   f"{bdt * 1e6:.1f} us, {2 * n * k / bdt / 1e9:.0f} GB/s = {100 * 2 * n * k / bdt / peak:.0f}%")
        except Exception as e:  # noqa: BLE001
            bdt = None
            record(kind, f"{name} bf16 XLA dot", f"{type(e).__name__}: {str(e)[:160]}", "ERROR")
        finally:
            free_tree(bw)
        if not rows:
            continue
        rows.sort(key=lambda r: r[0])
        d = next((r for r in rows if r[1][0] == "default"), None)
        for dt, key, err in rows[: a.top]:
            rel = f"; x{d[0] / dt:.2f} of the default's speed" if d else ""
            vs = f"; x{bdt / dt:.2f} of bf16's speed" if bdt else ""
            record(kind, f"{name} [{n} x {k}] M={ROWS} blocks {key[1]}{' (default)' if key[0] == 'default' else ''}",
                   f"{dt * 1e6:.1f} us, {per / dt / 1e9:.0f} GB/s = {100 * per / dt / peak:.0f}%{rel}{vs}; "
                   f"max err {err:.2g}")
        if d and d not in rows[: a.top]:
            record(kind, f"{name} [{n} x {k}] M={ROWS} blocks {d[1][1]} (default)",
                   f"{d[0] * 1e6:.1f} us, {per / d[0] / 1e9:.0f} GB/s = {100 * per / d[0] / peak:.0f}%; rank "
                   f"{rows.index(d) + 1} of {len(rows)}")
        log("  all: " + ", ".join(f"{k_[1]} {per / dt / 1e9:.0f}" for dt, k_, _ in rows))


def sweep_gmm(a) -> None:
    """The grouped int4 expert matmul at 26B-A4B's stacks: gate_up [128, 1408, 2816] and down [128, 2816, 704->768],
    8 and 128 routed rows (decode at 1 and 16 streams, top-8), over the legal (tn, tk)."""
    if a.tiny:
        e, f2, d, topk = 8, 256, 512, 2
    else:
        e, f2, d, topk = 128, 1408, 2816, 8
    peak = a.peak_bw
    stacks = [("gate_up", f2, d), ("down", d, (f2 // 2 + 127) // 128 * 128)]
    for tokens in (1, 16):
        rng = np.random.default_rng(11 + tokens)
        ids = np.concatenate([rng.choice(e, size=topk, replace=False) for _ in range(tokens)])
        sizes = jnp.asarray(np.bincount(ids, minlength=e).astype(np.int32))
        routed = int((np.asarray(sizes) > 0).sum())
        for sname, n, k in stacks:
            if CLOCK.over(30):
                record("gmm", f"{sname} x{tokens}", "skipped: deadline", "SKIP")
                continue
            per_expert = n * k // 2 + n * (k // 32) * 2
            reps = 1 if DIRECT else max(2, math.ceil(a.min_mib * MiB / (e * per_expert)))
            # separate stacks, called one after another (as the engine's unrolled layers are): a scan over stacked
            # experts copied each [E, N, K] slice before the kernel on the chip (0.5-0.9 ms a call, 2026-12-04)
            ws = tuple(a_ for r in range(reps) for a_ in (_filler((e, n, k // 2), "uint8")(jnp.uint32(5 + 2 * r)),
                                                          _filler((e, n, k // 32), "bfloat16")(jnp.uint32(6 + 2 * r))))
            x = _normal((tokens * topk, k), 6, 1.0, jnp.bfloat16)

            def q(w, n=n, k=k):
                return QuantArray(w[0], w[1], "int4", (e, n, k), 32, jnp.bfloat16)

            def prog(blocks, x=x, q=q, sizes=sizes):
                def run(*flat):
                    total, y = jnp.float32(0), None
                    for r in range(len(flat) // 2):
                        y = gmm_pallas(x, q(flat[2 * r:2 * r + 2]), sizes, blocks=blocks, interpret=INTERPRET)
                        total = total + jnp.sum(y.astype(jnp.float32))
                    return total, y
                return jax.jit(run)

            default = gmm_blocks(x.shape[0], q(ws[:2]))[:3]
            tm = default[0]
            tns = sorted({t for t in (*TN, n) if t <= n and _divides(t, n, 128)})
            tks = sorted({t for t in (256, 512, 1024, k // 2) if t <= k // 2 and _divides(t, k // 2, 256)})
            cands = [(tm, tn, tk) for tn in tns for tk in tks if (tm, tn, tk) != default]
            progs = {("default", default): prog(None), **{("cand", b): prog(b) for b in cands}}
            compiled = _compile_all(progs, ws)
            ref = gmm_ref(x, q(ws[-2:]), sizes).astype(jnp.float32)
            rows = _time_all("gmm", f"{sname} x{tokens}", compiled, ws, ref, reps, a.reps)
            free_tree(ws)
            rows.sort(key=lambda r: r[0])
            d = next((r for r in rows if r[1][0] == "default"), None)
            nbytes = routed * per_expert
            for dt, key, err in rows:
                rel = f"; x{d[0] / dt:.2f} of the default's speed" if d else ""
                record("gmm", f"{sname} [{e} x {n} x {k}] {tokens} tokens ({routed} experts) blocks {key[1]}"
                       f"{' (default)' if key[0] == 'default' else ''}",
                       f"{dt * 1e6:.1f} us, {nbytes / dt / 1e9:.0f} GB/s = {100 * nbytes / dt / peak:.0f}%{rel}; "
                       f"max err {err:.2g}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="toy shapes, interpret mode: a CPU smoke test")
    p.add_argument("--only", default="int8", help="comma list of int8, int4, gmm")
    p.add_argument("--deadline", type=float, default=480.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-mib", type=float, default=256.0, help="weight bytes per timed call (distinct copies)")
    p.add_argument("--top", type=int, default=4, help="candidates reported per shape (all are logged)")
    p.add_argument("--shapes", nargs="*", default=None, help="only the shapes whose name contains one of these")
    p.add_argument("--direct", action="store_true",
                   help="time one call on one weight (repeated) instead of a scan over distinct weights")
    p.add_argument("--peak-bw", type=float, default=819e9)
    a = p.parse_args(argv)
    if a.tiny:
        a.min_mib, a.reps = 1.0, 1
    CLOCK.deadline = a.deadline
    threading.Thread(target=watchdog, args=(a.deadline + 20,), daemon=True).start()
    on_tpu = jax.default_backend() == "tpu"
    if not on_tpu and not a.tiny:
        log("not on a TPU: run with --tiny for a CPU smoke test")
        return 2
    global INTERPRET, DIRECT
    DIRECT = a.direct
    INTERPRET = not on_tpu  # the kernels in TPU interpret mode on the CPU
    log(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    only = a.only.split(",")
    for kind in only:
        if kind in ("int8", "int4"):
            run_item(kind, f"{kind} matmul blocks", lambda kind=kind: sweep_linear(a, kind), need=40)
        elif kind == "gmm":
            run_item("gmm", "grouped int4 expert matmul blocks", lambda: sweep_gmm(a), need=30)
    print_summary()
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)
