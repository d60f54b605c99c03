"""transformers' own ``generate`` as a benchmark system, without and with ``assistant_model``
(``hf_generate``, ``hf_assisted``): one request at a time, timed per forward pass.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.records import RequestRecord, RunResult
from benchmarks.workloads import BenchRequest, Workload


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

    def __init__(
        self,
        name: str,
        target: str,
        eos_id: int | None,
        pad_id: int | None,
        threads: int,
        assistant: str = "",
        dtype: str = "float32",
    ):
        self.dtype = dtype  # as the verifier resolves it (benchmarks.systems.target_dtype)
        self.name = name
        self.target, self.assistant_path, self.eos_id, self.pad_id, self.threads = (
            target,
            assistant,
            eos_id,
            pad_id,
            threads,
        )
        self.description = (
            "transformers assisted generation (assistant_model = generalist drafter), one request at a time"
            if assistant
            else "transformers generate on the target, one request at a time"
        )
        self.model = self.assistant = None
        self.timers: list[_ForwardTimer] = []
        # transformers' own kernels: in bfloat16 a pass's rounding follows its shape, so a greedy
        # output may leave the target's own at a near tie; in float32 it may not
        self.exact_greedy = self.dtype == "float32"

    def describe(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "kind": "one-at-a-time",
            "torch_threads": self.threads,
            "effective_concurrency": 1,
            "dtype": self.dtype,
            "greedy_checked": self.exact_greedy,
        }

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
            attention_mask=torch.ones_like(ids),
            max_new_tokens=r.max_new_tokens,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id if self.pad_id is not None else self.eos_id,
            streamer=_FirstToken(),
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
        return tuple(int(t) for t in out[0, ids.shape[1] :].tolist()), kw["streamer"].first_at

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
        return RunResult(
            records,
            wall,
            {
                "verify_batches": target_calls,
                "accepted_tokens": accepted,
                "tokens_committed": committed,
                "verifier_busy_s": target_s,
                "drafter_busy_s": assist_s,
                "round_s": gen_s,
                "drafter_calls": assist_calls,
            },
        )


# ---- the catalogue -------------------------------------------------------------------------------
