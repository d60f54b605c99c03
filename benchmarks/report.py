"""Metrics of one run of one system on one workload, the ratios between systems, and the report.

Report schema (``cosine-bench/1``; documented in docs/benchmarks.md)::

    {
      "schema": "cosine-bench/1",
      "machine":  {platform, python, torch, transformers, cpu, cores, memory_gib, torch_threads, gpu},
      "scenario": {name, zoo, max_new_tokens, reference, workloads: {name: spec}, systems: {name: spec},
                   order, skipped: {system: {workloads, why}}, wall_s, greedy_check},
      "systems":  {system: {workload: metrics}},
      "ratios":   {headline ratio: value | null, ...,
                   "by_workload": {workload: {"<a>_vs_<b>_throughput" | "<a>_vs_<b>_latency"
                                              | "<a>_vs_<b>_sustained" (closed loops of several clients): value}}}
    }

Metrics of one (system, workload) pair (every key always present; null when not measurable)::

    requests, failed, output_tokens, wall_s, tokens_per_s, sustained_tokens_per_s (closed loops of
    several clients: tokens/s while every client was busy, without the drain), requests_per_s, offered_rps,
    latency_mean_s, latency_p50_s, latency_p99_s, ttft_mean_s, ttft_p50_s, ttft_p99_s, tpot_mean_s,
    mean_accepted_len (draft tokens accepted per request per round), tokens_per_round,
    verify_batches, mean_batch_requests, verifier_busy_frac,
    time_split {draft_s, verify_s, other_s, draft_frac, verify_frac, other_frac},
    bound_tokens_per_s, frac_of_bound,
    acceptance {drafter: {domain: accepted tokens per round}}, usage {drafter: {domain: share of requests}},
    latencies_s [sorted], effective_concurrency, counters {raw counters of the run}
"""

from __future__ import annotations

import math
import os
import platform
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.records import RunResult
from benchmarks.workloads import Workload

SCHEMA = "cosine-bench/1"

# headline ratios: (key, numerator system, denominator system, metric, workload role)
HEADLINE = (
    ("cosine_vs_vanilla_sd_throughput", "cosine", "vanilla_sd", "tokens_per_s", "high"),
    ("cosine_vs_vanilla_sd_latency", "cosine", "vanilla_sd", "latency_mean_s", "low"),
    ("cosine_vs_hf_assisted_throughput", "cosine", "hf_assisted", "tokens_per_s", "high"),
    ("cosine_vs_autoregressive_throughput", "cosine", "autoregressive", "tokens_per_s", "high"),
    ("cosine_vs_autoregressive_throughput_c1", "cosine", "autoregressive", "tokens_per_s", "c1"),
    ("cosine_vs_hf_assisted_throughput_c1", "cosine", "hf_assisted", "tokens_per_s", "c1"),
    ("cosine_vs_cosine_no_control_throughput", "cosine", "cosine_no_control", "tokens_per_s", "high"),
    ("cosine_vs_specinfer_tree_throughput", "cosine", "specinfer_tree", "tokens_per_s", "high"),
    ("vanilla_sd_vs_autoregressive_throughput", "vanilla_sd", "autoregressive", "tokens_per_s", "high"),
    ("cosine_vs_cosine_no_routing_throughput", "cosine", "cosine_no_routing", "tokens_per_s", "high"),
    ("cosine_vs_cosine_token_fusion_throughput", "cosine", "cosine_token_fusion", "tokens_per_s", "high"),
    ("cosine_vs_cosine_step_fusion_throughput_c1", "cosine", "cosine_step_fusion", "tokens_per_s", "c1"),
    ("cosine_vs_cosine_no_corpus_throughput_c1", "cosine", "cosine_no_corpus", "tokens_per_s", "c1"),
    ("cosine_vs_cosine_no_corpus_throughput", "cosine", "cosine_no_corpus", "tokens_per_s", "high"),
    ("cosine_vs_cosine_step_fusion_throughput", "cosine", "cosine_step_fusion", "tokens_per_s", "high"),
    ("cosine_vs_cosine_no_pipeline_throughput", "cosine", "cosine_no_pipeline", "tokens_per_s", "high"),
    ("cosine_vs_cosine_no_routing_latency", "cosine", "cosine_no_routing", "latency_mean_s", "low"),
    ("cosine_vs_cosine_token_fusion_latency", "cosine", "cosine_token_fusion", "latency_mean_s", "low"),
    ("cosine_vs_cosine_no_pipeline_latency", "cosine", "cosine_no_pipeline", "latency_mean_s", "low"),
    ("cosine_vs_cosine_drafter_domains_throughput", "cosine", "cosine_drafter_domains", "tokens_per_s", "high"),
    ("cosine_vs_cosine_drafter_domains_latency", "cosine", "cosine_drafter_domains", "latency_mean_s", "low"),
    ("cosine_vs_cosine_unpriced_drafting_throughput_c1", "cosine", "cosine_unpriced_drafting", "tokens_per_s", "c1"),
    ("cosine_vs_cosine_unpriced_drafting_throughput", "cosine", "cosine_unpriced_drafting", "tokens_per_s", "high"),
    ("cosine_vs_cosine_unpriced_drafting_latency", "cosine", "cosine_unpriced_drafting", "latency_mean_s", "low"),
    ("cosine_vs_cosine_fixed_pipeline_throughput", "cosine", "cosine_fixed_pipeline", "tokens_per_s", "high"),
    ("cosine_vs_cosine_fixed_pipeline_latency", "cosine", "cosine_fixed_pipeline", "latency_mean_s", "low"),
    ("cosine_vs_cosine_no_lookup_throughput_c1", "cosine", "cosine_no_lookup", "tokens_per_s", "c1"),
    ("cosine_vs_cosine_no_lookup_throughput", "cosine", "cosine_no_lookup", "tokens_per_s", "high"),
    ("cosine_vs_cosine_no_lookup_latency", "cosine", "cosine_no_lookup", "latency_mean_s", "low"),
    ("cosine_vs_cosine_no_draft_ahead_throughput_c16", "cosine", "cosine_no_draft_ahead", "tokens_per_s", "c16"),
    ("cosine_vs_cosine_no_draft_ahead_throughput", "cosine", "cosine_no_draft_ahead", "tokens_per_s", "high"),
    ("cosine_vs_cosine_no_guard_throughput_c1", "cosine", "cosine_no_guard", "tokens_per_s", "c1"),
    ("cosine_vs_cosine_no_guard_throughput_c16", "cosine", "cosine_no_guard", "tokens_per_s", "c16"),
    ("cosine_vs_cosine_no_guard_throughput", "cosine", "cosine_no_guard", "tokens_per_s", "high"),
    ("cosine_vs_cosine_no_chunks_latency", "cosine", "cosine_no_chunks", "latency_mean_s", "low"),
    ("cosine_vs_cosine_no_chunks_throughput", "cosine", "cosine_no_chunks", "tokens_per_s", "high"),
    ("cosine_vs_cosine_chunks_latency", "cosine", "cosine_chunks", "latency_mean_s", "low"),
    ("cosine_vs_cosine_chunks_throughput", "cosine", "cosine_chunks", "tokens_per_s", "high"),
)
# systems every other one is compared against in ratios.by_workload
BASELINES = ("vanilla_sd", "autoregressive", "hf_assisted", "hf_generate", "specinfer_tree")


def read_at(system: str, roles: Mapping[str, str]) -> set[str] | None:
    """The workloads where an ablation of cosine (a ``cosine_*`` system) is read: those of its
    headline ratios against cosine. None for any other system, or an ablation with no headline
    ratio: every workload is read."""
    if not system.startswith("cosine_"):
        return None
    names = {roles.get(role, "") for _, a, b, _, role in HEADLINE if a == "cosine" and b == system}
    names.discard("")
    return names or None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of ``values``; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def metrics(result: RunResult, workload: Workload, one_at_a_time: bool = False) -> dict[str, Any]:
    recs = result.records
    ok = [r for r in recs if not r.error]
    tokens = sum(len(r.token_ids) for r in ok)
    wall = result.wall_s
    lat = [r.latency_s for r in ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [
        (r.latency_s - r.ttft_s) / (len(r.token_ids) - 1) for r in ok if r.ttft_s is not None and len(r.token_ids) > 1
    ]
    c = result.counters
    batches = c.get("verify_batches", 0.0)
    req_rounds = sum(r.rounds for r in ok)  # (request, verify pass) pairs
    busy = c.get("verifier_busy_s", 0.0)
    committed = c.get("tokens_committed", 0.0) or tokens
    # time split of the rounds (decode steps, generate calls): model time of the drafters, of the
    # verifier, and everything else (network, serialisation, scheduling, fusion, Python)
    round_s = c.get("round_s", 0.0)
    draft_s = c.get("drafter_busy_s", 0.0)
    other_s = max(0.0, round_s - draft_s - busy)
    total = draft_s + busy + other_s
    split = {
        "draft_s": draft_s,
        "verify_s": busy,
        "other_s": other_s,
        "draft_frac": _div(draft_s, total),
        "verify_frac": _div(busy, total),
        "other_frac": _div(other_s, total),
    }
    # acceptance per drafter and (true) domain: draft tokens credited to the drafter per round of
    # the requests it served
    acc_num: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    acc_den: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    served: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    per_domain: dict[str, int] = defaultdict(int)
    for r in ok:
        per_domain[r.domain] += 1
        for d in r.drafters_used:
            served[d][r.domain] += 1
            acc_num[d][r.domain] += r.accepted_by_drafter.get(d, 0)
            acc_den[d][r.domain] += r.rounds
    acceptance = {d: {dom: acc_num[d][dom] / n for dom, n in row.items() if n} for d, row in acc_den.items()}
    usage = {d: {dom: n / per_domain[dom] for dom, n in row.items()} for d, row in served.items()}
    tps = tokens / wall if wall > 0 else None
    bound = committed / busy if busy > 0 else None
    sustained = sustained_tokens_per_s(ok, workload) if not one_at_a_time else None
    return {
        "requests": len(recs),
        "failed": len(recs) - len(ok),
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tps,
        "sustained_tokens_per_s": sustained,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "offered_rps": workload.offered_rps or None,
        "latency_mean_s": _mean(lat),
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_mean_s": _mean(tpot),
        "mean_accepted_len": _div(sum(r.accepted_tokens for r in ok), req_rounds),
        "tokens_per_round": _div(tokens, req_rounds),
        "verify_batches": batches,
        "mean_batch_requests": _div(req_rounds, batches),
        "verifier_busy_frac": _div(busy, wall),
        "time_split": split,
        "bound_tokens_per_s": bound,
        "frac_of_bound": _div(tps, bound),
        "acceptance": acceptance,
        "usage": usage,
        "latencies_s": sorted(lat),
        "effective_concurrency": 1
        if one_at_a_time
        else (workload.spec.concurrency if workload.spec.kind == "closed" else None),
        "counters": dict(c),
        "errors": sorted({r.error for r in recs if r.error})[:5],
    }


def sustained_tokens_per_s(records: Sequence[Any], workload: Workload) -> float | None:
    """Closed loop of several clients: output tokens per second while every client had a request in
    flight, i.e. until the last request was issued (the clients share one queue, so none idles before
    it is empty). What follows, the drain, is the workload's end rather than the system's pace: the
    last requests finish alone in thin passes, and speculation, finishing requests at different rounds,
    spreads that drain out. Tokens inside the window are counted per request as if emitted evenly
    from its first token to its last (a speculative system emits them in bursts of a round). None for
    open loops, one client, or when every request was issued at once."""
    if workload.spec.kind != "closed" or workload.spec.concurrency <= 1 or not records:
        return None
    end = max(r.issued_s for r in records)
    if end <= 0:
        return None
    emitted = 0.0
    for r in records:
        n = len(r.token_ids)
        if not n or r.first_token_s is None or r.first_token_s > end:
            continue
        if r.finished_s <= end or n == 1:
            emitted += n
        else:
            emitted += 1 + (n - 1) * (end - r.first_token_s) / max(r.finished_s - r.first_token_s, 1e-9)
    return emitted / end


def compute_ratios(systems: Mapping[str, Mapping[str, Mapping[str, Any]]], roles: Mapping[str, str]) -> dict[str, Any]:
    """Ratios between systems measured in this run. ``roles``: "high"/"low" -> workload name.
    A throughput ratio is a/b of tokens/s (> 1: a is faster); a latency ratio is a/b of mean
    latency (< 1: a is quicker). None when a side is missing."""

    def get(system: str, workload: str, metric: str) -> float | None:
        return systems.get(system, {}).get(workload, {}).get(metric)

    out: dict[str, Any] = {}
    for key, a, b, metric, role in HEADLINE:
        w = roles.get(role, "")
        out[key] = _div(get(a, w, metric), get(b, w, metric))
    out["workloads"] = dict(roles)
    by_workload: dict[str, dict[str, float | None]] = {}
    workloads = sorted({w for per in systems.values() for w in per})
    for w in workloads:
        row: dict[str, float | None] = {}
        for base in BASELINES:
            if base not in systems or w not in systems[base]:
                continue
            for a in systems:
                if a == base or w not in systems[a]:
                    continue
                row[f"{a}_vs_{base}_throughput"] = _div(get(a, w, "tokens_per_s"), get(base, w, "tokens_per_s"))
                row[f"{a}_vs_{base}_latency"] = _div(get(a, w, "latency_mean_s"), get(base, w, "latency_mean_s"))
                sustained = _div(get(a, w, "sustained_tokens_per_s"), get(base, w, "sustained_tokens_per_s"))
                if sustained is not None:
                    row[f"{a}_vs_{base}_sustained"] = sustained
        by_workload[w] = row
    out["by_workload"] = by_workload
    return out


def machine_info(threads: int) -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        pass
    return {
        "platform": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": mem,
        "torch_threads": threads,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def validate_report(report: Mapping[str, Any]) -> list[str]:
    """Problems with a report's shape (empty when it follows the schema)."""
    problems = []
    for key in ("schema", "machine", "scenario", "systems", "ratios"):
        if key not in report:
            problems.append(f"missing top-level key {key!r}")
    if report.get("schema") != SCHEMA:
        problems.append(f"schema is {report.get('schema')!r}, expected {SCHEMA!r}")
    for system, per in (report.get("systems") or {}).items():
        for workload, m in per.items():
            for key in (
                "tokens_per_s",
                "latency_mean_s",
                "latency_p99_s",
                "mean_accepted_len",
                "verifier_busy_frac",
                "ttft_mean_s",
                "tpot_mean_s",
                "time_split",
                "bound_tokens_per_s",
                "frac_of_bound",
                "acceptance",
            ):
                if key not in m:
                    problems.append(f"systems.{system}.{workload}: missing {key!r}")
    ratios = report.get("ratios") or {}
    for key, *_ in HEADLINE[:4]:
        if key not in ratios:
            problems.append(f"ratios: missing {key!r}")
    return problems
