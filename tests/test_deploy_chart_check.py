"""deploy/chart_check.py's reading of the rendered chart, offline (no containers): env resolution,
$(VAR) expansion, the ports moved in the shared namespace and the probes that follow them."""

from __future__ import annotations

import pytest

pytest.importorskip("helm_python")

from deploy import chart_check  # noqa: E402


@pytest.fixture(scope="module")
def pods():
    return {p["name"]: p for p in chart_check.plan(chart_check.render("pw", "key", "0.1.0", "redis:test"))}


def test_expand_follows_the_kubelet():
    env = {"A": "1"}
    assert chart_check.expand("$(A):$(B):$$(A)", env) == "1:$(B):$(A)"


def test_small_profile_pods(pods):
    assert sorted(pods) == [
        "cosine-drafter-code",
        "cosine-drafter-prose",
        "cosine-gateway",
        "cosine-redis",
        "cosine-router",
        "cosine-verifier",
        "cosine-zoo-1",
    ]
    assert pods["cosine-zoo-1"]["restart"] == "on-failure"
    assert all(p["restart"] == "always" for n, p in pods.items() if n != "cosine-zoo-1")


def test_env_from_configmaps_secrets_and_downward_api(pods):
    env = pods["cosine-verifier"]["containers"][0]["env"]
    assert env["COSINE_REDIS_URL"] == "redis://:pw@cosine-redis:6379/0"
    assert env["COSINE_ADVERTISE_ADDRESS"] == "127.0.0.1:50053"
    assert env["COSINE_MEMBER_ID"] == "cosine-verifier-check"
    assert env["COSINE_DEVICE"] == "cpu" and env["COSINE_TARGET"] == "/models/zoo/target"


def test_second_drafter_moves_ports_env_and_probes(pods):
    c = pods["cosine-drafter-prose"]["containers"][0]
    assert c["moved"] == {50054: 50055, 9103: 9104}
    assert c["env"]["COSINE_PORT"] == "50055" and c["env"]["COSINE_ADVERTISE_ADDRESS"] == "127.0.0.1:50055"
    assert c["probes"]["readinessProbe"]["grpc"] == ["127.0.0.1:50055", "cosine.v1.Drafter"]


def test_redis_args_expand_the_password(pods, tmp_path):
    redis = pods["cosine-redis"]["containers"][0]
    engine = type("E", (), {"flags": [], "cmd": "podman"})()
    args = chart_check.run_args(engine, pods["cosine-redis"], redis, tmp_path, "always")
    assert args[args.index("redis:test") + 1 :][:2] == ["--requirepass", "pw"]
    assert "--read-only" in args and ["--user", "999:999"] == args[args.index("--user") : args.index("--user") + 2]
