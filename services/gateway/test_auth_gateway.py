"""API keys at the gateway over real gRPC: a gateway (real Redis, no router or verifier behind it)
with keys on refuses calls without a valid bearer key with a fixed UNAUTHENTICATED message, lets a
valid key through to the next check (no verifier: UNAVAILABLE), and keeps health checks open."""

from __future__ import annotations

import asyncio

import pytest

from common.platform.grpc_server import check_health
from common.platform.settings import load_settings
from cosine_client import Client, Unauthenticated, Unavailable
from services.gateway.auth import UNAUTHENTICATED_MESSAGE
from services.gateway.server import build_app
from services.gateway.settings import GatewaySettings
from tests.support.testing import start_service


@pytest.fixture
def keyed_gateway(redis_url, redis_prefix, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("file-key\n")
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
            "--api-keys-file",
            str(keys_file),
        ],
        {"COSINE_API_KEYS": "env-key-1,env-key-2"},
    )
    server, port = start_service(settings, build_app, prog="gateway")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.mark.parametrize("key", [None, "", "wrong", "env-key-1x", "Bearer env-key-1"])
def test_missing_or_wrong_key_is_refused_without_detail(keyed_gateway, key, monkeypatch):
    monkeypatch.delenv("COSINE_API_KEY", raising=False)
    with Client(keyed_gateway, timeout=10, api_key=key) as client:
        with pytest.raises(Unauthenticated) as unary:
            client.generate("hello", max_new_tokens=4)
        with pytest.raises(Unauthenticated) as streamed:
            list(client.stream("hello", max_new_tokens=4))
    assert unary.value.message == UNAUTHENTICATED_MESSAGE
    assert streamed.value.message == UNAUTHENTICATED_MESSAGE


@pytest.mark.parametrize("key", ["env-key-1", "env-key-2", "file-key"])
def test_valid_key_passes_auth(keyed_gateway, key):
    with Client(keyed_gateway, timeout=10, api_key=key) as client:
        with pytest.raises(Unavailable, match="no verifier"):
            client.generate("hello", max_new_tokens=4)


def test_key_from_environment(keyed_gateway, monkeypatch):
    monkeypatch.setenv("COSINE_API_KEY", "file-key")
    with Client(keyed_gateway, timeout=10) as client:
        with pytest.raises(Unavailable):
            client.generate("hello", max_new_tokens=4)


def test_health_stays_open(keyed_gateway):
    assert asyncio.run(check_health(keyed_gateway))
    assert asyncio.run(check_health(keyed_gateway, "cosine.v1.Gateway"))
