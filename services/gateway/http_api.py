"""The OpenAI-compatible HTTP front of the gateway: ``POST /v1/completions``,
``POST /v1/chat/completions`` (server-sent events when ``stream`` is set), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (the gateway's Prometheus families, as on its metrics port),
served by uvicorn in the gateway's own event loop beside its gRPC server.

Thin like the gRPC servicer: bodies become the gateway's :class:`RawRequest`, the gateway's app
(seen here only as the :class:`HttpHost` it provides) validates, admits and relays, and a
:class:`GatewayError` becomes an OpenAI error object with the HTTP status of its gRPC code (400
naming the field, 401, 404, 409, 429, 503, 504). API keys, when the gateway has any, are
required as ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.logs import get_logger
from common.spec.grammar import Grammars
from common.spec.types import TokenLogprob
from services.gateway.auth import UNAUTHENTICATED_MESSAGE, bearer_token, key_is_valid
from services.gateway.errors import GatewayError
from services.gateway.openai_choices import collect, fan_out, first_pieces, merged, merged_stats
from services.gateway.openai_logprobs import Shaper, shaper
from services.gateway.openai_schema import (
    FINISH_REASONS,
    ChatCompletionRequest,
    CompletionRequest,
    asked_logprobs,
    chat_raw,
    choices,
    completion_raw,
    envelope,
    error_body,
    spec_decoding,
    usage,
)
from services.gateway.progress import Progress
from services.gateway.requests import GenerationRequest, InvalidRequest, RawRequest
from services.gateway.settings import GatewaySettings

log = get_logger("gateway.http")


class HttpHost(Protocol):
    """What the HTTP front uses of the gateway (:class:`services.gateway.server.GatewayApp` is one)."""

    settings: GatewaySettings
    keys: frozenset[str]  # API keys; empty: none required
    model_name: str
    tokenizer: Any  # the target's (a token's text in the logprobs objects)
    grammars: Grammars | None  # the grammar engine's view of it (a token's raw bytes); None before ready
    metrics_registry: CollectorRegistry | None  # the gateway's Prometheus registry; None: no /metrics

    async def ensure_ready(self) -> None: ...

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]: ...

    async def admit(self, raw: RawRequest) -> GenerationRequest: ...

    def relay(self, gen: GenerationRequest, deadline_s: float | None = None) -> AsyncIterator[Progress]: ...


HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.FAILED_PRECONDITION: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
# The gateway's field names, as an OpenAI client knows them.
PARAM_NAMES = {"prompt_ids": "prompt", "max_new_tokens": "max_tokens", "request": None}


def error_response(exc: GatewayError, chat: bool = False) -> JSONResponse:
    status, kind = HTTP_STATUS.get(exc.code, (500, "internal_error"))
    param = PARAM_NAMES.get(exc.field, exc.field) or None
    if chat and param == "prompt":
        param = "messages"
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(
        error_body(exc.message, kind, param, exc.code.name.lower()), status_code=status, headers=headers
    )


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def create_http_app(gateway: HttpHost) -> FastAPI:
    api = FastAPI(
        title="CoSine gateway",
        summary="OpenAI-compatible completions served by speculative decoding",
        docs_url=None,
        redoc_url=None,
    )

    @api.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = list(first.get("loc", ()))
        if loc and loc[0] == "body":
            loc = loc[1:]
        # a body that is not JSON, or not an object, is the request as a whole (no field to name)
        whole = first.get("type") == "json_invalid" or not loc or not isinstance(loc[0], str)
        param = None if whole else ".".join(str(p) for p in loc)
        what = (
            "the request body is not a valid JSON object"
            if whole and first.get("type") in ("json_invalid", "model_attributes_type", "dict_type")
            else ""
        )
        message = (
            f"{param}: {first.get('msg', 'invalid')}"
            if param
            else (what or str(first.get("msg", "invalid request body")))
        )
        return JSONResponse(error_body(message, "invalid_request_error", param, "invalid_argument"), status_code=400)

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return JSONResponse(
            error_body(str(exc.detail), kind, None, None), status_code=exc.status_code, headers=exc.headers
        )

    def authorize(request: Request) -> None:
        if gateway.keys and not key_is_valid(bearer_token(request.headers.get("authorization")), gateway.keys):
            raise GatewayError(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    async def ready_model(model: str | None) -> str:
        await gateway.ensure_ready()
        if model is not None and model != gateway.model_name:
            raise GatewayError(
                grpc.StatusCode.NOT_FOUND,
                f"model '{model}' is not served here; this server serves '{gateway.model_name}'",
                "model",
            )
        return gateway.model_name

    @api.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/metrics")
    async def metrics() -> Response:
        """Open without a key, as /health and the metrics port are (scrapers carry no API key)."""
        registry = gateway.metrics_registry
        if registry is None:
            raise StarletteHTTPException(404, "this gateway keeps no metrics")
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            authorize(request)
            name = await ready_model(None)
        except GatewayError as exc:
            return error_response(exc)
        return JSONResponse(
            {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "cosine"}]}
        )

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        request_id = uuid.uuid4().hex
        return await _serve(
            request,
            body,
            lambda: completion_raw(body, request_id, gateway.settings.max_logprobs),
            chat=False,
            request_id=request_id,
        )

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        request_id = uuid.uuid4().hex
        return await _serve(
            request,
            body,
            lambda: chat_raw(body, request_id, gateway.render_chat, gateway.settings.max_logprobs),
            chat=True,
            request_id=request_id,
        )

    async def _serve(
        request: Request, body: CompletionRequest | ChatCompletionRequest, to_raw: Any, *, chat: bool, request_id: str
    ) -> Any:
        try:
            authorize(request)
            model = await ready_model(body.model)
            try:
                raw: RawRequest = to_raw()
                n = choices(body, gateway.settings.max_n)
            except InvalidRequest as exc:
                raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field) from None
            gen = await gateway.admit(raw)
            streams = [gateway.relay(g) for g in fan_out(gen, n)]
            firsts = await first_pieces(streams)  # failures before the first token still get a status code
        except GatewayError as exc:
            return error_response(exc, chat)
        except StopAsyncIteration:
            return error_response(GatewayError(grpc.StatusCode.INTERNAL, "the request ended without output"), chat)
        response_id = ("chatcmpl-" if chat else "cmpl-") + gen.request_id
        token_bytes = None
        if chat and asked_logprobs(body) is not None and gateway.grammars is not None:
            await asyncio.to_thread(gateway.grammars.warm)  # its tokenizer view, built once (about a second)
            token_bytes = gateway.grammars.token_bytes
        shapers = [shaper(gateway.tokenizer, asked_logprobs(body), chat, token_bytes) for _ in range(n)]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _stream(gen, merged(streams, firsts), response_id, model, chat, include_usage, shapers)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            whole = await collect(streams, firsts)
        except GatewayError as exc:
            return error_response(exc, chat)
        out = []
        for i, got in enumerate(whole):
            reason = FINISH_REASONS.get(got.last.finish_reason, "stop")
            choice: dict[str, Any] = {"index": i, "finish_reason": reason, "logprobs": shapers[i](got.entries)}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(got.text)}
            else:
                choice["text"] = "".join(got.text)
            out.append(choice)
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse(
            envelope(
                kind,
                response_id,
                model,
                out,
                usage=usage(len(gen.prompt_ids), sum(got.count for got in whole)),
                speculative_decoding=spec_decoding(merged_stats([got.last.stats for got in whole])),
            )
        )

    return api


async def _stream(
    gen: GenerationRequest,
    pieces: AsyncIterator[tuple[int, Progress]],
    response_id: str,
    model: str,
    chat: bool,
    include_usage: bool,
    shapers: list[Shaper],
) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's chunk shape, ``data: [DONE]`` last; each chunk holds one
    choice, named by its ``index``, the choices' chunks interleaved as they come. A failure after
    the first event (headers already sent) is reported as an ``error`` event. Each chunk carries
    the logprobs of its choice's tokens since that choice's previous chunk (a piece whose text is
    still held back sends no chunk; its tokens' logprobs go with the next). The last choice to
    finish carries ``speculative_decoding`` for all of them."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    n = len(shapers)
    count = 0
    entries: list[list[TokenLogprob]] = [[] for _ in range(n)]
    started = [False] * n
    stats: list[Any] = [None] * n
    finished = 0

    def chunk(i: int, text: str, reason: str | None, role: bool = False, **extra: Any) -> bytes:
        shaped = shapers[i](entries[i])
        entries[i].clear()
        if chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            )
            choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": shaped}
        else:
            choice = {"index": i, "text": text, "finish_reason": reason, "logprobs": shaped}
        return _sse(envelope(kind, response_id, model, [choice], **extra))

    try:
        async for i, piece in pieces:
            count += len(piece.token_ids)
            entries[i].extend(piece.logprobs)
            is_first, started[i] = not started[i], True
            reason = FINISH_REASONS.get(piece.finish_reason, "stop") if piece.finished else None
            extra = {}
            if piece.finished:
                stats[i], finished = piece.stats, finished + 1
                if finished == n:
                    extra = {"speculative_decoding": spec_decoding(merged_stats(stats))}
            if piece.text or piece.finished or (chat and is_first):
                yield chunk(i, piece.text, reason, role=chat and is_first, **extra)
        if include_usage:
            yield _sse(envelope(kind, response_id, model, [], usage=usage(len(gen.prompt_ids), count)))
    except GatewayError as exc:
        status, err_kind = HTTP_STATUS.get(exc.code, (500, "internal_error"))
        yield _sse(error_body(exc.message, err_kind, None, exc.code.name.lower()))
    finally:
        await pieces.aclose()  # a client that went away cancels the requests at the router
    yield _sse("[DONE]")


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside the service's own loop: signals stay the service's (it drains both fronts)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpFront:
    """Serves :func:`create_http_app` on ``host:port`` (port 0: any free port; ``port`` holds the
    bound one after :meth:`start`)."""

    def __init__(self, gateway: HttpHost, host: str, port: int):
        self.gateway = gateway
        self.host = host
        self.port = port
        self.server: _EmbeddedServer | None = None
        self.task: asyncio.Task[None] | None = None

    def _socket(self) -> socket.socket:
        family, kind, proto, _, addr = socket.getaddrinfo(
            self.host or None, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError:
            sock.close()
            raise
        sock.set_inheritable(True)
        return sock

    async def start(self, ssl: dict[str, Any] | None = None) -> None:
        sock = self._socket()
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            create_http_app(self.gateway),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=self.gateway.settings.shutdown_grace_s,
            **(ssl or {}),
        )
        self.server = _EmbeddedServer(config)
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises the start-up error
                raise OSError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        log.info("serving HTTP", port=self.port, api="openai")

    async def stop(self) -> None:
        if self.server is None or self.task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self.task, timeout=self.gateway.settings.shutdown_grace_s + 2)
