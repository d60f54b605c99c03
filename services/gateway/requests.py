"""Request validation, incremental detokenization and stop strings for the gateway (no gRPC here)."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers.decoders import DecodeStream

from common.spec.types import NO_LOGPROBS, Constraint, InvalidInput, SamplingParams

REQUEST_ID_MAX = 128


class InvalidRequest(ValueError):
    """A request field is invalid. ``field`` names it for the client."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class Limits:
    default_max_new_tokens: int
    max_new_tokens_limit: int
    max_prompt_tokens: int
    max_stop_strings: int
    vocab_size: int
    max_context: int
    max_logprobs: int = 20  # most alternatives a request may ask log-probabilities of


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: everything downstream may trust it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    domain_hint: str = ""
    resume_ids: tuple[int, ...] = ()  # already delivered by an earlier gateway (a resumed stream)
    logprobs: int = NO_LOGPROBS  # the target's log-probabilities with this many alternatives (NO_LOGPROBS: none)
    presence_penalty: float = 0.0  # penalties on the target's logits (common.spec.penalties); 0, 0, 1: off
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    constraint: Constraint | None = None  # structured output (common.spec.grammar); None: anything

    def sampling(self) -> SamplingParams:
        """How the target picks this request's tokens (what the router and verifier are given)."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            constraint=self.constraint,
        )

    def params(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": list(self.stop),
            "domain_hint": self.domain_hint,
            "logprobs": self.logprobs,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "constraint": None if self.constraint is None else [self.constraint.kind, self.constraint.spec],
        }


@dataclass(frozen=True)
class RawRequest:
    """The fields of a GenerateRequest as plain values (the servicer fills this from protobuf)."""

    prompt: str | None
    prompt_ids: Sequence[int] | None
    max_new_tokens: int
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: Sequence[str]
    request_id: str
    domain_hint: str
    unknown_fields: Sequence[int] = ()
    resume_ids: Sequence[int] = ()
    logprobs: int | None = None  # None: no log-probabilities
    presence_penalty: float | None = None  # None: 0
    frequency_penalty: float | None = None  # None: 0
    repetition_penalty: float | None = None  # None: 1 (off)
    constraint: Constraint | None = None  # structured output (None: anything)
    constraint_field: str = "constraint"  # the request field the constraint came in, for errors


def _penalties(raw: RawRequest) -> tuple[float, float, float]:
    """The penalties of ``raw`` with their defaults; raises InvalidRequest naming a bad one."""
    values = []
    for name in ("presence_penalty", "frequency_penalty"):
        value = 0.0 if getattr(raw, name) is None else float(getattr(raw, name))
        if not -2.0 <= value <= 2.0:  # also catches NaN
            raise InvalidRequest(name, f"must be between -2 and 2 (got {getattr(raw, name)})")
        values.append(value)
    repetition = 1.0 if raw.repetition_penalty is None else float(raw.repetition_penalty)
    if not 0.0 < repetition < math.inf:
        raise InvalidRequest("repetition_penalty", f"must be a finite number > 0 (got {raw.repetition_penalty})")
    return values[0], values[1], repetition


def _constraint(raw: RawRequest) -> Constraint | None:
    """``raw``'s constraint, its kind and spec checked (whether it compiles: ``GatewayApp.admit``)."""
    if raw.constraint is None:
        return None
    try:
        raw.constraint.validate()
    except InvalidInput as exc:
        raise InvalidRequest(raw.constraint_field, str(exc).removeprefix("sampling.constraint.")) from None
    return raw.constraint


def validate(raw: RawRequest, limits: Limits, tokenize: Callable[[str], list[int]]) -> GenerationRequest:
    """Check every field; raise InvalidRequest naming the first bad one."""
    if raw.unknown_fields:
        numbers = ", ".join(str(n) for n in sorted(raw.unknown_fields))
        raise InvalidRequest(
            "request",
            f"unknown field number(s) {numbers}: this gateway speaks cosine.v1; upgrade the gateway or drop the "
            "field(s)",
        )
    request_id = raw.request_id or uuid.uuid4().hex
    if len(request_id) > REQUEST_ID_MAX or not all(ch.isalnum() or ch in "-_.:" for ch in request_id):
        raise InvalidRequest("request_id", f"at most {REQUEST_ID_MAX} characters of letters, digits and -_.:")
    if raw.prompt is not None:
        if not raw.prompt.strip():
            raise InvalidRequest("prompt", "must not be empty")
        prompt_ids = tuple(tokenize(raw.prompt))
    elif raw.prompt_ids is not None:
        prompt_ids = tuple(int(t) for t in raw.prompt_ids)
        if not prompt_ids:
            raise InvalidRequest("prompt_ids", "must not be empty")
        bad = next((t for t in prompt_ids if t < 0 or t >= limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                "prompt_ids", f"token id {bad} is outside the target's vocabulary (0..{limits.vocab_size - 1})"
            )
    else:
        raise InvalidRequest("prompt", "give either prompt (text) or prompt_ids")
    if len(prompt_ids) > limits.max_prompt_tokens:
        name = "prompt" if raw.prompt is not None else "prompt_ids"
        raise InvalidRequest(name, f"{len(prompt_ids)} tokens is more than the limit of {limits.max_prompt_tokens}")
    max_new = raw.max_new_tokens or limits.default_max_new_tokens
    if not 1 <= max_new <= limits.max_new_tokens_limit:
        raise InvalidRequest("max_new_tokens", f"must be between 1 and {limits.max_new_tokens_limit} (got {max_new})")
    if len(prompt_ids) + max_new > limits.max_context:
        raise InvalidRequest(
            "max_new_tokens",
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new}) exceeds the target's context of "
            f"{limits.max_context}",
        )
    temperature = 0.0 if raw.temperature is None else float(raw.temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest("temperature", f"must be >= 0 (got {raw.temperature})")
    top_p = 1.0 if raw.top_p is None or raw.top_p == 0 else float(raw.top_p)
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise InvalidRequest("top_p", f"must be in (0, 1] (got {raw.top_p})")
    top_k = 0 if raw.top_k is None else int(raw.top_k)
    if not 0 <= top_k < 2**32:
        raise InvalidRequest("top_k", f"must be between 0 and 2^32 - 1 (got {raw.top_k})")
    if raw.seed is not None and not 0 <= int(raw.seed) < 2**64:
        raise InvalidRequest("seed", f"must be between 0 and 2^64 - 1 (got {raw.seed})")
    resume_ids = tuple(int(t) for t in raw.resume_ids)
    bad = next((t for t in resume_ids if t < 0 or t >= limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            "resume_ids", f"token id {bad} is outside the target's vocabulary (0..{limits.vocab_size - 1})"
        )
    if len(resume_ids) >= max_new:
        raise InvalidRequest(
            "resume_ids",
            f"{len(resume_ids)} tokens already received leave nothing of max_new_tokens ({max_new}) to generate",
        )
    stops = tuple(raw.stop)
    if len(stops) > limits.max_stop_strings:
        raise InvalidRequest("stop", f"at most {limits.max_stop_strings} stop strings")
    if any(not s for s in stops):
        raise InvalidRequest("stop", "stop strings must not be empty")
    logprobs = NO_LOGPROBS if raw.logprobs is None else int(raw.logprobs)
    if raw.logprobs is not None and not 0 <= logprobs <= limits.max_logprobs:
        raise InvalidRequest("logprobs", f"must be between 0 and {limits.max_logprobs} (got {raw.logprobs})")
    presence, frequency, repetition = _penalties(raw)
    return GenerationRequest(
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=raw.seed,
        stop=stops,
        domain_hint=raw.domain_hint,
        resume_ids=resume_ids,
        logprobs=logprobs,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        constraint=_constraint(raw),
    )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas with the tokenizer's own incremental
    decoder (:class:`tokenizers.decoders.DecodeStream`), which holds back a character split over
    several tokens (multi-byte UTF-8, byte fallback) until it is complete.

    Ids are stepped one at a time whatever chunks they arrive in, so the text given out after a
    token depends only on the ids so far. That is what lets a resumed stream go on without a
    duplicate: a detokenizer primed with the ids the client already has stands where the one that
    served them stood. (Stepped a chunk at a time, a chunk ending inside a character holds back
    the text before it too, and a detokenizer primed with the same ids in one step would then
    send that text a second time.)"""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        # a transformers fast tokenizer wraps the ``tokenizers.Tokenizer`` that DecodeStream steps with
        self._tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self._emitted_chars = 0

    def push(self, new_ids: Sequence[int]) -> str:
        pieces = []
        for token in new_ids:
            self.ids.append(int(token))
            piece = self._stream.step(self._tokenizer, int(token))
            if piece:
                pieces.append(piece)
        delta = "".join(pieces)
        self._emitted_chars += len(delta)
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back (a truly broken byte sequence included, as the
        tokenizer's own decode writes it)."""
        text = self._tokenizer.decode(self.ids, skip_special_tokens=self._skip_special_tokens)
        delta = text[self._emitted_chars :]
        self._emitted_chars = len(text)
        return delta


@dataclass
class StopMatcher:
    """Finds stop strings in streamed text. Text that could be the start of a stop string is held
    back until it is known not to be one; the stop string itself is never emitted."""

    stops: tuple[str, ...]
    pending: str = ""
    stopped: bool = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending, self.stopped = self.pending[:cut], "", True
            return out
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
