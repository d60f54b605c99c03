"""`cosine models build|eval`: build the model zoo and show its acceptance matrix."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from cosine_zoo.profiles import PROFILES


def register(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser("models", help="build and inspect the model zoo (target + drafters)")
    sub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    build = sub.add_parser("build", help="build a zoo: corpus, tokenizer, target, drafters, evaluation")
    build.add_argument("--profile", choices=sorted(PROFILES), default="default",
                       help="tiny: seconds (tests); default: <= 8 min on 2 CPU cores; gpu: larger, on CUDA")
    build.add_argument("--out", type=Path, required=True, help="zoo directory to write")
    build.add_argument("--seed", type=int, default=0, help="seed of corpus, initialisation and data order")
    build.add_argument("--force", action="store_true", help="rebuild everything, even stages already done")
    build.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    build.add_argument("--quiet", action="store_true", help="no progress bars")
    build.set_defaults(func=cmd_build)

    ev = sub.add_parser("eval", help="print a zoo's acceptance matrix and target perplexity")
    ev.add_argument("zoo", type=Path, help="zoo directory")
    ev.set_defaults(func=cmd_eval)


def cmd_build(args: argparse.Namespace) -> int:
    from common.checkpoints import CheckpointError
    from common.logs import configure_logging
    from cosine_zoo.build import BuildOptions, build_zoo
    from cosine_zoo.profiles import get_profile

    configure_logging("info")
    opts = BuildOptions(out=args.out, profile=get_profile(args.profile), seed=args.seed, force=args.force,
                        progress=not args.quiet, threads=args.threads)
    try:
        zoo = build_zoo(opts)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print_report(zoo.manifest, sys.stdout)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from common.logs import configure_logging
    from cosine_zoo.manifest import ZooError, load_zoo

    configure_logging("warning")
    try:
        zoo = load_zoo(args.zoo)
    except ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print_report(zoo.manifest, sys.stdout)
    return 0


def print_report(manifest: Mapping, out: TextIO) -> None:
    ev = manifest["evaluation"]
    out.write(f"zoo profile={manifest['profile']} seed={manifest['seed']} "
              f"target params={manifest['target']['params']:,}\n\n")
    out.write(f"Acceptance: mean accepted draft tokens per round (greedy, k={ev['k']}, "
              f"{ev['prompts_per_domain']} held-out prompts x {ev['new_tokens']} new tokens per domain)\n\n")
    out.write(format_matrix(ev["acceptance"], manifest["domains"], manifest["drafters"]) + "\n\n")
    out.write("Target perplexity (held-out)\n\n")
    out.write(format_table(["domain", "perplexity"], [[d, f"{v:.2f}"] for d, v in ev["target_perplexity"].items()]) + "\n")


def format_matrix(matrix: Mapping[str, Mapping[str, float]], domains: list[str], drafters: Mapping) -> str:
    header = ["drafter", "params", *domains]
    rows = [[name, f"{drafters[name]['params']:,}", *(f"{matrix[name][d]:.2f}" for d in domains)] for name in matrix]
    return format_table(header, rows)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (readable as text, pasteable into the README)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in rows)])
