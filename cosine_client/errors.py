"""Typed errors of the SDK. Each carries the gRPC status code and the server's message."""

from __future__ import annotations

import grpc


class CosineError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgument(CosineError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Unavailable(CosineError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(CosineError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(CosineError):
    code = grpc.StatusCode.CANCELLED


class ResourceExhausted(CosineError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFound(CosineError):
    code = grpc.StatusCode.NOT_FOUND


class Unauthenticated(CosineError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {
    cls.code: cls
    for cls in (InvalidArgument, Unavailable, DeadlineExceeded, Cancelled, ResourceExhausted, NotFound, Unauthenticated)
}


def from_rpc_error(exc: grpc.RpcError) -> CosineError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _BY_CODE.get(code, CosineError)
    return cls(details or code.name, code)


# What gRPC reports when the connection itself broke or could not be made (the gateway died or is
# restarting), as opposed to an UNAVAILABLE the gateway answered on purpose ("no verifier ...").
TRANSPORT_FAILURES = (
    "socket closed",
    "connection reset",
    "failed to connect",
    "connection refused",
    "broken pipe",
    "goaway",
    "too many pings",
    "stream removed",
    "end of tcp stream",
    "connection aborted",
)


NEVER_CONNECTED = ("failed to connect", "connection refused")

# Trailing metadata on every error the gateway answers itself: its message may quote a transport
# failure between the gateway and the router, which is not one between this client and the gateway.
GATEWAY_ANSWER = ("cosine-answered-by", "gateway")


def answered_by_gateway(exc: grpc.RpcError) -> bool:
    try:
        trailers = exc.trailing_metadata() or ()
    except Exception:  # an error raised before any call was made carries none
        return False
    return any((key, value) == GATEWAY_ANSWER for key, value in trailers)


def is_transport_failure(exc: grpc.RpcError, first_attempt: bool = False) -> bool:
    """The connection broke (or, after a first attempt, could not be made again). A first attempt
    that never connected is not one: nothing is listening there, and waiting would only hide it."""
    code = exc.code() if hasattr(exc, "code") else None
    details = ((exc.details() if hasattr(exc, "details") else str(exc)) or "").lower()
    if (
        code != grpc.StatusCode.UNAVAILABLE
        or not any(m in details for m in TRANSPORT_FAILURES)
        or answered_by_gateway(exc)
    ):
        return False
    return not (first_attempt and any(m in details for m in NEVER_CONNECTED))
