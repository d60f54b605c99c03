"""Throwaway certificates for development, documentation and tests (``cosine certs``).

:func:`write_dev_certs` writes a fresh certificate authority and two certificates it signs:

- ``service.pem`` / ``service-key.pem``: for every service of a cluster. It is both a server
  certificate (TLS on each gRPC port) and a client certificate (what a service presents to a peer
  that requires mutual TLS), and names ``localhost``, ``127.0.0.1``, ``::1`` and
  :data:`DEFAULT_SERVER_NAME` (the name the Helm chart tells services to expect, since peers are
  dialled by pod IP), plus any names given.
- ``client.pem`` / ``client-key.pem``: a client-only certificate for the SDK and the CLI against
  a gateway that requires client certificates.
- ``ca.pem``: what every party trusts; ``ca-key.pem`` signs more certificates (keep it or delete it).

Keys are ECDSA P-256, unencrypted, written readable by the owner only. Not for production: a
real deployment's certificates come from its own CA (cert-manager, Vault, a corporate PKI).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_SERVER_NAME = "cosine"
DEFAULT_NAMES = ("localhost", "127.0.0.1", "::1", DEFAULT_SERVER_NAME)
FILES = ("ca.pem", "ca-key.pem", "service.pem", "service-key.pem", "client.pem", "client-key.pem")


@dataclass(frozen=True)
class DevCerts:
    """Paths of the files :func:`write_dev_certs` wrote."""

    dir: Path
    ca: Path
    ca_key: Path
    cert: Path  # service certificate (server and client use)
    key: Path
    client_cert: Path  # client-only certificate
    client_key: Path

    @classmethod
    def at(cls, directory: str | Path) -> DevCerts:
        d = Path(directory)
        return cls(d, *(d / name for name in FILES))


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "CoSine development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for n in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            entries.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(entries)


def make_ca(
    common_name: str = "CoSine development CA", days: int = 30
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def issue(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    names: Sequence[str] = (),
    server: bool = True,
    client: bool = True,
    days: int = 30,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf certificate signed by the CA, for server and/or client authentication."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    usages = [
        u for u, on in ((ExtendedKeyUsageOID.SERVER_AUTH, server), (ExtendedKeyUsageOID.CLIENT_AUTH, client)) if on
    ]
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_encipherment=False,
                key_cert_sign=False,
                crl_sign=False,
                content_commitment=False,
                data_encipherment=False,
                key_agreement=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if names:
        builder = builder.add_extension(_san(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_dev_certs(
    out_dir: str | Path, names: Sequence[str] = (), days: int = 30, overwrite: bool = False
) -> DevCerts:
    """Write a new CA, a service certificate and a client certificate into ``out_dir``.
    ``names`` are added to the service certificate's DNS/IP names. Refuses to replace existing
    files unless ``overwrite``: certificates signed by the old CA would stop being trusted."""
    paths = DevCerts.at(out_dir)
    paths.dir.mkdir(parents=True, exist_ok=True)
    existing = [
        p.name
        for p in (paths.ca, paths.ca_key, paths.cert, paths.key, paths.client_cert, paths.client_key)
        if p.exists()
    ]
    if existing and not overwrite:
        raise FileExistsError(f"{paths.dir} already holds {', '.join(existing)} (use --force to replace them)")
    ca, ca_key = make_ca(days=days)
    all_names = list(dict.fromkeys([*DEFAULT_NAMES, *names]))
    service, service_key = issue(ca, ca_key, "cosine-service", all_names, server=True, client=True, days=days)
    client, client_key = issue(ca, ca_key, "cosine-client", (), server=False, client=True, days=days)
    for path, data, private in (
        (paths.ca, cert_pem(ca), False),
        (paths.ca_key, key_pem(ca_key), True),
        (paths.cert, cert_pem(service), False),
        (paths.key, key_pem(service_key), True),
        (paths.client_cert, cert_pem(client), False),
        (paths.client_key, key_pem(client_key), True),
    ):
        _write(path, data, private)
    return paths
