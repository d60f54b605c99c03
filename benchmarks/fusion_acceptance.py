"""Does collaboration pay? Mean accepted draft tokens per round on a mixed-domain workload:
token fusion of several drafters vs every single drafter alone (all in one run, same prompts).

    python -m benchmarks.fusion_acceptance --zoo .cosine/zoo-smol

Runs the router core in-process with the real engines (no sockets), greedy, so acceptance is the
only thing measured; output is checked against plain decoding of the target for every setting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from common.runtime.checkpoints import load_tokenizer
from common.runtime.drafter_engine import DrafterEngine
from common.runtime.sim import plain_generate
from common.runtime.verifier_engine import VerifierEngine
from common.spec.types import GREEDY
from cosine_cli.workload import mixed_workload
from services.router.core import RouterCore
from services.router.inprocess import LocalDrafterPool, LocalVerifier, output_of
from services.router.settings import RouterSettings


async def run(
    core: RouterCore, prompts: dict[str, list[int]], max_new: int, eos: int
) -> tuple[dict[str, list[int]], float]:
    core.start()
    try:
        reqs = {rid: core.submit(rid, p, max_new, GREEDY, [eos]) for rid, p in prompts.items()}
        out = {}
        accepted = rounds = 0
        for rid, req in reqs.items():
            out[rid] = await output_of(req)
            accepted += req.stats.accepted_tokens
            rounds += req.stats.rounds
        return out, accepted / max(1, rounds)
    finally:
        await core.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zoo", default=".cosine/zoo-smol")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from cosine_zoo.manifest import load_zoo

    zoo = load_zoo(args.zoo)
    tok = load_tokenizer(zoo.target.path)
    work = mixed_workload(zoo.prompts, args.requests)
    prompts = {f"r{i}": tok(p).input_ids for i, (_, p) in enumerate(work)}
    verifier = VerifierEngine.from_checkpoint(zoo.target.path)
    engines = {n: DrafterEngine.from_checkpoint(d.path, domains=d.domains) for n, d in zoo.drafters.items()}
    eos = tok.eos_token_id
    expected, _ = plain_generate(verifier, prompts, args.max_new_tokens, eos)

    async def profiles(drafters, domain):
        return {d: zoo.acceptance[d][domain] for d in drafters if domain in zoo.acceptance.get(d, {})}

    settings: dict[str, tuple[RouterSettings, dict[str, DrafterEngine]]] = {
        f"single:{n}": (RouterSettings(drafters_per_request=1, tree_width=1, routing=False, adaptive_k=False), {n: e})
        for n, e in engines.items()
    }
    settings["routed single (1 drafter, best by expertise)"] = (
        RouterSettings(drafters_per_request=1, tree_width=1, adaptive_k=False),
        engines,
    )
    settings["fused 2 drafters, width 1"] = (
        RouterSettings(drafters_per_request=2, tree_width=1, adaptive_k=False),
        engines,
    )
    settings["fused 2 drafters, width 3"] = (
        RouterSettings(drafters_per_request=2, tree_width=3, adaptive_k=False),
        engines,
    )
    settings["fused 3 drafters, width 3"] = (
        RouterSettings(drafters_per_request=3, tree_width=3, adaptive_k=False),
        engines,
    )
    rows = {}
    for name, (config, pool) in settings.items():
        t0 = time.perf_counter()
        core = RouterCore(config, LocalDrafterPool(pool), LocalVerifier(verifier), profiles=profiles)
        got, accepted = asyncio.run(run(core, prompts, args.max_new_tokens, eos))
        if got != expected:
            bad = [r for r in prompts if got[r] != expected[r]]
            print(f"LOSSLESS CHECK FAILED for {name}: {bad}", file=sys.stderr)
            return 1
        rows[name] = {
            "accepted_per_round": accepted,
            "batches": core.counters.rounds,
            "seconds": time.perf_counter() - t0,
        }
        print(f"{name:<48} {accepted:6.2f} accepted draft tokens per request-round", flush=True)
    best_single = max(v["accepted_per_round"] for k, v in rows.items() if k.startswith("single:"))
    fused = rows["fused 2 drafters, width 3"]["accepted_per_round"]
    print(f"\nfused (2 drafters, width 3) / best single drafter: {fused / best_single:.2f}x")
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
