"""Requests that do not parse: INVALID_ARGUMENT naming the field (not grpc's UNKNOWN), over real
gRPC for a unary call and a bidirectional stream, and the field located by walking the bytes."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.platform.grpc_server import create_server
from common.platform.malformed import locate_decode_error
from cosine.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc


def bad_utf8(msg, placeholder: bytes) -> bytes:
    data = msg.SerializeToString()
    assert placeholder in data
    return data.replace(placeholder, b"\xff" * len(placeholder))


@pytest.mark.parametrize(
    "cls,data,path",
    [
        (gateway_pb2.GenerateRequest, bad_utf8(gateway_pb2.GenerateRequest(prompt="zz"), b"zz"), "prompt"),
        (gateway_pb2.GenerateRequest, b"\x18\xff", "max_new_tokens"),
        (gateway_pb2.GenerateRequest, bad_utf8(gateway_pb2.GenerateRequest(stop=["a", "zz"]), b"zz"), "stop"),
        (
            verifier_pb2.VerifyBatch,
            bad_utf8(
                verifier_pb2.VerifyBatch(
                    items=[
                        verifier_pb2.VerifyItem(request_id="a"),
                        verifier_pb2.VerifyItem(request_id="b", tree={"drafter_ids": ["zz"]}),
                    ]
                ),
                b"zz",
            ),
            "items[1].tree.drafter_ids",
        ),
        (verifier_pb2.VerifyBatch, b"\x12\x05\x0a", "items[0]"),
    ],
)
def test_the_field_at_fault_is_located(cls, data, path):
    with pytest.raises(Exception):
        cls.FromString(data)
    assert locate_decode_error(cls.DESCRIPTOR, data)[0] == path


class Echo(gateway_pb2_grpc.GatewayServicer, verifier_pb2_grpc.VerifierServicer):
    def __init__(self) -> None:
        self.closed = 0

    async def Generate(self, request, context):
        return gateway_pb2.GenerateResponse(request_id=request.request_id)

    async def Verify(self, request_iterator, context):
        try:
            async for batch in request_iterator:
                yield verifier_pb2.VerifyResult(batch_id=batch.batch_id)
        finally:
            self.closed += 1


def test_malformed_requests_get_invalid_argument_naming_the_field():
    servicer = Echo()

    async def body():
        def register(server):
            gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
            verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)

        handle = await create_server("127.0.0.1:0", register, ["cosine.v1.Gateway", "cosine.v1.Verifier"])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
                generate = channel.unary_unary("/cosine.v1.Gateway/Generate")
                ok = gateway_pb2.GenerateResponse.FromString(
                    await generate(gateway_pb2.GenerateRequest(request_id="r1").SerializeToString(), timeout=10)
                )
                assert ok.request_id == "r1"
                with pytest.raises(grpc.aio.AioRpcError) as unary:
                    await generate(bad_utf8(gateway_pb2.GenerateRequest(request_id="zz"), b"zz"), timeout=10)

                verify = channel.stream_stream("/cosine.v1.Verifier/Verify")
                good = verifier_pb2.VerifyBatch(batch_id=7).SerializeToString()
                bad = bad_utf8(
                    verifier_pb2.VerifyBatch(batch_id=8, items=[verifier_pb2.VerifyItem(request_id="zz")]), b"zz"
                )
                call = verify(iter([good, bad, good]), timeout=10)
                replies = []
                with pytest.raises(grpc.aio.AioRpcError) as stream:
                    async for reply in call:
                        replies.append(verifier_pb2.VerifyResult.FromString(reply).batch_id)
            return unary.value, stream.value, replies
        finally:
            await handle.stop(0)

    unary, stream, replies = asyncio.run(body())
    assert unary.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert unary.details().startswith("request_id: not valid UTF-8"), unary.details()
    assert stream.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stream.details().startswith("items[0].request_id: not valid UTF-8"), stream.details()
    assert replies == [7]  # the stream ran up to the bad message, and the servicer's clean-up ran
    assert servicer.closed == 1
