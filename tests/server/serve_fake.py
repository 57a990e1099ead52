"""`python -m tests.server.serve_fake PORT DELAY NUM_TOKENS GRACE`: the CLI's run_server over a fake engine
whose aborts are printed, for the SIGTERM tests."""

import sys

from gemmajax.server.app import build_app
from gemmajax.server.cli import run_server
from tests.server.conftest import SamplingParams
from tests.server.fake_engine import FakeEngineClient


class PrintingEngine(FakeEngineClient):
    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        print(f"ABORTED {request_id}", flush=True)

    def shutdown(self) -> None:
        print("ENGINE SHUTDOWN", flush=True)


if __name__ == "__main__":
    port, delay, num_tokens, grace = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    engine = PrintingEngine("z" * num_tokens, max_model_len=10_000)
    engine.token_delay = delay
    run_server(build_app(engine, sampling_params_cls=SamplingParams), host="127.0.0.1", port=port,
               log_level="warning", timeout_graceful_shutdown=grace)
