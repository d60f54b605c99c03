"""gRPC plumbing shared by the four services: server creation with health and reflection,
signal handling and graceful shutdown. Servicers stay thin; this module knows no domain logic."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.platform.malformed import MalformedMessageInterceptor, handler_replies, handler_reply
from common.platform.tls import TlsConfig, add_port, open_channel

# Generous limits: a verify batch of many trees with logits-free payloads stays far below this.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # accept the keepalive pings our channels send every 30 s (the default floor of 5 minutes
    # answers them with GOAWAY "too many pings", which cut long streams)
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
]
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Each channel its own connection: with the shared pool, a channel opened to a restarted server
    # inherits the old channel's connection while it waits out its reconnect backoff, and its first
    # calls fail at once with "failed to connect" although the server is up again.
    ("grpc.use_local_subchannel_pool", 1),
]


class PortInUse(RuntimeError):
    pass


@dataclass
class ServerHandle:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)


async def create_server(
    address: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tls: TlsConfig | None = None,
) -> ServerHandle:
    """Create an aio server bound to ``address`` ("host:port"; port 0 picks a free one) with the
    standard health service and server reflection, serving TLS (or mTLS) when ``tls`` has a
    certificate, plaintext otherwise. Returns a started handle with its port. A request that
    does not parse ends with INVALID_ARGUMENT naming the field (innermost interceptor, so the
    others see that status like any other)."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[*interceptors, MalformedMessageInterceptor()])
    register(server)
    names = tuple(service_names)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    try:
        port = add_port(server, address, tls)
    except RuntimeError as exc:
        raise PortInUse(f"cannot listen on {address}: {exc}") from exc
    if port == 0:
        raise PortInUse(f"cannot listen on {address} (address in use or not local)")
    await server.start()
    handle = ServerHandle(server, port, health_servicer, names)
    await handle.set_serving(True)
    return handle


class ErrorStatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps exception types a servicer lets through to a status code (instead of UNKNOWN), e.g.
    ``{StoreUnavailable: UNAVAILABLE}``: Redis down is a retryable condition, not a server bug."""

    def __init__(self, mapping: Mapping[type[BaseException], grpc.StatusCode]) -> None:
        self.mapping = tuple(mapping.items())

    def _status(self, exc: BaseException) -> grpc.StatusCode | None:
        return next((code for kind, code in self.mapping if isinstance(exc, kind)), None)

    async def _abort_or_raise(self, exc: Exception, context: Any) -> None:
        """End the call with the mapped status, or let an unmapped exception through."""
        code = self._status(exc)
        if code is None:
            raise exc
        await context.abort(code, str(exc))

    async def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None

        def unary(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def wrapped(request_or_iterator: Any, context: Any) -> Any:
                try:
                    return await handler_reply(fn, request_or_iterator, context)
                except Exception as exc:
                    await self._abort_or_raise(exc, context)

            return wrapped

        def streaming(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def wrapped(request_or_iterator: Any, context: Any) -> AsyncIterator[Any]:
                try:
                    async for item in handler_replies(fn, request_or_iterator, context):
                        yield item
                except Exception as exc:
                    await self._abort_or_raise(exc, context)

            return wrapped

        return rewrap_handler(handler, unary, streaming)


def rewrap_handler(
    handler: grpc.RpcMethodHandler,
    unary: Callable[[Callable[..., Any]], Callable[..., Any]],
    streaming: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> grpc.RpcMethodHandler:
    """The same method with its behaviour wrapped: ``unary`` wraps handlers that answer once,
    ``streaming`` those that answer with a stream (what server interceptors need)."""
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kw)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kw)
    return handler


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def wait_for_shutdown_signal() -> str:
    """Resolve with the signal name on SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    fired: asyncio.Future[str] = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: fired.done() or fired.set_result(signal.Signals(s).name))
    try:
        return await fired
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def check_health(address: str, service: str = "", timeout_s: float = 2.0, tls: TlsConfig | None = None) -> bool:
    """True when the server at ``address`` answers SERVING for ``service`` (over TLS when ``tls``
    dials TLS)."""
    async with open_channel(address, tls) as channel:
        return await channel_serving(channel, service, timeout_s)


async def channel_serving(channel: grpc.aio.Channel, service: str = "", timeout_s: float = 2.0) -> bool:
    """True when the server behind ``channel`` answers SERVING for ``service`` through that very
    channel (so calls made on it next find it connected)."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def wait_healthy(
    address: str,
    timeout_s: float,
    service: str = "",
    is_alive: Callable[[], bool] | None = None,
    tls: TlsConfig | None = None,
) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if is_alive is not None and not is_alive():
            return False
        if await check_health(address, service, timeout_s=1.0, tls=tls):
            return True
        await asyncio.sleep(0.1)
    return False


ShutdownHook = Callable[[], Awaitable[None]]
