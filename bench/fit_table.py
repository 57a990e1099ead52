"""The TPU fit table (docs/fit_table.md): every published Gemma 4 size x quant x chip, through `gemmajax.aot`.

Design choices: each row is one `gemmajax.aot.analyze` run in its fast mode (deviceless compiles at full size of every
program the engine runs, `aot.STEPS`: the largest mixed step (T=512, S=16) with logits first, then its greedy
variant and the all-decode step (T=S=16) with tokens and with logits, the KV cache sized from an overhead estimate;
an out-of-memory compile shrinks the cache and compiles again), so the KV tokens in the table are a cache size the
TPU compiler accepted for all four. Rows whose
weights alone exceed the chip are decided without compiling. Results are cached in a JSON file after every row and
the markdown is rewritten each time, so a long run can be stopped and resumed. Measured vLLM-TPU figures come from
shared/reference/anchors.md and are printed beside our projections, never mixed with them.

Slices (`--slices`, docs/fit_table_slices.md): every size x quant x chip that does not fit one chip, again over a
2x2 and a 2x4 slice (tensor parallel 4 / 8 by gemmajax.parallel's rules, expert parallelism on for 26B-A4B), the
same fast mode over the decode and prefill (logits) steps (SLICE_STEPS), every figure per chip. Rows not
regenerated in a run stay "not run".

Other KV dtypes or margins (`--kv-dtype fp8_e4m3 --margin-mib 64`): a table of the rows run only, in its own file
(docs/fit_table_<kv-dtype>[_margin<M>].md) with its own cache; e.g. docs/fit_table_fp8_e4m3_margin64.md, the 26B-A4B
rows with the fp8 cache and the 64 MiB margin measured on a real v5e (README, "On a real TPU v5e").

Run: JAX_PLATFORMS=cpu python bench/fit_table.py [--cache /tmp/fit_cache.json] [--out docs/fit_table.md]
     JAX_PLATFORMS=cpu python bench/fit_table.py --slices [--only 31b|none|v6e|2x2 ...]
     JAX_PLATFORMS=cpu python bench/fit_table.py --kv-dtype fp8_e4m3 --margin-mib 64 --only "26b-a4b|w4a16+emb4|v5e"
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from gemmajax import aot  # noqa: E402
from gemmajax.config import ModelConfig  # noqa: E402

QUANTS = ("none", "w8a8", "w8a8+emb4", "w4a16", "w4a16+emb4", "qat-w4a16", "qat-w4a16+emb4")
CHIP_ORDER = ("v5e", "v6e")
SETTINGS = dict(max_model_len=8192, max_num_seqs=16, max_num_batched_tokens=512, page_size=32, kv_dtype="bf16",
                margin_mib=256)
DEFAULT_SETTINGS = dict(SETTINGS)  # --kv-dtype / --margin-mib other than these: a table of the rows run only
PROJ_CONTEXT = 512
STEPS = ("decode", "decode-greedy", "prefill-greedy", "prefill")  # the last (the largest program) is compiled first
# Slices: the all-decode and the largest mixed step with logits out (the greedy twins differ only in returning tokens
# instead of the [16, V] float32 logits, so they need less: 12b on v5e 2x2, peak 14.74 / 14.73 GiB against 14.75
# for prefill / decode, measured); each compile of a sharded full-size step takes minutes on 2 cores. The first
# overhead guess on a slice is smaller (a chip holds a quarter or an eighth of the activations: 0.05 GiB of
# temporaries for 12b on v5e 2x2, measured).
SLICE_STEPS = ("decode", "prefill")
SLICE_GUESS = 256 * aot.MiB

# Measured vLLM-TPU figures (shared/reference/anchors.md sections 0 and 2.4; xbill9/gemma4-dev and the
# tpu-inference sweeps): weights GiB, decode tok/s at 1 and 16 streams, KV tokens; None where not reported.
# qat-w4a16 = xbill9's "W4A16 repack" of the QAT checkpoint; w8a8 = "W8A8 (from QAT)" on E2B, "W8A8, bf16 tables"
# on 12B. Protocol: ~30-token prompts, 256 output tokens, max-num-batched-tokens 512.
ANCHORS: dict[tuple[str, str, str], dict] = {
    ("e2b", "none", "v5e"): dict(weights=8.94, tok1=144, tok16=2008, kv=None),
    ("e2b", "w8a8", "v5e"): dict(weights=None, tok1=220, tok16=2872, kv=None),
    ("e2b", "w8a8+emb4", "v5e"): dict(weights=3.43, tok1=243, tok16=3086, kv=None),
    ("e2b", "qat-w4a16", "v5e"): dict(weights=6.42, tok1=136, tok16=1906, kv=None),
    ("e2b", "w4a16", "v5e"): dict(weights=7.17, tok1=136, tok16=1911, kv=None, what="Google W4A16"),
    ("e4b", "w8a8+emb4", "v5e"): dict(weights=None, tok1=133, tok16=1747, kv=None),
    ("e4b", "qat-w4a16", "v5e"): dict(weights=8.90, tok1=75, tok16=1012, kv=None),
    ("e4b", "w4a16", "v5e"): dict(weights=10.15, tok1=None, tok16=None, kv=None, what="Google W4A16"),
    ("12b", "w8a8+emb4", "v5e"): dict(weights=11.31, tok1=57, tok16=675, kv=9728),
    ("12b", "w8a8", "v5e"): dict(weights=12.03, tok1=53, tok16=624, kv=None),
    ("12b", "qat-w4a16", "v5e"): dict(weights=7.59, tok1=33, tok16=388, kv=None),
    ("12b", "w4a16", "v5e"): dict(weights=9.46, tok1=33, tok16=392, kv=None, what="Google W4A16"),
    ("26b-a4b", "qat-w4a16", "v5e"): dict(weights=13.58, tok1=31, tok16=201, kv=None),
    ("26b-a4b", "qat-w4a16+emb4", "v5e"): dict(weights=13.58, tok1=31, tok16=201, kv=None,
                                               what="W4A16 repack + lowmem patch"),
    ("31b", "none", "v5e"): dict(weights=None, tok1=None, tok16=None, kv=None, what="does not fit"),
    ("e2b", "none", "v6e"): dict(weights=None, tok1=211, tok16=1900, kv=None),
    ("e4b", "none", "v6e"): dict(weights=None, tok1=111, tok16=1330, kv=None),
    ("12b", "none", "v6e"): dict(weights=22.4, tok1=45, tok16=695, kv=None, what="max-len 8K only"),
    ("26b-a4b", "qat-w4a16", "v6e"): dict(weights=17.43, tok1=None, tok16=1283, kv=53888),
}

# Rows with anchors first, so a run cut short still covers the comparisons that matter.
PRIORITY = [("26b-a4b", "w4a16+emb4", "v5e"), ("26b-a4b", "w4a16", "v5e"), ("26b-a4b", "w8a8", "v6e"),
            ("26b-a4b", "w8a8+emb4", "v6e"), ("26b-a4b", "w4a16", "v6e"), ("26b-a4b", "w4a16+emb4", "v6e"),
            ("12b", "w8a8+emb4", "v5e"), ("31b", "none", "v5e"), ("e2b", "none", "v5e"), ("e2b", "w8a8+emb4", "v5e"),
            ("e2b", "none", "v6e"), ("26b-a4b", "w4a16", "v6e"), ("12b", "none", "v6e"), ("12b", "w4a16", "v5e")]


# The rows of docs/fit_table.md (generated 2026-11-29) that do not fit one chip, plus the +emb4 twins of the
# int4 rows the table did not have then (qat-w4a16 repeats w4a16's compile). Each gets a 2x2 and a 2x4 row.
ONE_CHIP_MISSES = ([("12b", "none", "v5e")] + [("26b-a4b", q, "v5e") for q in QUANTS]
                   + [("31b", q, "v5e") for q in QUANTS] + [("26b-a4b", "none", "v6e"), ("31b", "none", "v6e"),
                                                            ("31b", "w8a8", "v6e")])
SLICES = ("2x2", "2x4")


def slice_rows() -> list[tuple[str, str, str, str]]:
    """(model, quant, chip, topology): bf16 rows first, then the quantized ones."""
    rows = [(m, q, c, t) for t in SLICES for m, q, c in ONE_CHIP_MISSES]
    return sorted(rows, key=lambda r: (r[1] != "none", rows.index(r)))


def all_rows() -> list[tuple[str, str, str]]:
    rows = [(m, q, c) for c in CHIP_ORDER for m in aot.MODELS for q in QUANTS]
    return sorted(rows, key=lambda r: (PRIORITY.index(r) if r in PRIORITY else len(PRIORITY), rows.index(r)))


def storage_quant(quant: str) -> str:
    """qat-w4a16 is stored exactly as w4a16 (int4, groups of 32): same shapes, same compiled program."""
    return quant.replace("qat-", "")


def run_row(model: str, quant: str, chip: str, overhead_guess: int, log, topology: str = "1x1") -> dict:
    cfg = ModelConfig.preset(model)
    req = aot.AotRequest(cfg=cfg, chip=chip, topology=topology, quant=storage_quant(quant), probe=False,
                         expert_parallel=topology != "1x1" and cfg.enable_moe,
                         steps=STEPS if topology == "1x1" else SLICE_STEPS,
                         overhead_guess=overhead_guess, proj_context=PROJ_CONTEXT, margin_bytes=SETTINGS["margin_mib"]
                         * aot.MiB, **{k: v for k, v in SETTINGS.items() if k != "margin_mib"})
    t0 = time.perf_counter()
    res = aot.analyze(req, log=log)
    d = res.to_json()
    d["quant"] = quant
    d["wall_seconds"] = time.perf_counter() - t0
    d["compiled"] = bool(res.compiles)
    return d


def _gib(n) -> str:
    return "—" if n is None else f"{n / aot.GiB:.2f}"


def _num(n) -> str:
    return "—" if n is None else f"{n:,.0f}"


KEPT = "†"  # marks a row of docs/fit_table.md that a run did not regenerate (kept from the file it replaced)


def earlier_rows(text: str) -> dict[str, tuple[str, str | None]]:
    """The rows of an earlier docs/fit_table.md: per key model|quant|chip, (its table line, its notes line or None).
    A notes line gains "(kept from the run of DATE)" once, DATE being the earlier file's generation date."""
    m = re.search(r" on (\d{4}-\d{2}-\d{2})", text)
    date = m.group(1) if m else "an unknown date"
    known = {"|".join(r) for r in all_rows()}
    rows: dict[str, list] = {}
    for line in text.splitlines():
        cells = [c.strip().rstrip(KEPT).strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) > 3 and "|".join(cells[:3]) in known:
            rows.setdefault("|".join(cells[:3]), [line, None])[0] = line
        n = re.match(r"- `([^`]+)`: ", line)
        if n and n.group(1) in known:
            note = line if "(kept from the run of " in line else f"{line} (kept from the run of {date})"
            rows.setdefault(n.group(1), [None, None])[1] = note
    return {k: (v[0], v[1]) for k, v in rows.items() if v[0] is not None and "| not run |" not in v[0]}


def _kept_line(line: str, meas: str) -> str:
    """A kept table line with KEPT after its model name (once) and today's vLLM-TPU cell `meas` (ANCHORS may have
    changed since); the other cells as they were."""
    cells = line.strip().strip("|").split("|")
    cells[0] = f" {cells[0].strip().rstrip(KEPT).strip()}{KEPT} "
    if len(cells) == 12:    # the layout render writes: the measured cell is the 11th
        cells[10] = f" {meas} "
    return "|" + "|".join(cells) + "|"


def _margin() -> str:
    m = SETTINGS["margin_mib"]
    return f"{m / 1024:.2f} GiB" if m % 256 == 0 else f"{m} MiB"


def _variant() -> bool:
    """A table whose KV dtype or margin is not the main table's: it shows the rows it ran, nothing kept."""
    return SETTINGS != DEFAULT_SETTINGS


def render(results: dict[str, dict], earlier: dict[str, tuple[str, str | None]] | None = None) -> str:
    """The markdown document from the cached results; rows the cache lacks are taken from `earlier` (earlier_rows of
    the file being replaced) where it has them, marked KEPT, else "not run"."""
    s = SETTINGS
    earlier = earlier or {}
    kept = [k for k in ("|".join(r) for r in all_rows()) if k not in results and k in earlier]
    out = [
        "# Does it fit? Gemma 4 on one TPU v5e / v6e chip (generated)",
        "",
        f"Generated by `bench/fit_table.py` with `gemmajax.aot` (libtpu deviceless compiles, no TPU) on "
        f"{datetime.date.today().isoformat()}. Do not edit by hand: rerun the script."
        + (f" {len(kept)} rows marked {KEPT} are not in this run's results (`--cache`): they are kept from the file "
           f"it replaced, and their notes say from which run; those from runs before 2026-12-04 counted the older "
           f"page split (every sequence paying window + 512 tokens in the sliding layers), so they undercount their "
           f"KV tokens." if kept else ""),
        "",
        f"Settings: max_model_len {s['max_model_len']}, max_num_seqs {s['max_num_seqs']}, max_num_batched_tokens "
        f"{s['max_num_batched_tokens']}, page_size {s['page_size']}, KV cache {s['kv_dtype']}, margin {_margin()}. HBM "
        f"limits are the TPU compiler's own (v5e {aot.CHIPS['v5e'].hbm_limit / aot.GiB:.2f} GiB, v6e "
        f"{aot.CHIPS['v6e'].hbm_limit / aot.GiB:.2f} GiB); bandwidth v5e 819 GB/s, v6e 1,640 GB/s.",
        "",
        "How to read it:",
        "- **fits / KV tokens (ours)**: the programs the engine runs, each with the weights and the whole paged KV "
        "cache as arguments, compiled for the chip by libtpu: the largest mixed step (T=512, S=16) and the all-decode "
        "step (T=S=16), each returning greedy tokens and logits; the cache is sized from the HBM left after weights, "
        "the largest program's other buffers and the margin, and the number shown is a cache size the compiler "
        "accepted for all of them (`compile`). Rows "
        "marked `weights` were decided without compiling: the weights alone leave no room for one 8192-token "
        "sequence. KV tokens = the context the cache holds when filled with 8192-token sequences, each paying "
        "its window (+2) in the sliding layers beside one 512-token chunk of sliding pages shared by the cache, its whole context in the full-attention layers and nothing in "
        "KV-shared layers (the engine's page split, `gemmajax.aot.plan_kv`).",
        "- **vLLM-style tokens**: the same KV bytes divided by the bytes per token of a cache where every KV-owning "
        "layer keeps the whole context (sliding layers not windowed), the layout the measured vLLM-TPU figures use.",
        "- **KV KiB/token**: ours at 8192 tokens of context (sliding layers pay only their window) / vLLM-style.",
        f"- **projection tok/s**: a roofline PROJECTION, not a measurement: HBM bandwidth / bytes read per decode "
        f"step (all weights; embedding and per-layer-embedding gathers only their rows; the tied LM head in full; "
        f"MoE experts hit by uniform routing; the KV of {PROJ_CONTEXT} tokens per stream, every layer reading its "
        f"source's pages) at 1 stream, and x16 with 16 streams' KV. Real kernels reach a fraction of it (vLLM-TPU "
        f"reached about 83 % of v5e bandwidth with int8 on 12B, about 33 % with int4).",
        "- **vLLM-TPU measured**: anchors.md (weights GiB, decode tok/s at 1 / 16 streams, KV tokens); "
        "`qat-w4a16` = xbill9's W4A16 repack, `w4a16` = Google's W4A16 checkpoint where reported.",
        "- `qat-w4a16` is stored exactly like `w4a16` (int4, groups of 32): its row repeats that compile (with "
        "`+emb4` too).",
        "- 26b-a4b: the experts go through the grouped matmul kernel (`gemmajax/quant/gmm.py`), which reads the "
        "quantized experts in place and only those the step routes to; the projection counts those experts' bytes "
        "(uniform routing), and the compiled steps' temporaries are in the notes. Quantized expert stacks pad `in` "
        "to whole 128-byte lanes (down_proj 704 -> 768), included in the weights.",
        "",
        "| model | quant | chip | weights GiB | fits | KV tokens (ours) | vLLM-style tokens, same bytes | "
        "KV KiB/token ours / vLLM-style | projection tok/s @1 | projection tok/s @16 | vLLM-TPU measured | "
        "decided by |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    shown = [r for r in all_rows() if "|".join(r) in results] if _variant() else all_rows()
    for model, quant, chip in sorted(shown, key=lambda r: (CHIP_ORDER.index(r[2]), aot.MODELS.index(r[0]),
                                                                 QUANTS.index(r[1]))):
        r = results.get(f"{model}|{quant}|{chip}")
        a = ANCHORS.get((model, quant, chip))
        meas = "—"
        if a:
            parts = [f"{a['weights']:.2f} GiB" if a.get("weights") else None,
                     f"{_num(a.get('tok1'))} / {_num(a.get('tok16'))} tok/s" if a.get("tok1") or a.get("tok16")
                     else None,
                     f"{a['kv']:,} KV tokens" if a.get("kv") else None, a.get("what")]
            meas = "; ".join(p for p in parts if p)
        if r is None:
            key = f"{model}|{quant}|{chip}"
            out.append(_kept_line(earlier[key][0], meas) if key in kept else
                       f"| {model} | {quant} | {chip} | — | not run | — | — | — | — | — | {meas} | — |")
            continue
        p = r.get("projection") or {}
        fits = "**yes**" if r["fits"] else "no"
        how = "compile" if r["compiled"] else "weights"
        if r["fits"]:
            kv, vkv = _num(r["kv_tokens"]), _num(r["kv_tokens_vllm_style"])
        else:
            kv = vkv = "—"
        out.append(
            f"| {model} | {quant} | {chip} | {_gib(r['weight_bytes'])} | {fits} | {kv} | {vkv} | "
            f"{r['kv_bytes_per_token_ours'] / 1024:.1f} / {r['kv_bytes_per_token_vllm'] / 1024:.1f} | "
            f"{_num(p.get('tok_s_1')) if r['fits'] else '—'} | {_num(p.get('tok_s_16')) if r['fits'] else '—'} | "
            f"{meas} | {how} |")
    out += notes({k: v for k, v in results.items() if k.count("|") == 2},
                 {k: earlier[k][1] for k in kept if earlier[k][1]})
    return "\n".join(out)


def notes(results: dict[str, dict], kept: dict[str, str] | None = None) -> list[str]:
    """The notes section: a line per row of `results`, and the kept rows' earlier lines (`kept`: key -> line)."""
    out = ["", "## Notes per row", ""]
    kept = kept or {}
    for key in sorted([*results, *kept]):
        if key not in results:
            out.append(kept[key])
            continue
        r = results[key]
        why = r["reason"]
        temps = ", ".join(f"{c['step']} temporaries {c['temp_bytes'] / aot.GiB:.2f} GiB in {c['seconds']:.0f} s"
                          for c in r.get("compiles", []) if c.get("oom") is None and c.get("error") is None)
        extra = "; ".join(r.get("notes", []))
        line = (f"- `{key}`: {why}" + (f" ({temps})" if temps else "") + (f"; {extra}" if extra else "")
                + (f"; attention {r['attn_impl']}" if r.get("attn_impl") else ""))
        out.append(" ".join(line.split()))   # one line per row (compiler messages carry newlines)
    out.append("")
    return out


def render_slices(results: dict[str, dict]) -> str:
    """docs/fit_table_slices.md from the cached results of the slice rows."""
    s = SETTINGS
    out = [
        "# Does it fit a slice? Gemma 4 on 4 / 8 TPU v5e / v6e chips, tensor parallel (generated)",
        "",
        f"Generated by `bench/fit_table.py --slices` with `gemmajax.aot --topology` (libtpu deviceless compiles of the "
        f"SPMD-partitioned programs, no TPU) on {datetime.date.today().isoformat()}. Do not edit by hand: rerun the "
        f"script. Rows marked `not run` were not regenerated yet.",
        "",
        f"Rows: every size x quant x chip of docs/fit_table.md that does not fit one chip, over a 2x2 (tensor "
        f"parallel 4) and a 2x4 slice (tensor parallel 8), split by `gemmajax.parallel` (q / k / v / gate / up on "
        f"their outputs, o / down on their inputs, vocabulary rows, KV pages by KV head, heads stored repeatedly where "
        f"fewer than chips), expert parallelism on for 26b-a4b. Settings as docs/fit_table.md: max_model_len "
        f"{s['max_model_len']}, max_num_seqs {s['max_num_seqs']}, max_num_batched_tokens "
        f"{s['max_num_batched_tokens']}, page_size {s['page_size']}, KV {s['kv_dtype']}, margin {_margin()} per chip.",
        "",
        "- **weights / chip**: what one chip holds (split leaves' shards, replicated leaves whole); the compiled "
        "program's arguments on one chip include exactly these bytes.",
        "- **fits** is one chip's verdict: each chip runs the same partitioned program, so all fit or none does.",
        "- **KV tokens**: the whole cache's context (every chip holds its KV heads of the same pages).",
        f"- **projection tok/s**: a roofline PROJECTION, not a measurement: one chip's HBM bandwidth / the bytes one "
        f"chip reads per decode step (its shards; KV of {PROJ_CONTEXT} tokens per stream); the chips read in "
        f"parallel and the all-reduces between them are not counted.",
        "- **quantized rows**: the int8 / int4 matmul kernels and the grouped expert matmul run per shard under "
        "shard_map (`gemmajax.quant.sharded`: Mosaic kernels cannot be partitioned by GSPMD); a row whose step still "
        "met a Pallas call outside a shard_map would read `compile error`.",
        "- **steps**: the all-decode step (T=S=16) and the largest mixed step (T=512, S=16) with logits out, each at "
        "full size (`SLICE_STEPS`); the greedy twins return tokens instead of the logits and need less.",
        "",
        "| model | quant | chip | slice | weights GiB | weights / chip GiB | fits | KV / chip GiB | KV tokens (ours) | "
        "peak / chip GiB | projection tok/s @1 | projection tok/s @16 | decided by |",
        "|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for model, quant, chip, topo in sorted(slice_rows(), key=lambda r: (CHIP_ORDER.index(r[2]), SLICES.index(r[3]),
                                                                        aot.MODELS.index(r[0]), QUANTS.index(r[1]))):
        r = results.get(f"{model}|{quant}|{chip}|{topo}")
        if r is None:
            out.append(f"| {model} | {quant} | {chip} | {topo} | — | — | not run | — | — | — | — | — | — |")
            continue
        p = r.get("projection") or {}
        err = r["reason"].startswith("compile error")
        fits = "**yes**" if r["fits"] else ("compile error" if err else "no")
        how = "compile" if r["compiled"] else "weights"
        ok = r["fits"]
        proof = r.get("proof") or {}
        peak = (proof["argument_bytes"] + proof["output_bytes"] - proof["alias_bytes"] + proof["temp_bytes"]
                + proof["code_bytes"]) if ok else None
        out.append(
            f"| {model} | {quant} | {chip} | {topo} | {_gib(r['weight_bytes'])} | {_gib(r['weight_bytes_per_chip'])} | "
            f"{fits} | {_gib(r['kv_cache_bytes_per_chip']) if ok else '—'} | {_num(r['kv_tokens']) if ok else '—'} | "
            f"{_gib(peak)} | {_num(p.get('tok_s_1')) if ok else '—'} | {_num(p.get('tok_s_16')) if ok else '—'} | "
            f"{how} |")
    out += notes({k: v for k, v in results.items() if k.count("|") == 3})
    return "\n".join(out)


def main(argv=None) -> int:
    saved = dict(SETTINGS)
    try:
        return _main(argv)
    finally:  # --kv-dtype / --margin-mib set the module's SETTINGS for this run only
        SETTINGS.clear()
        SETTINGS.update(saved)


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                 "docs", "fit_table.md"))
    p.add_argument("--cache", default="/tmp/gemmajax_fit_table.json", help="results so far (JSON), for resuming")
    p.add_argument("--only", nargs="*", default=None, help="rows as model|quant|chip (default: all)")
    p.add_argument("--render-only", action="store_true", help="rewrite the markdown from the cache, compile nothing")
    p.add_argument("--kv-dtype", default=SETTINGS["kv_dtype"], choices=("bf16", "fp8_e4m3", "fp8_e5m2"),
                   help="the KV cache's dtype; other than bf16, a table of the rows run only (default out: "
                   "docs/fit_table_<kv-dtype>.md, its own cache file)")
    p.add_argument("--margin-mib", type=int, default=SETTINGS["margin_mib"],
                   help="HBM kept free besides what the compiler counts (gemmajax aot's --margin-mib)")
    p.add_argument("--slices", action="store_true",
                   help="the 2x2 / 2x4 rows of what does not fit one chip (docs/fit_table_slices.md by default)")
    args = p.parse_args(argv)
    SETTINGS.update(kv_dtype=args.kv_dtype, margin_mib=args.margin_mib)
    if _variant():
        tag = f"{args.kv_dtype}" + (f"_margin{args.margin_mib}" if args.margin_mib != DEFAULT_SETTINGS["margin_mib"]
                                    else "")
        if args.out == p.get_default("out"):
            args.out = os.path.join(os.path.dirname(args.out), f"fit_table_{tag}.md")
        if args.cache == p.get_default("cache"):
            args.cache = f"/tmp/gemmajax_fit_table_{tag}.json"
    if args.slices and args.out == p.get_default("out"):
        args.out = os.path.join(os.path.dirname(args.out), "fit_table_slices.md")
    earlier = {}
    if args.slices and _variant():
        p.error("--slices takes the main table's settings (no --kv-dtype / --margin-mib)")
    if not args.slices and not _variant() and os.path.exists(args.out):  # rows not regenerated keep their lines
        with open(args.out) as f:
            earlier = earlier_rows(f.read())

    def draw(results: dict[str, dict]) -> str:
        return render_slices(results) if args.slices else render(results, earlier)
    results: dict[str, dict] = {}
    if os.path.exists(args.cache):
        with open(args.cache) as f:
            results = json.load(f)
    def extra(c: dict, r: dict) -> int:
        """A compile's HBM besides KV and weights (per chip on a slice)."""
        return (c["argument_bytes"] + c["output_bytes"] - c["alias_bytes"] + c["temp_bytes"] + c["code_bytes"]
                - c["kv_bytes"] - r.get("weight_bytes_per_chip", r["weight_bytes"]))

    def kind(model: str, quant: str, topo: str) -> str:
        """Rows whose overheads predict each other: same model and slice, bf16 or quantized (26b-a4b on v5e 2x2: bf16
        experts 1.04 GiB of temporaries, w8a8 0.06)."""
        return f"{model}|{topo}|{'bf16' if quant == 'none' else 'quantized'}"

    guesses: dict[str, int] = {}  # per kind: the overhead beyond the weights seen in an earlier compile
    for key, r in results.items():
        for c in r.get("compiles", []):
            if c.get("oom") is None and c.get("error") is None and c.get("argument_bytes"):
                g = kind(r["model"], r["quant"], r.get("topology", "1x1"))
                guesses[g] = max(guesses.get(g, 0), extra(c, r))
    if args.only:
        rows = [tuple(x.split("|")) for x in args.only]
    else:
        rows = slice_rows() if args.slices else all_rows()
    for row in ([] if args.render_only else rows):
        model, quant, chip, topo = (*row, "1x1")[:4]
        key = "|".join(row) if topo != "1x1" else f"{model}|{quant}|{chip}"
        if key in results:
            continue
        twin = key.replace(f"|{quant}|", f"|{storage_quant(quant)}|")
        if twin != key and twin in results:
            results[key] = dict(results[twin], quant=quant)
        else:
            g = kind(model, quant, topo)
            guess = int(guesses.get(g, 768 * aot.MiB if topo == "1x1" else SLICE_GUESS) * 1.1)
            print(f"== {key} (overhead guess {guess / aot.GiB:.2f} GiB)", flush=True)
            results[key] = run_row(model, quant, chip, guess, lambda m: print("   " + m, flush=True), topo)
            for c in results[key].get("compiles", []):
                if c.get("argument_bytes"):
                    guesses[g] = max(guesses.get(g, 0), extra(c, results[key]))
            print(f"   -> {results[key]['reason']} ({results[key]['wall_seconds']:.0f} s)", flush=True)
        with open(args.cache, "w") as f:
            json.dump(results, f, indent=1)
        with open(args.out, "w") as f:
            f.write(draw(results))
    with open(args.out, "w") as f:
        f.write(draw(results))
    print(f"wrote {args.out} ({len(results)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
