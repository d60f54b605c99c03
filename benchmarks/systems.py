"""The systems the benchmark compares, behind one small interface.

Every system serves a :class:`~benchmarks.workloads.Workload` and returns a :class:`RunResult`:
one :class:`RequestRecord` per request (tokens, issue / first-token / finish times, speculation
statistics) and the counters of the run (verify batches, accepted tokens, verifier busy time, the
time split of the rounds).

- in-process: ``autoregressive`` (our verifier engine, continuous batching of plain decode steps).
- one request at a time: ``hf_generate`` and ``hf_assisted`` (transformers ``generate``, without
  and with ``assistant_model``). In a closed loop the clients still send ``C`` requests at once; the
  system serves them one after the other, so their latency includes the wait in line.
- services: every other system is a router configuration on one shared set of processes (Redis,
  verifier, drafters: :class:`ServicePlane`); switching system restarts only the router and the
  gateway with the system's router flags and re-seeds the expertise profiles, so every service
  system runs on the same processes, models and thread budget.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from benchmarks.workloads import BenchRequest, Workload


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


# ---- in-process: autoregressive decoding through the verifier engine ---------------------------


class AutoregressiveSystem:
    """The target alone: plain decode steps (empty trees) through :class:`VerifierEngine`, with
    continuous batching (up to ``max_batch`` requests per forward pass, the router's default)."""

    one_at_a_time = False

    def __init__(self, target: str, eos_id: int | None, threads: int, max_batch: int = 16, name: str = "autoregressive"):
        self.name = name
        self.description = f"target alone, batched plain decoding (up to {max_batch} requests per pass) in our verifier engine"
        self.target, self.eos_id, self.threads, self.max_batch = target, eos_id, threads, max_batch
        self.engine = None

    def describe(self) -> dict[str, Any]:
        return {"description": self.description, "kind": "in-process", "torch_threads": self.threads, "max_batch": self.max_batch}

    def start(self) -> None:
        import torch

        from services.verifier.engine import VerifierEngine

        torch.set_num_threads(self.threads)
        self.engine = VerifierEngine.from_checkpoint(self.target, seed=0)

    def stop(self) -> None:
        self.engine = None

    def warm_up(self, workload: Workload) -> None:
        self.run(workload)

    def run(self, workload: Workload) -> RunResult:
        from common.spec_types import SamplingParams, TokenTree, VerifyItem

        engine = self.engine
        assert engine is not None, "start() first"
        spec = workload.spec
        reqs = workload.requests
        records = {r.index: RequestRecord(r.index, r.domain) for r in reqs}
        tokens: dict[int, list[int]] = {r.index: [] for r in reqs}
        active: list[BenchRequest] = []
        seen: set[int] = set()
        nxt = 0
        steps = 0
        busy_ns = 0
        step_s = 0.0
        t0 = time.perf_counter()
        while nxt < len(reqs) or active:
            now = time.perf_counter() - t0
            if spec.kind == "closed":
                while nxt < len(reqs) and len(active) < spec.concurrency:
                    records[reqs[nxt].index].issued_s = now
                    active.append(reqs[nxt])
                    nxt += 1
            else:
                while nxt < len(reqs) and reqs[nxt].arrival_s <= now:
                    records[reqs[nxt].index].issued_s = reqs[nxt].arrival_s
                    active.append(reqs[nxt])
                    nxt += 1
                if not active:
                    time.sleep(max(0.0, reqs[nxt].arrival_s - now))
                    continue
            batch = active[: self.max_batch]
            items = [
                VerifyItem(
                    request_id=str(r.index), append_ids=() if r.index in seen else r.prompt_ids, tree=TokenTree(),
                    sampling=SamplingParams(temperature=r.temperature, seed=r.seed),
                )
                for r in batch
            ]
            s0 = time.perf_counter()
            outcome = engine.verify(items)
            s1 = time.perf_counter()
            steps += 1
            busy_ns += outcome.timings.total_ns
            step_s += s1 - s0
            done = []
            for r, verdict in zip(batch, outcome.verdicts):
                rec = records[r.index]
                seen.add(r.index)
                if not verdict.ok:
                    rec.error = verdict.error
                    done.append(r)
                    continue
                toks = tokens[r.index]
                toks.append(int(verdict.next_token))
                rec.rounds += 1
                if rec.first_token_s is None:
                    rec.first_token_s = s1 - t0
                if len(toks) >= r.max_new_tokens or (self.eos_id is not None and toks[-1] == self.eos_id):
                    done.append(r)
            for r in done:
                rec = records[r.index]
                rec.finished_s = time.perf_counter() - t0
                rec.token_ids = tuple(tokens[r.index])
                engine.release(str(r.index))
                active.remove(r)
        wall = max((rec.finished_s for rec in records.values()), default=0.0) - min((rec.issued_s for rec in records.values()), default=0.0)
        out = [records[r.index] for r in reqs]
        return RunResult(out, wall, {
            "verify_batches": steps, "accepted_tokens": 0, "tokens_committed": sum(len(r.token_ids) for r in out),
            "verifier_busy_s": busy_ns / 1e9, "drafter_busy_s": 0.0, "round_s": step_s, "drafter_calls": 0,
        })


# ---- one request at a time: transformers generate ----------------------------------------------


class _FirstToken:
    """A ``generate`` streamer that only notes when the first new token appears."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_at: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_at is None:  # the first put() is the prompt
            self.first_at = time.perf_counter()

    def end(self) -> None:
        pass


class _ForwardTimer:
    """Counts forward calls of a module and the time they take."""

    def __init__(self, module: Any) -> None:
        self.calls = 0
        self.seconds = 0.0
        self._t = 0.0
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        self._t = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - self._t

    def reset(self) -> tuple[int, float]:
        out = (self.calls, self.seconds)
        self.calls, self.seconds = 0, 0.0
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class HFGenerateSystem:
    """transformers ``generate`` on the target, one request at a time; with ``assistant`` set,
    assisted generation (transformers' own speculative decoding with its default schedule)."""

    one_at_a_time = True

    def __init__(self, name: str, target: str, eos_id: int | None, pad_id: int | None, threads: int, assistant: str = ""):
        self.name = name
        self.target, self.assistant_path, self.eos_id, self.pad_id, self.threads = target, assistant, eos_id, pad_id, threads
        self.description = ("transformers assisted generation (assistant_model = generalist drafter), one request at a time"
                            if assistant else "transformers generate on the target, one request at a time")
        self.model = self.assistant = None
        self.timers: list[_ForwardTimer] = []

    def describe(self) -> dict[str, Any]:
        return {"description": self.description, "kind": "one-at-a-time", "torch_threads": self.threads, "effective_concurrency": 1}

    def start(self) -> None:
        import torch

        from common.checkpoints import load_causal_lm

        torch.set_num_threads(self.threads)
        self.model = load_causal_lm(self.target)
        self.timers = [_ForwardTimer(self.model)]
        if self.assistant_path:
            from common.checkpoints import read_config
            from common.draft_vocab import in_target_space, load_draft_vocab

            self.assistant = load_causal_lm(self.assistant_path)
            vocab = load_draft_vocab(self.assistant_path, read_config(self.assistant_path))
            if vocab is not None:  # transformers wants the target's vocabulary on both sides
                self.assistant = in_target_space(self.assistant, vocab)
            self.timers.append(_ForwardTimer(self.assistant))

    def stop(self) -> None:
        for t in self.timers:
            t.remove()
        self.model = self.assistant = None

    def warm_up(self, workload: Workload) -> None:
        self.run(workload)

    def _generate(self, r: BenchRequest) -> tuple[tuple[int, ...], float | None]:
        import torch

        ids = torch.tensor([list(r.prompt_ids)], dtype=torch.long)
        kw: dict[str, Any] = dict(
            attention_mask=torch.ones_like(ids), max_new_tokens=r.max_new_tokens, eos_token_id=self.eos_id,
            pad_token_id=self.pad_id if self.pad_id is not None else self.eos_id, streamer=_FirstToken(),
        )
        if r.temperature > 0:
            kw.update(do_sample=True, temperature=r.temperature, top_k=0, top_p=1.0)
            torch.manual_seed(r.seed or 0)
        else:
            kw.update(do_sample=False)
        if self.assistant is not None:
            kw["assistant_model"] = self.assistant
        with torch.inference_mode():
            out = self.model.generate(ids, **kw)
        return tuple(int(t) for t in out[0, ids.shape[1]:].tolist()), kw["streamer"].first_at

    def run(self, workload: Workload) -> RunResult:
        spec = workload.spec
        reqs = workload.requests
        for t in self.timers:
            t.reset()
        records: list[RequestRecord] = []
        gen_s = 0.0
        t0 = time.perf_counter()
        finished: list[float] = []
        for i, r in enumerate(reqs):
            rec = RequestRecord(r.index, r.domain)
            if spec.kind == "closed":
                # C clients send at once; the one freed by request i - C sends request i
                rec.issued_s = 0.0 if i < spec.concurrency else finished[i - spec.concurrency]
            else:
                rec.issued_s = r.arrival_s
                wait = r.arrival_s - (time.perf_counter() - t0)
                if wait > 0:
                    time.sleep(wait)
            g0 = time.perf_counter()
            calls0 = self.timers[0].calls
            try:
                rec.token_ids, first = self._generate(r)
                rec.first_token_s = None if first is None else first - t0
            except Exception as exc:  # reported per request, like a service error
                rec.error = f"{type(exc).__name__}: {exc}"
            g1 = time.perf_counter()
            # every target pass commits its accepted draft tokens + 1 (the first: prompt -> 1 token)
            rec.rounds = self.timers[0].calls - calls0
            if self.assistant is not None:
                rec.accepted_tokens = max(0, len(rec.token_ids) - rec.rounds)
                rec.accepted_by_drafter = {"generalist": rec.accepted_tokens}
                rec.drafters_used = ("generalist",)
            gen_s += g1 - g0
            rec.finished_s = g1 - t0
            finished.append(rec.finished_s)
            records.append(rec)
        target_calls, target_s = self.timers[0].reset()
        assist_calls, assist_s = self.timers[1].reset() if len(self.timers) > 1 else (0, 0.0)
        committed = sum(len(r.token_ids) for r in records)
        accepted = sum(r.accepted_tokens for r in records)
        wall = max(r.finished_s for r in records) - min(r.issued_s for r in records) if records else 0.0
        return RunResult(records, wall, {
            "verify_batches": target_calls, "accepted_tokens": accepted, "tokens_committed": committed,
            "verifier_busy_s": target_s, "drafter_busy_s": assist_s, "round_s": gen_s, "drafter_calls": assist_calls,
        })


# ---- services: router configurations on one set of processes -----------------------------------


class ServicePlane:
    """Redis + verifier + drafter processes, started once and shared by every service system, and
    one router and gateway per router configuration: each service system keeps its own for the
    whole run (what it learns online stays with it), and going from one system to the next
    restarts nothing, so the benchmark can run every system on one workload before the next."""

    def __init__(self, target: str, drafters: Mapping[str, str], domains: Mapping[str, Sequence[str]],
                 acceptance: Mapping[str, Mapping[str, float]], cores: int, log_dir: str, prior_weight: float = 20.0,
                 lexicon: Mapping[str, tuple[int, Mapping[int, int]]] | None = None,
                 corpus: Mapping[str, Sequence[Sequence[int]]] | None = None):
        from cosine_cli.cluster import ClusterSpec, LocalCluster

        self.acceptance = acceptance
        self.lexicon = lexicon or {}
        self.corpus = corpus or {}
        self.prior_weight = prior_weight
        self.cluster = LocalCluster(ClusterSpec(
            target=target, drafters=dict(drafters), drafter_domains={k: list(v) for k, v in domains.items()},
            cores=cores, log_dir=log_dir, prefix="bench",
        ))
        self.started = False
        self.planes: dict[tuple[str, ...], Any] = {}  # router flags -> ControlPlane

    def ensure_started(self) -> None:
        if not self.started:
            self.cluster.start(progress=False)
            self.started = True
            from cosine_cli.cluster import ControlPlane

            self.planes[tuple(self.cluster.spec.router_args)] = ControlPlane(
                self.cluster.router_address, self.cluster.gateway_address, self.cluster.http_url)

    def use(self, router_args: Sequence[str], drafters: int | None, tag: str) -> Any:
        """The control plane (router and gateway addresses) running these router flags, started
        (its processes tagged ``tag``) unless one already does, with the expertise profiles and
        the domain lexicon re-seeded from the zoo."""
        self.ensure_started()
        plane = self.planes.get(tuple(router_args))
        if plane is None:
            plane = self.planes[tuple(router_args)] = self.cluster.add_control_plane(router_args, tag, drafters)
        self.reseed()
        return plane

    def reseed(self) -> None:
        """Profiles and domain lexicon back to the zoo's (online statistics and what routers learned
        dropped); the lookup corpus is rewritten only when it changed, so no router reloads it."""
        from cosine_cli.commands import seed_profiles

        asyncio.run(seed_profiles(self.cluster.redis_url, self.cluster.spec.prefix, dict(self.acceptance), self.prior_weight, reset=True,
                                  lexicon=self.lexicon, corpus=self.corpus))

    def stop(self) -> None:
        if self.started:
            self.cluster.stop()
            self.started = False
            self.planes.clear()


class ServiceSystem:
    """A router configuration served through the gateway (the SDK's streaming call, so the first
    token's arrival is observed)."""

    one_at_a_time = False

    def __init__(self, name: str, plane: ServicePlane, router_args: Sequence[str], description: str,
                 use_drafters: Sequence[str] = ()):
        self.name = name
        self.plane = plane
        self.use_drafters = tuple(use_drafters)
        self.router_args = tuple(router_args) + tuple(a for d in use_drafters for a in ("--use-drafters", d))
        self.description = description
        self.address = ""
        self.router_address = ""

    def describe(self) -> dict[str, Any]:
        return {"description": self.description, "kind": "services", "router_args": list(self.router_args),
                "drafters": list(self.use_drafters) or sorted(self.plane.cluster.spec.drafters)}

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
        from common.tls import open_channel
        from cosine.v1 import router_pb2, router_pb2_grpc

        async with open_channel(self.router_address, self.plane.cluster.spec.tls) as channel:
            st = await router_pb2_grpc.RouterStub(channel).Status(router_pb2.StatusRequest(), timeout=10)
        return dict(st.counters), {d.drafter_id: float(d.rounds) for d in st.drafters}

    async def _run(self, workload: Workload) -> RunResult:
        from cosine_client import AsyncClient

        before, d_before = await self._status()
        async with AsyncClient(self.address, timeout=600, **self.plane.cluster.client_tls()) as client:
            async def serve(r: BenchRequest, rec: RequestRecord, t0: float) -> None:
                kw: dict[str, Any] = {}
                if r.temperature > 0:
                    kw.update(temperature=r.temperature, seed=r.seed)
                toks: list[int] = []
                try:
                    async for chunk in client.stream(prompt_ids=list(r.prompt_ids), max_new_tokens=r.max_new_tokens, **kw):
                        if chunk.token_ids and rec.first_token_s is None:
                            rec.first_token_s = time.perf_counter() - t0
                        toks.extend(chunk.token_ids)
                        if chunk.finished and chunk.stats is not None:
                            s = chunk.stats
                            rec.rounds, rec.accepted_tokens = s.rounds, s.accepted_tokens
                            rec.accepted_by_drafter, rec.drafters_used = dict(s.accepted_by_drafter), tuple(s.drafters_used)
                except Exception as exc:
                    rec.error = f"{type(exc).__name__}: {exc}"
                rec.token_ids = tuple(toks)
                rec.finished_s = time.perf_counter() - t0

            records = await drive(workload, serve)
        after, d_after = await self._status()
        diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        wall = max(r.finished_s for r in records) - min(r.issued_s for r in records) if records else 0.0
        counters = {
            "verify_batches": diff.get("rounds", 0.0), "accepted_tokens": diff.get("accepted_tokens", 0.0),
            "tokens_committed": diff.get("tokens_committed", 0.0), "verifier_busy_s": diff.get("verifier_busy_s", 0.0),
            "drafter_busy_s": diff.get("drafter_busy_s", 0.0), "drafter_calls": diff.get("drafter_calls", 0.0),
            "drafter_fused_rounds": diff.get("drafter_fused_rounds", 0.0),
            "round_s": diff.get("draft_s", 0.0) + diff.get("verify_s", 0.0) + diff.get("apply_s", 0.0),
            "draft_phase_s": diff.get("draft_s", 0.0), "verify_phase_s": diff.get("verify_s", 0.0), "apply_s": diff.get("apply_s", 0.0),
            "draft_tokens": diff.get("draft_tokens", 0.0), "rounds_drafted_ahead": diff.get("rounds_drafted_ahead", 0.0),
            "draft_ahead_s": diff.get("draft_ahead_s", 0.0), "routed_ahead": diff.get("routed_ahead", 0.0),
            "lookup_tokens": diff.get("lookup_tokens", 0.0), "lookup_accepted": diff.get("lookup_accepted", 0.0),
            "corpus_tokens": diff.get("corpus_tokens", 0.0), "corpus_accepted": diff.get("corpus_accepted", 0.0),
            "domains_by_lexicon": diff.get("domains_by_lexicon", 0.0), "domains_by_drafters": diff.get("domains_by_drafters", 0.0),
        }
        rounds = {d: d_after.get(d, 0.0) - d_before.get(d, 0.0) for d in d_after}
        return RunResult(records, wall, counters, {d: n for d, n in rounds.items() if n})


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


# ---- the catalogue -------------------------------------------------------------------------------

# router flags of each service system: the mechanisms are settings, never separate code
FIXED_K = ("--no-adaptive-k", "--no-cost-control", "--initial-k", "4", "--no-lookup-drafts")
SERVICE_SYSTEMS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    # name: (router flags, drafters used (empty: all), description)
    "vanilla_sd": (("--no-routing", "--fusion", "chunk", "--drafters-per-request", "1", "--rounds-in-flight", "1", *FIXED_K),
                   ("generalist",), "one generalist drafter, fixed k=4, no routing, no fusion, no pipelining (the paper's baseline)"),
    "specinfer_tree": (("--all-drafters", "--no-routing", "--fusion", "chunk", "--rounds-in-flight", "1", *FIXED_K), (),
                       "every drafter drafts every request; chains merged into one token tree; no routing, no fusion, no pipelining"),
    "cosine": ((), (), "everything on: routing by expertise, chunk fusion into a token tree, lookup drafting, pipelining while it pays, adaptive k, "
                       "cost-aware control"),
    "cosine_no_routing": (("--no-routing",), (), "cosine with routing off (fixed first drafters)"),
    "cosine_token_fusion": (("--fusion", "token"), (), "cosine with per-token fusion (fused at every draft step) instead of chunk fusion"),
    "cosine_step_fusion": (("--fusion", "token", "--no-local-fusion"), (),
                           "cosine with token fusion driven by the router, one message per draft step (not one per round)"),
    "cosine_no_pipeline": (("--rounds-in-flight", "1"), (), "cosine with one round in flight (no pipelining)"),
    "cosine_no_control": (("--no-cost-control",), (), "cosine with cost-aware control off (every drafted node verified)"),
    "cosine_drafter_domains": (("--domain-detection", "drafters"), (),
                               "cosine with every live drafter scoring each new prompt for its domain (no lexicon)"),
    "cosine_fixed_pipeline": (("--no-pipeline-control",), (),
                              "cosine keeping --rounds-in-flight rounds in flight whatever drafting and verifying cost"),
    "cosine_unshared_lexicon": (("--no-shared-lexicon",), (),
                                "cosine whose router learns its domain lexicon from nothing (no zoo seed, nothing shared through Redis)"),
    "cosine_global_gate": (("--no-domain-gate",), (),
                           "cosine whose draft gate keeps one record of whether drafting pays for every request, whatever its domain"),
    "cosine_unpriced_drafting": (("--no-draft-pricing",), (),
                                 "cosine pricing only verify rows when deciding whether a request drafts (the drafters' time unpriced)"),
    "cosine_no_lookup": (("--no-lookup-drafts",), (), "cosine without the lookup drafter (only the drafter models propose)"),
    "cosine_one_drafter": (("--drafters-per-request", "1"), (), "cosine with one drafter per request"),
    "services_plain": (("--no-speculate",), (),
                       "the target alone through the same services (gateway, router, verifier), drafting off: what the "
                       "serving path costs without speculation"),
    "cosine_no_corpus": (("--no-lookup-corpus",), (),
                         "cosine whose lookup drafter proposes from each request's own text only (no lookup corpus)"),
    "cosine_no_draft_ahead": (("--no-draft-ahead",), (),
                              "cosine whose rounds wait for their drafting requests (none drafts while the others are verified)"),
}
IN_PROCESS_SYSTEMS = ("autoregressive", "hf_generate", "hf_assisted")
ALL_SYSTEMS = ("autoregressive", "hf_generate", "hf_assisted", "vanilla_sd", "specinfer_tree", "cosine",
               "cosine_no_routing", "cosine_token_fusion", "cosine_no_pipeline", "cosine_no_control", "cosine_drafter_domains",
               "cosine_unpriced_drafting", "cosine_fixed_pipeline", "cosine_no_lookup", "cosine_no_draft_ahead",
               "cosine_unshared_lexicon", "cosine_global_gate", "cosine_step_fusion", "cosine_no_corpus",
               "services_plain", "cosine_one_drafter")
# what a plain `cosine bench` runs: the baselines the goals are stated against and the ablations that
# explain them, sized to finish within 25 minutes on 2 cores with the smol zoo (--systems all: every one)
DEFAULT_SYSTEMS = ("autoregressive", "services_plain", "hf_assisted", "vanilla_sd", "cosine", "cosine_token_fusion", "cosine_no_control",
                   "cosine_no_lookup", "cosine_no_draft_ahead", "cosine_no_corpus")


def make_systems(names: Sequence[str], zoo: Any, eos_id: int | None, pad_id: int | None, cores: int, log_dir: str,
                 threads: int = 1) -> tuple[list[Any], ServicePlane | None]:
    """The systems named, in that order. In-process systems run ``threads`` torch threads; the
    service processes split ``cores`` (see :func:`cosine_cli.cluster.thread_budget`)."""
    unknown = [n for n in names if n not in ALL_SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)} (choose from {', '.join(ALL_SYSTEMS)})")
    target = str(zoo.target.path)
    plane = None
    if any(n in SERVICE_SYSTEMS for n in names):
        plane = ServicePlane(target, {n: str(d.path) for n, d in zoo.drafters.items()},
                             {n: d.domains for n, d in zoo.drafters.items()}, zoo.acceptance, cores, log_dir, lexicon=zoo.lexicon,
                             corpus=zoo.lookup_corpus)
    out: list[Any] = []
    for n in names:
        if n == "autoregressive":
            out.append(AutoregressiveSystem(target, eos_id, threads))
        elif n == "hf_generate":
            out.append(HFGenerateSystem(n, target, eos_id, pad_id, threads))
        elif n == "hf_assisted":
            out.append(HFGenerateSystem(n, target, eos_id, pad_id, threads, assistant=str(zoo.drafters["generalist"].path)))
        else:
            flags, drafters, desc = SERVICE_SYSTEMS[n]
            assert plane is not None
            out.append(ServiceSystem(n, plane, flags, desc, drafters))
    return out, plane
