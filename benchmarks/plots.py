"""PNG plots of a benchmark report (matplotlib, no display needed).

- ``throughput.png``: tokens/s against closed-loop concurrency and against offered open-loop load.
- ``latency_cdf.png``: end-to-end latency CDFs at low and at high load.
- ``acceptance.png``: accepted draft tokens per round, drafter x domain (the zoo's offline figures
  and what the speculative systems measured).
- ``time_split.png``: where the round time goes (drafter model, verifier model, everything else),
  and the cost of an output token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PLOTS = ("throughput.png", "latency_cdf.png", "acceptance.png", "time_split.png")

STYLE = {
    "autoregressive": ("#555555", "s", "-"),
    "hf_generate": ("#999999", "v", ":"),
    "hf_assisted": ("#8c564b", "^", ":"),
    "vanilla_sd": ("#1f77b4", "o", "-"),
    "specinfer_tree": ("#9467bd", "D", "-"),
    "cosine": ("#d62728", "*", "-"),
    "cosine_no_routing": ("#ff7f0e", "P", "--"),
    "cosine_token_fusion": ("#2ca02c", "X", "--"),
    "cosine_no_pipeline": ("#e377c2", "h", "--"),
    "cosine_drafter_domains": ("#bcbd22", "p", "--"),
    "cosine_no_control": ("#17becf", "d", "--"),
    "cosine_no_lookup": ("#7f7f7f", "<", "--"),
    "cosine_unpriced_drafting": ("#aec7e8", ">", "--"),
    "cosine_fixed_pipeline": ("#ff9896", "H", "--"),
    "cosine_no_draft_ahead": ("#c5b0d5", "8", "--"),
    "cosine_unshared_lexicon": ("#98df8a", "1", "--"),
    "cosine_global_gate": ("#f7b6d2", "2", "--"),
    "cosine_step_fusion": ("#dbdb8d", "3", "--"),
    "cosine_no_corpus": ("#9edae5", "4", "--"),
    "services_plain": ("#c49c94", "x", ":"),
    "cosine_no_guard": ("#ffbb78", "+", "--"),
    "cosine_no_chunks": ("#393b79", "|", "--"),
    "cosine_chunks": ("#637939", "_", "--"),
}


def _style(name: str) -> tuple[str, str, str]:
    return STYLE.get(name, ("#000000", "o", ":"))


def write_plots(report: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        _throughput(report, out / "throughput.png"),
        _latency_cdf(report, out / "latency_cdf.png"),
        _acceptance(report, out / "acceptance.png"),
        _time_split(report, out / "time_split.png"),
    ]
    return paths


def _workloads(report: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return report["scenario"]["workloads"]


def _subtitle(report: Mapping[str, Any]) -> str:
    sc = report["scenario"]
    m = report["machine"]
    zoo = sc.get("zoo", {})
    return (
        f"zoo {zoo.get('profile', '?')}, target {zoo.get('target_params', 0) / 1e6:.1f}M params, "
        f"{sc.get('max_new_tokens')} new tokens/request, {m.get('cores')} cores, threads {m.get('torch_threads')}"
    )


def _throughput(report: Mapping[str, Any], path: Path) -> Path:
    import matplotlib.pyplot as plt

    systems = report["systems"]
    wl = _workloads(report)
    closed = sorted(
        (w for w, s in wl.items() if s["kind"] == "closed" and not s.get("temperature")),
        key=lambda w: wl[w]["concurrency"],
    )
    opened = [w for w, s in wl.items() if s["kind"] == "open" and not s.get("temperature")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    for name, per in systems.items():
        color, marker, ls = _style(name)
        xs = [wl[w]["concurrency"] for w in closed if w in per and per[w].get("tokens_per_s")]
        ys = [per[w]["tokens_per_s"] for w in closed if w in per and per[w].get("tokens_per_s")]
        if xs:
            ax1.plot(xs, ys, color=color, marker=marker, linestyle=ls, label=name, markersize=8)
        pts = []
        for w in opened:
            m = per.get(w)
            if m and m.get("tokens_per_s") and m.get("offered_rps"):
                per_req = m["output_tokens"] / max(1, m["requests"] - m["failed"])
                pts.append((m["offered_rps"] * per_req, m["tokens_per_s"], w))
        pts.sort()
        if pts:
            ax2.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                color=color,
                marker=marker,
                linestyle=ls,
                label=name,
                markersize=8,
            )
    ax1.set_xscale("log", base=2)
    ax1.set_xticks([wl[w]["concurrency"] for w in closed], [str(wl[w]["concurrency"]) for w in closed])
    ax1.set_xlabel("closed-loop concurrency (clients)")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("closed loop: throughput vs concurrency\n(hf_* serve one request at a time)")
    ax1.grid(alpha=0.3)
    lim = ax2.get_xlim()
    hi = max(lim[1], ax2.get_ylim()[1])
    ax2.plot([0, hi], [0, hi], color="#bbbbbb", linestyle=":", linewidth=1, label="throughput = offered")
    ax2.set_xlim(0, lim[1] * 1.05)
    ax2.set_ylim(0, None)
    for w in opened:
        # label each offered load once, at the x of the first system that ran it
        for per in systems.values():
            m = per.get(w)
            if m and m.get("offered_rps"):
                x = m["offered_rps"] * m["output_tokens"] / max(1, m["requests"] - m["failed"])
                ax2.annotate(
                    w.replace("open_", ""),
                    (x, 0),
                    textcoords="offset points",
                    xytext=(0, 4),
                    ha="center",
                    fontsize=8,
                    color="#666666",
                )
                break
    ax2.set_xlabel("offered load (output tokens/s; Poisson arrivals)")
    ax2.set_ylabel("achieved output tokens/s")
    ax2.set_title("open loop: throughput vs offered load")
    ax2.grid(alpha=0.3)
    handles, labels = ax1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)) or 1, fontsize=9, frameon=False)
    fig.suptitle(f"Throughput  ({_subtitle(report)})", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _latency_cdf(report: Mapping[str, Any], path: Path) -> Path:
    import matplotlib.pyplot as plt

    systems = report["systems"]
    roles = report["ratios"].get("workloads", {})
    panels = [w for w in (roles.get("low"), roles.get("high")) if w]
    if not panels:
        panels = list(_workloads(report))[:2]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6.5 * max(1, len(panels)), 6.2), squeeze=False)
    for ax, w in zip(axes[0], panels):
        for name, per in systems.items():
            lat = (per.get(w) or {}).get("latencies_s") or []
            if not lat:
                continue
            color, _, ls = _style(name)
            ys = [(i + 1) / len(lat) for i in range(len(lat))]
            mean = sum(lat) / len(lat)
            ax.step(
                lat,
                ys,
                where="post",
                color=color,
                linestyle=ls,
                label=f"{name} (mean {mean:.2f}s)",
                linewidth=2 if name == "cosine" else 1.3,
            )
        ax.set_xscale("log")
        ax.set_xlabel("end-to-end latency (s, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{w}: latency CDF")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    fig.suptitle(f"Latency  ({_subtitle(report)})", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _merged_acceptance(per: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Acceptance (accepted tokens per round) per drafter x domain over a system's greedy workloads,
    weighted by the rounds behind each figure (usage-weighted mean)."""
    num: dict[str, dict[str, float]] = {}
    den: dict[str, dict[str, float]] = {}
    for m in per.values():
        usage = m.get("usage") or {}
        for d, row in (m.get("acceptance") or {}).items():
            for dom, v in row.items():
                w = usage.get(d, {}).get(dom, 1.0)
                num.setdefault(d, {}).setdefault(dom, 0.0)
                den.setdefault(d, {}).setdefault(dom, 0.0)
                num[d][dom] += v * w
                den[d][dom] += w
    return {d: {dom: num[d][dom] / den[d][dom] for dom in row if den[d][dom]} for d, row in num.items()}


def _acceptance(report: Mapping[str, Any], path: Path) -> Path:
    import matplotlib.pyplot as plt
    import numpy as np

    zoo = report["scenario"].get("zoo", {})
    domains = list(zoo.get("domains") or [])
    drafters = list(zoo.get("drafters") or [])
    wl = _workloads(report)
    panels: list[tuple[str, dict[str, dict[str, float]]]] = []
    if zoo.get("acceptance"):
        panels.append(("zoo (offline, k=%s)" % zoo.get("k", "?"), zoo["acceptance"]))
    for name in ("cosine", "specinfer_tree", "cosine_no_routing", "vanilla_sd", "hf_assisted"):
        per = report["systems"].get(name)
        if per:
            greedy = {w: m for w, m in per.items() if not wl.get(w, {}).get("temperature")}
            panels.append((name, _merged_acceptance(greedy)))
    for _, mat in panels:
        for d, row in mat.items():
            if d not in drafters:
                drafters.append(d)
            for dom in row:
                if dom not in domains:
                    domains.append(dom)
    n = max(1, len(panels))
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.8 * cols, 4.4 * rows), squeeze=False, gridspec_kw={"hspace": 0.45, "wspace": 0.35}
    )
    vmax = max([v for _, mat in panels for row in mat.values() for v in row.values()] + [1.0])
    im = None
    for i, (title, mat) in enumerate(panels):
        ax = axes[i // cols][i % cols]
        grid = np.full((len(drafters), len(domains)), np.nan)
        for r, d in enumerate(drafters):
            for c, dom in enumerate(domains):
                v = mat.get(d, {}).get(dom)
                if v is not None:
                    grid[r, c] = v
        cmap = plt.get_cmap("viridis").with_extremes(bad="#eeeeee")
        im = ax.imshow(grid, cmap=cmap, vmin=0, vmax=vmax, aspect="auto")
        for r in range(len(drafters)):
            for c in range(len(domains)):
                v = grid[r, c]
                ax.text(
                    c,
                    r,
                    "-" if np.isnan(v) else f"{v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="#888888" if np.isnan(v) else ("white" if v < vmax * 0.6 else "black"),
                )
        ax.set_xticks(range(len(domains)), domains, rotation=30, fontsize=8)
        ax.set_yticks(range(len(drafters)), drafters, fontsize=8)
        ax.set_title(title, fontsize=10)
    for j in range(len(panels), rows * cols):
        axes[j // cols][j % cols].axis("off")
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="accepted draft tokens per round")
    fig.suptitle(
        "Acceptance: draft tokens credited per round, drafter x domain\n(measured over the greedy workloads; "
        "'-' = the drafter never served that domain; agreeing drafters share the credit)",
        fontsize=10,
    )
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _time_split(report: Mapping[str, Any], path: Path) -> Path:
    import matplotlib.pyplot as plt

    roles = report["ratios"].get("workloads", {})
    w = roles.get("high") or next(iter(_workloads(report)))
    names = [n for n, per in report["systems"].items() if w in per]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.55 * len(names) + 2.4))
    parts = (
        ("draft_frac", "drafter model", "#1f77b4"),
        ("verify_frac", "verifier model", "#d62728"),
        ("other_frac", "network + orchestration", "#bbbbbb"),
    )
    ys = list(range(len(names)))[::-1]
    for y, name in zip(ys, names):
        split = report["systems"][name][w]["time_split"]
        left = 0.0
        for key, label, color in parts:
            v = split.get(key) or 0.0
            ax1.barh(y, v, left=left, color=color, label=label if y == ys[0] else None)
            if v > 0.07:
                ax1.text(left + v / 2, y, f"{v:.0%}", ha="center", va="center", fontsize=8)
            left += v
    ax1.set_yticks(ys, names)
    ax1.set_xlim(0, 1)
    ax1.set_xlabel("share of round time (summed over rounds / decode steps / generate calls)")
    ax1.set_title(f"{w}: where the round time goes")
    ax1.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.08), ncol=3, frameon=False)
    for y, name in zip(ys, names):
        m = report["systems"][name][w]
        tps, bound = m.get("tokens_per_s") or 0.0, m.get("bound_tokens_per_s") or 0.0
        ax2.barh(
            y + 0.18, bound, height=0.34, color="#f2b8b8", label="bound: verifier never idle" if y == ys[0] else None
        )
        ax2.barh(
            y - 0.18,
            tps,
            height=0.34,
            color="#d62728" if name == "cosine" else "#555555",
            label="measured" if y == ys[0] else None,
        )
        if bound:
            ax2.text(tps, y - 0.18, f" {tps:.0f} ({tps / bound:.0%})", va="center", fontsize=8)
    ax2.set_yticks(ys, names)
    ax2.set_xlabel("output tokens/s")
    ax2.set_title(f"{w}: measured vs bound (tokens / verifier busy s)")
    ax2.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Time split  ({_subtitle(report)})", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    """Re-render the plots of a report: ``python -m benchmarks.plots REPORT.json [OUT_DIR]``."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit("usage: python -m benchmarks.plots REPORT.json [OUT_DIR]")
    report = json.loads(Path(args[0]).read_text())
    for p in write_plots(report, args[1] if len(args) > 1 else Path(args[0]).parent):
        print(p)


if __name__ == "__main__":
    main()
