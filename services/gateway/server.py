"""Gateway service: the public API; validates, tokenizes, records request state, relays to the router."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from common.grpc_server import ServerHandle
from common.store import Store
from cosine.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.settings import GatewaySettings

SERVICE_NAME = "cosine.v1.Gateway"


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, settings: GatewaySettings):
        self.settings = settings

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.GenerateResponse:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no router is connected to this gateway")

    async def GenerateStream(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no router is connected to this gateway")
        yield  # pragma: no cover


class GatewayApp:
    role = "gateway"
    service_names = (SERVICE_NAME,)

    def __init__(self, settings: GatewaySettings, store: Store):
        self.settings = settings
        self.store = store
        self.servicer = GatewayServicer(settings)

    def register(self, server: grpc.aio.Server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(self.servicer, server)

    async def start(self, handle: ServerHandle, address: str) -> None:
        pass

    async def stop(self) -> None:
        pass

    def member_info(self) -> dict[str, Any]:
        return {}


async def build_app(settings: GatewaySettings, store: Store) -> GatewayApp:
    return GatewayApp(settings, store)


def main(argv: Sequence[str] | None = None) -> None:
    from common.service import run_service

    run_service(GatewaySettings, build_app, prog="services.gateway", argv=argv,
                description="CoSine gateway: the public generation API of a CoSine cluster.")
