"""`python -m common.platform.healthcheck` (the images' and compose's HEALTHCHECK) against real servers."""

import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.platform.settings import load_settings
from tests.support.testing import start_service


def healthcheck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "common.platform.healthcheck", *args], capture_output=True, text=True, timeout=30
    )


@pytest.fixture()
def gateway(redis_url, redis_prefix):
    from services.gateway.server import build_app
    from services.gateway.settings import GatewaySettings

    settings = load_settings(
        GatewaySettings,
        [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--http-port",
            "0",
            "--redis-url",
            redis_url,
            "--redis-prefix",
            redis_prefix,
        ],
        {},
    )
    server, port = start_service(settings, build_app, prog="gateway")
    stopped = []

    def stop():
        if not stopped:
            stopped.append(True)
            server.stop()

    try:
        yield stop, port
    finally:
        stop()


def test_serving_service_exits_0_with_one_line(gateway):
    _, port = gateway
    for service in ("", "cosine.v1.Gateway"):
        args = [f"127.0.0.1:{port}"] + (["--service", service] if service else []) + ["--timeout", "5"]
        proc = healthcheck(*args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = proc.stdout.splitlines()
        assert len(lines) == 1 and lines[0].endswith("SERVING"), proc.stdout
        assert proc.stderr == ""


def test_unknown_service_exits_1(gateway):
    _, port = gateway
    proc = healthcheck(f"127.0.0.1:{port}", "--service", "cosine.v1.Nope")
    assert proc.returncode == 1
    assert len(proc.stdout.splitlines()) == 1 and "NOT_FOUND" in proc.stdout


def test_stopped_server_exits_1(gateway):
    stop, port = gateway
    stop()
    proc = healthcheck(f"127.0.0.1:{port}", "--timeout", "2")
    assert proc.returncode == 1
    assert len(proc.stdout.splitlines()) == 1 and "UNAVAILABLE" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr


def test_not_serving_exits_1():
    servicer = health.HealthServicer()
    servicer.set("cosine.v1.Verifier", health_pb2.HealthCheckResponse.NOT_SERVING)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        proc = healthcheck(f"127.0.0.1:{port}", "--service", "cosine.v1.Verifier")
        assert proc.returncode == 1
        assert proc.stdout.strip().endswith("NOT_SERVING"), proc.stdout
    finally:
        server.stop(0)


def test_bad_command_line_exits_2():
    assert healthcheck().returncode == 2
    assert healthcheck("127.0.0.1:1", "--timeout", "0").returncode == 2
