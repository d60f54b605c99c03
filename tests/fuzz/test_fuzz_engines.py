"""Fuzzing the internal streams the router drives: Verify on the verifier and Draft on the
drafter process, over loopback gRPC, with scripts of several messages per stream (well-formed and
malformed items mixed, see engine_cases.py). Each item gets its answer in order, a valid one
succeeds and matches its contract, a bad one is refused with a message naming the field; the
stream never breaks on an item; an unknown drafter ends the stream with NOT_FOUND. Random bytes
end the stream with INVALID_ARGUMENT. When the stream closes, no KV cache is left anywhere."""

from __future__ import annotations

import pytest
from hypothesis import example, given

from cosine.v1 import drafter_pb2, verifier_pb2

from .engine_cases import DRAFT_SCRIPT, DRAFTERS, RAW_DRAFT, RAW_VERIFY, VERIFY_SCRIPT, DrafterModel, VerifierModel
from .harness import RawRpc, check_status, fuzz_targets
from .strategies import field_paths

VERIFY_BATCH_FIELDS = field_paths(verifier_pb2.VerifyBatch)
DRAFT_STEP_FIELDS = field_paths(drafter_pb2.DraftStep)


@pytest.fixture(scope="module")
def verify(channels) -> RawRpc:
    return RawRpc(channels["verifier"], "/cosine.v1.Verifier/Verify", True, True)


@pytest.fixture(scope="module")
def draft(channels) -> RawRpc:
    return RawRpc(channels["drafter"], "/cosine.v1.Drafter/Draft", True, True)


@fuzz_targets("verifier/stream")
# a release refused as a repeat frees nothing: the request stays live and the stream's end must free it
@example(
    script=[
        verifier_pb2.VerifyBatch(
            batch_id=1,
            items=[
                verifier_pb2.VerifyItem(request_id="x", append_ids=[1, 2, 3]),
                verifier_pb2.VerifyItem(request_id="x", release=True),
            ],
        )
    ]
)
@given(script=VERIFY_SCRIPT)
def test_verify_streams_answer_every_item(stack, verify, fuzz_report, script):
    fuzz_report.case("verifier/stream")
    outcome = verify.send([b.SerializeToString() for b in script])
    check_status(outcome, {"OK"}, ())
    assert len(outcome.replies) == len(script)
    model = VerifierModel()
    for batch, raw in zip(script, outcome.replies):
        model.check_batch(batch, verifier_pb2.VerifyResult.FromString(raw))
    stack.assert_clean()


@fuzz_targets("verifier/raw-bytes")
@given(messages=RAW_VERIFY)
def test_verify_streams_of_any_bytes(stack, verify, fuzz_report, messages):
    fuzz_report.case("verifier/raw-bytes")
    outcome = verify.send(messages)
    check_status(outcome, {"OK", "INVALID_ARGUMENT"}, VERIFY_BATCH_FIELDS)
    for raw in outcome.replies:
        assert all(v.error_kind != "internal" for v in verifier_pb2.VerifyResult.FromString(raw).verdicts)
    stack.assert_clean()


@fuzz_targets("drafter/stream")
@example(
    script=[
        drafter_pb2.DraftStep(
            step_id=1,
            drafter_id=DRAFTERS[0],
            items=[
                drafter_pb2.DraftItem(request_id="x", truncate_to=-1, append_ids=[1, 2, 3], top_n=1, chain_len=1),
                drafter_pb2.DraftItem(request_id="x", truncate_to=-1, release=True),
            ],
        )
    ]
)
@given(script=DRAFT_SCRIPT)
def test_draft_streams_answer_every_item(stack, draft, fuzz_report, script):
    fuzz_report.case("drafter/stream")
    outcome = draft.send([s.SerializeToString() for s in script])
    known = [DrafterModel.known_drafters(s) for s in script]
    answered = known.index(False) if False in known else len(script)
    if answered < len(script):  # a step for a drafter this process does not host ends the stream
        check_status(outcome, {"NOT_FOUND"}, ())
        assert outcome.field == "drafter_id", outcome
    else:
        check_status(outcome, {"OK"}, ())
    assert len(outcome.replies) == answered
    model = DrafterModel()
    for step, raw in zip(script, outcome.replies):
        model.check_step(step, drafter_pb2.DraftStepResult.FromString(raw))
    stack.assert_clean()


@fuzz_targets("drafter/raw-bytes")
@given(messages=RAW_DRAFT)
def test_draft_streams_of_any_bytes(stack, draft, fuzz_report, messages):
    fuzz_report.case("drafter/raw-bytes")
    outcome = draft.send(messages)
    check_status(outcome, {"OK", "INVALID_ARGUMENT", "NOT_FOUND"}, DRAFT_STEP_FIELDS)
    stack.assert_clean()
