"""Router service: a thin gRPC servicer over the control plane (request pool, routing, fusion, rounds)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from common.grpc_server import ServerHandle
from common.store import Store
from cosine.v1 import router_pb2, router_pb2_grpc
from services.router.settings import RouterSettings

SERVICE_NAME = "cosine.v1.Router"


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, settings: RouterSettings):
        self.settings = settings

    async def Submit(self, request: router_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no verifier is connected to this router")
        yield  # pragma: no cover

    async def Status(self, request: router_pb2.StatusRequest, context: grpc.aio.ServicerContext) -> router_pb2.RouterStatus:
        return router_pb2.RouterStatus()


class RouterApp:
    role = "router"
    service_names = (SERVICE_NAME,)

    def __init__(self, settings: RouterSettings, store: Store):
        self.settings = settings
        self.store = store
        self.servicer = RouterServicer(settings)

    def register(self, server: grpc.aio.Server) -> None:
        router_pb2_grpc.add_RouterServicer_to_server(self.servicer, server)

    async def start(self, handle: ServerHandle, address: str) -> None:
        pass

    async def stop(self) -> None:
        pass

    def member_info(self) -> dict[str, Any]:
        return {}


async def build_app(settings: RouterSettings, store: Store) -> RouterApp:
    return RouterApp(settings, store)


def main(argv: Sequence[str] | None = None) -> None:
    from common.service import run_service

    run_service(RouterSettings, build_app, prog="services.router", argv=argv,
                description="CoSine router: schedules requests into pipelined rounds, routes them to drafters by "
                "expertise, fuses proposals into token trees and sends them to the verifier.")
