"""The gateway's wait for a restarted router, over real gRPC sockets: once ``reconnect_router``
returns, a call on the gateway's router channel goes through at its first try. (A server with the
health service stands in for the router: the check and the channel are what is under test.)

Before: the gateway asked a fresh health channel while its own router channel shared the lost
connection, still in its reconnect backoff, so each resumed request failed at once with "failed to
connect" and spent its resumes in a few milliseconds."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.settings import load_settings
from services.gateway.requests import Limits
from services.gateway.server import GatewayApp
from services.gateway.settings import GatewaySettings


async def serve(port: int) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def ask(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_after_reconnect_the_router_channel_answers_at_its_first_call():
    async def body() -> list[grpc.StatusCode]:
        server, port = await serve(0)
        settings = load_settings(GatewaySettings, ["--router-address", f"127.0.0.1:{port}"], {})
        app = GatewayApp(settings, store=None)  # type: ignore[arg-type]  # no Redis needed: the address is given
        app.limits = Limits(16, 64, 64, 2, 100, 128)  # no verifier needed for the tokenizer either
        await app.ensure_ready()
        assert app.router_channel is not None
        seen = [await ask(app.router_channel)]
        await server.stop(None)  # the router dies
        seen.append(await ask(app.router_channel))  # its channel now waits out a reconnect backoff
        lost = app.router_stub
        server, _ = await serve(port)  # restarted at the same address
        try:
            loop = asyncio.get_running_loop()
            await app.reconnect_router(loop.time() + 10, lost=lost)
            seen.append(await ask(app.router_channel))
            return seen
        finally:
            await server.stop(None)
            await app.router_channel.close()

    assert asyncio.run(body()) == [grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK]
