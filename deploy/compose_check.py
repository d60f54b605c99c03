"""`make compose-check`: the cluster of docker-compose.yml run for real in containers, then checked.

The compose file is read (interpolated with .env.example, a fresh Redis password, ZOO_PROFILE=tiny and
the cpu profile) and every service of the profile becomes one ``podman run`` (or ``docker run``) with
the file's image, environment, volumes (named volumes of this check), entrypoint, command and restart
policy. All of them join one network namespace that has only loopback (held by a sleeping container,
as a pod's infra container would hold it: podman 4.3 cannot give a pod's infra container the lowered
rlimits some hosts need), and reach each other by their compose names through an /etc/hosts mapping
every name to 127.0.0.1: nothing leaves the namespace, no bridge network, no published port. One
point differs from the file: both drafters listen on 50054 with metrics on 9103 (one container each
in compose), which collide in one namespace, so the second gets the next free ports (its advertised
address and health check follow). Containers start in the order of the file's ``depends_on``
conditions (service_healthy: the service's health check, run by this script with ``exec``, passes;
service_completed_successfully: exit 0). The checks then run in that namespace (``nsenter``), so
they reach the services on 127.0.0.1 as the compose network's peers would.

Checks, one line each: the images (``deploy/images.sh`` builds missing ones) and a Redis image (the
file's, or Debian's redis-server on the local base where it cannot be pulled), the zoo built by the
tools image into its volume, every service up and healthy, the SDK's and the ``openai`` client's
greedy outputs equal to the target's own greedy decode (transformers, in this process, on the zoo
volume's target), ``/metrics`` from every CoSine service, a drafter and the router each killed
(SIGKILL: a crash) under load and brought back by their restart policy with every request answered in
full and equal to the target's, and the teardown (containers and volumes removed).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from deploy.pod_check import RESULTS, ROOT, Cluster, Engine, check, checks_in_namespace, run_checks, sh, summary

POD = "cosine-check"
VOLUMES = ("zoo", "redis-data")
DEADLINE = [float("inf")]  # monotonic time by which the whole check ends (--deadline)


# ---- the compose file, as this run uses it


def compose_env(password: str) -> dict[str, str]:
    from deploy.compose import read_env_file

    env = read_env_file(ROOT / ".env.example")
    env.update(REDIS_PASSWORD=password, ZOO_PROFILE="tiny", COMPOSE_PROFILES="cpu")
    return env


def load_services(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    from deploy.compose import load

    doc = load(ROOT / "docker-compose.yml", env)
    active = set(env["COMPOSE_PROFILES"].split(","))
    return {n: s for n, s in doc["services"].items() if not s.get("profiles") or active & set(s["profiles"])}


def start_order(services: dict[str, dict[str, Any]]) -> list[str]:
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for dep in services[name].get("depends_on", {}):
            visit(dep)
        order.append(name)

    for name in services:
        visit(name)
    return order


def assign_ports(services: dict[str, dict[str, Any]], order: list[str]) -> dict[str, dict[str, str]]:
    """Each service's environment, with ports moved where two services would share one in the pod."""
    used: set[int] = {6379, 8000}
    out: dict[str, dict[str, str]] = {}
    for name in order:
        env = {k: str(v) for k, v in (services[name].get("environment") or {}).items()}
        if "COSINE_PORT" in env:
            port = int(env["COSINE_PORT"])
            metrics = int(services[name]["expose"][0])
            while port in used:
                port += 1
            while metrics in used:
                metrics += 1
            used |= {port, metrics}
            env["COSINE_PORT"], env["COSINE_METRICS_PORT"] = str(port), str(metrics)
            if "COSINE_ADVERTISE_ADDRESS" in env:
                env["COSINE_ADVERTISE_ADDRESS"] = f"{name}:{port}"
        out[name] = env
    return out


# ---- the engine


def container(name: str) -> str:
    return f"{POD}-{name}"


def bring_up(engine: Engine, services, order, envs, redis_image: str, hosts_dir: Path, timeout_s: float) -> None:
    for v in VOLUMES:
        engine("volume", "rm", "-f", f"{POD}-{v}", check_rc=False)
        engine("volume", "create", "--label", f"{POD}=1", f"{POD}-{v}")
    # The network namespace every container joins: only loopback in it. A container that holds it
    # (sleeping) stands in for a pod's infra container, whose rlimits podman 4.3 cannot lower.
    (hosts_dir / "hosts").write_text("127.0.0.1 localhost " + " ".join(services) + "\n::1 localhost\n")
    tools = services["zoo"]["image"]
    engine("run", "-d", "--name", container("net"), "--label", f"{POD}=1", "--network", "none", *engine.flags,
           "--entrypoint", "sleep", tools, "infinity")  # fmt: skip
    for name in order:
        svc = services[name]
        start = time.monotonic()
        args = ["run", "-d", "--name", container(name), "--label", f"{POD}=1", *engine.flags]
        args += ["--network", f"container:{container('net')}", "-v", f"{hosts_dir / 'hosts'}:/etc/hosts:ro"]
        restart = svc.get("restart", "no")
        if restart != "no":
            args += ["--restart", "always" if restart == "unless-stopped" else restart]
        for key, value in envs[name].items():
            args += ["-e", f"{key}={value}"]
        for mount in svc.get("volumes", ()):
            source, _, rest = mount.partition(":")
            args += ["-v", f"{POD}-{source}:{rest}"]
        image = redis_image if name == "redis" else svc["image"]
        entrypoint = svc.get("entrypoint")
        if entrypoint:
            args += ["--entrypoint", json.dumps(entrypoint)]
        args.append(image)
        args += list(svc.get("command") or [])
        engine(*args)
        wait_for(engine, name, svc, envs[name], timeout_s)
        check(f"up {name}", True, f"{time.monotonic() - start:.0f} s")


def health_cmd(name: str, svc: dict[str, Any], env: dict[str, str]) -> list[str] | None:
    test = (svc.get("healthcheck") or {}).get("test")
    if not test:
        return None
    cmd = list(test[1:]) if test[0] in ("CMD", "CMD-SHELL") else list(test)
    if test[0] == "CMD-SHELL":
        cmd = ["sh", "-c", cmd[0]]
    if "COSINE_PORT" in env:  # the check follows a moved port
        cmd = [f"127.0.0.1:{env['COSINE_PORT']}" if c.startswith("127.0.0.1:") else c for c in cmd]
    return cmd


def wait_for(engine: Engine, name: str, svc: dict[str, Any], env: dict[str, str], timeout_s: float) -> None:
    deadline = min(time.monotonic() + timeout_s, DEADLINE[0])
    cmd = health_cmd(name, svc, env)
    one_shot = svc.get("restart") == "no" and name == "zoo"
    while time.monotonic() < deadline:
        state = json.loads(engine("inspect", container(name), "--format", "{{json .State}}"))
        if one_shot:
            if state["Status"] == "exited":
                if state["ExitCode"] != 0:
                    raise RuntimeError(f"{name} exited {state['ExitCode']}: {logs(engine, name)}")
                return
        elif cmd is None:
            if state["Running"]:
                return
        elif state["Running"]:
            if engine.exec_ok(container(name), cmd):
                return
        time.sleep(2)
    raise RuntimeError(f"{name} not ready after {timeout_s:.0f} s: {logs(engine, name)}")


def logs(engine: Engine, name: str, lines: int = 30) -> str:
    return engine.logs(container(name), lines)


def teardown(engine: Engine) -> bool:
    names = engine("ps", "-a", "--filter", f"label={POD}", "--format", "{{.Names}}", check_rc=False).split()
    # the services first: the network holder cannot go while a container is joined to it
    for batch in ([n for n in names if n != container("net")], [n for n in names if n == container("net")]):
        if batch:
            engine("rm", "-f", "-v", "-t", "10", *batch, check_rc=False, timeout=180)
    for v in VOLUMES:
        engine("volume", "rm", "-f", f"{POD}-{v}", check_rc=False)
    left = engine("ps", "-a", "--filter", f"label={POD}", "--format", "{{.Names}}", check_rc=False)
    vols = engine("volume", "ls", "--filter", f"label={POD}", "--format", "{{.Name}}", check_rc=False)
    return not left and not vols


# ---- the checks (run inside the pod's network namespace)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--kill", default="drafter-a,router", help="services killed under load, one after another (comma-separated)"
    )
    ap.add_argument("--build", action="store_true", help="build the images even where they exist")
    ap.add_argument("--keep", action="store_true", help="leave the pod running at the end (no teardown)")
    ap.add_argument("--service-timeout", type=float, default=300, help="seconds a service may take to be ready")
    ap.add_argument("--deadline", type=float, default=1200, help="seconds the whole check may take (default 1200)")
    ap.add_argument("--in-pod", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    started = time.monotonic()
    DEADLINE[0] = started + args.deadline
    engine = Engine()
    password = os.environ.get("CHECK_REDIS_PASSWORD") or secrets.token_hex(16)
    env = compose_env(password)
    services = load_services(env)
    order = start_order(services)
    envs = assign_ports(services, order)

    if not args.in_pod:
        images = sorted({s["image"] for s in services.values() if s.get("build")})
        missing = [i for i in images if not engine.exists(i)]
        if args.build or missing:
            subprocess.run([str(ROOT / "deploy/images.sh"), "build"], check=True)
        check("images", all(engine.exists(i) for i in images), " ".join(images))
        redis_image = sh([str(ROOT / "deploy/images.sh"), "redis"])
        check("redis image", engine.exists(redis_image), redis_image)
        teardown(engine)  # what an interrupted run left
        ok = False
        hosts_dir = Path(tempfile.mkdtemp(prefix=f"{POD}-"))
        try:
            bring_up(engine, services, order, envs, redis_image, hosts_dir, args.service_timeout)
            if engine.cmd == "podman":  # the images' own HEALTHCHECKs (they read COSINE_PORT at run time)
                for name in order:
                    if services[name].get("build") and name != "zoo":
                        res = subprocess.run(
                            ["podman", "healthcheck", "run", container(name)], capture_output=True, text=True
                        )
                        out = (res.stdout + res.stderr).strip() or f"exit {res.returncode}"
                        check(f"image HEALTHCHECK {name}", res.returncode == 0, out)
            pid = engine("inspect", container("net"), "--format", "{{.State.Pid}}")
            child_env = dict(os.environ, CHECK_REDIS_PASSWORD=password)
            results = hosts_dir / "results.json"
            left = DEADLINE[0] - time.monotonic()
            ok = checks_in_namespace("deploy.compose_check", pid, results, args.kill, left, child_env)
        except Exception as exc:  # noqa: BLE001 - reported as a failed check, then torn down
            check("bring-up", False, str(exc)[-1500:])
        finally:
            if not args.keep:
                check("teardown", teardown(engine), f"every {POD}-* container and volume removed")
                shutil.rmtree(hosts_dir, ignore_errors=True)
        failed = summary("compose-check", started)
        return 0 if ok and not failed else 1

    mount = engine("volume", "inspect", f"{POD}-zoo", "--format", "{{.Mountpoint}}")
    try:
        cluster = Cluster(
            grpc_port=envs["gateway"]["COSINE_PORT"],
            http_port=envs["gateway"]["COSINE_HTTP_PORT"],
            metrics={n: e["COSINE_METRICS_PORT"] for n, e in envs.items() if "COSINE_METRICS_PORT" in e},
            container=container,
            wait=lambda victim, t: wait_for(engine, victim, services[victim], envs[victim], t),
        )
        run_checks(engine, cluster, Path(mount), args.kill.split(","))
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        check("checks", False, repr(exc)[-1500:])
    Path(args.in_pod).write_text(json.dumps(RESULTS))
    return 0 if all(ok for _, ok, _ in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
