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

from benchmarks.records import RequestRecord, RunResult, System
from benchmarks.service_systems import SERVICE_SYSTEMS, ServicePlane, ServiceSystem
from benchmarks.workloads import BenchRequest, Workload

__all__ = ["ALL_SYSTEMS", "DEFAULT_SYSTEMS", "IN_PROCESS_SYSTEMS", "AutoregressiveSystem", "HFGenerateSystem",
           "RequestRecord", "RunResult", "System", "make_systems"]


def target_dtype(dtype: str) -> str:
    """The dtype the verifier service resolves its ``--dtype`` to on this machine (``auto``:
    bfloat16 on a CPU with AMX), so that the in-process systems run the same model."""
    from common.runtime.runner import resolve_dtype

    return resolve_dtype(dtype, "cpu")


# ---- in-process: autoregressive decoding through the verifier engine ---------------------------


class AutoregressiveSystem:
    """The target alone: plain decode steps (empty trees) through :class:`VerifierEngine`, with
    continuous batching (up to ``max_batch`` requests per forward pass, the router's default)."""

    one_at_a_time = False

    def __init__(self, target: str, eos_id: int | None, threads: int, max_batch: int = 16, name: str = "autoregressive",
                 dtype: str = "float32"):
        self.dtype = target_dtype(dtype)
        self.name = name
        self.description = f"target alone, batched plain decoding (up to {max_batch} requests per pass) in our verifier engine"
        self.target, self.eos_id, self.threads, self.max_batch = target, eos_id, threads, max_batch
        self.engine = None

    def describe(self) -> dict[str, Any]:
        return {"description": self.description, "kind": "in-process", "torch_threads": self.threads, "max_batch": self.max_batch,
                "dtype": self.dtype}

    def start(self) -> None:
        import torch

        from common.runtime.verifier_engine import VerifierEngine

        torch.set_num_threads(self.threads)
        self.engine = VerifierEngine.from_checkpoint(self.target, seed=0, dtype=self.dtype)

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

    def __init__(self, name: str, target: str, eos_id: int | None, pad_id: int | None, threads: int, assistant: str = "",
                 dtype: str = "float32"):
        self.dtype = target_dtype(dtype)
        self.name = name
        self.target, self.assistant_path, self.eos_id, self.pad_id, self.threads = target, assistant, eos_id, pad_id, threads
        self.description = ("transformers assisted generation (assistant_model = generalist drafter), one request at a time"
                            if assistant else "transformers generate on the target, one request at a time")
        self.model = self.assistant = None
        self.timers: list[_ForwardTimer] = []
        # transformers' own kernels: in bfloat16 a pass's rounding follows its shape, so a greedy
        # output may leave the target's own at a near tie; in float32 it may not
        self.exact_greedy = self.dtype == "float32"

    def describe(self) -> dict[str, Any]:
        return {"description": self.description, "kind": "one-at-a-time", "torch_threads": self.threads, "effective_concurrency": 1,
                "dtype": self.dtype, "greedy_checked": self.exact_greedy}

    def start(self) -> None:
        import torch

        from common.runtime.checkpoints import load_causal_lm

        torch.set_num_threads(self.threads)
        self.model = load_causal_lm(self.target, dtype=self.dtype)
        self.timers = [_ForwardTimer(self.model)]
        if self.assistant_path:
            from common.runtime.checkpoints import read_config
            from common.runtime.draft_vocab import in_target_space, load_draft_vocab

            self.assistant = load_causal_lm(self.assistant_path, dtype=self.dtype)
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


# ---- the catalogue -------------------------------------------------------------------------------

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
                 threads: int = 1, dtype: str = "float32") -> tuple[list[Any], ServicePlane | None]:
    """The systems named, in that order. In-process systems run ``threads`` torch threads; the
    service processes split ``cores`` (see :func:`cosine_cli.cluster.thread_budget`). Every
    system's target runs in ``dtype`` (the verifier's ``--dtype``; the drafters stay float32)."""
    unknown = [n for n in names if n not in ALL_SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)} (choose from {', '.join(ALL_SYSTEMS)})")
    target = str(zoo.target.path)
    plane = None
    if any(n in SERVICE_SYSTEMS for n in names):
        plane = ServicePlane(target, {n: str(d.path) for n, d in zoo.drafters.items()},
                             {n: d.domains for n, d in zoo.drafters.items()}, zoo.acceptance, cores, log_dir, lexicon=zoo.lexicon,
                             corpus=zoo.lookup_corpus, verifier_args=("--dtype", dtype))
    out: list[Any] = []
    for n in names:
        if n == "autoregressive":
            out.append(AutoregressiveSystem(target, eos_id, threads, dtype=dtype))
        elif n == "hf_generate":
            out.append(HFGenerateSystem(n, target, eos_id, pad_id, threads, dtype=dtype))
        elif n == "hf_assisted":
            out.append(HFGenerateSystem(n, target, eos_id, pad_id, threads, assistant=str(zoo.drafters["generalist"].path), dtype=dtype))
        else:
            flags, drafters, desc = SERVICE_SYSTEMS[n]
            assert plane is not None
            out.append(ServiceSystem(n, plane, flags, desc, drafters))
    return out, plane
