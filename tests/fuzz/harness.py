"""Transport-neutral pieces of the fuzzers: how a case is sent, what came back, what must hold.

A **target** is anything with ``name`` and ``send(case) -> Outcome``. The gRPC targets speak raw
bytes (:class:`RawRpc`), so the same path carries well-formed messages, messages with unknown
fields and random bytes. An HTTP target (JSON bodies posted to ``/v1/completions``) is one more
class with ``send`` that maps HTTP statuses onto the same :class:`Outcome` codes (400 ->
``INVALID_ARGUMENT``); the strategies and checks stay as they are.

Every call is bounded by a deadline: a call that runs past it is a hang, and fails the case.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from hypothesis import settings

CALL_TIMEOUT_S = 30.0
FUZZER_CANCELLED = "FUZZER_CANCELLED"  # the fuzzer read enough of a stream and cancelled it itself


@dataclass(frozen=True)
class Outcome:
    """The end of one call: a status code name (``OK``, ``INVALID_ARGUMENT``...), its details and
    the replies received before it (raw bytes)."""

    code: str
    details: str = ""
    replies: tuple[bytes, ...] = ()

    @property
    def field(self) -> str:
        """The field the details name (``items[2].tree.parents: ...`` -> ``items.tree.parents``)."""
        return field_of(self.details)

    def __str__(self) -> str:
        return f"{self.code}: {self.details!r} after {len(self.replies)} replies"


def field_of(message: str) -> str:
    head = message.split(": ", 1)[0] if ": " in message else ""
    return re.sub(r"\[\d+\]", "", head)


class RawRpc:
    """One gRPC method spoken in raw bytes over a real channel."""

    def __init__(self, channel: grpc.Channel, path: str, request_streaming: bool, response_streaming: bool):
        self.path = path
        self.request_streaming = request_streaming
        self.response_streaming = response_streaming
        kind = {
            (False, False): channel.unary_unary,
            (False, True): channel.unary_stream,
            (True, False): channel.stream_unary,
            (True, True): channel.stream_stream,
        }
        self._call = kind[request_streaming, response_streaming](path)

    def send(
        self, request: bytes | Sequence[bytes], timeout_s: float = CALL_TIMEOUT_S, max_replies: int | None = None
    ) -> Outcome:
        """Send one message (or a stream of them) and collect what comes back. ``max_replies``: read
        that many replies of a response stream, then cancel the call (a client that went away)."""
        payload = iter(list(request)) if self.request_streaming else request
        replies: list[bytes] = []
        try:
            if not self.response_streaming:
                return Outcome("OK", "", (self._call(payload, timeout=timeout_s),))
            call = self._call(payload, timeout=timeout_s)
            for reply in call:
                replies.append(reply)
                if max_replies is not None and len(replies) >= max_replies:
                    call.cancel()
                    return Outcome(FUZZER_CANCELLED, "", tuple(replies))
            return Outcome("OK", "", tuple(replies))
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.CANCELLED and max_replies is not None and len(replies) >= max_replies:
                return Outcome(FUZZER_CANCELLED, "", tuple(replies))
            return Outcome(code.name, exc.details() or "", tuple(replies))


# ---- checks --------------------------------------------------------------------------------


def check_status(
    outcome: Outcome, allowed: Iterable[str], fields: Iterable[str], expect_field: str | None = None
) -> None:
    """The call ended with an allowed status; a refusal names one of ``fields`` (``expect_field``
    when the case was built bad in that one field). Hangs and INTERNAL/UNKNOWN fail here."""
    allowed, fields = set(allowed), set(fields)
    assert outcome.code != "DEADLINE_EXCEEDED", f"hang: no answer within the deadline ({outcome})"
    assert outcome.code in allowed, f"unexpected status {outcome}"
    if outcome.code == "INVALID_ARGUMENT":
        assert outcome.field in fields, f"the refusal names no known field: {outcome}"
        if expect_field is not None:
            assert outcome.field == expect_field, f"expected a refusal naming {expect_field!r}: {outcome}"
    elif expect_field is not None:
        assert outcome.code == "INVALID_ARGUMENT", f"a bad {expect_field!r} was not refused: {outcome}"


def check_message_names_field(message: str, fields: Iterable[str]) -> None:
    assert field_of(message) in set(fields), f"error names no known field: {message!r}"


# ---- report --------------------------------------------------------------------------------


@dataclass
class FuzzReport:
    """Cases run per target in this session and each target's result, printed at the end."""

    profile: str = "ci"
    cases: Counter[str] = field(default_factory=Counter)
    failed: set[str] = field(default_factory=set)

    def case(self, target: str) -> None:
        self.cases[target] += 1

    def lines(self) -> list[str]:
        out = []
        for target in sorted(self.cases):
            result = "FAILED" if target in self.failed else "passed"
            out.append(f"{target:<34} {self.cases[target]:>7} cases  {result}")
        out.append(f"{'total':<34} {sum(self.cases.values()):>7} cases  {'FAILED' if self.failed else 'passed'}")
        return out


def fuzz_targets(*names: str) -> Callable[[Any], Any]:
    """Mark a test as a fuzzer of ``names``: a failure of the test counts against them in the report."""

    def mark(fn: Any) -> Any:
        fn.fuzz_targets = names
        return fn

    return mark


def share_of_examples(parts: int) -> settings:
    """Settings for one of ``parts`` parametrized variants of a target, so that the target as a
    whole runs about the profile's ``max_examples`` (at least 10 per variant)."""
    return settings(max_examples=max(10, settings.default.max_examples // parts))
