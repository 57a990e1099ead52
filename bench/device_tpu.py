"""One run on one TPU v5e chip: the Pallas kernels checked against their jnp references on the chip, their speed,
Gemma 4 26B-A4B and E2B decode / prefill throughput with the engine's own step, and how much HBM a real 26B
program can use.

Design choices:
- One process, one command (the chip opens once), under a deadline (--deadline, seconds of work after the
  imports): an item that would start past it is skipped and says so, a watchdog prints the summary and exits if
  an item overruns by --grace seconds. Items run in the order of their value: (2) kernel correctness, (4b) 26B
  decode, (5) 26B memory, (4a) E2B decode, (4c) prefill, (3) kernel speed; each in its own try/except.
- Whole-model programs are compiled in background threads (XLA releases the GIL while it compiles) from the
  abstract weights (`gemmajax.aot.abstract_model_weights`), the abstract caches and the step inputs, starting at
  once, while the kernel checks run; the items then wait for their compiled program (bounded by the deadline).
- Weights are random but have exactly the real model's leaves, shapes and dtypes, built on the device leaf by leaf
  from a counter hash (no host copy of the weights, no PRNG state; integers uniform, float matrices +-[2^-9,
  2^-8), float vectors (norms, scalars) +-[0.5, 1): activations stay finite and token-dependent). Decode streams
  get distinct token ids, so the MoE routes them to different experts (identical streams would all read the same
  8 experts).
- The step is the engine's (`model_step` with greedy=True, hidden=True: the engine's all-greedy step, which also
  returns the final hidden state so that a non-finite value is caught), the paged cache donated, attention
  impl "auto" (the Pallas kernel when lowered for TPU, the jnp reference on the CPU).
- Page tables: each stream gets its own pages while the cache has them; past that they wrap around (several
  streams share pages: same bytes read, and said in the log). Item 5 grows the HBM in use past the planner's KV
  cache with plain "ballast" buffers beside it, so that the compiled programs are reused (a larger cache is the
  same bytes in HBM: the step aliases its pages, no copies).

Run: bash bench/device_tpu.sh (on the TPU machine) | JAX_PLATFORMS=cpu python bench/device_tpu.py --tiny (CPU smoke
test: tiny shapes, kernels in Pallas TPU interpret mode, the same code paths).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import math
import os
import queue
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from device_h200 import timeit  # the same mean-of-reps timer (bench/ is the script's own folder)
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from gemmajax import aot
from gemmajax.config import ModelConfig, _g4
from gemmajax.engine.runner import (
    RunnerSpec,
    abstract_caches,
    alloc_caches,
    build_step_inputs,
    kv_groups,
    model_step,
)
from gemmajax.kv.attention import make_ragged_meta, ragged_paged_attention
from gemmajax.kv.layout import kv_dtype as resolve_kv_dtype
from gemmajax.model import gemma
from gemmajax.quant import QuantArray, gmm, linear, quantize_table, take_rows
from gemmajax.quant.gmm import gmm_pallas, gmm_ref
from gemmajax.quant.int4_matmul import int4_matmul_pallas, int4_matmul_ref
from gemmajax.quant.int8_matmul import int8_matmul_pallas, int8_matmul_ref
from gemmajax.quant.loading import Quantizer
from gemmajax.quant.quantize import default_act_group

T0 = time.perf_counter()
GiB, MiB = aot.GiB, aot.MiB
PAGE = 32
# vLLM-TPU on one v5e (decode tok/s at 1 / 16 / 64 streams), the anchors this run is compared with
ANCHORS_E2B = {"none": (144, 560, 2008), "w8a8+emb4": (243, 923, 3086)}
ANCHORS_26B = (31, 102)  # patched vLLM-TPU, W4A16 repack (13.58 GiB of weights), at 1 / 16 streams

_PRINT = threading.Lock()
RESULTS: list[tuple[str, str, str, str]] = []  # (item, what, result, verdict)
_SUMMARY_DONE = threading.Event()


def now() -> float:
    return time.perf_counter() - T0


def log(msg: str) -> None:
    with _PRINT:
        print(f"[{now():6.1f}s] {msg}", flush=True)


def record(item: str, what: str, result: str, verdict: str = "") -> None:
    RESULTS.append((item, what, result, verdict))
    log(f"RESULT [{item}] {what}: {result}{'  ' + verdict if verdict else ''}")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def print_summary(reason: str = "") -> None:
    if _SUMMARY_DONE.is_set():
        return
    _SUMMARY_DONE.set()
    with _PRINT:
        print(f"\n==================== SUMMARY ({now():.0f} s after imports{'; ' + reason if reason else ''}) "
              f"====================", flush=True)
        w_item = max([4] + [len(r[0]) for r in RESULTS])
        w_what = min(70, max([4] + [len(r[1]) for r in RESULTS]))
        for it, what, res, ver in RESULTS:
            print(f"{it:<{w_item}}  {what:<{w_what}}  {ver:<4}  {res}", flush=True)
        n_pass = sum(r[3] == "PASS" for r in RESULTS)
        n_fail = sum(r[3] == "FAIL" for r in RESULTS)
        n_skip = sum(r[3] == "SKIP" for r in RESULTS)
        n_err = sum(r[3] == "ERROR" for r in RESULTS)
        print(f"checks: {n_pass} PASS, {n_fail} FAIL; {n_err} items ERROR, {n_skip} SKIP", flush=True)


class Clock:
    """The run's deadline (seconds of work after the imports)."""

    def __init__(self, deadline: float):
        self.deadline = deadline

    def left(self) -> float:
        return self.deadline - now()

    def over(self, need: float = 0.0) -> bool:
        return self.left() < need


CLOCK = Clock(500.0)


def run_item(key: str, title: str, fn, *, need: float = 0.0, enabled: bool = True):
    """Runs one item in its own try/except; skipped when fewer than `need` seconds are left."""
    if not enabled:
        record(key, title, "skipped (--skip / --only)", "SKIP")
        return None
    if CLOCK.over(need):
        record(key, title, f"skipped: deadline ({CLOCK.left():.0f} s left, needs ~{need:.0f} s)", "SKIP")
        return None
    t = now()
    log(f"==== {key}: {title} ({CLOCK.left():.0f} s left)")
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- report, go on with the next item
        record(key, title, f"{type(e).__name__}: {str(e)[:400]}", "ERROR")
        with _PRINT:
            traceback.print_exc(limit=12)
        return None
    finally:
        gc.collect()
        log(f"==== {key}: {title} done in {now() - t:.1f} s; {mem_line()}")


def watchdog(limit: float) -> None:
    while True:
        time.sleep(1.0)
        if now() > limit:
            log(f"WATCHDOG: {limit:.0f} s passed (deadline + grace); printing the summary and exiting")
            print_summary("cut by the watchdog")
            sys.stdout.flush()
            os._exit(3)


# ---------------------------------------------------------------------------------------------- device helpers

def mem_stats() -> dict:
    try:
        return jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 -- CPU backends may not have them
        return {}


def mem_line() -> str:
    s = mem_stats()
    if not s:
        return "memory_stats: n/a"
    g = lambda k: f"{s[k] / GiB:.3f} GiB" if k in s else "n/a"
    return f"in use {g('bytes_in_use')}, peak {g('peak_bytes_in_use')}, limit {g('bytes_limit')}"


def free_tree(tree) -> None:
    for a in jax.tree.leaves(tree):
        if isinstance(a, jax.Array) and not a.is_deleted():
            a.delete()



def _hash_u32(shape: tuple[int, ...], seed) -> jax.Array:
    """uint32 hash of each element's flat index and a seed (murmur3's finalizer): elementwise, no PRNG state."""
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        idx = idx + lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % (1 << 32))
        stride *= shape[d]
    h = idx * jnp.uint32(0x9E3779B1) + seed.astype(jnp.uint32) * jnp.uint32(0x85EBCA77)
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@functools.cache
def _filler(shape: tuple[int, ...], dtype: str):
    """One jitted fill per (shape, dtype): integers uniform (int8 in -127..127); floats with a random sign and
    mantissa and a fixed exponent: matrices (weights, quantization scales) +-[2^-9, 2^-8), vectors and scalars
    (norm weights, router / expert / layer scales) +-[0.5, 1), so that the residual stream neither explodes nor
    vanishes (Gemma 4 multiplies it by each layer's scalar: small ones would flush it to zero, and the MoE router
    would then send every token to the same experts)."""
    dt = jnp.dtype(dtype)
    exp = 118 if len(shape) >= 2 else 126

    def fill(seed):
        h = _hash_u32(shape, seed)
        if dt == jnp.uint8:
            return (h >> 24).astype(jnp.uint8)
        if dt == jnp.int8:
            return jnp.maximum((h >> 24).astype(jnp.int32) - 128, -127).astype(jnp.int8)
        if dt == jnp.bfloat16:
            bits = ((h >> 16) & jnp.uint32(0x807F)) | jnp.uint32(exp << 7)
            return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)
        if jnp.issubdtype(dt, jnp.floating):
            bits = (h & jnp.uint32(0x807FFFFF)) | jnp.uint32(exp << 23)
            return lax.bitcast_convert_type(bits, jnp.float32).astype(dt)
        return (h >> 8).astype(dt)

    return jax.jit(fill)


def random_tree(tree, seed: int = 0):
    """Device arrays with the shapes and dtypes of an abstract tree, leaf by leaf (peak: one leaf's temporaries)."""
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for i, a in enumerate(leaves):
        out.append(_filler(tuple(a.shape), jnp.dtype(a.dtype).name)(jnp.uint32(seed * 7919 + i)))
    jax.block_until_ready(out)
    return jax.tree.unflatten(treedef, out)


def rel_err(got, ref) -> tuple[float, float]:
    """(max |got - ref|, that / max |ref|) over finite-compared float32 values."""
    g = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    r = np.asarray(jnp.asarray(ref).astype(jnp.float32), np.float64)
    err = float(np.max(np.abs(g - r))) if g.size else 0.0
    mag = float(np.max(np.abs(r))) if r.size else 0.0
    return err, err / max(mag, 1e-30)


# ---------------------------------------------------------------------------------------------- configs

def tiny_e2b() -> ModelConfig:
    cfg = ModelConfig.from_hf(_g4(256, 4, 2, 1, None, 512, 2, 64, ple=64, shared=2, double=True), name="tiny-e2b")
    return cfg.replace(vocab_size=1024, ple_vocab_size=1024)


def tiny_26b() -> ModelConfig:
    cfg = ModelConfig.from_hf(_g4(256, 2, 4, 2, 1, 320, 2, 64, k_eq_v=True, moe=(8, 2, 64)), name="tiny-26b")
    return cfg.replace(vocab_size=1024)


_ABSTRACT: dict = {}
_ABSTRACT_LOCK = threading.Lock()


def abstract_weights(cfg: ModelConfig, quant: str):
    with _ABSTRACT_LOCK:
        key = (cfg, quant)
        if key not in _ABSTRACT:
            _ABSTRACT[key] = aot.abstract_model_weights(cfg, quant)
        return _ABSTRACT[key]


# ---------------------------------------------------------------------------------------------- whole-model programs

@dataclasses.dataclass(frozen=True)
class Prog:
    """One compiled step: `streams` decode sequences at `context` tokens (T = S = streams, the engine's all-decode
    step), or one sequence prefilling `tokens` tokens from position 0 (T = tokens, S = 1)."""

    name: str
    cfg: ModelConfig
    quant: str
    spec: RunnerSpec
    kind: str  # "decode" | "prefill"
    streams: int = 1
    context: int = 0
    tokens: int = 0


def make_spec(cfg: ModelConfig, num_pages: tuple[int, ...], kv: str, max_model_len: int, impl: str) -> RunnerSpec:
    return RunnerSpec(cfg, kv_groups(cfg), PAGE, tuple(num_pages), math.ceil(max_model_len / PAGE), kv,
                      attn_impl=impl)


def tables_for(spec: RunnerSpec, seqs: int, need: int) -> tuple[list, bool]:
    """Per sequence, per group, `need` page ids; wraps around the group's pages (null page 0 excluded) when the
    cache has fewer than seqs x need. Returns (tables, wrapped)."""
    out, wrapped = [], False
    for i in range(seqs):
        per = []
        for n in spec.num_pages:
            avail = n - 1
            wrapped |= seqs * need > avail
            per.append([1 + (i * need + j) % avail for j in range(need)])
        out.append(per)
    return out, wrapped


def prog_inputs(p: Prog):
    """numpy StepInputs of a program (deterministic: the precompile and the run build the same)."""
    rng = np.random.default_rng(1234 + p.streams)
    vocab = p.cfg.vocab_size
    if p.kind == "decode":
        need = math.ceil((p.context + 1) / PAGE)
        tables, _ = tables_for(p.spec, p.streams, need)
        ids = rng.choice(np.arange(3, vocab), size=p.streams, replace=False)
        entries = [([int(ids[i])], p.context, 1, tables[i]) for i in range(p.streams)]
        return build_step_inputs(p.spec, entries, p.streams, p.streams)
    need = math.ceil(p.tokens / PAGE)
    tables, _ = tables_for(p.spec, 1, need)
    ids = rng.integers(3, vocab, size=p.tokens)
    return build_step_inputs(p.spec, [(ids, 0, p.tokens, tables[0])], p.tokens, 1)


def pages_wrapped(p: Prog) -> bool:
    need = math.ceil((p.context + 1) / PAGE) if p.kind == "decode" else math.ceil(p.tokens / PAGE)
    return tables_for(p.spec, p.streams if p.kind == "decode" else 1, need)[1]


def _step(w, kv, inp, *, spec):
    return model_step(w, spec, kv, inp, greedy=True, hidden=True)


def step_jit(spec: RunnerSpec):
    return jax.jit(functools.partial(_step, spec=spec), donate_argnums=(1,))


def compile_prog(p: Prog):
    t = time.perf_counter()
    lowered = step_jit(p.spec).lower(abstract_weights(p.cfg, p.quant), abstract_caches(p.spec), prog_inputs(p))
    t_low = time.perf_counter() - t
    compiled = lowered.compile()
    log(f"  compiled {p.name}: lowering {t_low:.1f} s + compile {time.perf_counter() - t - t_low:.1f} s")
    return compiled


class _Quiet:
    """Background compiles share it, a timed loop holds it alone: lowering is Python and holds the interpreter's
    lock, which stalled the timing loop's dispatches (2026-12-04: fp8 26B-A4B steps timed at 53-223 ms beside
    compiles, 15.3 / 53.5 ms alone; docs/device_tpu_v5e_fp8_2026-12-04.log). A timing waits (until the deadline) for
    the compiles in flight; no compile starts while a timing waits or runs; compiles still run side by side."""

    def __init__(self):
        self.cv = threading.Condition()
        self.compiles = 0
        self.timing = 0  # timings waiting or running

    @contextlib.contextmanager
    def compiling(self):
        with self.cv:
            self.cv.wait_for(lambda: self.timing == 0)
            self.compiles += 1
        try:
            yield
        finally:
            with self.cv:
                self.compiles -= 1
                self.cv.notify_all()

    @contextlib.contextmanager
    def timed(self):
        with self.cv:
            self.timing += 1
            quiet = self.cv.wait_for(lambda: self.compiles == 0, timeout=max(0.0, CLOCK.left()))
        if not quiet:
            log("    timed beside a compile still running at the deadline")
        try:
            yield
        finally:
            with self.cv:
                self.timing -= 1
                self.cv.notify_all()


QUIET = _Quiet()


class Precompiler:
    """Compiles programs in daemon threads, in submission order; `get` waits (bounded) for one."""

    def __init__(self, workers: int):
        self.q: queue.Queue = queue.Queue()
        self.jobs: dict[str, dict] = {}
        for _ in range(max(1, workers)):
            threading.Thread(target=self._work, daemon=True).start()

    def submit(self, p: Prog) -> None:
        if p.name in self.jobs:
            return
        job = {"event": threading.Event(), "result": None, "error": None}
        self.jobs[p.name] = job
        self.q.put((p, job))

    def _work(self) -> None:
        while True:
            p, job = self.q.get()
            if CLOCK.over(5):
                job["error"] = TimeoutError(f"compile of {p.name} not started: deadline")
            else:
                try:
                    with QUIET.compiling():
                        job["result"] = compile_prog(p)
                except BaseException as e:  # noqa: BLE001 -- handed to whoever waits for it
                    job["error"] = e
                    log(f"  compile of {p.name} FAILED: {type(e).__name__}: {str(e)[:300]}")
            job["event"].set()

    def get(self, p: Prog, wait: float | None = None):
        """The compiled program, waiting at most `wait` seconds (default: until the deadline)."""
        self.submit(p)
        job = self.jobs[p.name]
        limit = max(0.0, CLOCK.left() if wait is None else min(wait, CLOCK.left()))
        if not job["event"].is_set():
            log(f"  waiting for the compile of {p.name} (at most {limit:.0f} s)")
        if not job["event"].wait(limit):
            raise TimeoutError(f"compile of {p.name} not finished within {limit:.0f} s")
        if job["error"] is not None:
            raise job["error"]
        return job["result"]


def run_steps(compiled, weights, kv, inp, steps: int, warmup: int = 2):
    """(seconds per step, kv, tokens, hidden) of a compiled step; the first call's time is logged."""
    t = time.perf_counter()
    (tok, h), kv = compiled(weights, kv, inp)
    jax.block_until_ready(tok)
    log(f"    first step {1e3 * (time.perf_counter() - t):.1f} ms")
    with QUIET.timed():  # no compile runs beside the timed steps
        for _ in range(warmup):
            (tok, h), kv = compiled(weights, kv, inp)
        jax.block_until_ready(tok)
        t = time.perf_counter()
        for _ in range(steps):
            (tok, h), kv = compiled(weights, kv, inp)
        jax.block_until_ready((tok, h))
        dt = (time.perf_counter() - t) / max(1, steps)
    return dt, kv, tok, h


def finite_check(h, rows: int) -> bool:
    return bool(jnp.all(jnp.isfinite(h[:rows].astype(jnp.float32))))


def kv_alive(kv) -> bool:
    return all(not a.is_deleted() for a in jax.tree.leaves(kv))


# ---------------------------------------------------------------------------------------------- 2. kernel correctness

def _stored(x: np.ndarray, dt, scale: float) -> np.ndarray:
    """The float32 value a page of dtype dt stores for x (clip to the fp8 range, round to the dtype)."""
    y = x.astype(np.float32) / np.float32(scale)
    if jnp.dtype(dt).itemsize == 1:
        fmax = float(jnp.finfo(dt).max)
        y = np.clip(y, -fmax, fmax)
    return y.astype(jnp.dtype(dt)).astype(np.float32)  # ml_dtypes: round to nearest even, on the host


def attention_case(rng, seqs, *, n, nk, h, dtype, window, k_scale, v_scale, t_pad, s_max, p_max, decode_only):
    """A ragged step over a paged cache (numpy on the host). Unused slots and pages, pages wholly before every query's
    window and the page-table entries past a sequence's pages (all pointing at page 1) hold NaN, so that any read of
    them shows in the output. Returns device args, the oracle's data and the real token count."""
    dt = resolve_kv_dtype(dtype)
    q_lens = [ql for _, ql in seqs]
    kv_lens = [c + ql for c, ql in seqs]
    need = [-(-kv // PAGE) for kv in kv_lens]
    num_pages = 2 + sum(need) + 2
    perm = rng.permutation(np.arange(2, num_pages))
    pages = np.full((num_pages, 2 * nk, PAGE, h), np.nan, np.float32)
    pages[0] = 0.0
    q = np.full((t_pad, n, h), np.nan, np.float32)
    k_new = np.full((t_pad, nk, h), np.nan, np.float32)
    v_new = np.full((t_pad, nk, h), np.nan, np.float32)
    tables, k_full, v_full = [], [], []
    at = t0 = 0
    for s, (cached, ql) in enumerate(seqs):
        kv_len = cached + ql
        bf = lambda a: a.astype(jnp.dtype(jnp.bfloat16)).astype(np.float32)
        k = bf(rng.standard_normal((kv_len, nk, h)) * 2.0)
        v = bf(rng.standard_normal((kv_len, nk, h)) * 2.0)
        table = perm[at:at + need[s]]
        at += need[s]
        pos = np.arange(cached)
        pg, off = table[pos // PAGE], pos % PAGE
        pages[pg, 0::2, off] = _stored(k[:cached], dt, k_scale)
        pages[pg, 1::2, off] = _stored(v[:cached], dt, v_scale)
        q[t0:t0 + ql] = bf(rng.standard_normal((ql, n, h)) * 2.0)
        k_new[t0:t0 + ql] = k[cached:]
        v_new[t0:t0 + ql] = v[cached:]
        k_full.append(_stored(k, dt, k_scale).astype(np.float64) * k_scale)
        v_full.append(_stored(v, dt, v_scale).astype(np.float64) * v_scale)
        if window is not None:
            for lp in range(max(0, cached - window + 1) // PAGE):  # out of every query's window: freed
                pages[table[lp]] = np.nan
        tables.append([int(x) for x in table] + [1] * (p_max - len(table)))
        t0 += ql
    meta = make_ragged_meta(q_lens, kv_lens, tables, max_num_seqs=s_max, pages_per_seq=p_max)
    if decode_only:
        meta = dataclasses.replace(meta, decode_only=True)
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k_new, jnp.bfloat16), jnp.asarray(v_new, jnp.bfloat16),
            jnp.asarray(pages).astype(dt), meta)
    return args, (q, k_full, v_full, q_lens, kv_lens), t0


def naive_attention(oracle, *, sm_scale, window) -> np.ndarray:
    """Dense per-sequence attention in float64 over the K/V as they read back from the cache: [T_real, N, H]."""
    q, k_full, v_full, q_lens, kv_lens = oracle
    n = q.shape[1]
    g = n // k_full[0].shape[1]
    outs, t0 = [], 0
    for s, ql in enumerate(q_lens):
        qs = q[t0:t0 + ql].astype(np.float64).transpose(1, 0, 2)  # [N, Q, H]
        k = np.repeat(k_full[s], g, axis=1).transpose(1, 2, 0)  # [N, H, L]
        v = np.repeat(v_full[s], g, axis=1).transpose(1, 0, 2)  # [N, L, H]
        sc = (qs @ k) * sm_scale  # [N, Q, L]
        qpos = kv_lens[s] - ql + np.arange(ql)
        kpos = np.arange(kv_lens[s])
        mask = kpos[None, :] <= qpos[:, None]
        if window is not None:
            mask &= qpos[:, None] - kpos[None, :] < window
        sc = np.where(mask[None], sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        outs.append((p @ v).transpose(1, 0, 2))
        t0 += ql
    return np.concatenate(outs, 0)


def check_attention(a, kimpl: str) -> None:
    """Ragged paged attention: the kernel against the jnp reference (output and written pages), the reference
    against a float64 oracle. Tolerance 2e-2 of max |ref|: q, K, V and the probabilities enter the kernel's matmuls in
    bf16 (p rounded to bf16 is 2^-9 relative; K/V values up to ~4.5 sigma = 9 against outputs of a few units), the
    reference keeps p in float32; tests/kv/test_attention.py holds the kernel to 3e-2 absolute of a float64 oracle at
    the same amplitude (values ~N(0, 2)). Written pages: bit-identical (both quantize the same K/V the same way)."""
    rng = np.random.default_rng(7)
    if a.tiny:
        w_sl, p_max = 32, 16
        mixed_a = [(70, 1), (5, 1), (0, 20), (30, 9), (100, 1)]
        mixed_b = [(40, 1), (0, 13), (90, 1), (20, 6)]
        dec = [(int(c), 1) for c in rng.integers(0, 120, 4)]
        heads = ((4, 2, 128), (4, 1, 256))
        t_mixed = 48
    else:
        w_sl, p_max = 1024, a.max_model_len // PAGE
        mixed_a = [(1500, 1), (40, 1), (0, 200), (700, 300), (2100, 1), (5, 1), (1023, 1), (300, 37)]
        mixed_b = [(900, 1), (0, 130), (33, 1), (2000, 1), (400, 64), (7, 1)]
        dec = [(int(c), 1) for c in rng.integers(0, 3000, 16)]
        heads = ((16, 8, 256), (16, 2, 512))
        t_mixed = 560
    (n_a, k_a, h_a), (n_b, k_b, h_b) = heads
    cases = [
        # name, seqs, (N, K, H), kv dtype, window, decode_only
        (f"mixed H={h_a} N/K={n_a}/{k_a} W={w_sl} bf16", mixed_a, heads[0], "bf16", w_sl, False),
        (f"mixed H={h_a} N/K={n_a}/{k_a} W={w_sl} fp8_e4m3", mixed_a, heads[0], "fp8_e4m3", w_sl, False),
        (f"mixed H={h_b} N/K={n_b}/{k_b} full bf16", mixed_b, heads[1], "bf16", None, False),
        (f"mixed H={h_b} N/K={n_b}/{k_b} full fp8_e4m3", mixed_b, heads[1], "fp8_e4m3", None, False),
        (f"decode-only x{len(dec)} H={h_a} W={w_sl} bf16", dec, heads[0], "bf16", w_sl, True),
        (f"decode-only x{len(dec)} H={h_b} full fp8_e4m3", dec, heads[1], "fp8_e4m3", None, True),
    ]
    tol = 2e-2
    for name, seqs, (n, nk, h), dt, window, dec_only in cases:
        if CLOCK.over(20):
            record("2.attn", name, "skipped: deadline", "SKIP")
            continue
        t = now()
        ks, vs = (0.5, 2.0) if dt.startswith("fp8") else (1.0, 1.0)
        t_pad = len(seqs) if dec_only else t_mixed
        s_max = len(seqs) if dec_only else 16
        args, oracle, t_real = attention_case(rng, seqs, n=n, nk=nk, h=h, dtype=dt, window=window, k_scale=ks,
                                              v_scale=vs, t_pad=t_pad, s_max=s_max, p_max=p_max,
                                              decode_only=dec_only)
        kw = {"sm_scale": h ** -0.5, "sliding_window": window, "k_scale": ks, "v_scale": vs}
        out_k, pages_k = jax.jit(functools.partial(ragged_paged_attention, impl=kimpl, **kw))(*args)
        out_r, pages_r = jax.jit(functools.partial(ragged_paged_attention, impl="ref", **kw))(*args)
        jax.block_until_ready((out_k, out_r, pages_k, pages_r))
        err, rel = rel_err(out_k[:t_real], out_r[:t_real])
        pad_zero = bool(jnp.all(out_k[t_real:] == 0))
        finite = bool(jnp.all(jnp.isfinite(out_k[:t_real].astype(jnp.float32))))
        pk = np.asarray(pages_k.astype(jnp.float32))
        pr = np.asarray(pages_r.astype(jnp.float32))
        same_pages = bool(np.array_equal(pk, pr, equal_nan=True))
        want = naive_attention(oracle, sm_scale=h ** -0.5, window=window)
        _, rel_o = rel_err(out_r[:t_real], want)
        ok = rel <= tol and pad_zero and finite and same_pages
        record("2.attn", name,
               f"kernel vs ref: max abs {err:.3e}, rel {rel:.2e} (tol {tol:g}); padding rows zero {pad_zero}; finite "
               f"{finite}; written pages bit-identical {same_pages}; ref vs float64 oracle rel {rel_o:.2e} "
               f"(tol {tol:g}: {verdict(rel_o <= tol)}); {now() - t:.1f} s", verdict(ok and rel_o <= tol))
        del args, out_k, out_r, pages_k, pages_r


def _normal(shape, seed: int, scale: float = 1.0, dtype=jnp.float32):
    return jax.jit(lambda k: (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype),
                   )(jax.random.key(seed))


def check_matmuls(a, interpret) -> None:
    """int8 (w8a8) and int4 (w4a16) kernels against their jnp references, weights quantized by the loaders'
    Quantizer (so act_group / padding are the engine's), bf16 activations. Tolerance 8e-3 of max |ref|: both sum in
    float32 (in different orders) and round once to bf16, so an element may land on the neighbouring bf16 value,
    one ulp <= 2^-7 of itself (tests/quant: int8 per token bit-identical, int4 < 2^-8, gmm 8e-3)."""
    if a.tiny:
        hidden, mlp, qdim, vocab = 256, 320, 512, 1024
    else:
        hidden, mlp, qdim, vocab = 2816, 2112, 16 * 256, 262144
    shapes = [("q_proj", "model.layers.0.self_attn.q_proj.weight", qdim, hidden),
              ("gate_proj", "model.layers.0.mlp.gate_proj.weight", mlp, hidden),
              ("down_proj", "model.layers.0.mlp.down_proj.weight", hidden, mlp)]
    kernels = {"int8": (functools.partial(int8_matmul_pallas, interpret=interpret), int8_matmul_ref, "w8a8"),
               "int4": (functools.partial(int4_matmul_pallas, interpret=interpret), int4_matmul_ref, "w4a16")}
    tol = 8e-3
    seed = 10
    for kind, (kern, ref, quant) in kernels.items():
        for pname, hf, out_f, in_f in shapes:
            w = _normal((out_f, in_f), seed, 0.05)
            q = jax.jit(lambda w, hf=hf, quant=quant: Quantizer(quant)(hf, w))(w)
            del w
            for m in (16, 512):
                if CLOCK.over(15):
                    record("2.matmul", f"{kind} {pname} M={m}", "skipped: deadline", "SKIP")
                    continue
                seed += 1
                x = _normal((m, in_f), seed, 1.0, jnp.bfloat16)
                yk = jax.jit(kern)(x, q)
                yr = jax.jit(ref)(x, q)
                err, rel = rel_err(yk, yr)
                diff = int(jnp.sum(yk != yr))
                ag = f", act_group {q.act_group}" if kind == "int8" else f", group {q.group}"
                record("2.matmul", f"{kind} {pname} [{out_f}x{in_f}]{ag} M={m}",
                       f"max abs {err:.3e}, rel {rel:.2e} (tol {tol:g}); {diff} of {yk.size} outputs differ",
                       verdict(rel <= tol and bool(jnp.all(jnp.isfinite(yk)))))
            del q
    # the LM head: int4 vocabulary table (+emb4), M = 16
    if CLOCK.over(20):
        record("2.matmul", "int4 LM head M=16", "skipped: deadline", "SKIP")
        return
    w = _normal((vocab, hidden), 99, 0.05)
    q = jax.jit(lambda w: quantize_table(w, 4))(w)
    del w
    x = _normal((16, hidden), 100, 1.0, jnp.bfloat16)
    yk = jax.jit(kernels["int4"][0])(x, q)
    yr = jax.jit(int4_matmul_ref)(x, q)
    err, rel = rel_err(yk, yr)
    diff = int(jnp.sum(yk != yr))
    record("2.matmul", f"int4 LM head table [{vocab}x{hidden}] M=16",
           f"max abs {err:.3e}, rel {rel:.2e} (tol {tol:g}); {diff} of {yk.size} outputs differ",
           verdict(rel <= tol and bool(jnp.all(jnp.isfinite(yk)))))
    del q, yk, yr


def gmm_ref_loop(x, w: QuantArray, group_sizes):
    """gmm_ref's definition (each expert's 2-D reference on all rows, kept where the rows are that expert's) as a
    loop over experts, so that 128 experts compile as one loop body instead of 128 unrolled matmuls."""
    m = x.shape[0]
    ref2d = int8_matmul_ref if w.kind == "int8" else int4_matmul_ref
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    rows = jnp.arange(m, dtype=jnp.int32)

    def body(e, y):
        we = dataclasses.replace(w, values=lax.dynamic_index_in_dim(w.values, e, 0, keepdims=False),
                                 scale=lax.dynamic_index_in_dim(w.scale, e, 0, keepdims=False), shape=w.shape[1:])
        sel = (rows >= starts[e]) & (rows < ends[e])
        return jnp.where(sel[:, None], ref2d(x, we), y)

    return lax.fori_loop(0, w.shape[0], body, jnp.zeros((m, w.out_features), x.dtype))


def routed_sizes(rng, experts: int, rows: int) -> np.ndarray:
    """Uneven rows per expert summing to `rows`: a quarter of the experts empty, the rest Zipf-like."""
    alive = rng.permutation(experts)[: max(1, experts - experts // 4)]
    p = 1.0 / (1.0 + np.arange(len(alive))) ** 0.8
    ids = rng.choice(alive, size=rows, p=p / p.sum())
    return np.bincount(ids, minlength=experts).astype(np.int32)


def check_gmm(a, interpret) -> None:
    """Grouped expert matmul kernel against the reference at 26B-A4B expert shapes (experts quantized by the
    loaders' Quantizer: in padded to EXPERT_PAD_IN), uneven groups with empty experts and 3 NaN padding rows past
    the groups (they must come out 0). Tolerance 8e-3 of max |ref| (tests/quant/test_gmm.py's bf16 tolerance: one
    bf16 rounding of float32 sums taken in another order)."""
    cfg = tiny_26b() if a.tiny else ModelConfig.preset("26b-a4b")
    e, f, d = cfg.num_experts, cfg.moe_dim, cfg.hidden_size
    token_counts = (4, 16) if a.tiny else (16, 512)
    tol = 8e-3
    rng = np.random.default_rng(3)
    for quant, kind in (("w4a16", "int4"), ("w8a8", "int8")):
        for proj, shape in (("gate_up_proj", (e, 2 * f, d)), ("down_proj", (e, d, f))):
            if CLOCK.over(20):
                record("2.gmm", f"{kind} {proj}", "skipped: deadline", "SKIP")
                continue
            w = _normal(shape, 200 + len(proj), 0.05)
            q = jax.jit(lambda w, proj=proj, quant=quant: Quantizer(quant)(f"model.layers.0.experts.{proj}", w))(w)
            del w
            for tokens in token_counts:
                if CLOCK.over(15):
                    record("2.gmm", f"{kind} {proj} {tokens}x{cfg.top_k_experts}", "skipped: deadline", "SKIP")
                    continue
                t = now()
                m = tokens * cfg.top_k_experts
                sizes = routed_sizes(rng, e, m - 3)
                x = np.asarray(rng.standard_normal((m, shape[2])), np.float32)
                x[m - 3:] = np.nan
                x = jnp.asarray(x, jnp.bfloat16)
                gs = jnp.asarray(sizes)
                yk = jax.jit(functools.partial(gmm_pallas, interpret=interpret))(x, q, gs)
                yr = jax.jit(gmm_ref_loop)(x, q, gs)
                err, rel = rel_err(yk[: m - 3], yr[: m - 3])
                pad_zero = bool(jnp.all(yk[m - 3:] == 0))
                finite = bool(jnp.all(jnp.isfinite(yk.astype(jnp.float32))))
                extra = ""
                if a.tiny:  # the loop is gmm_ref's definition: same numbers
                    same = bool(jnp.array_equal(yr, jax.jit(gmm_ref)(x, q, gs), equal_nan=True))
                    extra = f"; loop ref == gmm_ref {same}"
                    finite &= same
                record("2.gmm", f"{kind} {proj} {list(q.shape)} rows {m} ({int((sizes > 0).sum())} experts routed)",
                       f"max abs {err:.3e}, rel {rel:.2e} (tol {tol:g}); padding rows zero {pad_zero}; finite {finite}"
                       f"{extra}; {now() - t:.1f} s", verdict(rel <= tol and pad_zero and finite))
            del q


# ---------------------------------------------------------------------------------------------- 3. kernel speed

def copy_bandwidth(gib: float) -> float:
    n = int(gib * GiB) // 2
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda v: v + jnp.bfloat16(1))
    dt = timeit(f, x, reps=10)
    x.delete()
    return 2 * n * 2 / dt


def bench_linear(out_f: int, in_f: int, m: int, kind: str, min_bytes: int, impl: str) -> tuple[float, int]:
    """Seconds and weight bytes of one y = x @ W.T, over a scan of R distinct weights (R x bytes >= min_bytes)."""
    if kind == "bf16":
        per = out_f * in_f * 2
    elif kind == "int8":
        per = out_f * in_f + out_f * 4
    else:
        per = out_f * in_f // 2 + out_f * (in_f // 32) * 2
    reps = max(1, math.ceil(min_bytes / per))
    x = _normal((m, in_f), 5, 1.0, jnp.bfloat16)
    if kind == "bf16":
        args = (_filler((reps, out_f, in_f), "bfloat16")(jnp.uint32(1)),)

        def body(c, w):
            return c + jnp.sum(linear(x, w[0]).astype(jnp.float32)), None
    elif kind == "int8":
        ag = default_act_group(in_f)
        args = (_filler((reps, out_f, in_f), "int8")(jnp.uint32(2)),
                jnp.full((reps, out_f), 0.01 / 127, jnp.float32))

        def body(c, w):
            q = QuantArray(w[0], w[1], "int8", (out_f, in_f), 0, jnp.bfloat16, ag)
            return c + jnp.sum(linear(x, q, impl=impl).astype(jnp.float32)), None
    else:
        args = (_filler((reps, out_f, in_f // 2), "uint8")(jnp.uint32(3)),
                _filler((reps, out_f, in_f // 32), "bfloat16")(jnp.uint32(4)))

        def body(c, w):
            q = QuantArray(w[0], w[1], "int4", (out_f, in_f), 32, jnp.bfloat16)
            return c + jnp.sum(linear(x, q, impl=impl).astype(jnp.float32)), None

    f = jax.jit(lambda *ws: lax.scan(body, jnp.float32(0), ws)[0])
    dt = timeit(f, *args, reps=3) / reps
    free_tree(args)
    return dt, per


def bench_gmm(cfg: ModelConfig, tokens: int, min_bytes: int, impl: str) -> tuple[float, int, int]:
    """Seconds, bytes read (the routed experts' int4 gate_up blocks) and routed experts of one gmm call of `tokens`
    tokens x top-k (distinct experts per token, uniform), over a scan of R distinct expert stacks."""
    e, f, d, k = cfg.num_experts, cfg.moe_dim, cfg.hidden_size, cfg.top_k_experts
    rng = np.random.default_rng(11)
    ids = np.concatenate([rng.choice(e, size=k, replace=False) for _ in range(tokens)])
    sizes = np.bincount(ids, minlength=e).astype(np.int32)
    routed = int((sizes > 0).sum())
    per_expert = 2 * f * d // 2 + 2 * f * (d // 32) * 2
    reps = max(1, math.ceil(min_bytes / (e * per_expert)))
    # separate stacks called in turn, as the engine's unrolled layers do: a scan over stacked [R, E, N, K] experts
    # copied each slice before the kernel on the chip (116 GB/s measured that way, 253 without; 2026-12-04)
    ws = [(_filler((e, 2 * f, d // 2), "uint8")(jnp.uint32(5 + 2 * r)),
           _filler((e, 2 * f, d // 32), "bfloat16")(jnp.uint32(6 + 2 * r))) for r in range(reps)]
    x = _normal((tokens * k, d), 6, 1.0, jnp.bfloat16)
    gs = jnp.asarray(sizes)

    def run(ws):
        total = jnp.float32(0)
        for v, s in ws:
            q = QuantArray(v, s, "int4", (e, 2 * f, d), 32, jnp.bfloat16)
            total = total + jnp.sum(gmm(x, q, gs, impl=impl).astype(jnp.float32))
        return total

    dt = timeit(jax.jit(run), ws, reps=3) / reps
    free_tree(ws)
    return dt, routed * per_expert, routed


def item_speed(a, kimpl: str) -> None:
    peak = a.peak_bw
    copy_bw = copy_bandwidth(0.01 if a.tiny else 2.0)
    record("3.speed", "copy x + 1 (bf16, read + write)",
           f"{copy_bw / 1e9:.0f} GB/s = {100 * copy_bw / peak:.0f}% of {peak / 1e9:.0f} GB/s")
    big = 256 * 1024 if a.tiny else 512 * MiB
    if a.tiny:
        shapes = [("q_proj", 512, 256, (1, 16)), ("down_proj", 256, 320, (16,)), ("LM head", 1024, 256, (16,))]
    else:
        shapes = [("q_proj", 4096, 2816, (1, 16)), ("down_proj", 2816, 2112, (1, 16)),
                  ("LM head", 262144, 2816, (16,))]
    for name, o, i, ms in shapes:
        for kind in ("bf16", "int8", "int4"):
            for m in ms:
                what = f"{kind} {name} [{o}x{i}] M={m}"
                if CLOCK.over(10):
                    record("3.speed", what, "skipped: deadline", "SKIP")
                    continue
                try:
                    dt, nbytes = bench_linear(o, i, m, kind, big, kimpl)
                except Exception as e:  # noqa: BLE001
                    record("3.speed", what, f"{type(e).__name__}: {str(e)[:200]}", "ERROR")
                    continue
                record("3.speed", what, f"{dt * 1e6:.1f} us, {nbytes / 1e6:.1f} MB of weights -> "
                       f"{nbytes / dt / 1e9:.0f} GB/s = {100 * nbytes / dt / peak:.0f}% of {peak / 1e9:.0f}")
    cfg = tiny_26b() if a.tiny else ModelConfig.preset("26b-a4b")
    tokens = 4 if a.tiny else 16
    what = f"gmm int4 gate_up {tokens} tokens x top-{cfg.top_k_experts}"
    if CLOCK.over(10):
        record("3.speed", what, "skipped: deadline", "SKIP")
        return
    dt, nbytes, routed = bench_gmm(cfg, tokens, big, kimpl)
    record("3.speed", what, f"{dt * 1e6:.1f} us, {routed} of {cfg.num_experts} experts routed, {nbytes / 1e6:.1f} MB "
           f"-> {nbytes / dt / 1e9:.0f} GB/s = {100 * nbytes / dt / peak:.0f}% of {peak / 1e9:.0f}")


# ---------------------------------------------------------------------------------------------- 4 / 5. whole model

class Plans:
    """Every whole-model program of the run (the same objects are precompiled and run)."""

    def __init__(self, a):
        self.a = a
        impl = a.attn_impl
        mml = a.max_model_len
        # 26B-A4B
        self.cfg26 = tiny_26b() if a.tiny else ModelConfig.preset("26b-a4b")
        self.quant26 = a.quant_26b
        try:
            abstract_weights(self.cfg26, self.quant26)
        except Exception as e:  # noqa: BLE001
            log(f"abstract_model_weights refuses {self.quant26!r} ({e}); using 'w4a16+emb4'")
            self.quant26 = "w4a16+emb4"
        budget = int(a.kv_gib_26b * GiB)
        self.kv26 = a.kv_26b
        self.plan26 = {dt: aot.plan_kv(self.cfg26, budget, max_model_len=mml, chunk=a.chunk, page_size=PAGE,
                                       kv_dtype=dt) for dt in {self.kv26, "bf16"}}
        self.streams26 = (1, 4) if a.tiny else (1, 16)
        ctx = a.context
        s26 = {dt: make_spec(self.cfg26, p.num_pages, dt, mml, impl) for dt, p in self.plan26.items()}
        self.spec26 = s26
        self.d26 = {s: Prog(f"26b {self.quant26} {self.kv26} decode x{s}", self.cfg26, self.quant26, s26[self.kv26],
                            "decode", streams=s, context=ctx) for s in self.streams26}
        big = self.streams26[-1]
        self.mem_decode = Prog(f"26b {self.quant26} bf16 (planner cache) decode x{big}", self.cfg26, self.quant26,
                               s26["bf16"], "decode", streams=big, context=ctx)
        self.mem_prefill = Prog(f"26b {self.quant26} bf16 (planner cache) prefill {a.prefill}", self.cfg26,
                                self.quant26, s26["bf16"], "prefill", tokens=a.prefill)
        self.d26_bf16_1 = Prog(f"26b {self.quant26} bf16 decode x1", self.cfg26, self.quant26, s26["bf16"], "decode",
                               streams=1, context=ctx)
        # E2B: one cache for every stream count
        self.cfge = tiny_e2b() if a.tiny else ModelConfig.preset("e2b")
        self.streamse = (1, 4, 8) if a.tiny else (1, 16, 64)
        need = 1 + max(self.streamse) * math.ceil((ctx + 1) / PAGE)
        self.spece = make_spec(self.cfge, (need,) * len(kv_groups(self.cfge)), "bf16", mml, impl)
        self.quantse = ("none", "w8a8+emb4")
        self.de = {(q, s): Prog(f"e2b {q} bf16 decode x{s}", self.cfge, q, self.spece, "decode", streams=s,
                                context=ctx) for q in self.quantse for s in self.streamse}
        self.pe = Prog(f"e2b none prefill {a.prefill}", self.cfge, "none", self.spece, "prefill", tokens=a.prefill)

    def in_order(self, want) -> list[Prog]:
        out = []
        if want("26b"):
            out += [self.d26[s] for s in self.streams26]
        if want("mem"):
            out += [self.mem_decode, self.mem_prefill]
        if want("26b"):
            out.append(self.d26_bf16_1)
        if want("e2b"):
            out += [self.de[(q, s)] for q in self.quantse for s in self.streamse] + [self.pe]
        return out


def vs_anchor(ours: float, anchor: float) -> str:
    if math.isnan(anchor):  # --tiny: no anchor
        return "vLLM-TPU anchor: n/a (tiny)"
    r = ours / anchor
    return f"vLLM-TPU {anchor:g} tok/s -> ratio {r:.2f}x ({'ahead of' if r >= 1 else 'behind'} vLLM-TPU)"


def roofline(cfg, abstract, streams: int, context: int, kv: str, peak: float) -> tuple[float, float]:
    """(bytes one decode step reads, the tokens/s a step bound by `peak` bytes/s would give) -- a projection."""
    w, per_seq = aot.decode_bytes_read(cfg, abstract, streams, context + 1, kv)
    total = w + streams * per_seq
    return total, streams * peak / total


def routing_spread(weights, cfg: ModelConfig, inp) -> str:
    """Distinct experts layer 0's router picks for the step's tokens from their embeddings alone (informational)."""
    mw = weights.layers[0].moe
    x = take_rows(weights.embed, jnp.asarray(inp.token_ids), jnp.bfloat16)
    r = gemma.rms_norm(x, None, cfg.rms_norm_eps)
    r = gemma.scale(r * mw.router_scale.astype(r.dtype), cfg.hidden_size ** -0.5)
    _, top_i = lax.top_k(linear(r, mw.router_proj).astype(jnp.float32), cfg.top_k_experts)
    n = len(np.unique(np.asarray(top_i)))
    s, e, k = x.shape[0], cfg.num_experts, cfg.top_k_experts
    return (f"layer-0 router (embeddings only) sends {s} tokens to {n} distinct experts (uniform routing: "
            f"{e * (1 - (1 - k / e) ** s):.0f})")


def item_26b(a, plans: Plans, pre: Precompiler, want) -> None:
    """4b (decode at 1 / 16 streams, the KV dtype asked), 5 (memory with the planner's bf16 cache) and 4c (prefill)
    with one set of 26B weights resident."""
    cfg, quant = plans.cfg26, plans.quant26
    abstract = abstract_weights(cfg, quant)
    wbytes = aot.tree_bytes(abstract)
    log(f"building random {cfg.name} weights, quant {quant}: {wbytes / GiB:.2f} GiB; {mem_line()}")
    t = now()
    weights = random_tree(abstract)
    log(f"  built in {now() - t:.1f} s; {mem_line()}")
    try:
        if want("26b"):
            run_item("4b", f"26B-A4B {quant} decode, KV {plans.kv26}", lambda: _decode_26b(a, plans, pre, weights,
                                                                                         abstract), need=20)
        if want("mem"):
            run_item("5", "26B-A4B memory with the planner's bf16 KV cache", lambda: _memory_26b(
                a, plans, pre, weights, abstract), need=20)
        if want("26b"):
            run_item("4b", "26B-A4B decode x1, KV bf16 (if time allows)", lambda: _decode_26b_bf16_one(
                a, plans, pre, weights, abstract), need=30)
    finally:
        free_tree(weights)
        gc.collect()


def _decode_26b(a, plans: Plans, pre: Precompiler, weights, abstract) -> None:
    cfg, spec = plans.cfg26, plans.spec26[plans.kv26]
    plan = plans.plan26[plans.kv26]
    log(f"  KV cache {plans.kv26}: pages per group {dict(zip(plan.groups, spec.num_pages))}, "
        f"{spec.cache_bytes() / GiB:.3f} GiB (aot.plan_kv of {a.kv_gib_26b} GiB)")
    kv = alloc_caches(spec)
    try:
        for s in plans.streams26:
            p = plans.d26[s]
            what = f"26B-A4B {plans.quant26} KV {plans.kv26} x{s} ctx {a.context}"
            if CLOCK.over(10):
                record("4b", what, "skipped: deadline", "SKIP")
                continue
            try:
                compiled = pre.get(p)
                inp_np = prog_inputs(p)
                if s > 1 and cfg.enable_moe:
                    try:
                        log("  " + routing_spread(weights, cfg, inp_np))
                    except Exception as e:  # noqa: BLE001 -- informational only
                        log(f"  routing spread: {type(e).__name__}: {e}")
                if not kv_alive(kv):
                    kv = alloc_caches(spec)
                dt, kv, _, h = run_steps(compiled, weights, kv, jax.device_put(inp_np), a.steps)
            except Exception as e:  # noqa: BLE001
                record("4b", what, f"{type(e).__name__}: {str(e)[:300]}; {mem_line()}", "ERROR")
                continue
            ok = finite_check(h, s)
            nbytes, roof = roofline(cfg, abstract, s, a.context, plans.kv26, a.peak_bw)
            anchor = ANCHORS_26B[plans.streams26.index(s)] if not a.tiny else float("nan")
            wrap = " (pages shared between streams)" if pages_wrapped(p) else ""
            record("4b", what + wrap,
                   f"{s / dt:.1f} tok/s ({dt * 1e3:.2f} ms/step); {vs_anchor(s / dt, anchor)}; "
                   f"roofline PROJECTION {roof:.1f} tok/s ({nbytes / 1e9:.2f} GB/step at "
                   f"{a.peak_bw / 1e9:.0f} GB/s) -> {100 * (s / dt) / roof:.0f}% of it; "
                   f"{nbytes / dt / 1e9:.0f} GB/s; hidden finite {ok}; {mem_line()}", verdict(ok))
    finally:
        free_tree(kv)


def _memory_26b(a, plans: Plans, pre: Precompiler, weights, abstract) -> None:
    spec, plan = plans.spec26["bf16"], plans.plan26["bf16"]
    st = mem_stats()
    log(f"  weights resident; {mem_line()}")
    log(f"  planner's bf16 cache: pages {dict(zip(plan.groups, spec.num_pages))} = {spec.cache_bytes() / GiB:.3f} "
        f"GiB, {plan.tokens} tokens of {a.max_model_len}-token sequences")
    cd = pre.get(plans.mem_decode)
    cp = pre.get(plans.mem_prefill)
    kv = alloc_caches(spec)
    jax.block_until_ready(kv)
    log(f"  cache allocated; {mem_line()}")
    inp_d = jax.device_put(prog_inputs(plans.mem_decode))
    inp_p = jax.device_put(prog_inputs(plans.mem_prefill))
    s = plans.mem_decode.streams
    try:
        dt_d, kv, _, h = run_steps(cd, weights, kv, inp_d, max(3, a.steps // 4))
        ok_d = finite_check(h, s)
        dt_p, kv, _, h = run_steps(cp, weights, kv, inp_p, 3, warmup=1)
        ok_p = finite_check(h, 1)
    except Exception as e:  # noqa: BLE001
        st = mem_stats()
        record("5", f"planner cache {spec.cache_bytes() / GiB:.3f} GiB: decode x{s} + prefill {a.prefill}",
               f"FAILED {type(e).__name__}: {str(e)[:300]}; {mem_line()}", "FAIL")
        free_tree(kv)
        return
    st = mem_stats()
    wrap = " (pages shared between streams)" if pages_wrapped(plans.mem_decode) else ""
    record("5", f"planner cache {spec.cache_bytes() / GiB:.3f} GiB bf16: decode x{s}{wrap} + prefill {a.prefill}",
           f"ran: decode {dt_d * 1e3:.2f} ms/step ({s / dt_d:.1f} tok/s), prefill {dt_p * 1e3:.1f} ms; "
           f"peak_bytes_in_use {st.get('peak_bytes_in_use', 0) / GiB:.3f} GiB of bytes_limit "
           f"{st.get('bytes_limit', 0) / GiB:.3f} GiB; finite {ok_d and ok_p}", verdict(ok_d and ok_p))
    _, roof = roofline(plans.cfg26, abstract, s, a.context, "bf16", a.peak_bw)
    anchor = ANCHORS_26B[-1] if not a.tiny else float("nan")
    record("4b", f"26B-A4B {plans.quant26} KV bf16 x{s} ctx {a.context}{wrap} (item 5's program and cache)",
           f"{s / dt_d:.1f} tok/s ({dt_d * 1e3:.2f} ms/step); {vs_anchor(s / dt_d, anchor)}; "
           f"roofline PROJECTION {roof:.1f} tok/s -> {100 * (s / dt_d) / roof:.0f}%",
           verdict(ok_d))
    record("4c", f"26B-A4B {plans.quant26} prefill {a.prefill} tokens (1 sequence, bf16 KV)",
           f"{dt_p * 1e3:.1f} ms -> {a.prefill / dt_p:.0f} tok/s")
    # grow: ballast beside the cache, the same compiled programs
    step = int(a.grow_mib * MiB)
    ballast, best = [], 0
    best_peak = st.get("peak_bytes_in_use", 0)
    alloc = jax.jit(lambda: jnp.zeros((step,), jnp.uint8))
    err = "growth stopped by --grow-max-steps"
    for i in range(a.grow_max_steps):
        if CLOCK.over(10):
            err = "growth stopped by the deadline"
            break
        try:
            ballast.append(alloc())
            jax.block_until_ready(ballast[-1])
            (tok_d, _), kv = cd(weights, kv, inp_d)
            jax.block_until_ready(tok_d)
            (tok_p, _), kv = cp(weights, kv, inp_p)
            jax.block_until_ready(tok_p)
        except Exception as e:  # noqa: BLE001 -- the limit found
            err = f"+{(i + 1) * step / MiB:.0f} MiB failed: {type(e).__name__}: {str(e)[:300]}"
            break
        best = (i + 1) * step
        st = mem_stats()
        best_peak = st.get("peak_bytes_in_use", 0)
        log(f"  +{best / MiB:.0f} MiB beside the cache: decode + prefill ran; {mem_line()}")
    log(f"  growth: {err}")
    free_tree(ballast)
    ballast.clear()
    st = mem_stats()
    limit = st.get("bytes_limit", 0)
    record("5", "largest KV cache that ran (planner cache + ballast, same programs)",
           f"{(spec.cache_bytes() + best) / GiB:.3f} GiB (planner {spec.cache_bytes() / GiB:.3f} + {best / MiB:.0f} "
           f"MiB); peak_bytes_in_use there {best_peak / GiB:.3f} GiB of bytes_limit {limit / GiB:.3f} GiB "
           f"({100 * best_peak / max(limit, 1):.1f}%); stop: {err}")
    free_tree(kv)


def _decode_26b_bf16_one(a, plans: Plans, pre: Precompiler, weights, abstract) -> None:
    p = plans.d26_bf16_1
    anchor = ANCHORS_26B[0] if not a.tiny else float("nan")
    compiled = pre.get(p, wait=30.0)
    kv = alloc_caches(p.spec)
    try:
        dt, kv, _, h = run_steps(compiled, weights, kv, jax.device_put(prog_inputs(p)), a.steps)
        ok = finite_check(h, 1)
        _, roof = roofline(plans.cfg26, abstract, 1, a.context, "bf16", a.peak_bw)
        record("4b", f"26B-A4B {plans.quant26} KV bf16 x1 ctx {a.context}",
               f"{1 / dt:.1f} tok/s ({dt * 1e3:.2f} ms/step); {vs_anchor(1 / dt, anchor)}; roofline PROJECTION "
               f"{roof:.1f} tok/s -> {100 / dt / roof:.0f}%; hidden finite {ok}", verdict(ok))
    finally:
        free_tree(kv)


def item_e2b(a, plans: Plans, pre: Precompiler) -> None:
    cfg, spec = plans.cfge, plans.spece
    kv = None
    for quant in plans.quantse:
        if CLOCK.over(20):
            record("4a", f"E2B {quant}", "skipped: deadline", "SKIP")
            continue
        abstract = abstract_weights(cfg, quant)
        log(f"building random {cfg.name} weights, quant {quant}: {aot.tree_bytes(abstract) / GiB:.2f} GiB")
        weights = random_tree(abstract)
        try:
            if kv is None or not kv_alive(kv):
                kv = alloc_caches(spec)
            for i, s in enumerate(plans.streamse):
                p = plans.de[(quant, s)]
                if CLOCK.over(10):
                    record("4a", p.name, "skipped: deadline", "SKIP")
                    continue
                try:
                    compiled = pre.get(p)
                    dt, kv, _, h = run_steps(compiled, weights, kv, jax.device_put(prog_inputs(p)), a.steps)
                except Exception as e:  # noqa: BLE001
                    record("4a", p.name, f"{type(e).__name__}: {str(e)[:300]}", "ERROR")
                    if not kv_alive(kv):
                        kv = alloc_caches(spec)
                    continue
                ok = finite_check(h, s)
                anchor = ANCHORS_E2B[quant][i] if not a.tiny else float("nan")
                _, roof = roofline(cfg, abstract, s, a.context, "bf16", a.peak_bw)
                record("4a", f"E2B {quant} x{s} ctx {a.context} bf16 KV",
                       f"{s / dt:.0f} tok/s ({dt * 1e3:.2f} ms/step); {vs_anchor(s / dt, anchor)}; "
                       f"roofline PROJECTION {roof:.0f} tok/s -> "
                       f"{100 * (s / dt) / roof:.0f}%; hidden finite {ok}",
                       verdict(ok))
            if quant == "none" and not CLOCK.over(10):
                try:
                    compiled = pre.get(plans.pe)
                    dt, kv, _, h = run_steps(compiled, weights, kv, jax.device_put(prog_inputs(plans.pe)), 3, 1)
                    record("4c", f"E2B bf16 prefill {a.prefill} tokens (1 sequence)",
                           f"{dt * 1e3:.1f} ms -> {a.prefill / dt:.0f} tok/s; hidden finite {finite_check(h, 1)}",
                           verdict(finite_check(h, 1)))
                except Exception as e:  # noqa: BLE001
                    record("4c", plans.pe.name, f"{type(e).__name__}: {str(e)[:300]}", "ERROR")
                    if not kv_alive(kv):
                        kv = alloc_caches(spec)
        finally:
            free_tree(weights)
            gc.collect()
    if kv is not None:
        free_tree(kv)


# ---------------------------------------------------------------------------------------------- main

ITEMS = ("env", "kernels", "26b", "mem", "e2b", "speed")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="toy shapes, kernels in interpret mode: a CPU smoke test")
    p.add_argument("--deadline", type=float, default=500.0, help="seconds of work after the imports")
    p.add_argument("--grace", type=float, default=20.0, help="the watchdog exits this long after the deadline")
    p.add_argument("--only", default="", help=f"comma list of items to run, of {','.join(ITEMS)}")
    p.add_argument("--skip", default="", help="comma list of items to skip")
    p.add_argument("--context", type=int, default=None, help="decode context per stream (default 1024; tiny 64)")
    p.add_argument("--prefill", type=int, default=None, help="prefill tokens (default 512; tiny 64)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (default 20; tiny 2)")
    p.add_argument("--max-model-len", type=int, default=None, help="page-table width (default 8192; tiny 512)")
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens of the KV planner")
    p.add_argument("--quant-26b", default="qat-w4a16+emb4")
    p.add_argument("--kv-26b", default="fp8_e4m3", help="KV dtype of item 4b")
    p.add_argument("--kv-gib-26b", type=float, default=None,
                   help="KV budget of the 26B caches (default 1.46: docs/fit_table.md, 26b-a4b qat-w4a16+emb4 v5e)")
    p.add_argument("--grow-mib", type=float, default=None, help="item 5 growth step (default 128 MiB)")
    p.add_argument("--grow-max-steps", type=int, default=None, help="item 5 growth steps at most (default 64)")
    p.add_argument("--attn-impl", default="auto", help="attention impl of the whole-model steps")
    p.add_argument("--compile-workers", type=int, default=5, help="background compile threads")
    p.add_argument("--peak-bw", type=float, default=819e9, help="nominal HBM bandwidth, bytes/s (v5e: 819 GB/s)")
    a = p.parse_args(argv)
    t = a.tiny
    a.context = a.context or (64 if t else 1024)
    a.prefill = a.prefill or (64 if t else 512)
    a.steps = a.steps or (2 if t else 20)
    a.max_model_len = a.max_model_len or (512 if t else 8192)
    a.kv_gib_26b = a.kv_gib_26b if a.kv_gib_26b is not None else (0.02 if t else 1.46)
    a.grow_mib = a.grow_mib or (1.0 if t else 128.0)
    a.grow_max_steps = a.grow_max_steps or (2 if t else 64)
    CLOCK.deadline = a.deadline
    only = {s for s in a.only.split(",") if s}
    skip = {s for s in a.skip.split(",") if s}
    bad = (only | skip) - set(ITEMS)
    if bad:
        p.error(f"unknown items {sorted(bad)}; expected {ITEMS}")

    def want(key: str) -> bool:
        return (not only or key in only) and key not in skip

    threading.Thread(target=watchdog, args=(a.deadline + a.grace,), daemon=True).start()
    backend = jax.default_backend()
    on_tpu = backend == "tpu"
    if not t and not on_tpu:
        log(f"backend is {backend!r}, not TPU: run with --tiny for a CPU smoke test")
        return 2
    kimpl = "pallas" if on_tpu else "pallas_interpret"
    interpret = False if on_tpu else pltpu.InterpretParams()

    # 1. environment
    def env():
        dev = jax.devices()[0]
        record("1.env", "jax / backend / device", f"jax {jax.__version__}, backend {backend}, {len(jax.devices())} "
               f"device(s), device_kind {dev.device_kind!r}; kernels impl {kimpl!r}, model attention {a.attn_impl!r}")
        st = mem_stats()
        record("1.env", "memory_stats()", ", ".join(f"{k}={v}" for k, v in sorted(st.items())) if st else "n/a")
    run_item("1.env", "environment", env, enabled=want("env"))

    plans = Plans(a)
    pre = Precompiler(a.compile_workers)
    for prog in plans.in_order(want):  # start compiling the whole-model programs now, in the order they are needed
        pre.submit(prog)
    log(f"submitted {len(pre.jobs)} whole-model compiles to {a.compile_workers} background threads")

    # 2. kernel correctness on the chip
    if want("kernels"):
        run_item("2.attn", "ragged paged attention: pallas vs ref", lambda: check_attention(a, kimpl), need=30)
        run_item("2.matmul", "int8 / int4 matmul kernels vs ref", lambda: check_matmuls(a, interpret), need=20)
        run_item("2.gmm", "grouped expert matmul vs ref", lambda: check_gmm(a, interpret), need=20)
    else:
        record("2", "kernel correctness", "skipped (--skip / --only)", "SKIP")
    # 4b, 5, 4c (26B): one set of weights
    if want("26b") or want("mem"):
        run_item("4b/5", "26B-A4B decode and memory", lambda: item_26b(a, plans, pre, want), need=60)
    # 4a, 4c (E2B)
    run_item("4a", "E2B decode (bf16, w8a8+emb4) and prefill", lambda: item_e2b(a, plans, pre), need=30,
             enabled=want("e2b"))
    # 3. kernel speed
    run_item("3.speed", "kernel speed (weights streamed from HBM)", lambda: item_speed(a, kimpl), need=15,
             enabled=want("speed"))
    print_summary()
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # background compile threads may still run: do not wait for them
