"""Gateway service: the public API. Validates, tokenizes with the target's tokenizer, records
request state in Redis, relays to the router and streams text back incrementally."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import jinja2
from google.protobuf import unknown_fields
from prometheus_client import CollectorRegistry
from tenacity import retry_if_exception_type

from common.logs import get_logger
from common.platform.grpc_server import CHANNEL_OPTIONS, PortInUse, ServerHandle, channel_serving
from common.platform.metrics import ServiceMetrics
from common.platform.retry import RetryPolicy
from common.platform.service import StartupError
from common.platform.store import STORE_ERRORS, Store
from common.platform.tls import TlsConfig, http_server_ssl, open_channel
from common.runtime.checkpoints import CheckpointError, load_tokenizer
from common.spec.grammar import Grammars
from common.spec.types import Constraint, InvalidInput
from cosine.v1 import gateway_pb2, gateway_pb2_grpc, router_pb2_grpc
from cosine_client.errors import GATEWAY_ANSWER
from services.convert import finish_reason_to_pb, logprobs_to_pb, spec_stats_to_pb
from services.gateway.auth import ApiKeyError, ApiKeyInterceptor, load_api_keys
from services.gateway.chat_template import ChatTemplateError, load_chat_template
from services.gateway.errors import GatewayError
from services.gateway.http_api import HttpFront
from services.gateway.metrics import GatewayMetrics
from services.gateway.progress import Progress
from services.gateway.relay import RouterRelay
from services.gateway.requests import (
    GenerationRequest,
    InvalidRequest,
    Limits,
    RawRequest,
    validate,
)
from services.gateway.settings import GatewaySettings

SERVICE_NAME = "cosine.v1.Gateway"
# Waiting for a router after the one in use was lost: 0.1 s doubling to 0.5 s between looks (each
# look waits up to a second for a health answer), until the resume's deadline.
ROUTER_RETRY = RetryPolicy(initial_s=0.1, max_s=0.5)
log = get_logger("gateway")


def raw_from_pb(req: gateway_pb2.GenerateRequest) -> RawRequest:
    which = req.WhichOneof("input")
    unknown = [f.field_number for f in unknown_fields.UnknownFieldSet(req)]
    return RawRequest(
        prompt=req.prompt if which == "prompt" else None,
        prompt_ids=list(req.prompt_ids.ids) if which == "prompt_ids" else None,
        max_new_tokens=req.max_new_tokens,
        temperature=req.temperature if req.HasField("temperature") else None,
        top_p=req.top_p if req.HasField("top_p") else None,
        top_k=req.top_k if req.HasField("top_k") else None,
        seed=req.seed if req.HasField("seed") else None,
        stop=list(req.stop),
        request_id=req.request_id,
        domain_hint=req.domain_hint,
        unknown_fields=unknown,
        resume_ids=list(req.resume_ids.ids),
        logprobs=req.logprobs if req.HasField("logprobs") else None,
        presence_penalty=req.presence_penalty if req.HasField("presence_penalty") else None,
        frequency_penalty=req.frequency_penalty if req.HasField("frequency_penalty") else None,
        repetition_penalty=req.repetition_penalty if req.HasField("repetition_penalty") else None,
        constraint=Constraint(req.constraint.kind, req.constraint.spec) if req.HasField("constraint") else None,
    )


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Thin: protobuf in, :class:`GatewayApp` calls, protobuf out; a GatewayError becomes its status."""

    def __init__(self, app: GatewayApp):
        self.app = app

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GenerateResponse:
        t0 = time.perf_counter_ns()
        text, ids, logprobs, last = [], [], [], None
        try:
            gen = await self.app.admit(raw_from_pb(request))
            async for piece in self.app.relay(gen, context.time_remaining()):
                text.append(piece.text)
                ids.extend(piece.token_ids)
                logprobs.extend(piece.logprobs)
                last = piece
        except GatewayError as exc:
            await context.abort(exc.code, exc.message, trailing_metadata=(GATEWAY_ANSWER,))
        reply = gateway_pb2.GenerateResponse(
            request_id=gen.request_id,
            text="".join(text),
            token_ids=ids,
            finish_reason=finish_reason_to_pb(last.finish_reason) if last else 0,
            logprobs=logprobs_to_pb(logprobs),
        )
        if last is not None and last.stats is not None:
            reply.stats.CopyFrom(spec_stats_to_pb(last.stats))
        reply.usage.prompt_tokens = len(gen.prompt_ids)
        reply.usage.completion_tokens = len(gen.resume_ids) + len(ids)
        reply.timings.total_ns = time.perf_counter_ns() - t0
        return reply

    async def GenerateStream(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        count = 0
        try:
            gen = await self.app.admit(raw_from_pb(request))
            async for piece in self.app.relay(gen, context.time_remaining()):
                count += len(piece.token_ids)
                chunk = gateway_pb2.GenerateChunk(
                    request_id=gen.request_id,
                    text=piece.text,
                    token_ids=piece.token_ids,
                    finished=piece.finished,
                    logprobs=logprobs_to_pb(piece.logprobs),
                )
                if piece.finished:
                    chunk.finish_reason = finish_reason_to_pb(piece.finish_reason)
                    if piece.stats is not None:
                        chunk.stats.CopyFrom(spec_stats_to_pb(piece.stats))
                    chunk.usage.prompt_tokens = len(gen.prompt_ids)
                    chunk.usage.completion_tokens = len(gen.resume_ids) + count
                yield chunk
        except GatewayError as exc:
            await context.abort(exc.code, exc.message, trailing_metadata=(GATEWAY_ANSWER,))


class GatewayApp:
    """What the gateway does for a request, whichever front it came through (gRPC or HTTP):
    tokenizer and limits on demand, validation, admission under the in-flight limit, and the relay
    of the router's token stream as text. Failures are :class:`GatewayError` with a status code."""

    role = "gateway"
    service_names = (SERVICE_NAME,)

    def __init__(self, settings: GatewaySettings, store: Store):
        self.settings = settings
        self.store = store
        self.servicer = GatewayServicer(self)
        self.tokenizer: Any = None
        self.limits: Limits | None = None
        self.grammars: Grammars | None = None  # constraints compiled against the tokenizer (a 400 if they fail)
        self.eos_ids: tuple[int, ...] = ()
        self.model_name = settings.served_model_name
        self.chat_template: str | None = None  # --chat-template; None: the tokenizer's own
        self.router_channel: grpc.aio.Channel | None = None
        self.router_stub: router_pb2_grpc.RouterStub | None = None
        self.router_address = ""
        self.member_id = ""
        self.inflight = 0
        self.metrics: GatewayMetrics | None = None
        self.metrics_registry: CollectorRegistry | None = None  # also served on the HTTP API's /metrics
        self.keys: frozenset[str] = frozenset()
        self.interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()  # API keys, when configured
        self.http: HttpFront | None = None
        self._reconnecting = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()

    def bind_metrics(self, metrics: ServiceMetrics) -> None:
        self.metrics = GatewayMetrics(metrics)
        self.metrics_registry = metrics.registry

    def register(self, server: grpc.aio.Server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(self.servicer, server)

    async def start(self, handle: ServerHandle, address: str) -> None:
        self.member_id = address
        if self.settings.http_port >= 0:
            self.http = HttpFront(self, self.settings.host, self.settings.http_port)
            try:
                https = http_server_ssl(TlsConfig.from_settings(self.settings))
                await self.http.start(ssl=https.uvicorn_options() if https is not None else None)
            except OSError as exc:
                raise PortInUse(f"cannot serve HTTP on port {self.settings.http_port}: {exc.strerror or exc}") from None

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop()
        for task in list(self._retiring):
            task.cancel()
        if self.router_channel is not None:
            await self.router_channel.close()

    def member_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"tokenizer": self.settings.tokenizer}
        if self.http is not None:
            info["http_port"] = self.http.port
        return info

    # ---- set-up on demand ---------------------------------------------------------------------

    async def ensure_ready(self) -> None:
        """Tokenizer, limits and router channel, found through Redis membership on first use."""
        if self.limits is None:
            try:
                verifiers = await self.store.members("verifier")
            except STORE_ERRORS as exc:
                raise GatewayError(
                    grpc.StatusCode.UNAVAILABLE, f"cluster state cannot be read (Redis): {exc}"
                ) from None
            info = verifiers[0].info if verifiers else {}
            path = self.settings.tokenizer or info.get("target", "")
            if not path:
                raise GatewayError(
                    grpc.StatusCode.UNAVAILABLE, "no verifier is registered (and no --tokenizer given): cannot tokenize"
                )
            if self.tokenizer is None:
                try:
                    self.tokenizer = await asyncio.to_thread(load_tokenizer, path)
                except CheckpointError as exc:
                    raise GatewayError(
                        grpc.StatusCode.FAILED_PRECONDITION, f"cannot load the target's tokenizer: {exc}"
                    ) from None
            vocab = int(info.get("vocab_size") or len(self.tokenizer))
            max_context = int(info.get("max_context") or getattr(self.tokenizer, "model_max_length", 0) or 1 << 30)
            tokenizer = self.tokenizer
            # no await from here on: ``limits`` set means ready, so everything else is set with it
            # (the grammar engine builds its view of the tokenizer on first use, in a worker thread)
            self.grammars = Grammars(lambda: tokenizer, vocab)
            if not self.model_name:
                self.model_name = Path(path.rstrip("/")).name or "cosine"
            eos = self.tokenizer.eos_token_id
            self.eos_ids = () if eos is None else (int(eos),)
            self.limits = Limits(
                self.settings.default_max_new_tokens,
                self.settings.max_new_tokens_limit,
                self.settings.max_prompt_tokens,
                self.settings.max_stop_strings,
                vocab,
                min(max_context, 1 << 30),
                self.settings.max_logprobs,
            )
        if self.router_stub is None:
            address = self.settings.router_address
            if not address:
                try:
                    routers = await self.store.members("router")
                except STORE_ERRORS as exc:
                    raise GatewayError(
                        grpc.StatusCode.UNAVAILABLE, f"cluster state cannot be read (Redis): {exc}"
                    ) from None
                address = routers[0].address if routers else ""
            if not address:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, "no router is registered")
            self.router_address = address
            self.router_channel = open_channel(address, TlsConfig.from_settings(self.settings), CHANNEL_OPTIONS)
            self.router_stub = router_pb2_grpc.RouterStub(self.router_channel)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """A chat as the target was trained to see it: ``--chat-template`` or else its tokenizer's
        chat template, with the assistant's turn opened, tokenized as is (the template writes any
        special tokens)."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequest(
                "messages",
                "the target's tokenizer has no chat template and the gateway was given no --chat-template; "
                "use /v1/completions with a prompt",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=True, tokenize=False
            )
        except jinja2.TemplateError as exc:  # a template's raise_exception(...): roles out of order, ...
            raise InvalidRequest("messages", f"the chat template refused the messages: {exc}") from None
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    async def admit(self, raw: RawRequest) -> GenerationRequest:
        """Validate a request (the cluster must be ready to tokenize it)."""
        await self.ensure_ready()
        assert self.limits is not None
        try:
            gen = validate(raw, self.limits, self.tokenize)
        except InvalidRequest as exc:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field) from None
        if gen.constraint is not None and self.grammars is not None:
            try:  # compiled here too (cached), so a bad one is refused before it reaches the cluster
                await asyncio.to_thread(self.grammars.compile, gen.constraint)
            except InvalidInput as exc:
                reason = str(exc).removeprefix("constraint: ")
                raise GatewayError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{raw.constraint_field}: {reason}", raw.constraint_field
                ) from None
        return gen

    async def relay(self, gen: GenerationRequest, deadline_s: float | None = None) -> AsyncIterator[Progress]:
        """Submit to the router and turn its token chunks into text pieces. Request state lives
        in Redis while the request runs and is removed whatever way it ends."""
        if self.inflight >= self.settings.max_inflight:
            raise GatewayError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the gateway is at its limit of {self.settings.max_inflight} requests in flight; retry later",
            )
        assert self.router_stub is not None
        self.inflight += 1
        try:
            async for piece in self._relay(gen, deadline_s):
                yield piece
        finally:
            self.inflight -= 1

    async def _relay(self, gen: GenerationRequest, deadline_s: float | None) -> AsyncIterator[Progress]:
        timeout = (
            self.settings.request_timeout_s if deadline_s is None else min(deadline_s, self.settings.request_timeout_s)
        )
        async for piece in RouterRelay(self, gen, timeout).pieces():
            yield piece

    async def reconnect_router(self, deadline: float, lost: router_pb2_grpc.RouterStub | None) -> None:
        """After the router behind stub ``lost`` was lost: wait (until ``deadline``, loop time) for
        a router that answers health checks, the same one restarted or another member. Requests
        that lose the same router share one reconnection; the old channel is closed only after the
        calls still on it have had time to notice, so none is cut as cancelled."""
        loop = asyncio.get_running_loop()
        async with self._reconnecting:
            async for attempt in ROUTER_RETRY.retrying(
                retry=retry_if_exception_type(GatewayError), stop=lambda _: loop.time() >= deadline
            ):
                with attempt:
                    # after the first look, a router that still does not answer is looked up again
                    await self._router_answers(
                        rediscover=attempt.retry_state.attempt_number > 1
                        or self.router_stub is lost
                        or self.router_stub is None
                    )

    async def _router_answers(self, rediscover: bool) -> None:
        """One look for a router that answers health checks (a GatewayError while there is none)."""
        if rediscover:
            self.forget_router()
            try:
                await self.ensure_ready()
            except GatewayError as exc:
                log.debug("no router yet", reason=exc.message)
                raise
        # asked through the channel the resumed requests are submitted on, not a new one
        if self.router_channel is None or not await channel_serving(self.router_channel, timeout_s=1.0):
            within = self.settings.router_resume_timeout_s
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"the router was lost and none answered within {within:g}s")

    def forget_router(self) -> None:
        """Look the router up again on the next request (its channel is closed a little later)."""
        if self.router_channel is not None:
            self._retire(self.router_channel)
        self.router_channel, self.router_stub = None, None

    def _retire(self, channel: grpc.aio.Channel, after_s: float = 30.0) -> None:
        async def close_later() -> None:
            await asyncio.sleep(after_s)
            await channel.close()

        task = asyncio.get_running_loop().create_task(close_later())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)


async def build_app(settings: GatewaySettings, store: Store) -> GatewayApp:
    app = GatewayApp(settings, store)
    try:
        keys = load_api_keys(settings.api_keys, settings.api_keys_file)
        app.chat_template = load_chat_template(settings.chat_template)
    except (ApiKeyError, ChatTemplateError) as exc:
        raise StartupError(str(exc)) from None
    if app.chat_template is not None:
        log.info("chat template from --chat-template", chars=len(app.chat_template))
    if keys:
        app.keys = keys
        app.interceptors = (ApiKeyInterceptor(keys),)
        log.info("api keys required", keys=len(keys))
    if settings.tokenizer:
        try:
            app.tokenizer = await asyncio.to_thread(load_tokenizer, settings.tokenizer)
        except CheckpointError as exc:
            raise StartupError(str(exc)) from None
    return app


def main(argv: Sequence[str] | None = None) -> None:
    from common.platform.service import run_service

    run_service(
        GatewaySettings,
        build_app,
        prog="services.gateway",
        argv=argv,
        description="CoSine gateway: the public generation API of a CoSine cluster.",
    )
