"""TLS and mTLS on real gRPC servers over loopback (common/platform/tls.py, common/platform/grpc_server.py).

Each test starts the project's own server (create_server: health + reflection) with throwaway
certificates and dials it the way the services do (open_channel)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import ssl
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.platform import healthcheck
from common.platform.grpc_server import check_health, create_server
from common.platform.tls import TlsConfig, TlsError, http_server_ssl, open_blocking_channel, open_channel


def server_tls(certs, client_auth=False) -> TlsConfig:
    return TlsConfig(cert=str(certs.cert), key=str(certs.key), ca=str(certs.ca), client_auth=client_auth)


async def serve(tls: TlsConfig | None):
    return await create_server("127.0.0.1:0", lambda server: None, ("test.Service",), tls=tls)


async def health_code(port: int, tls: TlsConfig | None) -> grpc.StatusCode:
    """OK when the server answered SERVING, else the status code of the failed call."""
    async with open_channel(f"127.0.0.1:{port}", tls) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="test.Service"), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return grpc.StatusCode.OK


def test_tls_client_with_the_right_ca_is_served_and_plaintext_is_refused(dev_certs, other_certs):
    async def body():
        handle = await serve(server_tls(dev_certs))
        try:
            assert await health_code(handle.port, TlsConfig(ca=str(dev_certs.ca))) == grpc.StatusCode.OK
            assert await check_health(f"127.0.0.1:{handle.port}", "test.Service", tls=TlsConfig(ca=str(dev_certs.ca)))
            # a plaintext client cannot speak to a TLS port
            assert await health_code(handle.port, None) == grpc.StatusCode.UNAVAILABLE
            assert not await check_health(f"127.0.0.1:{handle.port}", "test.Service")
            # a client that trusts another CA refuses the server's certificate
            assert await health_code(handle.port, TlsConfig(ca=str(other_certs.ca))) == grpc.StatusCode.UNAVAILABLE
        finally:
            await handle.stop(0)

    asyncio.run(body())


def test_mtls_refuses_clients_without_a_certificate_or_with_another_cas(dev_certs, other_certs):
    async def body():
        handle = await serve(server_tls(dev_certs, client_auth=True))
        try:
            ca = str(dev_certs.ca)
            good_client = TlsConfig(cert=str(dev_certs.client_cert), key=str(dev_certs.client_key), ca=ca)
            service_as_client = TlsConfig(cert=str(dev_certs.cert), key=str(dev_certs.key), ca=ca)
            no_cert = TlsConfig(ca=ca)
            foreign = TlsConfig(cert=str(other_certs.client_cert), key=str(other_certs.client_key), ca=ca)
            assert await health_code(handle.port, good_client) == grpc.StatusCode.OK
            assert (
                await health_code(handle.port, service_as_client) == grpc.StatusCode.OK
            )  # services call each other with it
            assert await health_code(handle.port, no_cert) == grpc.StatusCode.UNAVAILABLE
            assert await health_code(handle.port, foreign) == grpc.StatusCode.UNAVAILABLE
            assert await health_code(handle.port, None) == grpc.StatusCode.UNAVAILABLE
        finally:
            await handle.stop(0)

    asyncio.run(body())


def test_plaintext_stays_the_default():
    async def body():
        handle = await serve(None)
        try:
            assert await health_code(handle.port, None) == grpc.StatusCode.OK
            assert await health_code(handle.port, TlsConfig()) == grpc.StatusCode.OK  # an empty config is plaintext
        finally:
            await handle.stop(0)

    assert not TlsConfig().enabled
    asyncio.run(body())


def test_server_name_override_checks_the_name_the_certificate_carries(dev_certs):
    """Peers in Kubernetes are dialled by IP: the certificate carries a DNS name instead, and
    --tls-server-name says which. A name the certificate does not carry is refused."""

    async def body():
        handle = await serve(server_tls(dev_certs))
        try:
            ca = str(dev_certs.ca)
            assert await health_code(handle.port, TlsConfig(ca=ca, server_name="cosine")) == grpc.StatusCode.OK
            assert (
                await health_code(handle.port, TlsConfig(ca=ca, server_name="elsewhere.example"))
                == grpc.StatusCode.UNAVAILABLE
            )
        finally:
            await handle.stop(0)

    asyncio.run(body())


def test_blocking_channel_and_the_healthcheck_command_speak_tls(dev_certs, monkeypatch, capsys):
    async def start():
        return await serve(server_tls(dev_certs, client_auth=True))

    loop = asyncio.new_event_loop()
    handle = loop.run_until_complete(start())
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        address = f"127.0.0.1:{handle.port}"
        client = TlsConfig(cert=str(dev_certs.client_cert), key=str(dev_certs.client_key), ca=str(dev_certs.ca))
        with open_blocking_channel(address, client) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # the container health check reads the service's own COSINE_TLS_* variables ...
        for name, value in (("CA", dev_certs.ca), ("CERT", dev_certs.cert), ("KEY", dev_certs.key)):
            monkeypatch.setenv(f"COSINE_TLS_{name}", str(value))
        assert healthcheck.main([address, "--service", "test.Service"]) == 0
        assert capsys.readouterr().out.strip().endswith("SERVING")
        # ... and without a client certificate the mTLS port refuses it
        assert healthcheck.main([address, "--tls-cert", "", "--tls-key", ""]) == 1
        assert "UNAVAILABLE" in capsys.readouterr().out
        assert healthcheck.main([address, "--tls-ca", "/nonexistent/ca.pem"]) == 2
        assert "--tls-ca '/nonexistent/ca.pem': no such file" in capsys.readouterr().err
    finally:
        asyncio.run_coroutine_threadsafe(handle.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()


# ---- bad files: one line naming the setting and the path -------------------------------------------


def test_bad_paths_and_files_give_one_line_errors(dev_certs, other_certs, tmp_path):
    missing = str(tmp_path / "missing.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello\n")
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    cases = [
        (TlsConfig(cert=missing, key=str(dev_certs.key)), f"--tls-cert {missing!r}: no such file"),
        (TlsConfig(cert=str(dev_certs.cert), key=str(tmp_path)), "is a directory"),
        (TlsConfig(cert=str(garbage), key=str(dev_certs.key)), "not a PEM certificate"),
        (TlsConfig(cert=str(dev_certs.cert), key=str(dev_certs.cert)), "not a PEM private key"),
        (TlsConfig(cert=str(dev_certs.cert), key=str(other_certs.key)), "is not the private key of --tls-cert"),
        (TlsConfig(ca=str(empty)), "the file is empty"),
        (TlsConfig(ca=str(garbage)), "no PEM CA certificate"),
        (TlsConfig(cert=str(dev_certs.cert)), "--tls-cert and --tls-key go together"),
        (
            TlsConfig(cert=str(dev_certs.cert), key=str(dev_certs.key), client_auth=True),
            "needs --tls-cert, --tls-key and --tls-ca",
        ),
    ]
    for config, expected in cases:
        with pytest.raises(TlsError) as info:
            config.check()
        assert expected in str(info.value) and "\n" not in str(info.value)
    server_tls(dev_certs, client_auth=True).check()  # the good set passes


def test_a_service_with_a_bad_certificate_path_exits_with_one_line(tmp_path, capsys):
    from common.platform.service import ServiceSettings, run_service

    async def never(settings, store):  # pragma: no cover - the check comes first
        raise AssertionError("the app must not be built")

    missing = str(tmp_path / "nope.pem")
    with pytest.raises(SystemExit) as info:
        run_service(
            ServiceSettings,
            never,
            prog="services.test",
            description="test",
            argv=["--tls-cert", missing, "--tls-key", missing],
        )
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"services.test: error: --tls-cert {missing!r}: no such file"


def test_sdk_labels_name_the_sdks_own_words(tmp_path):
    config = dataclasses.replace(TlsConfig(ca=str(tmp_path / "x.pem")), labels=("cert", "key", "ca"))
    with pytest.raises(TlsError, match=r"^ca '.*x\.pem': no such file$"):
        config.check()


# ---- the same files for an HTTP server -------------------------------------------------------------


def test_http_server_gets_the_same_files_and_requires_client_certificates_with_mtls(dev_certs, other_certs):
    assert http_server_ssl(TlsConfig(ca=str(dev_certs.ca))) is None  # no certificate: plaintext
    https = http_server_ssl(server_tls(dev_certs, client_auth=True))
    assert https.uvicorn_options() == {
        "ssl_certfile": str(dev_certs.cert),
        "ssl_keyfile": str(dev_certs.key),
        "ssl_ca_certs": str(dev_certs.ca),
        "ssl_cert_reqs": int(ssl.CERT_REQUIRED),
    }
    assert http_server_ssl(server_tls(dev_certs)).uvicorn_options() == {
        "ssl_certfile": str(dev_certs.cert),
        "ssl_keyfile": str(dev_certs.key),
    }

    def handshake(client_certs) -> bool:
        server_ctx = https.ssl_context()
        client_ctx = ssl.create_default_context(cafile=str(dev_certs.ca))
        if client_certs is not None:
            client_ctx.load_cert_chain(str(client_certs.client_cert), str(client_certs.client_key))
        a, b = socket.socketpair()
        outcome = {}

        def server_side():
            try:
                with server_ctx.wrap_socket(a, server_side=True) as s:
                    s.sendall(b"ok")
                outcome["server"] = True
            except (ssl.SSLError, OSError):
                outcome["server"] = False

        t = threading.Thread(target=server_side)
        t.start()
        try:
            with client_ctx.wrap_socket(b, server_hostname="localhost") as c:
                data = c.recv(2)
        except (ssl.SSLError, OSError):
            data = b""
        t.join(10)
        return data == b"ok" and outcome.get("server") is True

    assert handshake(dev_certs)
    assert not handshake(None)
    assert not handshake(other_certs)


def test_uvicorn_serves_https_and_mtls_with_the_options(dev_certs):
    """The contract with the gateway's HTTP server: ``uvicorn.Config(app, **uvicorn_options())``
    on a real loopback socket serves HTTPS, and with client auth refuses a client without a
    certificate (and a plaintext one)."""
    uvicorn = pytest.importorskip("uvicorn")
    import http.client

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    https = http_server_ssl(server_tls(dev_certs, client_auth=True))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", **https.uvicorn_options())
    )
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=lambda: loop.run_until_complete(server.serve(sockets=[sock])), daemon=True)
    runner.start()

    def get(context) -> int | None:
        conn = (
            http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
            if context is not None
            else http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        )
        try:
            conn.request("GET", "/")
            return conn.getresponse().status
        except (ssl.SSLError, OSError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    try:
        for _ in range(200):  # until it listens (no timing asserted: just a bounded wait)
            if server.started:
                break
            threading.Event().wait(0.05)
        with_cert = ssl.create_default_context(cafile=str(dev_certs.ca))
        with_cert.load_cert_chain(str(dev_certs.client_cert), str(dev_certs.client_key))
        assert get(with_cert) == 200
        assert get(ssl.create_default_context(cafile=str(dev_certs.ca))) is None  # no client certificate
        assert get(None) is None  # plaintext HTTP against the TLS port
    finally:
        server.should_exit = True
        runner.join(10)
        loop.close()
