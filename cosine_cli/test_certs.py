"""`cosine certs` writes a usable development CA and certificates; the TLS flags of `cosine up`."""

from __future__ import annotations

import argparse
import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from common.platform.devcerts import DevCerts
from common.platform.tls import TlsConfig
from cosine_cli.main import main
from cosine_cli.tls import client_tls, cluster_tls


def load(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_certs_writes_a_ca_a_service_and_a_client_certificate(tmp_path, capsys):
    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), "--name", "gateway.example.com", "--name", "10.0.0.7", "--days", "2"]) == 0
    assert "not for production" in capsys.readouterr().out
    paths = DevCerts.at(out)
    ca, service, client = load(paths.ca), load(paths.cert), load(paths.client_cert)
    for leaf in (service, client):
        assert leaf.issuer == ca.subject
        leaf.verify_directly_issued_by(ca)
    san = service.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "cosine", "gateway.example.com"} <= set(san.get_values_for_type(x509.DNSName))
    assert {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.0.0.7")} <= set(
        san.get_values_for_type(x509.IPAddress)
    )
    usage = lambda cert: set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)  # noqa: E731
    assert usage(service) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert usage(client) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    assert 1 < (service.not_valid_after_utc - service.not_valid_before_utc).days <= 2
    for key in (paths.ca_key, paths.key, paths.client_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    # the files are what the services accept
    TlsConfig(cert=str(paths.cert), key=str(paths.key), ca=str(paths.ca), client_auth=True).check()
    TlsConfig(cert=str(paths.client_cert), key=str(paths.client_key), ca=str(paths.ca)).check()

    # a second run would orphan every certificate signed by the first CA: refused unless --force
    before = paths.ca.read_bytes()
    assert main(["certs", "--out", str(out)]) == 1
    assert "already holds ca.pem" in capsys.readouterr().err
    assert paths.ca.read_bytes() == before
    assert main(["certs", "--out", str(out), "--force"]) == 0
    assert paths.ca.read_bytes() != before


def test_certs_help_says_what_each_file_is_for(capsys):
    with pytest.raises(SystemExit) as info:
        main(["certs", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for word in ("ca.pem", "service-key.pem", "client.pem", "NOT for production", "--tls-cert", "cosine up --tls-dir"):
        assert word in text


def test_up_tls_dir_writes_certificates_once_and_mtls_needs_it(tmp_path):
    args = argparse.Namespace(tls_dir=str(tmp_path / "c"), mtls=True)
    tls = cluster_tls(args)
    assert tls.client_auth and tls.cert.endswith("service.pem") and tls.ca.endswith("ca.pem")
    first = (tmp_path / "c" / "ca.pem").read_bytes()
    assert cluster_tls(args).ca == tls.ca and (tmp_path / "c" / "ca.pem").read_bytes() == first  # reused, not rewritten
    assert cluster_tls(argparse.Namespace(tls_dir="", mtls=False)) is None
    with pytest.raises(SystemExit, match="--mtls needs --tls-dir"):
        cluster_tls(argparse.Namespace(tls_dir="", mtls=True))


def test_client_flags_win_over_the_clusters_recorded_tls():
    none = argparse.Namespace(tls=None, tls_ca=None, tls_cert=None, tls_key=None, tls_server_name=None)
    state = {"tls": {"tls": True, "tls_ca": "/c/ca.pem"}}
    assert client_tls(none, state) == {"tls": True, "tls_ca": "/c/ca.pem"}
    assert client_tls(none, None) == {}  # an explicit address: the SDK's COSINE_TLS_* apply
    flags = argparse.Namespace(**{**vars(none), "tls_ca": "/mine.pem"})
    assert client_tls(flags, state) == {"tls_ca": "/mine.pem"}
