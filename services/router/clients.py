"""gRPC clients of the router: the drafter pool (membership-driven) and the verifier.

Protobuf stops here: the pool and the verifier client speak :mod:`common.spec.types` to the
router core. Each drafter process and the verifier are reached over one long-lived bidirectional
stream (:class:`services.router.streams.StreamClient`), on a channel opened by :func:`common.platform.tls.open_channel`
(TLS or mTLS when the router's settings say so).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from common.logs import get_logger
from common.platform.grpc_server import CHANNEL_OPTIONS
from common.platform.store import Store
from common.platform.tls import TlsConfig, open_channel
from common.spec.token_fusion import FusionOutcome, FusionRequest, StepPricing
from common.spec.types import DraftItem, DraftResult, Verdict, VerifyItem
from cosine.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from services.convert import (
    draft_group_results_from_pb,
    draft_groups_to_pb,
    draft_step_to_pb,
    fuse_round_to_pb,
    fusion_outcomes_from_pb,
    verdict_from_pb,
    verify_batch_to_pb,
)
from services.router.replicas import pick_replica
from services.router.streams import StreamClient

log = get_logger("router.clients")


@dataclass
class DrafterEndpoint:
    address: str
    member_id: str
    channel: grpc.aio.Channel
    stream: StreamClient
    drafters: dict[str, list[str]] = field(default_factory=dict)  # drafter id -> domains
    failed: str = ""
    failed_at: float = 0.0  # monotonic time of the failure mark (marks expire: see retry_failed_s)


class GrpcDrafterPool:
    """Live drafters, discovered through Redis membership and checked against the target's
    tokenizer fingerprint. A drafter id may be hosted by several processes (replicas); each request
    is served by one replica chosen by :func:`pick_replica`, so replicas share the load. A process
    whose stream breaks is marked failed; the mark expires after ``retry_failed_s`` (or when its
    process is seen again under a new membership entry) and the process is reconnected.

    A process that leaves the membership (a draining replica deregisters at once) gets no new
    draft step from that moment; its stream is closed once the steps already sent are answered,
    so a drain loses no answer. Its requests move to the remaining replicas by rendezvous
    hashing and are re-synced there from the committed sequence."""

    def __init__(
        self,
        store: Store,
        fingerprint: str,
        interval_s: float = 1.0,
        allow: Sequence[str] = (),
        retry_failed_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        tls: TlsConfig | None = None,
    ):
        self.store = store
        self.tls = tls
        self.allow = frozenset(allow)  # empty: every drafter the membership lists
        self.fingerprint = fingerprint
        self.interval_s = interval_s
        self.retry_failed_s = retry_failed_s
        self.clock = clock
        self.endpoints: dict[str, DrafterEndpoint] = {}  # address -> endpoint
        self.refused: dict[str, str] = {}  # address -> reason
        self._step = 0
        self._closing: set[asyncio.Task[None]] = set()  # streams of departed processes, closed once answered
        self.calls = 0  # draft steps answered
        self.fused_rounds = 0  # rounds of token fusion a drafter process ran on its own (one message each)
        self.busy_ns = 0  # drafter model time of those steps (from the drafters' own timings)
        self._task: asyncio.Task[None] | None = None

    def replicas(self, drafter_id: str, healthy: bool = True) -> list[DrafterEndpoint]:
        return [
            ep for _, ep in sorted(self.endpoints.items()) if drafter_id in ep.drafters and not (healthy and ep.failed)
        ]

    @property
    def by_drafter(self) -> dict[str, DrafterEndpoint]:
        """One endpoint per drafter id (a healthy one when there is one), for status reports."""
        out: dict[str, DrafterEndpoint] = {}
        for _, ep in sorted(self.endpoints.items()):
            for d in ep.drafters:
                if d not in out or (out[d].failed and not ep.failed):
                    out[d] = ep
        return out

    def live(self) -> list[str]:
        return sorted({d for ep in self.endpoints.values() if not ep.failed for d in ep.drafters})

    def domains(self, drafter_id: str) -> list[str]:
        eps = self.replicas(drafter_id, healthy=False)
        return list(eps[0].drafters.get(drafter_id, [])) if eps else []

    async def draft_many(self, calls: Mapping[str, Sequence[DraftItem]]) -> dict[str, list[DraftResult] | None]:
        """One draft step for several drafters: one message per drafter process, all processes
        concurrently, each request's items to its replica. A drafter with no healthy replica (it
        left between the round's start and this step) answers None; a process that fails is marked
        and the requests it served get no answer (the router drops that drafter for them)."""
        by_endpoint: dict[str, dict[str, list[DraftItem]]] = {}
        out: dict[str, list[DraftResult] | None] = {}
        for d, items in calls.items():
            addresses = [ep.address for ep in self.replicas(d)]
            if not addresses:
                out[d] = None
                continue
            out[d] = []
            for item in items:
                address = pick_replica(item.request_id, addresses)
                by_endpoint.setdefault(address, {}).setdefault(d, []).append(item)

        async def one(address: str, groups: dict[str, list[DraftItem]]) -> dict[str, list[DraftResult] | None]:
            ep = self.endpoints.get(address)
            if ep is None:
                return {d: None for d in groups}
            self._step += 1
            try:
                reply = await ep.stream.call(draft_groups_to_pb(self._step, groups), timeout_s=60)
            except Exception as exc:
                self._mark_endpoint(ep, str(exc))
                return {d: None for d in groups}
            self.calls += 1
            self.busy_ns += max(0, reply.timings.total_ns - reply.timings.queue_ns)
            answers = draft_group_results_from_pb(reply)
            return {d: answers.get(d) for d in groups}

        failed: set[str] = set()
        for part in await asyncio.gather(*(one(a, g) for a, g in by_endpoint.items())):
            for d, results in part.items():
                if results is None:
                    failed.add(d)
                elif out.get(d) is not None:
                    out[d].extend(results)
        for d in failed:  # answered by no replica at all: None; else the missing ids stay missing
            if not out.get(d):
                out[d] = None
        return out

    def fusion_host(self, request_id: str, drafters: Sequence[str]) -> str | None:
        """The drafter process that serves every one of ``drafters`` for this request (the replica
        :func:`pick_replica` picks for each), or None when they are served by different processes."""
        hosts = set()
        for d in drafters:
            address = pick_replica(request_id, [ep.address for ep in self.replicas(d)])
            if address is None:
                return None
            hosts.add(address)
        return hosts.pop() if len(hosts) == 1 else None

    async def fuse(
        self, host: str, width: int, pricing: StepPricing, requests: Sequence[FusionRequest]
    ) -> tuple[dict[str, FusionOutcome], list[float]] | None:
        """A round of token fusion inside the process at ``host`` (one message); None when it failed
        (the process is marked, as for a failed draft step)."""
        ep = self.endpoints.get(host)
        if ep is None or ep.failed:
            return None
        self._step += 1
        try:
            reply = await ep.stream.call(fuse_round_to_pb(self._step, width, pricing, requests), timeout_s=60)
        except Exception as exc:
            self._mark_endpoint(ep, str(exc))
            return None
        self.calls += 1
        self.fused_rounds += 1
        self.busy_ns += max(0, reply.timings.total_ns - reply.timings.queue_ns)
        return fusion_outcomes_from_pb(reply.fused)

    def release(self, drafter_id: str, request_ids: Sequence[str]) -> None:
        """Free the requests' caches on every healthy replica (a replica that does not hold one
        ignores it), so a request that moved between replicas leaves nothing behind."""
        for ep in self.replicas(drafter_id):
            self._step += 1
            ep.stream.send_nowait(
                draft_step_to_pb(self._step, drafter_id, [DraftItem(request_id=r, release=True) for r in request_ids])
            )

    def mark_failed(self, drafter_id: str, reason: str) -> None:
        for ep in self.replicas(drafter_id):
            self._mark_endpoint(ep, reason)

    def _mark_endpoint(self, ep: DrafterEndpoint, reason: str) -> None:
        if not ep.failed:
            ep.failed, ep.failed_at = reason or "failed", self.clock()
            log.warning(
                "drafter process left the pool",
                drafters=sorted(ep.drafters),
                address=ep.address,
                reason=reason,
                retry_in_s=self.retry_failed_s,
            )

    async def refresh(self) -> None:
        members = await self.store.members("drafter")
        seen = set()
        for m in members:
            seen.add(m.address)
            ep = self.endpoints.get(m.address)
            if (
                ep is not None
                and ep.failed
                and (ep.member_id != m.member_id or self.clock() - ep.failed_at >= self.retry_failed_s)
            ):
                await self._drop(m.address)  # restarted at the same address, or its failure mark expired: reconnect
                ep = None
            if ep is None and m.address not in self.refused:
                await self._connect(m.address, m.member_id)
        for address in list(self.endpoints):
            if address not in seen:  # left the membership (drain or crash): no new steps from now on
                ep = self.endpoints.pop(address)
                task = asyncio.create_task(self._close_when_answered(ep), name=f"drafter-close-{address}")
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    async def _close_when_answered(self, ep: DrafterEndpoint, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while ep.stream.pending and not ep.stream.broken and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await ep.stream.close()
        await ep.channel.close()
        log.info("drafters left", address=ep.address, drafters=sorted(ep.drafters))

    async def _connect(self, address: str, member_id: str) -> None:
        channel = open_channel(address, self.tls, CHANNEL_OPTIONS)
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
                reason = (
                    f"drafter {model.model_id} at {address} has tokenizer {model.tokenizer_fingerprint}, "
                    f"the target has {self.fingerprint}: refused (token ids would not match)"
                )
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
        log.info("drafters joined", address=address, drafters=sorted(drafters))

    async def _drop(self, address: str) -> None:
        ep = self.endpoints.pop(address, None)
        if ep is None:
            return
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
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


class GrpcVerifier:
    def __init__(self, address: str, tls: TlsConfig | None = None):
        self.address = address
        self.channel = open_channel(address, tls, CHANNEL_OPTIONS)
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

    @property
    def pass_times(self) -> tuple[tuple[int, float], ...]:
        """The verifier's pass seconds by rows, timed when it loaded the target (empty if it did not)."""
        if self.info is None:
            return ()
        return tuple(zip(self.info.pass_rows, self.info.pass_seconds))

    async def verify(self, items: Sequence[VerifyItem]) -> tuple[list[Verdict], int]:
        if self.stream.broken:
            self.stream.reset()  # one reconnect attempt per batch
        self._batch += 1
        reply = await self.stream.call(verify_batch_to_pb(self._batch, items), timeout_s=300)
        return [verdict_from_pb(v) for v in reply.verdicts], int(reply.timings.total_ns)

    def release(self, request_ids: Sequence[str]) -> None:
        self._batch += 1
        self.stream.send_nowait(
            verify_batch_to_pb(self._batch, [VerifyItem(request_id=r, release=True) for r in request_ids])
        )

    async def close(self) -> None:
        await self.stream.close()
        await self.channel.close()


__all__ = ["GrpcDrafterPool", "GrpcVerifier", "drafter_pb2", "verifier_pb2"]
