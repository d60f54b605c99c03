"""Fuzzing the router's Submit (the gateway's internal call) over loopback gRPC, with the real
drafters and verifier behind it. Valid submissions stream committed tokens; a submission broken
in one field is refused with INVALID_ARGUMENT naming it; anything else is served or refused by
field name. The fuzzer reads at most a few chunks, then cancels (a client that went away), and
checks that the request left nothing behind in the router, the drafters or the verifier."""

from __future__ import annotations

import pytest
from hypothesis import given

from cosine.v1 import router_pb2

from .harness import FUZZER_CANCELLED, Outcome, RawRpc, check_status, fuzz_targets, share_of_examples
from .stack import FuzzStack
from .strategies import (
    BAD_SUBMIT_FIELDS,
    RAW_SUBMIT,
    SUBMIT_FIELDS,
    VALID_SUBMIT,
    WILD_SUBMIT,
    SubmitSpec,
    one_bad_submit,
)

MAX_CHUNKS = 3


@pytest.fixture(scope="module")
def submit(channels) -> RawRpc:
    return RawRpc(channels["router"], "/cosine.v1.Router/Submit", False, True)


def run_case(
    stack: FuzzStack, submit: RawRpc, case: SubmitSpec | bytes, allowed: set[str], expect_field: str | None = None
) -> Outcome:
    outcome = submit.send(case if isinstance(case, bytes) else case.to_pb(), max_replies=MAX_CHUNKS)
    check_status(outcome, {*allowed, FUZZER_CANCELLED} if "OK" in allowed else allowed, SUBMIT_FIELDS, expect_field)
    chunks = [router_pb2.TokenChunk.FromString(r) for r in outcome.replies]
    if outcome.code == "OK":
        assert chunks and chunks[-1].finished, "a stream that ended OK ends with its finished chunk"
    if isinstance(case, SubmitSpec) and chunks:
        generated = [t for c in chunks for t in c.token_ids]
        assert all(c.request_id == case.request_id for c in chunks)
        assert len(generated) <= case.max_new_tokens
    stack.assert_clean()
    return outcome


@fuzz_targets("router/valid")
@given(case=VALID_SUBMIT)
def test_valid_submissions_are_served(stack, submit, fuzz_report, case):
    fuzz_report.case("router/valid")
    run_case(stack, submit, case, {"OK"})


@fuzz_targets("router/one-bad-field")
@pytest.mark.parametrize("field", BAD_SUBMIT_FIELDS)
def test_a_bad_field_is_refused_by_name(stack, submit, fuzz_report, field):
    @share_of_examples(len(BAD_SUBMIT_FIELDS))
    @given(case=one_bad_submit(field))
    def run(case):
        fuzz_report.case("router/one-bad-field")
        run_case(stack, submit, case, {"INVALID_ARGUMENT"}, case.expect_field)

    run()


@fuzz_targets("router/wild")
@given(case=WILD_SUBMIT)
def test_any_submission_is_served_or_refused_by_name(stack, submit, fuzz_report, case):
    fuzz_report.case("router/wild")
    run_case(stack, submit, case, {"OK", "INVALID_ARGUMENT"})


@fuzz_targets("router/raw-bytes")
@given(case=RAW_SUBMIT)
def test_any_bytes_are_served_or_refused_by_name(stack, submit, fuzz_report, case):
    fuzz_report.case("router/raw-bytes")
    run_case(stack, submit, case, {"OK", "INVALID_ARGUMENT"})


def test_a_duplicate_request_id_is_refused_while_the_first_runs(stack, submit):
    """Two submissions with one id: the second gets ALREADY_EXISTS naming request_id and the first
    goes on (it is cancelled by the fuzzer after its first chunk); nothing is left behind."""
    first = submit._call(SubmitSpec(request_id="dup", prompt_ids=(5, 6, 7), max_new_tokens=200).to_pb(), timeout=30)
    try:
        chunk = router_pb2.TokenChunk.FromString(next(first))
        assert chunk.request_id == "dup" and not chunk.finished
        second = submit.send(SubmitSpec(request_id="dup", prompt_ids=(1,), max_new_tokens=1).to_pb())
        assert second.code == "ALREADY_EXISTS" and second.field == "request_id", second
        assert router_pb2.TokenChunk.FromString(next(first)).request_id == "dup"  # the first one goes on
    finally:
        first.cancel()
    stack.assert_clean()
