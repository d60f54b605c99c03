"""`cosine`: the command line of the CoSine serving suite.

Subcommands register themselves through ``register(subparsers)`` functions; each module below
owns one group. Heavy imports (torch, transformers) happen inside the command, not at start-up,
so `cosine --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# module path -> imported lazily; each exposes register(subparsers)
COMMAND_MODULES = (
    "cosine_zoo.cli",
    "cosine_cli.commands",
    "cosine_cli.profiles",
    "cosine_cli.tls",
    "cosine_cli.chaos",
    "cosine_cli.kernels",
    "benchmarks.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cosine",
        description="CoSine: collaborative speculative inference serving. "
        "Small drafters propose, a large target verifies; the output is exactly the target's.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # that part of the suite is not installed
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
