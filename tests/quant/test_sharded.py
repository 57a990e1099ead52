"""The quantized matmuls per shard (gemmajax/quant/sharded.py): what a tensor-parallel step runs instead of a Pallas
call GSPMD cannot partition.

In a subprocess with 4 CPU devices (tests/parallel/run_sharded_quant.py), configurations drawn at random (seeded):
int8 per token / per 32-column group and int4, split along `out`, along `in` (int8), experts (gmm) or not at all,
2 or 4 devices, float32 and bf16 activations, the XLA forms (run_sharded_quant.py says why not interpret mode). Each sharded
result must equal the same matmul on one device up to float reassociation of the partial sums; grouped rows past
the groups' end (NaN inputs) must come out 0. A control run with the cross-shard activation maximum switched off
must miss that tolerance, and the kernel must see shards, not whole weights.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.xla_flags import subprocess_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRIALS = 12


def _tol(t: dict) -> float:
    """float32: reassociation of at most 4 partial sums (the int32 / f32 products themselves are the same); bf16
    activations: the partials are rounded to bf16 before the psum (2**-8 of the largest output, a little more)."""
    return (1e-5 if t.get("dtype", "float32") == "float32" else 1.2e-2) * max(t["max"], 1.0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sharded") / "out.json")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=subprocess_xla_flags(4))
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "tests.parallel.run_sharded_quant", "20261202", str(TRIALS), out],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


def test_linear_per_shard_equals_one_device(results):
    trials = results["linear"]
    assert len(trials) == TRIALS
    for t in trials:
        assert t["shape_ok"], t
        assert t["err"] <= _tol(t), t
    # the draw covers the space: every split, both kernels, both device counts, every kind
    assert {(t["kind"], t["act_group"], t["dim"]) for t in trials} == {
        (k, a, d) for k, a in (("int8", 0), ("int8", 32), ("int4", 0)) for d in ([None, 0, 1] if k == "int8" else [None, 0])}
    assert {t["devices"] for t in trials} == {2, 4}
    assert any(t["padded_out"] and t["dim"] == 0 for t in trials), "no padded rows split"
    assert any(t["padded_in"] and t["dim"] == 1 for t in trials), "no padded columns split"


def test_gmm_per_shard_equals_one_device(results):
    trials = results["gmm"]
    assert len(trials) == TRIALS
    for t in trials:
        assert t["err"] <= _tol(t), t
        assert t["tail_zero"] and t["finite"], t           # padding rows (NaN in) come out 0
    assert {(t["kind"], t["act_group"], t["dim"]) for t in trials} == {
        (k, a, d) for k, a in (("int8", 0), ("int8", 32), ("int4", 0))
        for d in ([None, 0, 1, 2] if k == "int8" else [None, 0, 1])}
    assert {t["devices"] for t in trials} == {2, 4} and {t["dtype"] for t in trials} == {"float32", "bfloat16"}
    assert any(t["padded_in"] and t["dim"] == 2 for t in trials), "no padded expert columns split"
    assert any(0 in t["sizes"] for t in trials) and any(t["rows"] > sum(t["sizes"]) for t in trials)


def test_per_token_scale_spans_the_shards(results):
    """Row-parallel int8 with one scale per token: the shards share the row's maximum (pmax); without it they would
    quantize with their own, and the result would be off by far more than the tolerance."""
    c = results["control"]
    for kind in ("", "gmm_"):
        err, mx = c[kind + "with_pmax"]
        assert err <= 1e-5 * mx, c
        bad, _ = c[kind + "without_pmax"]
        assert bad > 100 * 1e-5 * mx, c


def test_the_kernel_sees_shards(results):
    """[512, 256] weight over 4 devices, x [3, 256]: column-parallel int8 / int4 see 128 rows, row-parallel int8 64
    columns of x and of the weight; replicated the whole weight."""
    s = results["local_shapes"]
    assert s["int8/0"] == {"x": [3, 256], "values": [128, 256], "shape": [128, 256]}
    assert s["int4/0"] == {"x": [3, 256], "values": [128, 128], "shape": [128, 256]}
    assert s["int8/1"] == {"x": [3, 64], "values": [512, 64], "shape": [512, 64]}
    assert s["int8/None"] == {"x": [3, 256], "values": [512, 256], "shape": [512, 256]}
