"""A local CoSine cluster as processes: a private Redis (unless a URL is given), the verifier,
drafter processes, the router and the gateway. Used by `cosine up`, `cosine demo`, the
integration tests and the benchmark.

Thread budget: the verifier gets a torch thread per core, and the drafter processes share half of
the cores (at least one thread each), so they overlap the verifier's threads. A verify pass is what
every round waits for, and on a CPU it is bound by reading the target's weights, which one thread
cannot do at the machine's speed (a decode step is markedly slower with one thread than with two on
two cores); the drafters' steps are short and mostly run while the verifier waits.
Each process gets ``--torch-threads`` accordingly.

TLS: with ``ClusterSpec.tls`` every process gets the same certificate, key and CA (and
``--tls-client-auth`` when the config asks for it), so every hop is TLS or mutual TLS; the health
waits and the router status checks dial with the same config. Plaintext is the default.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.platform.grpc_server import join_host_port, wait_healthy
from common.platform.tls import TlsConfig, open_channel
from cosine_cli.redis_server import RedisServer, free_port
from cosine_cli.tls import service_tls_args


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class ClusterSpec:
    target: str
    drafters: Mapping[str, str]  # drafter id -> checkpoint path
    drafter_domains: Mapping[str, Sequence[str]] = field(default_factory=dict)
    redis_url: str = ""
    host: str = "127.0.0.1"
    gateway_port: int = 0
    http_port: int = 0  # the gateway's OpenAI-compatible HTTP API (0: any free port)
    drafter_processes: int = 1
    router_args: tuple[str, ...] = ()
    verifier_args: tuple[str, ...] = ()
    drafter_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    log_dir: str = ".cosine/logs"
    cores: int = 0  # 0: os.cpu_count()
    prefix: str = "cosine"
    startup_timeout_s: float = 180.0
    tls: TlsConfig | None = None  # None: plaintext everywhere


def thread_budget(cores: int, drafter_processes: int) -> tuple[int, int]:
    """(verifier threads, threads per drafter process) for ``cores`` cores (see the module doc)."""
    cores = max(1, cores)
    per_drafter = max(1, cores // (2 * max(1, drafter_processes)))
    return cores, per_drafter


def split_drafters(drafters: Mapping[str, str], processes: int) -> list[dict[str, str]]:
    names = sorted(drafters)
    processes = max(1, min(processes, len(names))) if names else 0
    groups: list[dict[str, str]] = [{} for _ in range(processes)]
    for i, name in enumerate(names):
        groups[i % processes][name] = drafters[name]
    return groups


@dataclass(frozen=True)
class ControlPlane:
    """Where one router and its gateway listen."""

    router_address: str
    gateway_address: str
    http_url: str


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    address: str
    log_path: Path
    metrics_address: str = ""
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)


class LocalCluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.redis: RedisServer | None = None
        self.redis_url = spec.redis_url
        self.procs: list[Proc] = []
        self.gateway_address = ""
        self.http_url = ""
        self.router_address = ""
        self.verifier_address = ""
        self.supervisor: Any = None
        self.redis_proc: Proc | None = None  # the private Redis, as the supervisor sees it
        self._ports: set[int] = set()  # every port this cluster handed out, so no two processes share one

    # ---- processes ---------------------------------------------------------------------------

    def _port(self) -> int:
        """A free port that no process of this cluster was given yet: the OS may hand the same
        free port out twice while the first taker has not bound it."""
        for _ in range(100):
            port = free_port(self.spec.host)
            if port not in self._ports:
                self._ports.add(port)
                return port
        raise ClusterError("no free port found on " + self.spec.host)

    def _spawn(self, name: str, module: str, port: int, args: Sequence[str], threads: int | None = None) -> Proc:
        log_dir = Path(self.spec.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        env = {**os.environ, "COSINE_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}
        if threads:
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        address = f"{self.spec.host}:{port}"
        metrics_port = self._port()  # every process of every local cluster: its own /metrics
        cmd = [
            sys.executable,
            "-m",
            module,
            "--host",
            self.spec.host,
            "--port",
            str(port),
            "--redis-url",
            self.redis_url,
            "--redis-prefix",
            self.spec.prefix,
            "--member-id",
            name,
            "--metrics-port",
            str(metrics_port),
            *service_tls_args(self.spec.tls),
            *args,
        ]
        if threads:
            cmd += ["--torch-threads", str(threads)]
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        proc = Proc(name, popen, address, log_path, f"{self.spec.host}:{metrics_port}", cmd, env)
        self.procs.append(proc)
        return proc

    async def _wait(self, procs: Sequence[Proc], what: str) -> None:
        async def one(p: Proc) -> None:
            ok = await wait_healthy(
                p.address, self.spec.startup_timeout_s, is_alive=lambda: p.popen.poll() is None, tls=self.spec.tls
            )
            if not ok:
                tail = _tail(p.log_path)
                state = (
                    f"exited with status {p.popen.returncode}" if p.popen.poll() is not None else "not healthy in time"
                )
                raise ClusterError(f"{p.name} {state}; last log lines:\n{tail}")

        await asyncio.gather(*(one(p) for p in procs))

    async def start_async(self, progress: bool = True) -> str:
        spec = self.spec
        say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
        if not self.redis_url:
            # persistent: a Redis that dies is restarted on its port with its data (profiles, request state)
            self.redis = RedisServer(host="127.0.0.1", persistent=True).start()
            self.redis_url = self.redis.url
            assert self.redis.popen is not None and self.redis.log_path is not None
            self.redis_proc = Proc("redis", self.redis.popen, f"127.0.0.1:{self.redis.port}", self.redis.log_path)
            say(f"redis      private redis-server at {self.redis_url} (append-only file)")
        cores = spec.cores or os.cpu_count() or 1
        groups = split_drafters(spec.drafters, spec.drafter_processes)
        v_threads, d_threads = thread_budget(cores, len(groups))
        say(f"threads    {cores} cores: verifier {v_threads}, {len(groups)} drafter process(es) x {d_threads}")
        try:
            verifier = self._spawn(
                "verifier", "services.verifier", self._port(), ["--target", spec.target, *spec.verifier_args], v_threads
            )
            drafters = []
            for i, group in enumerate(groups):
                args = [a for name, path in group.items() for a in ("--drafters", f"{name}={path}")]
                drafters.append(
                    self._spawn(
                        f"drafter-{i}", "services.drafter", self._port(), [*args, *spec.drafter_args], d_threads
                    )
                )
            say(
                f"starting   verifier ({spec.target}) and {len(spec.drafters)} drafter(s): "
                f"{', '.join(sorted(spec.drafters))}"
            )
            await self._wait([verifier, *drafters], "models")
            self.verifier_address = verifier.address
            await self._start_control_plane(spec.router_args, len(spec.drafters), spec.gateway_port)
        except BaseException:
            self.stop()
            raise
        say(f"ready      gateway at {self.gateway_address} (logs in {spec.log_dir}/)")
        return self.gateway_address

    async def _start_control_plane(
        self, router_args: Sequence[str], drafters: int, gateway_port: int = 0, tag: str = ""
    ) -> ControlPlane:
        """A router with ``router_args`` and its gateway; the cluster's own unless ``tag`` names
        another one (its processes are then ``router-<tag>`` and ``gateway-<tag>``)."""
        spec = self.spec
        suffix = f"-{tag}" if tag else ""
        router = self._spawn(
            f"router{suffix}",
            "services.router",
            self._port(),
            ["--verifier-address", self.verifier_address, *router_args],
        )
        await self._wait([router], "router")
        if not tag:
            self._ports.update(p for p in (spec.http_port, gateway_port) if p)
        http_port = (spec.http_port if not tag else 0) or self._port()
        gateway = self._spawn(
            f"gateway{suffix}",
            "services.gateway",
            (gateway_port if not tag else 0) or self._port(),
            [
                "--router-address",
                router.address,
                "--tokenizer",
                spec.target,
                "--http-port",
                str(http_port),
                *spec.gateway_args,
            ],
        )
        await self._wait([gateway], "gateway")
        scheme = "https" if spec.tls is not None and spec.tls.serves_tls else "http"
        plane = ControlPlane(router.address, gateway.address, f"{scheme}://{join_host_port(spec.host, http_port)}")
        if not tag:
            self.router_address, self.gateway_address, self.http_url = (
                plane.router_address,
                plane.gateway_address,
                plane.http_url,
            )
        await self._wait_router_ready(drafters, router.address)
        return plane

    async def add_control_plane_async(
        self, router_args: Sequence[str], tag: str, drafters: int | None = None
    ) -> ControlPlane:
        """Another router (flags ``router_args``) and gateway beside the cluster's own, sharing its
        Redis, verifier and drafters: a benchmark compares router configurations on the same loaded
        models without restarting anything between them. ``tag`` names its processes."""
        if not tag or any(p.name in (f"router-{tag}", f"gateway-{tag}") for p in self.procs):
            raise ClusterError(f"control plane tag {tag!r} is empty or already in use")
        return await self._start_control_plane(
            router_args, len(self.spec.drafters) if drafters is None else drafters, tag=tag
        )

    def add_control_plane(self, router_args: Sequence[str], tag: str, drafters: int | None = None) -> ControlPlane:
        return asyncio.run(self.add_control_plane_async(router_args, tag, drafters))

    async def restart_router_async(self, router_args: Sequence[str], drafters: int | None = None) -> str:
        """Replace the router and the gateway (new router flags) while Redis, the verifier and the
        drafters keep running with their models loaded. ``drafters``: how many the new router must
        see before this returns (default: all; fewer when ``--use-drafters`` restricts it).
        Returns the new gateway address."""
        for name in ("gateway", "router"):
            proc = next((p for p in self.procs if p.name == name), None)
            if proc is None:
                continue
            popen = proc.popen  # the process stopped is the one waited for (see signal)
            if popen.poll() is None:
                popen.send_signal(signal.SIGTERM)
                try:
                    popen.wait(10)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait(5)
            self.procs.remove(proc)
        await self._start_control_plane(router_args, len(self.spec.drafters) if drafters is None else drafters)
        return self.gateway_address

    def restart_router(self, router_args: Sequence[str], drafters: int | None = None) -> str:
        return asyncio.run(self.restart_router_async(router_args, drafters))

    async def _wait_router_ready(self, drafters: int, address: str = "", timeout_s: float = 60.0) -> None:
        """Until the router (the cluster's own unless ``address``) sees the verifier and ``drafters`` drafters."""
        from cosine.v1 import router_pb2, router_pb2_grpc

        deadline = time.monotonic() + timeout_s
        async with open_channel(address or self.router_address, self.spec.tls) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            while time.monotonic() < deadline:
                status = await stub.Status(router_pb2.StatusRequest(), timeout=5)
                if status.verifier_healthy and sum(d.healthy for d in status.drafters) >= drafters:
                    return
                await asyncio.sleep(0.2)
        raise ClusterError(f"the router did not see the verifier and {drafters} drafter(s) within {timeout_s:.0f}s")

    def start(self, progress: bool = True) -> str:
        return asyncio.run(self.start_async(progress))

    def watched(self) -> list[Proc]:
        """Every process the supervisor restarts: the services and the private Redis."""
        return [*self.procs, *([self.redis_proc] if self.redis_proc is not None else [])]

    def alive(self) -> list[str]:
        return [p.name for p in self.watched() if p.popen.poll() is None]

    def dead(self) -> list[Proc]:
        return [p for p in self.watched() if p.popen.poll() is not None]

    def proc(self, name: str) -> Proc:
        return next(p for p in self.watched() if p.name == name)

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to a process (``redis`` included); for SIGKILL, wait until it is gone."""
        # the process signalled is the one waited for: a supervisor may respawn it meanwhile and put
        # the new process in its place, which a wait read from ``p`` would wait on instead (a CI run
        # under load waited 10 s on the healthy replacement of a router it had just killed)
        popen = self.proc(name).popen
        if popen.poll() is None:
            popen.send_signal(sig)
        if sig == signal.SIGKILL:
            popen.wait(10)

    def respawn(self, name: str) -> Proc:
        """Start a process again with its command line, address and log file (after it died)."""
        p = self.proc(name)
        if p.popen.poll() is None:
            return p
        if p is self.redis_proc and self.redis is not None:
            self.redis.start()  # same port, same append-only file
            assert self.redis.popen is not None
            p.popen, p.started_at = self.redis.popen, time.monotonic()
            return p
        with open(p.log_path, "ab") as log:
            p.popen = subprocess.Popen(
                p.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=p.env, start_new_session=True
            )
        p.started_at = time.monotonic()
        return p

    def supervise(self, **kw: Any) -> Any:
        """Restart processes that die (see :mod:`cosine_cli.supervisor`) until :meth:`stop`."""
        from cosine_cli.supervisor import Supervisor

        self.supervisor = Supervisor(self, **kw).start()
        return self.supervisor

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM in reverse start order (gateway first), then SIGKILL what is left."""
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in reversed(self.procs):
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(5)
        self.procs.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
            self.redis_proc = None

    def client_tls(self) -> dict[str, Any]:
        """Keyword arguments that give an SDK client this cluster's TLS (plaintext: tls=False)."""
        tls = self.spec.tls
        if tls is None or not tls.enabled:
            return {"tls": False}
        return {
            "tls": True,
            "tls_ca": tls.ca,
            "tls_cert": tls.cert,
            "tls_key": tls.key,
            "tls_server_name": tls.server_name,
        }

    def state(self) -> dict[str, Any]:
        """What `cosine generate` and `cosine status` need to reach the cluster (``tls``: the paths
        they dial with, when the cluster runs TLS)."""
        return {
            "gateway": self.gateway_address,
            "http": self.http_url,
            "router": self.router_address,
            "redis_url": self.redis_url,
            "prefix": self.spec.prefix,
            "metrics": {p.name: p.metrics_address for p in self.procs if p.metrics_address},
            "tls": self.client_tls(),
        }

    def __enter__(self) -> LocalCluster:
        self.start(progress=False)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "(no log)"
    out = []
    for line in text:
        try:
            event = json.loads(line)
            out.append(
                f"  {event.get('level', '')} {event.get('event', '')} "
                + " ".join(f"{k}={v}" for k, v in event.items() if k not in ("level", "event", "timestamp", "service"))
            )
        except ValueError:
            out.append("  " + line)
    return "\n".join(out)
