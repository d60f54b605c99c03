"""Where the command line finds the local cluster and the default zoo: the state file that
`cosine up` writes, and the zoo loader every command shares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

STATE_FILE = Path(".cosine/cluster.json")
DEFAULT_ZOO = ".cosine/zoo-smol"


def read_state() -> dict[str, Any]:
    """What the running `cosine up` wrote about its cluster (addresses, metrics ports), else {}."""
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return {}


def load_zoo_or_exit(path: str) -> Any:
    """The zoo at ``path``, or exit with a line that says how to build one."""
    from common.runtime.checkpoints import CheckpointError
    from cosine_zoo.manifest import load_zoo

    try:
        return load_zoo(path)
    except CheckpointError as exc:
        raise SystemExit(
            f"cosine: error: {exc}\n  (build one with: cosine models build --profile smol --out {path})"
        ) from None
