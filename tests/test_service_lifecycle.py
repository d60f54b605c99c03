"""Every service starts as its own process, reports SERVING on grpc.health.v1, registers in Redis,
answers reflection, and stops cleanly on SIGTERM within 5 s. Bad settings end with one line."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.platform.store import Store

SERVICES = ["drafter", "verifier", "router", "gateway"]
ENV = {**os.environ, "COSINE_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}


def start(name, *args):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            f"services.{name}",
            "--port",
            "0",
            "--metrics-port",
            "0",
            *(["--http-port", "0"] if name == "gateway" else []),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
        text=True,
    )


def wait_serving_port(proc, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                raise AssertionError(f"exited with {proc.returncode}")
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "serving":
            return event["port"], event["member_id"]
    raise AssertionError("no 'serving' line")


@pytest.mark.parametrize("name", SERVICES)
def test_service_serves_health_reflection_and_stops_on_sigterm(name, redis_url, redis_prefix):
    proc = start(name, "--redis-url", redis_url, "--redis-prefix", redis_prefix, "--host", "127.0.0.1")
    try:
        port, member_id = wait_serving_port(proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=f"cosine.v1.{name.capitalize()}"), timeout=5
            )
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = list(
                stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            )
            names = {s.name for s in replies[0].list_services_response.service}
            assert f"cosine.v1.{name.capitalize()}" in names and "grpc.health.v1.Health" in names

        async def members():
            store = Store.from_url(redis_url, prefix=redis_prefix)
            try:
                return [m.member_id for m in await store.members(name)]
            finally:
                await store.close()

        assert asyncio.run(members()) == [member_id]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - t0 < 5
        assert asyncio.run(members()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize(
    "args,code,needle",
    [
        (["--frobnicate"], 2, "unrecognized arguments: --frobnicate"),
        (["--port", "70000"], 2, "--port: 70000 must be a port number"),
        (["--redis-url", "redis://127.0.0.1:1/0"], 1, "cannot reach Redis at redis://127.0.0.1:1/0"),
        (["--redis-url", "http://x"], 2, "--redis-url: 'http://x' must be a redis://"),
    ],
)
def test_bad_settings_end_with_one_clear_line(args, code, needle):
    proc = subprocess.run(
        [sys.executable, "-m", "services.router", *args], capture_output=True, text=True, env=ENV, timeout=30
    )
    assert proc.returncode == code
    errors = [line for line in proc.stderr.splitlines() if "error:" in line and not line.startswith("{")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", SERVICES)
def test_help_explains_every_flag(name):
    proc = subprocess.run(
        [sys.executable, "-m", f"services.{name}", "--help"], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0
    assert "--redis-url" in proc.stdout and "COSINE_REDIS_URL" in proc.stdout


def test_port_in_use_is_one_line(redis_url):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.gateway",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--redis-url",
                redis_url,
            ],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=30,
        )
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line and not line.startswith("{")]
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}" in errors[0], proc.stderr


def test_in_process_helper_returns_server_and_port(redis_url, redis_prefix):
    from common.platform.settings import load_settings
    from services.gateway.server import build_app
    from services.gateway.settings import GatewaySettings
    from tests.support.testing import start_service

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
    try:
        assert port > 0
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
