"""docker-compose.yml and the Dockerfiles, checked offline against the Compose schema and the code.

No Docker engine is needed: the file is interpolated with .env.example the way Compose does,
validated against the Compose Specification schema, and every service, port, COSINE_* variable,
volume, dependency and health check it names is compared with what the services really accept.
"""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from common.platform.settings import SettingsError
from deploy import compose
from deploy.settings_index import service_specs

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
CHECKPOINTS_FILE = ROOT / "docker-compose.checkpoints.yml"
TLS_FILE = ROOT / "docker-compose.tls.yml"
ENV_EXAMPLE = ROOT / ".env.example"
SPECS = service_specs()
HEALTHY_OR_DONE = {"service_healthy", "service_completed_successfully"}


@pytest.fixture(scope="module")
def env():
    return compose.read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def doc(env):
    return compose.load(COMPOSE_FILE, env)


def dockerfile_targets(path: Path) -> dict[str, list[str]]:
    """Stage name -> its instruction lines (continuations joined)."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    stages: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            current = m.group(1)
            stages[current] = []
        elif current is not None:
            stages[current].append(line)
    return stages


def cosine_service(svc: dict) -> str | None:
    """Which CoSine service a compose service runs: its build target or its image's target."""
    target = (svc.get("build") or {}).get("target")
    return target if target in SPECS else None


def env_of(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    assert isinstance(env, dict), "use the mapping form of environment"
    return {k: str(v) for k, v in env.items()}


def test_compose_file_is_valid_compose_spec(doc):
    pytest.importorskip("check_jsonschema", reason="the Compose schema ships with check-jsonschema (Python >= 3.11)")
    assert compose.schema_errors(doc) == []


def test_checkpoints_override_is_valid_and_only_adds_mounts(env):
    override = compose.load(CHECKPOINTS_FILE, {**env, "MODELS_DIR": "/srv/models"})
    if importlib.util.find_spec("check_jsonschema"):
        assert compose.schema_errors(override) == []
    base = compose.load(COMPOSE_FILE, env)
    for name, svc in override["services"].items():
        assert name in base["services"], f"override names an unknown service {name}"
        assert cosine_service(base["services"][name]) in ("drafter", "verifier", "gateway")
        assert any(v.endswith(":/models:ro") for v in svc["volumes"]), name


def test_tls_override_turns_on_mtls_for_every_cosine_service(env):
    override = compose.load(TLS_FILE, env)
    if importlib.util.find_spec("check_jsonschema"):
        assert compose.schema_errors(override) == []
    base = compose.load(COMPOSE_FILE, env)
    covered = set()
    for name, svc in override["services"].items():
        kind = cosine_service(base["services"][name])
        assert kind is not None, f"override names {name}, which runs no CoSine service"
        covered.add(name)
        merged = {**env_of(base["services"][name]), **env_of(svc)}  # compose merges environment maps
        settings = SPECS[kind].load(merged)
        (mount,) = svc["volumes"]
        source, target, mode = mount.rsplit(":", 2)
        assert mode == "ro" and source == "./certs"
        for path in (settings.tls_cert, settings.tls_key, settings.tls_ca):
            assert path.startswith(target + "/"), (name, path)
        assert settings.tls_server_name == "cosine"
        assert settings.tls_client_auth is (kind != "gateway"), name
    assert covered == {n for n, svc in base["services"].items() if cosine_service(svc)}
    gated = compose.load(TLS_FILE, {**env, "GATEWAY_CLIENT_AUTH": "true"})
    assert SPECS["gateway"].load(env_of(gated["services"]["gateway"])).tls_client_auth is True


def test_every_required_variable_is_in_env_example(env):
    used: set[str] = set()
    compose.load(COMPOSE_FILE, env, used)
    required = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?\?)", COMPOSE_FILE.read_text()))
    assert "REDIS_PASSWORD" in required
    assert required <= set(env), f"variables without default missing in .env.example: {required - set(env)}"
    assert set(env) - used <= {"COMPOSE_PROFILES"}, (
        f".env.example sets variables compose never reads: {set(env) - used - {'COMPOSE_PROFILES'}}"
    )
    with pytest.raises(compose.InterpolationError, match="REDIS_PASSWORD"):
        compose.load(COMPOSE_FILE, {k: v for k, v in env.items() if k != "REDIS_PASSWORD"})


def test_services_are_the_expected_cluster(doc):
    services = doc["services"]
    by_kind: dict[str, list[str]] = {}
    for name, svc in services.items():
        by_kind.setdefault(cosine_service(svc) or name, []).append(name)
    assert set(by_kind) == {"redis", "zoo", "drafter", "verifier", "router", "gateway"}, by_kind
    assert len(by_kind["router"]) == 1 and len(by_kind["gateway"]) == 1
    assert len(by_kind["drafter"]) >= 2
    drafter_names = [env_of(services[n])["COSINE_DRAFTERS"].split("=", 1)[0] for n in by_kind["drafter"]]
    assert len(set(drafter_names)) == len(drafter_names), f"drafters must host different models: {drafter_names}"
    # one verifier per profile: the CPU one by default, the GPU one behind the gpu profile
    verifier_profiles = {n: tuple(services[n].get("profiles", ())) for n in by_kind["verifier"]}
    assert sorted(verifier_profiles.values()) == [("cpu",), ("gpu",)], verifier_profiles
    assert ENV_EXAMPLE.read_text().count("COMPOSE_PROFILES=cpu") == 1


def test_gpu_verifier_reserves_a_gpu_and_uses_the_cuda_image(doc):
    gpu = [s for s in doc["services"].values() if cosine_service(s) == "verifier" and "gpu" in s.get("profiles", ())]
    assert len(gpu) == 1
    svc = gpu[0]
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", ()) for d in devices)
    assert svc["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    assert env_of(svc)["COSINE_DEVICE"] == "cuda"


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_cosine_variables_are_accepted_by_the_service_and_load(doc, kind):
    spec = SPECS[kind]
    found = False
    for name, svc in doc["services"].items():
        if cosine_service(svc) != kind:
            continue
        found = True
        env = env_of(svc)
        assert spec.unknown(env) == [], f"{name}: {kind} does not accept {spec.unknown(env)}"
        try:
            settings = spec.load(env)
        except SettingsError as exc:  # a bad value, e.g. a dtype the service refuses
            pytest.fail(f"{name}: {exc}")
        assert settings.host == "0.0.0.0", f"{name}: containers must listen on every interface"
        assert settings.port == spec.default_port, f"{name}: port {settings.port} != {kind} default {spec.default_port}"
        assert settings.advertise_address == f"{name}:{settings.port}", f"{name}: advertise its compose DNS name"
        assert settings.redis_url.startswith("redis://:") and "@redis:6379/" in settings.redis_url
    assert found, f"no compose service runs the {kind}"


def test_non_cosine_services_set_no_cosine_variables(doc):
    for name, svc in doc["services"].items():
        if cosine_service(svc) is None:
            assert not [k for k in env_of(svc) if k.startswith("COSINE_")], name


def test_addresses_point_at_real_services_and_ports(doc):
    services = doc["services"]
    for name, svc in services.items():
        env = env_of(svc)
        for key in ("COSINE_ROUTER_ADDRESS", "COSINE_VERIFIER_ADDRESS"):
            if key in env:
                host, port = env[key].rsplit(":", 1)
                assert host in services, f"{name}: {key} names unknown service {host}"
                peer = SPECS[cosine_service(services[host])]
                assert int(port) == peer.port(env_of(services[host]))


def test_health_checks_use_the_grpc_health_cli_on_the_real_port(doc):
    for name, svc in doc["services"].items():
        kind = cosine_service(svc)
        if kind is None:
            continue
        spec = SPECS[kind]
        test = svc["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "common.platform.healthcheck"], name
        assert test[4] == f"127.0.0.1:{spec.port(env_of(svc))}", name
        assert test[test.index("--service") + 1] == spec.health_service, name


def test_dependencies_wait_for_health_not_just_start(doc):
    services = doc["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: use the long form of depends_on with a condition"
        for dep, cond in deps.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert cond.get("condition") in HEALTHY_OR_DONE, f"{name} -> {dep}: {cond}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{dep} has no healthcheck"
            else:
                assert services[dep].get("restart") == "no", f"{dep} is a one-shot"
    for name, svc in services.items():
        if cosine_service(svc) in ("drafter", "verifier", "gateway"):
            assert svc["depends_on"]["zoo"]["condition"] == "service_completed_successfully"
        if cosine_service(svc):
            assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["router"]["condition"] == "service_healthy"


def test_volumes_are_declared_and_used(doc):
    declared = set(doc.get("volumes") or {})
    used = set()
    for name, svc in doc["services"].items():
        for mount in svc.get("volumes", ()):
            source = mount.split(":", 1)[0]
            if not source.startswith((".", "/", "$")):
                assert source in declared, f"{name} mounts undeclared volume {source}"
                used.add(source)
    assert used == declared == {"redis-data", "zoo"}
    assert "redis-data:/data" in doc["services"]["redis"]["volumes"]
    zoo_mounts = {n: m for n, s in doc["services"].items() for m in s.get("volumes", ()) if m.startswith("zoo:")}
    assert zoo_mounts.pop("zoo") == "zoo:/zoo"
    assert all(m == "zoo:/zoo:ro" for m in zoo_mounts.values()), zoo_mounts


def test_zoo_one_shot_builds_only_when_absent(doc):
    zoo = doc["services"]["zoo"]
    script = " ".join(zoo["command"])
    assert "[ -f /zoo/zoo.json ]" in script and "cosine models build --profile" in script and "--out /zoo" in script
    assert zoo["environment"]["ZOO_PROFILE"] in ("smol", "scratch", "tiny", "gpu")


def test_redis_has_a_volume_a_password_and_a_health_check(doc):
    redis = doc["services"]["redis"]
    assert "--requirepass" in " ".join(redis["command"])
    assert (
        redis["environment"]["REDIS_PASSWORD"]
        and redis["environment"]["REDISCLI_AUTH"] == redis["environment"]["REDIS_PASSWORD"]
    )
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    # persistence: profiles and request state survive a Redis restart (append-only file on the volume)
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--appendfsync everysec" in command and "--dir /data" in command
    assert any(v.endswith(":/data") for v in redis["volumes"])


def test_drafters_have_time_to_drain(doc):
    for name, svc in doc["services"].items():
        if cosine_service(svc) == "drafter":
            assert svc["stop_grace_period"] == "30s", name


def test_only_the_gateway_publishes_a_port(doc):
    published = {n for n, s in doc["services"].items() if s.get("ports")}
    assert published == {"gateway"}
    grpc_mapping, http_mapping = doc["services"]["gateway"]["ports"]
    assert grpc_mapping.endswith(f":{SPECS['gateway'].default_port}")
    assert http_mapping.endswith(f":{SPECS['gateway'].load({}).http_port}")


def test_metrics_ports_are_exposed_on_the_compose_network(doc):
    for name, service in doc["services"].items():
        role = name.split("-")[0]
        if role in SPECS:
            assert service["expose"] == [str(SPECS[role].load({}).metrics_port)], name


@pytest.mark.parametrize("dockerfile", ["docker/Dockerfile", "docker/Dockerfile.cuda"])
def test_dockerfile_targets_match_the_services(dockerfile):
    stages = dockerfile_targets(ROOT / dockerfile)
    assert "build" in stages and "runtime" in stages
    runtime = " ".join(stages["runtime"])
    assert "USER cosine" in runtime and "useradd" in runtime, "images run as a non-root user"
    build = " ".join(stages["build"])
    assert "grpc_tools.protoc" in build and "-c constraints.txt" in build and "torch==${TORCH_VERSION}" in build
    if dockerfile.endswith(".cuda"):
        assert "flash-attn" in build and "download.pytorch.org/whl/${TORCH_CUDA}" in build
    services_here = [s for s in stages if s in SPECS]
    assert services_here, dockerfile
    for kind in services_here:
        spec = SPECS[kind]
        lines = stages[kind]
        text = " ".join(lines)
        assert f"ENV COSINE_PORT={spec.default_port}" in text
        assert f"EXPOSE {spec.default_port}" in text
        (health,) = [line for line in lines if line.startswith("HEALTHCHECK")]
        assert (
            '-m common.platform.healthcheck "127.0.0.1:${COSINE_PORT}"' in health
            and f"--service {spec.health_service}" in health
        )
        assert f'CMD ["python", "-m", "{spec.module}"]' in lines
        assert (ROOT / spec.module.replace(".", "/") / "__main__.py").is_file()


def test_compose_builds_existing_targets(doc):
    for name, svc in doc["services"].items():
        build = svc.get("build")
        if build:
            stages = dockerfile_targets(ROOT / build.get("context", ".") / build["dockerfile"])
            assert build["target"] in stages, f"{name}: no stage {build['target']} in {build['dockerfile']}"


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_health_names_are_the_ones_the_servers_register(kind):
    server = importlib.import_module(f"services.{kind}.server")
    assert SPECS[kind].health_service == server.SERVICE_NAME
