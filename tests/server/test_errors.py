"""Bad requests, auth, overload, engine failure, client disconnects, and /metrics, on a real server."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import select
import socket
import time

import httpx
import openai
import pytest

from tests.server.conftest import make_app, running_server, wait_until
from tests.server.fake_engine import FakeEngineClient

USER = [{"role": "user", "content": "Hi"}]


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_malformed_and_invalid_bodies(base_url: str) -> None:
    url = f"{base_url}/v1/chat/completions"
    err = _error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert "malformed JSON" in err["message"]
    assert "empty" in _error(httpx.post(url, content=b""), 400)["message"]
    assert "JSON object" in _error(httpx.post(url, json=[1, 2]), 400)["message"]
    cases = [
        ({"messages": USER, "temperature": "hot"}, "temperature"),
        ({"messages": USER, "max_tokens": -3}, "max_tokens"),
        ({"messages": USER, "n": "two"}, "n"),
        ({"messages": USER, "stop": 5}, "stop"),
        ({"messages": USER, "stream": "maybe"}, "stream"),
        ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
        ({"messages": USER, "chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "messages.0"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages.0.content.0"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
         "messages.0.tool_calls.0.function.arguments"),
        ({}, "messages"),
    ]
    for body, param in cases:
        err = _error(httpx.post(url, json=body), 400)
        assert err["param"] == param, (body, err)
        assert err["type"] == "invalid_request_error"
        assert param.split(".")[0] in err["message"], err


def test_bad_field_via_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-gemma", messages=USER, top_p=7)
    assert e.value.body["param"] == "top_p" and "7" in e.value.body["message"]


def test_unknown_model_route_and_method(base_url: str, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-5", messages=USER)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    assert "/v1/nope" in _error(httpx.get(f"{base_url}/v1/nope"), 404)["message"]
    assert "GET" in _error(httpx.get(f"{base_url}/v1/chat/completions"), 405)["message"]
    # the model field may be left out (the one served model is meant)
    r = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello there!"


def test_prompt_too_long_and_capped(client: openai.OpenAI, engine: FakeEngineClient) -> None:
    n_overhead = len(engine.render_chat([{"role": "user", "content": ""}], tools=None, enable_thinking=False))
    long = [{"role": "user", "content": "x" * 300}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-gemma", messages=long)
    msg = e.value.body["message"]
    assert f"{300 + n_overhead} tokens" in msg and "200 tokens" in msg, msg
    assert e.value.body["code"] == "context_length_exceeded"
    fits = [{"role": "user", "content": "x" * (150 - n_overhead)}]
    client.chat.completions.create(model="fake-gemma", messages=fits, max_tokens=100)
    assert engine.calls[-1][2].max_tokens == 50  # 200 - 150: capped like vLLM


def test_api_key() -> None:
    """With --api-key every route but /health answers 401 in OpenAI's shape: the API, /metrics, unknown routes
    and wrong methods too (a client without the key learns nothing); a garbage key (non-ASCII bytes) too."""
    engine = FakeEngineClient()
    with running_server(make_app(engine, api_key="s3cret")) as url:
        routes = [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions"),
                  ("POST", "/v1/completions"), ("GET", "/v1/nope"), ("GET", "/nope"), ("GET", "/"),
                  ("GET", "/v1/chat/completions"), ("POST", "/health/")]
        for method, route in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                            {"Authorization": "Basic s3cret"}, {"Authorization": b"Bearer s3cr\xe9t"}):
                r = httpx.request(method, f"{url}{route}", json={"messages": USER}, headers=headers)
                err = _error(r, 401)
                assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error", (route, err)
                assert "--api-key" in err["message"] and r.headers["www-authenticate"] == "Bearer"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert ok.chat.completions.create(model="fake-gemma", messages=USER).choices[0].message.content
        assert ok.completions.create(model="fake-gemma", prompt="x").choices[0].text
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{url}/metrics", headers=auth).status_code == 200
        assert _error(httpx.get(f"{url}/v1/nope", headers=auth), 404)["type"] == "not_found_error"
        assert httpx.get(f"{url}/health").status_code == 200  # the one open route (load balancers probe it)
        assert len(engine.calls) == 2 and not engine.aborted  # no unauthorized request reached the engine


def test_body_over_the_limit_is_413_before_it_is_read() -> None:
    limit = 1 << 20
    engine = FakeEngineClient(max_model_len=1 << 30)
    with running_server(make_app(engine, max_request_bytes=limit)) as url:
        assert make_app(engine).state.max_request_bytes == 16 << 20  # the default
        host, port = url.removeprefix("http://").split(":")
        # 1. Content-Length says too much: answered at once, though not one byte of the body is ever sent
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % (1 << 30))
            status, body = _read_response(sock)
        assert status == 413, body
        err = json.loads(body)["error"]
        assert err["code"] == "request_too_large" and f"{1 << 30} bytes" in err["message"]
        assert str(limit) in err["message"] and "--max-request-bytes" in err["message"]
        # 2. chunked, no length: the server counts as the bytes stream in and answers while the client is still
        # sending (it never sends the final chunk, so a server that read the whole body first would never answer)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            piece = b"%x\r\n%s\r\n" % (64 << 10, b"x" * (64 << 10))
            sent = 0
            while sent < 256 * limit and not select.select([sock], [], [], 0)[0]:
                try:
                    sock.sendall(piece)
                except OSError:  # the server answered and closed: the response is waiting to be read
                    break
                sent += 64 << 10
            assert sent < 256 * limit, "no answer while 256 MiB streamed in"
            status, body = _read_response(sock)
        assert status == 413, body
        assert json.loads(body)["error"]["code"] == "request_too_large"
        # 3. httpx sending too much, with a length and chunked; then at the limit exactly, which is accepted
        big = json.dumps({"prompt": "x" * limit}).encode()
        assert _error(httpx.post(f"{url}/v1/completions", content=big), 413)["code"] == "request_too_large"
        assert _error(httpx.post(f"{url}/v1/completions", content=iter([big[:1000], big[1000:]])), 413)
        ok = json.dumps({"prompt": "y" * (limit - 100)}).encode()
        ok += b" " * (limit - len(ok))
        for content in (ok, iter([ok[:5000], ok[5000:]])):
            r = httpx.post(f"{url}/v1/completions", content=content, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello there!", r.text[:300]
        text = httpx.get(f"{url}/metrics").text
        assert _metric(text, "gemmajax_requests_total", '{endpoint="/v1/chat/completions",status="413"}') == 1
        assert _metric(text, "gemmajax_requests_total", '{endpoint="/v1/completions",status="413"}') == 3
    with pytest.raises(ValueError, match="max_request_bytes"):
        make_app(engine, max_request_bytes=0)


def _read_response(sock: socket.socket) -> tuple[int, str]:
    """Status and body of one HTTP/1.1 response with a Content-Length, read from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-response"
        body += chunk
    return int(head.split()[1]), body[:length].decode()


def test_queue_full_gives_429() -> None:
    engine = FakeEngineClient()
    engine.gate.clear()  # generations block before their first token
    with running_server(make_app(engine, max_queue=2)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=20)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(client.chat.completions.create, model="fake-gemma", messages=USER)
                    for _ in range(2)]
            wait_until(lambda: len(engine.active) == 2, what="two requests in the engine")
            r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER})
            err = _error(r, 429)
            assert r.headers["retry-after"] == "1" and "2 requests" in err["message"]
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model="fake-gemma", prompt="x")
            engine.gate.set()
            assert [f.result().choices[0].message.content for f in held] == ["Hello there!"] * 2
        # slots were released: new requests pass again
        assert client.chat.completions.create(model="fake-gemma", messages=USER).choices[0].finish_reason == "stop"
        assert len(engine.calls) == 3 and not engine.aborted


def test_engine_failure_is_500_and_server_survives(base_url: str, client: openai.OpenAI,
                                                   engine: FakeEngineClient) -> None:
    engine.fail_after = 2
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="fake-gemma", messages=USER)
    assert "device lost" in e.value.body["message"] and e.value.body["type"] == "server_error"
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json={"messages": USER, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert "device lost" in json.loads(events[-2].removeprefix("data: "))["error"]["message"]
    engine.fail_after = None
    assert client.chat.completions.create(model="fake-gemma", messages=USER).choices[0].message.content


def test_stream_disconnect_aborts(base_url: str, engine: FakeEngineClient) -> None:
    engine.reply = "x" * 150
    engine.token_delay = 0.02
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json={"messages": USER, "stream": True}) as r:
        for line in r.iter_lines():
            if '"content":"x"' in line:
                break  # got a token: now hang up
    rid = engine.calls[0][0]
    wait_until(lambda: rid in engine.aborted and rid not in engine.active, timeout=2, what="the abort")
    assert engine.tokens_emitted[rid] < 60  # it stopped right away, not after 150 tokens


def test_nonstream_disconnect_aborts(base_url: str, engine: FakeEngineClient) -> None:
    engine.gate.clear()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json={"prompt": "x"}, timeout=0.3)
    wait_until(lambda: len(engine.calls) == 1 and engine.calls[0][0] in engine.aborted, timeout=3,
               what="the abort")
    wait_until(lambda: not engine.active, timeout=2, what="the generation to stop")
    assert engine.tokens_emitted[engine.calls[0][0]] == 0


def test_n_stream_disconnect_aborts_every_choice(base_url: str, engine: FakeEngineClient) -> None:
    engine.reply = "y" * 150
    engine.token_delay = 0.02
    body = {"messages": USER, "stream": True, "n": 3}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if '"content":"y"' in line:
                break
    wait_until(lambda: len(engine.aborted) == 3 and not engine.active, timeout=2, what="three aborts")
    assert sorted(engine.aborted) == sorted(rid for rid, _, _ in engine.calls)


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def test_metrics(base_url: str, client: openai.OpenAI, engine: FakeEngineClient) -> None:
    client.chat.completions.create(model="fake-gemma", messages=USER)
    list(client.chat.completions.create(model="fake-gemma", messages=USER, stream=True, max_tokens=4))
    client.completions.create(model="fake-gemma", prompt="abc", n=2, max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER)
    httpx.get(f"{base_url}/v1/unknown")
    text = httpx.get(f"{base_url}/metrics").text
    assert _metric(text, "gemmajax_requests_total", '{endpoint="/v1/chat/completions",status="200"}') == 2
    assert _metric(text, "gemmajax_requests_total", '{endpoint="/v1/chat/completions",status="404"}') == 1
    assert _metric(text, "gemmajax_requests_total", '{endpoint="/v1/completions",status="200"}') == 1
    assert _metric(text, "gemmajax_requests_total", '{endpoint="other",status="404"}') == 1
    chat_prompt = len(engine.calls[0][1])
    assert _metric(text, "gemmajax_prompt_tokens_total") == 2 * chat_prompt + 3  # n=2 counts its prompt once
    assert _metric(text, "gemmajax_generation_tokens_total") == 12 + 4 + 2 * 3
    assert _metric(text, "gemmajax_time_to_first_token_seconds_count") == 4  # one per generation
    assert _metric(text, "gemmajax_e2e_request_latency_seconds_count") == 4
    assert _metric(text, "gemmajax_inter_token_latency_seconds_count") == 11 + 3 + 2 * 2
    assert _metric(text, "gemmajax_num_requests_running") == 0
    assert _metric(text, "gemmajax_num_requests_waiting") == 0
    assert _metric(text, "gemmajax_kv_cache_usage_perc") == 0.25
    assert _metric(text, "gemmajax_engine_num_preemptions") == 2
    assert _metric(text, "gemmajax_kv_cache_pages_used") == 7
    assert _metric(text, "gemmajax_server_requests_in_flight") == 0


def test_metrics_registry_is_per_app() -> None:
    a, b = make_app(FakeEngineClient()), make_app(FakeEngineClient())
    assert a.state.metrics.registry is not b.state.metrics.registry
    from prometheus_client import REGISTRY

    assert "gemmajax_requests" not in REGISTRY._names_to_collectors


def test_engine_rejections_are_400(base_url: str, client: openai.OpenAI, engine: FakeEngineClient) -> None:
    class GrammarError(ValueError):
        pass

    engine.reject = GrammarError("unsupported keyword 'patternProperties'")
    import sys
    from types import SimpleNamespace

    fake = SimpleNamespace(json_schema_grammar=lambda schema: "G", thinking_then=lambda g: g,
                           json_object_grammar=lambda: "G", tool_call_grammar=lambda *a, **k: "G",
                           GrammarError=GrammarError)
    old = sys.modules.get("gemmajax.tools.constrained")
    sys.modules["gemmajax.tools.constrained"] = fake
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="fake-gemma", messages=USER, response_format={"type": "json_object"})
    finally:
        if old is None:
            del sys.modules["gemmajax.tools.constrained"]
        else:
            sys.modules["gemmajax.tools.constrained"] = old
    assert e.value.body["param"] == "response_format" and "patternProperties" in e.value.body["message"]
    engine.reject = ValueError("prompt token ids must be in [0, 262144), got [999999]")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-gemma", prompt=[999999])
    assert "999999" in e.value.body["message"]
    engine.reject = None
    engine.error_after = 0
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-gemma", messages=USER)
    assert "KV pages" in e.value.body["message"]
    engine.error_after = 3
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="fake-gemma", messages=USER)
    assert "after 3 tokens" in e.value.body["message"]
    assert not {rid for rid, _, _ in engine.calls[-2:]} & set(engine.aborted)  # finished: nothing to abort
    engine.healthy = False
    assert _error(httpx.get(f"{base_url}/health"), 503)["type"] == "server_error"


def test_only_a_real_disconnect_is_logged_as_one(base_url: str, engine: FakeEngineClient, caplog) -> None:
    """A client that reads a stream to [DONE] and closes did not leave mid-stream; one that hangs up early did."""
    caplog.set_level(logging.INFO, logger="gemmajax.server.app")
    engine.reply = "abc"
    for _ in range(5):
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json={"messages": USER, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
    time.sleep(0.3)
    assert "client disconnected" not in caplog.text
    engine.reply, engine.token_delay = "x" * 150, 0.02
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json={"messages": USER, "stream": True}) as r:
        for line in r.iter_lines():
            if '"content":"x"' in line:
                break
    wait_until(lambda: "client disconnected during a stream" in caplog.text, timeout=2, what="the log line")
