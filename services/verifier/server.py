"""Verifier service: a thin gRPC servicer over the verifier engine (the target model)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from common.grpc_server import ServerHandle
from common.store import Store
from cosine.v1 import common_pb2, verifier_pb2_grpc
from services.verifier.settings import VerifierSettings

SERVICE_NAME = "cosine.v1.Verifier"
VERSION = "0.1.0"


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: Any):
        self.engine = engine

    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.InfoResponse:
        return common_pb2.InfoResponse(service="verifier", version=VERSION)

    async def Verify(self, request_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this verifier hosts no target model (start it with --target PATH)")
        yield  # pragma: no cover


class VerifierApp:
    role = "verifier"
    service_names = (SERVICE_NAME,)

    def __init__(self, settings: VerifierSettings, store: Store):
        self.settings = settings
        self.store = store
        self.servicer = VerifierServicer(None)

    def register(self, server: grpc.aio.Server) -> None:
        verifier_pb2_grpc.add_VerifierServicer_to_server(self.servicer, server)

    async def start(self, handle: ServerHandle, address: str) -> None:
        pass

    async def stop(self) -> None:
        pass

    def member_info(self) -> dict[str, Any]:
        return {"target": self.settings.target}


async def build_app(settings: VerifierSettings, store: Store) -> VerifierApp:
    return VerifierApp(settings, store)


def main(argv: Sequence[str] | None = None) -> None:
    from common.service import run_service

    run_service(VerifierSettings, build_app, prog="services.verifier", argv=argv,
                description="CoSine verifier: hosts the target model and verifies batches of token trees losslessly.")
