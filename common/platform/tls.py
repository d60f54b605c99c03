"""TLS and mutual TLS for every gRPC hop of a cluster, and for the gateway's HTTP server.

One frozen :class:`TlsConfig` per process, built from the settings every service shares
(``--tls-cert``, ``--tls-key``, ``--tls-ca``, ``--tls-client-auth``, ``--tls-server-name``):

- **serving**: a service given a certificate and its key serves TLS on its gRPC port; with
  ``--tls-client-auth`` it also requires every client to present a certificate signed by
  ``--tls-ca`` (mutual TLS). Without a certificate it serves plaintext (the local default).
- **dialling**: a process given ``--tls-ca`` opens every channel to its peers over TLS and checks
  the peer's certificate against that CA, under the name dialled or ``--tls-server-name`` (in
  Kubernetes peers are dialled by pod IP, so the chart names one DNS name every certificate
  carries). It presents its own certificate as client certificate, which is what a peer with
  client authentication asks for.

Give every service of a cluster the same three files and every hop is mutual TLS; give the gateway
only a certificate and key and the public face is TLS while the inside stays plaintext.
:func:`open_channel` is the one place channels are opened: secure when the config says so,
plaintext otherwise. :func:`http_server_ssl` gives the same files to an HTTP server.

Files are read when credentials are built: at start-up for the server, and for every channel
opened (a drafter that joins later gets the files as they are then). Every problem with a file is
a :class:`TlsError` whose message is one line naming the setting and the path.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

# How (cert, key, ca) are named in messages; the SDK uses its own words (dataclasses.replace(config, labels=...)).
FLAG_LABELS = ("--tls-cert", "--tls-key", "--tls-ca")


class TlsError(ValueError):
    """A certificate, key or CA file is missing, unreadable or wrong; the message is one line."""


@dataclass(frozen=True)
class TlsConfig:
    """Paths of this process's certificate, key and CA bundle (all PEM), and how to use them."""

    cert: str = ""  # certificate chain this process serves with (and presents to peers)
    key: str = ""  # private key of ``cert`` (unencrypted PEM)
    ca: str = ""  # CA bundle that peers' certificates (and, with client_auth, clients') must chain to
    client_auth: bool = False  # serving: require a client certificate signed by ``ca`` (mTLS)
    server_name: str = ""  # dialling: the name peers' certificates must carry (default: the host dialled)
    labels: tuple[str, str, str] = field(default=FLAG_LABELS, compare=False, repr=False)

    @classmethod
    def from_settings(cls, settings: Any) -> TlsConfig:
        """The TLS part of a service's settings (:class:`common.platform.service.ServiceSettings`)."""
        return cls(
            cert=getattr(settings, "tls_cert", ""),
            key=getattr(settings, "tls_key", ""),
            ca=getattr(settings, "tls_ca", ""),
            client_auth=bool(getattr(settings, "tls_client_auth", False)),
            server_name=getattr(settings, "tls_server_name", ""),
        )

    @property
    def serves_tls(self) -> bool:
        return bool(self.cert)

    @property
    def dials_tls(self) -> bool:
        return bool(self.ca)

    @property
    def enabled(self) -> bool:
        return self.serves_tls or self.dials_tls

    def problem(self) -> str | None:
        """What is inconsistent in the combination of settings (None when it is fine)."""
        cert, key, ca = self.labels
        if bool(self.cert) != bool(self.key):
            return f"{cert} and {key} go together: give both or neither"
        if self.client_auth and not (self.cert and self.ca):
            return f"client authentication (mTLS) needs {cert}, {key} and {ca} (the CA that signs client certificates)"
        return None

    def describe(self) -> str:
        """One line for the start-up log."""
        serving = ("mTLS" if self.client_auth else "TLS") if self.serves_tls else "plaintext"
        dialling = (
            "TLS" + (f" (server name {self.server_name})" if self.server_name else "")
            if self.dials_tls
            else "plaintext"
        )
        return f"serving {serving}, dialling peers {dialling}"

    def check(self) -> None:
        """Read and parse every file given, raise :class:`TlsError` on the first problem."""
        problem = self.problem()
        if problem:
            raise TlsError(problem)
        if self.cert:
            _cert_chain(self)
        if self.ca:
            _ca_bundle(self)


# ---- reading and checking files -----------------------------------------------------------------


def _read(path: str, label: str) -> bytes:
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise TlsError(f"{label} {path!r}: no such file") from None
    except IsADirectoryError:
        raise TlsError(f"{label} {path!r}: is a directory, not a PEM file") from None
    except OSError as exc:
        raise TlsError(f"{label} {path!r}: cannot read it ({exc.strerror or exc})") from None
    if not data.strip():
        raise TlsError(f"{label} {path!r}: the file is empty")
    return data


def _ssl_reason(exc: ssl.SSLError) -> str:
    return (exc.reason or str(exc)).replace("_", " ").lower()


def _cert_chain(config: TlsConfig) -> tuple[bytes, bytes]:
    """(certificate chain, private key) read and checked to be a matching PEM pair."""
    cert_label, key_label, _ = config.labels
    cert = _read(config.cert, cert_label)
    key = _read(config.key, key_label)
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise TlsError(f"{cert_label} {config.cert!r}: not a PEM certificate (no BEGIN CERTIFICATE block)")
    if b"PRIVATE KEY-----" not in key:
        raise TlsError(f"{key_label} {config.key!r}: not a PEM private key (no BEGIN PRIVATE KEY block)")
    if b"ENCRYPTED" in key:
        raise TlsError(f"{key_label} {config.key!r}: the key is encrypted; give an unencrypted PEM key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(config.cert, config.key, password=b"")
    except ssl.SSLError as exc:
        reason = _ssl_reason(exc)
        if "mismatch" in reason:
            raise TlsError(
                f"{key_label} {config.key!r} is not the private key of {cert_label} {config.cert!r}"
            ) from None
        raise TlsError(
            f"{cert_label} {config.cert!r} / {key_label} {config.key!r}: not a valid PEM certificate and key ({reason})"
        ) from None
    return cert, key


def _ca_bundle(config: TlsConfig) -> bytes:
    label = config.labels[2]
    ca = _read(config.ca, label)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cadata=ca.decode("ascii", errors="replace"))
    except (ssl.SSLError, ValueError) as exc:
        reason = _ssl_reason(exc) if isinstance(exc, ssl.SSLError) else str(exc)
        raise TlsError(f"{label} {config.ca!r}: no PEM CA certificate in it ({reason})") from None
    return ca


# ---- gRPC ---------------------------------------------------------------------------------------


def server_credentials(config: TlsConfig) -> grpc.ServerCredentials:
    """Credentials for ``server.add_secure_port``: this process's certificate, and with
    ``client_auth`` the CA every client certificate must chain to."""
    config.check()
    cert, key = _cert_chain(config)
    if config.client_auth:
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=_ca_bundle(config), require_client_auth=True
        )
    return grpc.ssl_server_credentials([(key, cert)])


def channel_credentials(config: TlsConfig) -> grpc.ChannelCredentials:
    """Credentials for a channel to a peer: trust ``ca`` (the system roots when it is empty) and
    present this process's certificate when it has one."""
    if bool(config.cert) != bool(config.key):
        raise TlsError(config.problem() or "certificate and key go together")
    root = _ca_bundle(config) if config.ca else None
    if config.cert:
        cert, key = _cert_chain(config)
        return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)
    return grpc.ssl_channel_credentials(root_certificates=root)


def channel_options(config: TlsConfig | None, options: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    out = list(options)
    if config is not None and config.server_name:
        out.append(("grpc.ssl_target_name_override", config.server_name))
    return out


def open_channel(
    address: str, config: TlsConfig | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to ``address``: TLS when ``config`` dials TLS, plaintext otherwise."""
    if config is not None and config.dials_tls:
        return grpc.aio.secure_channel(address, channel_credentials(config), options=channel_options(config, options))
    return grpc.aio.insecure_channel(address, options=list(options))


def open_blocking_channel(
    address: str, config: TlsConfig | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """The blocking counterpart of :func:`open_channel` (CLI, health checks, the blocking SDK)."""
    if config is not None and config.dials_tls:
        return grpc.secure_channel(address, channel_credentials(config), options=channel_options(config, options))
    return grpc.insecure_channel(address, options=list(options))


def add_port(server: grpc.Server | grpc.aio.Server, address: str, config: TlsConfig | None) -> int:
    """Bind ``address`` with TLS when ``config`` serves TLS, plaintext otherwise; returns the port."""
    if config is not None and config.serves_tls:
        return server.add_secure_port(address, server_credentials(config))
    return server.add_insecure_port(address)


# ---- HTTP (the gateway's OpenAI-compatible API) ---------------------------------------------------


@dataclass(frozen=True)
class HttpTls:
    """What an HTTP server needs to serve the same TLS as the gRPC port: the checked paths, and
    keyword arguments for ``uvicorn.Config`` / ``uvicorn.run``."""

    certfile: str
    keyfile: str
    ca_certs: str  # "" when clients are not asked for certificates
    require_client_cert: bool

    def uvicorn_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile}
        if self.require_client_cert:
            opts.update(ssl_ca_certs=self.ca_certs, ssl_cert_reqs=int(ssl.CERT_REQUIRED))
        return opts

    def ssl_context(self) -> ssl.SSLContext:
        """A server-side context (TLS 1.2+, client certificates required when mTLS is on)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.certfile, self.keyfile)
        if self.require_client_cert:
            ctx.load_verify_locations(self.ca_certs)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


def http_server_ssl(config: TlsConfig) -> HttpTls | None:
    """The settings' TLS for an HTTP server beside the gRPC one (None: serve plaintext).
    Raises :class:`TlsError` when a file is wrong."""
    if not config.serves_tls:
        return None
    config.check()
    return HttpTls(config.cert, config.key, config.ca if config.client_auth else "", config.client_auth)


__all__ = [
    "FLAG_LABELS",
    "HttpTls",
    "TlsConfig",
    "TlsError",
    "add_port",
    "channel_credentials",
    "channel_options",
    "http_server_ssl",
    "open_blocking_channel",
    "open_channel",
    "server_credentials",
]
