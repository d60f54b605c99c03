"""`make chart-check`: the Helm chart's pods run as containers on this machine, then checked.

The chart in k8s/ is rendered by Helm's own library (deploy/helm_chart.py) for a small profile: the
tiny zoo, one replica of everything, no autoscaling, the CPU images built here, a fresh Redis
password and API key. Every container of the rendered Job, StatefulSet and Deployments becomes one
``podman run`` (or ``docker run``) with the pod's image, command and args (``$(VAR)`` expanded as the
kubelet does), env (values, ConfigMap and Secret references, ``envFrom``, the downward API's
``status.podIP``/``metadata.name``), volumes (claims as named volumes of this check, chown'd to the
pod's user as ``fsGroup`` would; ``emptyDir`` as tmpfs; Secret volumes as read-only files), user
(``runAsUser``/``runAsGroup``, ``fsGroup`` as a supplementary group), container security (read-only
root filesystem, no capabilities, no privilege escalation) and restart policy. All of them join one
network namespace that has only loopback, as in `make compose-check`, and reach each other by their
Service names through an /etc/hosts mapping every name to 127.0.0.1. Where two pods would listen on
one port in that namespace (the drafters), the later one gets the next free ports, and its env and
probes follow.

As the kubelet would, the Job, the StatefulSet and every pod's init containers start together; a
pod's containers start once its init containers have exited 0; the pods are ready when their
startup and readiness probes pass (gRPC, exec and TCP probes, run by this script: gRPC and TCP from
the namespace as the kubelet dials a pod, exec inside the container). Then the checks of
`make compose-check` (deploy/pod_check.py) run in the namespace, and everything is torn down.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from deploy.pod_check import RESULTS, ROOT, Cluster, Engine, check, checks_in_namespace, run_checks, sh, summary

POD = "cosine-chart"
PROFILE = [
    "models.buildZoo.profile=tiny",
    "verifier.gpu.enabled=false",
    "verifier.dtype=float32",
    "gateway.replicas=1",
    "router.replicas=1",
    "drafterDefaults.autoscaling.enabled=false",
    "drafterDefaults.replicas=1",
]
DEADLINE = [float("inf")]


def render(password: str, api_key: str, tag: str, redis_image: str) -> list[dict]:
    from deploy.helm_chart import render_objects

    sets = [*PROFILE, "image.registry=localhost/", f"image.tag={tag}", f"redis.password={password}"]
    sets.append(f"redis.image={redis_image}")
    sets.append(f"gateway.apiKeys.keys=[{api_key}]")
    return render_objects(ROOT / "k8s", set_values=sets)


def _by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def secret_data(obj: dict) -> dict[str, str]:
    out = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
    out.update(obj.get("stringData") or {})
    return out


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion ($$ escapes; unknown names are left as written)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]) if m[1] else "$", text)


def container_env(c: dict, pod_name: str, configmaps: dict, secrets_: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in c.get("envFrom", ()):
        if "configMapRef" in src:
            env.update(configmaps[src["configMapRef"]["name"]]["data"])
        elif "secretRef" in src:
            env.update(secret_data(secrets_[src["secretRef"]["name"]]))
    fields = {"status.podIP": "127.0.0.1", "metadata.name": pod_name, "metadata.namespace": "default"}
    for item in c.get("env", ()):
        ref = item.get("valueFrom")
        if ref is None:
            env[item["name"]] = expand(str(item.get("value", "")), env)
        elif "fieldRef" in ref:
            env[item["name"]] = fields[ref["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in ref:
            env[item["name"]] = secret_data(secrets_[ref["secretKeyRef"]["name"]])[ref["secretKeyRef"]["key"]]
        elif "configMapKeyRef" in ref:
            env[item["name"]] = configmaps[ref["configMapKeyRef"]["name"]]["data"][ref["configMapKeyRef"]["key"]]
    return {k: str(v) for k, v in env.items()}


def plan(objects: list[dict]) -> list[dict[str, Any]]:
    """One entry per pod: its name, kind, restart policy, init containers and containers, each with
    the podman arguments, resolved env, ports and probes."""
    configmaps, secrets_ = _by_kind(objects, "ConfigMap"), _by_kind(objects, "Secret")
    used: set[int] = set()
    pods = []
    for kind in ("Job", "StatefulSet", "Deployment"):
        for name, obj in _by_kind(objects, kind).items():
            spec = obj["spec"]["template"]["spec"]
            replicas = obj["spec"].get("replicas", 1)
            if replicas != 1:
                raise RuntimeError(f"{kind} {name}: {replicas} replicas; the small profile has one")
            pod_name = f"{name}-0" if kind == "StatefulSet" else f"{name}-check"
            claims = {t["metadata"]["name"]: f"{POD}-{name}-{t['metadata']['name']}" for t in
                      obj["spec"].get("volumeClaimTemplates", ())}  # fmt: skip
            pod = {"name": name, "kind": kind, "pod": pod_name, "spec": spec, "claims": claims}
            pod["restart"] = {"Always": "always", "OnFailure": "on-failure", "Never": "no"}[
                spec.get("restartPolicy", "Always")
            ]
            for group in ("initContainers", "containers"):
                pod[group] = []
                for c in spec.get(group, ()):
                    env = container_env(c, pod_name, configmaps, secrets_)
                    ports = {p.get("name", str(p["containerPort"])): p["containerPort"] for p in c.get("ports", ())}
                    moved = {}
                    for port in ports.values():
                        new = port
                        while new in used:
                            new += 1
                        used.add(new)
                        if new != port:
                            moved[port] = new
                    for old, new in moved.items():  # the pod's env follows its moved ports
                        env = {k: re.sub(rf"(^|:){old}$", rf"\g<1>{new}", v) for k, v in env.items()}
                    ports = {k: moved.get(v, v) for k, v in ports.items()}
                    probes = {k: _probe(c[k], ports, moved) for k in ("startupProbe", "readinessProbe", "livenessProbe")
                              if k in c}  # fmt: skip
                    pod[group].append({"c": c, "env": env, "ports": ports, "moved": moved, "probes": probes})
            pods.append(pod)
    return pods


def _probe(probe: dict, ports: dict[str, int], moved: dict[int, int]) -> dict[str, Any]:
    def port(p: Any) -> int:
        return ports[p] if isinstance(p, str) and not p.isdigit() else moved.get(int(p), int(p))

    out: dict[str, Any] = {"period": probe.get("periodSeconds", 10), "failures": probe.get("failureThreshold", 3)}
    if "grpc" in probe:
        out["grpc"] = [f"127.0.0.1:{port(probe['grpc']['port'])}", probe["grpc"].get("service", "")]
    elif "tcpSocket" in probe:
        out["tcp"] = port(probe["tcpSocket"]["port"])
    elif "exec" in probe:
        out["exec"] = probe["exec"]["command"]
    else:
        raise RuntimeError(f"probe kind not supported by this check: {sorted(probe)}")
    return out


def cname(pod: dict, c: dict) -> str:
    return f"{POD}-{pod['name']}-{c['c']['name']}"


def run_args(engine: Engine, pod: dict, c: dict, tmp: Path, restart: str) -> list[str]:
    spec, sc = pod["spec"], pod["spec"].get("securityContext") or {}
    csc = c["c"].get("securityContext") or {}
    user, group = csc.get("runAsUser", sc.get("runAsUser")), csc.get("runAsGroup", sc.get("runAsGroup"))
    if (csc.get("runAsNonRoot") or sc.get("runAsNonRoot")) and not user:
        raise RuntimeError(f"{cname(pod, c)}: runAsNonRoot without a numeric runAsUser")
    args = ["run", "-d", "--name", cname(pod, c), "--label", f"{POD}=1", *engine.flags]
    args += ["--network", f"container:{POD}-net", "-v", f"{tmp / 'hosts'}:/etc/hosts:ro", "--hostname", pod["pod"]]
    if user is not None:
        args += ["--user", f"{user}:{group if group is not None else user}"]
    if sc.get("fsGroup") is not None:
        args += ["--group-add", str(sc["fsGroup"])]
    if csc.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"] if engine.cmd == "podman" else ["--read-only"]
    if csc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    for cap in (csc.get("capabilities") or {}).get("drop", ()):
        args += ["--cap-drop", cap]
    if restart != "no":
        args += ["--restart", restart]
    volumes = {v["name"]: v for v in spec.get("volumes", ())}
    for m in c["c"].get("volumeMounts", ()):
        # nocopy: a claim is not filled from the image's directory (podman's copy-up would also reset
        # its owner to that directory's, undoing fsGroup)
        mode = ":ro,nocopy" if m.get("readOnly", False) else ":nocopy"
        v = volumes.get(m["name"])
        if v is None and m["name"] in pod["claims"]:
            args += ["-v", f"{pod['claims'][m['name']]}:{m['mountPath']}{mode}"]
        elif "persistentVolumeClaim" in v:
            args += ["-v", f"{POD}-{v['persistentVolumeClaim']['claimName']}:{m['mountPath']}{mode}"]
        elif "emptyDir" in v:
            args += ["--tmpfs", f"{m['mountPath']}:rw,mode=1777"]
        elif "secret" in v:
            d = tmp / "secrets" / v["secret"]["secretName"]
            args += ["-v", f"{d}:{m['mountPath']}:ro"]
        else:
            raise RuntimeError(f"{cname(pod, c)}: volume {m['name']} of a kind this check does not run: {sorted(v)}")
    for k, val in c["env"].items():
        args += ["-e", f"{k}={val}"]
    cmd = [expand(x, c["env"]) for x in c["c"].get("command", ())]
    rest = [expand(x, c["env"]) for x in c["c"].get("args", ())]
    if cmd:
        args += ["--entrypoint", json.dumps(cmd)]
    return [*args, c["c"]["image"], *rest]


def write_secret_volumes(objects: list[dict], pods: list[dict], tmp: Path) -> None:
    secrets_ = _by_kind(objects, "Secret")
    for pod in pods:
        for v in pod["spec"].get("volumes", ()):
            if "secret" in v:
                s = v["secret"]
                data = secret_data(secrets_[s["secretName"]])
                d = tmp / "secrets" / s["secretName"]
                d.mkdir(parents=True, exist_ok=True)
                for item in s.get("items") or [{"key": k, "path": k} for k in data]:
                    (d / item["path"]).write_text(data[item["key"]])
                    (d / item["path"]).chmod(s.get("defaultMode", 0o644))
                d.chmod(0o755)


def probe_ok(engine: Engine, name: str, probe: dict, netns: str | None) -> bool:
    ns = ["nsenter", "-t", netns, "-n"] if netns else []
    try:
        if "grpc" in probe:
            address, service = probe["grpc"]
            cmd = [*ns, sys.executable, "-m", "common.platform.healthcheck", address, "--timeout", "3"]
            res = subprocess.run(cmd + (["--service", service] if service else []), capture_output=True, timeout=20)
            return res.returncode == 0
        if "tcp" in probe:
            if netns:
                code = f"import socket; socket.create_connection(('127.0.0.1', {probe['tcp']}), 3)"
                res = subprocess.run([*ns, sys.executable, "-c", code], capture_output=True, timeout=20)
                return res.returncode == 0
            socket.create_connection(("127.0.0.1", probe["tcp"]), 3).close()
            return True
    except (OSError, subprocess.TimeoutExpired):
        return False
    return engine.exec_ok(name, probe["exec"], timeout=20)


def wait_ready(engine: Engine, pods: list[dict], names: list[str], netns: str | None, timeout_s: float, t0=None):
    """Waits until every named pod's containers pass their startup, then readiness probes (or, for a
    Job, exit 0); returns pod name -> seconds from ``t0`` (default: now) until it was seen ready."""
    deadline, t0, done = min(time.monotonic() + timeout_s, DEADLINE[0]), t0 or time.monotonic(), {}
    todo = [p for p in pods if p["name"] in names]
    while todo and time.monotonic() < deadline:
        for pod in list(todo):
            ready = True
            for c in pod["containers"]:
                state = engine.state(cname(pod, c))
                if pod["kind"] == "Job":
                    if state["Status"] == "exited" and state["ExitCode"] == 0 and pod["restart"] != "always":
                        continue
                    ready = False
                elif not state["Running"] or not all(
                    probe_ok(engine, cname(pod, c), c["probes"][k], netns)
                    for k in ("startupProbe", "readinessProbe")
                    if k in c["probes"]
                ):
                    ready = False
            if ready:
                done[pod["name"]] = time.monotonic() - t0
                todo.remove(pod)
        time.sleep(2)
    if todo:
        last = todo[0]
        raise RuntimeError(f"{last['name']} not ready: {engine.logs(cname(last, last['containers'][0]))}")
    return done


def bring_up(engine: Engine, objects: list[dict], pods: list[dict], tmp: Path, timeout_s: float) -> str:
    hosts = sorted(o["metadata"]["name"] for o in objects if o["kind"] == "Service")
    hosts += [f"{p['pod']}.{p['name']}" for p in pods if p["kind"] == "StatefulSet"]
    (tmp / "hosts").write_text("127.0.0.1 localhost " + " ".join(hosts) + "\n::1 localhost\n")
    write_secret_volumes(objects, pods, tmp)
    for claim in {f"{POD}-{o['metadata']['name']}" for o in objects if o["kind"] == "PersistentVolumeClaim"} | {
        v for p in pods for v in p["claims"].values()
    }:
        engine("volume", "create", "--label", f"{POD}=1", claim)
    tools = next(c["c"]["image"] for p in pods if p["kind"] == "Job" for c in p["containers"])
    primed: set[str] = set()
    for pod in pods:  # fsGroup as the kubelet applies it: the claim's root group-owned, setgid, group-writable
        group = (pod["spec"].get("securityContext") or {}).get("fsGroup")
        claims = {v["name"]: f"{POD}-{v['persistentVolumeClaim']['claimName']}" for v in pod["spec"].get("volumes", ())
                  if "persistentVolumeClaim" in v} | pod["claims"]  # fmt: skip
        mounts = {m["name"]: m["mountPath"] for c in pod["containers"] for m in c["c"].get("volumeMounts", ())}
        for key, claim in claims.items():
            if claim not in primed:  # podman sets a volume's owner on its first mount: that first, then fsGroup
                engine("run", "--rm", "--network", "none", *engine.flags, "-v", f"{claim}:{mounts[key]}:nocopy",
                       "--entrypoint", "true", tools)  # fmt: skip
                primed.add(claim)
            if group is not None:
                root = Path(engine("volume", "inspect", claim, "--format", "{{.Mountpoint}}"))
                os.chown(root, -1, int(group))
                root.chmod(0o2775)
    engine("run", "-d", "--name", f"{POD}-net", "--label", f"{POD}=1", "--network", "none", *engine.flags,
           "--entrypoint", "sleep", tools, "infinity")  # fmt: skip
    netns = engine("inspect", f"{POD}-net", "--format", "{{.State.Pid}}")
    t0 = time.monotonic()
    # the Job, the StatefulSet and every init container at once, as the kubelet starts them
    for pod in pods:
        for c in pod["initContainers"]:
            engine(*run_args(engine, pod, c, tmp, "no"))
        if not pod["initContainers"]:
            for c in pod["containers"]:
                engine(*run_args(engine, pod, c, tmp, pod["restart"]))
    for pod in pods:
        for c in pod["initContainers"]:  # in order, each to exit 0, then the pod's containers
            while (state := engine.state(cname(pod, c)))["Status"] != "exited":
                if time.monotonic() > min(t0 + timeout_s, DEADLINE[0]):
                    raise RuntimeError(f"{cname(pod, c)} still running: {engine.logs(cname(pod, c))}")
                time.sleep(2)
            if state["ExitCode"] != 0:
                raise RuntimeError(f"{cname(pod, c)} exited {state['ExitCode']}: {engine.logs(cname(pod, c))}")
        if pod["initContainers"]:
            check(f"init containers {pod['name']}", True, f"exited 0 after {time.monotonic() - t0:.0f} s")
            for c in pod["containers"]:
                engine(*run_args(engine, pod, c, tmp, pod["restart"]))
    ready = wait_ready(engine, pods, [p["name"] for p in pods], netns, timeout_s, t0)
    for pod in pods:
        moved = {o: n for c in pod["containers"] for o, n in c["moved"].items()}
        how = "completed" if pod["kind"] == "Job" else "startup and readiness probes passed"
        extra = f"; ports moved in the shared namespace: {moved}" if moved else ""
        counts = [engine("inspect", cname(pod, c), "--format", "{{.RestartCount}}") for c in pod["containers"]]
        restarts = sum(map(int, counts))
        extra += f"; {restarts} restarts" if restarts else ""
        check(f"up {pod['kind']} {pod['name']}", True, f"{how}, seen {ready[pod['name']]:.0f} s after the start{extra}")
    for pod in pods:  # the liveness probes, once each, now that everything is up
        for c in pod["containers"]:
            if "livenessProbe" in c["probes"]:
                probe = c["probes"]["livenessProbe"]
                what = json.dumps({k: v for k, v in probe.items() if k not in ("period", "failures")})
                check(f"liveness probe {pod['name']}", probe_ok(engine, cname(pod, c), probe, netns), what)
    return netns


def teardown(engine: Engine) -> bool:
    names = engine("ps", "-a", "--filter", f"label={POD}", "--format", "{{.Names}}", check_rc=False).split()
    for batch in ([n for n in names if n != f"{POD}-net"], [n for n in names if n == f"{POD}-net"]):
        if batch:
            engine("rm", "-f", "-v", "-t", "10", *batch, check_rc=False, timeout=180)
    for v in engine("volume", "ls", "--filter", f"label={POD}", "--format", "{{.Name}}", check_rc=False).split():
        engine("volume", "rm", "-f", v, check_rc=False)
    left = engine("ps", "-a", "--filter", f"label={POD}", "--format", "{{.Names}}", check_rc=False)
    vols = engine("volume", "ls", "--filter", f"label={POD}", "--format", "{{.Name}}", check_rc=False)
    return not left and not vols


def cluster_of(engine: Engine, pods: list[dict], netns: str | None) -> Cluster:
    by = {p["name"].split("cosine-", 1)[-1]: p for p in pods}
    gw = by["gateway"]["containers"][0]
    metrics = {n: c["ports"]["metrics"] for n, p in by.items() for c in p["containers"] if "metrics" in c["ports"]}
    return Cluster(
        grpc_port=str(gw["ports"]["grpc"]),
        http_port=str(gw["ports"]["http"]),
        metrics={n: str(v) for n, v in metrics.items()},
        container=lambda victim: cname(by[victim], by[victim]["containers"][0]),
        wait=lambda victim, t: wait_ready(engine, pods, [by[victim]["name"]], netns, t) and None,
        api_key=os.environ["CHECK_API_KEY"],
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kill", default="drafter-code,router", help="pods killed under load (names without the release)")
    ap.add_argument("--keep", action="store_true", help="leave the pods running at the end (no teardown)")
    ap.add_argument("--service-timeout", type=float, default=600, help="seconds the pods may take to be ready")
    ap.add_argument("--deadline", type=float, default=1500, help="seconds the whole check may take")
    ap.add_argument("--in-pod", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    started = time.monotonic()
    DEADLINE[0] = started + args.deadline
    engine = Engine()
    password = os.environ.setdefault("CHECK_REDIS_PASSWORD", secrets.token_hex(16))
    api_key = os.environ.setdefault("CHECK_API_KEY", secrets.token_hex(16))
    # the chart's Redis image, or where it cannot be pulled Debian's redis-server on the local base
    if "CHECK_REDIS_IMAGE" not in os.environ:
        os.environ["CHECK_REDIS_IMAGE"] = sh([str(ROOT / "deploy/images.sh"), "redis"])
    objects = render(password, api_key, engine.tag, os.environ["CHECK_REDIS_IMAGE"])
    pods = plan(objects)

    if args.in_pod:
        try:
            mount = engine("volume", "inspect", f"{POD}-cosine-models", "--format", "{{.Mountpoint}}")
            # the zoo inside the claim: the verifier's COSINE_TARGET's parent, relative to its models mount
            verifier = next(c for p in pods if p["name"].endswith("-verifier") for c in p["containers"])
            at = next(m["mountPath"] for m in verifier["c"]["volumeMounts"] if m["name"] == "models")
            zoo = Path(mount) / Path(verifier["env"]["COSINE_TARGET"]).parent.relative_to(at)
            run_checks(engine, cluster_of(engine, pods, None), zoo, args.kill.split(","))
        except Exception as exc:  # noqa: BLE001 - reported as a failed check
            check("checks", False, repr(exc)[-1500:])
        Path(args.in_pod).write_text(json.dumps(RESULTS))
        return 0 if all(ok for _, ok, _ in RESULTS) else 1

    kinds = sorted({o["kind"] for o in objects})
    check("helm template (small profile)", True, f"{len(objects)} objects: {', '.join(kinds)}; {len(pods)} pods run")
    images = sorted({c["c"]["image"] for p in pods for g in ("initContainers", "containers") for c in p[g]})
    missing = [i for i in images if not engine.exists(i)]
    check("images", not missing, " ".join(images) + (f"; missing: {missing}" if missing else ""))
    if missing:
        return summary("chart-check", started) and 1
    teardown(engine)
    ok, tmp = False, Path(tempfile.mkdtemp(prefix=f"{POD}-"))
    tmp.chmod(0o755)
    try:
        netns = bring_up(engine, objects, pods, tmp, args.service_timeout)
        results = tmp / "results.json"
        left = DEADLINE[0] - time.monotonic()
        ok = checks_in_namespace("deploy.chart_check", netns, results, args.kill, left, dict(os.environ))
    except Exception as exc:  # noqa: BLE001 - reported as a failed check, then torn down
        check("bring-up", False, str(exc)[-1500:])
    finally:
        if not args.keep:
            check("teardown", teardown(engine), f"every {POD}-* container and volume removed")
            shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok and not summary("chart-check", started) else 1


if __name__ == "__main__":
    sys.exit(main())
