"""The gateway's wait for a restarted router, over real gRPC sockets: once ``reconnect_router``
returns, a call on the gateway's router channel goes through at its first try. (A server with the
health service stands in for the router: the check and the channel are what is under test.)

Before: the gateway asked a fresh health channel while its own router channel shared the lost
connection, still in its reconnect backoff, so each resumed request failed at once with "failed to
connect" and spent its resumes in a few milliseconds."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.platform.settings import load_settings
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


def test_a_lost_router_is_reported_as_the_gateways_answer_not_a_broken_connection(tiny_zoo, redis_url, redis_prefix):
    """A request whose router cannot be reached fails with UNAVAILABLE quoting gRPC's "failed to
    connect" between the gateway and the router. The SDK must not take that for its own connection
    to the gateway breaking (it would send the request again): the gateway marks its own answers."""
    from cosine.v1 import gateway_pb2, gateway_pb2_grpc
    from cosine_cli.redis_server import free_port
    from cosine_client import Client, Unavailable
    from cosine_client.errors import is_transport_failure
    from services.gateway.server import build_app
    from tests.support.testing import start_service

    port = free_port()  # a router address nothing listens on
    settings = load_settings(
        GatewaySettings,
        [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--http-port",
            "0",
            "--redis-url",
            redis_url,
            "--redis-prefix",
            redis_prefix,
            "--tokenizer",
            str(tiny_zoo.target.path),
            "--router-address",
            f"127.0.0.1:{port}",
            "--router-resumes",
            "0",
        ],
        {},
    )
    server, gateway_port = start_service(settings, build_app, prog="gateway")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gateway_port}") as channel:
            with pytest.raises(grpc.RpcError) as raw:
                gateway_pb2_grpc.GatewayStub(channel).Generate(
                    gateway_pb2.GenerateRequest(prompt="hello", max_new_tokens=2), timeout=20
                )
        assert raw.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (
            "failed to connect" in raw.value.details() and f"router at 127.0.0.1:{port} was lost" in raw.value.details()
        )
        assert not is_transport_failure(raw.value, first_attempt=False)
        with Client(f"127.0.0.1:{gateway_port}", timeout=20) as client:
            with pytest.raises(Unavailable, match="was lost"):
                client.generate("hello", max_new_tokens=2)
    finally:
        server.stop()
