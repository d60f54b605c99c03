"""What `make compose-check` and `make chart-check` share: the container engine, the one-line
checks, and the checks run against a cluster in one loopback-only network namespace (greedy
outputs through the SDK and the ``openai`` client equal to the target's own greedy decode,
``/metrics`` of every service, containers killed under load with nothing lost)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 48
RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((name, ok, detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""), flush=True)
    return ok


def summary(prog: str, started: float) -> list[str]:
    """Prints the closing line; returns the names of the failed checks."""
    passed = sum(ok for _, ok, _ in RESULTS)
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(
        f"{prog}: {passed}/{len(RESULTS)} checks passed in {time.monotonic() - started:.0f} s"
        + (f"; failed: {', '.join(failed)}" if failed else ""),
        flush=True,
    )
    return failed


def checks_in_namespace(
    module: str, pid: str, results: Path, kill: str, seconds_left: float, env: dict[str, str]
) -> bool:
    """Run ``python -m module --in-pod results`` inside the network namespace of process ``pid``, so
    that the checks' own traffic stays on that namespace's loopback, and gather what it wrote into
    :data:`RESULTS`. True when it exited 0."""
    cmd = ["nsenter", "-t", pid, "-n", sys.executable, "-m", module, "--in-pod", str(results)]
    cmd += ["--kill", kill, "--deadline", str(max(60.0, seconds_left))]
    ok = subprocess.run(cmd, cwd=ROOT, env=env).returncode == 0
    if results.exists():
        RESULTS.extend(tuple(r) for r in json.loads(results.read_text()))
    else:
        check("checks in the network namespace", False, "no results")
    return ok


def sh(args: list[str], check_rc: bool = True, capture: bool = True, timeout: float | None = None) -> str:
    res = subprocess.run(args, capture_output=capture, text=True, timeout=timeout)
    if check_rc and res.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)} exited {res.returncode}: {(res.stderr or '')[-2000:]}")
    return (res.stdout or "").strip()


class Engine:
    """podman (or docker), with the run flags this host needs (``deploy/images.sh flags``)."""

    def __init__(self) -> None:
        self.cmd = os.environ.get("ENGINE") or ("podman" if shutil.which("podman") else "docker")
        self.flags = sh([str(ROOT / "deploy/images.sh"), "flags"]).split()
        self.tag = os.environ.get("TAG", "0.1.0")

    def __call__(self, *args: str, check_rc: bool = True, timeout: float | None = None) -> str:
        return sh([self.cmd, *args], check_rc=check_rc, timeout=timeout)

    def exists(self, image: str) -> bool:
        if self.cmd == "podman":
            return subprocess.run(["podman", "image", "exists", image]).returncode == 0
        return subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0

    def state(self, name: str) -> dict[str, Any]:
        return json.loads(self("inspect", name, "--format", "{{json .State}}"))

    def logs(self, name: str, lines: int = 30) -> str:
        res = subprocess.run([self.cmd, "logs", "--tail", str(lines), name], capture_output=True, text=True)
        return (res.stdout + res.stderr)[-3000:]

    def exec_ok(self, name: str, cmd: list[str], timeout: float = 30) -> bool:
        try:
            res = subprocess.run([self.cmd, "exec", name, *cmd], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return res.returncode == 0


@dataclass
class Cluster:
    """How the checks reach a running cluster: the gateway's ports, every service's metrics port,
    the container of a service and how to wait until it is ready again."""

    grpc_port: str
    http_port: str
    metrics: dict[str, str]
    container: Callable[[str], str]
    wait: Callable[[str, float], None]
    api_key: str | None = None  # None: the SDK reads COSINE_API_KEY
    extra: dict[str, Any] = field(default_factory=dict)


def greedy_reference(zoo_dir: Path, prompts: list[str]) -> tuple[dict[str, list[int]], Any]:
    import torch

    from common.runtime.checkpoints import load_causal_lm, load_tokenizer

    tok = load_tokenizer(zoo_dir / "target")
    model = load_causal_lm(zoo_dir / "target")
    out = {}
    for prompt in prompts:
        ids = torch.tensor([tok(prompt).input_ids])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        out[prompt] = gen[0, ids.shape[1] :].tolist()
    return out, tok


def run_checks(engine: Engine, cluster: Cluster, zoo_dir: Path, kill: list[str]) -> None:
    from cosine_client import Client
    from cosine_zoo.manifest import load_zoo

    zoo = load_zoo(zoo_dir)
    prompts = [p for d in sorted(zoo.prompts) for p in zoo.prompts[d][:2]]
    reference, _ = greedy_reference(zoo_dir, prompts)
    grpc_address = "127.0.0.1:" + cluster.grpc_port

    with Client(grpc_address, timeout=120, api_key=cluster.api_key) as client:
        results = [client.generate(p, max_new_tokens=MAX_NEW, temperature=0) for p in prompts]
    sdk_equal = sum(list(r.token_ids) == reference[p] for r, p in zip(results, prompts))
    check("SDK greedy = target's greedy decode", sdk_equal == len(prompts), f"{sdk_equal}/{len(prompts)} requests")
    sdk_text = {p: r.text for r, p in zip(results, prompts)}

    from openai import OpenAI

    oa = OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key=cluster.api_key or "unused", timeout=120)
    model = oa.models.list().data[0].id
    oa_equal = 0
    for p in prompts:
        reply = oa.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0)
        oa_equal += reply.choices[0].text == sdk_text[p]
    check(
        "openai client greedy = target's greedy decode",
        oa_equal == len(prompts),
        f"{oa_equal}/{len(prompts)} completions (model {model!r}) equal the SDK's text of the target's ids",
    )

    for name, port in cluster.metrics.items():
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            body = urllib.request.urlopen(url, timeout=10).read().decode()
            families = {line.split()[2] for line in body.splitlines() if line.startswith("# TYPE cosine_")}
            check(f"/metrics {name}", bool(families), f"{url}: {len(families)} cosine_ families")
        except OSError as exc:
            check(f"/metrics {name}", False, f"{url}: {exc}")

    for victim in kill:
        kill_under_load(engine, cluster, grpc_address, prompts * 4, reference, victim)


def kill_under_load(engine: Engine, cluster: Cluster, grpc_address: str, load: list[str], reference, victim: str):
    """SIGKILL one container while requests are in flight; it comes back by its restart policy (or
    is started again); every request must be answered in full, equal to the target's greedy decode."""
    import asyncio

    from cosine_client import AsyncClient

    name = cluster.container(victim)

    async def under_load() -> tuple[list[Any], int, str]:
        async with AsyncClient(grpc_address, timeout=300, api_key=cluster.api_key) as ac:
            tasks = [asyncio.create_task(ac.generate(p, max_new_tokens=MAX_NEW, temperature=0)) for p in load]
            await asyncio.sleep(0.5)
            in_flight = sum(not t.done() for t in tasks)
            state = engine.state(name)
            # a crash, not `kill` (a stop by the user, which a restart policy leaves stopped)
            os.kill(int(state["Pid"]), signal.SIGKILL)
            before = state["StartedAt"]
            t0 = time.monotonic()
            how = "started again by this check"
            while time.monotonic() - t0 < 15:
                await asyncio.sleep(1.0)
                state = engine.state(name)
                if state["Running"] and state["StartedAt"] != before:
                    how = "restarted by its restart policy"
                    break
            else:
                engine("start", name)
            await asyncio.to_thread(cluster.wait, victim, 300)
            how += f", ready {time.monotonic() - t0:.0f} s after the kill"
            return await asyncio.gather(*tasks, return_exceptions=True), in_flight, how

    outcomes, in_flight, how = asyncio.run(under_load())
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    equal = sum(not isinstance(o, BaseException) and list(o.token_ids) == reference[p] for o, p in zip(outcomes, load))
    check(
        f"{victim} killed under load, nothing lost",
        in_flight > 0 and not errors and equal == len(load),
        f"{in_flight}/{len(load)} requests in flight at the kill; {how}; {len(load) - len(errors)} answered, "
        f"{equal} equal the target's" + (f"; first error: {errors[0]!r}" if errors else ""),
    )
