"""What the router accepts from Submit: every field is checked before a request enters the pool,
so a bad one is refused up front (INVALID_ARGUMENT naming the field) instead of failing later in
a drafter or the verifier, or after some tokens were already streamed. No gRPC here.

The limits come from the verifier the router is connected to (its vocabulary and context);
without them (in-process tests) token ranges and context are not checked.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from common.spec.types import NO_LOGPROBS, InvalidInput, SamplingParams
from services.router.requests import RequestFailed

REQUEST_ID_MAX = 128
_REQUEST_ID = re.compile(r"[A-Za-z0-9\-_.:]+")
DOMAIN_HINT_MAX = 64
_DOMAIN = re.compile(r"[A-Za-z0-9\-_.]*")


@dataclass(frozen=True)
class SubmitLimits:
    """The target's vocabulary size and maximum context (prompt + generated tokens)."""

    vocab_size: int
    max_context: int


def invalid(field: str, message: str) -> RequestFailed:
    return RequestFailed(f"{field}: {message}", "invalid")


def check_submission(
    request_id: str,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_ids: Sequence[int],
    domain_hint: str,
    limits: SubmitLimits | None,
    logprobs: int = NO_LOGPROBS,
    prompt_len: int = 0,
) -> None:
    """Raise :class:`RequestFailed` (kind ``invalid``, the message starting with the field's name)
    at the first field the router cannot serve."""
    if not request_id:
        raise invalid("request_id", "must not be empty")
    if len(request_id) > REQUEST_ID_MAX or not _REQUEST_ID.fullmatch(request_id):
        raise invalid("request_id", f"at most {REQUEST_ID_MAX} characters of ASCII letters, digits and -_.:")
    if not prompt:
        raise invalid("prompt_ids", "must not be empty")
    if not 0 <= prompt_len <= len(prompt):
        raise invalid("prompt_len", f"must be between 0 and the prompt's {len(prompt)} tokens (got {prompt_len})")
    if max_new_tokens < 1:
        raise invalid("max_new_tokens", f"must be >= 1 (got {max_new_tokens})")
    if limits is not None:
        vocab = limits.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid("prompt_ids", f"token id {bad} is outside the target's vocabulary [0, {vocab})")
        if len(prompt) >= limits.max_context:
            raise invalid(
                "prompt_ids", f"{len(prompt)} tokens leave no room in the target's context of {limits.max_context}"
            )
        if len(prompt) + max_new_tokens > limits.max_context:
            raise invalid(
                "max_new_tokens",
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) "
                f"exceeds the target's context of {limits.max_context}",
            )
        bad = next((t for t in stop_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid("stop_token_ids", f"token id {bad} is outside the target's vocabulary [0, {vocab})")
        if logprobs > vocab:
            raise invalid("logprobs", f"{logprobs} alternatives is more than the target's vocabulary of {vocab}")
    if logprobs < NO_LOGPROBS:
        raise invalid("logprobs", f"must be unset or >= 0 (got {logprobs})")
    try:
        sampling.validate()
    except InvalidInput as exc:
        raise RequestFailed(str(exc), "invalid") from None
    if len(domain_hint) > DOMAIN_HINT_MAX or not _DOMAIN.fullmatch(domain_hint):
        raise invalid("domain_hint", f"at most {DOMAIN_HINT_MAX} characters of ASCII letters, digits and -_.")
