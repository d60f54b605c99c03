"""Router service: a thin gRPC servicer over the control plane (services/router/core.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
from tenacity import RetryCallState, retry_if_exception_type

from common.logs import get_logger, request_context
from common.platform.grpc_server import ServerHandle
from common.platform.metrics import ServiceMetrics
from common.platform.retry import RetryPolicy
from common.platform.service import StartupError
from common.platform.store import Store, StoreUnavailable
from common.platform.tls import TlsConfig
from cosine.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.convert import sampling_from_pb, submit_logprobs_from_pb, token_chunk_to_pb
from services.router.admission import SubmitLimits
from services.router.clients import GrpcDrafterPool, GrpcVerifier
from services.router.core import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH, FINISH_STOP, RequestFailed, RouterCore
from services.router.metrics import RouterMetrics
from services.router.profiles import ProfileStore
from services.router.settings import RouterSettings

SERVICE_NAME = "cosine.v1.Router"
log = get_logger("router")

FINISH_TO_PB = {
    FINISH_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FINISH_EOS: common_pb2.FINISH_REASON_EOS,
    FINISH_STOP: common_pb2.FINISH_REASON_STOP,
    FINISH_CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}
KIND_TO_STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "context": grpc.StatusCode.INVALID_ARGUMENT,
    "kv_budget": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "already_exists": grpc.StatusCode.ALREADY_EXISTS,
    "unknown_request": grpc.StatusCode.NOT_FOUND,
    "internal": grpc.StatusCode.INTERNAL,
}


def stats_to_pb(stats: Any) -> common_pb2.SpecStats:
    return common_pb2.SpecStats(
        rounds=stats.rounds,
        mean_accepted_len=stats.mean_accepted_len,
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        drafters_used=sorted(stats.drafters_used),
        accepted_by_drafter=dict(stats.accepted_by_drafter),
        grammar_pruned_tokens=stats.grammar_pruned_tokens,
    )


# Looking for the verifier at start-up: 0.1 s doubling to 0.5 s between looks, for as long as it takes.
VERIFIER_CONNECT_RETRY = RetryPolicy(initial_s=0.1, max_s=0.5)


class _VerifierNotReady(Exception):
    """No verifier is registered yet (``address`` empty), or the one at ``address`` does not answer."""

    def __init__(self, address: str, error: Exception | None):
        super().__init__(f"verifier at {address}: {error}" if address else "no verifier registered")
        self.address = address
        self.error = error


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, app: RouterApp):
        self.app = app

    async def Submit(self, request: router_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        core = self.app.core
        if core is None or not self.app.verifier_ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no verifier is connected to this router")
        with request_context(request.request_id):
            try:
                req = core.submit(
                    request.request_id,
                    list(request.prompt_ids),
                    request.max_new_tokens,
                    sampling_from_pb(request.sampling),
                    list(request.stop_token_ids),
                    request.domain_hint,
                    submit_logprobs_from_pb(request),
                    request.prompt_len,
                )
            except RequestFailed as exc:
                await context.abort(KIND_TO_STATUS.get(exc.kind, grpc.StatusCode.INTERNAL), str(exc))
            try:
                while True:
                    event = await req.events.get()
                    if event.error is not None:
                        await context.abort(
                            KIND_TO_STATUS.get(event.error.kind, grpc.StatusCode.INTERNAL), str(event.error)
                        )
                    chunk = token_chunk_to_pb(req.request_id, event.tokens, event.logprobs, event.finished)
                    chunk.timings.total_ns = event.round_ns
                    if event.finished:
                        chunk.finish_reason = FINISH_TO_PB.get(
                            event.finish_reason, common_pb2.FINISH_REASON_UNSPECIFIED
                        )
                        chunk.stats.CopyFrom(stats_to_pb(req.stats))
                        # logged before the last chunk goes: a client may close the stream at it
                        log.info(
                            "request finished",
                            reason=event.finish_reason,
                            tokens=len(req.generated),
                            rounds=req.stats.rounds,
                            mean_accepted=round(req.stats.mean_accepted_len, 3),
                            domain=req.domain,
                        )
                        yield chunk
                        return
                    if event.tokens:
                        yield chunk
            finally:
                # the client went away or its deadline passed: while awaiting an event that is a
                # CancelledError, while suspended at a yield it is GeneratorExit; either way the
                # request must stop generating and free its caches
                if not req.done:
                    core.cancel(req.request_id)
                    # named here, not from the context: a stream closed at a yield unwinds in gRPC's task
                    log.info("request cancelled by client", request_id=req.request_id)

    async def Status(
        self, request: router_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouterStatus:
        app = self.app
        out = router_pb2.RouterStatus(
            verifier_address=app.verifier.address if app.verifier else "", verifier_healthy=app.verifier_ready
        )
        if app.core is not None:
            core = app.core
            out.queue_depth = core.queue_depth()
            out.active_requests = len(core.requests)
            out.rounds_in_flight = core.rounds_in_flight
            for key, value in core.counters.as_dict().items():
                out.counters[key] = float(value)
            out.counters["drafter_calls"] = float(app.pool.calls)
            out.counters["drafter_fused_rounds"] = float(app.pool.fused_rounds)
            out.counters["drafter_busy_s"] = app.pool.busy_ns / 1e9
            acceptance = core.drafter_acceptance()
            for d in sorted(set(app.pool.by_drafter) | set(acceptance)):
                ep = app.pool.by_drafter.get(d)
                rounds, mean = acceptance.get(d, (0.0, 0.0))
                out.drafters.add(
                    drafter_id=d,
                    address=ep.address if ep else "",
                    healthy=bool(ep and not ep.failed),
                    acceptance=mean,
                    rounds=int(rounds),
                )
        return out


class RouterApp:
    role = "router"
    service_names = (SERVICE_NAME,)

    def __init__(self, settings: RouterSettings, store: Store):
        self.settings = settings
        self.store = store
        self.servicer = RouterServicer(self)
        self.verifier: GrpcVerifier | None = None
        self.tls = TlsConfig.from_settings(settings)  # drafters and the verifier are dialled with it
        self.pool: GrpcDrafterPool = GrpcDrafterPool(
            store, "", settings.discovery_interval_s, settings.use_drafters, tls=self.tls
        )
        self.spec_metrics: RouterMetrics | None = None
        self.core: RouterCore | None = None
        self.verifier_ready = False
        self._connect_task: asyncio.Task[None] | None = None

    def bind_metrics(self, metrics: ServiceMetrics) -> None:
        self.spec_metrics = RouterMetrics(
            metrics,
            lambda: float(self.core.queue_depth()) if self.core else 0.0,
            lambda: float(len(self.core.requests)) if self.core else 0.0,
        )

    def register(self, server: grpc.aio.Server) -> None:
        router_pb2_grpc.add_RouterServicer_to_server(self.servicer, server)

    async def start(self, handle: ServerHandle, address: str) -> None:
        self._connect_task = asyncio.create_task(self._connect_verifier(), name="verifier-connect")

    async def _find_verifier(self) -> tuple[GrpcVerifier, common_pb2.ModelInfo, str]:
        """One look for the verifier (setting or membership): its client, model info and address,
        or :class:`_VerifierNotReady`."""
        address = self.settings.verifier_address
        if not address:
            try:
                members = await self.store.members("verifier")
            except StoreUnavailable as exc:  # Redis restarting: look again
                log.warning("cannot read the membership; retrying", error=str(exc))
                members = []
            address = members[0].address if members else ""
        if not address:
            raise _VerifierNotReady("", None)
        verifier = GrpcVerifier(address, self.tls)
        try:
            return verifier, await verifier.fetch_info(), address
        except Exception as exc:
            await verifier.close()
            raise _VerifierNotReady(address, exc) from None

    async def _connect_verifier(self) -> None:
        """Find the verifier, read its tokenizer fingerprint, then start drafter discovery and the
        round workers. Retries until it succeeds (the first miss is logged)."""

        def first_miss(state: RetryCallState) -> None:
            miss = state.outcome.exception() if state.outcome is not None else None
            if state.attempt_number != 1 or not isinstance(miss, _VerifierNotReady):
                return
            if miss.address:
                log.warning("verifier not ready yet; retrying", address=miss.address, error=str(miss.error))
            else:
                log.info("waiting for a verifier to register")

        async for attempt in VERIFIER_CONNECT_RETRY.retrying(
            retry=retry_if_exception_type(_VerifierNotReady), before_sleep=first_miss
        ):
            with attempt:
                verifier, info, address = await self._find_verifier()
        self.verifier = verifier
        self.pool.fingerprint = info.tokenizer_fingerprint
        try:
            await self.pool.refresh()
        except StoreUnavailable as exc:  # the discovery loop tries again every interval
            log.warning("drafter discovery failed", error=str(exc))
        self.pool.start()
        prior_weight = self.settings.profile_prior_weight
        profiles = ProfileStore(self.store)  # a Redis outage costs priors for a while, never a request
        self.core = RouterCore(
            self.settings,
            self.pool,
            verifier,
            metrics=self.spec_metrics,
            profiles=profiles.priors,
            record=profiles.record,
            load_lexicon=profiles.lexicon if self.settings.shared_lexicon else None,
            record_lexicon=profiles.learned if self.settings.shared_lexicon else None,
            load_corpus=profiles.corpus,
            limits=SubmitLimits(info.vocab_size, info.max_context) if info.vocab_size and info.max_context else None,
        )
        self.core.start()
        self.verifier_ready = True
        log.info(
            "verifier connected",
            address=address,
            model=info.model_name,
            vocab=info.vocab_size,
            fingerprint=info.tokenizer_fingerprint,
            drafters=self.pool.live(),
            prior_weight=prior_weight,
        )

    async def stop(self) -> None:
        if self._connect_task:
            self._connect_task.cancel()
            await asyncio.gather(self._connect_task, return_exceptions=True)
        if self.core is not None:
            await self.core.stop()
        await self.pool.close()
        if self.verifier is not None:
            await self.verifier.close()

    def member_info(self) -> dict[str, Any]:
        return {"fusion": self.settings.fusion, "rounds_in_flight": self.settings.rounds_in_flight}


async def build_app(settings: RouterSettings, store: Store) -> RouterApp:
    if settings.drafters_per_request < 1:
        raise StartupError("--drafters-per-request must be >= 1")
    return RouterApp(settings, store)


def main(argv: Sequence[str] | None = None) -> None:
    from common.platform.service import run_service

    run_service(
        RouterSettings,
        build_app,
        prog="services.router",
        argv=argv,
        description="CoSine router: schedules requests into pipelined rounds, routes them to drafters by "
        "expertise, fuses proposals into token trees and sends them to the verifier.",
    )
