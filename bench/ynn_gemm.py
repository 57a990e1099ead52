"""Where XLA:CPU's GEMM time goes at decode batch sizes: the LM head ([M, 640] x [640, 262,144], Gemma 3 270M) in
each weight layout and dtype XLA hands to YNNPACK, timed by the number of rows M, and (with `perf` on the PATH) the
share of the CPU time spent in YNNPACK's packing of the weight against its dot kernel.

Design choices: every form is checked against a numpy reference before it is timed (float32 sums within 1e-3 of
the largest output for bf16; exact for int8; shapes equal). Times are the min of --reps calls back to back per form,
the forms in turn, the whole sequence twice, in one process. The perf profile runs each form in a child process
(16 rows) and samples that process only after it has compiled and warmed up, so the shares are of the steady-state
call.

    .venv/bin/python bench/ynn_gemm.py [--rows 2,4,8,16,32] [--n 262144] [--reps 6] [--perf]

Measured 2026-12-06 (`--perf`, defaults; 2-core AMD EPYC Zen 4, AVX-512 bf16 / VNNI, jax 0.10.2, quiet: load 0.08
before), ms (GMAC/s):

| form | M=2 | M=4 | M=8 | M=16 | M=32 |
|---|---:|---:|---:|---:|---:|
| bf16 x.W^T, W [N,K] (the engine's) | 19.14 (18) | 21.34 (31) | 23.54 (57) | 29.78 (90) | 55.02 (98) |
| bf16 x.W, W [K,N] | 21.18 (16) | 22.00 (31) | 24.88 (54) | 32.05 (84) | 57.33 (94) |
| bf16 W.x^T (vocab rows) | 27.52 (12) | 27.19 (25) | 27.61 (49) | 28.12 (95) | 49.27 (109) |
| int8 x.W^T, W [N,K] (the engine's) | 11.08 (30) | 13.36 (50) | 17.49 (77) | 26.96 (100) | 56.69 (95) |
| int8 x.W, W [K,N] | 14.51 (23) | 16.57 (41) | 20.48 (66) | 30.02 (89) | 59.15 (91) |
| int8 W.x^T (vocab rows) | 15.93 (21) | 15.84 (42) | 17.65 (76) | 27.85 (96) | 53.48 (100) |

perf at 16 rows (steady state): bf16 [N,K] 55 % `ynn::transpose_x32_avx512`, 39 % the kernel
`dot_bf16_bf16_fp32_8x32x2_1x16x2_avx512bf16`; bf16 [K,N] 61 % `interleave2_x16_avx512`, 33 % the same kernel; int8
[N,K] 64 % `dot_int8_int8_int32_6x32x4_1x16x4_avx512`, 32 % `transpose_x32_avx512`; int8 [K,N] 58 % kernel, 39 %
`interleave4_x8_avx512`; the vocabulary as the GEMM's rows packs nothing (97-98 % in `..._16x16x2_...avx512bf16` or
`..._6x8x16_...avx512`) but those narrow kernels run at the same 95-96 GMAC/s. (An earlier run the same day, load
0.83 before, gave the same figures within 5 %.)

What it shows:
- Every form runs 16 rows at 84-100 GMAC/s. A bf16 call of 2 rows already costs two thirds of one of 16 (int8: two
  fifths).
- In the engine's layout most of a 16-row GEMM is YNNPACK repacking the weight, on every call. YNNPACK packs B
  whenever B is transposed or no unpacked kernel comes within 2x of the packed one (`should_pack_b`, XNNPACK's
  ynnpack/subgraph/dot.cc, as stored today; jaxlib 0.10.2 bundles its own copy). XLA hands it the weights as
  run-time tensors, so the packing is part of each call.
- The kernel's share of the CPU samples puts it at about 230 GMAC/s for the bf16 head (39 % of 29.8 ms: about
  12 ms) and about 155 for int8 (64 % of 27.0 ms: about 17 ms). These are estimates from the samples, not timed.
- The layout that packs nothing (the weight as the GEMM's rows) gets a narrow kernel that is no faster: 28 ms.
- Measured separately this session, not by this script:
  - the bf16 head closed over as a constant: 29.1 ms against 29.6 as an argument (the whole step:
    step_breakdown.py's --constants);
  - a u8 x s8 dot (YNNPACK's VNNI kernels are uint8 x int8; jaxlib 0.10.2 does not send that pair to YNNPACK, newer
    XLA sources list it) ran Eigen's generic GEMM, about 330 ms for the head.
- The int8 kernel used is plain AVX-512, not VNNI.
- No bf16 or int8 form measured here gets a 16-row LM head under about 27 ms on this machine; the int4 tiles are
  dequantized to bf16 and go through the same GEMMs. At the same rate the layers' 1.6 GMAC would take about 17 ms
  (an extrapolation), so the 16-row step's GEMMs take about 44 ms whatever the weights' bytes.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

K = 640
READY_TIMEOUT_S = 600  # a child's compile and warm-up (about 20 s here)
NT = (((1,), (1,)), ((), ()))  # contract dim 1 of both operands
NN = (((1,), (0,)), ((), ()))  # x [M, K] . w [K, N]
_PERF_COLUMNS = re.compile(r"\s{2,}")  # the symbol, then perf's padding and further columns
_PERF_LINE = re.compile(r"^\s*([\d.]+%)\s+\[.\]\s+(\S.*?)\s*$")  # perf report --stdio: "  55.47%  [.] symbol"


FORMS = ("bf16 x.W^T, W [N,K]", "bf16 x.W, W [K,N]", "bf16 W.x^T (vocab rows)", "int8 x.W^T, W [N,K]",
         "int8 x.W, W [K,N]", "int8 W.x^T (vocab rows)")


@functools.lru_cache(maxsize=1)
def weights(n: int, seed: int) -> tuple:
    """The head's weights, drawn once per (n, seed) and shared by every row count: bf16 [N, K] and [K, N], int8 [N, K]
    and [K, N] (jax arrays), and the float64 / int64 copies the references multiply."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    wb = jnp.asarray((rng.standard_normal((n, K)) * 0.05).astype(np.float32), jnp.bfloat16)
    w8 = rng.integers(-127, 128, (n, K)).astype(np.int8)
    return (wb, jnp.asarray(wb.T), jnp.asarray(w8), jnp.asarray(w8.T), np.asarray(wb, np.float64),
            w8.astype(np.int64))


def forms(m: int, n: int, seed: int = 0) -> dict:
    """name -> (fn, x, w, reference float64 or int64 in the form's own orientation, exact). The weights come from
    `weights(n, seed)`; x [m, K] is drawn for (seed, m)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    wb, wb_kn, w8, w8_kn, wb64, w8_64 = weights(n, seed)
    rng = np.random.default_rng((seed, m))
    xb = jnp.asarray(rng.standard_normal((m, K)).astype(np.float32), jnp.bfloat16)
    ref_b = np.asarray(xb, np.float64) @ wb64.T
    x8 = rng.integers(-127, 128, (m, K)).astype(np.int8)
    ref_8 = x8.astype(np.int64) @ w8_64.T
    x8 = jnp.asarray(x8)

    def dot(dims, out, swap=False):  # swap: the weight as the GEMM's left operand, y^T [N, M] (not transposed back:
        def f(x, w):                   # XLA would fold that transpose into the dot and undo the swap)
            return lax.dot_general(w, x, dims, preferred_element_type=out) if swap else \
                lax.dot_general(x, w, dims, preferred_element_type=out)
        return jax.jit(f)

    out = {
        "bf16 x.W^T, W [N,K]": (dot(NT, jnp.float32), xb, wb, ref_b, False),
        "bf16 x.W, W [K,N]": (dot(NN, jnp.float32), xb, wb_kn, ref_b, False),
        "bf16 W.x^T (vocab rows)": (dot(NT, jnp.float32, swap=True), xb, wb, ref_b.T, False),
        "int8 x.W^T, W [N,K]": (dot(NT, jnp.int32), x8, w8, ref_8, True),
        "int8 x.W, W [K,N]": (dot(NN, jnp.int32), x8, w8_kn, ref_8, True),
        "int8 W.x^T (vocab rows)": (dot(NT, jnp.int32, swap=True), x8, w8, ref_8.T, True),
    }
    assert tuple(out) == FORMS
    return out


def check(name: str, y, ref, exact: bool) -> None:
    y = np.asarray(y)
    if y.shape != ref.shape:
        raise ValueError(f"{name}: shape {y.shape}, expected {ref.shape}")
    if exact:
        if not np.array_equal(y.astype(np.int64), ref):
            raise ValueError(f"{name}: int8 products differ from numpy's")
        return
    err = float(np.max(np.abs(y - ref)))
    tol = 1e-3 * float(np.max(np.abs(ref)))
    if not err <= tol:
        raise ValueError(f"{name}: max error {err:.3g} against numpy (tolerance {tol:.3g})")


def time_rows(rows: list[int], n: int, reps: int) -> None:
    table: dict[str, dict[int, float]] = {}
    for m in rows:
        fs = forms(m, n)
        for name, (f, x, w, ref, exact) in fs.items():
            check(name, f(x, w), ref, exact)
        best = dict.fromkeys(fs, float("inf"))
        for _ in range(2):
            for name, (f, x, w, _, _) in fs.items():
                for _ in range(reps):
                    t = time.perf_counter()
                    f(x, w).block_until_ready()
                    best[name] = min(best[name], time.perf_counter() - t)
        for name, t in best.items():
            table.setdefault(name, {})[m] = t
    print(f"\n[M, {K}] x [{K}, {n}], ms (GMAC/s), min of {reps} calls x 2 passes")
    print("| form | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for name, by_m in table.items():
        cells = [f"{by_m[m] * 1e3:.2f} ({m * n * K / by_m[m] / 1e9:.0f})" for m in rows]
        print(f"| {name} | " + " | ".join(cells) + " |")


def child(form: str, m: int, n: int) -> None:
    """Compile and warm one form, say "ready", then call it until killed (the parent samples it with perf)."""
    f, x, w, ref, exact = forms(m, n)[form]
    check(form, f(x, w), ref, exact)
    for _ in range(3):
        f(x, w).block_until_ready()
    print("ready", flush=True)
    while True:
        f(x, w).block_until_ready()


def profile(n: int, seconds: float) -> None:
    perf = shutil.which("perf")
    if perf is None:
        print("\nperf is not on the PATH: no profile")
        return
    print(f"\nperf, 16 rows, {seconds:.0f} s of the steady state per form (share of the process's samples)")
    for form in FORMS:
        with tempfile.TemporaryDirectory() as d:
            err_path = os.path.join(d, "child.err")
            with open(err_path, "w") as err:
                proc = subprocess.Popen([sys.executable, __file__, "--child", form, "--n", str(n)],
                                        stdout=subprocess.PIPE, stderr=err, text=True)
            try:
                deadline = time.monotonic() + READY_TIMEOUT_S
                while True:  # the child prints "ready" once compiled and warm; give up on a dead or stuck child
                    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
                    line = proc.stdout.readline() if ready else None
                    if line and line.strip() == "ready":
                        break
                    if not line:  # None: timed out; "": the child closed its output (exited)
                        with open(err_path) as f:
                            tail = f.read()[-2000:]
                        why = "timed out" if line is None else f"exited ({proc.wait()})"
                        raise RuntimeError(f"{form}: the child {why} before it was ready; its stderr ends:\n{tail}")
                data = os.path.join(d, "perf.data")
                subprocess.run([perf, "record", "-q", "-p", str(proc.pid), "-o", data, "--", "sleep", str(seconds)],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                rep = subprocess.run([perf, "report", "-i", data, "--no-children", "--sort", "symbol", "--stdio"],
                                     check=True, capture_output=True, text=True).stdout
            finally:
                proc.kill()
                proc.wait()
        top = [mt.groups() for mt in map(_PERF_LINE.match, rep.splitlines()) if mt][:3]
        print(f"  {form}: " + "; ".join(f"{share} {_PERF_COLUMNS.split(sym)[0][:60]}" for share, sym in top))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="2,4,8,16,32")
    ap.add_argument("--n", type=int, default=262144)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--perf", action="store_true", help="also profile each form at 16 rows with perf")
    ap.add_argument("--perf-seconds", type=float, default=3.0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, 16, a.n)
        return
    import jax
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, load average {os.getloadavg()[0]:.2f} before")
    time_rows([int(r) for r in a.rows.split(",")], a.n, a.reps)
    if a.perf:
        profile(a.n, a.perf_seconds)
    print(f"load average {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
