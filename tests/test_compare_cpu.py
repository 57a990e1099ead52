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
