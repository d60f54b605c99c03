"""Demo workload: mixed-domain prompts sent concurrently through the gateway, and a summary."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cosine_client import AsyncClient, CosineError, Generation


@dataclass
class WorkResult:
    domain: str
    prompt: str
    generation: Generation | None
    latency_s: float
    error: str = ""


def mixed_workload(prompts: Mapping[str, Sequence[str]], count: int) -> list[tuple[str, str]]:
    """Round-robin over the domains so that every batch mixes them."""
    domains = sorted(d for d in prompts if prompts[d])
    out: list[tuple[str, str]] = []
    i = 0
    while len(out) < count and domains:
        d = domains[i % len(domains)]
        pool = prompts[d]
        out.append((d, pool[(i // len(domains)) % len(pool)]))
        i += 1
    return out


async def run_workload(
    address: str,
    work: Sequence[tuple[str, str]],
    concurrency: int,
    max_new_tokens: int,
    progress: bool = False,
    desc: str = "demo requests",
    client_options: Mapping[str, Any] | None = None,
    **params,
) -> list[WorkResult]:
    """Serve ``work`` through the gateway; ``client_options`` go to the AsyncClient (e.g. TLS)."""
    sem = asyncio.Semaphore(max(1, concurrency))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(work), desc=desc, unit="req", dynamic_ncols=True)
    results: list[WorkResult] = []

    async with AsyncClient(address, timeout=600, **dict(client_options or {})) as client:

        async def one(domain: str, prompt: str) -> None:
            async with sem:
                t0 = time.perf_counter()
                try:
                    gen = await client.generate(prompt, max_new_tokens=max_new_tokens, **params)
                    results.append(WorkResult(domain, prompt, gen, time.perf_counter() - t0))
                except CosineError as exc:
                    results.append(WorkResult(domain, prompt, None, time.perf_counter() - t0, str(exc)))
                if bar is not None:
                    done = [r for r in results if r.generation]
                    toks = sum(len(r.generation.token_ids) for r in done)
                    rounds = sum(r.generation.stats.rounds for r in done)
                    bar.set_postfix(tokens=toks, tok_per_round=f"{toks / rounds:.2f}" if rounds else "-")
                    bar.update(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(d, p) for d, p in work))
        wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    for r in results:
        r.wall_s = wall  # type: ignore[attr-defined]
    return results


def summarize(results: Sequence[WorkResult]) -> dict:
    ok = [r for r in results if r.generation is not None]
    wall = getattr(results[0], "wall_s", 0.0) if results else 0.0
    tokens = sum(len(r.generation.token_ids) for r in ok)
    rounds = sum(r.generation.stats.rounds for r in ok)
    accepted = sum(r.generation.stats.accepted_tokens for r in ok)
    served: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    credited: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    domain_rounds: dict[str, int] = defaultdict(int)
    for r in ok:
        domain_rounds[r.domain] += r.generation.stats.rounds
        for d in r.generation.stats.drafters_used:
            served[r.domain][d] += 1
        for d, n in r.generation.stats.accepted_by_drafter.items():
            credited[r.domain][d] += n
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "rounds": rounds,
        "mean_accepted_len": accepted / rounds if rounds else 0.0,
        "tokens_per_round": tokens / rounds if rounds else 0.0,
        "latency_mean_s": sum(r.latency_s for r in ok) / len(ok) if ok else 0.0,
        "served": {d: dict(v) for d, v in served.items()},
        "accepted_per_round": {dom: {d: n / domain_rounds[dom] for d, n in v.items()} for dom, v in credited.items()},
    }


def print_summary(results: Sequence[WorkResult], router_address: str = "") -> dict:
    s = summarize(results)
    print()
    print(f"requests        {s['requests']} ({s['failed']} failed) in {s['wall_s']:.1f} s")
    print(f"throughput      {s['tokens_per_s']:.1f} tokens/s ({s['tokens']} tokens)")
    print(f"mean latency    {s['latency_mean_s']:.2f} s")
    print(
        f"per round       {s['mean_accepted_len']:.2f} draft tokens accepted, {s['tokens_per_round']:.2f} tokens "
        "committed"
    )
    drafters = sorted({d for v in s["served"].values() for d in v})
    if drafters:
        print()
        print("requests served by each drafter, per domain (and draft tokens accepted per round):")
        width = max(10, *(len(d) + 2 for d in drafters))
        print(f"{'domain':<12}" + "".join(f"{d:>{width}}" for d in drafters))
        for dom in sorted(s["served"]):
            cells = []
            for d in drafters:
                n = s["served"][dom].get(d, 0)
                acc = s["accepted_per_round"].get(dom, {}).get(d, 0.0)
                cells.append(f"{f'{n} ({acc:.2f})' if n else '-':>{width}}")
            print(f"{dom:<12}" + "".join(cells))
    for r in results:
        if r.error:
            print(f"failed: [{r.domain}] {r.error}")
    return s


def print_speedup(cosine: dict, plain_results: Sequence[WorkResult], cosine_results: Sequence[WorkResult]) -> dict:
    """CoSine against the target alone on the same requests (same run, same verifier): throughput,
    latency, and whether every output is the same token for token."""
    plain = summarize(plain_results)
    alone = {r.prompt: r.generation.token_ids for r in plain_results if r.generation}  # results come in finishing order
    pairs = [(r.generation.token_ids, alone[r.prompt]) for r in cosine_results if r.generation and r.prompt in alone]
    same = sum(a == b for a, b in pairs)
    speedup = cosine["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else 0.0
    latency = cosine["latency_mean_s"] / plain["latency_mean_s"] if plain["latency_mean_s"] else 0.0
    print()
    print(
        f"target alone    {plain['tokens_per_s']:.1f} tokens/s, mean latency {plain['latency_mean_s']:.2f} s "
        f"(same requests, drafting off)"
    )
    print(
        f"speed-up        {speedup:.2f}x throughput, {latency:.2f}x latency; "
        f"{same}/{len(pairs)} outputs identical to the target's own"
    )
    return {
        "target_alone": plain,
        "speedup": speedup,
        "latency_ratio": latency,
        "identical": same,
        "compared": len(pairs),
    }
