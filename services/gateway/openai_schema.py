"""The OpenAI-compatible request and response shapes of the gateway's HTTP API (no HTTP here).

Requests are pydantic models (unknown fields are accepted and ignored, as OpenAI clients send
fields a server may not know); :func:`completion_raw` and :func:`chat_raw` turn them into the
gateway's own :class:`RawRequest`, which the same validation as the gRPC API checks. What CoSine
does not implement (echo, logit_bias, suffix, best_of other than n) is refused with the field named
rather than silently ignored. ``presence_penalty`` and ``frequency_penalty`` are OpenAI's,
``repetition_penalty`` (an extension) vLLM's; the target's logits are penalised before acceptance,
so the output is the penalised target's own. ``n`` choices (at most ``--max-n``) are ``n``
independent generations (:mod:`services.gateway.openai_choices`). Log-probabilities
(completions' ``logprobs: int``, chat's ``logprobs: true`` with ``top_logprobs: int``) are the
target's own, at most ``--max-logprobs`` alternatives (:mod:`services.gateway.openai_logprobs`
shapes them). ``response_format`` and vLLM's ``structured_outputs`` constrain the output to a JSON
schema, a regex, a grammar or a choice (:mod:`services.gateway.openai_structured`): the output is
the constrained target's own. Responses are plain dicts in OpenAI's shape,
with a ``speculative_decoding`` object beside ``usage``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.openai_structured import constraint_of
from services.gateway.progress import FinishReason, SpecStats
from services.gateway.requests import InvalidRequest, RawRequest

# Omitted sampling fields take OpenAI's defaults, so a client that works against OpenAI behaves
# the same here: temperature 1 and top_p 1 (ask for temperature 0 for greedy, lossless output).
DEFAULT_TEMPERATURE = 1.0

# The gateway's finish reasons as OpenAI names them (any other: "stop").
FINISH_REASONS = {
    FinishReason.LENGTH: "length",
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.CANCELLED: "abort",
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # an extension, as other open servers offer
    seed: int | None = Field(default=None, ge=0, lt=1 << 64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None  # choices (None: 1)
    presence_penalty: float | None = None  # ranges are checked by the gateway's validation (400 naming the field)
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # an extension, as vLLM offers
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None  # structured output (openai_structured.py)
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension (and guided_*, read from the extras)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(default=None, ge=0)  # alternatives per position (0: the chosen token only)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)


def choices(body: _Common, max_n: int) -> int:
    """How many choices the request asks for; raises InvalidRequest naming ``n`` outside 1..max_n."""
    n = 1 if body.n is None else body.n
    if not 1 <= n <= max_n:
        raise InvalidRequest("n", f"must be between 1 and {max_n} (got {n})")
    return n


def _unsupported(body: _Common) -> None:
    if body.logit_bias:
        raise InvalidRequest("logit_bias", "not supported")


def _stops(stop: str | list[str] | None) -> list[str]:
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


def completion_raw(body: CompletionRequest, request_id: str, max_logprobs: int) -> RawRequest:
    _unsupported(body)
    if body.logprobs is not None and body.logprobs > max_logprobs:
        raise InvalidRequest("logprobs", f"at most {max_logprobs} alternatives per position (got {body.logprobs})")
    if body.echo:
        raise InvalidRequest("echo", "not supported")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise InvalidRequest("best_of", "only best_of equal to n is supported (every candidate is returned)")
    if body.suffix:
        raise InvalidRequest("suffix", "not supported")
    prompt, prompt_ids = None, None
    if isinstance(body.prompt, str):
        prompt = body.prompt
    elif body.prompt and all(isinstance(p, str) for p in body.prompt):
        if len(body.prompt) != 1:
            raise InvalidRequest("prompt", "give one prompt per request (a batch of prompts is not supported)")
        prompt = str(body.prompt[0])
    else:
        prompt_ids = [int(t) for t in body.prompt]
    return _raw(body, request_id, body.max_tokens, prompt=prompt, prompt_ids=prompt_ids, logprobs=body.logprobs)


def chat_raw(
    body: ChatCompletionRequest,
    request_id: str,
    render: Callable[[list[dict[str, str]]], list[int]],
    max_logprobs: int,
) -> RawRequest:
    """``render`` applies the target's chat template (with the generation prompt) and tokenizes."""
    _unsupported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs", "needs logprobs: true")
    if body.top_logprobs is not None and body.top_logprobs > max_logprobs:
        raise InvalidRequest(
            "top_logprobs", f"at most {max_logprobs} alternatives per position (got {body.top_logprobs})"
        )
    messages = []
    for m in body.messages:
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or ())
        messages.append({"role": m.role, "content": text})
    max_tokens = body.max_completion_tokens or body.max_tokens
    return _raw(body, request_id, max_tokens, prompt=None, prompt_ids=render(messages), logprobs=asked_logprobs(body))


def asked_logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The alternatives per position a request asked the log-probabilities of (0: the chosen token
    only), or None when it asked for none."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def _raw(
    body: _Common,
    request_id: str,
    max_tokens: int | None,
    *,
    prompt: str | None,
    prompt_ids: list[int] | None,
    logprobs: int | None,
) -> RawRequest:
    constraint, constraint_field = constraint_of(body)
    return RawRequest(
        prompt=prompt,
        prompt_ids=prompt_ids,
        max_new_tokens=max_tokens or 0,
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=_stops(body.stop),
        request_id=request_id,
        domain_hint="",
        logprobs=logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        constraint=constraint,
        constraint_field=constraint_field or "constraint",
    )


def spec_decoding(stats: SpecStats | None) -> dict[str, Any] | None:
    """Per-request speculative-decoding figures (beside ``usage``)."""
    if stats is None:
        return None
    return {
        "rounds": stats.rounds,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "mean_accepted_tokens_per_round": round(stats.mean_accepted_len, 4),
        "acceptance_rate": round(stats.accepted_tokens / stats.draft_tokens, 4) if stats.draft_tokens else 0.0,
        "drafters_used": list(stats.drafters_used),
        "accepted_by_drafter": dict(stats.accepted_by_drafter),
        **({"grammar_pruned_tokens": stats.grammar_pruned_tokens} if stats.grammar_pruned_tokens else {}),
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(kind: str, response_id: str, model: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = {"id": response_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
