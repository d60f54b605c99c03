"""Benchmark workloads: mixed-domain requests from the zoo's held-out prompts, closed or open loop.

- **closed loop** at fixed concurrency ``C``: ``C`` clients, each sends its next request as soon as
  its previous one finished. Latency runs from the moment a client sends.
- **open loop**: requests arrive on their own schedule (Poisson), whatever the system does.
  Latency runs from the scheduled arrival, so queueing counts. The rate is a multiple of the
  *reference capacity* (requests/s the reference system sustained at the highest closed-loop
  concurrency, measured earlier in the same run), so "low" and "high" mean the same on any
  machine. ``fluctuating`` alternates phases of low and high rate.

Every workload of a run uses the same request list (same prompts in the same order, round-robin
over the domains via :func:`cosine_cli.workload.mixed_workload`), so systems and workloads differ
only in timing. Sampling workloads give each request its own seed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cosine_cli.workload import mixed_workload


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    kind: str  # "closed" | "open"
    requests: int
    concurrency: int = 1  # closed loop
    load: float = 0.0  # open loop: mean offered load as a multiple of the reference capacity
    phases: tuple[float, ...] = ()  # open loop: load multipliers of equal-length phases (fluctuating)
    temperature: float = 0.0  # 0: greedy (every output token checked against the target's own decode)
    label: str = ""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def describe(self) -> dict:
        out = {"kind": self.kind, "requests": self.requests, "temperature": self.temperature, "label": self.label}
        if self.kind == "closed":
            out["concurrency"] = self.concurrency
        else:
            out["load_x_reference"] = self.load
            if self.phases:
                out["phases_x_reference"] = list(self.phases)
        return out


@dataclass(frozen=True)
class BenchRequest:
    index: int
    domain: str
    prompt: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float = 0.0  # open loop: offset from the start of the workload
    temperature: float = 0.0
    seed: int | None = None


@dataclass
class Workload:
    spec: WorkloadSpec
    requests: list[BenchRequest]
    offered_rps: float = 0.0  # open loop: mean arrival rate actually scheduled
    rates_rps: tuple[float, ...] = field(default_factory=tuple)  # open loop: rate of each phase

    @property
    def name(self) -> str:
        return self.spec.name


def prompt_list(prompts: Mapping[str, Sequence[str]], count: int) -> list[tuple[str, str]]:
    return mixed_workload(prompts, count)


def poisson_arrivals(rates: Sequence[float], phase_s: float, count: int, rng: random.Random) -> list[float]:
    """Arrival offsets of a Poisson process whose rate is ``rates[i]`` during phase ``i`` (phases of
    ``phase_s`` seconds, cycled). Time-rescaling: unit-rate exponential gaps in cumulative
    intensity, mapped back to time phase by phase."""
    out: list[float] = []
    t = 0.0
    phase = 0  # index of the phase t lies in (tracked, not recomputed from t: float division drifts)
    for _ in range(count):
        need = rng.expovariate(1.0)
        while True:
            rate = rates[phase % len(rates)]
            end = (phase + 1) * phase_s if phase_s > 0 else float("inf")
            room = rate * (end - t)
            if need <= room:
                t += need / rate
                break
            need -= room
            t = end
            phase += 1
        out.append(t)
    return out


def build_workload(
    spec: WorkloadSpec,
    items: Sequence[tuple[str, str, tuple[int, ...]]],
    max_new_tokens: int,
    reference_rps: float = 0.0,
    seed: int = 0,
) -> Workload:
    """``items``: (domain, prompt, prompt ids) in workload order (at least ``spec.requests`` of them)."""
    rng = random.Random(f"{seed}:{spec.name}")
    n = spec.requests
    arrivals = [0.0] * n
    rates: tuple[float, ...] = ()
    offered = 0.0
    if spec.kind == "open":
        if reference_rps <= 0:
            raise ValueError(f"workload {spec.name}: an open-loop workload needs the reference capacity")
        multipliers = spec.phases or (spec.load,)
        rates = tuple(m * reference_rps for m in multipliers)
        mean_rate = sum(rates) / len(rates)
        # phases: the whole workload spans about two cycles of the pattern
        phase_s = n / mean_rate / (2 * len(rates)) if len(rates) > 1 else 0.0
        arrivals = poisson_arrivals(rates, phase_s, n, rng)
        offered = mean_rate
    elif spec.kind != "closed":
        raise ValueError(f"workload {spec.name}: kind must be closed or open, not {spec.kind!r}")
    reqs = []
    for i in range(n):
        domain, prompt, ids = items[i % len(items)]
        reqs.append(
            BenchRequest(
                index=i,
                domain=domain,
                prompt=prompt,
                prompt_ids=tuple(ids),
                max_new_tokens=max_new_tokens,
                arrival_s=arrivals[i],
                temperature=spec.temperature,
                seed=None if spec.greedy else rng.randrange(2**31),
            )
        )
    return Workload(spec, reqs, offered, rates)
