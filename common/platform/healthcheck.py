"""`python -m common.platform.healthcheck ADDRESS [--service NAME] [--timeout S]`: one gRPC health check.

Asks the grpc.health.v1 service at ADDRESS (host:port) for the status of NAME ("" = the server as
a whole), prints one line and exits 0 when the answer is SERVING, 1 otherwise (NOT_SERVING,
unknown service, unreachable, deadline exceeded), 2 on a bad command line. Container images and
docker-compose use it as their HEALTHCHECK; Kubernetes uses its native ``grpc`` probes instead,
except with TLS on (those probes cannot speak TLS), where the chart runs this check.

TLS: the check dials TLS when given ``--tls-ca`` and presents ``--tls-cert``/``--tls-key`` (for a
service that requires client certificates). Each defaults to the service's own variable
(``COSINE_TLS_CA``, ``COSINE_TLS_CERT``, ``COSINE_TLS_KEY``, ``COSINE_TLS_SERVER_NAME``), so a
HEALTHCHECK or exec probe inside the service's container follows the service's TLS settings.

Imports only grpc and the health stubs (no torch), so a check costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.platform.tls import TlsConfig, TlsError, open_blocking_channel

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1


def check(address: str, service: str = "", timeout_s: float = 3.0, tls: TlsConfig | None = None) -> tuple[bool, str]:
    """Return (serving, one-line description) for ``service`` at ``address``."""
    label = f"{address} {service or '(server)'}"
    try:
        with open_blocking_channel(address, tls) as channel:
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


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="python -m common.platform.healthcheck",
        description="Check a CoSine service over the gRPC health protocol; exit 0 when SERVING, 1 otherwise.",
    )
    parser.add_argument("address", help="host:port of the service, e.g. 127.0.0.1:50051")
    parser.add_argument(
        "--service", default="", help="health service name, e.g. cosine.v1.Gateway (default: the whole server)"
    )
    parser.add_argument("--timeout", type=float, default=3.0, metavar="S", help="deadline of the check in seconds")
    parser.add_argument(
        "--tls-ca",
        default=env.get("COSINE_TLS_CA", ""),
        metavar="PATH",
        help="dial TLS and check the server against this CA bundle [env COSINE_TLS_CA]",
    )
    parser.add_argument(
        "--tls-cert",
        default=env.get("COSINE_TLS_CERT", ""),
        metavar="PATH",
        help="client certificate, for a server that requires one [env COSINE_TLS_CERT]",
    )
    parser.add_argument(
        "--tls-key", default=env.get("COSINE_TLS_KEY", ""), metavar="PATH", help="its private key [env COSINE_TLS_KEY]"
    )
    parser.add_argument(
        "--tls-server-name",
        default=env.get("COSINE_TLS_SERVER_NAME", ""),
        metavar="NAME",
        help="name the server's certificate must carry (default: the host dialled) [env COSINE_TLS_SERVER_NAME]",
    )
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be greater than 0")
    tls = TlsConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, server_name=args.tls_server_name)
    try:
        tls.check()
    except TlsError as exc:
        print(f"python -m common.platform.healthcheck: error: {exc}", file=sys.stderr, flush=True)
        return 2
    serving, line = check(args.address, args.service, args.timeout, tls)
    print(line, flush=True)
    return EXIT_SERVING if serving else EXIT_NOT_SERVING


if __name__ == "__main__":
    sys.exit(main())
