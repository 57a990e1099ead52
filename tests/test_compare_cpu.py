"""bench/compare_cpu.py's merge of rounds: the table's row is each figure's own best over the rounds, whichever
round made it, and the rounds themselves stay as measured (the spread printed under the table reads them)."""
import argparse
import importlib.util
import os
import sys

from tests.bench_scripts import BENCH, load_bench

compare_cpu = load_bench("compare_cpu")


def test_each_figure_keeps_its_own_best_round():
    r0 = {"engine": "gemmajax", "mode": "w4a16", "tok_s_1": 40.8, "tok_s_16": 271.7, "ttft_s_1": 0.05,
          "ttft_s_16": 0.309, "round": 0}
    r1 = {"engine": "gemmajax", "mode": "w4a16", "tok_s_1": 50.2, "tok_s_16": 265.9, "ttft_s_1": 0.06,
          "ttft_s_16": 0.316, "round": 1}
    rounds = [dict(r0), dict(r1)]
    got = compare_cpu.best_of_rounds(rounds)
    # round 1 has the better 1-stream figure, round 0 the better 16-stream and TTFT figures: each keeps its own
    assert (got["tok_s_1"], got["tok_s_16"], got["ttft_s_1"], got["ttft_s_16"]) == (50.2, 271.7, 0.05, 0.309)
    assert got["round"] == 1  # the other fields come from the round with the most tok/s at 1 stream
    assert compare_cpu.best_of_rounds(rounds, "tok_s_16")["round"] == 0  # or at the stream count the run starts with
    assert rounds == [r0, r1]  # the rounds are not written into (the spread prints them as measured)
    args = argparse.Namespace(streams=[1, 16])
    lines = compare_cpu.spread({"gemmajax:w4a16": rounds}, args)
    assert lines[1] == "  gemmajax:w4a16: 40.8/271.7, 50.2/265.9 (1-stream spread 23%)"


def test_failed_rounds_are_left_out_and_an_all_failed_config_stays_an_error():
    ok = {"engine": "llama.cpp", "mode": "t2", "tok_s_1": 60.0, "ttft_s_1": 0.05}
    bad = {"engine": "llama.cpp", "mode": "t2", "error": "child exit 1: boom"}
    assert compare_cpu.best_of_rounds([dict(bad), dict(ok)]) == ok
    assert compare_cpu.best_of_rounds([dict(ok), dict(bad)]) == ok
    assert compare_cpu.best_of_rounds([dict(bad), dict(bad)])["error"] == bad["error"]
    lines = compare_cpu.spread({"llama.cpp:t2": [bad, ok], "x:y": [bad]}, argparse.Namespace(streams=[1, 16]))
    assert lines[1:] == ["  llama.cpp:t2: 60.0/- (1-stream spread 0%)"]


def test_loading_compare_cpu_leaves_bench_off_the_import_path():
    # bench/kernels.py on sys.path shadows the `kernels` package transformers imports; collecting this file once put
    # it there and broke every HF-building test after it in the session
    bench = os.path.realpath(BENCH)
    assert all(os.path.realpath(p or os.curdir) != bench for p in sys.path)  # realpath: a symlink to bench/ too
    spec = importlib.util.find_spec("kernels")
    assert spec is None or not os.path.realpath(spec.origin or "").startswith(bench + os.sep)


# GEMM floors by weight kind (seconds: layers, LM head) at 1 and 16 rows, as gemm_floor.measure() returns them
KIND_FLOOR = {"bf16": {1: (6e-3, 9e-3), 16: (20e-3, 30e-3)},
              "int8": {1: (3.7e-3, 4.8e-3), 16: (18e-3, 28e-3)},
              "int4": {1: (6.5e-3, 9.5e-3), 16: (21e-3, 33e-3)}}


def test_a_modes_floor_is_its_layers_kind_plus_its_heads_kind():
    mf = compare_cpu.mode_floor
    assert mf(KIND_FLOOR, "none", 1) == 6e-3 + 9e-3
    assert mf(KIND_FLOOR, "w8a8", 16) == 18e-3 + 30e-3  # int8 layers, the bf16 table
    assert mf(KIND_FLOOR, "w4a16+emb8", 1) == 6.5e-3 + 4.8e-3
    assert mf(KIND_FLOOR, "w8a8+emb4", 16) == 18e-3 + 33e-3
    assert mf(KIND_FLOOR, "w8a8", 64) is None and mf(None, "w8a8", 1) is None
    assert mf({"bf16": KIND_FLOOR["bf16"]}, "w4a16", 1) is None  # a kind that was not measured
    assert abs(compare_cpu.floor_ratio_vs_bf16(KIND_FLOOR, "w8a8+emb8", 1) - 15e-3 / 8.5e-3) < 1e-12
    assert abs(compare_cpu.floor_ratio_vs_bf16(KIND_FLOOR, "w4a16+emb4", 1) - 15e-3 / 16e-3) < 1e-12


def test_targets_say_which_failures_the_gemm_floors_put_out_of_reach():
    res = [{"engine": "gemmajax", "mode": "bf16", "tok_s_1": 60.0, "tok_s_16": 280.0, "ttft_s_16": 0.28},
           {"engine": "gemmajax", "mode": "w8a8+emb8", "tok_s_1": 100.0, "tok_s_16": 300.0, "ttft_s_16": 0.29},
           {"engine": "gemmajax", "mode": "w4a16+emb4", "tok_s_1": 55.0, "tok_s_16": 265.0, "ttft_s_16": 0.30},
           {"engine": "transformers", "mode": "bf16", "tok_s_1": 17.0, "tok_s_16": 184.0, "ttft_s_16": 0.297},
           {"engine": "llama.cpp", "mode": "Q4_K_M, 2 threads", "tok_s_1": 77.0}]
    args = argparse.Namespace(streams=[1, 16])
    quiet = {"load_before": 0.1, "load_after": 0.2, "foreign": 0.0}
    floor16 = {16: KIND_FLOOR["bf16"][16]}
    lines = compare_cpu.targets(res, args, quiet, floor16, KIND_FLOOR)

    def line(start):
        hits = [ln for ln in lines if ln.strip().startswith(start)]
        assert len(hits) == 1, (start, lines)
        return hits[0]
    # against bf16 the floors' ratio is printed, never judged: int4's GEMMs (16.0 ms) against bf16's (15.0)
    assert line("gemmajax w4a16+emb4 / gemmajax bf16 at 1 stream:").endswith(
        "0.92x (target >= 1x; GEMM floors bf16 / mode 0.94x): FAIL")
    assert line("gemmajax w8a8+emb8 / gemmajax bf16 at 1 stream:").endswith(
        "1.67x (target >= 1x; GEMM floors bf16 / mode 1.76x): PASS")
    # 1 / 16.0 ms = 62.5 tok/s at most, 0.81 of llama.cpp's 77
    assert line("gemmajax w4a16+emb4 / llama.cpp").endswith(
        "0.71x (target >= 1x; GEMM ceiling 0.81x): FAIL, out of reach with these GEMMs")
    # the best floor at 1 row (w8a8+emb8, 8.5 ms: 117.6 tok/s) allows 1.53x: a plain failure, not out of reach
    assert line("best gemmajax mode at 1 stream").endswith("1.30x (target >= 1.5x; GEMM ceiling 1.53x): FAIL")
    # 16 rows / 46 ms = 347.8 tok/s = 1.89x transformers' 184 < 2
    assert line("best gemmajax mode at 16 streams").endswith(
        "1.63x (target >= 2x; GEMM ceiling 1.89x): FAIL, out of reach with these GEMMs")
    # modes that did not run have no verdict beyond "missing"; TTFT has no ceiling
    assert line("gemmajax w8a8 / gemmajax bf16 at 1 stream:").endswith(": missing")
    assert line("TTFT of 16 prompts: transformers bf16 / gemmajax bf16:").endswith("1.06x (target >= 1x): PASS")
    # without the floors by kind the verdicts are the plain ones
    plain = compare_cpu.targets(res, args, quiet, floor16)
    assert not any("ceiling" in ln or "out of reach" in ln for ln in plain)

    # the rest-of-the-step child's figures for the best 16-stream mode: the bare step against its floor (18 + 28 =
    # 46 ms), the step without its GEMMs, and what 2 x 184 tok/s (a 43.5 ms step) leaves beyond the GEMMs (-2.5 ms)
    rest = {"mode": "w8a8+emb8", "streams": 16, "step_s": 51.0e-3, "rest_s": 6.4e-3}
    with_rest = compare_cpu.targets(res, args, quiet, floor16, KIND_FLOOR, None, rest)
    lines = with_rest
    assert line("best gemmajax mode at 16 streams").endswith(
        "1.63x (target >= 2x; GEMM ceiling 1.89x; bare step 51.0 ms = GEMM floor 46.0 + 5.0; the step without its "
        "GEMMs 6.4 ms; the target needs a 43.5 ms step, -2.5 ms beyond the GEMMs): FAIL, out of reach with these "
        "GEMMs")
    # every other line is as without it; figures of another mode or stream count are not this target's
    assert [ln for ln in with_rest if "at 16 streams (" not in ln] == [
        ln for ln in compare_cpu.targets(res, args, quiet, floor16, KIND_FLOOR) if "at 16 streams (" not in ln]
    for other in ({**rest, "mode": "bf16"}, {**rest, "streams": 8}):
        assert compare_cpu.rest_note(other, res[1], KIND_FLOOR, 16, 368.0) == ""
    # without the floors only the measured parts
    assert compare_cpu.rest_note(rest, res[1], None, 16, 368.0) == (
        "; bare step 51.0 ms; the step without its GEMMs 6.4 ms; the target needs a 43.5 ms step")


def test_gemm_stand_in_has_the_products_shape_and_reads_no_weight():
    import jax.numpy as jnp
    import numpy as np

    from gemmajax.quant.array import QuantArray
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 8)), jnp.bfloat16)
    y = compare_cpu.gemm_stand_in(x, jnp.zeros((12, 8), jnp.bfloat16))
    assert y.shape == (3, 5, 12) and y.dtype == jnp.bfloat16
    # x's first column times a ramp over the output columns: distinct values, so an argmax over them is not trivial
    want = np.asarray(x[..., :1], np.float32) * (np.arange(12, dtype=np.float32) * np.float32(1 / 12))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32))
    q = QuantArray(values=jnp.zeros((16, 8), jnp.int8), scale=jnp.ones((16,), jnp.float32), kind="int8",
                   shape=(12, 8), group=0, dtype=jnp.bfloat16)
    assert compare_cpu.gemm_stand_in(x, q).shape == (3, 5, 12)  # a QuantArray's logical out, not its padded rows


def test_paired_ratio_is_the_median_of_the_in_round_ratios():
    # bf16 drifts from round to round (the machine's speed); the mode is 10 % faster within every round but slower
    # than bf16's best round: the best of the processes would read 88/100 = 0.88x, the paired median 1.10x
    paired = {"bf16": {"1": [100.0, 60.0, 80.0, 70.0], "16": [280.0, 250.0, 260.0, 270.0]},
              "w8a8": {"1": [110.0, 66.0, 88.0, 77.0], "16": [266.0, 250.0, 273.0, 270.0]},
              "w4a16": {"1": [90.0, 60.0], "16": [250.0, 250.0]}}
    med, lo, hi = compare_cpu.paired_ratio(paired, "w8a8", 1)
    assert abs(med - 1.1) < 1e-12 and abs(lo - 1.1) < 1e-12 and abs(hi - 1.1) < 1e-12
    # 16: ratios 0.95, 1.0, 1.05, 1.0 -> median of an even count is the mean of the middle two
    med, lo, hi = compare_cpu.paired_ratio(paired, "w8a8", 16)
    assert (round(med, 12), round(lo, 12), round(hi, 12)) == (1.0, 0.95, 1.05)
    assert compare_cpu.paired_ratio(paired, "w4a16", 1) is None  # rounds that do not pair up
    assert compare_cpu.paired_ratio(paired, "w8a8+emb8", 1) is None and compare_cpu.paired_ratio(None, "w8a8", 1) is None
    assert abs(compare_cpu.paired_ratio({"bf16": {"1": [50.0, 40.0, 45.0]}, "w4a16": {"1": [45.0, 44.0, 54.0]}},
                                        "w4a16", 1)[0] - 1.1) < 1e-12  # ratios 0.9, 1.1, 1.2: odd count, the middle

    res = [{"engine": "gemmajax", "mode": "bf16", "tok_s_1": 100.0, "tok_s_16": 280.0, "ttft_s_16": 0.28},
           {"engine": "gemmajax", "mode": "w8a8", "tok_s_1": 88.0, "tok_s_16": 266.0, "ttft_s_16": 0.29}]
    args = argparse.Namespace(streams=[1, 16])
    quiet = {"load_before": 0.1, "load_after": 0.2, "foreign": 0.0}
    lines = compare_cpu.targets(res, args, quiet, None, None, paired)

    def line(part):
        hits = [ln for ln in lines if part in ln]
        assert len(hits) == 1, (part, lines)
        return hits[0]
    assert line("w8a8 / gemmajax bf16 at 1 stream") == (
        "  gemmajax w8a8 / gemmajax bf16 at 1 stream, paired: 1.10x (target >= 1x; paired in one process: median of "
        "4 rounds, 1.10-1.10; best of the processes 0.88x): PASS")
    assert line("w8a8 / gemmajax bf16 at 16 streams") == (
        "  gemmajax w8a8 / gemmajax bf16 at 16 streams, paired: 1.00x (target >= 1x; paired in one process: median "
        "of 4 rounds, 0.95-1.05; best of the processes 0.95x): PASS")
    # without the paired figures the verdict is the best of the processes'
    lines = compare_cpu.targets(res, args, quiet, None)
    assert line("w8a8 / gemmajax bf16 at 1 stream") == "  gemmajax w8a8 / gemmajax bf16 at 1 stream: 0.88x (target >= 1x): FAIL"


def test_best_gemmajax_is_the_fastest_mode_that_ran():
    rows = [{"engine": "gemmajax", "mode": "bf16", "tok_s_1": 50.0, "tok_s_16": 300.0},
            {"engine": "gemmajax", "mode": "w8a8", "tok_s_1": 90.0, "tok_s_16": 280.0},
            {"engine": "gemmajax", "mode": "w4a16", "tok_s_1": 99.0, "tok_s_16": 310.0, "skipped": "no"},
            {"engine": "gemmajax", "mode": "w4a16+emb4", "error": "boom"},
            {"engine": "transformers", "mode": "bf16", "tok_s_1": 120.0, "tok_s_16": 400.0}]
    assert compare_cpu.best_gemmajax(rows, 1)["mode"] == "w8a8"
    assert compare_cpu.best_gemmajax(rows, 16)["mode"] == "bf16"
    assert compare_cpu.best_gemmajax(rows[3:], 16) is None
