"""gemmajax.aot: KV accounting against hand arithmetic and the vLLM-TPU anchors, abstract quantized weights against
real quantization, the compiler's HBM limits, and deviceless TPU compiles of a tiny model through the real path.

Full-size compiles (E2B, 12B) take minutes on two cores: they are marked slow (`make test-slow`)."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import json
import math
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from gemmajax import aot  # noqa: E402
from gemmajax.config import ModelConfig, _g4  # noqa: E402
from gemmajax.model import gemma  # noqa: E402

KiB, GiB = 1024, 1 << 30


# Only a missing libtpu skips: with libtpu installed, any error it raises (a topology it cannot describe, a broken
# compile) fails the test that met it.
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install libtpu)")


def tiny_cfg(vocab: int = 1024) -> ModelConfig:
    """4 layers (sliding, full, then a KV-shared sliding and full pair), head dims 256 / 512 (the kernel's lanes),
    per-layer embeddings: every structural feature of E2B at toy size."""
    cfg = ModelConfig.from_hf(_g4(256, 4, 2, 1, None, 512, 2, 64, ple=64, shared=2, double=True), name="tiny")
    return cfg.replace(vocab_size=vocab, ple_vocab_size=vocab)


def args(**kw) -> argparse.Namespace:
    base = dict(model="e2b", chip="v5e", topology="1x1", quant="none", kv_dtype="bf16", max_model_len=8192,
                max_num_seqs=64, json=False)
    base.update(kw)
    return argparse.Namespace(**base)


# --------------------------------------------------------------------------------------------- KV accounting

def test_vllm_style_bytes_per_token_match_anchors():
    # anchors.md 2.4: E2B 18 KiB/token bf16 (15 caching layers), 12B 336 KiB/token as allocated by vLLM.
    assert aot.kv_bytes_per_token_vllm(ModelConfig.preset("e2b"), "bf16") == 18 * KiB
    assert aot.kv_bytes_per_token_vllm(ModelConfig.preset("12b"), "bf16") == 336 * KiB
    assert aot.kv_bytes_per_token_vllm(ModelConfig.preset("12b"), "fp8_e5m2") == 168 * KiB


def test_plan_kv_e2b_hand_computed():
    cfg = ModelConfig.preset("e2b")
    # E2B caches layers 0-14: 12 sliding (K=1, H=256) and 3 full (K=1, H=512); page 32 tokens, K and V, bf16.
    sliding_page, full_page = 12 * 2 * 32 * 256 * 2, 3 * 2 * 32 * 512 * 2
    # A sequence: window 512 + 2 positions, one page for the span's boundary and one the next token may open; the
    # step's 512-token chunk is paid once for the pool (16 pages + 1 for its boundary), beside the null pages.
    sliding_pps = math.ceil((512 + 2) / 32) + 2
    full_pps = 8192 // 32 + 1
    chunk_pages = 512 // 32 + 1
    per_seq = sliding_pps * sliding_page + full_pps * full_page
    fixed = (1 + chunk_pages) * sliding_page + full_page
    budget = fixed + int(2.5 * per_seq)
    plan = aot.plan_kv(cfg, budget, max_model_len=8192, chunk=512, page_size=32, kv_dtype="bf16")
    assert plan.groups == ("sliding", "full")
    assert plan.page_bytes == (sliding_page, full_page)
    assert plan.num_pages == (1 + chunk_pages + math.floor(2.5 * sliding_pps), 1 + math.floor(2.5 * full_pps))
    held = min((plan.num_pages[0] - 1 - chunk_pages) / sliding_pps, (plan.num_pages[1] - 1) / full_pps)
    assert plan.tokens == int(held * 8192) and 2.4 < held <= 2.5
    assert plan.cache_bytes <= budget
    assert plan.minimum_bytes == fixed + per_seq
    ours = aot.kv_bytes_per_token_ours(cfg, 8192, 512, 32, "bf16")
    assert ours == pytest.approx(per_seq / 8192)
    assert ours < 0.5 * 18 * KiB  # windowed sliding layers: well under half of vLLM-TPU's 18 KiB


def test_plan_kv_more_tokens_than_vllm_style_in_same_bytes():
    for name in ("e2b", "12b", "31b"):
        cfg = ModelConfig.preset(name)
        plan = aot.plan_kv(cfg, 4 * GiB, max_model_len=8192, chunk=512, page_size=32, kv_dtype="bf16")
        vllm = plan.cache_bytes // aot.kv_bytes_per_token_vllm(cfg, "bf16")
        assert plan.tokens > 2 * vllm, (name, plan.tokens, vllm)


def test_decode_bytes_read_tiny_hand_computed():
    cfg = tiny_cfg()
    w = aot.abstract_model_weights(cfg, "none")
    shapes = cfg.param_shapes()
    total = 2 * sum(math.prod(s) for n, s in shapes.items() if not gemma.is_norm(n)) + 4 * sum(
        math.prod(s) for n, s in shapes.items() if gemma.is_norm(n))  # bf16 weights, float32 norms
    _, D = shapes["embed_tokens.weight"]
    ple_rows, ple_cols = shapes["embed_tokens_per_layer.weight"]
    for batch in (1, 16):
        weights, kv = aot.decode_bytes_read(cfg, w, batch, 100, "bf16")
        # the PLE table is gathered (batch rows), the embedding is read whole as the LM head plus batch rows
        assert weights == total - 2 * ple_rows * ple_cols + batch * 2 * ple_cols + batch * 2 * D
    # every layer reads K and V of its source: sliding min(100, 64) tokens of H=256, full 100 tokens of H=512
    _, kv = aot.decode_bytes_read(cfg, w, 1, 100, "bf16")
    assert kv == 2 * (64 * 2 * 256 * 2) + 2 * (100 * 2 * 512 * 2)
    p = aot.project(cfg, w, aot.CHIPS["v6e"], 100, "bf16")
    w1, _ = aot.decode_bytes_read(cfg, w, 1, 100, "bf16")
    w16, _ = aot.decode_bytes_read(cfg, w, 16, 100, "bf16")
    assert p.tok_s_1 == pytest.approx(1640e9 / (w1 + kv))
    assert p.tok_s_16 == pytest.approx(16 * 1640e9 / (w16 + 16 * kv))


def test_moe_projection_counts_only_hit_experts():
    cfg = ModelConfig.preset("26b-a4b")
    w = aot.abstract_model_weights(cfg, "w4a16")
    experts = aot.weight_breakdown(w)["experts"]
    w1, _ = aot.decode_bytes_read(cfg, w, 1, 512, "bf16")
    w16, _ = aot.decode_bytes_read(cfg, w, 16, 512, "bf16")
    E, k = 128, 8
    embed_row = aot.tree_bytes(w.embed) / w.embed.shape[0]
    assert w16 - w1 == pytest.approx(experts * ((1 - (1 - k / E) ** 16) - k / E) + 15 * embed_row)


# --------------------------------------------------------------------------------------------- abstract weights

@pytest.mark.parametrize("quant", ["none", "w8a8", "w4a16+emb4", "w8a8+emb8"])
def test_abstract_weights_match_real_quantization(quant):
    """The abstract tree (what AOT compiles) has the leaves, shapes, dtypes and QuantArray metadata that the
    loaders' quantizer (gemmajax.quant.loading) gives real weights."""
    from gemmajax.quant.loading import make_quantizer

    cfg = tiny_cfg(vocab=300)  # 300 rows, D 256: tables pad columns
    shapes = cfg.param_shapes()
    rng = np.random.default_rng(0)

    def get(name):
        return jnp.asarray(rng.standard_normal(shapes[name]).astype(np.float32) * 0.02, jnp.bfloat16)

    real = gemma.build_weights(cfg, get, quantize=make_quantizer(quant))
    abstract = aot.abstract_model_weights(cfg, quant)
    # same tree, QuantArray metadata (kind, logical shape, group) included
    assert jax.tree.structure(abstract) == jax.tree.structure(real)
    flat_a = jax.tree_util.tree_flatten_with_path(abstract)[0]
    flat_r = jax.tree.leaves(real)
    for (path, a), r in zip(flat_a, flat_r):
        name = jax.tree_util.keystr(path)
        assert a.shape == r.shape, name
        # norms are float32 in the abstract tree (the loaders store them so); the rest has the real dtype
        assert jnp.dtype(a.dtype) == (jnp.float32 if "norm" in name else jnp.dtype(r.dtype)), name
    if quant != "none":
        assert aot.tree_bytes(abstract) < aot.tree_bytes(aot.abstract_model_weights(cfg, "none"))


def test_weight_bytes_match_anchor_builds():
    # anchors.md 2.4: 12B W8A8 with bf16 tables 12.03 GiB, 12B W4A16 repack 7.59 GiB.
    cfg = ModelConfig.preset("12b")
    assert aot.tree_bytes(aot.abstract_model_weights(cfg, "w8a8")) / GiB == pytest.approx(12.03, abs=0.05)
    assert aot.tree_bytes(aot.abstract_model_weights(cfg, "w4a16")) / GiB == pytest.approx(7.59, abs=0.05)


# --------------------------------------------------------------------------------------------- the programs

@pytest.mark.parametrize("max_num_seqs,max_num_batched_tokens", [(8, 64), (48, 512), (16, 512), (64, 64)])
def test_step_shapes_are_the_engines(monkeypatch, max_num_seqs, max_num_batched_tokens):
    """aot's shapes are the ones a real LLMEngine runs: `aot.step_shapes(*aot.engine_buckets(...))` equals
    `LLMEngine.step_shapes()` of an engine on the tiny model with the same limits, built as on a TPU backend
    (default buckets: powers of 2, no CPU dense ladder), so the two rules cannot drift apart. The programs aot
    compiles are that list's largest all-decode shape (T = S = its largest sequence bucket, decode_only) and its
    largest mixed shape, each greedy and with logits. The old rule compiled decode at (bucket(S) in the token
    buckets, S) without decode_only, e.g. (16, 8) for 8 sequences: a program the engine never runs."""
    from gemmajax.engine.llm_engine import EngineConfig, LLMEngine

    cfg = tiny_cfg()
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # the engine's choices for an accelerator
    eng = LLMEngine(cfg, aot.abstract_model_weights(cfg), None, EngineConfig(
        max_model_len=256, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, page_size=32,
        kv_cache_memory=1 << 22))
    monkeypatch.undo()
    shapes = eng.step_shapes()
    assert aot.step_shapes(*aot.engine_buckets(max_num_seqs, max_num_batched_tokens)) == shapes
    assert aot.step_shapes(eng.s_buckets, eng.t_buckets) == shapes
    progs = aot.programs(aot.AotRequest(cfg=cfg, max_model_len=256, max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max_num_batched_tokens))
    assert set(progs) == set(aot.STEPS)
    s_max = eng.s_buckets[-1]
    want = {"decode": (s_max, s_max, True), "prefill": max(x for x in shapes if not x[2])}
    assert want["prefill"] == (max_num_batched_tokens, s_max, False)
    for name, p in progs.items():
        assert (p.tokens, p.seqs, p.decode_only) == want[name.removesuffix("-greedy")], name
        assert p.greedy == name.endswith("-greedy")
        assert (p.tokens, p.seqs, p.decode_only) in shapes
        # the engine's decode-only greedy step is its decode-steps program (num_scheduler_steps, default 8)
        assert p.decode_steps == (eng.config.num_scheduler_steps if name == "decode-greedy" else 0), name
    one = aot.programs(aot.AotRequest(cfg=cfg, max_model_len=256, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens, num_scheduler_steps=1))
    assert not any(p.decode_steps for p in one.values())
    # the padding inputs carry the program's decode_only flag on every group, as LLMEngine.precompile sets it
    spec = aot._spec(aot.AotRequest(cfg=cfg, max_model_len=256), (2, 2), "ref")
    for p in progs.values():
        inp = aot.program_inputs(spec, p)
        assert inp.token_ids.shape == (p.tokens,) and inp.logits_indices.shape == (p.seqs,)
        assert all(m.decode_only == p.decode_only for m in inp.metas)
        assert all(m.decode_only for m in inp.shared_metas)


def test_unknown_step_is_an_error():
    req = aot.AotRequest(cfg=tiny_cfg(), max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64,
                         steps=("decode", "verify"))
    with pytest.raises(ValueError, match="expected one or more of"):
        aot.analyze(req)


# --------------------------------------------------------------------------------------------- the compiler

@needs_libtpu
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_chip_limits_are_the_compilers(chip):
    """CHIPS' hbm_limit is what the TPU compiler enforces: a 40 GiB argument fails, naming that limit."""
    target = aot.Target.create(chip)
    big = jax.ShapeDtypeStruct((40 << 10, 1 << 20), jnp.int8, sharding=target.sharding)
    with pytest.raises(Exception) as e:
        jax.jit(lambda a: a[:8, :128].astype(jnp.float32)).lower(big).compile()
    need = aot.parse_oom(str(e.value))
    assert need is not None, str(e.value)[:300]
    assert need[0] >= 40 * GiB
    assert abs(need[1] - aot.CHIPS[chip].hbm_limit) < 0.01 * GiB


def test_parse_oom_units():
    msg = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for "
           "HLO temporaries (18.00G) exceeds available HBM (15.75G). HLO module: jit_step.")
    assert aot.parse_oom(msg) == (int(18 * GiB), int(15.75 * GiB))
    assert aot.parse_oom("INTERNAL: something else") is None
    # the other wording (seen from libtpu 0.0.52 compiling 26b-a4b w4a16+emb4 for v5e with a cache 5.90M too big)
    msg2 = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out of memory in "
            "memory space hbm. Used 15.75G of 15.75G hbm. Exceeded hbm capacity by 5.90M.")
    assert aot.parse_oom(msg2) == (int(15.75 * GiB) + int(5.90 * (1 << 20)), int(15.75 * GiB))


def test_31b_bf16_does_not_fit_v5e_without_compiling():
    out = io.StringIO()
    rc = aot.run(args(model="31b", chip="v5e", quant="none"), out=out)
    text = out.getvalue()
    assert rc == aot.EXIT_DOES_NOT_FIT
    assert "DOES NOT FIT" in text and "decided without compiling" in text and "57.18 GiB" in text


def test_run_takes_a_model_config():
    # a tiny model whose one 2**20-token sequence needs 2 GiB of KV, on a chip asked to keep 15 GiB free
    out = io.StringIO()
    a = args(max_model_len=1 << 20, max_num_seqs=1, margin_mib=15 * 1024)
    rc = aot.run(a, cfg=tiny_cfg().replace(max_position_embeddings=1 << 20), out=out)
    assert rc == aot.EXIT_DOES_NOT_FIT and "tiny" in out.getvalue() and "decided without compiling" in out.getvalue()


def test_cli_aot_routes_to_run():
    from gemmajax.server import cli

    assert cli.main(["aot", "--model", "31b", "--chip", "v5e"]) == aot.EXIT_DOES_NOT_FIT


def test_bad_topology_is_unsupported(capsys):
    for topo in ("4x4", "2x3", "2"):
        assert aot.run(args(model="31b", chip="v6e", quant="w4a16", topology=topo)) == aot.EXIT_UNSUPPORTED
        err = capsys.readouterr().err
        assert f"topology {topo!r} is not supported" in err and "['1x1', '2x2', '2x4']" in err, err
    # expert parallelism on a dense model names the model and the flag
    assert aot.run(args(model="31b", chip="v5e", topology="2x2", enable_expert_parallel=True)) == \
        aot.EXIT_UNSUPPORTED
    assert "enable_expert_parallel: model 31b has no experts" in capsys.readouterr().err


@needs_libtpu
def test_tiny_model_fits_v5e_with_pallas_and_proof_compile():
    """The whole path on a tiny model: probe compiles of decode and prefill, the KV budget, the proof compile."""
    req = aot.request_from_args(args(quant="w8a8+emb4", max_model_len=1024, max_num_seqs=8,
                                     max_num_batched_tokens=64), cfg=tiny_cfg())
    res = aot.analyze(req)
    text = aot.format_report(res)
    r = json.loads(json.dumps(res.to_json()))
    assert r["fits"] and r["exit_code"] == 0 and text.splitlines()[-1].startswith("FITS")
    for line in text.splitlines():  # every tok/s figure is labelled a projection
        if "tok/s" in line:
            assert line.count("(projection)") == line.count("tok/s"), line
    assert r["attn_impl"] == "pallas"
    # the engine's programs (max_num_seqs 8, 64 batched tokens): all-decode (8, 8) and the largest mixed step (64, 8),
    # each as the greedy (tokens) and the logits variant
    got = [(c["step"], c["tokens"], c["seqs"], c["decode_only"], c["greedy"]) for c in r["compiles"]]
    assert got == [("decode", 8, 8, True, False), ("decode-greedy", 8, 8, True, True),
                   ("prefill", 64, 8, False, False), ("prefill-greedy", 64, 8, False, True)]
    by = {c["step"]: c for c in r["compiles"]}
    # decode-greedy is the engine's program of 8 decode steps (num_scheduler_steps): tokens [8, 8] and [8] out
    assert [by[k]["decode_steps"] for k in aot.STEPS] == [0, 8, 0, 0]
    for kind in ("decode", "prefill"):  # the greedy variant returns tokens int32 [8] ([8, 8] + [8] for decode)
        saved = by[kind]["output_bytes"] - by[kind + "-greedy"]["output_bytes"]  # instead of logits f32 [8, 1024]
        # the TPU pads [8] int32 to a 512-byte tile, [8, 8] to a 4 KiB one
        assert 8 * 1024 * 4 - (8192 if kind == "decode" else 4096) <= saved < 8 * 1024 * 4, (kind, saved)
    # the TPU kernels are in the program: one attention call per layer (4), the int8 matmuls of every projection
    assert all(c["pallas_calls"] > 4 + 4 * 5 for c in r["compiles"])
    proof = r["proof"]
    peak = (proof["argument_bytes"] + proof["output_bytes"] - proof["alias_bytes"] + proof["temp_bytes"]
            + proof["code_bytes"])
    limit = aot.CHIPS["v5e"].hbm_limit
    assert limit - r["margin_bytes"] - 64 * (1 << 20) < peak <= limit  # the cache fills the chip, and compiled
    assert proof["kv_bytes"] == r["kv_cache_bytes"] > 14 * GiB
    # the windowed sliding layer: a 1024-token sequence holds 5 sliding pages (window 64 + 2 positions, + 2) of
    # 32 x 1 KiB and 33 full pages of 32 x 2 KiB, against vLLM-style 1 KiB + 2 KiB for every token
    ours = (5 * 32 * 1024 + 33 * 32 * 2048) / 1024
    assert r["kv_bytes_per_token_ours"] == pytest.approx(ours) and r["kv_bytes_per_token_vllm"] == 3072
    assert r["kv_tokens"] / r["kv_tokens_vllm_style"] == pytest.approx(3072 / ours, rel=0.01)
    assert r["projection"]["tok_s_16"] > r["projection"]["tok_s_1"]


@needs_libtpu
def test_fast_mode_lets_the_compiler_overrule_a_bad_guess():
    """The fit table's fast mode: a guess that leaves no room must not decide; the compiler does, with the
    smallest cache, and the cache is then resized to the overhead the compile measured."""
    req = aot.AotRequest(cfg=tiny_cfg(), chip="v5e", max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64,
                         probe=False, steps=("prefill",), overhead_guess=20 * GiB)
    r = aot.analyze(req)
    assert r.fits, r.reason
    assert len(r.compiles) == 1 and r.compiles[0] is r.proof and r.proof.ok
    assert r.kv_cache_bytes > 14 * GiB and r.proof.peak_bytes <= aot.CHIPS["v5e"].hbm_limit


@needs_libtpu
def test_fast_mode_compiles_every_program_at_full_size():
    """The fit table's settings: every program the engine runs is compiled with the proven cache (the last of
    `steps` first), and the reported proof is the one with the highest peak."""
    steps = ("decode", "decode-greedy", "prefill-greedy", "prefill")
    req = aot.AotRequest(cfg=tiny_cfg(), chip="v5e", max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64,
                         probe=False, steps=steps)
    r = aot.analyze(req)
    assert r.fits, r.reason
    assert [c.step for c in r.compiles] == ["prefill", "decode", "decode-greedy", "prefill-greedy"]
    assert all(c.ok and c.kv_pages == r.proof.kv_pages for c in r.compiles)
    assert r.proof is max(r.compiles, key=lambda c: c.peak_bytes) and "all 4 steps compile" in r.reason
    assert r.proof.peak_bytes <= aot.CHIPS["v5e"].hbm_limit and r.kv_cache_bytes > 14 * GiB


@needs_libtpu
def test_compiler_decides_does_not_fit():
    """Weights pass the cheap check, but the step's logits ([S, V] float32, 16 GiB) exceed the chip."""
    cfg = tiny_cfg(vocab=1 << 23)
    req = aot.AotRequest(cfg=cfg, chip="v5e", max_model_len=256, max_num_seqs=512, max_num_batched_tokens=512,
                         steps=("decode",))
    r = aot.analyze(req)
    assert not r.fits
    assert "does not compile" in r.reason and "exceeds available HBM" in r.reason
    assert r.compiles and r.compiles[0].oom is not None


# --------------------------------------------------------------------------------------------- full size (slow)

@pytest.mark.slow
@needs_libtpu
def test_e2b_w8a8_fits_v5e():
    out = io.StringIO()
    rc = aot.run(args(model="e2b", quant="w8a8", max_model_len=2048, max_num_seqs=16, json=True), out=out)
    r = json.loads(out.getvalue())
    assert rc == 0 and r["fits"] and r["kv_tokens"] > r["kv_tokens_vllm_style"]


@pytest.mark.slow
@needs_libtpu
def test_12b_w8a8_emb4_fits_v5e():
    # anchors.md: vLLM-TPU serves 12B W8A8 + int4 embeddings (11.31 GiB) on one v5e with 9,728 KV tokens.
    out = io.StringIO()
    rc = aot.run(args(model="12b", quant="w8a8+emb4", max_model_len=8192, max_num_seqs=16, json=True), out=out)
    r = json.loads(out.getvalue())
    assert rc == 0 and r["fits"]
    assert r["kv_tokens"] > 9728


def test_kv_dtype_auto_is_the_model_dtype():
    """`--kv-dtype auto` (the default, as the engine's) sizes bf16 pages for the bf16 weights aot compiles."""
    assert aot.AotRequest(cfg=tiny_cfg()).kv_dtype == "auto"
    out = io.StringIO()
    assert aot.run(args(model="31b", chip="v5e", quant="none", kv_dtype="auto", json=True), out=out) == \
        aot.EXIT_DOES_NOT_FIT
    assert json.loads(out.getvalue())["kv_dtype"] == "bf16"


# --------------------------------------------------------------------------------------------- slices (2x2, 2x4)

def tiny4_cfg() -> ModelConfig:
    """tiny_cfg with 4 query heads (they split over 4 chips) and 2 KV heads per layer (fewer than the chips: the K/V
    projections stay whole, each head's pages are stored twice, one head per chip)."""
    cfg = ModelConfig.from_hf(_g4(256, 4, 4, 2, 1, 512, 2, 64, ple=64, shared=2, double=True), name="tiny4")
    return cfg.replace(vocab_size=1024, ple_vocab_size=1024)


def _chip_weight_bytes_by_hand(cfg: ModelConfig, chips: int) -> tuple[int, int]:
    """(total, one chip's) bf16 weight bytes from the HF tensor list: q / o / gate / up / down and both vocabulary
    tables split in `chips` pieces (Megatron's layout; 4 query heads and the widths divide), K/V projections (2 KV
    heads < chips), the PLE projections, norms (float32) and scalars whole on every chip."""
    split = ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens.", "embed_tokens_per_layer.")
    total = chip = 0
    for name, shape in cfg.param_shapes().items():
        b = math.prod(shape) * (4 if gemma.is_norm(name) else 2)
        total += b
        chip += b // chips if any(k in name for k in split) else b
    return total, chip


def test_slice_weights_and_kv_per_chip():
    """v5e 2x2 without compiling: one chip holds a quarter of every split leaf plus the replicated ones, by hand;
    KV pages cost one stored head per chip (half the logical page: 2 heads, each stored twice over 4 chips)."""
    cfg = tiny4_cfg()
    target = aot.Target.create("v5e", "2x2", cfg)
    assert target.num_chips == 4 and target.plan.size == 4
    w = target.abstract_weights(aot.abstract_model_weights(cfg, "none"))
    total, chip = _chip_weight_bytes_by_hand(cfg, 4)
    assert aot.tree_bytes(w) == total and aot.chip_bytes(w) == chip
    assert chip < total / 2
    spec = aot._spec(aot.AotRequest(cfg=cfg, kv_dtype="bf16", max_model_len=1024), (1, 1), "pallas", target.plan)
    # sliding layer: K=2, H=256, 32 tokens, K and V, bf16; full layer H=512. One stored head per chip.
    assert spec.page_bytes() == [2 * 2 * 32 * 256 * 2, 2 * 2 * 32 * 512 * 2]
    assert aot.chip_page_bytes(spec) == [2 * 1 * 32 * 256 * 2, 2 * 1 * 32 * 512 * 2]
    kv = aot.plan_kv(cfg, 1 << 30, max_model_len=1024, chunk=64, page_size=32, kv_dtype="bf16", plan=target.plan)
    one = aot.plan_kv(cfg, 1 << 30, max_model_len=1024, chunk=64, page_size=32, kv_dtype="bf16")
    assert kv.cache_bytes * 2 == kv.logical_bytes and kv.cache_bytes <= 1 << 30
    assert kv.tokens == pytest.approx(2 * one.tokens, rel=0.01)   # the same chip budget holds twice the context


@needs_libtpu
def test_tiny_model_fits_v5e_2x2_per_chip():
    """The whole path over a v5e 2x2 slice (tensor parallel 4): the compiler's per-chip arguments are our per-chip
    weights + KV pages (+ step inputs), the cache fills one chip's HBM, the projection reads one chip's shards."""
    req = aot.AotRequest(cfg=tiny4_cfg(), chip="v5e", topology="2x2", kv_dtype="bf16", max_model_len=1024,
                         max_num_seqs=8, max_num_batched_tokens=64, steps=("prefill-greedy",))
    r = aot.analyze(req)
    assert r.fits, r.reason
    total, chip = _chip_weight_bytes_by_hand(req.cfg, 4)
    assert (r.num_chips, r.weight_bytes, r.weight_bytes_per_chip) == (4, total, chip)
    assert r.kv_cache_bytes == 2 * r.kv_cache_bytes_per_chip
    p = r.proof
    assert p.kv_bytes == r.kv_cache_bytes_per_chip > 14 * GiB
    assert chip + p.kv_bytes <= p.argument_bytes < chip + p.kv_bytes + (1 << 20)   # + step inputs
    limit = aot.CHIPS["v5e"].hbm_limit
    assert limit - r.margin_bytes - 64 * (1 << 20) < p.peak_bytes <= limit
    assert p.pallas_calls == 4                    # the attention kernel of every layer, under shard_map
    text = aot.format_report(r)
    assert "tensor parallel 4" in text and "per chip" in text.splitlines()[-1]
    # the projection: one chip reads its weight shards (the tied LM head's quarter in full, a quarter of the rows
    # gathered) and one of each layer's 2 KV heads
    plain = aot.abstract_model_weights(req.cfg)
    w1, kv1 = aot.decode_bytes_read(req.cfg, plain, 1, 1024, "bf16")
    assert r.projection.kv_read_per_seq == pytest.approx(kv1 / 2)
    ple, embed = aot.tree_bytes(plain.ple_table), aot.tree_bytes(plain.embed)
    row = ple / 1024 + embed / 1024                # one PLE row and one embedding row, bf16
    assert r.projection.weights_read == pytest.approx(chip - ple / 4 + row / 4)
    assert w1 == pytest.approx(total - ple + row)
    assert r.projection.tok_s_1 == pytest.approx(aot.CHIPS["v5e"].bandwidth / (chip - ple / 4 + row / 4 + kv1 / 2))


def test_31b_bf16_v5e_2x2_at_128k_does_not_fit(capsys):
    """The issue's case: 57 GiB of weights and one 131072-token sequence's KV over 4 x 15.75 GiB. Decided without
    compiling, per chip: a quarter of the split weights plus the replicated ones, a quarter of the KV."""
    out = io.StringIO()
    rc = aot.run(args(model="31b", chip="v5e", topology="2x2", quant="none", kv_dtype="auto", max_model_len=131072,
                      max_num_seqs=16, json=True), out=out)
    r = json.loads(out.getvalue())
    assert rc == aot.EXIT_DOES_NOT_FIT and not r["fits"] and "decided without compiling" in r["reason"]
    assert r["weight_bytes"] / GiB == pytest.approx(57.18, abs=0.01)
    chip = r["weight_bytes_per_chip"]
    assert chip == pytest.approx(r["weight_bytes"] / 4, rel=0.01) and chip > r["weight_bytes"] / 4
    # one sequence's KV, by hand: 50 sliding layers x 16 KV heads x 256 over window 1024 + 2 (33 pages, +2) and
    # 10 full layers x 4 KV heads x 512 (K = V) over 131072 (+1 page), both stored K and V, bf16; beside it the
    # null pages and the step's 512-token chunk of sliding pages (16 + 1); a quarter per chip
    sliding_page, full_page = 50 * 32 * 2 * 16 * 256 * 2, 10 * 32 * 2 * 4 * 512 * 2
    seq = (33 + 2) * sliding_page + (4096 + 1) * full_page
    fixed = (1 + 17) * sliding_page + full_page
    assert seq / GiB == pytest.approx(10.86, abs=0.01)   # "11 GiB" in the issue
    assert f"({(seq + fixed) / 4 / GiB:.2f} GiB of" in r["reason"]
    assert chip + seq / 4 > aot.CHIPS["v5e"].hbm_limit


@needs_libtpu
@pytest.mark.parametrize("quant", ["w8a8", "w4a16"])
def test_quantized_matmuls_on_a_slice_compile_per_shard(quant):
    """The quantized matmul kernels run per shard under shard_map (gemmajax.quant.sharded), so a quantized model
    compiles for a v5e 2x2 slice: every projection and the LM head is a Pallas call beside the attention kernel,
    and one chip holds its shards of the split weights."""
    req = aot.AotRequest(cfg=tiny4_cfg(), chip="v5e", topology="2x2", quant=quant, kv_dtype="bf16",
                         max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64, steps=("decode-greedy",))
    r = aot.analyze(req)
    assert r.fits, r.reason
    p = r.proof
    # 4 attention calls; quantized: q / o / gate / up / down in every layer, k / v in the 2 KV-owning ones, the LM head
    assert p.pallas_calls >= 4 + 4 * 5 + 2 * 2 + 1, p.pallas_calls
    # int8 splits along `in` too; int4 never does (o_proj / down_proj whole on every chip, as the PLE projections)
    assert r.weight_bytes / 4 <= r.weight_bytes_per_chip < r.weight_bytes / (2 if quant == "w8a8" else 1.6)


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("model,chip,quant,ep", [
    ("31b", "v6e", "none", False), ("31b", "v5e", "w8a8", False), ("26b-a4b", "v5e", "w8a8", True)])
def test_full_size_fits_a_2x2_slice(model, chip, quant, ep):
    """The issue's targets at max_model_len 8192, 16 sequences: 31B bf16 on v6e 2x2, 31B and 26B-A4B w8a8 on v5e
    2x2 (26B-A4B with expert parallelism)."""
    out = io.StringIO()
    rc = aot.run(args(model=model, chip=chip, topology="2x2", quant=quant, kv_dtype="auto", max_model_len=8192,
                      max_num_seqs=16, enable_expert_parallel=ep, json=True), out=out)
    r = json.loads(out.getvalue())
    assert rc == 0 and r["fits"], r["reason"]
    assert r["weight_bytes"] / 4 <= r["weight_bytes_per_chip"] < r["weight_bytes"] / 3
    p = r["proof"]
    assert p["kv_bytes"] == r["kv_cache_bytes_per_chip"] and r["kv_seqs_at_max_len"] >= 1
    assert r["weight_bytes_per_chip"] + p["kv_bytes"] <= p["argument_bytes"]
    assert p["argument_bytes"] + p["temp_bytes"] <= aot.CHIPS[chip].hbm_limit


# --------------------------------------------------------------------------------------------- speculative decoding

def tiny_drafter(backbone: int = 256):
    """A gemma4_assistant for tiny_cfg: 2 Q-only layers (sliding, full) of width 128 over the target's K/V, centroid
    masking (16 clusters of 64 tokens, the top 4 kept)."""
    from gemmajax.model.assistant import AssistantConfig

    t = _g4(128, 2, 2, 1, None, 256, 2, 64)
    t.update(vocab_size=1024, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=2)
    return AssistantConfig.from_hf({"model_type": "gemma4_assistant", "text_config": t, "backbone_hidden_size": backbone,
                                    "use_ordered_embeddings": True, "num_centroids": 16,
                                    "centroid_intermediate_top_k": 4}, name="tiny-drafter")


def test_verify_programs_are_the_engines():
    """With a drafter every program returns the hidden state, and the verify step is all 8 sequences' newest token and
    4 drafts: T = R = 40 tokens padded to the 64-token bucket, logits (or tokens) at every row."""
    req = aot.AotRequest(cfg=tiny_cfg(), max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64,
                         draft=tiny_drafter(), kv_dtype="bf16")
    progs = aot.programs(req)
    assert all(p.hidden for p in progs.values()) and set(progs) == set(aot.STEPS + aot.SPEC_STEPS)
    assert not any(p.decode_steps for p in progs.values())   # a drafter's engine runs one step a program
    v = progs["verify-greedy"]
    assert (v.tokens, v.seqs, v.rows, v.decode_only, v.greedy) == (64, 8, 64, False, True)
    inp = aot.program_inputs(aot._spec(req, (2, 2), "ref"), v)
    assert inp.token_ids.shape == (64,) and inp.logits_indices.shape == (64,)
    assert not any(p.hidden for p in aot.programs(dataclasses.replace(req, draft=None)).values())


@needs_libtpu
def test_tiny_model_with_drafter_fits_v5e():
    """The verify step and the drafter's 4-step program compile for v5e; the drafter's bytes (by hand from its HF
    tensor list) are held beside the target's and taken from the KV budget; the speculative projection uses the
    assumed acceptance and says so."""
    acfg = tiny_drafter()
    req = aot.AotRequest(cfg=tiny_cfg(), chip="v5e", max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64,
                         kv_dtype="bf16", draft=acfg, steps=("verify-greedy",), num_speculative_tokens=4,
                         assumed_acceptance=0.7)
    r = aot.analyze(req)
    assert r.fits, r.reason
    draft = sum(math.prod(s) * (4 if gemma.is_norm(n) or n.endswith("token_ordering") else 2)
                for n, s in acfg.param_shapes().items())
    assert r.draft_weight_bytes == draft
    by = {c.step: c for c in r.compiles}
    assert set(by) == {"verify-greedy", "draft"}
    v, d = by["verify-greedy"], by["draft"]
    assert v.output_bytes - v.alias_bytes >= 64 * 256 * 2                      # tokens [64] and hidden [64, 256] bf16
    assert d.weight_bytes == draft + 1024 * 256 * 2 and d.pallas_calls == 2   # + the target's embedding; 2 layers
    assert d.argument_bytes >= d.weight_bytes + d.kv_bytes
    limit = aot.CHIPS["v5e"].hbm_limit
    extra = max(c.overhead_bytes - c.weight_bytes for c in r.compiles)
    assert r.kv_budget_bytes == limit - r.margin_bytes - r.weight_bytes - draft - extra
    assert r.proof.step == "verify-greedy" and r.proof.peak_bytes + draft <= limit
    p = r.projection
    assert p.tokens_per_round == pytest.approx((1 - 0.7 ** 5) / 0.3)
    # one draft step at 1 stream: the drafter less its vocabulary table, plus the 4 x 64 rows it selects, one target
    # embedding row of 256 bf16, and the target K/V of its 2 layers (sliding: window 64 + 1, full: 1024 tokens)
    assert [(s.window, s.num_kv_heads, s.head_dim) for s in acfg.text.layers] == [(65, 1, 256), (None, 1, 512)]
    table = 1024 * 128 * 2
    d1 = draft - table + 4 * 64 * 128 * 2 + 256 * 2 + 65 * 2 * 256 * 2 + 1024 * 2 * 512 * 2
    assert p.draft_bytes_1 == pytest.approx(d1)
    assert p.spec_tok_s_1 == pytest.approx(819e9 * p.tokens_per_round / (p.bytes_1 + 4 * d1))
    text = aot.format_report(r)
    line = next(x for x in text.splitlines() if "speculative" in x)
    assert "ASSUMED acceptance rate 0.70" in line and line.count("tok/s") == line.count("(projection)") == 2


def test_drafter_errors_are_unsupported(capsys):
    a = args(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64)
    assert aot.run(a, cfg=tiny_cfg(), draft=tiny_drafter(backbone=512)) == aot.EXIT_UNSUPPORTED
    assert "backbone_hidden_size=512 but the target's hidden_size is 256" in capsys.readouterr().err
    assert aot.run(args(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64, topology="2x2"),
                   cfg=tiny4_cfg(), draft=tiny_drafter()) == aot.EXIT_UNSUPPORTED
    assert "only 1x1 is compiled" in capsys.readouterr().err
    assert aot.run(args(speculative_model="/nonexistent")) == aot.EXIT_UNSUPPORTED
    assert "no config.json" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- vision / audio towers

def tiny_towers():
    """A vision tower (2 layers of width 64, 4x4 patches, clipped linears) and an audio tower (2 conformer layers of
    width 64), both projecting to tiny_cfg's width 256."""
    from gemmajax.model import audio as au
    from gemmajax.model import vision as vi
    from gemmajax.model.multimodal import MultimodalConfig

    return MultimodalConfig(
        vision=vi.VisionConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2,
                               head_dim=32, patch_size=4, position_embedding_size=128, use_clipped_linears=True,
                               text_hidden_size=256),
        audio=au.AudioConfig(hidden_size=64, num_layers=2, num_heads=2, output_proj_dims=64, text_hidden_size=256))


def _tower_bytes_by_hand(tower) -> int:
    """bf16 tensors of the checkpoint's tower, norms (and standardization buffers) float32 as the loader keeps them."""
    return sum(math.prod(s) * (4 if "norm" in n or n.endswith(("std_bias", "std_scale")) else 2)
               for n, s in tower.param_shapes().items())


def test_tower_presets_are_the_checkpoints():
    """Which towers each published size carries, projecting to its text width; their bytes from the tensor list."""
    from gemmajax.model import audio as au
    from gemmajax.model import vision as vi

    want = {"e2b": (vi.VisionConfig, au.AudioConfig), "e4b": (vi.VisionConfig, au.AudioConfig),
            "12b": (vi.UnifiedVisionConfig, au.UnifiedAudioConfig), "26b-a4b": (vi.VisionConfig, type(None)),
            "31b": (vi.VisionConfig, type(None))}
    for model in aot.MODELS:
        t = aot.tower_preset(model)
        assert (type(t.vision), type(t.audio)) == want[model], model
        D = ModelConfig.preset(model).hidden_size
        assert all(getattr(t, n).text_hidden_size == D for n in aot.tower_names(t)), model
    e2b = aot.tower_preset("e2b")
    w = aot.abstract_tower_weights(e2b)
    assert aot.tree_bytes(w.vision) == _tower_bytes_by_hand(e2b.vision)
    assert aot.tree_bytes(w) == _tower_bytes_by_hand(e2b.vision) + _tower_bytes_by_hand(e2b.audio)
    # under w8a8 (+emb4: tables only) the projections are int8 with per-row scales, as load_multimodal makes them
    assert aot.tree_bytes(aot.abstract_tower_weights(e2b, "w8a8+emb4")) < 0.6 * aot.tree_bytes(w)


def test_encoder_programs_take_the_largest_inputs():
    """280 soft tokens per image (x 9 patches; the 12B's merged patches 1:1); 30 s of audio: 2,999 log-mel frames
    padded to 3,072 (768 soft-token rows, 750 of them valid), the 12B's 750 raw 640-sample frames."""
    for model, vision, audio in (("e2b", (1, 2520, 768), (1, 3072, 128)), ("12b", (1, 280, 6912), (1, 750, 640))):
        t = aot.tower_preset(model)
        _, (x, p), desc, rows = aot.encoder_program(t.vision)
        assert (x.shape, p.shape, rows) == (vision, vision[:2] + (2,), 280) and "280 soft tokens" in desc
        _, (f, m), desc, rows = aot.encoder_program(t.audio)
        assert (f.shape, m.shape) == (audio, audio[:2]) and "30 s" in desc
        assert rows == (768 if model == "e2b" else 750)
    with pytest.raises(ValueError, match="expected a VisionConfig, .* got ModelConfig"):
        aot.encoder_program(tiny_cfg())


def test_towers_in_the_cheap_check_and_no_mm():
    """31B bf16 on a v5e is decided without compiling; its vision tower's bytes are in the sum, and --no-mm takes
    them out (and says what they would have held)."""
    out = io.StringIO()
    assert aot.run(args(model="31b", chip="v5e", json=True), out=out) == aot.EXIT_DOES_NOT_FIT
    r = json.loads(out.getvalue())
    tower = _tower_bytes_by_hand(aot.tower_preset("31b").vision)
    assert (r["towers"], r["mm"], r["tower_weight_bytes"], r["encoders"]) == ("vision", True, tower, [])
    assert f"57.18 GiB + the vision towers {tower / 2**20:.1f} MiB (--no-mm" in r["reason"]
    assert "decided without compiling" in r["reason"]
    out = io.StringIO()
    assert aot.run(args(model="31b", chip="v5e", no_mm=True), out=out) == aot.EXIT_DOES_NOT_FIT
    text = out.getvalue()
    assert "text only (--no-mm): the vision towers are not loaded" in text and f"{tower / 2**20:.1f} MiB" in text
    assert "towers" not in text.splitlines()[-1]


def test_cli_aot_takes_no_mm():
    from gemmajax.server import cli

    assert cli.main(["aot", "--model", "31b", "--chip", "v5e", "--no-mm"]) == aot.EXIT_DOES_NOT_FIT


def _tiny_tower_runs(probe: bool):
    """The tiny model with tiny_towers for v5e, and the same request with --no-mm; the checks both modes share: each
    encoder compiles (weights = its tensors by hand), the towers' bytes come out of the KV budget exactly, the report
    and JSON name each encoder; --no-mm compiles none and keeps the bytes."""
    towers = tiny_towers()
    a = args(kv_dtype="bf16", max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64)
    req = dataclasses.replace(aot.request_from_args(a, cfg=tiny_cfg(), towers=towers), steps=("prefill-greedy",),
                              max_soft_tokens=70, audio_seconds=0.5, probe=probe, overhead_guess=64 << 20)
    r = aot.analyze(req)
    assert r.fits, r.reason
    vision, audio = _tower_bytes_by_hand(towers.vision), _tower_bytes_by_hand(towers.audio)
    assert r.tower_weight_bytes == vision + audio
    enc = {e.name: e for e in r.encoders}
    assert list(enc) == ["vision", "audio"] and all(e.ok for e in enc.values())
    assert (enc["vision"].weight_bytes, enc["audio"].weight_bytes) == (vision, audio)
    assert enc["vision"].input_shape == (1, 70 * 9, 48) and enc["vision"].soft_tokens == 70
    assert enc["audio"].input_shape == (1, 128, 128) and enc["audio"].soft_tokens == 32   # 0.5 s: 49 frames -> 128
    for e in enc.values():   # the program takes the tower and its inputs; it has work to do
        assert e.argument_bytes >= e.weight_bytes + math.prod(e.input_shape) * 4 and e.temp_bytes > 0
        assert e.flops > 2 * 2 * 64 * 64 * e.soft_tokens
    text_only = aot.analyze(dataclasses.replace(req, mm=False))
    assert text_only.fits and text_only.encoders == [] and text_only.tower_weight_bytes == 0
    assert text_only.tower_weight_bytes_skipped == vision + audio
    assert text_only.kv_budget_bytes - r.kv_budget_bytes == vision + audio
    # the proof's program holds the text weights and the cache; the towers are held beside it
    p = r.proof
    assert r.peak_bytes == p.peak_bytes + vision + audio <= aot.CHIPS["v5e"].hbm_limit
    assert p.weight_bytes == r.weight_bytes_per_chip
    text = aot.format_report(r)
    for name, tower in (("vision", "VisionConfig"), ("audio", "AudioConfig")):
        line = next(x for x in text.splitlines() if x.startswith(f"  encoder {name}"))
        assert tower in line and f"temporaries {enc[name].temp_bytes / 2**20:.1f} MiB" in line, line
    assert "not their sum" in text and "towers" in text.splitlines()[-1]
    j = json.loads(json.dumps(r.to_json()))
    assert [e["name"] for e in j["encoders"]] == ["vision", "audio"] and j["tower_weight_bytes"] == vision + audio
    assert "encoder" not in aot.format_report(text_only).replace("no encoder", "")
    return r, text_only


@needs_libtpu
def test_tiny_encoders_compile_for_v5e():
    """compile_encoders alone (no text step): both tiny encoders compile deviceless, their weights are the towers'
    tensors by hand, their programs take those weights and inputs and do at least their projections' FLOPs."""
    towers = tiny_towers()
    target = aot.Target.create("v5e")
    encs = aot.compile_encoders(target, towers, max_soft_tokens=70, audio_seconds=0.5)
    assert [(e.name, e.tower) for e in encs] == [("vision", "VisionConfig"), ("audio", "AudioConfig")]
    for e, tower in zip(encs, (towers.vision, towers.audio)):
        assert e.ok, e.oom or e.error
        assert e.weight_bytes == _tower_bytes_by_hand(tower)
        assert e.argument_bytes >= e.weight_bytes + math.prod(e.input_shape) * 4 and e.temp_bytes > 0
        assert e.flops >= 2 * e.soft_tokens * 256 * 64    # at least the final projection to the text width


@pytest.mark.slow   # two step compiles and two encoders: ~45 s on two loaded cores
@needs_libtpu
def test_tiny_towers_come_out_of_the_kv_budget_fast_mode():
    """One compile per program (probe=False, a 64 MiB overhead guess above both encoders' buffers): the budget is
    the chip less weights, towers, the guess and the margin, so --no-mm gives exactly the towers back."""
    r, _ = _tiny_tower_runs(probe=False)
    assert len(r.compiles) == 1 and max(e.extra_bytes for e in r.encoders) < 64 << 20


@pytest.mark.slow   # four step compiles and two encoders: ~80 s on two loaded cores
@needs_libtpu
def test_tiny_towers_come_out_of_the_kv_budget():
    """The default path (every step probed with a small cache, then proven): the encoders' buffers are under the
    step's (the programs run one at a time, so only the larger counts), and the towers' bytes alone leave the
    budget."""
    r, _ = _tiny_tower_runs(probe=True)
    step_extra = max(c.overhead_bytes - c.weight_bytes for c in r.compiles if c is not r.proof)
    enc_extra = max(e.extra_bytes for e in r.encoders)
    assert enc_extra < step_extra, (enc_extra, step_extra)
    assert r.kv_budget_bytes == (aot.CHIPS["v5e"].hbm_limit - r.margin_bytes - r.weight_bytes - r.tower_weight_bytes
                                 - step_extra)
