"""Print a `cosine bench` report as the Markdown tables the README and docs/benchmarks.md show.

    python -m benchmarks.summary bench-out/report.json

Every figure comes from the report (one run); nothing is carried over from another run.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

# ratio key, what it says, the goal it is held against ("" when none)
GOALS = (
    ("cosine_vs_autoregressive_throughput_c1", "cosine / autoregressive, tokens/s, 1 client", ">= 2.0"),
    ("cosine_vs_autoregressive_throughput", "cosine / autoregressive, tokens/s, high load", ">= 1.3"),
    ("cosine_vs_vanilla_sd_throughput", "cosine / vanilla_sd, tokens/s, high load", ">= 1.3"),
    ("cosine_vs_vanilla_sd_latency", "cosine / vanilla_sd, mean latency, low load", "<= 0.75"),
    ("cosine_vs_hf_assisted_throughput_c1", "cosine / hf_assisted, tokens/s, 1 client", ">= 1.5"),
    ("cosine_vs_cosine_no_control_throughput", "cosine / cosine without cost control, tokens/s, high load", ""),
    ("cosine_vs_cosine_token_fusion_throughput", "cosine / cosine with token fusion, tokens/s, high load", ""),
    ("cosine_vs_cosine_step_fusion_throughput_c1", "cosine / cosine fusing tokens step by step from the router, tokens/s, 1 client", ""),
    ("cosine_vs_cosine_step_fusion_throughput", "cosine / cosine fusing tokens step by step from the router, tokens/s, high load", ""),
    ("cosine_vs_cosine_unpriced_drafting_throughput_c1", "cosine / cosine without draft pricing, tokens/s, 1 client", ""),
    ("cosine_vs_cosine_unpriced_drafting_throughput", "cosine / cosine without draft pricing, tokens/s, high load", ""),
    ("cosine_vs_cosine_fixed_pipeline_throughput", "cosine / cosine with a fixed pipeline, tokens/s, high load", ""),
    ("cosine_vs_cosine_no_lookup_throughput_c1", "cosine / cosine without the lookup drafter, tokens/s, 1 client", ""),
    ("cosine_vs_cosine_no_lookup_throughput", "cosine / cosine without the lookup drafter, tokens/s, high load", ""),
    ("cosine_vs_cosine_no_corpus_throughput_c1", "cosine / cosine without the lookup corpus, tokens/s, 1 client", ""),
    ("cosine_vs_cosine_no_corpus_throughput", "cosine / cosine without the lookup corpus, tokens/s, high load", ""),
    ("cosine_vs_cosine_no_draft_ahead_throughput_c16", "cosine / cosine waiting for its drafters, tokens/s, 16 clients", ""),
    ("cosine_vs_cosine_no_draft_ahead_throughput", "cosine / cosine waiting for its drafters, tokens/s, high load", ""),
)


def _f(x: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def systems_table(report: Mapping[str, Any]) -> str:
    roles = report["ratios"]["workloads"]
    hi, lo, c1 = roles.get("high", ""), roles.get("low", ""), roles.get("c1", "")
    rows = ["| system | c=1 tok/s | c=4 tok/s | c=16 tok/s | low load: latency mean (s) | high load: tok/s | "
            "high load: latency mean (s) | accepted/round (high) | verifier busy (high) | "
            "split draft/verify/other (high) | bound tok/s (high) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in report["scenario"]["order"]:
        per = report["systems"].get(name, {})

        def m(w: str, key: str, fmt: str = "{:.0f}") -> str:
            return _f(per.get(w, {}).get(key), fmt)

        split = per.get(hi, {}).get("time_split") or {}
        parts = [split.get(k) for k in ("draft_frac", "verify_frac", "other_frac")]
        split_s = " / ".join(_f(p * 100 if p is not None else None) + "%" for p in parts) if split else "-"
        rows.append(f"| {name} | {m(c1, 'tokens_per_s', '{:.1f}')} | {m('closed_c4', 'tokens_per_s', '{:.1f}')} | "
                    f"{m('closed_c16', 'tokens_per_s', '{:.1f}')} | {m(lo, 'latency_mean_s', '{:.2f}')} | "
                    f"{m(hi, 'tokens_per_s', '{:.1f}')} | {m(hi, 'latency_mean_s', '{:.2f}')} | "
                    f"{m(hi, 'mean_accepted_len', '{:.2f}')} | "
                    f"{_pct(per.get(hi, {}).get('verifier_busy_frac'))} | {split_s} | "
                    f"{m(hi, 'bound_tokens_per_s', '{:.1f}')} |")
    return "\n".join(rows)


def sustained_table(report: Mapping[str, Any], a: str = "cosine", bases: tuple[str, ...] = ("autoregressive", "vanilla_sd")) -> str:
    """Closed loops of several clients: ``a`` against each base, tokens/s over the whole workload and
    while every client was busy (without the drain at the workload's end); empty without such figures."""
    per_workload = report["ratios"].get("by_workload", {})
    rows = []
    for w, r in sorted(per_workload.items(), key=lambda kv: report["scenario"]["workloads"].get(kv[0], {}).get("concurrency") or 0):
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
    worst = [(w, r.get("cosine_vs_autoregressive_throughput")) for w, r in per_workload.items()
             if r.get("cosine_vs_autoregressive_throughput") is not None]
    if worst:
        w, v = min(worst, key=lambda x: x[1])
        rows.append(f"| cosine / autoregressive, tokens/s, worst workload ({w}) | {v:.2f} | >= 1.0 |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.summary REPORT.json", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        report = json.load(f)
    check = report["scenario"]["greedy_check"]
    print(f"scenario {report['scenario']['name']}, zoo {report['scenario']['zoo']['profile']}, "
          f"{report['scenario']['wall_s']:.0f} s, greedy outputs checked: {check['checked_requests']}, "
          f"mismatches: {len(check['mismatches'])}\n")
    print(systems_table(report) + "\n")
    print(goals_table(report))
    sustained = sustained_table(report)
    if sustained:
        print("\n" + sustained)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
