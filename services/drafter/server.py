"""Drafter service: a thin gRPC servicer over the drafter engines hosted by this process.

One process may host several drafter models; each is its own drafter identity to the router.
Model work runs in a worker thread (one per process: the engines are not thread-safe and the
cores are budgeted per process), so the event loop keeps serving health checks and streams.

**Drain on SIGTERM** (:meth:`DrafterApp.drain`, called by the shared shutdown path after the
health status has turned NOT_SERVING and the membership entry is deleted): the process takes no
new work - a draft step carrying a request it does not hold is refused with UNAVAILABLE, which a
router takes as "this replica is gone" and moves the request to another replica - while steps for
the requests it holds, and the step running, are answered. It exits once every router has closed
its stream or no step has come for ``drain_idle_s`` (routers drop a replica that left the
membership within a discovery interval), and after ``drain_timeout_s`` at the latest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import grpc

from common.logs import get_logger
from common.platform.grpc_server import ServerHandle
from common.platform.live_requests import LiveRequests
from common.platform.metrics import ServiceMetrics, bind_engine_metrics
from common.platform.service import StartupError
from common.platform.store import Store
from common.runtime.checkpoints import CheckpointError
from common.runtime.drafter_engine import DrafterEngine
from common.runtime.model_thread import ModelThread
from common.runtime.threads import configure_torch_threads
from common.spec.token_fusion import FusionOutcome, FusionRequest, StepPricing, TokenFusion
from common.spec.types import DraftItem, DraftResult, StageTimings
from cosine.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from services.convert import (
    draft_items_from_pb,
    draft_result_to_pb,
    fuse_round_from_pb,
    fusion_outcomes_to_pb,
    model_info_to_pb,
)
from services.drafter.settings import DrafterSettings

SERVICE_NAME = "cosine.v1.Drafter"
VERSION = "0.1.0"
log = get_logger("drafter")


def run_chain_step(engine: DrafterEngine, items: Sequence[DraftItem]) -> tuple[list[DraftResult], StageTimings]:
    """One batched step, then greedy continuation for items with chain_len > 1: each further
    position appends the item's own best candidate and proposes again (one batched forward per
    position, all chain items together)."""
    t0 = time.perf_counter_ns()
    outcome = engine.run_step(items)
    results = list(outcome.results)
    forward_ns = outcome.timings.forward_ns
    chains = {
        i: [(r.token_ids, r.probs)]
        for i, (item, r) in enumerate(zip(items, results))
        if item.chain_len > 1 and r.ok and r.token_ids
    }
    ended: set[int] = set()  # chains cut short by a per-item error keep what they drafted
    for _ in range(max((items[i].chain_len for i in chains), default=1) - 1):
        live = [i for i in chains if i not in ended and len(chains[i]) < items[i].chain_len]
        if not live:
            break
        step = [
            DraftItem(request_id=items[i].request_id, append_ids=(chains[i][-1][0][0],), top_n=max(1, items[i].top_n))
            for i in live
        ]
        more = engine.run_step(step)
        forward_ns += more.timings.forward_ns
        for i, r in zip(live, more.results):
            if r.ok and r.token_ids:
                chains[i].append((r.token_ids, r.probs))
                results[i] = replace(results[i], cache_len=r.cache_len)
            else:
                ended.add(i)
    for i, positions in chains.items():
        results[i] = replace(results[i], positions=tuple(positions))
    total = time.perf_counter_ns() - t0
    return results, StageTimings(
        prefill_ns=outcome.timings.prefill_ns,
        forward_ns=forward_ns,
        decode_ns=max(0, total - forward_ns - outcome.timings.prefill_ns),
        total_ns=total,
    )


def run_fused_round(
    engines: Mapping[str, DrafterEngine], width: int, pricing: StepPricing, requests: Sequence[FusionRequest]
) -> tuple[dict[str, FusionOutcome], list[float]]:
    """A round of token fusion over drafters hosted here: the router's loop (common/spec/token_fusion.py),
    each step one batched forward per drafter, and no message between steps. Returns each
    request's outcome and each step's seconds."""
    loop = TokenFusion(requests, width, pricing)
    seconds: list[float] = []
    while not loop.done:
        calls = loop.step()
        t0 = time.perf_counter()
        loop.take({d: list(engines[d].run_step(items).results) if d in engines else None for d, items in calls.items()})
        seconds.append(time.perf_counter() - t0)
    return loop.outcomes, seconds


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, app: DrafterApp):
        self.app = app

    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.InfoResponse:
        reply = common_pb2.InfoResponse(service="drafter", version=VERSION)
        for name, engine in sorted(self.app.engines.items()):
            reply.models.append(model_info_to_pb(engine.model_info(), name, engine.domains))
        return reply

    async def Draft(self, request_iterator, context: grpc.aio.ServicerContext):
        live = (
            LiveRequests()
        )  # (drafter id, request id) this stream holds caches for (see common/platform/live_requests.py)
        self.app.streams += 1
        try:
            async for step in request_iterator:
                received = time.perf_counter_ns()
                self.app.last_step = time.monotonic()
                if step.HasField("fuse"):
                    yield await self.fused_round(step, context, live, received)
                    continue
                groups = [(g.drafter_id, draft_items_from_pb(g)) for g in step.groups] or [
                    (step.drafter_id, draft_items_from_pb(step))
                ]
                unknown = sorted({d for d, _ in groups if d not in self.app.engines})
                if unknown:
                    await context.abort(
                        grpc.StatusCode.NOT_FOUND,
                        f"drafter_id: this process hosts no drafter {', '.join(map(repr, unknown))} "
                        f"(it hosts {', '.join(sorted(self.app.engines)) or 'none'})",
                    )
                if self.app.draining:
                    new = self.app.not_held(groups)
                    if new:
                        await context.abort(
                            grpc.StatusCode.UNAVAILABLE,
                            f"drafter process draining (shutting down): it takes no "
                            f"new requests ({len(new)} in this step, e.g. {new[0]!r}); use another replica",
                        )
                before = live.begin(((d, item.request_id), item.release) for d, items in groups for item in items)
                answers, timings = await self.app.run_groups(groups)
                live.settle(
                    before,
                    (
                        ((d, item.request_id), item.release, r.ok)
                        for (d, items), results in zip(groups, answers)
                        for item, r in zip(items, results)
                    ),
                )
                reply = drafter_pb2.DraftStepResult(step_id=step.step_id, drafter_id=step.drafter_id)
                if step.groups:
                    for (d, _), results in zip(groups, answers):
                        reply.groups.add(drafter_id=d, results=[draft_result_to_pb(r) for r in results])
                else:
                    reply.results.extend(draft_result_to_pb(r) for r in answers[0])
                reply.timings.prefill_ns = timings.prefill_ns
                reply.timings.forward_ns = timings.forward_ns
                reply.timings.decode_ns = timings.decode_ns
                reply.timings.total_ns = time.perf_counter_ns() - received
                reply.timings.queue_ns = max(0, reply.timings.total_ns - timings.total_ns)
                yield reply
        finally:
            self.app.streams -= 1
            # the router went away: free every cache it left behind (shielded: a second cancellation
            # must not drop the release queued behind a running step)
            if live:
                leftovers: dict[str, set[str]] = {}
                for d, rid in live.ids:
                    leftovers.setdefault(d, set()).add(rid)
                await asyncio.shield(self.app.release(leftovers))

    async def fused_round(
        self, step: drafter_pb2.DraftStep, context: grpc.aio.ServicerContext, live: LiveRequests, received: int
    ) -> drafter_pb2.DraftStepResult:
        """A whole round of token fusion in this process (DraftStep.fuse)."""
        width, pricing, requests = fuse_round_from_pb(step.fuse)
        groups: dict[str, list[DraftItem]] = {}
        for r in requests:
            for s in r.sources:
                groups.setdefault(s.drafter_id, []).append(s.first)
        unknown = sorted(d for d in groups if d not in self.app.engines)
        if unknown:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"fuse.requests.sources.drafter_id: this process hosts no drafter "
                f"{', '.join(map(repr, unknown))} (it hosts {', '.join(sorted(self.app.engines)) or 'none'})",
            )
        if self.app.draining:
            new = self.app.not_held(list(groups.items()))
            if new:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"drafter process draining (shutting down): it takes no "
                    f"new requests ({len(new)} in this round, e.g. {new[0]!r}); use another replica",
                )
        before = live.begin(((d, item.request_id), False) for d, items in groups.items() for item in items)
        outcomes, seconds, forward_ns = await self.app.run_fused(width, pricing, requests)
        live.settle(
            before,
            (
                ((s.drafter_id, r.request_id), False, s.drafter_id in outcomes[r.request_id].cache_len)
                for r in requests
                for s in r.sources
            ),
        )
        reply = drafter_pb2.DraftStepResult(step_id=step.step_id, fused=fusion_outcomes_to_pb(outcomes, seconds))
        reply.timings.forward_ns = forward_ns
        reply.timings.total_ns = time.perf_counter_ns() - received
        reply.timings.queue_ns = max(0, reply.timings.total_ns - forward_ns)
        return reply


class DrafterApp:
    role = "drafter"
    service_names = (SERVICE_NAME,)

    def __init__(
        self,
        settings: DrafterSettings,
        store: Store,
        engines: dict[str, DrafterEngine],
        model_thread: ModelThread | None = None,
    ):
        self.settings = settings
        self.store = store
        self.engines = engines
        self.servicer = DrafterServicer(self)
        self.model_thread = model_thread or ModelThread("drafter-model")  # the thread that loaded the drafters
        self.draining = False
        self.streams = 0  # open Draft streams
        self.in_flight = 0  # draft steps on the model thread or waiting for it
        self.last_step = time.monotonic()

    def not_held(self, groups: Sequence[tuple[str, Sequence[DraftItem]]]) -> list[str]:
        """Request ids of a step that this process holds no cache for (releases aside)."""
        return [
            item.request_id
            for d, items in groups
            for item in items
            if not item.release and not self.engines[d].holds(item.request_id)
        ]

    async def drain(self) -> None:
        """Answer what is in flight and let the routers move away; return when done (see the module doc)."""
        self.draining = True
        t0 = time.monotonic()
        held = sum(e.active_requests for e in self.engines.values())
        log.info(
            "draining",
            streams=self.streams,
            in_flight=self.in_flight,
            requests_held=held,
            timeout_s=self.settings.drain_timeout_s,
        )
        while time.monotonic() - t0 < self.settings.drain_timeout_s:
            idle = time.monotonic() - max(self.last_step, t0) >= self.settings.drain_idle_s
            if self.in_flight == 0 and (self.streams == 0 or idle):
                break
            await asyncio.sleep(0.05)
        log.info(
            "drained",
            seconds=round(time.monotonic() - t0, 3),
            streams=self.streams,
            in_flight=self.in_flight,
            requests_held=sum(e.active_requests for e in self.engines.values()),
        )

    async def run_groups(
        self, groups: Sequence[tuple[str, Sequence[DraftItem]]]
    ) -> tuple[list[list[DraftResult]], StageTimings]:
        """Every group's step on the model thread, in one hop; timings summed."""

        def work() -> tuple[list[list[DraftResult]], StageTimings]:
            answers, stages = [], []
            for d, items in groups:
                results, timings = run_chain_step(self.engines[d], items)
                answers.append(results)
                stages.append(timings)
            return answers, StageTimings.sum(stages)

        self.in_flight += 1
        try:
            return await self.model_thread.run(work)
        finally:
            self.in_flight -= 1
            self.last_step = time.monotonic()

    async def run_fused(
        self, width: int, pricing: StepPricing, requests: Sequence[FusionRequest]
    ) -> tuple[dict[str, FusionOutcome], list[float], int]:
        """A fused round (:func:`run_fused_round`) on the model thread; also its model time in ns."""
        self.in_flight += 1
        try:
            outcomes, seconds = await self.model_thread.run(run_fused_round, self.engines, width, pricing, requests)
            return outcomes, seconds, int(sum(seconds) * 1e9)
        finally:
            self.in_flight -= 1
            self.last_step = time.monotonic()

    async def release(self, leftovers: dict[str, set[str]]) -> None:
        def work() -> int:
            n = 0
            for d, ids in leftovers.items():
                for rid in ids:
                    n += bool(self.engines[d].release(rid))
            return n

        n = await self.model_thread.run(work)
        if n:
            log.info("released caches of a closed stream", requests=n)

    def bind_metrics(self, metrics: ServiceMetrics) -> None:
        for name, engine in self.engines.items():
            bind_engine_metrics(metrics, lambda e=engine: e, model=name)

    def register(self, server: grpc.aio.Server) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(self.servicer, server)

    async def start(self, handle: ServerHandle, address: str) -> None:
        pass

    async def stop(self) -> None:
        self.model_thread.shutdown()

    def member_info(self) -> dict[str, Any]:
        return {"drafters": sorted(self.engines)}


async def build_app(settings: DrafterSettings, store: Store) -> DrafterApp:
    threads = configure_torch_threads(settings.torch_threads)
    engines: dict[str, DrafterEngine] = {}
    model_thread = ModelThread("drafter-model")
    for name, path in settings.parsed_drafters().items():
        try:
            engine = await model_thread.run(
                DrafterEngine.from_checkpoint,
                path,
                device=settings.device,
                dtype=settings.dtype,
                kv_cache=settings.kv_cache,
                cuda_graphs=settings.cuda_graphs,
                kv_token_budget=settings.kv_budget_tokens,
                domains=_domains_of(path, name),
                max_top_n=settings.max_top_n,
                max_chain_len=settings.max_chain_len,
            )
        except (CheckpointError, ValueError) as exc:
            raise StartupError(f"drafter {name}: {exc}") from None
        engines[name] = engine
        info = engine.model_info()
        log.info(
            "drafter loaded",
            drafter=name,
            path=path,
            params=info.num_parameters,
            fingerprint=info.tokenizer_fingerprint,
            domains=list(engine.domains),
            threads=threads,
        )
    if not engines:
        log.warning("no drafter model given (--drafters NAME=PATH); this process will refuse draft steps")
    return DrafterApp(settings, store, engines, model_thread)


def _domains_of(path: str, name: str) -> list[str]:
    """Domains a drafter was trained for: from a model zoo's manifest next to the checkpoint, if any."""
    import json
    from pathlib import Path

    for parent in Path(path).resolve().parents:
        manifest = parent / "zoo.json"
        if manifest.is_file():
            try:
                data = json.loads(manifest.read_text())
            except ValueError:
                return []
            for key, entry in (data.get("drafters") or {}).items():
                if key == name or Path(parent, entry.get("path", "")).resolve() == Path(path).resolve():
                    return list(entry.get("domains") or [])
            return []
    return []


def main(argv: Sequence[str] | None = None) -> None:
    from common.platform.service import run_service

    run_service(
        DrafterSettings,
        build_app,
        prog="services.drafter",
        argv=argv,
        description="CoSine drafter: hosts small causal LMs and proposes next-token candidates to the router.",
    )
