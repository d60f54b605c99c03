"""Drafter service: a thin gRPC servicer over the drafter engines hosted by this process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from common.grpc_server import ServerHandle
from common.store import Store
from cosine.v1 import common_pb2, drafter_pb2_grpc
from services.drafter.settings import DrafterSettings

SERVICE_NAME = "cosine.v1.Drafter"
VERSION = "0.1.0"


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, models: dict[str, Any]):
        self.models = models

    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.InfoResponse:
        return common_pb2.InfoResponse(service="drafter", version=VERSION)

    async def Draft(self, request_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this drafter hosts no model (start it with --drafters NAME=PATH)")
        yield  # pragma: no cover


class DrafterApp:
    role = "drafter"
    service_names = (SERVICE_NAME,)

    def __init__(self, settings: DrafterSettings, store: Store):
        self.settings = settings
        self.store = store
        self.servicer = DrafterServicer({})

    def register(self, server: grpc.aio.Server) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(self.servicer, server)

    async def start(self, handle: ServerHandle, address: str) -> None:
        pass

    async def stop(self) -> None:
        pass

    def member_info(self) -> dict[str, Any]:
        return {"drafters": sorted(self.servicer.models)}


async def build_app(settings: DrafterSettings, store: Store) -> DrafterApp:
    return DrafterApp(settings, store)


def main(argv: Sequence[str] | None = None) -> None:
    from common.service import run_service

    run_service(DrafterSettings, build_app, prog="services.drafter", argv=argv,
                description="CoSine drafter: hosts small causal LMs and proposes next-token candidates to the router.")
