"""`cosine chaos`: kill every part of a local cluster under load and count what it costs.

Starts a local cluster as `cosine up` does (supervised: a process that dies is restarted), runs
a greedy workload once undisturbed for reference outputs, then once per victim - drafter,
verifier, router, gateway, Redis, in that order - while that process is SIGKILLed a quarter of
the way through and brought back by the supervisor. Reports, per kill and in total, requests
sent, completed and failed (sent = completed + failed), retries (requests sent again after an
UNAVAILABLE; see :mod:`cosine_cli.chaos_run`), and completed outputs that differ from the
undisturbed run; as a table, or as JSON with ``--json``. Exit status 0 when no request failed and
no output differs, 1 otherwise, 2 when the cluster did not start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from cosine_cli.local_state import DEFAULT_ZOO, load_zoo_or_exit
from cosine_cli.profiles import seed_zoo

REPORT_SCHEMA = "cosine-chaos/1"
COLUMNS = ("phase", "sent", "completed", "failed", "retries", "differ", "in flight", "restarts", "back after")


def register(sub: argparse._SubParsersAction) -> None:
    from cosine_cli.chaos_run import VICTIMS

    p = sub.add_parser(
        "chaos",
        help="kill each service of a local cluster under load (drafter, verifier, router, gateway, Redis) and report",
        description="Start a local cluster (as `cosine up`, supervised), run a greedy workload once undisturbed for "
        "reference outputs, then once per victim while that process is SIGKILLed and restarted by the supervisor. "
        "Reports requests sent, completed, failed, retried (after UNAVAILABLE) and outputs that differ from the "
        "undisturbed run, per kill and in total. Exit status 0 when nothing failed or differed, 1 otherwise.",
    )
    p.add_argument(
        "--zoo", default=DEFAULT_ZOO, help=f"model zoo directory (default: {DEFAULT_ZOO}; the tiny test zoo works too)"
    )
    p.add_argument(
        "--victims",
        default=",".join(VICTIMS),
        help=f"comma-separated processes to kill, in order (default: {','.join(VICTIMS)})",
    )
    p.add_argument("--requests", type=int, default=24, help="requests per run of the workload (default: 24)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default: 8)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per request (default: 32)")
    p.add_argument(
        "--retry-window",
        type=float,
        default=90.0,
        metavar="S",
        help="how long a client keeps re-sending a request that failed with UNAVAILABLE (default: 90)",
    )
    p.add_argument(
        "--recovery-timeout",
        type=float,
        default=180.0,
        metavar="S",
        help="how long to wait for a killed process to be back before the next kill (default: 180)",
    )
    p.add_argument("--drafter-processes", type=int, default=1, help="drafter processes in the cluster (default: 1)")
    p.add_argument("--log-dir", default=".cosine/chaos-logs", help="where each service writes its log")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.set_defaults(func=cmd_chaos)


def _victims(text: str) -> list[str]:
    from cosine_cli.chaos_run import VICTIMS

    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VICTIMS]
    if bad or not names:
        raise SystemExit(
            f"cosine chaos: error: --victims: unknown {', '.join(bad) or '(none given)'}; choose from "
            f"{', '.join(VICTIMS)}"
        )
    return names


def total(kills: list[Any]) -> dict[str, Any]:
    keys = ("sent", "completed", "failed", "retries", "differ", "restarts")
    return {
        "name": "total",
        **{k: sum(getattr(r, k) for r in kills) for k in keys},
        "killed": sorted({r.victim for r in kills if r.restarts > 0}),
    }


def print_table(reference: Any, kills: list[Any], tot: dict[str, Any]) -> None:
    rows = [
        (reference.name, reference.sent, reference.completed, reference.failed, reference.retries, "-", "-", "-", "-")
    ]
    for r in kills:
        back = f"{r.back_after_s:.1f} s" if r.back_after_s is not None else "not back"
        rows.append((r.name, r.sent, r.completed, r.failed, r.retries, r.differ, r.in_flight_at_kill, r.restarts, back))
    rows.append(
        (
            "total (kills)",
            tot["sent"],
            tot["completed"],
            tot["failed"],
            tot["retries"],
            tot["differ"],
            "-",
            tot["restarts"],
            "-",
        )
    )
    widths = [max(len(str(c)) for c in col) for col in zip(COLUMNS, *rows)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(line(COLUMNS))
    for row in rows:
        print(line(row))
    errors = {k: v for r in (reference, *kills) for k, v in r.errors.items()}
    if errors:
        print("failures by status: " + ", ".join(f"{k} {v}" for k, v in sorted(errors.items())))


async def run_chaos(args: argparse.Namespace, victims: list[str], say) -> dict[str, Any]:
    from cosine_cli.chaos_run import PhaseReport, kill_phase, run_workload, tally
    from cosine_cli.cluster import ClusterSpec, LocalCluster
    from cosine_cli.supervisor import Backoff
    from cosine_cli.workload import mixed_workload

    zoo = load_zoo_or_exit(args.zoo)
    spec = ClusterSpec(
        target=str(zoo.target.path),
        drafters={n: str(d.path) for n, d in zoo.drafters.items()},
        drafter_domains={n: list(d.domains) for n, d in zoo.drafters.items()},
        gateway_port=0,
        drafter_processes=args.drafter_processes,
        log_dir=args.log_dir,
    )
    prompts = [p for _, p in mixed_workload(zoo.prompts, args.requests)]
    cluster = LocalCluster(spec)
    try:
        await cluster.start_async(progress=True)
        await seed_zoo(cluster.redis_url, spec.prefix, zoo)
        cluster.supervise(backoff=Backoff(initial_s=0.5), say=say)
        say(
            f"chaos      reference run: {len(prompts)} requests, {args.concurrency} at a time, {args.max_new_tokens} "
            "new tokens"
        )
        outcomes = await run_workload(
            cluster.gateway_address, prompts, args.concurrency, args.max_new_tokens, args.retry_window
        )
        reference = tally(PhaseReport("reference"), outcomes, None)
        ref_tokens = [o.tokens for o in outcomes]
        kills = []
        for i, victim in enumerate(victims, 1):
            say(f"chaos      run {i}/{len(victims)}: kill {victim}")
            kills.append(
                await kill_phase(
                    cluster,
                    victim,
                    prompts,
                    ref_tokens,
                    args.concurrency,
                    args.max_new_tokens,
                    args.retry_window,
                    args.recovery_timeout,
                    say,
                )
            )
    finally:
        cluster.stop()
    return {
        "schema": REPORT_SCHEMA,
        "zoo": args.zoo,
        "requests": len(prompts),
        "concurrency": args.concurrency,
        "max_new_tokens": args.max_new_tokens,
        "reference": reference,
        "kills": kills,
        "total": total(kills),
    }


def cmd_chaos(args: argparse.Namespace) -> int:
    from cosine_cli.cluster import ClusterError

    victims = _victims(args.victims)
    if args.requests < 1 or args.concurrency < 1 or args.max_new_tokens < 1:
        raise SystemExit("cosine chaos: error: --requests, --concurrency and --max-new-tokens must be >= 1")
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        report = asyncio.run(run_chaos(args, victims, say))
    except ClusterError as exc:
        print(f"cosine chaos: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {**report, "reference": report["reference"].as_dict(), "kills": [k.as_dict() for k in report["kills"]]}
        print(json.dumps(out, indent=2))
    else:
        print_table(report["reference"], report["kills"], report["total"])
    tot, ref = report["total"], report["reference"]
    return 0 if tot["failed"] == 0 and tot["differ"] == 0 and ref.failed == 0 else 1
