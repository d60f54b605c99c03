"""What every system of the benchmark returns, and the interface it serves behind.

Every system serves a :class:`~benchmarks.workloads.Workload` and returns a :class:`RunResult`:
one :class:`RequestRecord` per request (tokens, issue / first-token / finish times, speculation
statistics) and the counters of the run (verify batches, accepted tokens, verifier busy time, the
time split of the rounds). The systems themselves: :mod:`benchmarks.systems` (in process, and the
catalogue) and :mod:`benchmarks.service_systems` (router configurations through the services).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from benchmarks.workloads import Workload


@dataclass
class RequestRecord:
    index: int
    domain: str
    token_ids: tuple[int, ...] = ()
    issued_s: float = 0.0  # when the request was sent (closed loop) or scheduled to arrive (open loop)
    first_token_s: float | None = None
    finished_s: float = 0.0
    rounds: int = 0  # verify passes of the target that served this request
    accepted_tokens: int = 0  # draft tokens the target accepted
    accepted_by_drafter: dict[str, int] = field(default_factory=dict)
    drafters_used: tuple[str, ...] = ()
    error: str = ""

    @property
    def latency_s(self) -> float:
        return self.finished_s - self.issued_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.issued_s


@dataclass
class RunResult:
    records: list[RequestRecord]
    wall_s: float  # first issue to last finish
    # verify_batches, accepted_tokens, tokens_committed, verifier_busy_s, drafter_busy_s,
    # round_s (summed wall time of the rounds / decode steps), drafter_calls
    counters: dict[str, float] = field(default_factory=dict)
    drafter_rounds: dict[str, float] = field(default_factory=dict)  # drafter -> rounds it drafted in


class System(Protocol):
    name: str
    description: str
    one_at_a_time: bool

    def start(self) -> None: ...

    def run(self, workload: Workload) -> RunResult: ...

    def warm_up(self, workload: Workload) -> None: ...

    def stop(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...
