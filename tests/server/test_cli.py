"""The `gemmajax` CLI: flags of API.md, lazy delegation, serve wiring, and SIGTERM handling in a subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx
import openai
import pytest

from gemmajax.server import cli
from tests.server.conftest import running_server
from tests.server.fake_engine import FakeEngineClient

ROOT = Path(__file__).resolve().parents[2]


def test_serve_flags_and_defaults() -> None:
    args = cli.build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.quant, args.kv_dtype, args.dtype) == ("127.0.0.1", 8000, "none", "auto",
                                                                              "bfloat16")
    assert args.default_thinking_token_budget is None and args.speculative_config is None
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == (8192, 64, None)
    assert args.enable_prefix_caching is True and args.ckpt is None and args.served_model_name is None
    assert args.precompile is False and args.max_request_bytes == 16 << 20 and args.max_queue == 256
    assert args.num_scheduler_steps is None   # the engine's default
    args = cli.build_parser().parse_args(
        ["serve", "--ckpt", "m.gguf", "--quant", "w8a8+emb8", "--kv-dtype", "fp8_e5m2", "--port", "9000",
         "--max-model-len", "4096", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
         "--served-model-name", "g", "--api-key", "k", "--max-queue", "3", "--no-enable-prefix-caching",
         "--precompile", "--max-request-bytes", "1000", "--default-thinking-token-budget", "0",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--num-scheduler-steps", "4"])
    assert args.num_scheduler_steps == 4
    assert args.precompile is True and args.max_request_bytes == 1000
    assert args.default_thinking_token_budget == 0
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert (args.ckpt, args.quant, args.kv_dtype, args.port, args.max_model_len, args.max_num_seqs) == (
        "m.gguf", "w8a8+emb8", "fp8_e5m2", 9000, 4096, 8)
    assert (args.max_num_batched_tokens, args.served_model_name, args.api_key, args.max_queue) == (512, "g", "k", 3)
    assert args.enable_prefix_caching is False


@pytest.mark.parametrize("argv", [["serve", "--quant", "int3"], ["serve", "--quant", "w8a8+emb3"],
                                  ["serve", "--kv-dtype", "fp16"], ["serve", "--speculative-config", "[1]"],
                                  ["serve", "--speculative-config", "{bad"],
                                  ["serve", "--default-thinking-token-budget", "-1"], ["aot", "--model", "7b", "--chip", "v5e"],
                                  ["aot", "--model", "e2b", "--chip", "v4"], ["quantize", "--ckpt", "x"],
                                  ["generate"], ["serve", "--max-num-seqs", "0"],
                                  ["serve", "--max-request-bytes", "0"], ["serve", "--max-queue", "-1"],
                                  ["serve", "--num-scheduler-steps", "0"]])
def test_bad_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("argv, module", [
    (["generate", "--prompt", "hi", "--max-tokens", "5", "--temperature", "0.5"], "gemmajax.engine.cli_generate"),
    (["quantize", "--ckpt", "in", "--quant", "w4a16", "--out", "o"], "gemmajax.quant.cli"),
    (["aot", "--model", "26b-a4b", "--chip", "v6e", "--topology", "2x2", "--quant", "w8a8"], "gemmajax.aot"),
])
def test_subcommands_delegate(argv: list[str], module: str, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture) -> None:
    seen = []
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(run=lambda args: seen.append(args) or 3))
    assert cli.main(argv) == 3
    args = seen[0]
    if argv[0] == "generate":
        assert (args.prompt, args.max_tokens, args.temperature, args.quant) == ("hi", 5, 0.5, "none")
    elif argv[0] == "quantize":
        assert (args.ckpt, args.quant, args.out) == ("in", "w4a16", "o")
    else:
        assert (args.model, args.chip, args.topology, args.quant, args.kv_dtype) == ("26b-a4b", "v6e", "2x2", "w8a8",
                                                                                      "auto")
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    assert cli.main(argv) == cli.EXIT_NOT_AVAILABLE
    assert "not available yet" in capsys.readouterr().err


def test_serve_builds_engine_and_app(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngineClient(model_name="served")
    got = {}

    class AsyncEngineClient:
        @staticmethod
        def from_args(args):
            got["args"] = args
            return engine

    monkeypatch.setitem(sys.modules, "gemmajax.engine.async_engine",
                        types.SimpleNamespace(AsyncEngineClient=AsyncEngineClient))
    monkeypatch.setattr(cli, "run_server", lambda app, **kw: got.update(app=app, **kw))
    monkeypatch.setattr(cli.logging, "basicConfig", lambda **kw: None)
    monkeypatch.setenv("GEMMAJAX_API_KEY", "envkey")
    assert cli.main(["serve", "--port", "8123", "--served-model-name", "served", "--max-queue", "5",
                     "--max-request-bytes", "2048"]) == 0
    assert got["args"].served_model_name == "served" and got["args"].api_key == "envkey"
    assert (got["host"], got["port"], got["timeout_graceful_shutdown"]) == ("127.0.0.1", 8123, 30.0)
    app = got["app"]
    assert app.state.slots.limit == 5 and app.state.max_request_bytes == 2048
    with running_server(app) as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="envkey", max_retries=0)
        assert [m.id for m in ok.models.list().data] == ["served"]

    monkeypatch.setitem(sys.modules, "gemmajax.engine.async_engine", None)
    assert cli.main(["serve"]) == cli.EXIT_NOT_AVAILABLE


def _start(delay: float, num_tokens: int, grace: float) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "tests.server.serve_fake", str(port), str(delay), str(num_tokens),
                             str(grace)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)


def _stream_through_sigterm(proc: subprocess.Popen, url: str) -> str:
    """Start a stream, SIGTERM the server after its first token, return all the text that arrived."""
    text, done = "", False
    body = {"messages": [{"role": "user", "content": "go"}], "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and '"content":"z' in line:
                    if not text:
                        proc.send_signal(signal.SIGTERM)
                    text += "z"
    except httpx.RemoteProtocolError:  # the server dropped the connection mid-stream
        pass
    return text + ("[DONE]" if done else "")


def test_sigterm_lets_inflight_stream_finish() -> None:
    proc, url = _start(delay=0.01, num_tokens=60, grace=20)
    try:
        assert _stream_through_sigterm(proc, url) == "z" * 60 + "[DONE]"
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode in (0, -signal.SIGTERM), err[-2000:]
    assert "ABORTED" not in out and "ENGINE SHUTDOWN" in out


def test_sigterm_past_grace_aborts_inflight() -> None:
    proc, url = _start(delay=0.05, num_tokens=400, grace=0.5)
    t0 = time.monotonic()
    try:
        text = _stream_through_sigterm(proc, url)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 10  # 400 tokens would take 20 s
    assert "[DONE]" not in text and len(text) < 100
    assert "ABORTED chatcmpl-" in out, (out, err[-2000:])
    assert "ENGINE SHUTDOWN" in out


def test_aot_subcommand_has_every_flag_of_gemmajax_aot() -> None:
    """`gemmajax aot` parses every flag `python -m gemmajax.aot` takes (aot.add_arguments), with the same defaults:
    a flag added to one and not the other (e.g. --enable-expert-parallel, --speculative-model) fails here."""
    import argparse

    from gemmajax import aot
    ref = argparse.ArgumentParser()
    aot.add_arguments(ref)
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    ours = sub.choices["aot"]

    def flags(p):
        return {o: (a.default, tuple(a.choices) if a.choices else None, a.required) for a in p._actions
                for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert flags(ours) == flags(ref)


@pytest.mark.parametrize("flag, want", [([], {}), (["--num-scheduler-steps", "2"], {"num_scheduler_steps": 2})])
def test_serve_flags_reach_the_llm(flag: list[str], want: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gemmajax serve`'s engine flags become the LLM's arguments (async_engine._llm_from_args); an unset
    --num-scheduler-steps leaves the engine's default."""
    from gemmajax.engine import async_engine, llm
    seen = {}
    monkeypatch.setattr(llm, "LLM", lambda ckpt, **kw: seen.update(kw, ckpt=ckpt) or "llm")
    args = cli.build_parser().parse_args(["serve", "--ckpt", "m.gguf", "--max-num-seqs", "3", *flag])
    assert async_engine._llm_from_args(args) == "llm"
    assert seen["ckpt"] == "m.gguf" and seen["max_num_seqs"] == 3
    assert {k: seen[k] for k in ("num_scheduler_steps",) if k in seen} == want
