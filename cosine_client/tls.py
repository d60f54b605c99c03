"""TLS for the SDK's channel to the gateway.

:meth:`TlsOptions.resolve` decides from the client's arguments, falling back on the environment
(read when a client is made, never at import):

| argument          | variable                 | meaning                                                        |
|-------------------|--------------------------|----------------------------------------------------------------|
| ``tls``           | ``COSINE_TLS``           | dial TLS (implied by a CA); ``False`` forces plaintext         |
| ``tls_ca``        | ``COSINE_TLS_CA``        | CA bundle the gateway's certificate chains to (default: system roots) |
| ``tls_cert``      | ``COSINE_TLS_CERT``      | client certificate, for a gateway that requires one (mTLS)     |
| ``tls_key``       | ``COSINE_TLS_KEY``       | its private key                                                |
| ``tls_server_name`` | ``COSINE_TLS_SERVER_NAME`` | name the gateway's certificate must carry (default: host dialled) |

A missing or unreadable file raises :class:`TlsSetupError` with one line naming the argument and path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

TRUE = frozenset({"1", "true", "yes", "on"})


class TlsSetupError(ValueError):
    """A TLS argument is inconsistent or names a file that cannot be used."""


def _read(path: str, label: str, marker: bytes) -> bytes:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise TlsSetupError(f"{label} {path!r}: no such file") from None
    except OSError as exc:
        raise TlsSetupError(f"{label} {path!r}: cannot read it ({exc.strerror or exc})") from None
    if marker not in data:
        raise TlsSetupError(f"{label} {path!r}: not a PEM file (no {marker.decode().strip('-')} block)")
    return data


@dataclass(frozen=True)
class TlsOptions:
    enabled: bool = False
    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""

    @classmethod
    def resolve(
        cls,
        tls: bool | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> TlsOptions:
        env = os.environ if environ is None else environ
        ca = env.get("COSINE_TLS_CA", "") if tls_ca is None else tls_ca
        cert = env.get("COSINE_TLS_CERT", "") if tls_cert is None else tls_cert
        key = env.get("COSINE_TLS_KEY", "") if tls_key is None else tls_key
        name = env.get("COSINE_TLS_SERVER_NAME", "") if tls_server_name is None else tls_server_name
        if tls is None:
            tls = bool(ca) or env.get("COSINE_TLS", "").strip().lower() in TRUE
        if not tls:
            return cls()
        if bool(cert) != bool(key):
            raise TlsSetupError("tls_cert and tls_key go together: give both or neither")
        return cls(True, ca, cert, key, name)

    def credentials(self) -> grpc.ChannelCredentials:
        root = _read(self.ca, "tls_ca", b"-----BEGIN CERTIFICATE-----") if self.ca else None
        if self.cert:
            chain = _read(self.cert, "tls_cert", b"-----BEGIN CERTIFICATE-----")
            key = _read(self.key, "tls_key", b"PRIVATE KEY-----")
            return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)
        return grpc.ssl_channel_credentials(root_certificates=root)

    def channel_options(self, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        return [*options, ("grpc.ssl_target_name_override", self.server_name)] if self.server_name else list(options)

    def channel(self, address: str, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
        if self.enabled:
            return grpc.secure_channel(address, self.credentials(), options=self.channel_options(options))
        return grpc.insecure_channel(address, options=list(options))

    def aio_channel(self, address: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        if self.enabled:
            return grpc.aio.secure_channel(address, self.credentials(), options=self.channel_options(options))
        return grpc.aio.insecure_channel(address, options=list(options))
