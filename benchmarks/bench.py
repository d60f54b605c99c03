"""`cosine bench`: every system on the same workloads, one after the other, in one invocation.

    cosine bench --zoo .cosine/zoo-smol --out bench-out/report.json

Flow: load the zoo; decode every prompt of the run with the target alone (the *reference pass*:
our verifier engine, greedy, batched) - its outputs are what every greedy run must reproduce
token for token, and its throughput is the reference capacity that sets the open-loop rates;
then start every system (the service systems share one verifier and its drafters, each with a
router and gateway of its own) and run each workload on every system in turn before the next
workload, so that the figures a ratio compares are measured a few minutes apart at most, not up to
ten: this machine's speed drifts over minutes. The JSON report and the PNG plots are
written at the end (the report also after a failure, with what was measured).

A greedy output that differs from the reference by one token fails the benchmark
(:class:`GreedyMismatch`, exit status 3) after the report is written.

Which workloads a system skips, and why, is :mod:`benchmarks.scenarios`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.greedy_check import BenchError, GreedyMismatch, check_greedy, mismatch_text
from benchmarks.scenarios import SCENARIOS, skipped_workloads
from benchmarks.workloads import WorkloadSpec


@dataclass
class BenchOptions:
    zoo: str
    out: str = "bench-out/report.json"
    scenario: str = "default"
    systems: Sequence[str] = ()
    workloads: Sequence[str] = ()
    max_new_tokens: int | None = None
    requests: int | None = None  # overrides every workload's request count
    cores: int = 0
    threads: int = 0  # torch intra-op threads of the in-process systems (0: one per core)
    dtype: str = "auto"  # the target's, in every system (auto: bfloat16 on a CPU with AMX, else float32)
    device: str = "cpu"  # the verifier's and drafters' (and the target alone's) torch device
    plots: bool = True
    progress: bool = True
    log_dir: str = ""


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_bench(opts: BenchOptions, system_factory: Any = None) -> dict[str, Any]:
    """Run the benchmark and write the report (and plots). Returns the report.

    ``system_factory(names, zoo, eos_id, pad_id, cores, log_dir, threads) -> (systems, plane)`` replaces
    :func:`benchmarks.systems.make_systems` (tests inject fake systems through it)."""
    import torch

    from benchmarks.report import SCHEMA, compute_ratios, machine_info, metrics
    from benchmarks.systems import ALL_SYSTEMS, DEFAULT_SYSTEMS, AutoregressiveSystem, make_systems
    from benchmarks.workloads import build_workload, prompt_list
    from common.runtime.checkpoints import load_tokenizer
    from cosine_zoo.manifest import load_zoo

    t_start = time.perf_counter()
    scenario = SCENARIOS[opts.scenario]()
    if opts.max_new_tokens:
        scenario = replace(scenario, max_new_tokens=opts.max_new_tokens)
    specs = list(scenario.workloads)
    if opts.workloads:
        names = {w.name for w in specs}
        unknown = [w for w in opts.workloads if w not in names]
        if unknown:
            raise BenchError(
                f"unknown workload(s) {', '.join(unknown)} (scenario {scenario.name}: {', '.join(sorted(names))})"
            )
        specs = [w for w in specs if w.name in opts.workloads]
    if opts.requests:
        specs = [replace(w, requests=opts.requests) for w in specs]
    system_names = list(ALL_SYSTEMS if list(opts.systems) == ["all"] else opts.systems or DEFAULT_SYSTEMS)
    if opts.device != "cpu" and not opts.systems:  # transformers' systems are CPU-only here
        system_names = [n for n in system_names if not n.startswith("hf_")]
    cores = opts.cores or os.cpu_count() or 1
    threads = max(1, min(cores, opts.threads or cores))
    torch.set_num_threads(threads)
    out_path = Path(opts.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log_dir = opts.log_dir or str(out_path.parent / "logs")

    zoo = load_zoo(opts.zoo)
    tok = load_tokenizer(zoo.target.path)
    eos_id, pad_id = tok.eos_token_id, tok.pad_token_id
    n_items = max(w.requests for w in specs)
    items = [(d, p, tuple(tok(p).input_ids)) for d, p in prompt_list(zoo.prompts, n_items)]

    # reference pass: the target's own greedy decode of every prompt, batched (16 at a time)
    _say(
        f"bench      zoo {opts.zoo} ({zoo.profile}), {len(system_names)} system(s), {len(specs)} workload(s), "
        f"{scenario.max_new_tokens} new tokens/request, {cores} cores"
    )
    ref_spec = WorkloadSpec("reference", "closed", len(items), concurrency=16)
    ref_wl = build_workload(ref_spec, items, scenario.max_new_tokens, seed=scenario.seed)
    warm = build_workload(
        WorkloadSpec("warm-up", "closed", min(4, len(items)), concurrency=4), items, min(8, scenario.max_new_tokens)
    )
    ref_sys = AutoregressiveSystem(
        str(zoo.target.path), eos_id, threads, name="reference", dtype=opts.dtype, device=opts.device
    )
    ref_sys.start()
    ref_sys.warm_up(warm)
    ref_run = ref_sys.run(ref_wl)
    ref_sys.stop()
    if any(r.error for r in ref_run.records):
        raise BenchError(f"the reference pass failed: {[r.error for r in ref_run.records if r.error][:3]}")
    expected = {items[r.index][2]: tuple(r.token_ids) for r in ref_run.records}
    ref_tokens = sum(len(r.token_ids) for r in ref_run.records)
    _say(f"reference  target alone, greedy: {len(items)} prompts, {ref_tokens} tokens in {ref_run.wall_s:.1f}s")
    # open-loop rates are multiples of the reference system's capacity: the requests/s it
    # sustained on the highest-concurrency closed-loop workload of this run (measured first)
    closed = [w for w in specs if w.kind == "closed" and w.greedy]
    capacity_wl = max(closed, key=lambda w: w.concurrency).name if closed else ""
    reference = {"system": "", "workload": capacity_wl, "requests_per_s": 0.0, "tokens_per_s": 0.0}
    workloads = {
        w.name: build_workload(w, items, scenario.max_new_tokens, seed=scenario.seed)
        for w in specs
        if w.kind == "closed"
    }

    def set_reference(system: str, rps: float, tps: float) -> None:
        reference.update(system=system, requests_per_s=rps, tokens_per_s=tps)
        for w in specs:
            if w.kind == "open":
                workloads[w.name] = build_workload(w, items, scenario.max_new_tokens, rps, scenario.seed)
        _say(
            f"reference  capacity of {system} on {capacity_wl or 'the reference pass'}: {rps:.2f} requests/s "
            f"({tps:.0f} tokens/s); "
            f"open-loop rates: "
            + ", ".join(f"{w.name} {workloads[w.name].offered_rps:.2f}/s" for w in specs if w.kind == "open")
        )

    ordered = sorted(system_names, key=lambda n: n != scenario.reference)  # the reference system first
    if not capacity_wl:
        set_reference(
            "autoregressive (reference pass)", len(ref_run.records) / ref_run.wall_s, ref_tokens / ref_run.wall_s
        )

    if system_factory is None:
        systems, plane = make_systems(
            ordered, zoo, eos_id, pad_id, cores, log_dir, threads, dtype=opts.dtype, device=opts.device
        )
    else:
        systems, plane = system_factory(ordered, zoo, eos_id, pad_id, cores, log_dir, threads)
    results: dict[str, dict[str, Any]] = {}
    described: dict[str, Any] = {}
    mismatches: list[dict[str, Any]] = []
    failures: list[str] = []
    checked = 0
    # (the first system measures the capacity the open-loop rates are set from, whatever it is)
    skipped = skipped_workloads(systems, specs, scenario.roles, capacity_wl) if not opts.workloads else {}
    bar = None
    if opts.progress:
        from tqdm import tqdm

        bar = tqdm(
            total=len(systems) * len(specs) - sum(len(s["workloads"]) for s in skipped.values()),
            desc="bench",
            unit="run",
            dynamic_ncols=True,
            file=sys.stderr,
        )

    def report_now(done: bool) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "machine": machine_info(threads),
            "scenario": {
                "name": scenario.name,
                "complete": done,
                "max_new_tokens": scenario.max_new_tokens,
                "seed": scenario.seed,
                "target_dtype": ref_sys.dtype,
                "device": opts.device,
                "zoo": {
                    "profile": zoo.profile,
                    "target_params": zoo.target.params,
                    "domains": list(zoo.domains),
                    "drafters": {n: {"params": d.params, "domains": list(d.domains)} for n, d in zoo.drafters.items()},
                    "k": zoo.k,
                    "acceptance": {d: dict(r) for d, r in zoo.acceptance.items()},
                },
                "reference": dict(reference),
                "workloads": {
                    w.name: {
                        **w.spec.describe(),
                        "offered_rps": w.offered_rps or None,
                        "phase_rates_rps": list(w.rates_rps) or None,
                    }
                    for w in workloads.values()
                },
                "systems": described,
                "order": [s.name for s in systems],
                "skipped": skipped,
                "wall_s": time.perf_counter() - t_start,
                "greedy_check": {"checked_requests": checked, "mismatches": mismatches},
                "failed_requests": failures,
            },
            "systems": results,
            "ratios": compute_ratios(results, scenario.roles),
        }

    try:
        for system in systems:
            if bar is not None:
                bar.set_description(f"{system.name}: starting")
            t0 = time.perf_counter()
            system.start()
            system.warm_up(warm)  # first passes are slow (allocations, kernel set-up): not measured
            described[system.name] = {**system.describe(), "start_s": time.perf_counter() - t0}
        # one workload on every system before the next workload: the machine's speed drifts over
        # minutes, and the systems a ratio compares are measured within a minute or two of each other
        for spec in specs:
            for system in systems:
                if spec.name in skipped.get(system.name, {}).get("workloads", ()):
                    continue
                wl = workloads.get(spec.name)
                if wl is None:  # open loop before any capacity was measured: the first system sets it
                    first = results.get(systems[0].name, {}).get(capacity_wl)
                    if not first or not first["requests_per_s"]:
                        raise BenchError(f"no capacity measured on {capacity_wl} before {spec.name}")
                    set_reference(systems[0].name, first["requests_per_s"], first["tokens_per_s"])
                    wl = workloads[spec.name]
                if bar is not None:
                    bar.set_description(f"{wl.name}: {system.name}")
                run = system.run(wl)
                m = metrics(run, wl, system.one_at_a_time)
                m["offered_rps"] = wl.offered_rps or None
                results.setdefault(system.name, {})[wl.name] = m
                failures += [f"{system.name}/{wl.name}: {e}" for e in m["errors"]]
                if wl.spec.greedy:
                    bad = check_greedy(
                        system.name, wl.name, run.records, expected, {r.index: r.prompt_ids for r in wl.requests}
                    )
                    if not getattr(
                        system, "exact_greedy", True
                    ):  # not serving our target's kernels: counted, not failed
                        m["greedy_equal"] = sum(1 for r in run.records if not r.error) - len(bad)
                        bad = []
                    else:
                        checked += sum(1 for r in run.records if not r.error)
                    if bad:
                        mismatches += bad
                        raise GreedyMismatch(mismatch_text(bad))
                if bar is not None:
                    bar.set_postfix_str(f"{m['tokens_per_s'] or 0:.0f} tok/s, lat {m['latency_mean_s'] or 0:.2f}s")
                    bar.update(1)
    finally:
        for system in systems:
            system.stop()
        if plane is not None:
            plane.stop()
        if bar is not None:
            bar.close()
        partial = report_now(done=False)
        out_path.write_text(json.dumps(partial, indent=1) + "\n")
    report = report_now(done=True)
    out_path.write_text(json.dumps(report, indent=1) + "\n")
    if opts.plots:
        from benchmarks.plots import write_plots

        write_plots(report, out_path.parent)
    if failures:
        raise BenchError(f"{len(failures)} request(s) failed; first: {failures[0]} (report: {out_path})")
    return report


def format_table(report: dict[str, Any], workloads: Sequence[str] | None = None) -> str:
    roles = report["ratios"].get("workloads", {})
    wanted = list(workloads or [w for w in (roles.get("low"), roles.get("high")) if w])
    lines = []
    for w in wanted:
        lines.append(f"\n{w} ({report['scenario']['workloads'].get(w, {}).get('label', '')})")
        lines.append(
            f"{'system':<20}{'tok/s':>9}{'lat mean':>10}{'p50':>8}{'p99':>8}{'ttft':>8}{'tpot ms':>9}"
            f"{'acc/rnd':>9}{'busy':>7}{'bound':>8}{'%bound':>8}  split d/v/o"
        )
        for name, per in report["systems"].items():
            m = per.get(w)
            if not m:
                continue
            s = m["time_split"]

            def f(v: Any, fmt: str) -> str:
                return "-" if v is None else format(v, fmt)

            lines.append(
                f"{name:<20}{f(m['tokens_per_s'], '.1f'):>9}{f(m['latency_mean_s'], '.3f'):>10}"
                f"{f(m['latency_p50_s'], '.3f'):>8}"
                f"{f(m['latency_p99_s'], '.3f'):>8}{f(m['ttft_mean_s'], '.3f'):>8}"
                f"{f(None if m['tpot_mean_s'] is None else m['tpot_mean_s'] * 1e3, '.2f'):>9}"
                f"{f(m['mean_accepted_len'], '.2f'):>9}{f(m['verifier_busy_frac'], '.0%'):>7}"
                f"{f(m['bound_tokens_per_s'], '.0f'):>8}"
                f"{f(m['frac_of_bound'], '.0%'):>8}  "
                f"{f(s['draft_frac'], '.0%')}/{f(s['verify_frac'], '.0%')}/{f(s['other_frac'], '.0%')}"
            )
    r = report["ratios"]
    lines.append("\nratios (same run):")
    for key, value in r.items():
        if key in ("by_workload", "workloads"):
            continue
        lines.append(f"  {key:<44} {'-' if value is None else f'{value:.3f}'}")
    return "\n".join(lines)


# ---- CLI ------------------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark every system (baselines, CoSine, ablations) on the same workloads; JSON report + plots",
        description="Run every system on the same workloads, one after the other, on this machine with the same "
        "thread budget; write a JSON report and PNG plots beside it. Greedy outputs are checked token by token "
        "against the target's own decode.",
    )
    p.add_argument("--zoo", default=".cosine/zoo-smol", help="model zoo directory")
    p.add_argument("--out", default="bench-out/report.json", help="report path; the plots go beside it")
    p.add_argument(
        "--scenario", choices=sorted(SCENARIOS), default="default", help="default: the full run; quick: seconds (tests)"
    )
    p.add_argument(
        "--systems",
        default="",
        help="comma-separated systems, or 'all' (default: autoregressive, services_plain, hf_assisted, "
        "vanilla_sd, cosine, cosine_token_fusion, cosine_no_control, cosine_no_lookup, cosine_no_draft_ahead, "
        "cosine_no_corpus)",
    )
    p.add_argument("--workloads", default="", help="comma-separated subset of the scenario's workloads (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens per request (default: the scenario's)")
    p.add_argument(
        "--requests", type=int, default=None, help="requests per workload (default: the scenario's, per workload)"
    )
    p.add_argument(
        "--cores",
        type=int,
        default=0,
        help="cores every system may use (default: all); the service processes split them",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of the in-process systems, at most --cores (default 0: "
        "one per core, the same cores the service processes share)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="the target's dtype in every system (default auto: bfloat16 on a CPU with AMX, row-invariant, float32 "
        "elsewhere; transformers' systems are not held to greedy equality in bfloat16, their kernels round by shape)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="torch device of the verifier, the drafters and the target alone: cpu, cuda, cuda:1 ... (default cpu; "
        "on another device transformers' systems are left out)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=cmd_bench)


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def cmd_bench(args: argparse.Namespace) -> int:
    from common.runtime.checkpoints import CheckpointError

    opts = BenchOptions(
        zoo=args.zoo,
        out=args.out,
        scenario=args.scenario,
        systems=_split(args.systems),
        workloads=_split(args.workloads),
        max_new_tokens=args.max_new_tokens,
        requests=args.requests,
        cores=args.cores,
        threads=args.threads,
        plots=not args.no_plots,
        dtype=args.dtype,
        device=args.device,
    )
    t0 = time.perf_counter()
    # SIGTERM unwinds like Ctrl-C, so the service processes the run started are stopped too
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        report = run_bench(opts)
    except GreedyMismatch as exc:
        print("\n" + "!" * 100 + f"\n{exc}\n" + "!" * 100, file=sys.stderr)
        return 3
    except (BenchError, CheckpointError, ValueError) as exc:
        print(f"cosine bench: error: {exc}", file=sys.stderr)
        return 1
    print(format_table(report))
    print(
        f"\nwall {time.perf_counter() - t0:.0f}s; greedy check: "
        f"{report['scenario']['greedy_check']['checked_requests']} "
        f"outputs equal to the target's own decode; report {args.out}"
        + ("" if args.no_plots else f", plots in {Path(args.out).parent}/")
    )
    return 0
