"""Supervision of the local cluster's processes (the private Redis included): one that dies is
restarted, as compose's restart policy and Kubernetes do for theirs.

A watcher thread polls the processes; a dead one is respawned with the same command line, address
and log file after a backoff that doubles per quick death (``initial_s`` .. ``max_s``, the shared
retry policy's) and resets once a process has stayed up for ``stable_s``. Each restart prints one line.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.platform.retry import RetryPolicy


@dataclass
class Backoff:
    """Restart delays per process by the shared :class:`RetryPolicy`: none after a first quick
    death, then ``initial_s`` doubling to ``max_s`` (jittered); a process that stayed up for
    ``stable_s`` starts over."""

    initial_s: float = 0.5
    max_s: float = 30.0
    stable_s: float = 30.0
    quick_deaths: dict[str, int] = field(default_factory=dict)

    def next_delay(self, name: str, uptime_s: float) -> float:
        if uptime_s >= self.stable_s:
            self.quick_deaths.pop(name, None)
        deaths = self.quick_deaths.get(name, 0)
        self.quick_deaths[name] = deaths + 1
        return RetryPolicy(self.initial_s, self.max_s).delay(deaths) if deaths else 0.0


class Supervisor:
    """Restarts dead processes of a :class:`~cosine_cli.cluster.LocalCluster` until stopped."""

    def __init__(
        self,
        cluster: Any,
        interval_s: float = 0.25,
        backoff: Backoff | None = None,
        say: Callable[[str], None] | None = None,
    ):
        self.cluster = cluster
        self.interval_s = interval_s
        self.backoff = backoff or Backoff()
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.restarts: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cluster-supervisor", daemon=True)
        self._due: dict[str, float] = {}

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for proc in list(self.cluster.watched()):
                code = proc.popen.poll()
                if code is None:
                    continue
                now = time.monotonic()
                if proc.name not in self._due:
                    delay = self.backoff.next_delay(proc.name, now - proc.started_at)
                    self._due[proc.name] = now + delay
                    self.say(f"restart    {proc.name} exited with status {code}; restarting in {delay:.1f} s")
                if now >= self._due[proc.name] and not self._stop.is_set():
                    del self._due[proc.name]
                    try:
                        self.cluster.respawn(proc.name)
                    except Exception as exc:  # e.g. its port still taken: try again after the next backoff
                        self.say(f"restart    {proc.name} did not start: {exc}")
                        continue
                    self.restarts[proc.name] = self.restarts.get(proc.name, 0) + 1
                    self.say(f"restart    {proc.name} restarted at {proc.address} (restart {self.restarts[proc.name]})")
