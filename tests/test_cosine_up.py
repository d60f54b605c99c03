"""`cosine up` as a user runs it (a process, the tiny zoo from disk): the serving flags reach the
services, and every /metrics endpoint it prints answers, the API port's with the request counted."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from cosine_cli.status_metrics import scrape, total

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def read_until(lines: queue.Queue, marker: str, timeout_s: float) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line.rstrip("\n"))
        if marker in line:
            return seen
    raise AssertionError(f"no {marker!r} from cosine up; it printed:\n" + "\n".join(seen))


def test_up_serves_the_named_model_behind_a_key_and_prints_every_metrics_endpoint(tiny_zoo, tmp_path):
    cmd = [sys.executable, "-m", "cosine_cli.main", "up", "--zoo", str(tiny_zoo.root), "--gateway-port", "0"]
    cmd += ["--http-port", "0", "--log-dir", str(tmp_path / "logs"), "--served-model-name", "tiny"]
    cmd += ["--api-key", "k-1", "--device", "cpu", "--dtype", "float32"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        out = read_until(lines, "Ctrl-C stops the cluster", 240)
        api = next(line.split()[1] for line in out if line.startswith("openai "))
        assert any("(model tiny)" in line for line in out), out
        endpoints = {}
        for line in out:
            if line.startswith("metrics "):
                _, name, url, *rest = line.split()
                endpoints[(name, bool(rest))] = url
        assert {name for name, _ in endpoints} == {"gateway", "router", "verifier", "drafter-0"}, out
        api_metrics = endpoints[("gateway", True)]
        assert api_metrics == api.removesuffix("/v1") + "/metrics"
        for url in endpoints.values():
            assert total(scrape(url.removeprefix("http://").removesuffix("/metrics")), "process_cpu_seconds_total") >= 0

        client = openai.OpenAI(base_url=api, api_key="k-1", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=api, api_key="wrong", max_retries=0).models.list()
        reply = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=8, temperature=0)
        rounds = reply.model_extra["speculative_decoding"]["rounds"]
        got = scrape(api_metrics.removeprefix("http://").removesuffix("/metrics"))
        assert total(got, "cosine_spec_decode_rounds_total") == rounds >= 1
        verifier_log = (tmp_path / "logs" / "verifier.log").read_text()
        assert '"dtype": "float32"' in verifier_log or "'dtype': 'float32'" in verifier_log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0
