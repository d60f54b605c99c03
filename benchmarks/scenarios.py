"""The bench's scenarios: which workloads a run has, and which of them each system skips.

A system that serves one request at a time (transformers' ``generate``, assisted or not) runs only
the workloads where that is the load (one client, and the low open-loop load) unless workloads are
named with ``--workloads``: under load its throughput is its one-client figure again and its latency
only the queue in front of it. An ablation of cosine (``cosine_no_control`` and the other
``cosine_*`` systems) likewise runs only the workloads its headline ratios against cosine are read
at (``report.HEADLINE``), unless workloads are named. The report lists what each system skipped and
why, under ``scenario.skipped``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.workloads import WorkloadSpec

ONE_AT_A_TIME_WHY = (
    "serves one request at a time: under load its throughput is its one-client figure and its latency the queue "
    "in front of it"
)
ABLATION_WHY = (
    "an ablation of cosine: run where its headline ratios against cosine are read (name workloads to run it on them)"
)


@dataclass(frozen=True)
class Scenario:
    name: str
    max_new_tokens: int
    workloads: tuple[WorkloadSpec, ...]
    roles: dict[str, str] = field(default_factory=dict)  # "high"/"low" -> workload name
    reference: str = "vanilla_sd"  # its closed-loop capacity sets the open-loop rates (first selected system otherwise)
    seed: int = 0


def _default() -> Scenario:
    # sized for the smol zoo (a 135 M target, about 15-120 tokens/s on 2 CPU cores) to finish within
    # 25 minutes with ratios that agree between runs: a closed loop of 16 clients runs 4 requests per
    # client, so the drain at its end (the last requests finishing alone) weighs half what it did with 2;
    # sampling at 4 clients likewise 4 per client (with 2 its ratio moved 0.91-1.02 between runs); low
    # load 12 requests (with 6, one or two long requests set the mean latency: cosine / vanilla_sd's
    # latency moved 0.68-0.80 between runs)
    w = (
        WorkloadSpec("closed_c1", "closed", 12, concurrency=1, label="closed loop, 1 client"),
        WorkloadSpec("closed_c4", "closed", 16, concurrency=4, label="closed loop, 4 clients"),
        WorkloadSpec("closed_c16", "closed", 64, concurrency=16, label="closed loop, 16 clients"),
        WorkloadSpec("open_low", "open", 12, load=0.15, label="Poisson, 0.15x vanilla_sd capacity"),
        WorkloadSpec("open_high", "open", 48, load=2.0, label="Poisson, 2x vanilla_sd capacity"),
        WorkloadSpec(
            "open_fluct", "open", 16, phases=(0.15, 1.5), label="Poisson, alternating 0.15x / 1.5x vanilla_sd capacity"
        ),
        WorkloadSpec(
            "closed_c4_sampling", "closed", 16, concurrency=4, temperature=0.8, label="closed loop, 4 clients, T=0.8"
        ),
    )
    return Scenario("default", 40, w, {"high": "open_high", "low": "open_low", "c1": "closed_c1", "c16": "closed_c16"})


def _quick() -> Scenario:
    w = (
        WorkloadSpec("closed_c1", "closed", 2, concurrency=1, label="closed loop, 1 client"),
        WorkloadSpec("closed_c4", "closed", 4, concurrency=4, label="closed loop, 4 clients"),
        WorkloadSpec("open_low", "open", 3, load=0.3, label="Poisson, 0.3x reference capacity"),
        WorkloadSpec("open_high", "open", 4, load=2.0, label="Poisson, 2x reference capacity"),
        WorkloadSpec(
            "closed_c4_sampling", "closed", 4, concurrency=4, temperature=0.8, label="closed loop, 4 clients, T=0.8"
        ),
    )
    return Scenario("quick", 8, w, {"high": "open_high", "low": "open_low", "c1": "closed_c1"})


def _suite() -> Scenario:
    # the end-to-end part of ``benchmarks.gpu_suite``: one client and sixteen, greedy
    w = (
        WorkloadSpec("closed_c1", "closed", 8, concurrency=1, label="closed loop, 1 client"),
        WorkloadSpec("closed_c16", "closed", 32, concurrency=16, label="closed loop, 16 clients"),
    )
    return Scenario("suite", 64, w, {"c1": "closed_c1", "c16": "closed_c16"})


SCENARIOS = {"default": _default, "quick": _quick, "suite": _suite}


def loaded(spec: WorkloadSpec, roles: dict[str, str]) -> bool:
    """Whether ``spec`` keeps more than one request in a system at a time (see the module docstring)."""
    if spec.kind == "closed":
        return spec.concurrency > 1
    return spec.name != roles.get("low")


def skipped_workloads(
    systems: Sequence[Any], specs: Sequence[WorkloadSpec], roles: dict[str, str], capacity_wl: str
) -> dict[str, dict[str, Any]]:
    """system -> {"workloads": those it does not run, "why"} (the report's ``scenario.skipped``), for a
    run whose workloads were not named (see the module docstring). The first system always runs the
    workload that measures the capacity the open-loop rates are set from."""
    from benchmarks.report import read_at

    out: dict[str, dict[str, Any]] = {}
    for i, s in enumerate(systems):
        keep = {capacity_wl} if i == 0 else set()
        if getattr(s, "one_at_a_time", False):
            ws, why = [w.name for w in specs if loaded(w, roles) and w.name not in keep], ONE_AT_A_TIME_WHY
        elif (at := read_at(s.name, roles)) is not None:
            ws, why = [w.name for w in specs if w.name not in at and w.name not in keep], ABLATION_WHY
        else:
            continue
        if ws:
            out[s.name] = {"workloads": ws, "why": why}
    return out
