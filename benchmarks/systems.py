"""The systems the benchmark compares, and the catalogue that builds them by name.

- in-process: ``autoregressive`` (our verifier engine, continuous batching of plain decode steps).
- one request at a time: ``hf_generate`` and ``hf_assisted`` (transformers ``generate``, without
  and with ``assistant_model``). In a closed loop the clients still send ``C`` requests at once; the
  system serves them one after the other, so their latency includes the wait in line.
- services: every other system is a router configuration served through the gateway
  (:mod:`benchmarks.service_systems`), all on one shared set of processes, each with a router and
  gateway of its own.

What a system returns (:class:`~benchmarks.records.RunResult`) is in :mod:`benchmarks.records`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from benchmarks.hf_systems import HFGenerateSystem
from benchmarks.records import RequestRecord, RunResult, System
from benchmarks.service_systems import SERVICE_SYSTEMS, ServicePlane, ServiceSystem
from benchmarks.workloads import BenchRequest, Workload

__all__ = [
    "ALL_SYSTEMS",
    "DEFAULT_SYSTEMS",
    "IN_PROCESS_SYSTEMS",
    "AutoregressiveSystem",
    "HFGenerateSystem",
    "RequestRecord",
    "RunResult",
    "System",
    "make_systems",
]


def target_dtype(dtype: str, device: str = "cpu") -> str:
    """The dtype the verifier service resolves its ``--dtype`` to on ``device`` (``auto``:
    bfloat16 on a CPU with AMX), so that the in-process systems run the same model."""
    from common.runtime.runner import resolve_dtype

    return resolve_dtype(dtype, device)


# ---- in-process: autoregressive decoding through the verifier engine ---------------------------


class AutoregressiveSystem:
    """The target alone: plain decode steps (empty trees) through :class:`VerifierEngine`, with
    continuous batching (up to ``max_batch`` requests per forward pass, the router's default)."""

    one_at_a_time = False

    def __init__(
        self,
        target: str,
        eos_id: int | None,
        threads: int,
        max_batch: int = 16,
        name: str = "autoregressive",
        dtype: str = "float32",
        device: str = "cpu",
    ):
        self.dtype = target_dtype(dtype, device)
        self.device = device
        self.name = name
        self.description = (
            f"target alone, batched plain decoding (up to {max_batch} requests per pass) in our verifier engine"
        )
        self.target, self.eos_id, self.threads, self.max_batch = target, eos_id, threads, max_batch
        self.engine = None

    def describe(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "kind": "in-process",
            "torch_threads": self.threads,
            "max_batch": self.max_batch,
            "dtype": self.dtype,
            "device": self.device,
        }

    def start(self) -> None:
        import torch

        from common.runtime.verifier_engine import VerifierEngine

        torch.set_num_threads(self.threads)
        self.engine = VerifierEngine.from_checkpoint(self.target, seed=0, dtype=self.dtype, device=self.device)

    def stop(self) -> None:
        self.engine = None

    def warm_up(self, workload: Workload) -> None:
        self.run(workload)

    def run(self, workload: Workload) -> RunResult:
        from common.spec.types import SamplingParams, TokenTree, VerifyItem

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
                    request_id=str(r.index),
                    append_ids=() if r.index in seen else r.prompt_ids,
                    tree=TokenTree(),
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
        wall = max((rec.finished_s for rec in records.values()), default=0.0) - min(
            (rec.issued_s for rec in records.values()), default=0.0
        )
        out = [records[r.index] for r in reqs]
        return RunResult(
            out,
            wall,
            {
                "verify_batches": steps,
                "accepted_tokens": 0,
                "tokens_committed": sum(len(r.token_ids) for r in out),
                "verifier_busy_s": busy_ns / 1e9,
                "drafter_busy_s": 0.0,
                "round_s": step_s,
                "drafter_calls": 0,
            },
        )


IN_PROCESS_SYSTEMS = ("autoregressive", "hf_generate", "hf_assisted")
ALL_SYSTEMS = (
    "autoregressive",
    "hf_generate",
    "hf_assisted",
    "vanilla_sd",
    "specinfer_tree",
    "cosine",
    "cosine_no_routing",
    "cosine_token_fusion",
    "cosine_no_pipeline",
    "cosine_no_control",
    "cosine_drafter_domains",
    "cosine_unpriced_drafting",
    "cosine_fixed_pipeline",
    "cosine_no_lookup",
    "cosine_no_draft_ahead",
    "cosine_unshared_lexicon",
    "cosine_global_gate",
    "cosine_step_fusion",
    "cosine_no_corpus",
    "services_plain",
    "cosine_one_drafter",
    "cosine_no_guard",
    "cosine_no_chunks",
    "cosine_chunks",
)
# what a plain `cosine bench` runs: the baselines the goals are stated against and the ablations that
# explain them, sized to finish within 25 minutes on 2 cores with the smol zoo (--systems all: every one)
DEFAULT_SYSTEMS = (
    "autoregressive",
    "services_plain",
    "hf_assisted",
    "vanilla_sd",
    "cosine",
    "cosine_token_fusion",
    "cosine_no_control",
    "cosine_no_lookup",
    "cosine_no_draft_ahead",
    "cosine_no_corpus",
)


def make_systems(
    names: Sequence[str],
    zoo: Any,
    eos_id: int | None,
    pad_id: int | None,
    cores: int,
    log_dir: str,
    threads: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
) -> tuple[list[Any], ServicePlane | None]:
    """The systems named, in that order. In-process systems run ``threads`` torch threads; the
    service processes split ``cores`` (see :func:`cosine_cli.cluster.thread_budget`). Every
    system's target runs in ``dtype`` (the verifier's ``--dtype``; the drafters stay float32), and
    the verifier's and drafters' models on ``device`` (transformers' systems: on the CPU only)."""
    if device != "cpu" and any(n.startswith("hf_") for n in names):
        raise ValueError(f"transformers' systems run on the CPU only, not on {device}")
    unknown = [n for n in names if n not in ALL_SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)} (choose from {', '.join(ALL_SYSTEMS)})")
    target = str(zoo.target.path)
    plane = None
    if any(n in SERVICE_SYSTEMS for n in names):
        plane = ServicePlane(
            target,
            {n: str(d.path) for n, d in zoo.drafters.items()},
            {n: d.domains for n, d in zoo.drafters.items()},
            zoo.acceptance,
            cores,
            log_dir,
            lexicon=zoo.lexicon,
            corpus=zoo.lookup_corpus,
            verifier_args=("--dtype", dtype, "--device", device),
            drafter_args=("--device", device),
        )
    out: list[Any] = []
    for n in names:
        if n == "autoregressive":
            out.append(AutoregressiveSystem(target, eos_id, threads, dtype=dtype, device=device))
        elif n == "hf_generate":
            out.append(HFGenerateSystem(n, target, eos_id, pad_id, threads, dtype=target_dtype(dtype)))
        elif n == "hf_assisted":
            out.append(
                HFGenerateSystem(
                    n,
                    target,
                    eos_id,
                    pad_id,
                    threads,
                    assistant=str(zoo.drafters["generalist"].path),
                    dtype=target_dtype(dtype),
                )
            )
        else:
            flags, drafters, desc = SERVICE_SYSTEMS[n]
            assert plane is not None
            out.append(ServiceSystem(n, plane, flags, desc, drafters))
    return out, plane
