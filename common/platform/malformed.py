"""Bytes that do not parse as the message an RPC expects: which field is at fault, and a gRPC
interceptor that answers such calls with INVALID_ARGUMENT instead of grpc's UNKNOWN.

grpc deserializes a request before any servicer code runs; when protobuf refuses the bytes
(bad UTF-8 in a string field, a truncated length, a wire type that does not match the schema)
the client would get ``UNKNOWN: Unexpected DecodeError``. :class:`MalformedMessageInterceptor`
wraps every handler's deserializer so that the call ends with ``INVALID_ARGUMENT`` and a message
that names the field, found by :func:`locate_decode_error` walking the wire format against the
message's descriptor (e.g. ``items[2].tree.parents: truncated varint``).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor

# wire types of the protobuf encoding
VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5
_PACKABLE_WIRE = {
    FieldDescriptor.TYPE_DOUBLE: I64,
    FieldDescriptor.TYPE_FIXED64: I64,
    FieldDescriptor.TYPE_SFIXED64: I64,
    FieldDescriptor.TYPE_FLOAT: I32,
    FieldDescriptor.TYPE_FIXED32: I32,
    FieldDescriptor.TYPE_SFIXED32: I32,
}


class _Bad(Exception):
    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def _varint(data: bytes, pos: int, path: str) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data):
            raise _Bad(path, "truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise _Bad(path, "varint longer than 10 bytes")


def _expected_wire(field: FieldDescriptor) -> int:
    if field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE):
        return LEN
    return _PACKABLE_WIRE.get(field.type, VARINT)


def _walk(desc: Descriptor, data: bytes, prefix: str) -> None:
    """Raise :class:`_Bad` at the first field of ``data`` that cannot be a field of ``desc``."""
    pos, counts = 0, {}
    where = prefix or "request"
    while pos < len(data):
        tag, pos = _varint(data, pos, where)
        number, wire = tag >> 3, tag & 7
        field = desc.fields_by_number.get(number)
        # a field the schema does not know is blamed on the message that holds it
        path = (f"{prefix}.{field.name}" if prefix else field.name) if field is not None else where
        note = "" if field is not None else f"unknown field {number}: "
        if field is not None and field.is_repeated:
            path = f"{path}[{counts.get(number, 0)}]" if field.type == FieldDescriptor.TYPE_MESSAGE else path
            counts[number] = counts.get(number, 0) + 1
        if number == 0:
            raise _Bad(where, "field number 0 is not allowed")
        if field is not None and wire != _expected_wire(field) and not (wire == LEN and field.is_repeated):
            field = None  # protobuf keeps a field of the wrong wire type as an unknown field
        if wire == VARINT:
            try:
                _, pos = _varint(data, pos, path)
            except _Bad as bad:
                raise _Bad(path, note + bad.reason) from None
        elif wire in (I64, I32):
            size = 8 if wire == I64 else 4
            if pos + size > len(data):
                raise _Bad(path, note + f"truncated {size * 8}-bit value")
            pos += size
        elif wire == LEN:
            try:
                size, pos = _varint(data, pos, path)
            except _Bad as bad:
                raise _Bad(path, note + bad.reason) from None
            if pos + size > len(data):
                raise _Bad(path, note + f"length {size} runs past the end of the message")
            payload, pos = data[pos : pos + size], pos + size
            if field is not None:
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        payload.decode("utf-8")
                    except UnicodeDecodeError:
                        raise _Bad(path, "not valid UTF-8") from None
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    _walk(field.message_type, payload, path)
        elif wire in (SGROUP, EGROUP):
            raise _Bad(path, note + "groups are not part of this API")
        else:
            raise _Bad(path, note + f"unknown wire type {wire}")


def locate_decode_error(desc: Descriptor, data: bytes) -> tuple[str, str]:
    """``(field path, reason)`` for bytes that protobuf refuses to parse as ``desc``; the path is
    ``request`` when no single field is to blame."""
    try:
        _walk(desc, data, "")
    except _Bad as bad:
        return bad.path, bad.reason
    return "request", "not a valid message"


@dataclass(frozen=True)
class Malformed:
    """What a wrapped deserializer returns instead of raising: the message for the client."""

    message: str


def _safe_deserializer(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    desc = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)

    def safe(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or whatever a custom deserializer raises
            if desc is None:
                return Malformed(f"request: not a valid message ({exc})")
            path, reason = locate_decode_error(desc, data)
            return Malformed(f"{path}: {reason} (not a valid {desc.full_name})")

    return safe


async def handler_reply(fn: Callable[..., Any], request: Any, context: Any) -> Any:
    """Call a servicer method that answers once (plain or async), as grpc.aio does; for interceptors."""
    result = fn(request, context)
    return await result if inspect.isawaitable(result) else result


async def handler_replies(fn: Callable[..., Any], request: Any, context: Any) -> AsyncIterator[Any]:
    """The replies of a servicer method that answers with a stream, as grpc.aio calls it: an async
    generator, or a coroutine that writes with ``context.write()``; for interceptors."""
    result = fn(request, context)
    if hasattr(result, "__aiter__"):
        async for reply in result:
            yield reply
    elif inspect.isawaitable(result):
        await result


class MalformedMessageInterceptor(grpc.aio.ServerInterceptor):
    """Ends a call whose request (or any message of a request stream) does not parse with
    INVALID_ARGUMENT naming the field, before the servicer sees it. A stream that already ran
    ends at the bad message, through the servicer's own clean-up (its ``finally`` blocks)."""

    async def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        safe = _safe_deserializer(handler.request_deserializer)

        def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async def gen() -> AsyncIterator[Any]:
                async for request in requests:
                    if isinstance(request, Malformed):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                    yield request

            return gen()

        def unary_unary(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return await handler_reply(fn, request, context)

            return call

        def unary_stream(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                async for reply in handler_replies(fn, request, context):
                    yield reply

            return call

        def stream_unary(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
                return await handler_reply(fn, checked(requests, context), context)

            return call

        def stream_stream(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for reply in handler_replies(fn, checked(requests, context), context):
                    yield reply

            return call

        kwargs = {"request_deserializer": safe, "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary_unary(handler.unary_unary), **kwargs)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(unary_stream(handler.unary_stream), **kwargs)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(stream_unary(handler.stream_unary), **kwargs)
        return grpc.stream_stream_rpc_method_handler(stream_stream(handler.stream_stream), **kwargs)
