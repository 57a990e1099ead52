"""Side by side on the CPU, one run: gemmajax (bf16 and each quantized mode) vs Hugging Face transformers (the same
weights, bf16 and float32) vs llama.cpp (llama-cpp-python on the Q4_K_M file itself), on the default Gemma 3 270M.

Design choices: every engine configuration runs in its own child process (a clean peak RSS, no shared caches or
thread pools); all engines get the same token ids (prompts cut to --prompt-tokens, so a batch needs no padding),
greedy decoding with EOS ignored; the decode rate is streams x (N - 1) / (t(N new tokens) - t(1 new token)), so
prefill and the first token are excluded, and time to first token is the warm t(1); every configuration runs in
each of --rounds passes and keeps its best figures (on a shared machine a busy spell otherwise decides). Fraction of bandwidth = bytes
read per decode step (weights once, plus the KV cache at the mean context) x steps/s / the bandwidth this script
measures itself (numpy sums over a 1 GB array, one thread per core). The targets against bf16 are judged on a paired
child instead (--paired-rounds, default 4): every gemmajax mode an engine of one process, timed in interleaved rounds,
each mode's rate over bf16's taken within a round and the median kept, since the machine's speed drifts over minutes
and two processes' bests need not share a state. Last, the best 16-stream mode's bare step is timed with and
without its weight GEMMs (child_gemmajax_rest; --no-rest skips it), and that target's line says what the step is made
of and how much the target leaves beyond the GEMMs. The output starts with the CPU (model and matrix features): the
same kind of machine has been an AMD EPYC (Zen 4) and an Intel Xeon with AMX, which rank the modes differently.

    .venv/bin/python bench/compare_cpu.py                            # everything (about 20-30 min on 2 cores)
    .venv/bin/python bench/compare_cpu.py --engines gemmajax --modes none,w8a8+emb8 --new-tokens 32

Measured here on 2026-11-30 (`.venv/bin/python bench/compare_cpu.py`, defaults: 2 rounds, 64 new tokens, 24-token
prompts; 2-core AMD EPYC with AVX-512 bf16 / VNNI, jax 0.10.2, torch 2.13.0, llama-cpp-python 0.3.36; nothing else
of ours running, but the machine's neighbours were busy: the peers moved between rounds and runs):

load average 1.9 -> 1.4; numpy-sum bandwidth 37.4 GB/s (all cores; the BW % columns use it); 24-token prompts, 64 new tokens, greedy

| engine | mode | weights MB | load s | first calls s (1/16) | TTFT ms (1/16) | tok/s 1 | tok/s 16 | BW % 1 | BW % 16 | peak RSS MB |
|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| gemmajax | bf16 | 536 | 4.6 | 5/8 | 43/324 | 50.3 | 257.7 | 72 | 24 | 3298 |
| gemmajax | w8a8 | 437 | 7.7 | 6/11 | 75/515 | 64.1 | 211.8 | 75 | 16 | 3280 |
| gemmajax | w4a16 | 392 | 9.0 | 6/20 | 175/466 | 48.2 | 69.1 | 51 | 5 | 3296 |
| gemmajax | w8a8+emb8 | 270 | 8.1 | 5/10 | 66/509 | 86.7 | 217.8 | 63 | 10 | 3279 |
| gemmajax | w8a8+emb4 | 214 | 9.7 | 6/17 | 72/593 | 48.2 | 85.8 | 28 | 3 | 2967 |
| gemmajax | w4a16+emb8 | 225 | 11.0 | 7/32 | 170/593 | 61.2 | 72.1 | 37 | 3 | 3300 |
| gemmajax | w4a16+emb4 | 170 | 13.5 | 7/35 | 176/677 | 40.8 | 54.4 | 19 | 2 | 3019 |
| transformers | bf16 | 536 | 32.5 | 3/7 | 65/316 | 19.7 | 163.9 | 28 | 15 | 3306 |
| transformers | float32 | 1072 | 31.3 | 7/15 | 139/661 | 9.7 | 72.5 | 28 | 13 | 2668 |
| llama.cpp | Q4_K_M, 2 threads | 247 | 0.5 | 1/- | 49/- | 64.2 | - | 42 | - | 1147 |
| llama.cpp | Q4_K_M, 1 thread | 247 | 0.5 | 1/- | 55/- | 50.0 | - | 33 | - | 1147 |

gemmajax bf16 / transformers bf16 at 1 stream(s): 2.55x (target >= 2x: met)
gemmajax bf16 / transformers bf16 at 16 stream(s): 1.57x (target >= 2x: NOT met)
best quantized gemmajax at 1 stream (w8a8+emb8) / llama.cpp (Q4_K_M, 2 threads): 1.35x (target >= 1x: met)
best quantized gemmajax at 16 streams (w8a8+emb8) / llama.cpp at 1 stream: 3.39x (target >= 4x: NOT met)
best gemmajax mode at 16 streams (bf16) / llama.cpp at 1 stream: 4.01x (target >= 4x: met)
gemmajax w8a8 / transformers bf16: 3.25x at 1, 1.29x at 16
gemmajax w4a16 / transformers bf16: 2.44x at 1, 0.42x at 16
gemmajax w8a8+emb8 / transformers bf16: 4.39x at 1, 1.33x at 16
gemmajax w8a8+emb4 / transformers bf16: 2.44x at 1, 0.52x at 16
gemmajax w4a16+emb8 / transformers bf16: 3.10x at 1, 0.44x at 16
gemmajax w4a16+emb4 / transformers bf16: 2.07x at 1, 0.33x at 16

The peers move from run to run on this shared machine: two earlier full runs (2026-11-29) measured llama.cpp
(2 threads) at 73.0 and 73.6 tok/s, and transformers bf16 at 16 streams has measured 145.7-163.9. This run's
"4.01x: met" rests on llama.cpp's low 64.2 here; against 73.6 the best 16-stream figure is 3.5x. Neither
16-stream target is met.

Why not (bench/gemm_floor.py): every weight GEMM of a 16-stream step, run alone with nothing else, takes 52.2 ms
through XLA:CPU (YNNPACK) and 52.6 ms through torch (oneDNN): a bound of 307 tok/s. 2x transformers' 150-164
tok/s needs a step of 48.8-53.2 ms, at most 1.0 ms beyond the GEMMs (and less than the GEMMs alone when
transformers measures 164); 4x llama.cpp's 73.6 needs 54.4 ms, 2.2 ms beyond them. gemmajax's 16-stream bf16
step takes 62 ms here, 10 ms over its GEMMs (attention about 3.5 ms of it, measured alone). At 16 rows both GEMM
libraries read the 536 MB of weights at about 10 GB/s, a third of the bandwidth (YNNPACK packs each weight into
its kernel layout inside every call: gemm_floor.py has the measurements and what was tried). At 1 stream
gemmajax runs its own one-row form and reads the bf16 weights at 72-90 % of the all-core bandwidth; int4 has no
fast XLA:CPU form (a memory format here).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MODES = ("none", "w8a8", "w4a16", "w8a8+emb8", "w8a8+emb4", "w4a16+emb8", "w4a16+emb4")
SOURCE = ("The old lighthouse keeper climbed the stairs every evening to light the lamp, and on this night he "
          "noticed a small boat drifting toward the rocks. He ran down to the shore with a lantern, shouting to the "
          "sailors, who could not hear him over the wind. Then one of them waved back, and the boat turned slowly "
          "away from the reef, toward the calm water of the harbour where the fishermen kept their nets.")


# ------------------------------------------------------------------------------------------------ shared helpers
def measure_bandwidth(gib: float = 1.0, reps: int = 5) -> tuple[float, float]:
    """Memory-read bandwidth in GB/s over a float32 array of `gib` GB: (one thread, every core), each the best of
    `reps` numpy sums (every core: one thread per core summing its own slice; numpy releases the GIL there)."""
    import concurrent.futures

    import numpy as np
    a = np.ones(int(gib * 1e9) // 4, np.float32)
    a.sum()  # touch every page once
    n = os.cpu_count() or 1
    parts = np.array_split(a, n)
    one = every = float("inf")
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        for _ in range(reps):
            t = time.perf_counter()
            a.sum()
            one = min(one, time.perf_counter() - t)
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            every = min(every, time.perf_counter() - t)
    return a.nbytes / one / 1e9, a.nbytes / every / 1e9


def prompt_ids(n_prompts: int, n_tokens: int) -> list[list[int]]:
    """n_prompts prompts of exactly n_tokens ids each (BOS + a window of SOURCE), all different."""
    import gemmajax
    from gemmajax.model.gguf import default_model_path
    tok = gemmajax.load_tokenizer(default_model_path())
    ids = tok.encode(SOURCE, add_bos=False)
    if len(ids) < n_tokens + n_prompts:
        raise ValueError(f"the source text has {len(ids)} tokens; {n_tokens} + {n_prompts} are needed")
    bos = tok.encode("", add_bos=True)
    return [bos + ids[i:i + n_tokens - len(bos)] for i in range(n_prompts)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def best_of(fn, reps: int) -> float:
    """Minimum wall time of fn() over reps calls."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def decode_figures(run, prompts: list[list[int]], streams: tuple[int, ...], n_new: int, reps: int) -> dict:
    """run(prompts, n) generates n tokens for each prompt. First calls (compiles, warm-up) are timed apart."""
    out = {}
    for s in streams:
        batch = prompts[:s]
        t = time.perf_counter()
        run(batch, 1)
        run(batch, n_new)
        out[f"first_calls_s_{s}"] = time.perf_counter() - t
        out[f"ttft_s_{s}"], out[f"tok_s_{s}"] = decode_rate(run, batch, n_new, reps)
    return out


def decode_rate(run, batch: list[list[int]], n_new: int, reps: int) -> tuple[float, float]:
    """(t(1 new token) s, decode tok/s = streams x (N - 1) / (t(N) - t(1))), each time the best of reps calls."""
    t1 = best_of(lambda: run(batch, 1), reps)
    tn = best_of(lambda: run(batch, n_new), reps)
    return t1, len(batch) * (n_new - 1) / max(tn - t1, 1e-9)


def kv_bytes_per_token(cfg, itemsize: int) -> int:
    """K and V bytes one token adds to the cache (all KV-owning layers)."""
    return sum(2 * cfg.layers[i].num_kv_heads * cfg.layers[i].head_dim * itemsize for i in cfg.kv_layers)


# ------------------------------------------------------------------------------------------------ the engines
def gemmajax_runner(mode: str, args):
    """(the LLM of one quant mode, its run(batch, n)) as every gemmajax child builds them."""
    import gemmajax
    llm = gemmajax.LLM(args.model_path, quant=mode, dtype="bfloat16", kv_dtype="bf16", max_model_len=512,
                       max_num_seqs=max(args.streams), kv_cache_memory=256 << 20, enable_prefix_caching=False)
    params = {n: gemmajax.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, args.new_tokens)}

    def run(batch, n):
        outs = llm.generate(batch, params[n])
        assert all(len(o.token_ids) == n for o in outs), [len(o.token_ids) for o in outs]

    return llm, run


def child_gemmajax(mode: str, prompts, args) -> dict:
    import jax
    t = time.perf_counter()
    llm, run = gemmajax_runner(mode, args)
    load = time.perf_counter() - t
    res = decode_figures(run, prompts, tuple(args.streams), args.new_tokens, args.reps)
    weights = sum(leaf.nbytes for leaf in jax.tree.leaves(llm.engine.runner.weights))  # the engine's copy
    cfg = llm.config
    return {"engine": "gemmajax", "mode": "bf16" if mode == "none" else mode, "load_s": load,
            "weight_bytes": weights, "kv_token_bytes": kv_bytes_per_token(cfg, 2), **res}


def child_transformers(dtype_name: str, prompts, args) -> dict:
    # bench/ is on sys.path (this script runs as bench/compare_cpu.py), and its kernels.py would stand in for the
    # `kernels` package transformers imports when it is installed
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    torch.set_num_threads(os.cpu_count() or 1)
    dtype = {"bf16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    d, name = os.path.split(args.model_path)
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype).eval()
    load = time.perf_counter() - t

    @torch.inference_mode()
    def run(batch, n):
        ids = torch.as_tensor(batch)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + n, out.shape

    res = decode_figures(run, prompts, tuple(args.streams), args.new_tokens, args.reps)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied head counted once
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kv_tok = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * dtype.itemsize
    return {"engine": "transformers", "mode": dtype_name, "load_s": load, "weight_bytes": weights,
            "kv_token_bytes": kv_tok, **res}


def child_llamacpp(threads: str, prompts, args) -> dict:
    """llama.cpp through llama-cpp-python's low-level loop (eval one token, numpy argmax of its logits), which is
    what llama.cpp's own decode costs: the wrapper's `generate` adds Python sampling work per token (5-7x slower
    here). threads: "t1" | "t2" | ... (GGML's OpenMP threads spin: on a busy 2-core machine 1 can beat 2), with
    "+norepack" for llama.cpp's plain weight buffers (model param use_extra_bufts off: no repacking of the weights
    into its AMX / interleaved layouts). The parent retries with it when a child dies of a signal: llama-cpp-python
    0.3.36 built with GGML_NATIVE=ON segfaulted in its first decode on an Intel Xeon with AMX (2026-12-05), and ran
    with its extra buffers off."""
    try:
        import llama_cpp
    except ImportError:
        return {"engine": "llama.cpp", "mode": "Q4_K_M", "skipped": "llama-cpp-python is not installed "
                "(pip install llama-cpp-python builds it from source; about an hour on 2 busy cores)"}
    import numpy as np
    threads, _, plain = threads.partition("+")
    n_threads = int(threads.lstrip("t") or os.cpu_count() or 1)
    if plain:
        if plain != "norepack":
            raise ValueError(f"llama.cpp config: expected t<threads> or t<threads>+norepack, got {threads}+{plain}")
        import llama_cpp.llama as llama_module
        defaults = llama_cpp.llama_model_default_params

        def no_extra_buffers():
            p = defaults()
            p.use_extra_bufts = False
            return p
        llama_module.llama_cpp.llama_model_default_params = no_extra_buffers  # what Llama() builds its params from
    path = args.model_path
    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_batch=64, n_threads=n_threads, verbose=False)
    load = time.perf_counter() - t
    n_vocab = llm.n_vocab()

    def last_logits():  # the C buffer of the last evaluated token (the wrapper's `scores` copy is not needed)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))

    def run(batch, n):
        for p in batch:  # llama-cpp-python decodes one sequence at a time
            llm.reset()
            llm.eval(p)
            for i in range(n):
                tok = int(np.argmax(last_logits()))
                if i + 1 < n:
                    llm.eval([tok])

    streams = tuple(s for s in args.streams if s == 1) or (1,)
    res = decode_figures(run, prompts, streams, args.new_tokens, args.reps)
    import gguf
    reader = gguf.GGUFReader(path)
    weights = sum(int(t.n_bytes) for t in reader.tensors)

    def field(name):
        return int(reader.fields[name].parts[-1][0])

    kv_tok = 2 * field("gemma3.block_count") * field("gemma3.attention.head_count_kv") * \
        field("gemma3.attention.key_length") * 2
    return {"engine": "llama.cpp", "mode": f"Q4_K_M, {n_threads} thread{'s' if n_threads > 1 else ''}"
                                          + (", no weight repacking" if plain else ""),
            "load_s": load, "weight_bytes": weights, "kv_token_bytes": kv_tok, "version": llama_cpp.__version__,
            **res}


def child_gemmajax_paired(modes: str, prompts, args) -> dict:
    """Every mode of `modes` (comma-separated, "none" among them) as an engine of one process, their decode rates
    measured in --paired-rounds interleaved rounds: each round times every engine once per stream count (t(1) and
    t(N) new tokens, the rate as in decode_figures), the engines' order rotated by one each round. A mode's rate
    over bf16's is then taken within each round (paired_ratio): the machine's speed drifts over minutes (its
    memory bandwidth with its neighbours' load: 27.5-47.8 GB/s between runs), and two figures a few seconds apart
    share the drift where two processes' bests do not. Returns {"paired": {mode: {streams: [tok/s per round]}}}."""
    names = [m.strip() for m in modes.split(",") if m.strip()]
    runs = {_mode_name(m): gemmajax_runner(m, args)[1] for m in names}
    streams = tuple(args.streams)
    for run in runs.values():  # compiles and warm-up, untimed
        for s in streams:
            run(prompts[:s], 1)
            run(prompts[:s], args.new_tokens)
    rates: dict[str, dict[str, list[float]]] = {m: {str(s): [] for s in streams} for m in runs}
    order = list(runs)
    for rnd in range(args.paired_rounds):
        for m in order[rnd % len(order):] + order[:rnd % len(order)]:
            for s in streams:
                rates[m][str(s)].append(decode_rate(runs[m], prompts[:s], args.new_tokens, 1)[1])
    return {"engine": "gemmajax-paired", "mode": ",".join(runs), "paired": rates}


def paired_ratio(paired: dict | None, mode: str, s: int) -> tuple[float, float, float] | None:
    """(median, min, max) over the interleaved rounds of `mode`'s tok/s over bf16's in the same round, at s
    streams, from child_gemmajax_paired's "paired"; None without both modes' figures."""
    if not paired:
        return None
    a, b = paired.get(mode, {}).get(str(s)), paired.get("bf16", {}).get(str(s))
    if not a or not b or len(a) != len(b):
        return None
    r = [x / y for x, y in zip(a, b)]
    return statistics.median(r), min(r), max(r)


def gemm_stand_in(x, w, impl="auto"):
    """What `gemma.linear` returns in place of x @ w.T in the rest-of-the-step child: the product's shape and dtype,
    [..., out] in x.dtype, from x's first column times a column ramp. One elementwise expression that XLA fuses
    into whatever reads it, so no weight is read and no GEMM runs, while everything downstream (norms, RoPE,
    attention over the cache, the argmax over the vocabulary) still gets distinct values of the right shape."""
    import jax.numpy as jnp
    from jax import lax
    out = w.shape[-2]  # [out, in], a plain array or a QuantArray's logical shape
    ramp = lax.broadcasted_iota(jnp.float32, (*x.shape[:-1], out), x.ndim - 1) * (1.0 / out)
    return (x[..., :1].astype(jnp.float32) * ramp).astype(x.dtype)


def child_gemmajax_rest(mode: str, prompts, args) -> dict:
    """The decode step of `mode` at the most streams with and without its weight GEMMs, in one process: the bare
    compiled step (the engine's own program, called in a loop on a captured decode step's inputs, no host work
    between calls), then the same after every `gemma.linear` (the layers' projections and the tied LM head) is
    replaced by `gemm_stand_in` and the step recompiled. Timed alternately, --reps x 2 rounds of 20 calls, the best
    kept. The step without its GEMMs is what the GEMM floor leaves out; a target that needs a step of T ms leaves
    T minus the mode's GEMM floor for it. The model's mixture-of-experts GEMMs (gmm) are not replaced (Gemma 3
    has none). Returns {"rest": {"streams", "step_s", "rest_s"}}."""
    import jax

    from gemmajax.engine import runner
    from gemmajax.model import gemma
    s = args.streams[-1]
    captured = {}
    plain_compiled_step = runner.compiled_step

    def capturing(*key, **kw):
        f = plain_compiled_step(*key, **kw)

        def call(weights, kv, inp):
            captured["call"] = (f, weights, inp)
            return f(weights, kv, inp)
        return call
    runner.compiled_step = capturing
    llm, run = gemmajax_runner(mode, args)
    # one step a program, so a generate's decode steps are `compiled_step` calls (their program is what this times)
    llm.engine.config = dataclasses.replace(llm.engine.config, num_scheduler_steps=1)
    eng = llm.engine.runner

    def bare_step():  # compiles; the last call of a generate of --new-tokens is a decode step of s rows
        run(prompts[:s], args.new_tokens)
        f, weights, inp = captured["call"]
        if not (inp.metas[0].decode_only and inp.token_ids.shape[0] == s):
            raise RuntimeError(f"the last step captured is not a decode step of {s} rows: "
                               f"{inp.token_ids.shape[0]} tokens, decode_only={inp.metas[0].decode_only}")

        def steps(n):
            kv, out = eng.kv, None
            for _ in range(n):
                out, kv = f(weights, kv, inp)  # the cache is donated: each call takes the last one's
            jax.block_until_ready(out)
            eng.kv = kv
        return steps
    full = bare_step()
    plain_linear, plain_greedy = gemma.linear, runner.greedy_tokens
    gemma.linear = gemm_stand_in
    # a plain 16-bit table's greedy head multiplies inside greedy_tokens (no `linear`): route it through lm_head
    runner.greedy_tokens = lambda w, cfg, h: runner.greedy_argmax(gemma.lm_head(w, cfg, h))
    runner._compiled_step.cache_clear()
    try:
        rest = bare_step()
    finally:
        gemma.linear, runner.greedy_tokens = plain_linear, plain_greedy
    best = {"step_s": float("inf"), "rest_s": float("inf")}
    for _ in range(2 * args.reps):
        for key, steps in (("step_s", full), ("rest_s", rest)):
            steps(2)
            t = time.perf_counter()
            steps(20)
            best[key] = min(best[key], (time.perf_counter() - t) / 20)
    return {"engine": "gemmajax-rest", "mode": _mode_name(mode), "rest": {"streams": s, **best}}


CHILDREN = {"gemmajax": child_gemmajax, "gemmajax-paired": child_gemmajax_paired, "transformers": child_transformers,
            "llama.cpp": child_llamacpp, "gemmajax-rest": child_gemmajax_rest}


def run_child(args) -> None:
    engine, _, mode = args.child.partition(":")
    with open(args.prompts_file) as fh:
        prompts = json.load(fh)
    res = CHILDREN[engine](mode, prompts, args)
    res["peak_rss_mb"] = peak_rss_mb()
    print("RESULT " + json.dumps(res), flush=True)


# ------------------------------------------------------------------------------------------------ the parent
def configs(args) -> list[str]:
    out = []
    for e in args.engines:
        if e == "gemmajax":
            out += [f"gemmajax:{m}" for m in args.modes]
        elif e == "transformers":
            out += [f"transformers:{d}" for d in args.hf_dtypes]
        elif e == "llama.cpp":
            out += [f"llama.cpp:t{n}" for n in args.llama_threads]
        else:
            raise SystemExit(f"--engines: unknown engine {e!r}; expected gemmajax, transformers, llama.cpp")
    return out


def spawn(cfg: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", cfg, "--new-tokens", str(args.new_tokens),
           "--prompt-tokens", str(args.prompt_tokens), "--reps", str(args.reps), "--model-path", args.model_path,
           "--prompts-file", args.prompts_file, "--paired-rounds", str(args.paired_rounds),
           "--streams", *map(str, args.streams)]
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), TOKENIZERS_PARALLELISM="false")
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-8:]
        why = f"signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}" if p.returncode else "no RESULT"
        return {"engine": cfg.split(":")[0], "mode": cfg.split(":")[1], "error": f"child {why}: " + " | ".join(tail)}
    res = json.loads(lines[-1][len("RESULT "):])
    res["wall_s"] = time.perf_counter() - t
    return res


def bandwidth_fraction(r: dict, s: int, bw_gbs: float, args) -> float | None:
    tok = r.get(f"tok_s_{s}")
    if not tok:
        return None
    ctx = args.prompt_tokens + args.new_tokens / 2  # mean context over the decode
    step_bytes = r["weight_bytes"] + s * ctx * r["kv_token_bytes"]
    return step_bytes * (tok / s) / (bw_gbs * 1e9)


def report(results: list[dict], bw_gbs: float, args, quiet: dict, floor: dict | None,
           kind_floor: dict | None = None, paired: dict | None = None, rest: dict | None = None) -> str:
    head = ("| engine | mode | weights MB | load s | first calls s (1/16) | TTFT ms (1/16) | tok/s 1 | tok/s 16 "
            "| BW % 1 | BW % 16 | peak RSS MB |")
    lines = [f"CPU: {quiet.get('cpu') or cpu_description()}",
             (f"load average {quiet['load_before']:.2f} before the run -> {quiet['load_after']:.2f} after; "
              f"other processes used {100 * quiet['foreign']:.1f} % of the CPUs during the run; numpy-sum bandwidth "
              f"{bw_gbs:.1f} GB/s (all cores; the BW % columns use it); "
              f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, greedy"),
             "", head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in results:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['engine']} | {r['mode']} | {r.get('error') or r.get('skipped')} |")
            continue
        s1, s16 = args.streams[0], args.streams[-1]
        b1, b16 = bandwidth_fraction(r, s1, bw_gbs, args), bandwidth_fraction(r, s16, bw_gbs, args)
        fc = "/".join(f(r.get(f"first_calls_s_{s}"), ".0f") for s in (s1, s16))
        ttft = "/".join(f(None if r.get(f"ttft_s_{s}") is None else 1e3 * r[f"ttft_s_{s}"], ".0f") for s in (s1, s16))
        lines.append(f"| {r['engine']} | {r['mode']} | {r['weight_bytes'] / 1e6:.0f} | {r['load_s']:.1f} | {fc} | "
                     f"{ttft} | {f(r.get(f'tok_s_{s1}'), '.1f')} | {f(r.get(f'tok_s_{s16}'), '.1f')} | "
                     f"{f(None if b1 is None else 100 * b1, '.0f')} | {f(None if b16 is None else 100 * b16, '.0f')} "
                     f"| {r['peak_rss_mb']:.0f} |")
    if floor:
        lines += ["", "GEMM floor (bench/gemm_floor.py, this run: every weight GEMM of a step alone, bf16, XLA:CPU): "
                  + "; ".join(f"{m} rows {1e3 * lay:.1f} + LM head {1e3 * lm:.1f} = {1e3 * (lay + lm):.1f} ms "
                              f"({m / (lay + lm):.0f} tok/s bound)" for m, (lay, lm) in sorted(floor.items()))]
    if kind_floor and len(kind_floor) > 1:
        lines += ["", "GEMM floor by mode (the same, each weight as the mode stores it, through the engine's own "
                  "matmuls; ms at " + " / ".join(str(s) for s in args.streams) + " rows): "
                  + "; ".join(f"{_mode_name(m)} " + " / ".join(f"{1e3 * t:.1f}" if t else "-" for t in
                                                             (mode_floor(kind_floor, m, s) for s in args.streams))
                              for m in MODES)]
    if paired:
        n = len(paired["bf16"][str(args.streams[0])])  # the paired child runs bf16 and every mode each round
        lines += ["", f"paired (every gemmajax mode an engine of one process, {n} interleaved rounds; tok/s at "
                  + " / ".join(str(s) for s in args.streams) + " streams, median of the rounds): "
                  + "; ".join(f"{m} " + " / ".join(f"{statistics.median(by[str(s)]):.1f}" for s in args.streams)
                              for m, by in paired.items())]
    lines += ["", *targets(results, args, quiet, floor, kind_floor, paired, rest)]
    return "\n".join(lines)


def _mode_name(mode: str) -> str:
    return "bf16" if mode == "none" else mode


def _mode_arg(name: str) -> str:
    """`_mode_name`'s inverse: the MODES entry (and --quant value) of a table row's mode."""
    return "none" if name == "bf16" else name


def mode_floor(kind_floor: dict | None, mode: str, rows: int) -> float | None:
    """Seconds the GEMMs of one step of `mode` (MODES: "none", "w8a8" or "w4a16", with "+emb8" / "+emb4") take
    alone at `rows`: its layers' weight kind plus its LM head's, from gemm_floor.measure()'s "xla_kinds"
    ({kind: {rows: (layers s, LM head s)}}); None when a kind or row count was not measured."""
    from gemmajax.quant.quantize import parse_quant
    if not kind_floor:
        return None
    q = parse_quant(mode)
    lay = kind_floor.get(q.linear or "bf16", {})
    head = kind_floor.get({8: "int8", 4: "int4"}.get(q.table_bits, "bf16"), {})
    return lay[rows][0] + head[rows][1] if rows in lay and rows in head else None


def floor_ratio_vs_bf16(kind_floor: dict | None, mode: str, rows: int) -> float | None:
    """bf16's GEMM floor over `mode`'s at `rows`: above 1 when the mode's GEMMs alone are faster. Printed beside the
    mode-against-bf16 targets, not judged: a mode's tok/s over bf16's is (F_bf16 + R) / (F_mode + R) for the same
    rest R of the step, so at most this ratio when it is above 1 and below 1 otherwise; but one process's GEMMs
    differ from the next's by up to 30 % on this machine (the bf16 one-row LM head: 5.9-10.3 ms in fresh
    processes, with transparent huge pages or without), more than most of these ratios' distance from 1."""
    fb, fm = mode_floor(kind_floor, "none", rows), mode_floor(kind_floor, mode, rows)
    return None if not fb or not fm else fb / fm


QUIET_LOAD = 0.5  # a 1-minute load average above this before the run: the figures are not measurements
QUIET_FOREIGN = 0.05  # nor when other processes took more than this share of the CPUs during the run


def quiet_check(load_before: float, foreign: float) -> str | None:
    """None on a quiet machine, else why the run's figures are not measurements."""
    why = []
    if load_before > QUIET_LOAD:
        why.append(f"load {load_before:.2f} before the run (> {QUIET_LOAD})")
    if foreign > QUIET_FOREIGN:
        why.append(f"other processes used {100 * foreign:.1f} % of the CPUs during it (> {100 * QUIET_FOREIGN:.0f} %)")
    return "; ".join(why) or None


def best_gemmajax(results: list[dict], s: int) -> dict | None:
    """The gemmajax row (of a mode that ran) with the most tok/s at s streams: the mode the best-mode targets judge,
    and the one the rest-of-the-step child measures. None without one."""
    ours = [r for r in results if r["engine"] == "gemmajax" and "error" not in r and "skipped" not in r]
    return max(ours, key=lambda r: r.get(f"tok_s_{s}") or 0, default=None)


def rest_note(rest: dict | None, best: dict | None, kind_floor: dict | None, s: int, need_rate: float) -> str:
    """The 16-stream target's account of its step from child_gemmajax_rest (same mode and stream count only):
    the bare step, the mode's GEMM floor and what is left beyond it, the step without its GEMMs, and how much a
    step at `need_rate` tok/s leaves beyond the floor. "" when there is nothing to say."""
    if not rest or not best or rest.get("mode") != best.get("mode") or rest.get("streams") != s:
        return ""
    step, alone = 1e3 * rest["step_s"], 1e3 * rest["rest_s"]
    fl = mode_floor(kind_floor, _mode_arg(best["mode"]), s)
    out = f"; bare step {step:.1f} ms"
    if fl:
        out += f" = GEMM floor {1e3 * fl:.1f} + {step - 1e3 * fl:.1f}"
    out += f"; the step without its GEMMs {alone:.1f} ms"
    if need_rate:
        need = 1e3 * s / need_rate
        out += f"; the target needs a {need:.1f} ms step" + (f", {need - 1e3 * fl:.1f} ms beyond the GEMMs" if fl else "")
    return out


def targets(results: list[dict], args, quiet: dict, floor: dict | None, kind_floor: dict | None = None,
            paired: dict | None = None, rest: dict | None = None) -> list[str]:
    """Issue 16's targets, each with its measured ratio and PASS / FAIL, or 'not judged' when the machine was not
    quiet (quiet_check); then the informational ratios. With the GEMM floors by mode (kind_floor, this run), each
    target also gets its ceiling: the best ratio the modes' GEMMs alone allow (a step is never faster than its GEMMs;
    against a peer: the mode's rate if its step were its GEMMs alone, over the peer's), and a failed target whose
    ceiling is under what it needs says "out of reach with these GEMMs"; the targets against bf16 get the two GEMM
    floors' ratio, printed only (floor_ratio_vs_bf16). With `paired` (child_gemmajax_paired's rates), a target
    against bf16 is judged on the median of the in-round ratios (paired_ratio), the best-of-processes ratio printed
    beside it. With `rest` (child_gemmajax_rest's figures for the best 16-stream mode), that target's line also
    says what its step is made of (rest_note)."""
    ok = {(r["engine"], r["mode"]): r for r in results if "error" not in r and "skipped" not in r}
    s16 = args.streams[-1]
    why = quiet_check(quiet["load_before"], quiet["foreign"])
    rows: list[tuple] = []  # (what, measured ratio or None if missing, needed, ceiling or None, judged by it?, note)

    def rate(r, s):
        return None if r is None else r.get(f"tok_s_{s}")

    def ratio(a, b):
        return None if a is None or b is None or not b else a / b

    ours = {m: r for (e, m), r in ok.items() if e == "gemmajax"}
    bf = ours.get("bf16")
    hf = ok.get(("transformers", "bf16"))
    lcs = [r for (e, _), r in ok.items() if e == "llama.cpp" and r.get("tok_s_1")]
    lc = max(lcs, key=lambda r: r["tok_s_1"]) if lcs else None
    lc_name = f"llama.cpp {lc['mode']}" if lc else "llama.cpp"

    def bound(s, peer_rate, modes):  # the best rate any of `modes`' GEMMs alone allow at s streams, over a peer's
        fs = [f for f in (mode_floor(kind_floor, m, s) for m in modes) if f]
        return ratio(s / min(fs), peer_rate) if fs else None

    measured = [m for m in MODES if _mode_name(m) in ours]
    for mode in (m for m in MODES if m != "none"):
        for s in (1, s16):
            what = f"gemmajax {mode} / gemmajax bf16 at {s} stream{'s' if s > 1 else ''}"
            x = ratio(rate(ours.get(mode), s), rate(bf, s))
            pr = paired_ratio(paired, mode, s)
            note = ""
            if pr:
                note = (f"; paired in one process: median of {len(paired[mode][str(s)])} rounds, "
                        f"{pr[1]:.2f}-{pr[2]:.2f}; best of the processes {'-' if x is None else f'{x:.2f}x'}")
                what, x = what + ", paired", pr[0]
            rows.append((what, x, 1.0, floor_ratio_vs_bf16(kind_floor, mode, s), False, note))
    rows.append((f"gemmajax w4a16+emb4 / {lc_name} at 1 stream", ratio(rate(ours.get("w4a16+emb4"), 1), rate(lc, 1)),
                 1.0, bound(1, rate(lc, 1), ["w4a16+emb4"]), True))
    best1 = best_gemmajax(results, 1)
    rows.append((f"best gemmajax mode at 1 stream ({best1['mode'] if best1 else '-'}) / {lc_name}",
                 ratio(rate(best1, 1), rate(lc, 1)), 1.5, bound(1, rate(lc, 1), measured), True))
    floor_rate = s16 / sum(floor[s16]) if floor and s16 in floor else None
    rows.append((f"gemmajax bf16 at {s16} streams / the GEMM floor's rate ({floor_rate or 0:.0f} tok/s)",
                 ratio(rate(bf, s16), floor_rate), 0.85, None, True))
    best16 = best_gemmajax(results, s16)
    rows.append((f"best gemmajax mode at {s16} streams ({best16['mode'] if best16 else '-'}) / transformers bf16",
                 ratio(rate(best16, s16), rate(hf, s16)), 2.0, bound(s16, rate(hf, s16), measured), True,
                 rest_note(rest, best16, kind_floor, s16, 2.0 * (rate(hf, s16) or 0))))
    for mode in map(_mode_name, MODES):
        if mode in ours:  # a shorter time is better: the ratio is transformers' TTFT over ours
            rows.append((f"TTFT of {s16} prompts: transformers bf16 / gemmajax {mode}",
                         ratio((hf or {}).get(f"ttft_s_{s16}"), ours[mode].get(f"ttft_s_{s16}")), 1.0, None, True))
    out = [f"not a measurement: {why}; the ratios below are printed, not judged" if why else
           f"quiet machine (load {quiet['load_before']:.2f} before the run, other processes "
           f"{100 * quiet['foreign']:.1f} % of the CPUs): targets judged"]
    passed = 0
    for what, x, need, ceil, judged, *note in rows:
        verdict = "missing" if x is None else "not judged" if why else "PASS" if x >= need else "FAIL"
        passed += verdict == "PASS"
        if verdict == "FAIL" and judged and ceil is not None and ceil < need:
            verdict += ", out of reach with these GEMMs"
        cell = "" if ceil is None else f"; GEMM {'ceiling' if judged else 'floors bf16 / mode'} {ceil:.2f}x"
        out.append(f"  {what}: {'-' if x is None else f'{x:.2f}x'} (target >= {need:g}x{cell}{''.join(note)}): "
                   f"{verdict}")
    if not why:
        out.append(f"{passed} of {len(rows)} targets pass")
    if bf and floor and s16 in floor and rate(bf, s16):
        step = s16 / rate(bf, s16)
        out.append(f"bf16 step at {s16} streams {1e3 * step:.1f} ms / GEMM floor {1e3 * sum(floor[s16]):.1f} ms = "
                   f"{step / sum(floor[s16]):.2f}")
    for r in ours.values():
        if hf and r is not bf:
            x1, x16 = ratio(rate(r, 1), rate(hf, 1)), ratio(rate(r, s16), rate(hf, s16))
            out.append(f"gemmajax {r['mode']} / transformers bf16: {'-' if x1 is None else f'{x1:.2f}x'} at 1, "
                       f"{'-' if x16 is None else f'{x16:.2f}x'} at {s16}")
    return out


def best_of_rounds(rounds: list[dict], by: str = "tok_s_1") -> dict:
    """One configuration's rounds -> its row of the table: a copy of the round with the largest `by` (tok/s at the
    first stream count, the one spread() reports), with each tok_s_* figure the largest and each ttft_s_* the
    smallest over the rounds that did not fail (every figure its own best, whichever round made it); the last
    round's error when every round failed."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return dict(rounds[-1])
    out = dict(max(ok, key=lambda r: r.get(by) or 0))
    for k in {k for r in ok for k in r if k.startswith(("tok_s_", "ttft_s_"))}:
        vals = [r[k] for r in ok if r.get(k) is not None]
        if vals:
            out[k] = max(vals) if k.startswith("tok_s_") else min(vals)
    return out


def spread(seen: dict[str, list[dict]], args) -> list[str]:
    """Each configuration's figures round by round (the table keeps the best of each): how far one process's speed
    moves from the next on this machine, i.e. how close to 1 a verdict can be and still mean something."""
    out = ["round by round (tok/s at 1 / at the most streams; the table keeps each figure's best):"]
    s1, s16 = args.streams[0], args.streams[-1]
    for cfg, rs in seen.items():
        vals = [(r.get(f"tok_s_{s1}"), r.get(f"tok_s_{s16}")) for r in rs if "error" not in r]
        if not vals:
            continue
        cells = ", ".join("/".join("-" if v is None else f"{v:.1f}" for v in pair) for pair in vals)
        lo1, hi1 = min(v[0] or 0 for v in vals), max(v[0] or 0 for v in vals)
        out.append(f"  {cfg}: {cells}" + (f" ({s1}-stream spread {hi1 / lo1 - 1:.0%})" if lo1 else ""))
    return out


def cpu_description() -> str:
    """The CPU as /proc/cpuinfo names it, with the matrix features that decide this script's GEMMs (machines of the
    same kind have been AMD Zen 4 and Intel Xeons with AMX, whose figures differ by 2x both ways)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                k, _, v = line.partition(":")
                if not line.strip():
                    break  # the first processor's block is enough
                info.setdefault(k.strip(), v.strip())
    except OSError:
        return "unknown CPU"
    flags = set(info.get("flags", "").split())
    feats = [name for flag, name in (("avx512_bf16", "AVX-512 bf16"), ("avx512_vnni", "VNNI"),
                                     ("amx_bf16", "AMX bf16"), ("amx_int8", "AMX int8")) if flag in flags]
    return (f"{info.get('model name', 'unknown CPU')} (family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')}; {', '.join(feats) or 'no AVX-512 bf16 / VNNI / AMX'}), "
            f"{os.cpu_count()} logical CPUs")


def cpu_busy_s() -> float:
    """CPU seconds every process of this machine has used since boot (busy time in /proc/stat, steal included)."""
    with open("/proc/stat") as fh:
        vals = [int(v) for v in fh.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    guest = sum(vals[8:10]) if len(vals) > 9 else 0  # already counted in user / nice
    return (sum(vals) - idle - guest) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds this process and its finished children have used."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="gemmajax,transformers,llama.cpp",
                    type=lambda s: [e.strip() for e in s.split(",") if e.strip()])
    ap.add_argument("--modes", default=",".join(MODES), type=lambda s: [m.strip() for m in s.split(",") if m.strip()],
                    help="gemmajax quant modes (none = bf16)")
    ap.add_argument("--hf-dtypes", default="bf16,float32", type=lambda s: s.split(","))
    ap.add_argument("--llama-threads", default="2,1", type=lambda s: [int(v) for v in s.split(",")],
                    help="llama.cpp thread counts to run (the best one is the peer in the ratios)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions per figure (the best is kept)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="passes over all configurations (each figure keeps its best round)")
    ap.add_argument("--paired-rounds", type=int, default=4,
                    help="interleaved rounds of the paired child (every gemmajax mode in one process) that the "
                         "targets against bf16 are judged on; 0: none, judged on the best of the processes")
    ap.add_argument("--no-rest", action="store_true",
                    help="skip the step of the best 16-stream mode without its GEMMs (child_gemmajax_rest)")
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--no-floor", action="store_true", help="skip the GEMM floor (bench/gemm_floor.py) measurement")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_child(args)
        return
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown {bad}; expected some of {MODES}")
    import tempfile

    from gemmajax.model.gguf import default_model_path
    args.model_path = default_model_path()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(prompt_ids(max(args.streams), args.prompt_tokens), fh)  # the same token ids for every engine
        args.prompts_file = fh.name
    load0 = os.getloadavg()[0]
    print(f"CPU: {cpu_description()}", flush=True)
    print(f"load average {load0:.2f} before the run" + (f": not a measurement: load {load0:.2f} (> {QUIET_LOAD}); "
          "running anyway, the targets will not be judged" if load0 > QUIET_LOAD else ""), flush=True)
    busy0, own0, t0 = cpu_busy_s(), own_cpu_s(), time.perf_counter()
    bw1, bw = measure_bandwidth()
    print(f"numpy-sum bandwidth: {bw1:.1f} GB/s one thread, {bw:.1f} GB/s all cores", flush=True)
    floor = kind_floor = None
    if not args.no_floor:
        import gemm_floor  # bench/ is on sys.path: this script runs as bench/compare_cpu.py
        kinds = ("bf16", "int8", "int4") if any(m != "none" for m in args.modes) else ("bf16",)
        fl = gemm_floor.measure(args.model_path, rows=sorted(set(args.streams)), engines=("xla",), kinds=kinds)
        floor = {int(m): tuple(v) for m, v in fl["xla"].items()}
        kind_floor = fl["xla_kinds"]
        print("GEMM floor (XLA:CPU) by weight kind, ms (layers, LM head): " + json.dumps(
            {k: {m: [round(1e3 * t, 2) for t in v] for m, v in by.items()} for k, by in kind_floor.items()}),
            flush=True)
    crashed: dict[str, str] = {}  # llama.cpp configs that died of a signal -> the config run in their place
    seen: dict[str, list[dict]] = {}  # every round's figures (copies): the table's best and the spread come from it
    for rnd in range(args.rounds):  # configurations alternate, so a busy spell of the machine hits all of them
        for cfg in configs(args):
            cfg = crashed.get(cfg, cfg)
            r = spawn(cfg, args)
            if cfg.startswith("llama.cpp:") and "+" not in cfg and r.get("error", "").startswith("child signal"):
                print(json.dumps(r), flush=True)  # a crash in llama.cpp's repacked weight buffers (child_llamacpp)
                crashed[cfg] = cfg + "+norepack"
                cfg = crashed[cfg]
                r = spawn(cfg, args)
            r["round"] = rnd
            seen.setdefault(cfg, []).append(dict(r))
            brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
            print(json.dumps(brief), flush=True)
        bw1, bw = max(bw1, (b := measure_bandwidth())[0]), max(bw, b[1])
    paired = None
    if "gemmajax" in args.engines and "none" in args.modes and len(args.modes) > 1 and args.paired_rounds > 0:
        r = spawn("gemmajax-paired:" + ",".join(args.modes), args)
        print(json.dumps({k: v for k, v in r.items() if k != "paired"}), flush=True)
        paired = r.get("paired")  # None after a failed child: the targets fall back to the best of the processes
    results = [best_of_rounds(rs, f"tok_s_{args.streams[0]}") for rs in seen.values()]
    rest, best16 = None, best_gemmajax(results, args.streams[-1])
    if best16 and best16.get(f"tok_s_{args.streams[-1]}") and not args.no_rest:  # the mode targets() judges
        r = spawn("gemmajax-rest:" + _mode_arg(best16["mode"]), args)
        print(json.dumps(r), flush=True)
        rest = r.get("rest") and {"mode": r["mode"], **r["rest"]}
    wall = time.perf_counter() - t0
    foreign = max(0.0, (cpu_busy_s() - busy0) - (own_cpu_s() - own0)) / (wall * (os.cpu_count() or 1))
    quiet = {"load_before": load0, "load_after": os.getloadavg()[0], "foreign": foreign, "cpu": cpu_description()}
    text = report(results, bw, args, quiet, floor, kind_floor, paired, rest)
    if args.rounds > 1:
        text += "\n" + "\n".join(spread(seen, args))
    print("\n" + text)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"bandwidth_gbs": bw, "results": results, "args": vars(args), "quiet": quiet,
                       "gemm_floor_s": floor, "gemm_floor_by_kind_s": kind_floor, "paired": paired, "rest": rest},
                      fh, indent=1)


if __name__ == "__main__":
    main()
