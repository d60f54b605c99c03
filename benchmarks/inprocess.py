"""CoSine against the target decoding alone, in one process, on any device.

The router core runs with the real engines called directly (no sockets, no Redis): the zoo's
target and drafters on ``--device`` / ``--dtype``, its lookup corpus, domain lexicon and expertise
profiles. It serves the same mixed-domain requests as the target alone (plain decode steps through
the same verifier engine, continuous batching with the same number of requests in flight), greedy,
and every output is compared token by token with the target's own.

Where the services cannot run (a GPU node without Redis, say), this gives CoSine's speed-up on
that device; ``cosine bench`` is the full comparison through the services.

    python -m benchmarks.inprocess --zoo .cosine/zoo-smol --device cuda --concurrency 1,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.runtime.sim import plain_generate
from common.spec.types import GREEDY
from services.router.inprocess import output_of


@dataclass
class Run:
    """One system's pass over the requests at one concurrency."""

    outputs: dict[str, list[int]]
    wall_s: float
    passes: int  # verify passes of the target
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.outputs.values())


class _Far:
    """The verifier engine behind a round trip of ``seconds`` a call (the target alone's steps)."""

    def __init__(self, engine: Any, seconds: float):
        self.engine, self.seconds = engine, seconds

    def verify(self, items: Any) -> Any:
        time.sleep(self.seconds)
        return self.engine.verify(items)

    def release(self, request_id: str) -> None:
        self.engine.release(request_id)


def target_alone(
    verifier: Any,
    prompts: Mapping[str, Sequence[int]],
    max_new: int,
    eos: int | None,
    concurrency: int,
    round_trip_s: float = 0.0,
) -> Run:
    """Plain decode steps through ``verifier`` (empty trees), ``concurrency`` requests in flight
    (:func:`common.runtime.sim.plain_generate`), each step behind ``round_trip_s``."""
    t0 = time.perf_counter()
    outputs, passes = plain_generate(
        _Far(verifier, round_trip_s) if round_trip_s > 0 else verifier, prompts, max_new, eos, concurrency
    )
    return Run(outputs, time.perf_counter() - t0, passes)


async def cosine_run(
    core: Any, prompts: Mapping[str, Sequence[int]], max_new: int, eos: int | None, concurrency: int
) -> Run:
    """The router ``core`` serving ``prompts`` greedy from ``concurrency`` clients (started and stopped here)."""
    queue = list(prompts)
    out: dict[str, list[int]] = {}

    async def client() -> None:
        while queue:
            rid = queue.pop(0)
            out[rid] = await output_of(
                core.submit(rid, list(prompts[rid]), max_new, GREEDY, [eos] if eos is not None else [])
            )

    core.start()
    try:
        await asyncio.sleep(0)  # the lexicon and the corpus load before the first request
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    finally:
        await core.stop()
    c = core.counters
    stats = {
        "accepted_per_pass": c.accepted_tokens / max(1, c.verify_passes),
        "lookup_accepted": c.lookup_accepted + c.step_lookup_accepted,
        "drafter_calls": sum(getattr(core.drafters, "calls", {}).values()),
        "verify_s": c.verify_s,
        "draft_s": c.draft_s,
    }
    return Run(out, wall, c.verify_passes, stats)


@dataclass
class Setup:
    """The engines and the zoo's knowledge, loaded once and shared by every run."""

    verifier: Any
    drafters: dict[str, Any]
    acceptance: Mapping[str, Mapping[str, float]]
    lexicon: Mapping[str, tuple[int, Mapping[int, int]]]
    corpus: Mapping[str, Sequence[Sequence[int]]]

    @classmethod
    def load(cls, zoo: Any, device: str, dtype: str, drafters: Sequence[str] | None) -> Setup:
        from common.runtime.drafter_engine import DrafterEngine
        from common.runtime.verifier_engine import VerifierEngine

        names = list(zoo.drafters) if drafters is None else list(drafters)
        unknown = [n for n in names if n not in zoo.drafters]
        if unknown:
            raise SystemExit(f"unknown drafter(s) {', '.join(unknown)}: the zoo has {', '.join(zoo.drafters)}")
        verifier = VerifierEngine.from_checkpoint(zoo.target.path, device=device, dtype=dtype, seed=0)
        verifier.time_passes()  # as the verifier service does: the router core prices rows by this curve
        drafter_dtype = "float32" if dtype == "auto" else dtype
        engines = {
            n: DrafterEngine.from_checkpoint(
                zoo.drafters[n].path, device=device, dtype=drafter_dtype, domains=zoo.drafters[n].domains
            )
            for n in names
        }
        return cls(verifier, engines, zoo.acceptance, zoo.lexicon, zoo.lookup_corpus)

    def core(self, fuse_locally: bool = True, round_trip_s: float = 0.0) -> Any:
        from common.spec.lookup_corpus import DomainCorpora
        from services.router.core import RouterCore
        from services.router.inprocess import LocalDrafterPool, LocalVerifier
        from services.router.lexicon import DomainLexicon
        from services.router.settings import RouterSettings

        learned: list[tuple[str, Sequence[int]]] = []  # what the router adds to the shared lexicon

        corpora = DomainCorpora.build(self.corpus) if self.corpus else None
        self.verifier.corpus = corpora  # the verifier drafts from the same corpus at plain steps, as the service does

        async def profiles(drafters: Sequence[str], domain: str) -> dict[str, float]:
            return {d: self.acceptance[d][domain] for d in drafters if domain in self.acceptance.get(d, {})}

        async def load_lexicon() -> DomainLexicon:  # a fresh copy per read, as from Redis: the seed + what was learned
            lexicon = DomainLexicon()
            for domain, (examples, counts) in sorted(self.lexicon.items()):
                lexicon.absorb(
                    domain, examples, counts, labelled=True
                )  # the zoo's seed: its training prompts, labelled
            for domain, prompt in learned:
                lexicon.absorb(domain, 1, Counter(prompt))
            return lexicon

        async def record_lexicon(domain: str, prompt: Sequence[int]) -> None:
            learned.append((domain, list(prompt)))

        async def load_corpus(version: int) -> tuple[int, Any] | None:
            return None if version else (1, corpora)

        return RouterCore(
            RouterSettings(),
            LocalDrafterPool(self.drafters, fuse_locally=fuse_locally),
            LocalVerifier(self.verifier, round_trip_s=round_trip_s),
            profiles=profiles,
            load_lexicon=load_lexicon if self.lexicon else None,
            record_lexicon=record_lexicon if self.lexicon else None,
            load_corpus=load_corpus if corpora is not None else None,
        )


def compare(
    prompts: Mapping[str, Sequence[int]],
    setup: Setup,
    max_new: int,
    eos: int | None,
    concurrency: int,
    round_trip_s: float = 0.0,
) -> dict[str, Any]:
    alone = target_alone(setup.verifier, prompts, max_new, eos, concurrency, round_trip_s)
    cosine = asyncio.run(cosine_run(setup.core(round_trip_s=round_trip_s), prompts, max_new, eos, concurrency))
    equal = sum(cosine.outputs.get(r) == alone.outputs[r] for r in prompts)
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "greedy_equal": equal,
        "target_alone": {
            "tokens": alone.tokens,
            "wall_s": alone.wall_s,
            "tokens_per_s": alone.tokens / alone.wall_s,
            "passes": alone.passes,
        },
        "cosine": {
            "tokens": cosine.tokens,
            "wall_s": cosine.wall_s,
            "tokens_per_s": cosine.tokens / cosine.wall_s,
            "passes": cosine.passes,
            **cosine.stats,
        },
        "speedup": (cosine.tokens / cosine.wall_s) / (alone.tokens / alone.wall_s),
        "mismatched": [r for r in prompts if cosine.outputs.get(r) != alone.outputs[r]],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.inprocess",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--zoo", type=Path, default=Path(".cosine/zoo-smol"), help="model zoo directory (default .cosine/zoo-smol)"
    )
    ap.add_argument("--device", default="cpu", help="torch device of every model: cpu, cuda, cuda:1 ... (default cpu)")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="the target's weights and activations (default auto: bfloat16 on a CPU whose bfloat16 products are "
        "row-invariant, float32 elsewhere, with the drafters in float32). On a GPU, in bfloat16 or float16 a greedy "
        "output may leave the target alone's at a near tie, since rounding there depends on the shape of the pass",
    )
    ap.add_argument("--drafters", default="", help="comma-separated drafters of the zoo to load (default: all)")
    ap.add_argument(
        "--concurrency", default="1,16", help="requests in flight, comma-separated, one comparison each (default 1,16)"
    )
    ap.add_argument(
        "--requests",
        type=int,
        default=24,
        help="requests per comparison, round-robin over the zoo's domains (default 24)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per request (default 64)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default 0: torch's choice)")
    ap.add_argument(
        "--round-trip-ms",
        type=float,
        default=0.0,
        help="a verifier across a network: every call to it (a step of the target alone, a round of "
        "cosine) first waits this long, none of it busy time (default 0: in process)",
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from common.logs import configure_logging
    from common.runtime.checkpoints import load_tokenizer
    from cosine_cli.workload import mixed_workload
    from cosine_zoo.manifest import ZooError, load_zoo

    configure_logging("warning")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise SystemExit(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}") from None
    if not levels or min(levels) < 1:
        raise SystemExit("--concurrency: every level must be at least 1")
    try:
        zoo = load_zoo(args.zoo)
    except ZooError as exc:
        raise SystemExit(str(exc)) from None
    tok = load_tokenizer(zoo.target.path)
    eos = tok.eos_token_id
    chosen = [d.strip() for d in args.drafters.split(",") if d.strip()] or None
    print(
        f"loading the target and {len(chosen) if chosen else len(zoo.drafters)} drafters on {args.device} "
        f"({args.dtype}) ...",
        file=sys.stderr,
        flush=True,
    )
    setup = Setup.load(zoo, args.device, args.dtype, chosen)
    work = mixed_workload(zoo.prompts, args.requests)
    prompts = {f"r{i}": list(tok(p).input_ids) for i, (_, p) in enumerate(work)}
    warm = dict(list(prompts.items())[:2])
    compare(warm, setup, 8, eos, 2)  # first kernels, allocator, caches: kept out of the figures
    device = str(setup.verifier.runner.device)
    gpu = (
        torch.cuda.get_device_name(setup.verifier.runner.device)
        if setup.verifier.runner.device.type == "cuda"
        else None
    )
    results = []
    print(
        f"{'in flight':>9} {'target alone tok/s':>19} {'cosine tok/s':>13} {'speed-up':>9} {'tokens/pass':>12} "
        f"{'greedy equal':>13}"
    )
    for c in levels:
        r = compare(prompts, setup, args.max_new_tokens, eos, c, args.round_trip_ms / 1e3)
        results.append(r)
        a, s = r["target_alone"], r["cosine"]
        print(
            f"{c:>9} {a['tokens_per_s']:>19.1f} {s['tokens_per_s']:>13.1f} {r['speedup']:>8.2f}x "
            f"{s['tokens'] / max(1, s['passes']):>12.2f} {r['greedy_equal']:>6}/{r['requests']:<6}",
            flush=True,
        )
    report = {
        "device": device,
        "gpu": gpu,
        "round_trip_ms": args.round_trip_ms,
        "dtype": str(setup.verifier.runner.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "zoo": str(args.zoo),
        "drafters": sorted(setup.drafters),
        "max_new_tokens": args.max_new_tokens,
        "results": results,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if any(r["mismatched"] for r in results):
        print(
            "greedy outputs differ from the target's own: "
            + "; ".join(
                f"{r['concurrency']} in flight: {', '.join(r['mismatched'])}" for r in results if r["mismatched"]
            ),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
