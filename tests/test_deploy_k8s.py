"""The Helm chart in k8s/, rendered by Helm's own library (deploy.helm_chart) with the default
values, the multi-drafter example and an external-Redis/CPU variant, then checked:

- `helm lint --strict` finds no warning or error;
- every object validates against the Kubernetes OpenAPI schemas (kubernetes-validate, strict);
- every COSINE_* variable a container gets (env + envFrom ConfigMaps) is accepted by the service
  the container runs, and the service's settings load from it;
- containers listen on the port the settings give, probes are gRPC health probes on that port and
  the service's health name (with TLS on: the image's health check over TLS, since Kubernetes'
  gRPC probes cannot speak TLS), Services, HPAs, PDBs and NetworkPolicies point at what exists;
- with TLS on, every certificate, key and CA path a service is given lies in the read-only mount
  of the TLS Secret.
"""

from pathlib import Path

import pytest
import yaml

from common.platform.settings import SettingsError
from deploy.helm_chart import ChartError, lint, render_objects
from deploy.settings_index import service_specs

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "k8s"
MULTI = CHART / "examples" / "values-multi-drafter.yaml"
SPECS = service_specs()
K8S_VERSIONS = ("1.30.0", "1.37.0")  # oldest and newest schema sets checked
TLS = ["tls.enabled=true", "tls.secretName=cosine-tls"]
EXTERNAL = [
    "redis.enabled=false",
    "redis.externalUrl=redis://:pw@redis.example.internal:6379/0",
    "verifier.gpu.enabled=false",
    "networkPolicy.enabled=false",
]

RENDERS = {
    "default": dict(),
    "multi-drafter": dict(values_files=[MULTI]),
    "external-redis-cpu": dict(set_values=EXTERNAL),
    "tls": dict(values_files=[MULTI], set_values=TLS),
}


@pytest.mark.parametrize("name", sorted(RENDERS))
def test_helm_lint_strict_finds_nothing(name):
    kwargs = RENDERS[name]
    report = lint(CHART, kwargs.get("values_files", ()), kwargs.get("set_values", ()))
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.fixture(scope="module", params=sorted(RENDERS))
def rendered(request):
    return request.param, render_objects(CHART, **RENDERS[request.param])


def by_kind(objects, kind):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_templates(objects):
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield o, o["spec"]["template"]


def cosine_containers(objects):
    """(workload, pod spec, container, service spec) for every container that runs a CoSine service."""
    for workload, template in pod_templates(objects):
        for c in template["spec"]["containers"]:
            cmd = c.get("command") or []
            if cmd[:2] == ["python", "-m"] and cmd[2].startswith("services."):
                yield workload, template, c, SPECS[cmd[2].split(".")[1]]


def container_env(objects, container):
    """The environment the container sees: envFrom ConfigMaps/Secrets, then env (fieldRefs and
    secretKeyRefs resolved, $(VAR) references expanded as the kubelet does)."""
    configmaps, secrets = by_kind(objects, "ConfigMap"), by_kind(objects, "Secret")
    env: dict[str, str] = {}
    for source in container.get("envFrom", ()):
        if "configMapRef" in source:
            env.update(configmaps[source["configMapRef"]["name"]]["data"])
        else:
            env.update(secrets[source["secretRef"]["name"]]["stringData"])
    for item in container.get("env", ()):
        if "value" in item:
            value = item["value"]
            for k, v in env.items():
                value = value.replace(f"$({k})", v)
        elif "fieldRef" in item["valueFrom"]:
            value = {"status.podIP": "10.1.2.3", "metadata.name": "pod-0"}[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            value = (
                secrets[ref["name"]]["stringData"][ref["key"]]
                if ref["name"] in secrets
                else "redis://:external@redis:6379/0"
            )
        env[item["name"]] = value
    return env


def probe_check(probe, tls: bool) -> dict:
    """{"port", "service"} a probe checks: Kubernetes' gRPC probe (plaintext), or the image's
    health check command over TLS (``python -m common.platform.healthcheck 127.0.0.1:PORT [--service S]``,
    which reads the container's COSINE_TLS_* variables). Empty when it is neither."""
    if not tls:
        return probe.get("grpc") or {}
    cmd = (probe.get("exec") or {}).get("command") or []
    if (
        cmd[:3] != ["python", "-m", "common.platform.healthcheck"]
        or len(cmd) < 4
        or not cmd[3].startswith("127.0.0.1:")
    ):
        return {}
    service = cmd[cmd.index("--service") + 1] if "--service" in cmd else ""
    return {"port": int(cmd[3].rsplit(":", 1)[1]), "service": service}


def tls_problems(template, container, settings) -> list[str]:
    """Every TLS file the settings name must lie in a read-only mount of a Secret volume."""
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    mounts = [m for m in container.get("volumeMounts", ()) if "secret" in volumes.get(m["name"], {})]
    out = []
    for flag, path in (("tls_cert", settings.tls_cert), ("tls_key", settings.tls_key), ("tls_ca", settings.tls_ca)):
        if path and not any(path.startswith(m["mountPath"].rstrip("/") + "/") and m.get("readOnly") for m in mounts):
            out.append(f"{flag} {path} is not in a read-only Secret mount")
    if settings.tls_client_auth and not settings.tls_ca:
        out.append("client authentication without a CA")
    return out


def problems(objects) -> list[str]:
    """Everything wrong with a rendered chart against the code (empty when right)."""
    out = []
    services = by_kind(objects, "Service")
    for workload, template, c, spec in cosine_containers(objects):
        where = f"{workload['metadata']['name']}/{c['name']}"
        env = container_env(objects, c)
        unknown = spec.unknown(env)
        if unknown:
            out.append(f"{where}: {spec.name} does not accept {unknown}")
            continue
        try:
            settings = spec.load(env)
        except SettingsError as exc:
            out.append(f"{where}: {exc}")
            continue
        if settings.host != "0.0.0.0":
            out.append(f"{where}: listens on {settings.host}, not on every interface")
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        if ports.get("grpc") != settings.port:
            out.append(f"{where}: containerPort {ports.get('grpc')} but the service listens on {settings.port}")
        if ports.get("metrics", -1) != settings.metrics_port:
            out.append(
                f"{where}: metrics containerPort {ports.get('metrics')} but /metrics is on {settings.metrics_port}"
            )
        if ports.get("http", -1) != getattr(settings, "http_port", -1):
            out.append(
                f"{where}: http containerPort {ports.get('http')} but the HTTP API is on "
                f"{getattr(settings, 'http_port', -1)}"
            )
        scrape = (template["metadata"].get("annotations") or {}).get("prometheus.io/port")
        if scrape is not None and int(scrape) != settings.metrics_port:
            out.append(f"{where}: scrape annotation on port {scrape}, /metrics is on {settings.metrics_port}")
        if settings.advertise_address != f"10.1.2.3:{settings.port}":
            out.append(f"{where}: advertises {settings.advertise_address}, not the pod's own address")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            grpc = probe_check(c.get(probe, {}), bool(settings.tls_cert))
            if not grpc:
                out.append(f"{where}: {probe} is not a gRPC health probe" + (" over TLS" if settings.tls_cert else ""))
            elif grpc["port"] != settings.port:
                out.append(f"{where}: {probe} on port {grpc['port']}, the service listens on {settings.port}")
            elif grpc.get("service", "") not in ("", spec.health_service):
                out.append(f"{where}: {probe} asks for health of {grpc['service']!r}")
        if probe_check(c["readinessProbe"], bool(settings.tls_cert)).get("service") != spec.health_service:
            out.append(f"{where}: readiness must ask for {spec.health_service}")
        out.extend(f"{where}: {p}" for p in tls_problems(template, c, settings))
        labels = template["metadata"]["labels"]
        matching = [s for s in services.values() if s["spec"]["selector"].items() <= labels.items()]
        if not matching:
            out.append(f"{where}: no Service selects it")
        for s in matching:
            for p in s["spec"]["ports"]:
                listening = {"grpc": settings.port, "http": getattr(settings, "http_port", -1)}.get(
                    p["name"], settings.port
                )
                if ports.get(p["targetPort"], p["targetPort"]) != listening:
                    out.append(
                        f"Service {s['metadata']['name']}: targetPort {p['targetPort']} is not the {spec.name} port"
                    )
    return out


def test_render_needs_no_helm_and_gives_objects(rendered):
    name, objects = rendered
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "ConfigMap", "Secret", "PodDisruptionBudget"} <= kinds
    if name != "external-redis-cpu":
        assert {"StatefulSet", "NetworkPolicy", "HorizontalPodAutoscaler"} <= kinds
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), "duplicate objects"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(rendered, version):
    import kubernetes_validate

    _, objects = rendered
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{obj['kind']}/{obj['metadata']['name']} (k8s {version}): {exc.message} at "
                f"{'/'.join(map(str, exc.path))}"
            )


def test_settings_ports_and_probes_match_the_services(rendered):
    _, objects = rendered
    assert problems(objects) == []
    assert {spec.name for *_, spec in cosine_containers(objects)} == set(SPECS)


def test_a_misspelt_setting_fails_the_check():
    objects = render_objects(CHART, set_values=["router.env.COSINE_DRAFTER_PER_REQUEST=3"])
    assert any("COSINE_DRAFTER_PER_REQUEST" in p for p in problems(objects))
    objects = render_objects(CHART, set_values=["verifier.dtype=float64"])
    assert any("COSINE_DTYPE" in p for p in problems(objects))
    objects = render_objects(CHART, set_values=["drafterDefaults.env.COSINE_PORT=6000"])
    assert any("containerPort 50054" in p for p in problems(objects))


@pytest.mark.parametrize("values", [None, MULTI])
def test_one_drafter_deployment_per_listed_model(values):
    objects = render_objects(CHART, [values] if values else [])
    listed = yaml.safe_load((values or CHART / "values.yaml").read_text())["drafters"]
    drafters = {
        c_env["COSINE_DRAFTERS"]: w
        for w, _, c, spec in cosine_containers(objects)
        if spec.name == "drafter"
        for c_env in [container_env(objects, c)]
    }
    assert sorted(drafters) == sorted(f"{d['name']}={d['path']}" for d in listed)
    assert len(listed) >= 2
    hpas = by_kind(objects, "HorizontalPodAutoscaler")
    deployments = by_kind(objects, "Deployment")
    for hpa in hpas.values():
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] in deployments
        assert "replicas" not in deployments[target["name"]]["spec"], "the HPA owns replicas"
    autoscaled = [d for d in listed if (d.get("autoscaling") or {}).get("enabled", True)]
    assert len(hpas) == len(autoscaled) >= 1


def test_verifier_runs_on_a_gpu_node():
    objects = render_objects(CHART)
    (verifier,) = [w for w, _, _, spec in cosine_containers(objects) if spec.name == "verifier"]
    pod = verifier["spec"]["template"]["spec"]
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"].endswith("-verifier-cuda:0.1.0")
    assert container_env(objects, container)["COSINE_DEVICE"] == "cuda"
    cpu = render_objects(CHART, set_values=["verifier.gpu.enabled=false"])
    (verifier,) = [w for w, _, _, spec in cosine_containers(cpu) if spec.name == "verifier"]
    pod = verifier["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]


def test_every_workload_has_requests_and_a_pdb(rendered):
    _, objects = rendered
    pdbs = by_kind(objects, "PodDisruptionBudget")
    for workload, template in pod_templates(objects):
        for c in template["spec"]["containers"]:
            assert c["resources"]["requests"], f"{workload['metadata']['name']}: no resource requests"
        if workload["kind"] == "Deployment":
            labels = template["metadata"]["labels"]
            assert any(p["spec"]["selector"]["matchLabels"].items() <= labels.items() for p in pdbs.values()), workload[
                "metadata"
            ]["name"]


def test_redis_statefulset_or_external_url():
    objects = render_objects(CHART)
    (sts,) = by_kind(objects, "StatefulSet").values()
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--appendfsync") + 1] == "everysec"
    assert args[args.index("--dir") + 1] == "/data"  # the claim's mount: the append-only file survives the pod
    for name, dep in by_kind(objects, "Deployment").items():
        if "drafter" in name:
            assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 20  # room for the drain
    secret = by_kind(objects, "Secret")["cosine-redis"]["stringData"]
    assert secret["redis-url"] == f"redis://:{secret['redis-password']}@cosine-redis:6379/0"
    external = render_objects(CHART, set_values=EXTERNAL)
    assert "StatefulSet" not in {o["kind"] for o in external}
    assert by_kind(external, "Secret")["cosine-redis"]["stringData"] == {
        "redis-url": "redis://:pw@redis.example.internal:6379/0"
    }
    with pytest.raises(ChartError, match="redis.externalUrl is required"):
        render_objects(CHART, set_values=["redis.enabled=false"])


def _selected(policy, labels):
    return policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


def _peers_allowed(objects, policy):
    """Components allowed in to the service's own ports by a policy ('*' when anyone may connect);
    the metrics rule (a second rule) is checked on its own."""
    allowed = set()
    components = {"gateway", "router", "verifier", "drafter", "redis", "zoo"}
    for rule in policy["spec"]["ingress"][:1]:
        if not rule.get("from"):
            return {"*"}
        for peer in rule["from"]:
            if "ipBlock" in peer:
                allowed.add(f"ip:{peer['ipBlock']['cidr']}")
                continue
            sel = peer["podSelector"]
            for comp in components:
                labels = {
                    "app.kubernetes.io/name": "cosine",
                    "app.kubernetes.io/instance": "cosine",
                    "app.kubernetes.io/component": comp,
                }
                ok = sel.get("matchLabels", {}).items() <= labels.items() and all(
                    labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions", ())
                )
                if ok:
                    allowed.add(comp)
    return allowed


@pytest.mark.parametrize("values", [None, MULTI])
def test_network_policies_expose_only_the_gateway(values):
    objects = render_objects(CHART, [values] if values else [])
    policies = by_kind(objects, "NetworkPolicy")
    deny = policies.pop("cosine-default-deny")
    assert deny["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in deny["spec"]
    for _, template in pod_templates(objects):
        assert _selected(deny, template["metadata"]["labels"]), "every pod of the release starts from deny-all"
    allowed = {}
    for policy in policies.values():
        comp = policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        allowed[comp] = _peers_allowed(objects, policy)
    expected_gateway = {"*"} if values is None else {"ip:10.0.0.0/8"}
    # Redis: every CoSine service registers its membership there, so all four reach it; nothing else.
    assert allowed == {
        "gateway": expected_gateway,
        "router": {"gateway"},
        "verifier": {"router"},
        "drafter": {"router"},
        "redis": {"gateway", "router", "verifier", "drafter"},
    }
    ports = {
        p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p["spec"]["ingress"][0]["ports"][0][
            "port"
        ]
        for p in policies.values()
    }
    assert ports == {**{n: SPECS[n].default_port for n in SPECS}, "redis": 6379}
    gateway_policy = policies["cosine-gateway"]["spec"]["ingress"][0]
    assert [p["port"] for p in gateway_policy["ports"]] == [SPECS["gateway"].default_port, 8000]  # gRPC and HTTP
    # scrapers reach each CoSine pod's /metrics port (and nothing else) through a second rule
    metrics_ports = {"gateway": 9100, "router": 9101, "verifier": 9102, "drafter": 9103}
    for p in policies.values():
        comp = p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        rules = p["spec"]["ingress"]
        if comp == "redis":
            assert len(rules) == 1
        else:
            assert len(rules) == 2 and [q["port"] for q in rules[1]["ports"]] == [metrics_ports[comp]], comp
    assert by_kind(objects, "Service")["cosine-gateway"]["spec"]["type"] == (
        "ClusterIP" if values is None else "LoadBalancer"
    )
    for name, svc in by_kind(objects, "Service").items():
        if name != "cosine-gateway":
            assert svc["spec"].get("type", "ClusterIP") == "ClusterIP", name


def test_models_volume_and_zoo_job():
    objects = render_objects(CHART)
    (job,) = by_kind(objects, "Job").values()
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "[ -f /models/zoo/zoo.json ]" in script and "cosine models build --profile smol --out /models/zoo" in script
    assert "cosine-models" in by_kind(objects, "PersistentVolumeClaim")
    for _, template, c, spec in cosine_containers(objects):
        if spec.name in ("verifier", "drafter", "gateway"):
            mounts = {m["name"]: m for m in c["volumeMounts"]}
            assert mounts["models"]["readOnly"] is True and mounts["models"]["mountPath"] == "/models"
            assert [i["name"] for i in template["spec"]["initContainers"]] == ["wait-for-models"]
    multi = render_objects(CHART, [MULTI])
    assert "Job" not in {o["kind"] for o in multi} and "PersistentVolumeClaim" not in {o["kind"] for o in multi}
    for _, template, c, spec in cosine_containers(multi):
        if spec.name in ("verifier", "drafter", "gateway"):
            volumes = {v["name"]: v for v in template["spec"]["volumes"]}
            assert volumes["models"]["nfs"]["server"] == "nfs.example.internal"
            assert "initContainers" not in template["spec"]


def test_pods_run_as_non_root_with_read_only_root(rendered):
    _, objects = rendered
    for workload, template in pod_templates(objects):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, workload["metadata"]["name"]
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_set_values_and_files_merge_as_helm_reads_them(tmp_path):
    from deploy.helm_chart import parse_set, user_values

    assert parse_set(["a.b=3", "a.c=true", "d=x", "e="]) == {"a": {"b": 3, "c": True}, "d": "x", "e": ""}
    f = tmp_path / "v.yaml"
    f.write_text("a: {b: 1, keep: yes}\nlist: [1, 2]\n")
    assert user_values([f], ["a.b=2"]) == {"a": {"b": 2, "keep": True}, "list": [1, 2]}
    with pytest.raises(ChartError, match="KEY=VALUE"):
        parse_set(["novalue"])


def test_cli_prints_what_helm_template_prints(capsys):
    from deploy.helm_chart import main

    assert main([str(CHART), "-f", str(MULTI)]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap"}
    assert len(docs) == len(render_objects(CHART, [MULTI]))
    assert main([str(CHART), "--set", "redis.enabled=false"]) == 1
    assert "redis.externalUrl is required" in capsys.readouterr().err


def test_metrics_ports_annotations_and_pod_monitor(tmp_path):
    objects = render_objects(CHART)
    services = 0
    for workload, _, _, spec in cosine_containers(objects):
        ann = workload["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics", spec.name
        services += 1
    assert services >= 5  # gateway, router, verifier and two drafters
    assert "PodMonitor" not in {o["kind"] for o in objects}
    monitored = render_objects(
        CHART, set_values=["metrics.podMonitor.enabled=true", "metrics.podMonitor.labels.release=prom"]
    )
    (pm,) = [o for o in monitored if o["kind"] == "PodMonitor"]
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics" and pm["metadata"]["labels"]["release"] == "prom"
    scoped = tmp_path / "scrapers.yaml"
    scoped.write_text(
        yaml.safe_dump(
            {"networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]}}
        )
    )
    for policy in by_kind(render_objects(CHART, [scoped]), "NetworkPolicy").values():
        rules = policy["spec"].get("ingress", [])
        if len(rules) == 2:
            assert rules[1]["from"] == [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    off = render_objects(CHART, set_values=["metrics.enabled=false"])
    assert problems(off) == []  # off: no metrics port, and the services are told -1
    for _, _, c, spec in cosine_containers(off):
        assert "metrics" not in {p["name"] for p in c["ports"]}
        assert container_env(off, c)["COSINE_METRICS_PORT"] == "-1"


def test_api_keys_on_by_default_from_a_secret(tmp_path):
    objects = render_objects(CHART)
    secret = by_kind(objects, "Secret")["cosine-api-keys"]
    assert len(secret["data"]["keys"]) >= 40  # a generated key, base64
    gateway = by_kind(objects, "Deployment")["cosine-gateway"]
    (c,) = gateway["spec"]["template"]["spec"]["containers"]
    assert container_env(objects, c)["COSINE_API_KEYS_FILE"] == "/etc/cosine/api-keys/keys"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "api-keys")
    volume = next(v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys")
    assert mount["mountPath"] == "/etc/cosine/api-keys" and volume["secret"]["secretName"] == "cosine-api-keys"
    given = tmp_path / "keys.yaml"
    given.write_text(yaml.safe_dump({"gateway": {"apiKeys": {"keys": ["k-one", "k-two"]}}}))
    assert by_kind(render_objects(CHART, [given]), "Secret")["cosine-api-keys"]["stringData"]["keys"] == "k-one\nk-two"
    own = render_objects(CHART, set_values=["gateway.apiKeys.existingSecret=team-keys"])
    assert "cosine-api-keys" not in by_kind(own, "Secret")
    volume = next(
        v
        for v in by_kind(own, "Deployment")["cosine-gateway"]["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "api-keys"
    )
    assert volume["secret"]["secretName"] == "team-keys"
    off = render_objects(CHART, set_values=["gateway.apiKeys.enabled=false"])
    assert "cosine-api-keys" not in by_kind(off, "Secret") and problems(off) == []
    (c,) = by_kind(off, "Deployment")["cosine-gateway"]["spec"]["template"]["spec"]["containers"]
    assert "COSINE_API_KEYS_FILE" not in container_env(off, c)


def test_tls_mounts_the_secret_and_turns_on_mtls_between_services():
    objects = render_objects(CHART, set_values=TLS)
    assert problems(objects) == []
    auth = {}
    for _, template, c, spec in cosine_containers(objects):
        env = container_env(objects, c)
        settings = spec.load(env)
        assert (settings.tls_cert, settings.tls_key, settings.tls_ca) == (
            "/etc/cosine/tls/tls.crt",
            "/etc/cosine/tls/tls.key",
            "/etc/cosine/tls/ca.crt",
        )
        assert settings.tls_server_name == "cosine"
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == "cosine-tls" and volume["secret"]["defaultMode"] == 0o440
        auth.setdefault(spec.name, set()).add(settings.tls_client_auth)
        assert all("exec" in c[p] and "grpc" not in c[p] for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    # the services require each other's certificates; the public gateway does not ask clients for one
    assert auth == {"gateway": {False}, "router": {True}, "verifier": {True}, "drafter": {True}}

    both = render_objects(CHART, set_values=[*TLS, "tls.gatewayClientAuth=true", "tls.serverName=cosine.internal"])
    assert problems(both) == []
    for _, _, c, spec in cosine_containers(both):
        settings = spec.load(container_env(both, c))
        assert settings.tls_client_auth and settings.tls_server_name == "cosine.internal"
    plain_inside = render_objects(CHART, set_values=[*TLS, "tls.mtls=false"])
    assert {
        spec.name: spec.load(container_env(plain_inside, c)).tls_client_auth
        for _, _, c, spec in cosine_containers(plain_inside)
    } == {"gateway": False, "router": False, "verifier": False, "drafter": False}


def test_tls_off_is_plaintext_with_grpc_probes_and_a_missing_secret_is_an_error():
    objects = render_objects(CHART)
    for _, template, c, spec in cosine_containers(objects):
        assert not [k for k in container_env(objects, c) if k.startswith("COSINE_TLS_")]
        assert "tls" not in {v["name"] for v in template["spec"]["volumes"]}
        assert c["readinessProbe"]["grpc"]["service"] == spec.health_service
    with pytest.raises(ChartError, match="tls.secretName is required"):
        render_objects(CHART, set_values=["tls.enabled=true"])


def test_a_tls_file_outside_the_secret_mount_fails_the_check():
    objects = render_objects(CHART, set_values=TLS)
    (router,) = [c for _, _, c, spec in cosine_containers(objects) if spec.name == "router"]
    next(e for e in router["env"] if e["name"] == "COSINE_TLS_CA")["value"] = "/tmp/ca.pem"
    assert problems(objects) == ["cosine-router/router: tls_ca /tmp/ca.pem is not in a read-only Secret mount"]
    (gateway,) = [c for _, _, c, spec in cosine_containers(objects) if spec.name == "gateway"]
    gateway["readinessProbe"] = {"grpc": {"port": 50051, "service": "cosine.v1.Gateway"}}
    assert "cosine-gateway/gateway: readinessProbe is not a gRPC health probe over TLS" in problems(objects)
