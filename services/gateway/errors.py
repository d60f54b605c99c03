"""The one failure type of the gateway's request path, whichever front a request came through."""

from __future__ import annotations

import grpc


class GatewayError(Exception):
    """A request cannot be served. ``code`` is the gRPC status the gRPC front answers with (the
    HTTP front maps it to an HTTP status); ``field`` names the offending request field, if any."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str = ""):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
