"""How the SDK decides on TLS: arguments first, then COSINE_TLS_* variables; plaintext otherwise."""

import pytest

from cosine_client import TlsOptions, TlsSetupError


def test_arguments_win_over_the_environment():
    env = {"COSINE_TLS_CA": "/env/ca.pem", "COSINE_TLS_CERT": "/env/c.pem", "COSINE_TLS_KEY": "/env/k.pem"}
    assert TlsOptions.resolve(environ={}) == TlsOptions()  # nothing: plaintext
    assert TlsOptions.resolve(environ=env) == TlsOptions(True, "/env/ca.pem", "/env/c.pem", "/env/k.pem")
    assert TlsOptions.resolve(tls_ca="/arg/ca.pem", environ=env).ca == "/arg/ca.pem"
    assert TlsOptions.resolve(tls=False, environ=env) == TlsOptions()  # forced plaintext
    assert TlsOptions.resolve(environ={"COSINE_TLS": "true"}) == TlsOptions(True)  # the system's roots
    assert TlsOptions.resolve(tls=True, tls_server_name="cosine", environ={}).server_name == "cosine"


def test_a_certificate_needs_its_key_and_files_must_exist(tmp_path):
    with pytest.raises(TlsSetupError, match="tls_cert and tls_key go together"):
        TlsOptions.resolve(tls_ca="/x", tls_cert="/c.pem", environ={})
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    with pytest.raises(TlsSetupError, match=r"^tls_ca '.*ca\.pem': not a PEM file"):
        TlsOptions(True, str(bad)).credentials()
    with pytest.raises(TlsSetupError, match=r"^tls_ca '/nonexistent\.pem': no such file$"):
        TlsOptions(True, "/nonexistent.pem").credentials()
