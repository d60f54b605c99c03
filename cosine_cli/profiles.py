"""`cosine profile`: what the routers learn from before they serve, written into Redis: the
drafters' expertise profiles (a zoo's acceptance matrix, or measured on your checkpoints), the
domain lexicon and the lookup corpus. `cosine up` seeds a zoo the same way (:func:`seed_zoo`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cosine_cli.local_state import DEFAULT_ZOO, load_zoo_or_exit, read_state


def register(sub: argparse._SubParsersAction) -> None:
    pr = sub.add_parser(
        "profile",
        help="write drafter expertise profiles into Redis (a zoo's acceptance matrix, or measured)",
        description="Seed the router's expertise profiles. From a zoo: its acceptance matrix, and the domain lexicon "
        "of its lexicon.json. With --measure: "
        "for real checkpoints, measure each drafter's mean accepted tokens per round (greedy, chain of --k) on "
        "prompts of each domain, then write them.",
    )
    pr.add_argument("--zoo", default=DEFAULT_ZOO, help="model zoo directory whose zoo.json holds the acceptance matrix")
    pr.add_argument(
        "--measure", action="store_true", help="measure instead of reading a zoo (needs --target, --drafter, --prompts)"
    )
    pr.add_argument("--target", help="target checkpoint directory (with --measure)")
    pr.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="drafter checkpoint (with --measure; repeatable)",
    )
    pr.add_argument("--prompts", help='JSON lines of {"domain": ..., "text": ...} (with --measure)')
    pr.add_argument("--k", type=int, default=4, help="speculation length of the measurement")
    pr.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt in the measurement")
    pr.add_argument("--redis-url", help="Redis URL (default: the cluster started by `cosine up`)")
    pr.add_argument("--redis-prefix", default="cosine")
    pr.add_argument("--prior-weight", type=float, default=20.0, help="how many rounds the offline figures count for")
    pr.add_argument("--reset", action="store_true", help="drop online statistics too")
    pr.add_argument(
        "--corpus",
        metavar="FILE",
        help='JSON lines of {"domain": ..., "text": ...}: text the target wrote (completions with their prompts, '
        "e.g. from your logs), tokenized with the target's tokenizer (--target, else the zoo's) and seeded as the "
        "routers' lookup corpus instead of the zoo's",
    )
    pr.set_defaults(func=cmd_profile)


async def seed_profiles(
    redis_url: str,
    prefix: str,
    matrix: dict[str, dict[str, float]],
    prior_weight: float,
    reset: bool = False,
    lexicon: Mapping[str, tuple[int, Mapping[int, int]]] | None = None,
    corpus: Mapping[str, Sequence[Sequence[int]]] | None = None,
) -> int:
    """Write the zoo's acceptance matrix as profile priors and, when given, its domain lexicon and
    the routers' lookup corpus (``reset``: drop the online figures and the lexicon routers learned)."""
    from common.platform.store import Store

    store = Store.from_url(redis_url, prefix=prefix)
    try:
        for drafter, row in matrix.items():
            await store.seed_profile(drafter, row, prior_weight, reset=reset)
        if lexicon:
            await store.seed_lexicon(lexicon, reset=reset)
        if corpus:
            await store.seed_corpus(corpus)
    finally:
        await store.close()
    return len(matrix)


async def seed_zoo(redis_url: str, prefix: str, zoo: Any) -> int:
    """:func:`seed_profiles` with everything a zoo carries: its acceptance matrix (prior weight 20),
    its domain lexicon and its lookup corpus."""
    return await seed_profiles(redis_url, prefix, zoo.acceptance, 20.0, lexicon=zoo.lexicon, corpus=zoo.lookup_corpus)


def measure_matrix(
    target: str, drafters: dict[str, str], prompts: dict[str, list[str]], k: int, new_tokens: int
) -> dict[str, dict[str, float]]:
    """Drafter x domain mean accepted draft tokens per round (greedy, chains of k) on real checkpoints."""
    from common.runtime.checkpoints import load_causal_lm, load_tokenizer, read_config
    from common.runtime.draft_vocab import load_draft_vocab
    from cosine_zoo import distill, evaluate

    tok = load_tokenizer(target)
    model = load_causal_lm(target)
    # a drafter with a reduced draft vocabulary speaks its own ids: map them like the runner does
    models = {
        name: (load_causal_lm(path), load_draft_vocab(path, read_config(path))) for name, path in drafters.items()
    }
    matrix: dict[str, dict[str, float]] = {name: {} for name in drafters}
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    for domain, texts in sorted(prompts.items()):
        ids = evaluate.encode_prompts(tok, texts)
        conts = evaluate.greedy_continuations(model, ids, new_tokens, tok.eos_token_id, pad)
        examples = [distill.Example(tuple(p), tuple(c)) for p, c in zip(ids, conts)]
        for name, (drafter, vocab) in models.items():
            stats = evaluate.acceptance(distill.draft_matches(drafter, vocab, examples), k)
            matrix[name][domain] = round(stats.mean_accepted, 4)
    return matrix


def read_prompts(path: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.setdefault(str(row["domain"]), []).append(str(row["text"]))
        except (ValueError, KeyError, TypeError):
            raise SystemExit(f'cosine profile: error: {path}:{n}: expected {{"domain": ..., "text": ...}}') from None
    return out


def read_corpus(path: str, tokenizer_path: str) -> dict[str, list[list[int]]]:
    """``cosine profile --corpus``'s file as domain -> token sequences (the target's tokenizer)."""
    from common.runtime.checkpoints import load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    return {domain: [list(tok(t).input_ids) for t in texts] for domain, texts in read_prompts(path).items()}


def cmd_profile(args: argparse.Namespace) -> int:
    url = args.redis_url or read_state().get("redis_url")
    if not url:
        print("cosine profile: error: no --redis-url and no running `cosine up` cluster", file=sys.stderr)
        return 2
    if args.measure:
        if not (args.target and args.drafter and args.prompts):
            print(
                "cosine profile: error: --measure needs --target, --drafter NAME=PATH and --prompts FILE",
                file=sys.stderr,
            )
            return 2
        drafters = dict(spec.partition("=")[::2] for spec in args.drafter)
        matrix = measure_matrix(args.target, drafters, read_prompts(args.prompts), args.k, args.new_tokens)
        source, lexicon, corpus = "measurement", None, None
        tokenizer = args.target
    else:
        zoo = load_zoo_or_exit(args.zoo)
        matrix = {d: dict(row) for d, row in zoo.acceptance.items()}
        source, lexicon, corpus = f"{args.zoo}/zoo.json", zoo.lexicon, zoo.lookup_corpus
        tokenizer = str(zoo.tokenizer_path)
    if args.corpus:
        corpus = read_corpus(args.corpus, tokenizer)
    for name, row in sorted(matrix.items()):
        print(f"{name:<16}" + "  ".join(f"{d}={v:.2f}" for d, v in sorted(row.items())))
    n = asyncio.run(
        seed_profiles(url, args.redis_prefix, matrix, args.prior_weight, args.reset, lexicon=lexicon, corpus=corpus)
    )
    print(
        f"seeded {n} drafter profile(s) from {source} into {url}"
        + (" with the zoo's domain lexicon" if lexicon else "")
        + (f"; lookup corpus of {sum(map(len, corpus.values()))} sequences" if corpus else "")
    )
    return 0
