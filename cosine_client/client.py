"""Blocking and asyncio clients of the CoSine gateway."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
from tenacity import AsyncRetrying, RetryCallState, Retrying, stop_after_attempt

from common.platform.retry import RetryPolicy
from cosine.v1 import gateway_pb2, gateway_pb2_grpc
from cosine_client.errors import CosineError, from_rpc_error, is_transport_failure
from cosine_client.tls import TlsOptions
from cosine_client.types import FINISH_REASONS, Chunk, Generation, SpecStats, TokenLogprob, Usage

RESUMES = 3  # times a call is sent again after the connection to the gateway broke
RESUME_WAIT_S = 30.0  # longest wait for the gateway to answer again before a resume
# after the gateway answers again, a short pause (jittered: clients cut together come back spread out)
RESUME_RETRY = RetryPolicy(initial_s=0.05, max_s=1.0)
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024), ("grpc.keepalive_time_ms", 30_000)]


def build_request(
    prompt: str | None = None,
    *,
    prompt_ids: Sequence[int] | None = None,
    max_new_tokens: int = 0,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    request_id: str = "",
    domain_hint: str = "",
    resume_ids: Sequence[int] = (),
    logprobs: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    json_object: bool = False,
    json_schema: dict[str, Any] | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    choice: Sequence[str] | None = None,
) -> gateway_pb2.GenerateRequest:
    """``logprobs``: also return the target's log-probability of every generated token, with this
    many most probable alternatives at each position (0: the chosen token only; None: none).

    Penalties (None: off), applied to the target's logits so the output is the penalised target's
    own: ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] (OpenAI's, on the generated
    tokens), ``repetition_penalty`` > 0 (transformers' and vLLM's, on the prompt's and the
    generated tokens; 1: off).

    Structured output, at most one (the output is the constrained target's own): ``json_object``
    (any JSON object), ``json_schema`` (a JSON schema as a dict), ``regex`` (the output matches it
    whole), ``grammar`` (Lark or GBNF) or ``choice`` (the output is one of these strings)."""
    if (prompt is None) == (prompt_ids is None):
        raise ValueError("give exactly one of prompt or prompt_ids")
    req = gateway_pb2.GenerateRequest(
        max_new_tokens=max_new_tokens, stop=list(stop), request_id=request_id, domain_hint=domain_hint
    )
    if prompt is not None:
        req.prompt = prompt
    else:
        req.prompt_ids.ids.extend(int(t) for t in prompt_ids or ())
    if temperature is not None:
        req.temperature = temperature
    if top_p is not None:
        req.top_p = top_p
    if top_k is not None:
        req.top_k = top_k
    if seed is not None:
        req.seed = seed
    if resume_ids:
        req.resume_ids.ids.extend(int(t) for t in resume_ids)
    if logprobs is not None:
        req.logprobs = logprobs
    if presence_penalty is not None:
        req.presence_penalty = presence_penalty
    if frequency_penalty is not None:
        req.frequency_penalty = frequency_penalty
    if repetition_penalty is not None:
        req.repetition_penalty = repetition_penalty
    constraints = [
        (kind, spec)
        for kind, spec, given in (
            ("json_object", "", json_object),
            ("json_schema", json.dumps(json_schema) if json_schema is not None else "", json_schema is not None),
            ("regex", regex or "", regex is not None),
            ("grammar", grammar or "", grammar is not None),
            ("choice", json.dumps(list(choice or ())), choice is not None),
        )
        if given
    ]
    if len(constraints) > 1:
        raise ValueError("give at most one of json_object, json_schema, regex, grammar or choice")
    if constraints:
        req.constraint.kind, req.constraint.spec = constraints[0]
    return req


def resumed(req: gateway_pb2.GenerateRequest, attempt: int, received: Sequence[int]) -> gateway_pb2.GenerateRequest:
    """The request to send again after a broken connection: the tokens already received go in
    ``resume_ids``; a client-chosen id gets a suffix (the lost gateway's claim on it may linger)."""
    again = gateway_pb2.GenerateRequest()
    again.CopyFrom(req)
    if req.request_id:
        again.request_id = f"{req.request_id[:120]}.r{attempt}"
    del again.resume_ids.ids[:]
    again.resume_ids.ids.extend(received)
    return again


def all_received(req: gateway_pb2.GenerateRequest, received: Sequence[int], request_id: str) -> Chunk | None:
    """After a broken connection: the chunk that ends the stream when every token the request may
    generate was already received (the connection broke before the final message), else None;
    asking the gateway for nothing more would be refused."""
    if req.max_new_tokens > 0 and len(received) >= req.max_new_tokens:
        return Chunk(request_id=request_id, text="", token_ids=(), finished=True, finish_reason="length")
    return None


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.001, deadline - time.monotonic())


def _generation(reply: gateway_pb2.GenerateResponse, elapsed_s: float) -> Generation:
    return Generation(
        request_id=reply.request_id,
        text=reply.text,
        token_ids=tuple(reply.token_ids),
        finish_reason=FINISH_REASONS.get(reply.finish_reason, "unspecified"),
        stats=SpecStats.from_pb(reply.stats),
        usage=Usage(reply.usage.prompt_tokens, reply.usage.completion_tokens),
        elapsed_s=elapsed_s,
        logprobs=tuple(TokenLogprob.from_pb(e) for e in reply.logprobs),
    )


def _chunk(msg: gateway_pb2.GenerateChunk) -> Chunk:
    return Chunk(
        request_id=msg.request_id,
        text=msg.text,
        token_ids=tuple(msg.token_ids),
        finished=msg.finished,
        finish_reason=FINISH_REASONS.get(msg.finish_reason, "") if msg.finished else "",
        stats=SpecStats.from_pb(msg.stats) if msg.finished else None,
        usage=Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens) if msg.finished else None,
        logprobs=tuple(TokenLogprob.from_pb(e) for e in msg.logprobs),
    )


def _broken_connection(state: RetryCallState) -> bool:
    """Send again only when the connection to the gateway broke (see :func:`is_transport_failure`)."""
    exc = state.outcome.exception() if state.outcome is not None else None
    return isinstance(exc, grpc.RpcError) and is_transport_failure(exc, first_attempt=state.attempt_number == 1)


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """``authorization: Bearer <key>`` for a key given, else ``$COSINE_API_KEY``, else nothing."""
    key = os.environ.get("COSINE_API_KEY", "") if api_key is None else api_key
    return (("authorization", f"Bearer {key}"),) if key else ()


class Client:
    """Blocking client. ``timeout`` (seconds) is the default deadline of every call; ``api_key``
    (default ``$COSINE_API_KEY``) is sent as ``authorization: Bearer <key>``.

    TLS: ``tls_ca`` (or ``$COSINE_TLS_CA``) dials TLS and checks the gateway against that CA;
    ``tls=True`` alone uses the system's roots; ``tls_cert``/``tls_key`` add a client certificate
    for a gateway that requires one; ``tls=False`` forces plaintext (see :mod:`cosine_client.tls`)."""

    def __init__(
        self,
        address: str,
        timeout: float | None = None,
        channel: grpc.Channel | None = None,
        api_key: str | None = None,
        *,
        tls: bool | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
    ):
        self.address = address
        self.timeout = timeout
        self._metadata = auth_metadata(api_key)
        self.tls = TlsOptions.resolve(tls, tls_ca, tls_cert, tls_key, tls_server_name)
        self._channel = channel or self.tls.channel(address, CHANNEL_OPTIONS)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    def _wait_for_gateway(self, deadline: float | None) -> None:
        wait = RESUME_WAIT_S if deadline is None else min(RESUME_WAIT_S, _remaining(deadline) or 0.0)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=wait)
        except grpc.FutureTimeoutError:
            pass  # the next call fails and says why

    def _attempts(self, resume: int, deadline: float | None) -> Retrying:
        """The call, then up to ``resume`` more after a broken connection, each once the gateway answers again."""

        def pause(seconds: float) -> None:
            self._wait_for_gateway(deadline)
            time.sleep(seconds)

        return RESUME_RETRY.retrying_sync(retry=_broken_connection, stop=stop_after_attempt(resume + 1), sleep=pause)

    def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, resume: int = RESUMES, **kwargs: Any
    ) -> Generation:
        """One request, the whole answer at once. When the connection to the gateway breaks (it
        died or restarts), the request is sent again, up to ``resume`` times."""
        req = build_request(prompt, **kwargs)
        t0 = time.perf_counter()
        timeout = timeout or self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for attempt in self._attempts(resume, deadline):
                with attempt:
                    again = attempt.retry_state.attempt_number - 1
                    reply = self._stub.Generate(
                        req if not again else resumed(req, again, ()),
                        timeout=_remaining(deadline),
                        metadata=self._metadata,
                    )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return _generation(reply, time.perf_counter() - t0)

    def stream(
        self, prompt: str | None = None, *, timeout: float | None = None, resume: int = RESUMES, **kwargs: Any
    ) -> Iterator[Chunk]:
        """The answer as it is generated. When the connection to the gateway breaks, the stream
        resumes (up to ``resume`` times) after the tokens already received: none is repeated or lost."""
        req = build_request(prompt, **kwargs)
        timeout = timeout or self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        received: list[int] = list(req.resume_ids.ids)
        request_id = req.request_id
        try:
            for attempt in self._attempts(resume, deadline):
                with attempt:
                    again = attempt.retry_state.attempt_number - 1
                    done = all_received(req, received, request_id) if again else None
                    if done is not None:
                        yield done
                        return
                    call = self._stub.GenerateStream(
                        req if not again else resumed(req, again, received),
                        timeout=_remaining(deadline),
                        metadata=self._metadata,
                    )
                    try:
                        for msg in call:
                            chunk = _chunk(msg)
                            received.extend(chunk.token_ids)
                            request_id = chunk.request_id or request_id
                            yield chunk
                    finally:
                        call.cancel()  # no-op when finished; frees the server side when the caller stops early
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client; use inside a running event loop. Takes the same TLS arguments as :class:`Client`."""

    def __init__(
        self,
        address: str,
        timeout: float | None = None,
        api_key: str | None = None,
        *,
        tls: bool | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
    ):
        self.address = address
        self.timeout = timeout
        self._metadata = auth_metadata(api_key)
        self.tls = TlsOptions.resolve(tls, tls_ca, tls_cert, tls_key, tls_server_name)
        self._channel = self.tls.aio_channel(address, CHANNEL_OPTIONS)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    async def _wait_for_gateway(self, deadline: float | None) -> None:
        wait = RESUME_WAIT_S if deadline is None else min(RESUME_WAIT_S, _remaining(deadline) or 0.0)
        try:
            await asyncio.wait_for(self._channel.channel_ready(), wait)
        except asyncio.TimeoutError:
            pass  # the next call fails and says why

    def _attempts(self, resume: int, deadline: float | None) -> AsyncRetrying:
        """As :meth:`Client._attempts`."""

        async def pause(seconds: float) -> None:
            await self._wait_for_gateway(deadline)
            await asyncio.sleep(seconds)

        return RESUME_RETRY.retrying(retry=_broken_connection, stop=stop_after_attempt(resume + 1), sleep=pause)

    async def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, resume: int = RESUMES, **kwargs: Any
    ) -> Generation:
        """As :meth:`Client.generate`: sent again (up to ``resume`` times) when the connection breaks."""
        req = build_request(prompt, **kwargs)
        t0 = time.perf_counter()
        timeout = timeout or self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            async for attempt in self._attempts(resume, deadline):
                with attempt:
                    again = attempt.retry_state.attempt_number - 1
                    reply = await self._stub.Generate(
                        req if not again else resumed(req, again, ()),
                        timeout=_remaining(deadline),
                        metadata=self._metadata,
                    )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return _generation(reply, time.perf_counter() - t0)

    async def stream(
        self, prompt: str | None = None, *, timeout: float | None = None, resume: int = RESUMES, **kwargs: Any
    ) -> AsyncIterator[Chunk]:
        """As :meth:`Client.stream`: resumes after the tokens already received when the connection breaks."""
        req = build_request(prompt, **kwargs)
        timeout = timeout or self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        received: list[int] = list(req.resume_ids.ids)
        request_id = req.request_id
        try:
            async for attempt in self._attempts(resume, deadline):
                with attempt:
                    again = attempt.retry_state.attempt_number - 1
                    done = all_received(req, received, request_id) if again else None
                    if done is not None:
                        yield done
                        return
                    call = self._stub.GenerateStream(
                        req if not again else resumed(req, again, received),
                        timeout=_remaining(deadline),
                        metadata=self._metadata,
                    )
                    try:
                        async for msg in call:
                            chunk = _chunk(msg)
                            received.extend(chunk.token_ids)
                            request_id = chunk.request_id or request_id
                            yield chunk
                    finally:
                        call.cancel()
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["Client", "AsyncClient", "CosineError", "TlsOptions", "build_request"]
