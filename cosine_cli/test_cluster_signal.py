"""Killing a cluster process waits for that process, even when a supervisor respawns it meanwhile."""

from __future__ import annotations

import subprocess
import sys
import time

from cosine_cli.cluster import ClusterSpec, LocalCluster, Proc

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


class RespawnedAtOnce(subprocess.Popen):
    """A process whose supervisor puts a replacement in its place as soon as it is signalled."""

    proc: Proc

    def send_signal(self, sig: int) -> None:
        super().send_signal(sig)
        self.proc.popen = subprocess.Popen(SLEEPER)


def test_kill_waits_for_the_killed_process_not_its_replacement(tmp_path):
    cluster = LocalCluster(ClusterSpec(target="", drafters={}, log_dir=str(tmp_path)))
    first = RespawnedAtOnce(SLEEPER)
    proc = Proc(name="router", popen=first, address="127.0.0.1:1", log_path=tmp_path / "router.log", cmd=SLEEPER)
    first.proc = proc
    cluster.procs.append(proc)
    try:
        t0 = time.monotonic()
        cluster.kill("router")
        assert time.monotonic() - t0 < 5  # not the 10 s wait on the replacement
        assert first.returncode is not None  # the killed one was waited for
        assert proc.popen is not first and proc.popen.poll() is None  # its replacement runs on
    finally:
        for p in (first, proc.popen):
            if p.poll() is None:
                p.kill()
                p.wait(10)
