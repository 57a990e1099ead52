"""The `gemmajax` command: serve, generate, quantize, aot (flags as in API.md's "Command line").

Parsing lives here; each subcommand's work is imported lazily from the package that owns it, so `--help`
is instant and a subcommand whose implementation is missing says so and exits 2 instead of crashing.
`serve` runs uvicorn with graceful shutdown: on SIGTERM in-flight requests get `--timeout-graceful-shutdown`
seconds to finish, then are cancelled (which aborts them in the engine).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

QUANT_SCHEMES = ("none", "w8a8", "w4a16", "qat-w4a16")
KV_DTYPES = ("auto", "bf16", "fp8_e5m2", "fp8_e4m3")
AOT_MODELS = ("e2b", "e4b", "12b", "26b-a4b", "31b")
AOT_CHIPS = ("v5e", "v6e")
EXIT_NOT_AVAILABLE = 2


def quant_arg(value: str) -> str:
    """A --quant value: a scheme, optionally with a +emb4 / +emb8 suffix for the vocabulary tables."""
    scheme, plus, emb = value.partition("+")
    if scheme not in QUANT_SCHEMES or (plus and emb not in ("emb4", "emb8")):
        raise argparse.ArgumentTypeError(
            f"invalid quant {value!r}: expected one of {', '.join(QUANT_SCHEMES)}, optionally followed by "
            f"+emb4 or +emb8 (e.g. w8a8+emb8)")
    return value


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return n


def _nonnegative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return n


def _json_object(value: str) -> dict:
    import json
    try:
        obj = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r} ({e})") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(obj).__name__}: {value!r}")
    return obj


def _model_flags(p: argparse.ArgumentParser, *, ckpt_required: bool = False) -> None:
    p.add_argument("--ckpt", required=ckpt_required, default=None,
                   help="HF checkpoint dir, .gguf file or a `gemmajax quantize` output dir "
                        "(default: the built-in Gemma 3 270M GGUF)")
    p.add_argument("--quant", type=quant_arg, default="none", help="none | w8a8 | w4a16 | qat-w4a16 [+emb4|+emb8]")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto", help="KV page dtype; auto = the model's dtype")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="activation dtype")
    p.add_argument("--max-model-len", type=_positive, default=8192)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gemmajax", description="Gemma 4 inference in pure JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,quantize,aot}")

    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _model_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=_positive, default=64, help="sequences decoded together")
    p.add_argument("--max-num-batched-tokens", type=_positive, default=None, help="token budget of one step")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: from ckpt)")
    p.add_argument("--api-key", default=os.environ.get("GEMMAJAX_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every route but /health (default: $GEMMAJAX_API_KEY)")
    p.add_argument("--max-queue", type=_positive, default=256,
                   help="requests held at once (running + waiting); more get HTTP 429 with Retry-After")
    p.add_argument("--max-request-bytes", type=_positive, default=16 << 20,
                   help="largest request body accepted (default 16 MiB); a larger one gets HTTP 413 unread")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--num-scheduler-steps", type=_positive, default=None,
                   help="greedy decode steps one device program may run once every sequence is decoding (default "
                        "8; 1 = one step a program: tokens stream one by one, a new request waits at most one step)")
    p.add_argument("--default-thinking-token-budget", type=_nonnegative, default=None,
                   help="thinking tokens allowed when a request sets no thinking_token_budget (then the end of "
                        "thought is forced); without it a constrained answer still gets half of max_tokens")
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding, vLLM\'s form: \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--allowed-media-domains", default="",
                   help="comma-separated domains whose http(s) image URLs the server fetches (default: none; data "
                        "URLs always work)")
    p.add_argument("--limit-mm-per-prompt", type=_json_object, default=None,
                   help='most media per prompt, e.g. \'{"image": 4, "audio": 1}\'')
    p.add_argument("--tensor-parallel-size", type=_positive, default=1,
                   help="split the model over this many devices (heads, MLP, vocabulary; KV pages by KV head); "
                        "across hosts, every device of every host")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: split the experts over the tensor-parallel devices (whole experts each)")
    p.add_argument("--num-hosts", type=_positive, default=1,
                   help="hosts of a multi-host run; start the same command on each with its --host-index")
    p.add_argument("--host-index", type=_nonnegative, default=0,
                   help="this host's index (0 serves HTTP and schedules; the others run its steps)")
    p.add_argument("--coordinator", default=None,
                   help="HOST:PORT of host 0's jax.distributed coordinator (required with --num-hosts > 1)")
    p.add_argument("--precompile", action="store_true",
                   help="compile every step shape before serving, so no request waits for a compile (minutes on a "
                        "CPU; the persistent compilation cache makes restarts fast)")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(run=_serve)

    p = sub.add_parser("generate", help="generate text for one prompt (offline engine)")
    _model_flags(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=_positive, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-num-seqs", type=_positive, default=64)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.set_defaults(run=_delegate("gemmajax.engine.cli_generate", "run"))

    p = sub.add_parser("quantize", help="convert and quantize a checkpoint into a fast-loading directory")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--quant", type=quant_arg, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.set_defaults(run=_delegate("gemmajax.quant.cli", "run"))

    p = sub.add_parser("aot", help="compile the serving step for a TPU topology without a TPU; print the HBM fit")
    p.add_argument("--model", required=True, choices=AOT_MODELS)
    p.add_argument("--chip", required=True, choices=AOT_CHIPS)
    p.add_argument("--topology", default="1x1", choices=("1x1", "2x2", "2x4"),
                   help="chips of the slice (x by y); tensor parallel size = their number (default 1x1)")
    p.add_argument("--quant", type=quant_arg, default="none")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto")
    p.add_argument("--max-model-len", type=_positive, default=8192)
    p.add_argument("--max-num-seqs", type=_positive, default=64)
    p.add_argument("--max-num-batched-tokens", type=_positive, default=512, help="prefill chunk of one step")
    p.add_argument("--page-size", type=_positive, default=32)
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models on a slice: split the expert stacks by expert (else along their MLP width)")
    p.add_argument("--speculative-model", default=None,
                   help="a gemma4_assistant drafter directory (its config.json only): compile the verify step and "
                        "the drafter, count its weights, project speculative decoding")
    p.add_argument("--num-speculative-tokens", type=_positive, default=4)
    p.add_argument("--num-scheduler-steps", type=int, default=8,
                   help="decode steps of the engine's decode-steps program (decode-greedy compiles it; 1: one step)")
    p.add_argument("--assumed-acceptance", type=float, default=0.7,
                   help="per-draft acceptance rate the speculative projection ASSUMES (not measured)")
    p.add_argument("--margin-mib", type=int, default=256, help="HBM kept free besides what the compiler counts")
    p.add_argument("--proj-context", type=_positive, default=None,
                   help="context of the projection (default max-model-len)")
    p.add_argument("--attn-impl", default="pallas", choices=("pallas", "ref"))
    p.add_argument("--no-mm", action="store_true",
                   help="text only: leave the checkpoint's vision / audio towers out (not loaded, no encoder compiled)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=_delegate("gemmajax.aot", "run"))
    return parser


def _not_available(what: str, err: BaseException) -> int:
    print(f"gemmajax: {what} is not available yet in this build ({type(err).__name__}: {err})", file=sys.stderr)
    return EXIT_NOT_AVAILABLE


def _delegate(module: str, func: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            target = getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError) as e:
            return _not_available(f"`gemmajax {args.command}` ({module}.{func})", e)
        rc = target(args)
        return 0 if rc is None else int(rc)

    return run


def run_server(app: Any, *, host: str, port: int, log_level: str = "info",
               timeout_graceful_shutdown: float | None = 30.0, on_shutdown: Any = None) -> None:
    """Serve `app` with uvicorn until SIGINT/SIGTERM; in-flight requests get the graceful timeout to finish.
    on_shutdown: called once the server has stopped, before uvicorn re-raises the signal that stopped it (which
    ends the process: code after this call would not run)."""
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    if on_shutdown is not None:
                        on_shutdown()

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=timeout_graceful_shutdown, timeout_keep_alive=5)
    Server(config).run()


def _serve(args: argparse.Namespace) -> int:
    try:
        from gemmajax.engine.async_engine import AsyncEngineClient
    except ImportError as e:
        return _not_available("the serving engine (gemmajax.engine.async_engine.AsyncEngineClient)", e)
    from gemmajax.server.app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.num_hosts > 1 and (args.host_index >= args.num_hosts or not args.coordinator):
        print(f"gemmajax serve: --num-hosts {args.num_hosts} needs --coordinator HOST:PORT and --host-index in "
              f"[0, {args.num_hosts}); got --host-index {args.host_index}, --coordinator {args.coordinator}",
              file=sys.stderr)
        return EXIT_NOT_AVAILABLE
    if args.num_hosts > 1 and args.host_index > 0:   # no HTTP here: run host 0's steps until it stops
        from gemmajax.engine.async_engine import follow_from_args
        return follow_from_args(args)
    engine = AsyncEngineClient.from_args(args)
    domains = [d for d in (args.allowed_media_domains or "").split(",") if d.strip()]
    if domains:
        from gemmajax.server.media_fetch import make_fetcher
        engine.media_fetch = make_fetcher(domains)
    app = build_app(engine, api_key=args.api_key, max_queue=args.max_queue, max_request_bytes=args.max_request_bytes)

    def release_hosts():   # stop stepping, release the other hosts from their loops (engine/multihost.py), leave
        from gemmajax.parallel import shutdown_distributed
        engine.shutdown()
        engine.engine.runner.close()
        shutdown_distributed()

    run_server(app, host=args.host, port=args.port, log_level=args.log_level,
               timeout_graceful_shutdown=args.timeout_graceful_shutdown,
               on_shutdown=release_hosts if args.num_hosts > 1 else None)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `gemmajax` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
