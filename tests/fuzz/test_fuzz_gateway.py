"""Fuzzing the public API: GenerateRequest through a real gateway (and the router, drafters and
verifier behind it) over loopback gRPC, unary and streaming. Valid requests succeed; a request
broken in one field is refused with INVALID_ARGUMENT naming that field; anything else (any
unicode, extreme numbers, NaN/inf, unknown fields, random bytes) succeeds or is refused naming a
field. Never a crash or a hang, and after every case no request state is left anywhere."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cosine.v1 import common_pb2, gateway_pb2

from .harness import FUZZER_CANCELLED, Outcome, RawRpc, check_status, fuzz_targets, share_of_examples
from .stack import GATEWAY_LIMITS, FuzzStack
from .strategies import (
    BAD_GENERATE_FIELDS,
    GATEWAY_FIELDS,
    RAW_GENERATE,
    VALID_GENERATE,
    WILD_GENERATE,
    GenerateSpec,
    one_bad_generate,
)

FINISHED = {common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_EOS, common_pb2.FINISH_REASON_STOP}


@dataclass
class GrpcGateway:
    """The gateway over gRPC, unary (Generate) or streaming (GenerateStream)."""

    rpc: RawRpc
    streaming: bool

    @property
    def name(self) -> str:
        return self.rpc.path

    def send(self, case: GenerateSpec | bytes) -> Outcome:
        return self.rpc.send(case if isinstance(case, bytes) else case.to_pb())

    def check_success(self, case: GenerateSpec | bytes, outcome: Outcome) -> None:
        """A generation that succeeded is whole: finished, usage adds up, within max_new_tokens."""
        limit = GATEWAY_LIMITS["max_new_tokens_limit"]
        if self.streaming:
            chunks = [gateway_pb2.GenerateChunk.FromString(r) for r in outcome.replies]
            assert chunks and chunks[-1].finished and chunks[-1].finish_reason in FINISHED, chunks[-1:]
            assert not any(c.finished for c in chunks[:-1])
            ids = [t for c in chunks for t in c.token_ids]
            assert chunks[-1].usage.completion_tokens == len(ids) <= limit
            request_id = chunks[0].request_id
        else:
            reply = gateway_pb2.GenerateResponse.FromString(outcome.replies[0])
            assert reply.finish_reason in FINISHED and reply.usage.completion_tokens == len(reply.token_ids) <= limit, (
                reply
            )
            request_id = reply.request_id
        if isinstance(case, GenerateSpec) and case.request_id:
            assert request_id == case.request_id


@pytest.fixture(scope="module")
def gateways(channels) -> list[GrpcGateway]:
    """Every front door of the gateway a case may take (an HTTP target would be one more entry)."""
    return [
        GrpcGateway(RawRpc(channels["gateway"], "/cosine.v1.Gateway/Generate", False, False), False),
        GrpcGateway(RawRpc(channels["gateway"], "/cosine.v1.Gateway/GenerateStream", False, True), True),
    ]


def run_case(
    stack: FuzzStack,
    gateways: list[GrpcGateway],
    data: st.DataObject,
    case: GenerateSpec | bytes,
    allowed: set[str],
    expect_field: str | None = None,
) -> None:
    gateway = data.draw(st.sampled_from(gateways), label="gateway")
    outcome = gateway.send(case)
    assert outcome.code != FUZZER_CANCELLED
    check_status(outcome, allowed, GATEWAY_FIELDS, expect_field)
    if outcome.code == "OK":
        gateway.check_success(case, outcome)
    stack.assert_clean()


@fuzz_targets("gateway/valid")
@given(case=VALID_GENERATE, data=st.data())
def test_valid_requests_are_served(stack, gateways, fuzz_report, case, data):
    fuzz_report.case("gateway/valid")
    run_case(stack, gateways, data, case, {"OK"})


@fuzz_targets("gateway/one-bad-field")
@pytest.mark.parametrize("field", BAD_GENERATE_FIELDS)
def test_a_bad_field_is_refused_by_name(stack, gateways, fuzz_report, field):
    @share_of_examples(len(BAD_GENERATE_FIELDS))
    @given(case=one_bad_generate(field), data=st.data())
    def run(case, data):
        fuzz_report.case("gateway/one-bad-field")
        run_case(stack, gateways, data, case, {"INVALID_ARGUMENT"}, case.expect_field)

    run()


@fuzz_targets("gateway/wild")
@given(case=WILD_GENERATE, data=st.data())
def test_any_request_is_served_or_refused_by_name(stack, gateways, fuzz_report, case, data):
    fuzz_report.case("gateway/wild")
    run_case(stack, gateways, data, case, {"OK", "INVALID_ARGUMENT"})


@fuzz_targets("gateway/raw-bytes")
@given(case=RAW_GENERATE, data=st.data())
def test_any_bytes_are_served_or_refused_by_name(stack, gateways, fuzz_report, case, data):
    fuzz_report.case("gateway/raw-bytes")
    run_case(stack, gateways, data, case, {"OK", "INVALID_ARGUMENT"})


def test_stack_is_reachable(channels):
    """The fuzzers' own premise: the gateway answers a plain valid request."""
    reply = gateway_pb2.GenerateResponse.FromString(
        RawRpc(channels["gateway"], "/cosine.v1.Gateway/Generate", False, False)
        .send(GenerateSpec(prompt="def f(x):", max_new_tokens=3).to_pb())
        .replies[0]
    )
    assert 1 <= len(reply.token_ids) <= 3 and isinstance(grpc.StatusCode.OK, grpc.StatusCode)
