"""Tensor and expert parallelism (gemmajax/parallel.py) and multi-host runs.

The engine runs in subprocesses (tests/parallel/run_tp.py) with 4 forced CPU devices, so this process keeps one:
greedy float32 tokens at tensor_parallel_size 2 and 4 (and 3, where heads and vocabulary do not divide) and with
expert parallelism equal tensor_parallel_size 1, for E2B-like (PLE, KV sharing, one KV head), 31B-like (K=V, KV
heads 2 / 1), 26B-like (MoE) and Gemma 3 tiny models, and for w8a8 and w4a16 (31B-like), w8a8 experts (26B-like, by
expert and by width: the quantized kernels per shard, gemmajax.quant.sharded); every split leaf and KV pool is held in
pieces (no device has a whole copy); the compiled decode step has one all-reduce per attention / MLP block.
Two processes of 2 CPU devices each (gloo) give the TP=1 tokens at TP=4: offline (both call generate), and as
`gemmajax serve --num-hosts 2` (host 0 answers HTTP and broadcasts each step, host 1 runs them).
In this process: the rules on full-size presets over a v5e 2x2 topology's devices (what `gemmajax aot` uses), and
the errors.

Prompts: one-token prompts run the all-decode program only (one compile per case), and one pair of longer
prompts (13 and 5 tokens, chunked prefill) runs the mixed program too. Models: block-end norms x64, so greedy
continuations move from token to token (at gain 1 they repeat the prompt's last token, which hides sharding bugs).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from gemmajax.config import ModelConfig
from tests.golden.hf_models import build_hf, save_text_checkpoint
from tests.xla_flags import subprocess_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S, F = "sliding_attention", "full_attention"
SMALL = {  # the golden variants with fewer layers (compile time), same features
    "e2b": dict(num_hidden_layers=4, layer_types=[S, F, S, F], num_kv_shared_layers=2),
    "31b": dict(num_hidden_layers=2, layer_types=[S, F]),
    "26b": dict(num_hidden_layers=2, layer_types=[S, F]),
    "gemma3": dict(num_hidden_layers=2, layer_types=[S, F]),
}
GAIN = 64.0
_RNG = np.random.default_rng(1)
SHORT = [[int(t)] for t in _RNG.integers(3, 512, size=2)]          # decode program only
LONG = [list(map(int, _RNG.integers(3, 512, size=n))) for n in (13, 5)]  # chunked prefill + decode
MAX_TOKENS = 10

# (name, variant, tp, ep, quant, prompts, hlo)
CASES = [(f"{v}/tp{tp}", v, tp, False, "none", "short", False) for v in ("e2b", "31b", "gemma3") for tp in (1, 2, 4)]
CASES += [("31b/tp3", "31b", 3, False, "none", "short", False),
          ("26b/tp1", "26b", 1, False, "none", "short", False), ("26b/tp2", "26b", 2, False, "none", "short", False),
          ("26b/tp2ep", "26b", 2, True, "none", "short", False), ("26b/tp4ep", "26b", 4, True, "none", "short", False),
          ("31b-w8a8/tp1", "31b", 1, False, "w8a8", "short", False),
          ("31b-w8a8/tp2", "31b", 2, False, "w8a8", "short", False),
          # the quantized kernels per shard (gemmajax.quant.sharded): int4 column-parallel with its rows' group
          # scales and replicated along `in`; int8 experts split by expert (EP) and by width (TP4; the dense
          # down_proj's 96 columns are split with per-token scales; the experts' 32 columns padded to 128 all sit
          # on the first shard, so tests/quant/test_sharded.py covers the experts' per-token case)
          ("31b-w4a16/tp1", "31b", 1, False, "w4a16", "short", False),
          ("31b-w4a16/tp2", "31b", 2, False, "w4a16", "short", False),
          ("26b-w8a8/tp1", "26b", 1, False, "w8a8", "short", False),
          ("26b-w8a8/tp2ep", "26b", 2, True, "w8a8", "short", False),
          ("26b-w8a8/tp4", "26b", 4, False, "w8a8", "short", False),
          ("31b-long/tp1", "31b", 1, False, "none", "long", False), ("31b-long/tp2", "31b", 2, False, "none", "long", True),
          ("e2b-long/tp1", "e2b", 1, False, "none", "long", False), ("e2b-long/tp4", "e2b", 4, False, "none", "long", False)]


def _checkpoint(variant: str, path: str) -> str:
    import torch
    model, cfg = build_hf(variant, seed=3, **SMALL[variant])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("post_attention_layernorm", "post_feedforward_layernorm.",
                                       "post_per_layer_input_norm")):
                p.copy_((p + 1) * GAIN - 1 if variant == "gemma3" else p * GAIN)   # Gemma 3 stores w of 1 + w
    return save_text_checkpoint(model, cfg, path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {v: _checkpoint(v, str(tmp_path_factory.mktemp(v))) for v in SMALL}


def _env(devices: int) -> dict:
    """The subprocesses' environment: N CPU devices, compiled as the whole suite is (tests/xla_flags.py; TP=1 and
    TP=N are compiled alike, and their equality is what is tested)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=subprocess_xla_flags(devices))
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _write_cases(path: str, cases: list[dict], prompts) -> str:
    with open(path, "w") as f:
        json.dump({"prompts": prompts, "max_tokens": MAX_TOKENS, "cases": cases}, f)
    return path


@pytest.fixture(scope="module")
def results(ckpts, tmp_path_factory):
    """Every single-process case, in two concurrent subprocesses (one per prompt set, then halves), 4 devices."""
    d = tmp_path_factory.mktemp("runs")
    groups = {}
    for name, v, tp, ep, quant, prompts, hlo in CASES:
        groups.setdefault(prompts, []).append(dict(name=name, ckpt=ckpts[v], tp=tp, ep=ep, quant=quant, hlo=hlo))
    shorts = groups["short"]
    jobs = [("short-a", shorts[::2], SHORT), ("short-b", shorts[1::2], SHORT), ("long", groups["long"], LONG)]
    out, logs = {}, {}
    # two at a time: the machine has two cores
    for batch in (jobs[:2], jobs[2:]):
        procs = []
        for tag, cases, prompts in batch:
            cf = _write_cases(str(d / f"{tag}.json"), cases, prompts)
            procs.append((tag, str(d / f"{tag}.out.json"), subprocess.Popen(
                [sys.executable, "-m", "tests.parallel.run_tp", cf, str(d / f"{tag}.out.json")], cwd=ROOT,
                env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        for tag, of, p in procs:
            text, _ = p.communicate(timeout=900)
            assert p.returncode == 0, f"{tag} failed:\n{text[-6000:]}"
            with open(of) as f:
                out.update(json.load(f))
            logs[tag] = text
    out["_logs"] = "\n".join(logs.values())
    return out


def _base(name: str) -> str:
    return name.split("/")[0] + "/tp1"


@pytest.mark.parametrize("name", [c[0] for c in CASES if c[2] > 1])
def test_tokens_equal_tp1(results, name):
    """Greedy tokens at TP > 1 (EP for the MoE cases) are TP=1's, and they move (no all-one-token outputs)."""
    got, want = results[name]["tokens"], results[_base(name)]["tokens"]
    assert got == want, f"{name}: {got} != {_base(name)}: {want}"
    assert all(len(t) == MAX_TOKENS for t in want)
    assert max(len(set(t)) for t in want) >= 4, f"{_base(name)} repeats itself: {want}"


def _split_leaves(r: dict) -> dict[str, dict]:
    return {leaf["path"]: leaf for leaf in r["leaves"] if leaf["spec"] and "model" in leaf["spec"]}


@pytest.mark.parametrize("name", [c[0] for c in CASES if c[2] > 1])
def test_split_leaves_are_in_pieces(results, name):
    """Every leaf with a split spec is held as tp shards of 1/tp of the split dim (no device has a whole copy),
    on every device; the same for the KV pools."""
    r = results[name]
    tp = int(name.split("/tp")[1][0])
    for leaf in list(_split_leaves(r).values()) + [k for k in r["kv"] if k["spec"] and "model" in k["spec"]]:
        d = leaf["spec"].index("model")
        want = list(leaf["shape"])
        want[d] //= tp
        assert leaf["shards"] == [want], f"{name} {leaf['path']}: shards {leaf['shards']}, expected {want}"
        assert leaf["num_shards"] == tp


def _specs(r: dict, key: str) -> dict[str, list]:
    return {leaf["path"]: leaf["spec"] for leaf in r["leaves"] if key in leaf["path"]}


def test_which_leaves_split(results):
    """The layout: heads / MLP / vocabulary split (column-parallel on out, row-parallel on in), KV projections only
    where KV heads divide, experts by expert with EP and by width without, int8 scales with their rows."""
    r = results["31b/tp2"]
    split = _split_leaves(r)
    for key in ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert all(p in split for p in _specs(r, key)), f"31b/tp2 {key} not split everywhere: {_specs(r, key)}"
    assert _specs(r, ".embed")[".embed"] == ["model", None]
    assert all(s == [None, "model"] for s in _specs(r, "o_proj").values())
    assert split.get(".layers[0].attn.k_proj"), "sliding k_proj (2 KV heads) should split over 2 devices"
    assert ".layers[1].attn.k_proj" not in split, "full-layer k_proj (1 KV head) cannot split over 2 devices"
    # TP=4: 2 KV heads do not divide 4 devices -> K/V projections replicated, pages repeated (one head per device)
    r4 = results["31b/tp4"]
    assert not any("k_proj" in p for p in _split_leaves(r4))
    assert [k["shape"][1] for k in r4["kv"]] == [8, 8] and all(k["shards"][0][1] == 2 for k in r4["kv"])
    assert [k["shape"][1] for k in results["31b/tp1"]["kv"]] == [4, 2]
    # E2B-like: the PLE table splits by vocabulary row
    assert results["e2b/tp2"]["leaves"] and _split_leaves(results["e2b/tp2"])[".ple_table"]["spec"] == ["model", None]
    # MoE: experts split on E with EP, along the expert MLP width without
    ep, tp = _split_leaves(results["26b/tp4ep"]), _split_leaves(results["26b/tp2"])
    assert ep[".layers[0].moe.gate_up_proj"]["spec"] == ["model", None, None]
    assert ep[".layers[0].moe.down_proj"]["spec"] == ["model", None, None]
    assert tp[".layers[0].moe.gate_up_proj"]["spec"] == [None, "model", None]
    assert tp[".layers[0].moe.down_proj"]["spec"] == [None, None, "model"]
    # w8a8: values and scales split together (q rows with their scales; o columns with the per-row scales whole),
    # except where a shard would cut an activation group (o_proj of the sliding layer: 128 columns in groups of
    # 128 over 2 devices): replicated, logged
    w = results["31b-w8a8/tp2"]
    q = _specs(w, "layers[0].attn.q_proj")
    assert q[".layers[0].attn.q_proj.values"] == ["model", None] and q[".layers[0].attn.q_proj.scale"] == ["model"]
    o = _specs(w, "layers[1].attn.o_proj")
    assert o[".layers[1].attn.o_proj.values"] == [None, "model"] and o[".layers[1].attn.o_proj.scale"] == [None]
    assert _specs(w, "layers[0].attn.o_proj")[".layers[0].attn.o_proj.values"] == [None, None]
    assert "int8 activation groups of 128 would straddle shards of 64 columns" in results["_logs"]
    # w4a16: rows with their group scales; never along `in` (o_proj whole)
    w4 = results["31b-w4a16/tp2"]
    q4 = _specs(w4, "layers[0].attn.q_proj")
    assert q4[".layers[0].attn.q_proj.values"] == ["model", None] and q4[".layers[0].attn.q_proj.scale"] == ["model", None]
    assert _specs(w4, "layers[1].attn.o_proj")[".layers[1].attn.o_proj.values"] == [None, None]
    # int8 experts: by expert with EP (values and scales), by width without (down_proj's `in`, per-token scales)
    e8, t8 = _specs(results["26b-w8a8/tp2ep"], "moe."), _specs(results["26b-w8a8/tp4"], "moe.")
    assert e8[".layers[0].moe.gate_up_proj.values"] == ["model", None, None]
    assert e8[".layers[0].moe.down_proj.scale"] == ["model", None]
    assert t8[".layers[0].moe.gate_up_proj.values"] == [None, "model", None]
    assert t8[".layers[0].moe.down_proj.values"] == [None, None, "model"]


def test_tp3_replicates_what_does_not_divide(results):
    """tensor_parallel_size 3 on 4 heads and a 512 vocabulary: those leaves are replicated with a log line naming
    the dimension; the MLP (96 columns) still splits; tokens are TP=1's (test_tokens_equal_tp1)."""
    logs = results["_logs"]
    assert "4 query heads do not divide over 3 devices" in logs
    assert "vocab size 512 does not divide over 3 devices" in logs
    split = _split_leaves(results["31b/tp3"])
    assert ".layers[0].mlp.gate_proj" in split and ".layers[0].attn.q_proj" not in split and ".embed" not in split
    assert not any(k["spec"] and "model" in k["spec"] for k in results["31b/tp3"]["kv"])


def test_one_all_reduce_per_block(results):
    """The compiled TP=2 decode step of the 2-layer 31B-like model: one all-reduce after each attention and MLP
    block, one for the vocabulary-split embedding gather, and only the greedy argmax's tiny all-gathers."""
    c = results["31b-long/tp2"]["collectives"]
    layers = len(SMALL["31b"]["layer_types"])
    assert c.get("all-reduce") == 2 * layers + 1, c
    assert c.get("all-gather", 0) <= 2 and not c.get("collective-permute") and not c.get("all-to-all"), c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two(args_of, env, timeout=600) -> list[str]:
    """Run two processes (host 0 and host 1) to completion; their outputs."""
    procs = [subprocess.Popen(args_of(i), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in (0, 1)]
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_two_processes_equal_tp1(results, ckpts, tmp_path):
    """Two processes on 127.0.0.1 with 2 CPU devices each (jax.distributed, gloo), both calling generate: TP=4
    over both gives the TP=1 greedy tokens (chunked prefill included)."""
    cf = _write_cases(str(tmp_path / "mh.json"), [dict(name="31b/mh", ckpt=ckpts["31b"], tp=4)], LONG)
    of = str(tmp_path / "mh.out.json")
    addr = f"127.0.0.1:{_free_port()}"
    texts = _two(lambda i: [sys.executable, "-m", "tests.parallel.run_tp", cf, of, "--num-hosts", "2",
                            "--host-index", str(i), "--coordinator", addr], _env(2))
    with open(of) as f:
        out = json.load(f)["31b/mh"]
    assert out["processes"] == 2 and len(out["devices"]) == 4, texts[0][-3000:]
    assert out["tokens"] == results["31b-long/tp1"]["tokens"]
    # host 0 holds 2 of the 4 shards of each split leaf
    q = next(leaf for leaf in out["leaves"] if leaf["path"] == ".layers[0].attn.q_proj")
    assert q["num_shards"] == 2 and q["shards"] == [[q["shape"][0] // 4, q["shape"][1]]]


def test_two_host_server_equals_tp1(results, ckpts, gguf_file):
    """`gemmajax serve --tensor-parallel-size 4 --num-hosts 2 --host-index i --coordinator ADDR` on two processes:
    host 0 answers HTTP and broadcasts every step, host 1 runs them (engine/multihost.py); the greedy completion
    is TP=1's text; on SIGTERM host 0 releases host 1, which exits 0."""
    import signal
    import urllib.request

    from gemmajax.tools.tokenizer import gguf_to_gemma4_sp
    ckpt = ckpts["31b"]
    with open(os.path.join(ckpt, "tokenizer.model"), "wb") as f:      # the server loads its tokenizer from ckpt
        f.write(gguf_to_gemma4_sp(gguf_file))
    port, addr = _free_port(), f"127.0.0.1:{_free_port()}"
    flags = ["--ckpt", ckpt, "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "2",
             "--max-num-batched-tokens", "16", "--tensor-parallel-size", "4", "--num-hosts", "2",
             "--coordinator", addr, "--port", str(port)]
    procs = [subprocess.Popen([sys.executable, "-m", "gemmajax.server.cli", "serve", *flags, "--host-index", str(i)],
                              cwd=ROOT, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in (0, 1)]
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                assert all(p.poll() is None for p in procs), "a server process died at startup"
                time.sleep(0.5)
        body = json.dumps({"model": os.path.basename(ckpt), "prompt": LONG[0], "max_tokens": MAX_TOKENS,
                           "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        answer = json.load(urllib.request.urlopen(req, timeout=300))
        procs[0].send_signal(signal.SIGTERM)
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert answer["choices"][0]["text"] == results["31b-long/tp1"]["texts"][0]
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert procs[1].returncode == 0, logs[1][-3000:]
    assert "host 1: host 0 stopped after" in logs[1]


# ---------------------------------------------------------------------------- in this process (one CPU device)

@pytest.fixture(scope="module")
def topo_devices():
    from jax.experimental import topologies
    return topologies.get_topology_desc("v5e:2x2", platform="tpu").devices


def _abstract(cfg, quant="none"):
    from gemmajax.aot import abstract_model_weights
    return abstract_model_weights(cfg, quant, "bfloat16")


def test_presets_on_a_tpu_topology(topo_devices):
    """Full-size presets over a v5e 2x2 topology's 4 devices (no memory, no TPU): what aot's --topology needs.
    31B (32 heads, KV heads 16 / 4): everything splits; 26B-A4B with EP: 128 experts, 32 per device; w4a16:
    int4 rows split with their group scales, int4 columns never (down / o replicated, logged)."""
    from jax.sharding import PartitionSpec as P

    from gemmajax.parallel import AXIS, ShardPlan
    cfg = ModelConfig.preset("31b")
    plan = ShardPlan.create(cfg, 4, devices=topo_devices)
    w = plan.abstract(_abstract(cfg))
    lw = w.layers[0]
    assert lw.attn.q_proj.sharding.spec == P(AXIS, None) and lw.attn.o_proj.sharding.spec == P(None, AXIS)
    assert lw.attn.k_proj.sharding.spec == P(AXIS, None) and w.embed.sharding.spec == P(AXIS, None)
    assert lw.attn.q_proj.sharding.shard_shape(lw.attn.q_proj.shape)[0] == lw.attn.q_proj.shape[0] // 4
    assert plan.kv_device_fraction() == pytest.approx(0.25)

    moe = ModelConfig.preset("26b-a4b")
    ep = ShardPlan.create(moe, 4, expert_parallel=True, devices=topo_devices)
    m = ep.abstract(_abstract(moe, "w4a16")).layers[0].moe
    assert m.gate_up_proj.values.sharding.spec == P(AXIS, None, None)
    assert m.gate_up_proj.scale.sharding.spec == P(AXIS, None, None)
    assert m.gate_up_proj.values.sharding.shard_shape(m.gate_up_proj.values.shape)[0] == 32
    q = ShardPlan.create(cfg, 4, devices=topo_devices).specs(_abstract(cfg, "w4a16")).layers[0]
    assert q.attn.q_proj.values == P(AXIS, None) and q.attn.q_proj.scale == P(AXIS, None)
    for leaf in (q.attn.o_proj.values, q.attn.o_proj.scale, q.mlp.down_proj.values):   # int4 along `in`: whole
        assert all(x is None for x in leaf), leaf


def test_errors_name_the_problem():
    """Too few devices, a bad size, EP on a dense model: each error names the value and what would work."""
    from gemmajax.parallel import ShardPlan, init_distributed
    cfg = ModelConfig.preset("e2b")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 devices, but only 1 cpu device"):
        ShardPlan.create(cfg, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be >= 1, got 0"):
        ShardPlan.create(cfg, 0)
    with pytest.raises(ValueError, match=r"has no experts"):
        ShardPlan.create(cfg, 1, expert_parallel=True)
    with pytest.raises(ValueError, match=r"host_index must be in \[0, num_hosts\)"):
        init_distributed("127.0.0.1:1", 2, 2)
    with pytest.raises(ValueError, match=r"needs a coordinator"):
        init_distributed("", 2, 1)


def test_serve_flags_parse():
    """`gemmajax serve --tensor-parallel-size N --enable-expert-parallel --num-hosts H --host-index I
    --coordinator ADDR` parse to what AsyncEngineClient.from_args reads."""
    from gemmajax.server.cli import build_parser
    a = build_parser().parse_args(["serve", "--tensor-parallel-size", "4", "--enable-expert-parallel",
                                   "--num-hosts", "2", "--host-index", "1", "--coordinator", "10.0.0.1:1234"])
    assert (a.tensor_parallel_size, a.enable_expert_parallel, a.num_hosts, a.host_index, a.coordinator) == \
        (4, True, 2, 1, "10.0.0.1:1234")
    d = build_parser().parse_args(["serve"])
    assert (d.tensor_parallel_size, d.enable_expert_parallel, d.num_hosts, d.host_index) == (1, False, 1, 0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tensor-parallel-size", "0"])
