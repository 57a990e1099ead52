"""Fixtures: a real uvicorn server on a free loopback port running the app over a FakeEngineClient."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import uvicorn

from gemmajax.engine.sampling_params import SamplingParams
from gemmajax.server.app import build_app
from tests.server.fake_engine import FakeEngineClient


@contextlib.contextmanager
def running_server(app) -> Iterator[str]:
    """Serve `app` with uvicorn in a thread on a free 127.0.0.1 port; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start within 10 s")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def make_app(engine: FakeEngineClient, **kw):
    return build_app(engine, sampling_params_cls=SamplingParams, **kw)


@pytest.fixture
def engine() -> FakeEngineClient:
    return FakeEngineClient()


@pytest.fixture
def base_url(engine: FakeEngineClient) -> Iterator[str]:
    with running_server(make_app(engine)) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=20)


def wait_until(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)
