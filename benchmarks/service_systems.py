"""The service systems of the benchmark: router configurations served through the gateway.

Every service system is a router configuration (:data:`SERVICE_SYSTEMS`: the mechanisms are
settings, never separate code) on one shared set of processes, Redis, the verifier and the
drafters (:class:`ServicePlane`). Each system gets a router and gateway of its own beside them,
started once and kept for the whole run, so what a router learns online stays with its system and
going from one system to the next restarts nothing: the benchmark runs every system on one
workload before the next. Expertise profiles and the domain lexicon are re-seeded from the zoo
before every run, since the other systems' routers write to the same Redis keys.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from benchmarks.cpu_split import CpuMeter, cpu_counters
from benchmarks.records import RequestRecord, RunResult
from benchmarks.workloads import BenchRequest, Workload


class ServicePlane:
    """Redis + verifier + drafter processes, started once and shared by every service system, and
    one router and gateway per router configuration: each service system keeps its own for the
    whole run (what it learns online stays with it), and going from one system to the next
    restarts nothing, so the benchmark can run every system on one workload before the next."""

    def __init__(
        self,
        target: str,
        drafters: Mapping[str, str],
        domains: Mapping[str, Sequence[str]],
        acceptance: Mapping[str, Mapping[str, float]],
        cores: int,
        log_dir: str,
        prior_weight: float = 20.0,
        lexicon: Mapping[str, tuple[int, Mapping[int, int]]] | None = None,
        corpus: Mapping[str, Sequence[Sequence[int]]] | None = None,
        verifier_args: Sequence[str] = (),
        drafter_args: Sequence[str] = (),
    ):
        from cosine_cli.cluster import ClusterSpec, LocalCluster

        self.acceptance = acceptance
        self.lexicon = lexicon or {}
        self.corpus = corpus or {}
        self.prior_weight = prior_weight
        self.cluster = LocalCluster(
            ClusterSpec(
                target=target,
                drafters=dict(drafters),
                drafter_domains={k: list(v) for k, v in domains.items()},
                cores=cores,
                log_dir=log_dir,
                prefix="bench",
                verifier_args=tuple(verifier_args),
                drafter_args=tuple(drafter_args),
            )
        )
        self.started = False
        self.planes: dict[tuple[str, ...], Any] = {}  # router flags -> ControlPlane
        self.plane_procs: dict[
            tuple[str, ...], tuple[str, str]
        ] = {}  # router flags -> its router's and gateway's process names

    def ensure_started(self) -> None:
        if not self.started:
            self.cluster.start(progress=False)
            self.started = True
            from cosine_cli.cluster import ControlPlane

            self.planes[tuple(self.cluster.spec.router_args)] = ControlPlane(
                self.cluster.router_address, self.cluster.gateway_address, self.cluster.http_url
            )
            self.plane_procs[tuple(self.cluster.spec.router_args)] = ("router", "gateway")

    def use(self, router_args: Sequence[str], drafters: int | None, tag: str) -> Any:
        """The control plane (router and gateway addresses) running these router flags, started
        (its processes tagged ``tag``) unless one already does, with the expertise profiles and
        the domain lexicon re-seeded from the zoo."""
        self.ensure_started()
        plane = self.planes.get(tuple(router_args))
        if plane is None:
            plane = self.planes[tuple(router_args)] = self.cluster.add_control_plane(router_args, tag, drafters)
            self.plane_procs[tuple(router_args)] = (f"router-{tag}", f"gateway-{tag}")
        self.reseed()
        return plane

    def cpu_meter(self, router_args: Sequence[str]) -> CpuMeter:
        """The processes that serve the control plane running these router flags, by part: the
        shared verifier, drafters and Redis, its own router and gateway, and this process (the clients)."""
        router, gateway = self.plane_procs[tuple(router_args)]
        procs = self.cluster.watched()

        def pids(match: Callable[[str], bool]) -> list[int]:
            return [p.popen.pid for p in procs if match(p.name)]

        return CpuMeter(
            {
                "verifier": pids(lambda n: n == "verifier"),
                "drafters": pids(lambda n: n.startswith("drafter-")),
                "router": pids(lambda n: n == router),
                "gateway": pids(lambda n: n == gateway),
                "clients": [os.getpid()],
                "redis": pids(lambda n: n == "redis"),
            }
        )

    def reseed(self) -> None:
        """Profiles and domain lexicon back to the zoo's (online statistics and what routers learned
        dropped); the lookup corpus is rewritten only when it changed, so no router reloads it."""
        from cosine_cli.profiles import seed_profiles

        asyncio.run(
            seed_profiles(
                self.cluster.redis_url,
                self.cluster.spec.prefix,
                dict(self.acceptance),
                self.prior_weight,
                reset=True,
                lexicon=self.lexicon,
                corpus=self.corpus,
            )
        )

    def stop(self) -> None:
        if self.started:
            self.cluster.stop()
            self.started = False
            self.planes.clear()


class ServiceSystem:
    """A router configuration served through the gateway (the SDK's streaming call, so the first
    token's arrival is observed)."""

    one_at_a_time = False

    def __init__(
        self,
        name: str,
        plane: ServicePlane,
        router_args: Sequence[str],
        description: str,
        use_drafters: Sequence[str] = (),
    ):
        self.name = name
        self.plane = plane
        self.use_drafters = tuple(use_drafters)
        self.router_args = tuple(router_args) + tuple(a for d in use_drafters for a in ("--use-drafters", d))
        self.description = description
        self.address = ""
        self.router_address = ""

    def describe(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "kind": "services",
            "router_args": list(self.router_args),
            "drafters": list(self.use_drafters) or sorted(self.plane.cluster.spec.drafters),
        }

    def start(self) -> None:
        control = self.plane.use(self.router_args, len(self.use_drafters) or None, self.name)
        self.address, self.router_address = control.gateway_address, control.router_address

    def stop(self) -> None:
        pass  # the plane is stopped once, after the last service system

    def warm_up(self, workload: Workload) -> None:
        """Run a workload unmeasured (what it taught the router's profiles is forgotten before each run)."""
        self.run(workload)

    def run(self, workload: Workload) -> RunResult:
        self.plane.reseed()  # other systems' routers have written their online figures since
        return asyncio.run(self._run(workload))

    async def _status(self) -> tuple[dict[str, float], dict[str, float]]:
        from common.platform.tls import open_channel
        from cosine.v1 import router_pb2, router_pb2_grpc

        async with open_channel(self.router_address, self.plane.cluster.spec.tls) as channel:
            st = await router_pb2_grpc.RouterStub(channel).Status(router_pb2.StatusRequest(), timeout=10)
        return dict(st.counters), {d.drafter_id: float(d.rounds) for d in st.drafters}

    async def _run(self, workload: Workload) -> RunResult:
        from cosine_client import AsyncClient

        meter = self.plane.cpu_meter(self.router_args)
        before, d_before = await self._status()
        cpu_before = meter.read()
        async with AsyncClient(self.address, timeout=600, **self.plane.cluster.client_tls()) as client:

            async def serve(r: BenchRequest, rec: RequestRecord, t0: float) -> None:
                kw: dict[str, Any] = {}
                if r.temperature > 0:
                    kw.update(temperature=r.temperature, seed=r.seed)
                toks: list[int] = []
                try:
                    async for chunk in client.stream(
                        prompt_ids=list(r.prompt_ids), max_new_tokens=r.max_new_tokens, **kw
                    ):
                        if chunk.token_ids and rec.first_token_s is None:
                            rec.first_token_s = time.perf_counter() - t0
                        toks.extend(chunk.token_ids)
                        if chunk.finished and chunk.stats is not None:
                            s = chunk.stats
                            rec.rounds, rec.accepted_tokens = s.rounds, s.accepted_tokens
                            rec.accepted_by_drafter, rec.drafters_used = (
                                dict(s.accepted_by_drafter),
                                tuple(s.drafters_used),
                            )
                except Exception as exc:
                    rec.error = f"{type(exc).__name__}: {exc}"
                rec.token_ids = tuple(toks)
                rec.finished_s = time.perf_counter() - t0

            records = await drive(workload, serve)
        cpu_after = meter.read()
        after, d_after = await self._status()
        diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        wall = max(r.finished_s for r in records) - min(r.issued_s for r in records) if records else 0.0
        counters = {
            "verify_batches": diff.get("verify_passes", 0.0),
            "accepted_tokens": diff.get("accepted_tokens", 0.0),
            "tokens_committed": diff.get("tokens_committed", 0.0),
            "verifier_busy_s": diff.get("verifier_busy_s", 0.0),
            "drafter_busy_s": diff.get("drafter_busy_s", 0.0),
            "drafter_calls": diff.get("drafter_calls", 0.0),
            "drafter_fused_rounds": diff.get("drafter_fused_rounds", 0.0),
            "round_s": diff.get("draft_s", 0.0) + diff.get("verify_s", 0.0) + diff.get("apply_s", 0.0),
            "draft_phase_s": diff.get("draft_s", 0.0),
            "verify_phase_s": diff.get("verify_s", 0.0),
            "apply_s": diff.get("apply_s", 0.0),
            "draft_tokens": diff.get("draft_tokens", 0.0),
            "rounds_drafted_ahead": diff.get("rounds_drafted_ahead", 0.0),
            "draft_ahead_s": diff.get("draft_ahead_s", 0.0),
            "routed_ahead": diff.get("routed_ahead", 0.0),
            "lookup_tokens": diff.get("lookup_tokens", 0.0),
            "lookup_accepted": diff.get("lookup_accepted", 0.0),
            "corpus_tokens": diff.get("corpus_tokens", 0.0),
            "corpus_accepted": diff.get("corpus_accepted", 0.0),
            "domains_by_lexicon": diff.get("domains_by_lexicon", 0.0),
            "domains_by_drafters": diff.get("domains_by_drafters", 0.0),
            "plain_step_passes": diff.get("plain_step_passes", 0.0),
            "step_lookup_tokens": diff.get("step_lookup_tokens", 0.0),
            "step_lookup_accepted": diff.get("step_lookup_accepted", 0.0),
            "router_rounds": diff.get("rounds", 0.0),
            "guard_plain_rounds": diff.get("guard_plain_rounds", 0.0),
            "guard_withdrawals": diff.get("guard_withdrawals", 0.0),
            "guard_readmissions": diff.get("guard_readmissions", 0.0),
            # verification frontiers: drafted rows by what became of them, and the verifier's wait for drafts
            **{k: diff.get(k, 0.0) for k in FRONTIER_COUNTERS},
            **cpu_counters(cpu_before, cpu_after),
        }
        rounds = {d: d_after.get(d, 0.0) - d_before.get(d, 0.0) for d in d_after}
        return RunResult(records, wall, counters, {d: n for d, n in rounds.items() if n})


# the router's counters of verification frontiers (services/router/frontiers.py) the report carries as they are
FRONTIER_COUNTERS = (
    "rows_verified",
    "rows_accepted",
    "rows_beyond_rejection",
    "rows_pruned",
    "frontier_chunks",
    "frontier_chunks_kept",
    "verifier_wait_s",
)


async def drive(workload: Workload, serve: Callable[[BenchRequest, RequestRecord, float], Any]) -> list[RequestRecord]:
    """Run ``serve(request, record, t0)`` for every request of the workload, closed or open loop;
    sets ``issued_s`` (seconds since ``t0``) before each call."""
    reqs = workload.requests
    records = {r.index: RequestRecord(r.index, r.domain) for r in reqs}
    t0 = time.perf_counter()
    if workload.spec.kind == "closed":
        queue = list(reqs)
        queue.reverse()

        async def client() -> None:
            while queue:
                r = queue.pop()
                rec = records[r.index]
                rec.issued_s = time.perf_counter() - t0
                await serve(r, rec, t0)

        await asyncio.gather(*(client() for _ in range(max(1, workload.spec.concurrency))))
    else:
        tasks = []
        for r in reqs:
            wait = r.arrival_s - (time.perf_counter() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
            rec = records[r.index]
            rec.issued_s = r.arrival_s
            tasks.append(asyncio.create_task(serve(r, rec, t0)))
        await asyncio.gather(*tasks)
    return [records[r.index] for r in reqs]


# router flags of each service system: the mechanisms are settings, never separate code
FIXED_K = ("--no-adaptive-k", "--no-cost-control", "--initial-k", "4", "--no-lookup-drafts")
SERVICE_SYSTEMS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    # name: (router flags, drafters used (empty: all), description)
    "vanilla_sd": (
        ("--no-routing", "--fusion", "chunk", "--drafters-per-request", "1", "--rounds-in-flight", "1", *FIXED_K),
        ("generalist",),
        "one generalist drafter, fixed k=4, no routing, no fusion, no pipelining (the paper's baseline)",
    ),
    "specinfer_tree": (
        ("--all-drafters", "--no-routing", "--fusion", "chunk", "--rounds-in-flight", "1", *FIXED_K),
        (),
        "every drafter drafts every request; chains merged into one token tree; no routing, no fusion, no pipelining",
    ),
    "cosine": (
        (),
        (),
        "everything on: routing by expertise, chunk fusion into a token tree, lookup drafting, pipelining while it "
        "pays, adaptive k, "
        "cost-aware control",
    ),
    "cosine_no_routing": (("--no-routing",), (), "cosine with routing off (fixed first drafters)"),
    "cosine_token_fusion": (
        ("--fusion", "token"),
        (),
        "cosine with per-token fusion (fused at every draft step) instead of chunk fusion",
    ),
    "cosine_step_fusion": (
        ("--fusion", "token", "--no-local-fusion"),
        (),
        "cosine with token fusion driven by the router, one message per draft step (not one per round)",
    ),
    "cosine_no_pipeline": (("--rounds-in-flight", "1"), (), "cosine with one round in flight (no pipelining)"),
    "cosine_no_control": (
        ("--no-cost-control",),
        (),
        "cosine with cost-aware control off (every drafted node verified)",
    ),
    "cosine_drafter_domains": (
        ("--domain-detection", "drafters"),
        (),
        "cosine with every live drafter scoring each new prompt for its domain (no lexicon)",
    ),
    "cosine_fixed_pipeline": (
        ("--no-pipeline-control",),
        (),
        "cosine keeping --rounds-in-flight rounds in flight whatever drafting and verifying cost",
    ),
    "cosine_unshared_lexicon": (
        ("--no-shared-lexicon",),
        (),
        "cosine whose router learns its domain lexicon from nothing (no zoo seed, nothing shared through Redis)",
    ),
    "cosine_global_gate": (
        ("--no-domain-gate",),
        (),
        "cosine whose draft gate keeps one record of whether drafting pays for every request, whatever its domain",
    ),
    "cosine_unpriced_drafting": (
        ("--no-draft-pricing",),
        (),
        "cosine pricing only verify rows when deciding whether a request drafts (the drafters' time unpriced)",
    ),
    "cosine_no_lookup": (
        ("--no-lookup-drafts",),
        (),
        "cosine without the lookup drafter (only the drafter models propose)",
    ),
    "cosine_no_guard": (
        ("--no-yield-guard",),
        (),
        "cosine without the yield guard: the cost control's prices alone decide where it speculates",
    ),
    "cosine_one_drafter": (("--drafters-per-request", "1"), (), "cosine with one drafter per request"),
    "cosine_no_chunks": (
        ("--verify-chunks", "off"),
        (),
        "cosine verifying each draft whole in one pass (no verification frontiers), whatever the default",
    ),
    "cosine_chunks": (
        ("--verify-chunks", "auto"),
        (),
        "cosine verifying drafts chunk by chunk, each request's chunk depth from its acceptance, the next "
        "chunk drafted beside the pass and pruned unverified after a rejection",
    ),
    "services_plain": (
        ("--no-speculate",),
        (),
        "the target alone through the same services (gateway, router, verifier), drafting off: what the "
        "serving path costs without speculation",
    ),
    "cosine_no_corpus": (
        ("--no-lookup-corpus",),
        (),
        "cosine whose lookup drafter proposes from each request's own text only (no lookup corpus)",
    ),
    "cosine_no_draft_ahead": (
        ("--no-draft-ahead",),
        (),
        "cosine whose rounds wait for their drafting requests (none drafts while the others are verified)",
    ),
}
