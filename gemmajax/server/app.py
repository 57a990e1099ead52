"""The Starlette app: routes, API key, bounded in-flight requests, OpenAI-shaped errors, SSE, metrics.

The app is a thin transport over an `EngineClient` (below); tests run it with a fake engine under uvicorn.
Every response, streamed or not, races a watcher of the client's connection: a client that goes away
cancels its handler at once, and the generation plumbing aborts the engine request (serving_completion.py).
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import secrets
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import anyio
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gemmajax.server.metrics import CONTENT_TYPE, ServerMetrics, stats_fields
from gemmajax.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    parse_request,
    short_repr,
    unknown_fields,
)
from gemmajax.server.serving_chat import ChatServing
from gemmajax.server.serving_completion import CompletionServing

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's "client closed request": only ever seen in metrics and logs
DEFAULT_MAX_REQUEST_BYTES = 16 << 20


class EngineClient(Protocol):
    """The engine as the server sees it (gemmajax.engine.async_engine.AsyncEngineClient implements it).

    `generate` yields RequestOutput-like objects as tokens arrive, the last with finished=True:
      request_id, prompt_token_ids, token_ids (all output ids so far), new_token_ids, delta_text, text
      (detokenized per SamplingParams.skip_special_tokens), finished, finish_reason ("stop" | "length" | "abort"
      | "error", with `error` the reason), logprobs (per new token {"token_id", "logprob", "top": [(id, lp)]}
      or None), num_cached_tokens.
    Optional extras used when present: `tokenizer` (with `decode(ids)`) and `token_text(id)` for logprob tokens
    and echo of token-id prompts; `sampling_defaults` (dict, e.g. from generation_config.json) for fields a
    request leaves unset; `check_health()` (False or an exception = 503), `start()`, `shutdown()` (sync or async).
    """

    model_name: str
    max_model_len: int

    def encode_prompt(self, prompt: str | list[int]) -> list[int]: ...

    def render_chat(self, messages: list[dict], *, tools: list[dict] | None, enable_thinking: bool,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]: ...

    def generate(self, request_id: str, prompt_token_ids: list[int], params: Any, after: str | None = None
                 ) -> AsyncIterator[Any]: ...
    # after: the request id of a sibling choice with the same prompt (n > 1), whose prompt pages this one may reuse

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> Any: ...


# --------------------------------------------------------------------------------------------- transport helpers
def json_response(payload: BaseModel | dict[str, Any], status: int = 200, headers: dict[str, str] | None = None
                  ) -> Response:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def error_response(err: APIError) -> Response:
    return json_response(err.body(), err.status, err.headers)


_TYPE_BY_STATUS = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


def http_error(status: int, message: str, **kw: Any) -> APIError:
    kind = "server_error" if status >= 500 else _TYPE_BY_STATUS.get(status, "invalid_request_error")
    return APIError(status, message, type=kind, **kw)


# --------------------------------------------------------------------------------------------- request bodies
async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` bytes: from Content-Length before
    reading anything, else (chunked) while counting the bytes as they stream in, so no more than `limit` bytes
    of a body are ever held."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _too_large(f"is {int(declared)} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"exceeds {limit} bytes", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(what: str, limit: int) -> APIError:
    return APIError(413, f"the request body {what}, more than this server's limit of {limit} bytes "
                         f"(--max-request-bytes); send a shorter request", code="request_too_large")


_BAD_TEXT = re.compile("[\ud800-\udfff]")  # lone surrogates: from \u escapes, or invalid UTF-8 (surrogateescape)


def decode_json(raw: bytes) -> Any:
    """The JSON value of a UTF-8 body, or APIError(400) saying what is wrong and, for bad text, in which field.

    Bytes that are not UTF-8 are decoded with surrogateescape, so the parse still succeeds and the string that
    holds them can be named; lone UTF-16 surrogates from `\\u` escapes are refused the same way, since no
    tokenizer or JSON encoder downstream can handle them."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        raw.decode("utf-8")
        utf8_error = None
    except UnicodeDecodeError as e:
        utf8_error = f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"
    text = raw.decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        note = f"; the body also holds {utf8_error}" if utf8_error else ""
        raise APIError(400, f"malformed JSON body: {e}{note}") from None
    except RecursionError:
        raise APIError(400, "the JSON body is nested too deeply: lists and objects may nest a few hundred levels, "
                            f"not {sys.getrecursionlimit()} or more") from None
    except ValueError:  # not a syntax error: an integer of more digits than int() accepts
        raise APIError(400, f"the JSON body holds an integer of more than {sys.get_int_max_str_digits()} digits") \
            from None
    bad = _find_bad_text(body)
    if bad is not None:
        path, value = bad
        m = _BAD_TEXT.search(value)
        if utf8_error is not None:
            why = f"the body is not valid UTF-8: {utf8_error}"
        else:
            why = f"it holds a lone UTF-16 surrogate \\u{ord(m.group()):04x} (a \\u escape of a high surrogate " \
                  f"must be followed by one of a low surrogate)"
        raise APIError(400, f"{path or 'body'}: a string is not valid Unicode text: {why}", param=path or None)
    return body


def _find_bad_text(body: Any) -> tuple[str, str] | None:
    """(dotted path, text) of the first string or key holding a lone surrogate, or None. Iterative: the JSON
    parser already bounded the depth, and this walk must not add a recursion of its own."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), body)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str):
            if _BAD_TEXT.search(node):
                return ".".join(_printable(p) for p in path), node
        elif isinstance(node, dict):
            for k in node:
                if _BAD_TEXT.search(k):
                    return ".".join(_printable(p) for p in (*path, k)), k
            stack.extend(((*path, k), v) for k, v in reversed(node.items()))  # popped in document order
        elif isinstance(node, list):
            stack.extend(((*path, str(i)), node[i]) for i in reversed(range(len(node))))
    return None


def _printable(part: str) -> str:
    return _BAD_TEXT.sub(lambda m: f"\\u{ord(m.group()):04x}", short_repr(part, 60, quote=False))


class ClientDisconnected(Exception):
    pass


async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope, flag: list[bool]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            flag[0] = True
            scope.cancel()
            return


async def until_disconnect(receive: Receive, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it if the client disconnects first (then raise ClientDisconnected)."""
    disconnected, result, error = [False], [None], [None]
    async with anyio.create_task_group() as tg:
        async def run() -> None:
            try:
                result[0] = await work
            except Exception as e:  # noqa: BLE001 -- re-raised below, outside the task group (no ExceptionGroup)
                error[0] = e
            tg.cancel_scope.cancel()

        tg.start_soon(_watch_disconnect, receive, tg.cancel_scope, disconnected)
        tg.start_soon(run)
    if disconnected[0]:
        raise ClientDisconnected
    if error[0] is not None:
        raise error[0]
    return result[0]


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of ready lines; stops it at once when the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, lines: AsyncIterator[str], on_close: Callable[[], None] | None = None) -> None:
        self.lines, self.on_close = lines, on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected, complete = [False], False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_disconnect, receive, tg.cancel_scope, disconnected)
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                try:
                    async for line in self.lines:
                        await send({"type": "http.response.body", "body": line.encode(), "more_body": True})
                    complete = True  # a client that closes once it has everything did not leave mid-stream
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # the client is gone (ASGI spec >= 2.4 reports it this way)
                    disconnected[0] = True
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.lines, "aclose", None)
                if aclose is not None:
                    await aclose()
            if disconnected[0] and not complete:
                logger.info("client disconnected during a stream")
            if self.on_close is not None:
                self.on_close()


class RequestSlots:
    """At most `limit` generation requests in the server at once; beyond that, 429."""

    def __init__(self, limit: int, metrics: ServerMetrics) -> None:
        if limit < 1:
            raise ValueError(f"max_queue must be >= 1, got {limit}")
        self.limit, self.used, self.metrics = limit, 0, metrics

    def acquire(self) -> Callable[[], None]:
        if self.used >= self.limit:
            raise http_error(429, f"the server is at its limit of {self.limit} requests in flight; retry shortly",
                             code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.used += 1
        self.metrics.in_flight.set(self.used)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.used -= 1
                self.metrics.in_flight.set(self.used)

        return release


# --------------------------------------------------------------------------------------------- middleware
class MetricsMiddleware:
    """Counts every HTTP response by endpoint and status (including 401/404/429 and client disconnects)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.count_request(scope["path"], status[0])


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every route but /health (unknown routes too, so that a client without the
    key learns nothing about the server) when the server was started with an API key."""

    OPEN = frozenset({"/health"})

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key and scope["type"] == "http" and scope["path"] not in self.OPEN:
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            # bytes: compare_digest refuses str with non-ASCII characters, which any client can send
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
                what = "no API key was given" if not auth else "the API key is not valid"
                err = http_error(401, f"{what}: send `Authorization: Bearer <key>` with the server's --api-key",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------------------------- the app
async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def engine_stats(engine: EngineClient) -> dict[str, float]:
    """engine.stats() as numbers, with `kv_pages_used` (pages held by requests, every KV group) added from the
    engine's block manager when the stats lack it (AsyncEngineClient's EngineStats does not carry it yet)."""
    fields = stats_fields(engine.stats())
    bm = getattr(getattr(engine, "engine", None), "block_manager", None)
    if "kv_pages_used" not in fields and bm is not None:
        fields["kv_pages_used"] = float(sum(bm.num_usable_pages(g) - bm.num_free_pages(g)
                                            for g in range(len(bm.groups))))
    return fields


def build_app(engine_client: EngineClient, *, api_key: str | None = None, max_queue: int = 256,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, sampling_params_cls: Callable[..., Any] | None = None
              ) -> Starlette:
    """The OpenAI-compatible app over `engine_client`.

    Args:
      engine_client: the engine (EngineClient protocol above).
      api_key: when set, /v1/* needs `Authorization: Bearer <api_key>` (else 401).
      max_queue: generation requests held at once (running + waiting); more get 429 with Retry-After.
      max_request_bytes: the largest request body accepted; a larger one gets 413 before it is read.
      sampling_params_cls: the SamplingParams class (default gemmajax.engine.sampling_params.SamplingParams).
    """
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    engine = engine_client
    metrics = ServerMetrics(lambda: engine_stats(engine))
    slots = RequestSlots(max_queue, metrics)
    chat = ChatServing(engine, metrics, sampling_params_cls=sampling_params_cls)
    completion = CompletionServing(engine, metrics, sampling_params_cls=sampling_params_cls)

    async def read_json(request: Request, model_cls: type[BaseModel]) -> Any:
        body = decode_json(await read_body(request, max_request_bytes))
        req = parse_request(model_cls, body)
        extra = unknown_fields(model_cls, body)
        if extra:
            logger.warning("ignoring unknown request fields %s on %s", [short_repr(k, 40) for k in extra[:10]],
                           request.url.path)
        return req

    async def generate(request: Request, model_cls: type[BaseModel], serving: Any) -> Response:
        release = None
        streaming = False
        try:
            req = await read_json(request, model_cls)
            release = slots.acquire()
            result = await until_disconnect(request.receive, serving.create(req))
            if isinstance(result, BaseModel):
                return json_response(result)
            streaming = True
            return EventStreamResponse(result, on_close=release)
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED)
        except ClientDisconnected:
            logger.info("client disconnected before the response to %s was ready", request.url.path)
            return Response(status_code=CLIENT_CLOSED)
        except APIError as e:
            return error_response(e)
        except Exception as e:
            logger.exception("request to %s failed", request.url.path)
            return error_response(http_error(500, f"the request failed: {type(e).__name__}: {e}"))
        finally:
            if release is not None and not streaming:
                release()

    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest, chat)

    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest, completion)

    async def models(request: Request) -> Response:
        card = ModelCard(id=engine.model_name, max_model_len=engine.max_model_len)
        return json_response(ModelList(data=[card]))

    async def health(request: Request) -> Response:
        check = getattr(engine, "check_health", None)
        try:
            healthy = True if check is None else await _maybe_await(check())
        except Exception as e:  # noqa: BLE001 -- any failure of the check means unhealthy
            return error_response(http_error(503, f"the engine is not healthy: {type(e).__name__}: {e}"))
        if healthy is False:
            return error_response(http_error(503, "the engine is not healthy (its check_health() returned False)"))
        return Response(status_code=200)

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            message = f"no route {request.url.path}; the routes are /v1/chat/completions, /v1/completions, " \
                      f"/v1/models, /health, /metrics"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(http_error(exc.status_code, message, headers=dict(exc.headers or {})))

    async def on_unhandled(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(http_error(500, f"internal error: {type(exc).__name__}: {exc}"))

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        start = getattr(engine, "start", None)
        if start is not None:
            await _maybe_await(start())
        try:
            yield
        finally:
            stop = getattr(engine, "shutdown", None)
            if stop is not None:
                await _maybe_await(stop())

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(MetricsMiddleware, metrics=metrics), Middleware(ApiKeyMiddleware, api_key=api_key)],
        exception_handlers={HTTPException: on_http_error, Exception: on_unhandled},
        lifespan=lifespan,
    )
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.slots = slots
    app.state.max_request_bytes = max_request_bytes
    return app
