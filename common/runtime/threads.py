"""Process-level runtime settings for model-serving processes."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$COSINE_CACHE_DIR`` or ``~/.cache/cosine``: what is made once per machine and kept
    (fetched wheels and imported checkpoints, built CPU kernels)."""
    return Path(os.environ.get("COSINE_CACHE_DIR") or Path.home() / ".cache" / "cosine")


def configure_torch_threads(requested: int) -> int:
    """Set torch's intra-op threads: ``requested`` when > 0, else the cores this process may use.
    Returns the number set. Called once at start-up by the drafter and verifier."""
    import torch

    if requested > 0:
        threads = requested
    else:
        try:
            threads = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            threads = os.cpu_count() or 1
    torch.set_num_threads(max(1, threads))
    # Small models on CPU can slow down ~100x on denormal floats (|x| < 1.2e-38 in fp32).
    # Flushing them to zero moves activations by less than that, far below any logit gap that
    # decides a token; the cluster tests compare against unflushed transformers decoding.
    torch.set_flush_denormal(True)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (a second engine in the same process)
        pass
    return torch.get_num_threads()
