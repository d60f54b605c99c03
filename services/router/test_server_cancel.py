"""A Submit stream closed by the client while suspended at a yield (GeneratorExit, not
CancelledError) still cancels its request: nothing generates on, every cache is freed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from common.runtime.verifier_engine import VerifierEngine
from cosine.v1 import common_pb2, router_pb2
from services.router.core import RouterCore
from services.router.inprocess import LocalDrafterPool, LocalVerifier
from services.router.server import RouterServicer
from services.router.settings import RouterSettings


class FakeContext:
    async def abort(self, code, details):  # pragma: no cover - a failure path of the test
        raise AssertionError(f"aborted: {code} {details}")


def test_closing_the_stream_at_a_yield_cancels_the_request(llama_target):
    verifier = VerifierEngine.from_checkpoint(llama_target, attention_backend="sdpa")

    async def body() -> None:
        core = RouterCore(RouterSettings(), LocalDrafterPool({}), LocalVerifier(verifier))
        core.start()
        try:
            servicer = RouterServicer(SimpleNamespace(core=core, verifier_ready=True))
            request = router_pb2.SubmitRequest(
                request_id="r1", prompt_ids=[1, 2, 3], max_new_tokens=500, sampling=common_pb2.SamplingParams()
            )
            stream = servicer.Submit(request, FakeContext())
            first = await stream.__anext__()  # the generator is now suspended at a yield
            assert first.token_ids and not first.finished
            req = core.requests["r1"]
            await stream.aclose()  # what grpc does when the client cancels: GeneratorExit at the yield
            for _ in range(50):
                if "r1" not in core.requests:
                    break
                await asyncio.sleep(0.05)
            assert req.cancelled and req.done and "r1" not in core.requests
            assert verifier.active_requests == 0
        finally:
            await core.stop()

    asyncio.run(body())
