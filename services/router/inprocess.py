"""In-process drafter pool and verifier for the router core: the real engines, called directly.

Used by tests (lossless checks of routing + fusion + pipelining without sockets) and by the
benchmark's single-process baselines. Engines are called on the event loop's thread, one call at
a time, as the services do in their worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from common.runtime.drafter_engine import DrafterEngine
from common.runtime.verifier_engine import VerifierEngine
from common.spec.token_fusion import FusionOutcome, FusionRequest, StepPricing
from common.spec.types import DraftItem, DraftResult, Verdict, VerifyItem
from services.drafter.server import run_chain_step, run_fused_round
from services.router.requests import Request


class LocalDrafterPool:
    """``fuse_locally``: every request's token fusion runs here in one call per round, as in a drafter
    process that hosts all of its drafters (off: the router drives it, one :meth:`draft_many` per step)."""

    def __init__(
        self,
        engines: Mapping[str, DrafterEngine],
        fail_after: Mapping[str, int] | None = None,
        fuse_locally: bool = False,
    ):
        self.engines = dict(engines)
        self.fuse_locally = fuse_locally
        self.fused_rounds = 0
        self.failed: dict[str, str] = {}
        self.calls: dict[str, int] = {d: 0 for d in engines}
        self.fail_after = dict(fail_after or {})  # drafter -> calls after which it "crashes" (tests)

    def live(self) -> list[str]:
        return sorted(d for d in self.engines if d not in self.failed)

    def domains(self, drafter_id: str) -> list[str]:
        return list(self.engines[drafter_id].domains) or [drafter_id]

    async def draft(self, drafter_id: str, items: Sequence[DraftItem]) -> list[DraftResult]:
        self.calls[drafter_id] += 1
        if drafter_id in self.fail_after and self.calls[drafter_id] > self.fail_after[drafter_id]:
            raise ConnectionError(f"drafter {drafter_id} is gone")
        results, _ = run_chain_step(self.engines[drafter_id], items)
        return results

    async def draft_many(self, calls: Mapping[str, Sequence[DraftItem]]) -> dict[str, list[DraftResult] | None]:
        await asyncio.sleep(0)  # a real pool yields to the event loop while the drafters work
        out: dict[str, list[DraftResult] | None] = {}
        for d, items in calls.items():
            try:
                out[d] = await self.draft(d, items)
            except Exception as exc:
                self.mark_failed(d, str(exc))
                out[d] = None
        return out

    def fusion_host(self, request_id: str, drafters: Sequence[str]) -> str | None:
        if self.fuse_locally and all(d in self.engines and d not in self.failed for d in drafters):
            return "local"
        return None

    async def fuse(
        self, host: str, width: int, pricing: StepPricing, requests: Sequence[FusionRequest]
    ) -> tuple[dict[str, FusionOutcome], list[float]] | None:
        await asyncio.sleep(0)
        self.fused_rounds += 1
        return run_fused_round(self.engines, width, pricing, requests)

    def release(self, drafter_id: str, request_ids: Sequence[str]) -> None:
        if drafter_id in self.failed:
            return
        for rid in request_ids:
            self.engines[drafter_id].release(rid)

    def mark_failed(self, drafter_id: str, reason: str) -> None:
        self.failed[drafter_id] = reason


class LocalVerifier:
    """The verifier engine called in process. ``round_trip_s``: each call first waits that long,
    none of it busy time, as across a network (``benchmarks.inprocess --round-trip-ms``)."""

    def __init__(self, engine: VerifierEngine, round_trip_s: float = 0.0):
        self.engine = engine
        self.round_trip_s = round_trip_s
        self.batches: list[int] = []

    async def verify(self, items: Sequence[VerifyItem]) -> tuple[list[Verdict], int]:
        if self.round_trip_s > 0:
            await asyncio.sleep(self.round_trip_s)
        outcome = self.engine.verify(items)
        self.batches.append(len(items))
        return list(outcome.verdicts), outcome.timings.total_ns

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.engine.release(rid)

    @property
    def pass_times(self) -> tuple[tuple[int, float], ...]:
        return self.engine.pass_times


async def output_of(request: Request) -> list[int]:
    """Every token streamed to a submitted request (``RouterCore.submit``) until it finishes;
    ``RuntimeError`` naming the request when it ends in an error."""
    tokens: list[int] = []
    while True:
        ev = await request.events.get()
        if ev.error:
            raise RuntimeError(f"{request.request_id}: {ev.error}")
        tokens += ev.tokens
        if ev.finished:
            return tokens
