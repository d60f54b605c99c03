"""The machinery of `cosine chaos` (no argument parsing, no printing of tables): a greedy workload
whose clients retry what a dying service cuts, and one phase that kills a process under it.

What a client does is what a careful application does with the SDK today: a request that fails
with UNAVAILABLE (a gateway or a router died under its stream, Redis is down so the gateway cannot
record a new request) is sent again after a short backoff, for up to ``retry_window_s``; every
other error fails the request. The figures count requests (sent = completed + failed) and,
apart, the retries. When the gateway resumes requests from Redis after a router death, and the
SDK rides over a gateway death, fewer UNAVAILABLE reach this client: the retries fall, and the
command needs no change to show it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
from tenacity import retry_if_exception, stop_before_delay

from common.platform.retry import RetryPolicy
from cosine_client import AsyncClient, CosineError

VICTIMS = ("drafter", "verifier", "router", "gateway", "redis")
# A request cut by a dying service is sent again after 0.25 s doubling to 2 s (jittered), within the window.
CHAOS_RETRY = RetryPolicy(initial_s=0.25, max_s=2.0)


@dataclass
class Outcome:
    """One logical request of a workload: its tokens (None when it failed) and what it took."""

    index: int
    tokens: tuple[int, ...] | None
    attempts: int = 1
    error: str = ""
    latency_s: float = 0.0


@dataclass
class PhaseReport:
    """The figures of one run of the workload (the reference run, or one kill)."""

    name: str
    victim: str = ""
    process: str = ""
    sent: int = 0
    completed: int = 0
    failed: int = 0
    retries: int = 0
    differ: int = 0
    in_flight_at_kill: int = 0
    restarts: int = 0
    back_after_s: float | None = None
    wall_s: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def generate_with_retries(
    client: AsyncClient, prompt: str, index: int, max_new_tokens: int, retry_window_s: float, timeout_s: float
) -> Outcome:
    """Greedy generation of ``prompt``; UNAVAILABLE is retried with backoff within the window."""
    t0 = time.monotonic()
    attempts = 0
    try:
        async for attempt in CHAOS_RETRY.retrying(
            retry=retry_if_exception(_unavailable), stop=stop_before_delay(retry_window_s)
        ):
            with attempt:
                attempts += 1
                gen = await client.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0, timeout=timeout_s)
    except CosineError as exc:
        return Outcome(index, None, attempts, f"{exc.code.name}: {exc.message}", time.monotonic() - t0)
    return Outcome(index, tuple(gen.token_ids), attempts, latency_s=time.monotonic() - t0)


def _unavailable(exc: BaseException) -> bool:
    return isinstance(exc, CosineError) and exc.code == grpc.StatusCode.UNAVAILABLE


@dataclass
class Counts:
    started: int = 0
    finished: int = 0


async def run_workload(
    address: str,
    prompts: Sequence[str],
    concurrency: int,
    max_new_tokens: int,
    retry_window_s: float = 90.0,
    timeout_s: float = 300.0,
    counts: Counts | None = None,
    on_done: Callable[[Counts], None] | None = None,
) -> list[Outcome]:
    """Every prompt once, ``concurrency`` at a time; outcomes in prompt order. ``counts`` follows
    the requests started and finished; ``on_done`` is called with it after each request."""
    sem = asyncio.Semaphore(max(1, concurrency))
    counts = counts if counts is not None else Counts()
    async with AsyncClient(address) as client:

        async def one(i: int, prompt: str) -> Outcome:
            async with sem:
                counts.started += 1
                out = await generate_with_retries(client, prompt, i, max_new_tokens, retry_window_s, timeout_s)
                counts.finished += 1
            if on_done is not None:
                on_done(counts)
            return out

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def tally(
    report: PhaseReport, outcomes: Sequence[Outcome], reference: Sequence[tuple[int, ...] | None] | None
) -> PhaseReport:
    report.sent = len(outcomes)
    report.completed = sum(o.tokens is not None for o in outcomes)
    report.failed = report.sent - report.completed
    report.retries = sum(o.attempts - 1 for o in outcomes)
    if reference is not None:
        report.differ = sum(
            1
            for o in outcomes
            if o.tokens is not None and reference[o.index] is not None and o.tokens != reference[o.index]
        )
    for o in outcomes:
        if o.error:
            key = o.error.split(":", 1)[0]
            report.errors[key] = report.errors.get(key, 0) + 1
    return report


async def wait_back(cluster: Any, process: str, timeout_s: float) -> float | None:
    """Seconds until ``process`` is up again after a kill (Redis: answers PING; a service: its
    health check says SERVING and, for the control plane, the router sees every model), or
    None when it is not back within ``timeout_s``."""
    from common.platform.grpc_server import check_health
    from common.platform.store import Store, StoreUnavailable

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        proc = cluster.proc(process)
        if proc.popen.poll() is None:
            if process == "redis":
                store = Store.from_url(cluster.redis_url)
                try:
                    await store.ping()
                    return time.monotonic() - t0
                except StoreUnavailable:
                    pass
                finally:
                    await store.close()
            elif await check_health(proc.address, timeout_s=1.0):
                return time.monotonic() - t0
        await asyncio.sleep(0.1)
    return None


async def kill_phase(
    cluster: Any,
    victim: str,
    prompts: Sequence[str],
    reference: Sequence[tuple[int, ...] | None],
    concurrency: int,
    max_new_tokens: int,
    retry_window_s: float,
    recovery_timeout_s: float,
    say: Callable[[str], None],
) -> PhaseReport:
    """Run the workload and SIGKILL ``victim`` once a quarter of it has finished; wait until the
    supervisor has brought it back and the router sees every model again."""
    process = "drafter-0" if victim == "drafter" else victim
    report = PhaseReport(f"kill {victim}", victim, process)
    restarts_before = cluster.supervisor.restarts.get(process, 0)
    trigger = asyncio.Event()
    kill_at = max(1, len(prompts) // 4)
    back: asyncio.Task[float | None] | None = None
    counts = Counts()

    def on_done(c: Counts) -> None:
        if c.finished >= kill_at:
            trigger.set()

    async def killer() -> None:
        nonlocal back
        try:
            await asyncio.wait_for(trigger.wait(), timeout=120)
        except asyncio.TimeoutError:
            pass
        report.in_flight_at_kill = counts.started - counts.finished
        cluster.kill(process)
        say(f"chaos      {process} killed (SIGKILL) with {report.in_flight_at_kill} request(s) in flight")
        back = asyncio.create_task(wait_back(cluster, process, recovery_timeout_s))

    t0 = time.monotonic()
    kill_task = asyncio.create_task(killer())
    outcomes = await run_workload(
        cluster.gateway_address, prompts, concurrency, max_new_tokens, retry_window_s, counts=counts, on_done=on_done
    )
    trigger.set()
    await kill_task
    report.wall_s = time.monotonic() - t0
    if back is not None:
        report.back_after_s = await back
    if report.back_after_s is not None:
        from cosine_cli.cluster import ClusterError

        try:  # the next phase starts with every model seen by the router
            await cluster._wait_router_ready(len(cluster.spec.drafters), timeout_s=recovery_timeout_s)
        except ClusterError as exc:
            say(f"chaos      {exc}")
            report.back_after_s = None
    report.restarts = cluster.supervisor.restarts.get(process, 0) - restarts_before
    tally(report, outcomes, reference)
    back_txt = f"back after {report.back_after_s:.1f} s" if report.back_after_s is not None else "NOT back"
    say(
        f"chaos      {process} {back_txt}; {report.completed}/{report.sent} completed, {report.failed} failed, "
        f"{report.retries} retries, {report.differ} differ"
    )
    return report
