"""When the SDK sends a call again: only after the connection broke, never for a refusal the
gateway answered on purpose, and never for a first call that found nothing listening."""

import grpc
import pytest

from cosine_client.client import all_received, build_request, resumed
from cosine_client.errors import is_transport_failure


class FakeError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("details,first,expected", [
    ("Socket closed", True, True),
    ("recvmsg:Connection reset by peer", False, True),
    ("Too many pings", True, True),
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused", True, False),
    ("failed to connect to all addresses", False, True),
    ("no verifier is registered (and no --tokenizer given): cannot tokenize", False, False),
])
def test_transport_failures(details, first, expected):
    assert is_transport_failure(FakeError(grpc.StatusCode.UNAVAILABLE, details), first_attempt=first) is expected


def test_other_codes_are_never_resumed():
    assert not is_transport_failure(FakeError(grpc.StatusCode.INTERNAL, "Socket closed"))


def test_resumed_request_carries_what_was_received():
    req = build_request("hi", max_new_tokens=8, request_id="abc", temperature=0.0)
    again = resumed(req, 2, [4, 5, 6])
    assert list(again.resume_ids.ids) == [4, 5, 6] and again.request_id == "abc.r2"
    assert again.prompt == "hi" and again.max_new_tokens == 8 and again.temperature == 0.0
    assert list(req.resume_ids.ids) == []  # the original is untouched
    assert resumed(build_request("hi"), 1, [1]).request_id == ""  # the gateway names it


def test_a_stream_that_broke_after_its_last_token_ends_without_asking_again():
    """Every token of max_new_tokens was received before the final message was lost: the stream
    ends with a finished chunk of its own (the gateway would refuse a resume with nothing left)."""
    req = build_request("hi", max_new_tokens=3)
    assert all_received(req, [4, 5], "abc") is None
    done = all_received(req, [4, 5, 6], "abc")
    assert done is not None and done.finished and done.finish_reason == "length"
    assert done.token_ids == () and done.request_id == "abc"
    assert all_received(build_request("hi"), [4, 5, 6], "abc") is None  # the gateway's default length: ask it
