"""Print a `cosine bench` report as the Markdown tables docs/benchmarks.md shows.

    python -m benchmarks.summary bench-out/report.json

The systems table, the goals and the closed loops' sustained ratios, then the per-workload table
(docs/benchmarks.md's *Results*), what the yield guard did, and the cores each part of the
serving path kept busy at 16 clients and high load.

Every figure comes from the report (one run); nothing is carried over from another run.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from benchmarks.cpu_split import PARTS, cores_used
from benchmarks.report import _div

# ratio key, what it says, the goal it is held against ("" when none)
GOALS = (
    ("cosine_vs_autoregressive_throughput_c1", "cosine / autoregressive, tokens/s, 1 client", ">= 2.0"),
    ("cosine_vs_autoregressive_throughput", "cosine / autoregressive, tokens/s, high load", ">= 1.3"),
    ("cosine_vs_vanilla_sd_throughput", "cosine / vanilla_sd, tokens/s, high load", ">= 1.3"),
    ("cosine_vs_vanilla_sd_latency", "cosine / vanilla_sd, mean latency, low load", "<= 0.75"),
    ("cosine_vs_hf_assisted_throughput_c1", "cosine / hf_assisted, tokens/s, 1 client", ">= 1.5"),
    ("cosine_vs_cosine_no_control_throughput", "cosine / cosine without cost control, tokens/s, high load", ""),
    ("cosine_vs_cosine_token_fusion_throughput", "cosine / cosine with token fusion, tokens/s, high load", ""),
    (
        "cosine_vs_cosine_step_fusion_throughput_c1",
        "cosine / cosine fusing tokens step by step from the router, tokens/s, 1 client",
        "",
    ),
    (
        "cosine_vs_cosine_step_fusion_throughput",
        "cosine / cosine fusing tokens step by step from the router, tokens/s, high load",
        "",
    ),
    (
        "cosine_vs_cosine_unpriced_drafting_throughput_c1",
        "cosine / cosine without draft pricing, tokens/s, 1 client",
        "",
    ),
    ("cosine_vs_cosine_unpriced_drafting_throughput", "cosine / cosine without draft pricing, tokens/s, high load", ""),
    ("cosine_vs_cosine_fixed_pipeline_throughput", "cosine / cosine with a fixed pipeline, tokens/s, high load", ""),
    ("cosine_vs_cosine_no_lookup_throughput_c1", "cosine / cosine without the lookup drafter, tokens/s, 1 client", ""),
    ("cosine_vs_cosine_no_lookup_throughput", "cosine / cosine without the lookup drafter, tokens/s, high load", ""),
    ("cosine_vs_cosine_no_corpus_throughput_c1", "cosine / cosine without the lookup corpus, tokens/s, 1 client", ""),
    ("cosine_vs_cosine_no_corpus_throughput", "cosine / cosine without the lookup corpus, tokens/s, high load", ""),
    (
        "cosine_vs_cosine_no_draft_ahead_throughput_c16",
        "cosine / cosine waiting for its drafters, tokens/s, 16 clients",
        "",
    ),
    ("cosine_vs_cosine_no_draft_ahead_throughput", "cosine / cosine waiting for its drafters, tokens/s, high load", ""),
    ("cosine_vs_cosine_no_guard_throughput_c1", "cosine / cosine without the yield guard, tokens/s, 1 client", ""),
    ("cosine_vs_cosine_no_guard_throughput_c16", "cosine / cosine without the yield guard, tokens/s, 16 clients", ""),
    ("cosine_vs_cosine_no_guard_throughput", "cosine / cosine without the yield guard, tokens/s, high load", ""),
    ("cosine_vs_cosine_no_chunks_latency", "cosine / cosine verifying drafts whole, mean latency, low load", ""),
    ("cosine_vs_cosine_no_chunks_throughput", "cosine / cosine verifying drafts whole, tokens/s, high load", ""),
    ("cosine_vs_cosine_chunks_latency", "cosine / cosine verifying drafts by chunks, mean latency, low load", ""),
    ("cosine_vs_cosine_chunks_throughput", "cosine / cosine verifying drafts by chunks, tokens/s, high load", ""),
)


def _f(x: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def systems_table(report: Mapping[str, Any]) -> str:
    roles = report["ratios"]["workloads"]
    hi, lo, c1 = roles.get("high", ""), roles.get("low", ""), roles.get("c1", "")
    rows = [
        "| system | c=1 tok/s | c=4 tok/s | c=16 tok/s | low load: latency mean (s) | high load: tok/s | "
        "high load: latency mean (s) | accepted/round (high) | verifier busy (high) | "
        "split draft/verify/other (high) | bound tok/s (high) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in report["scenario"]["order"]:
        per = report["systems"].get(name, {})

        def m(w: str, key: str, fmt: str = "{:.0f}") -> str:
            return _f(per.get(w, {}).get(key), fmt)

        split = per.get(hi, {}).get("time_split") or {}
        parts = [split.get(k) for k in ("draft_frac", "verify_frac", "other_frac")]
        split_s = " / ".join(_f(p * 100 if p is not None else None) + "%" for p in parts) if split else "-"
        rows.append(
            f"| {name} | {m(c1, 'tokens_per_s', '{:.1f}')} | {m('closed_c4', 'tokens_per_s', '{:.1f}')} | "
            f"{m('closed_c16', 'tokens_per_s', '{:.1f}')} | {m(lo, 'latency_mean_s', '{:.2f}')} | "
            f"{m(hi, 'tokens_per_s', '{:.1f}')} | {m(hi, 'latency_mean_s', '{:.2f}')} | "
            f"{m(hi, 'mean_accepted_len', '{:.2f}')} | "
            f"{_pct(per.get(hi, {}).get('verifier_busy_frac'))} | {split_s} | "
            f"{m(hi, 'bound_tokens_per_s', '{:.1f}')} |"
        )
    return "\n".join(rows)


def sustained_table(
    report: Mapping[str, Any], a: str = "cosine", bases: tuple[str, ...] = ("autoregressive", "vanilla_sd")
) -> str:
    """Closed loops of several clients: ``a`` against each base, tokens/s over the whole workload and
    while every client was busy (without the drain at the workload's end); empty without such figures."""
    per_workload = report["ratios"].get("by_workload", {})
    rows = []
    for w, r in sorted(
        per_workload.items(), key=lambda kv: report["scenario"]["workloads"].get(kv[0], {}).get("concurrency") or 0
    ):
        cells = [(r.get(f"{a}_vs_{b}_throughput"), r.get(f"{a}_vs_{b}_sustained")) for b in bases]
        if all(s is None for _, s in cells):
            continue
        rows.append(f"| {w} | " + " | ".join(f"{_f(t, '{:.2f}')} | {_f(s, '{:.2f}')}" for t, s in cells) + " |")
    if not rows:
        return ""
    head = "| workload | " + " | ".join(f"{a} / {b}: whole run | while all clients busy" for b in bases) + " |"
    return "\n".join([head, "|---|" + "---|---|" * len(bases), *rows])


def goals_table(report: Mapping[str, Any]) -> str:
    ratios = report["ratios"]
    rows = ["| figure | measured | goal |", "|---|---|---|"]
    for key, label, goal in GOALS:
        if not goal and ratios.get(key) is None:  # an ablation this run did not include
            continue
        rows.append(f"| {label} | {_f(ratios.get(key), '{:.2f}')} | {goal or '-'} |")
    per_workload = ratios.get("by_workload", {})
    worst = [
        (w, r.get("cosine_vs_autoregressive_throughput"))
        for w, r in per_workload.items()
        if r.get("cosine_vs_autoregressive_throughput") is not None
    ]
    if worst:
        w, v = min(worst, key=lambda x: x[1])
        rows.append(f"| cosine / autoregressive, tokens/s, worst workload ({w}) | {v:.2f} | >= 1.0 |")
    return "\n".join(rows)


WORKLOAD_LABELS = {
    "closed_c1": "1 client",
    "closed_c4": "4 clients",
    "closed_c16": "16 clients",
    "closed_c4_sampling": "4 clients, sampling",
    "open_low": "low load",
    "open_fluct": "fluctuating load",
    "open_high": "high load",
}


def workload_table(report: Mapping[str, Any]) -> str:
    """cosine against its baselines and ablations, workload by workload (a dash where a system did not
    run it): tokens/s and latency ratios, how busy its verifier was, what a round accepted, how many
    requests shared a pass and what a pass took (verifier busy seconds per pass)."""
    systems = report["systems"]
    cos = systems.get("cosine", {})

    def metric(system: str, w: str, key: str) -> float | None:
        return systems.get(system, {}).get(w, {}).get(key)

    def ratio(a: str, b: str, w: str, key: str = "tokens_per_s") -> str:
        return _f(_div(metric(a, w, key), metric(b, w, key)), "{:.2f}")

    def pass_ms(system: str, w: str) -> float | None:
        m = systems.get(system, {}).get(w)
        if not m or not m.get("verify_batches"):
            return None
        busy = (m.get("counters") or {}).get("verifier_busy_s")
        if busy is None and m.get("verifier_busy_frac") is not None:  # in process: the wall time it was busy
            busy = m["wall_s"] * m["verifier_busy_frac"]
        return None if busy is None else busy / m["verify_batches"] * 1e3

    head = (
        "| workload | cosine / autoregressive, tok/s | same, while all clients busy | cosine / autoregressive, "
        "latency | "
        "services_plain / autoregressive, tok/s | cosine / services_plain, tok/s | cosine / vanilla_sd, tok/s | "
        "cosine / cosine_token_fusion, tok/s | cosine / cosine_no_draft_ahead, tok/s | cosine / cosine_no_corpus, "
        "tok/s | "
        "busy, cosine | accepted/round, cosine | requests a pass, cosine / services_plain / autoregressive | "
        "verify ms a pass, cosine / autoregressive |"
    )
    rows = [head, "|" + "---|" * 14]
    ran = report["scenario"]["workloads"]
    for w in [w for w in WORKLOAD_LABELS if w in ran] + [w for w in ran if w not in WORKLOAD_LABELS]:
        if w not in cos:
            continue
        batch = " / ".join(
            _f(metric(s, w, "mean_batch_requests"), "{:.1f}") for s in ("cosine", "services_plain", "autoregressive")
        )
        ms = " / ".join(_f(pass_ms(s, w)) for s in ("cosine", "autoregressive"))
        cells = [
            WORKLOAD_LABELS.get(w, w),
            ratio("cosine", "autoregressive", w),
            ratio("cosine", "autoregressive", w, "sustained_tokens_per_s"),
            ratio("cosine", "autoregressive", w, "latency_mean_s"),
            ratio("services_plain", "autoregressive", w),
            ratio("cosine", "services_plain", w),
            ratio("cosine", "vanilla_sd", w),
            ratio("cosine", "cosine_token_fusion", w),
            ratio("cosine", "cosine_no_draft_ahead", w),
            ratio("cosine", "cosine_no_corpus", w),
            _pct(cos[w].get("verifier_busy_frac")),
            _f(cos[w].get("mean_accepted_len"), "{:.2f}"),
            batch,
            ms,
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) if len(rows) > 2 else ""


def guard_table(report: Mapping[str, Any]) -> str:
    """The yield guard in cosine's run, workload by workload (``services/router/yield_guard.py``):
    the share of its rounds it ran plain (control groups and withdrawals), how often it withdrew
    and re-admitted speculation, and the committed tokens per verifier-busy second of cosine and of
    services_plain; empty for a report without the guard's counters."""
    systems = report["systems"]
    rows = []
    for w in report["scenario"]["workloads"]:
        c = (systems.get("cosine", {}).get(w) or {}).get("counters") or {}
        if "guard_plain_rounds" not in c:
            continue

        def per_busy(system: str) -> float | None:
            m = systems.get(system, {}).get(w) or {}
            return m.get("bound_tokens_per_s")

        cells = [
            WORKLOAD_LABELS.get(w, w),
            _pct(_div(c["guard_plain_rounds"], c.get("router_rounds"))),
            f"{c.get('guard_withdrawals', 0):.0f} / {c.get('guard_readmissions', 0):.0f}",
            f"{_f(per_busy('cosine'), '{:.0f}')} / {_f(per_busy('services_plain'), '{:.0f}')}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    if not rows:
        return ""
    head = (
        "| workload | cosine's rounds run plain by its yield guard | withdrawn / re-admitted | "
        "tokens per verifier-busy second, cosine / services_plain |"
    )
    return "\n".join(["the yield guard\n", head, "|---|---|---|---|", *rows])


def cores_table(report: Mapping[str, Any], workloads: tuple[str, ...] = ("closed_c16", "open_high")) -> str:
    """Cores each part of the serving path kept busy, per service system, at 16 clients and high
    load (:mod:`benchmarks.cpu_split`); empty for a report without those counters."""
    rows = []
    for w in [w for w in workloads if w in report["scenario"]["workloads"]]:
        for name in report["scenario"]["order"]:
            cores = cores_used(report["systems"].get(name, {}).get(w, {}))
            if cores is not None:
                rows.append(
                    f"| {name} | {WORKLOAD_LABELS.get(w, w)} | "
                    + " | ".join(f"{cores[p]:.2f}" for p in PARTS)
                    + f" | {sum(cores.values()):.2f} |"
                )
    if not rows:
        return ""
    head = "| system | workload | " + " | ".join(PARTS) + " | together |"
    return "\n".join(
        ["cores kept busy while serving (CPU seconds / wall seconds)\n", head, "|" + "---|" * (len(PARTS) + 3), *rows]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.summary",
        description="Print a `cosine bench` report (report.json) as Markdown tables: every system by workload, the "
        "goal ratios, the closed loops' sustained ratios, and cosine against its baselines per workload. "
        "Every figure comes from that one report.",
    )
    parser.add_argument("report", help="the report.json a `cosine bench` run wrote")
    args = parser.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    check = report["scenario"]["greedy_check"]
    print(
        f"scenario {report['scenario']['name']}, zoo {report['scenario']['zoo']['profile']}, "
        f"{report['scenario']['wall_s']:.0f} s, greedy outputs checked: {check['checked_requests']}, "
        f"mismatches: {len(check['mismatches'])}\n"
    )
    print(systems_table(report) + "\n")
    print(goals_table(report))
    for table in (sustained_table(report), workload_table(report), guard_table(report), cores_table(report)):
        if table:
            print("\n" + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
