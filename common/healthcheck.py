"""`python -m common.healthcheck ADDRESS [--service NAME] [--timeout S]`: one gRPC health check.

Asks the grpc.health.v1 service at ADDRESS (host:port) for the status of NAME ("" = the server as
a whole), prints one line and exits 0 when the answer is SERVING, 1 otherwise (NOT_SERVING,
unknown service, unreachable, deadline exceeded), 2 on a bad command line. Container images and
docker-compose use it as their HEALTHCHECK; Kubernetes uses its native ``grpc`` probes instead.

Imports only grpc and the health stubs (no torch), so a check costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1


def check(address: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    """Return (serving, one-line description) for ``service`` at ``address``."""
    label = f"{address} {service or '(server)'}"
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, wait_for_ready=False
            )
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        detail = exc.details() if hasattr(exc, "details") else str(exc)
        name = code.name if code is not None else "ERROR"
        return False, f"{label}: {name} ({' '.join(str(detail or '').split())[:160]})"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{label}: {status}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m common.healthcheck",
        description="Check a CoSine service over the gRPC health protocol; exit 0 when SERVING, 1 otherwise.",
    )
    parser.add_argument("address", help="host:port of the service, e.g. 127.0.0.1:50051")
    parser.add_argument("--service", default="", help="health service name, e.g. cosine.v1.Gateway (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, metavar="S", help="deadline of the check in seconds")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be greater than 0")
    serving, line = check(args.address, args.service, args.timeout)
    print(line, flush=True)
    return EXIT_SERVING if serving else EXIT_NOT_SERVING


if __name__ == "__main__":
    sys.exit(main())
