"""`cosine chaos` end to end on the tiny zoo: a real local cluster whose every process (drafter,
verifier, router, gateway, Redis) is SIGKILLed in turn under a small greedy workload and
restarted by the supervisor. The report must add up and name every victim."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cosine_cli.chaos_run import VICTIMS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_chaos_reports_every_kill_consistently(tiny_zoo, tmp_path):
    requests = 8
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cosine_cli.main",
            "chaos",
            "--zoo",
            str(tiny_zoo.root),
            "--requests",
            str(requests),
            "--concurrency",
            "4",
            "--max-new-tokens",
            "16",
            "--retry-window",
            "60",
            "--recovery-timeout",
            "120",
            "--log-dir",
            str(tmp_path / "logs"),
            "--json",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["schema"] == "cosine-chaos/1"
    ref = report["reference"]
    assert ref["sent"] == ref["completed"] == requests and ref["failed"] == 0  # undisturbed: everything served

    kills = report["kills"]
    assert [k["victim"] for k in kills] == list(VICTIMS)
    for k in kills:
        assert k["sent"] == requests and k["sent"] == k["completed"] + k["failed"], k
        assert k["restarts"] >= 1 and k["back_after_s"] is not None, k  # killed, and the supervisor brought it back
        assert k["in_flight_at_kill"] >= 1, k  # killed under load
        assert k["retries"] >= 0 and k["differ"] <= k["completed"]
    tot = report["total"]
    for key in ("sent", "completed", "failed", "retries", "differ", "restarts"):
        assert tot[key] == sum(k[key] for k in kills), key
    assert tot["sent"] == tot["completed"] + tot["failed"]
    assert tot["killed"] == sorted(VICTIMS)
    assert tot["differ"] == 0  # whatever survived a kill is the target's greedy output, token for token
    assert proc.returncode == (0 if tot["failed"] == 0 else 1)
    for victim in ("drafter-0", "verifier", "router", "gateway", "redis"):
        assert f"{victim} killed (SIGKILL)" in proc.stderr  # progress lines
