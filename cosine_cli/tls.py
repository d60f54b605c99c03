"""TLS on the command line: `cosine certs`, the client flags of `cosine generate` / `cosine status`,
and `cosine up --tls-dir DIR [--mtls]`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.platform.tls import TlsConfig

CERTS_HELP = """\
Write a throwaway certificate authority and two certificates it signs, for trying TLS and mutual
TLS locally and in the documentation's examples. NOT for production: use your own CA there.

files written into --out:
  ca.pem                 the CA certificate: what every service and client trusts (--tls-ca)
  ca-key.pem             the CA's private key (signs more certificates; delete it when done)
  service.pem            certificate for every service (server and client use): --tls-cert
  service-key.pem        its private key: --tls-key
  client.pem             client-only certificate for the SDK / CLI against an mTLS gateway
  client-key.pem         its private key

The service certificate names localhost, 127.0.0.1, ::1 and "cosine" (the name the Helm chart
tells services to expect, --tls-server-name), plus every --name given.

examples:
  cosine certs --out certs
  python -m services.gateway --tls-cert certs/service.pem --tls-key certs/service-key.pem ...
  cosine generate --address 127.0.0.1:50051 --tls-ca certs/ca.pem "def fib(n):"
  cosine up --tls-dir certs --mtls        # a local cluster with mutual TLS on every hop
  kubectl create secret generic cosine-tls --from-file=tls.crt=certs/service.pem \\
      --from-file=tls.key=certs/service-key.pem --from-file=ca.crt=certs/ca.pem
"""


def register(sub: argparse._SubParsersAction) -> None:
    certs = sub.add_parser(
        "certs",
        help="write a throwaway development CA and service/client certificates (TLS, mTLS)",
        description=CERTS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    certs.add_argument(
        "--out", default=".cosine/certs", metavar="DIR", help="directory to write into (default: %(default)s)"
    )
    certs.add_argument(
        "--name",
        action="append",
        default=[],
        metavar="NAME",
        help="extra DNS name or IP address for the service certificate (repeatable), e.g. gateway.example.com",
    )
    certs.add_argument("--days", type=int, default=30, help="validity in days (default: %(default)s)")
    certs.add_argument("--force", action="store_true", help="replace certificates already in --out")
    certs.set_defaults(func=cmd_certs)


def cmd_certs(args: argparse.Namespace) -> int:
    from common.platform.devcerts import write_dev_certs

    if args.days < 1:
        print("cosine certs: error: --days must be 1 or more", file=sys.stderr)
        return 2
    try:
        paths = write_dev_certs(args.out, names=args.name, days=args.days, overwrite=args.force)
    except (FileExistsError, OSError) as exc:
        print(f"cosine certs: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote a development CA and certificates into {paths.dir} (valid {args.days} days; not for production)")
    print(f"  services: --tls-cert {paths.cert} --tls-key {paths.key} --tls-ca {paths.ca} [--tls-client-auth]")
    print(f"  clients:  --tls-ca {paths.ca} [--tls-cert {paths.client_cert} --tls-key {paths.client_key}]")
    return 0


def add_client_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="dial TLS (implied by --tls-ca; default: $COSINE_TLS, or what `cosine up` started)",
    )
    p.add_argument(
        "--tls-ca",
        default=None,
        metavar="PATH",
        help="CA bundle the server's certificate must chain to (default: $COSINE_TLS_CA)",
    )
    p.add_argument(
        "--tls-cert",
        default=None,
        metavar="PATH",
        help="client certificate for a server that requires one (default: $COSINE_TLS_CERT)",
    )
    p.add_argument(
        "--tls-key", default=None, metavar="PATH", help="private key of --tls-cert (default: $COSINE_TLS_KEY)"
    )
    p.add_argument(
        "--tls-server-name",
        default=None,
        metavar="NAME",
        help="name the server's certificate must carry (default: the host dialled; $COSINE_TLS_SERVER_NAME)",
    )


def client_tls(args: argparse.Namespace, state: Mapping[str, Any] | None) -> dict[str, Any]:
    """SDK TLS arguments: the flags given, else what `cosine up` recorded for its cluster (when
    dialling it: ``state``), else nothing (the SDK's COSINE_TLS_* variables then apply)."""
    given = {k: getattr(args, k) for k in ("tls", "tls_ca", "tls_cert", "tls_key", "tls_server_name")}
    if state is not None and all(v is None for v in given.values()):
        return dict(state.get("tls") or {})
    return {k: v for k, v in given.items() if v is not None}


def cluster_tls(args: argparse.Namespace) -> Any:
    """The TlsConfig of `cosine up --tls-dir DIR [--mtls]` (None: plaintext). Writes development
    certificates into DIR when it holds none."""
    if args.mtls and not args.tls_dir:
        raise SystemExit("cosine: error: --mtls needs --tls-dir DIR")
    if not args.tls_dir:
        return None
    from common.platform.devcerts import DevCerts, write_dev_certs
    from common.platform.tls import TlsConfig, TlsError

    certs = DevCerts.at(args.tls_dir)
    if not certs.ca.exists():
        write_dev_certs(args.tls_dir)
        print(f"certs      wrote a development CA and certificates into {args.tls_dir}", file=sys.stderr)
    tls = TlsConfig(
        cert=str(certs.cert.resolve()), key=str(certs.key.resolve()), ca=str(certs.ca.resolve()), client_auth=args.mtls
    )
    try:
        tls.check()
    except TlsError as exc:
        raise SystemExit(f"cosine: error: {exc}") from None
    return tls


def service_tls_args(tls: TlsConfig | None) -> list[str]:
    """The service flags that give a process ``tls`` (nothing for plaintext)."""
    if tls is None or not tls.enabled:
        return []
    args = []
    for flag, value in (
        ("--tls-cert", tls.cert),
        ("--tls-key", tls.key),
        ("--tls-ca", tls.ca),
        ("--tls-server-name", tls.server_name),
    ):
        if value:
            args += [flag, value]
    return args + (["--tls-client-auth"] if tls.client_auth else [])
