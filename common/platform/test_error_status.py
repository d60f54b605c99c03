"""ErrorStatusInterceptor over a real gRPC server and channel: an exception type a servicer lets
through becomes the status it is mapped to (StoreUnavailable -> UNAVAILABLE), for unary and
streaming handlers alike; other exceptions stay UNKNOWN."""

from __future__ import annotations

import asyncio

import grpc

from common.platform.grpc_server import ErrorStatusInterceptor
from common.platform.store import StoreUnavailable


async def _unary(request: bytes, context) -> bytes:
    if request == b"outage":
        raise StoreUnavailable("Redis unavailable: connection refused")
    if request == b"bug":
        raise ValueError("a bug")
    return b"ok"


async def _stream(request: bytes, context):
    yield b"first"
    raise StoreUnavailable("Redis unavailable: connection refused")


async def _call_all() -> dict[str, tuple[grpc.StatusCode, str]]:
    handler = grpc.method_handlers_generic_handler(
        "t.T",
        {
            "U": grpc.unary_unary_rpc_method_handler(_unary),
            "S": grpc.unary_stream_rpc_method_handler(_stream),
        },
    )
    server = grpc.aio.server(interceptors=[ErrorStatusInterceptor({StoreUnavailable: grpc.StatusCode.UNAVAILABLE})])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out: dict[str, tuple[grpc.StatusCode, str]] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            unary = ch.unary_unary("/t.T/U")
            assert await unary(b"fine", timeout=10) == b"ok"
            for name in ("outage", "bug"):
                try:
                    await unary(name.encode(), timeout=10)
                except grpc.aio.AioRpcError as exc:
                    out[name] = (exc.code(), exc.details() or "")
            got = []
            try:
                async for msg in ch.unary_stream("/t.T/S")(b"", timeout=10):
                    got.append(msg)
            except grpc.aio.AioRpcError as exc:
                out["stream"] = (exc.code(), exc.details() or "")
            out["stream_messages"] = (grpc.StatusCode.OK, ",".join(m.decode() for m in got))
    finally:
        await server.stop(0)
    return out


def test_mapped_exceptions_get_their_status_and_others_stay_unknown():
    out = asyncio.run(_call_all())
    assert out["outage"][0] == grpc.StatusCode.UNAVAILABLE and "Redis unavailable" in out["outage"][1]
    assert out["bug"][0] == grpc.StatusCode.UNKNOWN
    assert out["stream"][0] == grpc.StatusCode.UNAVAILABLE
    assert out["stream_messages"][1] == "first"  # what was streamed before the outage arrived
