"""API keys at the public face: loading them, checking them in constant time, and a gRPC server
interceptor that refuses calls without a valid ``authorization: Bearer <key>`` metadata entry.

Keys come from a file (one key per line, blank lines and ``#`` comments ignored; a Kubernetes
Secret mounted as a file fits) and/or a list given in settings (``COSINE_API_KEYS``,
comma-separated). No keys means authentication is off. A refused call gets UNAUTHENTICATED with
a fixed message: nothing tells a caller whether a key was missing, malformed or merely wrong.
Health checks and server reflection stay open so that probes need no key.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc

UNAUTHENTICATED_MESSAGE = "missing or invalid API key"
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class ApiKeyError(ValueError):
    """The key file cannot be read. The message names the path."""


def load_api_keys(keys: Iterable[str] = (), keys_file: str = "") -> frozenset[str]:
    found = [k.strip() for k in keys if k.strip()]
    if keys_file:
        try:
            text = Path(keys_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ApiKeyError(f"cannot read the API key file {keys_file}: {exc.strerror or exc}") from None
        found += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return frozenset(found)


def bearer_token(header: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header value, or None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def key_is_valid(presented: str | None, keys: frozenset[str]) -> bool:
    """Constant-time comparison against every key (no early exit on the first match)."""
    if presented is None:
        return False
    candidate = presented.encode()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(candidate, key.encode())
    return ok


def _metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, name: str) -> str | None:
    for key, value in metadata or ():
        if key == name:
            return value.decode() if isinstance(value, bytes) else value
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health and reflection unless it carries a valid bearer key."""

    def __init__(self, keys: frozenset[str]):
        self.keys = keys

    def _deny(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        async def abort(request_or_iterator: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

        async def abort_stream(request_or_iterator: object, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
            yield  # pragma: no cover - makes this an async generator

        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(abort, **kwargs)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(abort_stream, **kwargs)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(abort, **kwargs)
        return grpc.stream_stream_rpc_method_handler(abort_stream, **kwargs)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        token = bearer_token(_metadata_value(handler_call_details.invocation_metadata, "authorization"))
        if key_is_valid(token, self.keys):
            return handler
        return self._deny(handler)
