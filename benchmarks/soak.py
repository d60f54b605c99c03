"""Soak: N concurrent generation streams through one gateway, all opened at once.

    python -m benchmarks.soak                       # 1000 streams, local cluster on .cosine/zoo-smol
    python -m benchmarks.soak --tiny-zoo            # the same on the tiny test zoo (built if absent)
    python -m benchmarks.soak --address HOST:PORT   # against a running gateway

Every stream is counted once: *completed* when its final chunk (``finished``) arrives, *lost*
otherwise - an error status (by code), or a stream that ended without its final chunk. For the
completed ones it prints latency (request to final chunk) and time to first token (request to the
first chunk carrying tokens), p50 and p99, and the tokens per second of the whole run. Greedy, so
two runs of the same prompts must produce the same outputs. ``--json`` prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_ZOO = ".cosine/zoo-smol"
TINY_ZOO = ".cosine/zoo-tiny"


@dataclass
class StreamOutcome:
    finished: bool
    tokens: int = 0
    latency_s: float | None = None  # request to final chunk
    ttft_s: float | None = None  # request to first chunk with tokens
    error: str = ""  # status code name, or "ended" for a stream that stopped without its final chunk


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered), max(1, math.ceil(q / 100 * len(ordered))))  # the smallest value with q% at or under it
    return ordered[rank - 1]


def summarize(outcomes: Sequence[StreamOutcome], wall_s: float) -> dict[str, Any]:
    done = [o for o in outcomes if o.finished]
    lat = [o.latency_s for o in done if o.latency_s is not None]
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    tokens = sum(o.tokens for o in done)
    return {
        "streams": len(outcomes),
        "completed": len(done),
        "lost": len(outcomes) - len(done),
        "lost_by_reason": dict(sorted(Counter(o.error or "ended" for o in outcomes if not o.finished).items())),
        "tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
    }


async def one_stream(client: Any, prompt: str, max_new_tokens: int, timeout_s: float) -> StreamOutcome:
    from cosine_client import CosineError

    t0 = time.perf_counter()
    out = StreamOutcome(False)
    try:
        async for chunk in client.stream(prompt, max_new_tokens=max_new_tokens, temperature=0.0, timeout=timeout_s):
            if chunk.token_ids and out.ttft_s is None:
                out.ttft_s = time.perf_counter() - t0
            out.tokens += len(chunk.token_ids)
            if chunk.finished:
                out.finished, out.latency_s = True, time.perf_counter() - t0
                return out
        out.error = "ended"
    except CosineError as exc:
        out.error = exc.code.name
    return out


async def run_streams(
    address: str, prompts: Sequence[str], streams: int, max_new_tokens: int, timeout_s: float, progress: bool = False
) -> tuple[list[StreamOutcome], float]:
    """Open ``streams`` streams at once (prompts round-robin) and wait for all; outcomes and wall time."""
    from cosine_client import AsyncClient

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=streams, desc="soak streams", unit="stream", dynamic_ncols=True, file=sys.stderr)
    async with AsyncClient(address) as client:

        async def tracked(i: int) -> StreamOutcome:
            out = await one_stream(client, prompts[i % len(prompts)], max_new_tokens, timeout_s)
            if bar is not None:
                bar.update(1)
            return out

        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(tracked(i) for i in range(streams)))
        wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return list(outcomes), wall


def ensure_tiny_zoo(path: str) -> None:
    if (Path(path) / "zoo.json").is_file():
        return
    from common.logs import configure_logging
    from cosine_zoo.build import BuildOptions, build_zoo
    from cosine_zoo.profiles import tiny

    configure_logging("warning", stream=sys.stderr)  # stdout carries the figures (--json)
    print(f"building   the tiny zoo into {path}", file=sys.stderr, flush=True)
    build_zoo(BuildOptions(out=Path(path), profile=tiny(), seed=0, progress=False, threads=1))


def print_summary(s: dict[str, Any]) -> None:
    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    print(
        f"streams         {s['streams']} opened at once: {s['completed']} completed, {s['lost']} lost"
        + (f" ({', '.join(f'{k} {v}' for k, v in s['lost_by_reason'].items())})" if s["lost"] else "")
    )
    print(f"latency         p50 {sec(s['latency_p50_s'])}, p99 {sec(s['latency_p99_s'])}")
    print(f"first token     p50 {sec(s['ttft_p50_s'])}, p99 {sec(s['ttft_p99_s'])}")
    print(f"throughput      {s['tokens_per_s']:.1f} tokens/s ({s['tokens']} tokens in {s['wall_s']:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.soak",
        description=__doc__.split("\n\n")[0],
        epilog="Counts: completed = final chunk received; lost = anything else.",
    )
    ap.add_argument("--streams", type=int, default=1000, help="concurrent streams, all opened at once (default: 1000)")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="tokens per stream (default: 16)")
    ap.add_argument("--timeout", type=float, default=900.0, metavar="S", help="deadline of each stream (default: 900)")
    ap.add_argument("--zoo", default=DEFAULT_ZOO, help=f"model zoo of the local cluster (default: {DEFAULT_ZOO})")
    ap.add_argument(
        "--tiny-zoo", action="store_true", help=f"use the tiny test zoo instead ({TINY_ZOO}, built if absent)"
    )
    ap.add_argument("--address", help="gateway host:port of a running cluster (no local cluster is started)")
    ap.add_argument("--log-dir", default=".cosine/soak-logs", help="service logs of the local cluster")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    if args.streams < 1 or args.max_new_tokens < 1:
        ap.error("--streams and --max-new-tokens must be >= 1")
    from cosine_cli.local_state import load_zoo_or_exit
    from cosine_cli.profiles import seed_zoo

    zoo_dir = TINY_ZOO if args.tiny_zoo else args.zoo
    if args.tiny_zoo:
        ensure_tiny_zoo(zoo_dir)
    zoo = load_zoo_or_exit(zoo_dir)
    prompts = [p for d in sorted(zoo.prompts) for p in zoo.prompts[d]]
    cluster = None
    address = args.address
    try:
        if not address:
            from cosine_cli.cluster import ClusterSpec, LocalCluster

            cluster = LocalCluster(
                ClusterSpec(
                    target=str(zoo.target.path),
                    drafters={n: str(d.path) for n, d in zoo.drafters.items()},
                    gateway_port=0,
                    log_dir=args.log_dir,
                    router_args=("--max-queue", str(max(1024, args.streams))),
                    gateway_args=("--request-timeout-s", str(args.timeout)),
                )
            )
            address = cluster.start()
            asyncio.run(seed_zoo(cluster.redis_url, cluster.spec.prefix, zoo))
        print(
            f"soak       {args.streams} streams x {args.max_new_tokens} tokens through {address} ({zoo_dir})",
            file=sys.stderr,
            flush=True,
        )
        outcomes, wall = asyncio.run(
            run_streams(address, prompts, args.streams, args.max_new_tokens, args.timeout, progress=True)
        )
    finally:
        if cluster is not None:
            cluster.stop()
    summary = {"zoo": zoo_dir, "max_new_tokens": args.max_new_tokens, **summarize(outcomes, wall)}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0 if summary["lost"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
