"""The figures a distilled zoo is judged by: which drafter agrees with the target on which domain,
how sure the target is on each, and what a drafter step costs against a target step.

Every figure is measured on the held-out prompts the teacher stage wrote continuations for, never
on the training prompts.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from common.logs import get_logger
from cosine_zoo import distill, evaluate
from cosine_zoo.manifest import evaluation_record
from cosine_zoo.profiles import DistillProfile

log = get_logger("cosine_zoo.build")


def evaluate_distilled(
    target: Any,
    drafters: dict[str, Any],
    vocab: Any,
    heldout: dict[str, list[distill.Example]],
    profile: DistillProfile,
    device: str = "cpu",
) -> dict[str, Any]:
    """The drafter x domain acceptance matrix on the target's greedy continuations of the held-out
    prompts, the rounds behind each figure, the target's held-out perplexity, and each specialist's
    acceptance on its own domain over the generalist's there (``specialist_ratio``)."""
    spec = profile.evaluation
    matrix = {name: {} for name in drafters}
    rounds = {name: {} for name in drafters}
    for d in heldout:
        for name, drafter in drafters.items():
            stats = evaluate.acceptance(distill.draft_matches(drafter, vocab, heldout[d], device=device), spec.k)
            matrix[name][d] = round(stats.mean_accepted, 4)
            rounds[name][d] = stats.rounds
    # perplexity on the held-out prompt text plus the target's own continuation of it
    perplexity = {}
    for d in heldout:
        stream = torch.tensor([t for ex in heldout[d] for t in ex.prompt])
        perplexity[d] = round(
            evaluate.perplexity(target, stream, min(spec.ppl_seq_len, len(stream) - 1), spec.ppl_windows, device), 4
        )
    log.info("evaluated", acceptance=matrix)
    return evaluation_record(spec, perplexity, matrix, rounds)


def step_costs(target_path: Path, drafter_paths: dict[str, Path], profile: DistillProfile) -> dict[str, Any]:
    """Milliseconds of one decode step at batch 1 on one thread, target and each drafter (the project's runner)."""
    from common.runtime.runner import LMRunner, SeqInput

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def step_ms(path: Path) -> float:
            runner = LMRunner.from_checkpoint(path, backend="sdpa")
            pool = runner.new_pool(None)
            cache = pool.new_cache()
            ctx = profile.step_cost_context
            cache.reserve(ctx + 40)
            runner.forward([SeqInput(cache, tuple(range(1, ctx + 1)))])
            cache.commit(ctx)
            times = []
            for i in range(25):
                t0 = time.perf_counter()
                runner.forward([SeqInput(cache, (1 + i % 50,))])
                times.append(time.perf_counter() - t0)
                cache.commit(1)
            cache.release()
            return statistics.median(times[5:]) * 1000

        target_ms = step_ms(target_path)
        drafter_ms = {name: round(step_ms(p), 3) for name, p in drafter_paths.items()}
    finally:
        torch.set_num_threads(saved)
    worst = max(drafter_ms.values())
    return {
        "context": profile.step_cost_context,
        "threads": 1,
        "batch": 1,
        "target_ms": round(target_ms, 3),
        "drafter_ms": drafter_ms,
        "worst_ratio": round(worst / target_ms, 4),
    }
