"""`cosine kernels build`: the project's C++ CPU kernels built and cached ahead of the first request.

The services build the kernels themselves the first time a process asks for them, so a machine set
up without this command still serves; building at setup only moves the compile out of a request's
way. Where the kernels cannot be had (no AVX-512 or AVX2, no C++ compiler, no ninja, a failed build)
the command prints one line saying so and why, and exits 0: the services then use torch's kernels.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    kernels = sub.add_parser(
        "kernels",
        help="the project's C++ CPU kernels (attention and projections)",
        description="Build the project's C++ CPU kernels for this machine's CPU and cache "
        "them, so that no request waits for the compiler.",
    )
    what = kernels.add_subparsers(dest="kernels_command", metavar="ACTION", required=True)
    build = what.add_parser(
        "build",
        help="build and cache the kernels for this CPU (only loads a cached build)",
        description="Build the kernels for this CPU into the cache (COSINE_CACHE_DIR, else "
        "~/.cache/cosine), check them against torch, and say for which instruction set; "
        "where they cannot be built, say why. Exits 0 either way unless --require.",
    )
    build.add_argument(
        "--require",
        action="store_true",
        help="exit 1 when the kernels are left out (for an image build that must have them)",
    )
    build.set_defaults(func=cmd_build)


def cmd_build(args: argparse.Namespace) -> int:
    from common.logs import configure_logging
    from common.runtime import streamed_linear

    configure_logging(level="warning")  # the one line below says what happened; a failed build's detail is a warning
    if streamed_linear.unavailable_reason() is None and not streamed_linear.is_cached():
        print("building the project's CPU kernels for this CPU (later runs load the cached build)...", flush=True)
    result = streamed_linear.build_kernels()
    print(streamed_linear.describe(result), flush=True)
    return 1 if args.require and result.module is None else 0
