"""Where the cores go while a service system serves a workload.

The CPU seconds each part of the serving path used during a run, read from the kernel before and
after it: the verifier, the drafter processes, the system's own router and gateway, the clients (the
benchmark's own process, which runs nothing else while a service system is measured) and the
cluster's private Redis. Divided by the run's wall time they are the cores each part kept busy, the
figure that says what the services cost beside the target (the report's ``counters``,
``cpu_s_<part>``; ``python -m benchmarks.summary`` shows them as cores).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import psutil

PARTS = ("verifier", "drafters", "router", "gateway", "clients", "redis")


class CpuMeter:
    """The processes of each part (by pid); :meth:`read` sums their CPU seconds per part."""

    def __init__(self, pids: Mapping[str, Sequence[int]]):
        self.procs: dict[str, list[psutil.Process]] = {}
        for part, ps in pids.items():
            self.procs[part] = []
            for pid in ps:
                try:
                    self.procs[part].append(psutil.Process(pid))
                except psutil.Error:  # already gone: it uses nothing from now on
                    pass

    def read(self) -> dict[str, float]:
        out = {}
        for part, procs in self.procs.items():
            total = 0.0
            for p in procs:
                try:
                    t = p.cpu_times()
                except psutil.Error:  # ended since: what it used is no longer readable
                    continue
                total += t.user + t.system
            out[part] = total
        return out


def cpu_counters(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``cpu_s_<part>``: seconds each part used between two reads (never negative: a part whose
    process ended in between is counted from what is still readable)."""
    return {f"cpu_s_{part}": max(0.0, after.get(part, 0.0) - before.get(part, 0.0)) for part in after}


def cores_used(metrics: Mapping[str, object]) -> dict[str, float] | None:
    """Cores each part kept busy over a run (its CPU seconds over the run's wall time), or None for
    a run without the counters (a system in the benchmark's own process)."""
    counters = metrics.get("counters") or {}
    wall = metrics.get("wall_s")
    assert isinstance(counters, Mapping)
    if not isinstance(wall, (int, float)) or wall <= 0 or not any(f"cpu_s_{p}" in counters for p in PARTS):
        return None
    return {p: float(counters.get(f"cpu_s_{p}", 0.0)) / wall for p in PARTS}
