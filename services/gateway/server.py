"""Gateway service: the public API. Validates, tokenizes with the target's tokenizer, records
request state in Redis, relays to the router and streams text back incrementally."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import unknown_fields

from common.checkpoints import CheckpointError, load_tokenizer
from common.grpc_server import CHANNEL_OPTIONS, ServerHandle
from common.logs import get_logger, request_context
from common.service import StartupError
from common.store import RequestExists, Store
from cosine.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, router_pb2, router_pb2_grpc
from common.auth import ApiKeyError, ApiKeyInterceptor, load_api_keys
from common.metrics import ServiceMetrics
from services.gateway.metrics import GatewayMetrics
from services.gateway.requests import (
    GenerationRequest,
    IncrementalDetokenizer,
    InvalidRequest,
    Limits,
    RawRequest,
    StopMatcher,
    validate,
)
from services.gateway.settings import GatewaySettings

SERVICE_NAME = "cosine.v1.Gateway"
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
        stop=list(req.stop), request_id=req.request_id, domain_hint=req.domain_hint, unknown_fields=unknown,
    )


@dataclass
class Progress:
    """One piece of a generation as the gateway relays it."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    stats: common_pb2.SpecStats | None = None


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, app: GatewayApp):
        self.app = app

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.GenerateResponse:
        t0 = time.perf_counter_ns()
        gen = await self.app.admit(request, context)
        text, ids, last = [], [], None
        async for piece in self.app.relay(gen, context):
            text.append(piece.text)
            ids.extend(piece.token_ids)
            last = piece
        reply = gateway_pb2.GenerateResponse(request_id=gen.request_id, text="".join(text), token_ids=ids,
                                             finish_reason=last.finish_reason if last else 0)
        if last is not None and last.stats is not None:
            reply.stats.CopyFrom(last.stats)
        reply.usage.prompt_tokens = len(gen.prompt_ids)
        reply.usage.completion_tokens = len(ids)
        reply.timings.total_ns = time.perf_counter_ns() - t0
        return reply

    async def GenerateStream(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        gen = await self.app.admit(request, context)
        count = 0
        async for piece in self.app.relay(gen, context):
            count += len(piece.token_ids)
            chunk = gateway_pb2.GenerateChunk(request_id=gen.request_id, text=piece.text, token_ids=piece.token_ids, finished=piece.finished)
            if piece.finished:
                chunk.finish_reason = piece.finish_reason
                if piece.stats is not None:
                    chunk.stats.CopyFrom(piece.stats)
                chunk.usage.prompt_tokens = len(gen.prompt_ids)
                chunk.usage.completion_tokens = count
            yield chunk


class GatewayApp:
    role = "gateway"
    service_names = (SERVICE_NAME,)

    def __init__(self, settings: GatewaySettings, store: Store):
        self.settings = settings
        self.store = store
        self.servicer = GatewayServicer(self)
        self.tokenizer: Any = None
        self.limits: Limits | None = None
        self.eos_ids: tuple[int, ...] = ()
        self.router_channel: grpc.aio.Channel | None = None
        self.router_stub: router_pb2_grpc.RouterStub | None = None
        self.router_address = ""
        self.member_id = ""
        self.metrics: GatewayMetrics | None = None
        self.interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()  # API keys, when configured

    def bind_metrics(self, metrics: ServiceMetrics) -> None:
        self.metrics = GatewayMetrics(metrics)

    def register(self, server: grpc.aio.Server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(self.servicer, server)

    async def start(self, handle: ServerHandle, address: str) -> None:
        self.member_id = address

    async def stop(self) -> None:
        if self.router_channel is not None:
            await self.router_channel.close()

    def member_info(self) -> dict[str, Any]:
        return {"tokenizer": self.settings.tokenizer}

    # ---- set-up on demand ---------------------------------------------------------------------

    async def _ensure_ready(self, context: grpc.aio.ServicerContext) -> None:
        if self.limits is None:
            verifiers = await self.store.members("verifier")
            info = verifiers[0].info if verifiers else {}
            path = self.settings.tokenizer or info.get("target", "")
            if not path:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no verifier is registered (and no --tokenizer given): cannot tokenize")
            if self.tokenizer is None:
                try:
                    self.tokenizer = await asyncio.to_thread(load_tokenizer, path)
                except CheckpointError as exc:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot load the target's tokenizer: {exc}")
            vocab = int(info.get("vocab_size") or len(self.tokenizer))
            max_context = int(info.get("max_context") or getattr(self.tokenizer, "model_max_length", 0) or 1 << 30)
            self.limits = Limits(
                self.settings.default_max_new_tokens, self.settings.max_new_tokens_limit, self.settings.max_prompt_tokens,
                self.settings.max_stop_strings, vocab, min(max_context, 1 << 30),
            )
            eos = self.tokenizer.eos_token_id
            self.eos_ids = () if eos is None else (int(eos),)
        if self.router_stub is None:
            address = self.settings.router_address
            if not address:
                routers = await self.store.members("router")
                address = routers[0].address if routers else ""
            if not address:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no router is registered")
            self.router_address = address
            self.router_channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self.router_stub = router_pb2_grpc.RouterStub(self.router_channel)

    async def admit(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> GenerationRequest:
        await self._ensure_ready(context)
        assert self.limits is not None
        try:
            gen = validate(raw_from_pb(request), self.limits, lambda text: list(self.tokenizer(text).input_ids))
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return gen

    async def relay(self, gen: GenerationRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[Progress]:
        """Submit to the router and turn its token chunks into text pieces. Request state lives
        in Redis while the request runs and is removed whatever way it ends."""
        assert self.router_stub is not None
        with request_context(gen.request_id):
            try:
                await self.store.create_request(gen.request_id, list(gen.prompt_ids), gen.params(), owner=self.member_id)
            except RequestExists as exc:  # another request owns this id: answer without touching its state
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {exc}")
            submit = router_pb2.SubmitRequest(
                request_id=gen.request_id, prompt_ids=gen.prompt_ids, max_new_tokens=gen.max_new_tokens,
                stop_token_ids=self.eos_ids, domain_hint=gen.domain_hint,
            )
            submit.sampling.temperature = gen.temperature
            submit.sampling.top_p = gen.top_p
            submit.sampling.top_k = gen.top_k
            if gen.seed is not None:
                submit.sampling.seed = gen.seed
            remaining = context.time_remaining()
            timeout = min(remaining, self.settings.request_timeout_s) if remaining is not None else self.settings.request_timeout_s
            call = self.router_stub.Submit(submit, timeout=timeout)
            detok = IncrementalDetokenizer(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
            stops = StopMatcher(gen.stop) if gen.stop else None
            log.info("request admitted", prompt_tokens=len(gen.prompt_ids), max_new_tokens=gen.max_new_tokens,
                     temperature=gen.temperature, router=self.router_address)
            clock = self.metrics.start(len(gen.prompt_ids)) if self.metrics is not None else None
            outcome = "cancelled"
            try:
                async for chunk in call:
                    if clock is not None:
                        clock.tokens_out(len(chunk.token_ids))
                    text = detok.push(chunk.token_ids)
                    if chunk.finished:
                        text += detok.flush()
                    status = "done" if chunk.finished else "running"
                    await self.store.append_tokens(gen.request_id, list(chunk.token_ids), status=status)
                    reason = chunk.finish_reason
                    if stops is not None:
                        text = stops.feed(text) + (stops.flush() if chunk.finished else "")
                        if stops.stopped:
                            outcome = "stop"
                            yield Progress(text, list(chunk.token_ids), True, common_pb2.FINISH_REASON_STOP, chunk.stats)
                            return
                    if chunk.finished:
                        outcome = common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
                    yield Progress(text, list(chunk.token_ids), chunk.finished, reason, chunk.stats if chunk.finished else None)
                    if chunk.finished:
                        return
                raise RuntimeError("the router closed the stream before the request finished")
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAVAILABLE and "connect" in (exc.details() or "").lower():
                    self.router_stub = None  # rediscover the router next time
                outcome = code.name.lower()
                log.warning("request failed at the router", code=code.name, details=exc.details())
                await context.abort(code, exc.details() or code.name)
            finally:
                if clock is not None:
                    clock.end(outcome)
                call.cancel()  # no-op when finished; stops the router's work when we stopped early
                await self.store.delete_request(gen.request_id)


async def build_app(settings: GatewaySettings, store: Store) -> GatewayApp:
    app = GatewayApp(settings, store)
    try:
        keys = load_api_keys(settings.api_keys, settings.api_keys_file)
    except ApiKeyError as exc:
        raise StartupError(str(exc)) from None
    if keys:
        app.interceptors = (ApiKeyInterceptor(keys),)
        log.info("api keys required", keys=len(keys))
    if settings.tokenizer:
        try:
            app.tokenizer = await asyncio.to_thread(load_tokenizer, settings.tokenizer)
        except CheckpointError as exc:
            raise StartupError(str(exc)) from None
    return app


def main(argv: Sequence[str] | None = None) -> None:
    from common.service import run_service

    run_service(GatewaySettings, build_app, prog="services.gateway", argv=argv,
                description="CoSine gateway: the public generation API of a CoSine cluster.")
