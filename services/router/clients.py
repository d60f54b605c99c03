"""gRPC clients of the router: the drafter pool (membership-driven) and the verifier.

Protobuf stops here: the pool and the verifier client speak :mod:`common.spec_types` to the
router core. Each drafter process and the verifier are reached over one long-lived bidirectional
stream (:class:`common.streams.StreamClient`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.grpc_server import CHANNEL_OPTIONS
from common.logs import get_logger
from common.spec_types import DraftItem, DraftResult, Verdict, VerifyItem
from common.store import Store
from common.streams import StreamClient
from cosine.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from services.convert import (
    draft_group_results_from_pb,
    draft_groups_to_pb,
    draft_step_to_pb,
    verdict_from_pb,
    verify_batch_to_pb,
)

log = get_logger("router.clients")


@dataclass
class DrafterEndpoint:
    address: str
    member_id: str
    channel: grpc.aio.Channel
    stream: StreamClient
    drafters: dict[str, list[str]] = field(default_factory=dict)  # drafter id -> domains
    failed: str = ""
    failed_at: float = 0.0  # monotonic time of the failure mark


class GrpcDrafterPool:
    """Live drafters, discovered through Redis membership and checked against the target's
    tokenizer fingerprint. A drafter whose stream breaks leaves the pool until its process is seen
    again (new membership entry) or until ``retry_after_s`` has passed while its membership is
    still alive (then it is reconnected: a failure mark expires)."""

    def __init__(self, store: Store, fingerprint: str, interval_s: float = 1.0, allow: Sequence[str] = (),
                 retry_after_s: float = 10.0, clock: Any = time.monotonic):
        self.store = store
        self.allow = frozenset(allow)  # empty: every drafter the membership lists
        self.fingerprint = fingerprint
        self.interval_s = interval_s
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.endpoints: dict[str, DrafterEndpoint] = {}  # address -> endpoint
        self.by_drafter: dict[str, DrafterEndpoint] = {}
        self.refused: dict[str, str] = {}  # address -> reason
        self._step = 0
        self.calls = 0  # draft steps answered
        self.busy_ns = 0  # drafter model time of those steps (from the drafters' own timings)
        self._task: asyncio.Task[None] | None = None

    def live(self) -> list[str]:
        return sorted(d for d, ep in self.by_drafter.items() if not ep.failed)

    def domains(self, drafter_id: str) -> list[str]:
        ep = self.by_drafter.get(drafter_id)
        return list(ep.drafters.get(drafter_id, [])) if ep else []

    async def draft_many(self, calls: Mapping[str, Sequence[DraftItem]]) -> dict[str, list[DraftResult] | None]:
        """One draft step for several drafters: one message per drafter process, all processes
        concurrently. A process that fails leaves the pool; its drafters answer None."""
        by_endpoint: dict[str, dict[str, Sequence[DraftItem]]] = {}
        out: dict[str, list[DraftResult] | None] = {}
        for d, items in calls.items():
            ep = self.by_drafter.get(d)
            if ep is None or ep.failed:  # left (scale-down, failure) since the round picked it
                out[d] = None
                continue
            by_endpoint.setdefault(ep.address, {})[d] = items

        async def one(address: str, groups: dict[str, Sequence[DraftItem]]) -> dict[str, list[DraftResult] | None]:
            ep = self.endpoints[address]
            self._step += 1
            try:
                reply = await ep.stream.call(draft_groups_to_pb(self._step, groups), timeout_s=60)
            except Exception as exc:
                for d in groups:
                    self.mark_failed(d, str(exc))
                return {d: None for d in groups}
            self.calls += 1
            self.busy_ns += max(0, reply.timings.total_ns - reply.timings.queue_ns)
            answers = draft_group_results_from_pb(reply)
            return {d: answers.get(d) for d in groups}

        for part in await asyncio.gather(*(one(a, g) for a, g in by_endpoint.items())):
            out.update(part)
        return out

    def release(self, drafter_id: str, request_ids: Sequence[str]) -> None:
        ep = self.by_drafter.get(drafter_id)
        if ep is None or ep.failed:
            return
        self._step += 1
        ep.stream.send_nowait(draft_step_to_pb(self._step, drafter_id, [DraftItem(request_id=r, release=True) for r in request_ids]))

    def mark_failed(self, drafter_id: str, reason: str) -> None:
        ep = self.by_drafter.get(drafter_id)
        if ep is not None and not ep.failed:
            ep.failed, ep.failed_at = reason, self.clock()
            log.warning("drafter left the pool", drafter=drafter_id, address=ep.address, reason=reason,
                        retry_after_s=self.retry_after_s)

    async def refresh(self) -> None:
        members = await self.store.members("drafter")
        seen = set()
        for m in members:
            seen.add(m.address)
            ep = self.endpoints.get(m.address)
            if ep is not None and ep.failed and (ep.member_id != m.member_id
                                                 or self.clock() - ep.failed_at >= self.retry_after_s):
                # restarted at the same address, or still listed alive after its mark expired: try again
                await self._drop(m.address)
                ep = None
            if ep is None and m.address not in self.refused:
                await self._connect(m.address, m.member_id)
        for address in list(self.endpoints):
            if address not in seen:
                await self._drop(address)

    async def _connect(self, address: str, member_id: str) -> None:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub = drafter_pb2_grpc.DrafterStub(channel)
        try:
            info = await stub.Info(common_pb2.InfoRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            await channel.close()
            log.warning("drafter not reachable yet", address=address, error=exc.details())
            return
        drafters: dict[str, list[str]] = {}
        hosted = [m for m in info.models if not self.allow or m.model_id in self.allow]
        if info.models and not hosted:
            self.refused[address] = f"hosts none of the drafters this router uses ({', '.join(sorted(self.allow))})"
            await channel.close()
            return
        for model in hosted:
            if self.fingerprint and model.tokenizer_fingerprint != self.fingerprint:
                reason = (f"drafter {model.model_id} at {address} has tokenizer {model.tokenizer_fingerprint}, "
                          f"the target has {self.fingerprint}: refused (token ids would not match)")
                log.error("drafter refused", drafter=model.model_id, address=address, reason=reason)
                self.refused[address] = reason
                continue
            drafters[model.model_id] = list(model.domains)
        if not drafters:
            await channel.close()
            return
        stream = StreamClient(lambda it, s=stub: s.Draft(it), name=f"drafter@{address}")
        ep = DrafterEndpoint(address, member_id, channel, stream, drafters)
        self.endpoints[address] = ep
        for d in drafters:
            self.by_drafter[d] = ep
        log.info("drafters joined", address=address, drafters=sorted(drafters))

    async def _drop(self, address: str) -> None:
        ep = self.endpoints.pop(address, None)
        if ep is None:
            return
        for d in list(self.by_drafter):
            if self.by_drafter[d] is ep:
                del self.by_drafter[d]
        await ep.stream.close()
        await ep.channel.close()
        log.info("drafters left", address=address, drafters=sorted(ep.drafters))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="drafter-discovery")

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:
                log.warning("drafter discovery failed", error=str(exc))
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for address in list(self.endpoints):
            await self._drop(address)


class GrpcVerifier:
    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
        self.stream = StreamClient(lambda it: self.stub.Verify(it), name=f"verifier@{address}")
        self.info: common_pb2.ModelInfo | None = None
        self._batch = 0

    async def fetch_info(self, timeout_s: float = 5.0) -> common_pb2.ModelInfo:
        reply = await self.stub.Info(common_pb2.InfoRequest(), timeout=timeout_s)
        if not reply.models:
            raise RuntimeError(f"the verifier at {self.address} hosts no target model")
        self.info = reply.models[0]
        return self.info

    async def verify(self, items: Sequence[VerifyItem]) -> tuple[list[Verdict], int]:
        if self.stream.broken:
            self.stream.reset()  # one reconnect attempt per batch
        self._batch += 1
        reply = await self.stream.call(verify_batch_to_pb(self._batch, items), timeout_s=300)
        return [verdict_from_pb(v) for v in reply.verdicts], int(reply.timings.total_ns)

    def release(self, request_ids: Sequence[str]) -> None:
        self._batch += 1
        self.stream.send_nowait(verify_batch_to_pb(self._batch, [VerifyItem(request_id=r, release=True) for r in request_ids]))

    async def close(self) -> None:
        await self.stream.close()
        await self.channel.close()


__all__ = ["GrpcDrafterPool", "GrpcVerifier", "drafter_pb2", "verifier_pb2"]
