"""`cosine demo` (what `make run` runs) end to end on the tiny zoo: real processes, real Redis,
real gRPC; the summary shows CoSine against the target alone on the same requests."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_reports_speedup_against_the_target_alone(tiny_zoo, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cosine_cli.main",
            "demo",
            "--zoo",
            str(tiny_zoo.root),
            "--requests",
            "6",
            "--concurrency",
            "3",
            "--max-new-tokens",
            "8",
            "--gateway-port",
            "0",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert re.search(r"requests\s+6 \(0 failed\)", out)
    assert re.search(r"target alone\s+[\d.]+ tokens/s", out)
    m = re.search(r"speed-up\s+([\d.]+)x throughput, ([\d.]+)x latency; (\d+)/(\d+) outputs identical", out)
    assert m and float(m.group(1)) > 0
    assert m.group(3) == m.group(4) == "6"  # greedy: every output equals the target's own
