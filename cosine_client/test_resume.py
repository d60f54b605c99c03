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


@pytest.mark.parametrize(
    "details,first,expected",
    [
        ("Socket closed", True, True),
        ("recvmsg:Connection reset by peer", False, True),
        ("Too many pings", True, True),
        ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused", True, False),
        ("failed to connect to all addresses", False, True),
        ("no verifier is registered (and no --tokenizer given): cannot tokenize", False, False),
    ],
)
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


class FakeCall:
    """A server stream that gives ``messages`` and then fails with ``error`` (if any)."""

    def __init__(self, messages, error=None):
        self.messages, self.error, self.cancelled = messages, error, False

    def __iter__(self):
        yield from self.messages
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class FakeStub:
    def __init__(self, *calls):
        self.calls, self.requests = list(calls), []

    def GenerateStream(self, req, timeout=None, metadata=()):
        self.requests.append(req)
        return self.calls.pop(0)


def client_with(stub):
    from cosine_client.client import Client

    client = Client.__new__(Client)
    client.timeout, client._metadata, client._stub = None, (), stub
    client._wait_for_gateway = lambda deadline: None
    return client


def test_a_broken_stream_is_resumed_with_what_was_received_and_a_refusal_is_not():
    from cosine.v1 import gateway_pb2
    from cosine_client import CosineError

    def chunk(*ids, finished=False):
        return gateway_pb2.GenerateChunk(request_id="abc", token_ids=ids, finished=finished)

    broke = FakeError(grpc.StatusCode.UNAVAILABLE, "Socket closed")
    stub = FakeStub(FakeCall([chunk(4), chunk(5)], broke), FakeCall([chunk(6, finished=True)]))
    got = list(client_with(stub).stream("hi", max_new_tokens=8, request_id="abc"))
    assert [c.token_ids for c in got] == [(4,), (5,), (6,)]
    assert [list(r.resume_ids.ids) for r in stub.requests] == [[], [4, 5]] and stub.requests[1].request_id == "abc.r1"

    stub = FakeStub(*(FakeCall([], broke) for _ in range(3)))  # resume=2: three calls, then the failure
    with pytest.raises(CosineError):
        list(client_with(stub).stream("hi", resume=2))
    assert len(stub.requests) == 3 and not stub.calls

    refused = FakeError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty")
    stub = FakeStub(FakeCall([], refused), FakeCall([]))
    with pytest.raises(CosineError):
        list(client_with(stub).stream("hi"))
    assert len(stub.requests) == 1


def test_a_stream_left_early_cancels_its_call_and_sends_nothing_again():
    from cosine.v1 import gateway_pb2

    call = FakeCall([gateway_pb2.GenerateChunk(token_ids=[1]), gateway_pb2.GenerateChunk(token_ids=[2])])
    stub = FakeStub(call)
    stream = client_with(stub).stream("hi")
    assert next(stream).token_ids == (1,)
    stream.close()
    assert call.cancelled and len(stub.requests) == 1
