"""Verifier service: a thin gRPC servicer over the verifier engine (the target model).

Each VerifyBatch from the router is verified in one forward pass (then a pass per plain step its
items ask for) in a worker thread (the engine is not thread-safe; one model worker per process), so
the event loop keeps answering health checks while the model runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import grpc

from common.logs import get_logger
from common.platform.grpc_server import ServerHandle
from common.platform.live_requests import LiveRequests
from common.platform.metrics import ServiceMetrics, bind_engine_metrics
from common.platform.service import StartupError
from common.platform.store import Store
from common.runtime.batching import merge_outcomes, repeated_items, split_by_tokens
from common.runtime.checkpoints import CheckpointError
from common.runtime.model_thread import ModelThread
from common.runtime.threads import configure_torch_threads
from common.runtime.verifier_engine import VerifierEngine
from common.spec.lookup_corpus import DomainCorpora
from common.spec.types import VerifyItem, VerifyOutcome
from cosine.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from services.convert import model_info_to_pb, verdict_to_pb, verify_items_from_pb
from services.corpus import corpus_from_store, keep_corpus_loaded
from services.verifier.settings import VerifierSettings

SERVICE_NAME = "cosine.v1.Verifier"
VERSION = "0.1.0"
log = get_logger("verifier")


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, app: VerifierApp):
        self.app = app

    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.InfoResponse:
        reply = common_pb2.InfoResponse(service="verifier", version=VERSION)
        if self.app.engine is not None:
            reply.models.append(model_info_to_pb(self.app.engine.model_info(), "target"))
        return reply

    async def Verify(self, request_iterator, context: grpc.aio.ServicerContext):
        engine = self.app.engine
        if engine is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this verifier hosts no target model (start it with --target PATH)"
            )
        live = LiveRequests()  # request ids this stream holds caches for (see common/platform/live_requests.py)
        try:
            async for batch in request_iterator:
                received = time.perf_counter_ns()
                items = verify_items_from_pb(batch)
                before = live.begin((item.request_id, item.release) for item in items)
                outcome = await self.app.verify(items)
                live.settle(before, ((i.request_id, i.release, v.ok) for i, v in zip(items, outcome.verdicts)))
                reply = verifier_pb2.VerifyResult(
                    batch_id=batch.batch_id,
                    verdicts=[verdict_to_pb(v) for v in outcome.verdicts],
                    batch_tokens=outcome.batch_tokens,
                )
                t = outcome.timings
                reply.timings.prefill_ns, reply.timings.forward_ns, reply.timings.decode_ns = (
                    t.prefill_ns,
                    t.forward_ns,
                    t.decode_ns,
                )
                reply.timings.total_ns = time.perf_counter_ns() - received
                reply.timings.queue_ns = max(0, reply.timings.total_ns - t.total_ns)
                yield reply
        finally:
            if live:  # shielded: a second cancellation must not drop the release queued behind a running pass
                await asyncio.shield(self.app.release(set(live.ids)))


class VerifierApp:
    role = "verifier"
    service_names = (SERVICE_NAME,)

    def __init__(
        self,
        settings: VerifierSettings,
        store: Store,
        engine: VerifierEngine | None,
        model_thread: ModelThread | None = None,
    ):
        self.settings = settings
        self.store = store
        self.engine = engine
        self.servicer = VerifierServicer(self)
        self.model_thread = model_thread or ModelThread("verifier-model")  # the thread that loaded the target
        self.busy_ns = 0
        self.passes: Any = None
        self._closed = False
        self._corpus_task: asyncio.Task[None] | None = None

    async def verify(self, items: Sequence[VerifyItem]) -> VerifyOutcome:
        """Verify a batch; one forward pass per slice of at most --max-batch-tokens tokens."""
        assert self.engine is not None
        repeats = repeated_items(items)  # refused here: the split below could put them in different passes
        todo = [item for i, item in enumerate(items) if i not in repeats]
        outcomes = [
            await self.model_thread.run(self.engine.verify, part)
            for part in split_by_tokens(todo, self.settings.max_batch_tokens)
        ]
        outcome = merge_outcomes(outcomes, repeats)
        self.busy_ns += outcome.timings.total_ns
        if self.passes is not None:
            self.passes.inc()
            self.pass_requests.observe(len(items))
            self.pass_seconds.observe(outcome.timings.total_ns / 1e9)
        return outcome

    async def release(self, request_ids: set[str]) -> None:
        engine = self.engine
        if engine is None:
            return
        n = await self.model_thread.run(lambda: sum(engine.release(r) for r in request_ids))
        if n:
            log.info("released caches of a closed stream", requests=n)

    def bind_metrics(self, metrics: ServiceMetrics) -> None:
        bind_engine_metrics(metrics, lambda: self.engine)
        self.passes = metrics.counter("cosine_verifier_batches_total", "verify batches")
        self.pass_requests = metrics.histogram(
            "cosine_verifier_batch_requests", "requests per verify batch", buckets=(1, 2, 4, 8, 12, 16, 24, 32, 64)
        )
        self.pass_seconds = metrics.histogram("cosine_verifier_batch_seconds", "model time of a verify batch")

    def register(self, server: grpc.aio.Server) -> None:
        verifier_pb2_grpc.add_VerifierServicer_to_server(self.servicer, server)

    async def start(self, handle: ServerHandle, address: str) -> None:
        engine = self.engine
        if engine is None:
            return

        def use(corpora: DomainCorpora | None) -> None:  # a reference swap: a pass in flight reads one or the other
            engine.corpus = corpora

        # the lookup corpus the routers draft from, for the plain steps' drafts (VerifyItem.step_corpus)
        self._corpus_task = asyncio.ensure_future(
            keep_corpus_loaded(lambda version: corpus_from_store(self.store, version), use, lambda: self._closed)
        )

    async def stop(self) -> None:
        self._closed = True
        if self._corpus_task is not None:
            self._corpus_task.cancel()
        self.model_thread.shutdown()

    def member_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"target": self.settings.target}
        if self.engine is not None:
            m = self.engine.model_info()
            info.update(
                vocab_size=m.vocab_size,
                max_context=m.max_context,
                fingerprint=m.tokenizer_fingerprint,
                attention_backend=m.attention_backend,
            )
        return info


async def build_app(settings: VerifierSettings, store: Store) -> VerifierApp:
    threads = configure_torch_threads(settings.torch_threads)
    engine = None
    model_thread = ModelThread("verifier-model")
    if settings.target:
        try:
            engine = await model_thread.run(
                VerifierEngine.from_checkpoint,
                settings.target,
                device=settings.device,
                dtype=settings.dtype,
                attention_backend=settings.attention,
                kv_cache=settings.kv_cache,
                cuda_graphs=settings.cuda_graphs,
                kv_token_budget=settings.kv_budget_tokens,
                max_tree_nodes=settings.max_tree_nodes,
            )
        except (CheckpointError, ValueError) as exc:
            raise StartupError(f"target: {exc}") from None
        if settings.time_passes:
            await model_thread.run(engine.time_passes)
        m = engine.model_info()
        log.info(
            "target loaded",
            path=settings.target,
            architecture=m.architecture,
            params=m.num_parameters,
            attention_backend=m.attention_backend,
            threads=threads,
            fingerprint=m.tokenizer_fingerprint,
        )
    else:
        log.warning("no target model given (--target PATH); this verifier will refuse Verify streams")
    return VerifierApp(settings, store, engine, model_thread)


def main(argv: Sequence[str] | None = None) -> None:
    from common.platform.service import run_service

    run_service(
        VerifierSettings,
        build_app,
        prog="services.verifier",
        argv=argv,
        description="CoSine verifier: hosts the target model and verifies batches of token trees losslessly.",
    )
