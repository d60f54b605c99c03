"""One admitted request's trip through the router, as the gateway relays it: Redis request state,
the router's token stream turned into text (incremental detokenization, stop strings), metrics,
and resume when the router is lost.

Request state: the tokens of a running request are written to Redis with its first chunk and then
with the first chunk after every ``--request-state-interval-s``, not after every chunk: on a small
machine a Redis script per token is taken from the verifier's cores. So the state trails the
client's stream by about that interval (plus the wait for a chunk); a finished request's state is
deleted, so its last tokens are not written.

Resume: when the router's stream breaks with UNAVAILABLE (the router died or was replaced), the
gateway waits for a router (the same address restarted by its supervisor, or another member) and
submits a continuation: the prompt followed by every token already relayed, for the tokens still
to come, under a new internal id (the lost router's caches on the verifier and drafters are keyed
by the old one). The detokenizer and the stop matcher keep their state, so the client's stream
goes on with no token repeated or skipped; greedy output is the target's either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from common.logs import get_logger, request_context
from common.platform.store import STORE_ERRORS, RequestExists, Store
from cosine.v1 import router_pb2_grpc
from services.convert import submit_to_pb, token_chunk_from_pb
from services.gateway.errors import GatewayError
from services.gateway.metrics import GatewayMetrics
from services.gateway.progress import FinishReason, Progress
from services.gateway.requests import GenerationRequest, IncrementalDetokenizer, StopMatcher
from services.gateway.settings import GatewaySettings

log = get_logger("gateway")


class RelayHost(Protocol):
    """What a relay uses of the gateway (:class:`services.gateway.server.GatewayApp` is one): its
    settings, store, tokenizer and metrics, and its connection to the router."""

    settings: GatewaySettings
    store: Store
    tokenizer: Any
    eos_ids: tuple[int, ...]
    member_id: str
    metrics: GatewayMetrics | None
    router_address: str
    router_stub: router_pb2_grpc.RouterStub | None

    async def ensure_ready(self) -> None: ...

    async def reconnect_router(self, deadline: float, lost: router_pb2_grpc.RouterStub | None) -> None: ...

    def forget_router(self) -> None: ...


def router_lost(exc: grpc.aio.AioRpcError) -> bool:
    """The stream broke because the router went away (not because it refused the request)."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE


class RouterRelay:
    def __init__(self, app: RelayHost, gen: GenerationRequest, timeout_s: float):
        self.app = app
        self.gen = gen
        self.timeout_s = timeout_s
        self.produced: list[int] = list(gen.resume_ids)  # tokens the client has (relayed, or resumed from)
        self.resumes = 0
        self.unsaved: list[int] = []  # relayed tokens not yet in the request's Redis state
        self.save_due = 0.0  # loop time of the next write of the request state
        self.detok = IncrementalDetokenizer(app.tokenizer, skip_special_tokens=True)
        self.stops = StopMatcher(gen.stop) if gen.stop else None
        if gen.resume_ids:  # a resumed stream: the text the client has is not sent again
            seen = self.detok.push(gen.resume_ids)
            if self.stops is not None:
                self.stops.feed(seen)  # text held back as a possible stop string stays held back

    def _submit(self, stub: router_pb2_grpc.RouterStub, timeout_s: float) -> grpc.aio.UnaryStreamCall:
        gen = self.gen
        request_id = gen.request_id if not self.resumes else f"{gen.request_id}:r{self.resumes}"
        submit = submit_to_pb(
            request_id,
            [*gen.prompt_ids, *self.produced],
            gen.max_new_tokens - len(self.produced),
            gen.sampling(),
            self.app.eos_ids,
            gen.domain_hint,
            gen.logprobs,
            prompt_len=len(gen.prompt_ids),  # what was produced is output (the penalties count it)
        )
        return stub.Submit(submit, timeout=timeout_s)

    def _text(self, token_ids: list[int], finished: bool) -> str:
        text = self.detok.push(token_ids)
        return text + self.detok.flush() if finished else text

    async def _save(self, token_ids: list[int], now: float) -> bool:
        """Note relayed tokens in the request's Redis state when a write is due (see the module doc).
        An outage must not fail a running request: the store keeps what it could not write. False
        only when a write was due and did not land."""
        self.unsaved.extend(token_ids)
        if now < self.save_due or not self.unsaved:
            return True
        self.save_due = now + self.app.settings.request_state_interval_s
        ids, self.unsaved = self.unsaved, []
        return await self.app.store.append_tokens(self.gen.request_id, ids, status="running")

    async def pieces(self) -> AsyncIterator[Progress]:
        app, gen = self.app, self.gen
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        with request_context(gen.request_id):
            try:
                await app.store.create_request(gen.request_id, list(gen.prompt_ids), gen.params(), owner=app.member_id)
            except RequestExists as exc:  # another request owns this id: answer without touching its state
                raise GatewayError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {exc}", "request_id") from None
            except STORE_ERRORS as exc:
                raise GatewayError(
                    grpc.StatusCode.UNAVAILABLE, f"request state cannot be written (Redis): {exc}"
                ) from None
            log.info(
                "request admitted",
                prompt_tokens=len(gen.prompt_ids),
                max_new_tokens=gen.max_new_tokens,
                temperature=gen.temperature,
                router=app.router_address,
                **(
                    {
                        "presence_penalty": gen.presence_penalty,
                        "frequency_penalty": gen.frequency_penalty,
                        "repetition_penalty": gen.repetition_penalty,
                    }
                    if gen.sampling().penalised
                    else {}
                ),
            )
            clock = app.metrics.start(len(gen.prompt_ids)) if app.metrics is not None else None
            outcome = "cancelled"
            store_failures = 0
            try:
                while True:
                    if self.stops is not None and self.stops.stopped:  # a resumed stream already ended in a stop string
                        outcome = "stop"
                        yield Progress("", [], True, FinishReason.STOP)
                        return
                    if self.produced and self.produced[-1] in app.eos_ids:  # ended at the target's end of sequence
                        outcome = "eos"  # (the router or the client's connection was lost right after it)
                        yield Progress(self._text([], True), [], True, FinishReason.EOS)
                        return
                    if len(self.produced) >= gen.max_new_tokens:  # the router was lost right after the last token
                        outcome = "length"
                        yield Progress(self._text([], True), [], True, FinishReason.LENGTH)
                        return
                    if app.router_stub is None:
                        await app.ensure_ready()
                    stub = app.router_stub
                    assert stub is not None
                    call = self._submit(stub, max(0.001, deadline - loop.time()))
                    try:
                        async for message in call:
                            chunk = token_chunk_from_pb(message)
                            ids = list(chunk.token_ids)
                            self.produced.extend(ids)
                            if clock is not None:
                                clock.tokens_out(len(ids))
                            if clock is not None and chunk.finished:
                                clock.stats = chunk.stats
                            text = self._text(ids, chunk.finished)
                            if not chunk.finished and not await self._save(ids, loop.time()):
                                store_failures += 1
                                if store_failures == 1:
                                    log.warning("request state not written yet (Redis away); the request goes on")
                            if self.stops is not None:
                                text = self.stops.feed(text) + (self.stops.flush() if chunk.finished else "")
                                if self.stops.stopped:
                                    outcome = "stop"
                                    yield Progress(text, ids, True, FinishReason.STOP, chunk.stats, chunk.logprobs)
                                    return
                            if chunk.finished:
                                outcome = chunk.finish_reason.value
                            yield Progress(
                                text,
                                ids,
                                chunk.finished,
                                chunk.finish_reason,
                                chunk.stats if chunk.finished else None,
                                chunk.logprobs,
                            )
                            if chunk.finished:
                                return
                        raise GatewayError(
                            grpc.StatusCode.INTERNAL, "the router closed the stream before the request finished"
                        )
                    except grpc.aio.AioRpcError as exc:
                        code = exc.code()
                        if router_lost(exc) and self.resumes < app.settings.router_resumes and loop.time() < deadline:
                            self.resumes += 1
                            log.warning(
                                "router lost; resuming the request",
                                details=exc.details(),
                                committed=len(self.produced),
                                attempt=self.resumes,
                            )
                            outcome = "unavailable"  # unless a router answers in time
                            await app.reconnect_router(
                                min(deadline, loop.time() + app.settings.router_resume_timeout_s), lost=stub
                            )
                            continue
                        outcome = code.name.lower()
                        log.warning(
                            "request failed at the router", code=code.name, details=exc.details(), resumes=self.resumes
                        )
                        if router_lost(exc):
                            if app.router_stub is stub:
                                app.forget_router()  # rediscover the router next time
                            raise GatewayError(
                                code,
                                f"the router at {app.router_address} was lost ({self.resumes} of "
                                f"{app.settings.router_resumes} resumes spent): {exc.details()}",
                            ) from None
                        raise GatewayError(code, exc.details() or code.name) from None
                    finally:
                        call.cancel()  # no-op when finished; stops the router's work when we stopped early
            finally:
                if clock is not None:
                    clock.end(outcome)
                await app.store.delete_request(gen.request_id)  # retried later by the store while Redis is away
