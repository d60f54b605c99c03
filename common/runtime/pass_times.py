"""The verify pass's seconds by rows, timed once when the target is loaded.

The router keeps a drafted node only when its expected tokens repay what its row adds to the pass
(``services/router/pass_plan.py``), and it learns the pass time by rows from the passes it runs. It
learns only the sizes it runs, though, and a pass's time is not smooth in its rows: the CPU kernels
take rows a tile at a time, so one row past a tile costs a whole tile (on an AVX-512 CPU, whose
kernels take eight rows a tile, a ninth row costs several times what the eighth did). A size it
never ran was priced by a line between the sizes around it, which missed such a step: the first
drafted rows beyond a full tile looked a third as dear as they are. On a GPU the curve is flat for
hundreds of rows, then rises.

:func:`measure_pass_times` times a pass of one request with a chain of ``rows`` tokens on a short
cache, for every row count up to 20 and a few beyond, the counts interleaved over two tries and
the faster kept (a neighbour that is busy for a moment slows one try, not the curve's shape). The
verifier reports the curve in its ``Info`` (``ModelInfo.pass_rows`` / ``pass_seconds``); the router
takes its shape and the level of its own recent passes (``PassCurve.set_prior``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from common.logs import get_logger
from common.runtime.runner import LMRunner, SeqInput

log = get_logger(__name__)

PASS_ROWS = (*range(1, 21), 24, 28, 32, 40, 48, 64, 96)  # row counts timed (the router extrapolates beyond)
CONTEXT = 64  # cached tokens under the timed chain
TRIES = 2  # each row count's time is the faster of this many passes


def measure_pass_times(
    runner: LMRunner, rows: Sequence[int] = PASS_ROWS, context: int = CONTEXT, tries: int = TRIES
) -> tuple[tuple[int, float], ...]:
    """(rows, seconds) of a pass of one request with a chain of ``rows`` tokens (see the module doc)."""
    rows = sorted({r for r in rows if 0 < r})
    if not rows:
        return ()
    context = max(1, min(context, runner.max_context - rows[-1]))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, runner.vocab_size, (context + rows[-1],), generator=gen).tolist()
    pool = runner.new_pool(None)
    cache = pool.new_cache()
    cache.reserve(context + rows[-1])
    runner.forward([SeqInput(cache, tuple(ids[:context]))])
    cache.commit(context)
    best = {r: float("inf") for r in rows}
    t_start = time.perf_counter()
    try:
        for _ in range(max(1, tries)):
            for r in rows:
                seq = SeqInput(cache, tuple(ids[context : context + r]), None, tuple(range(r)))
                t0 = time.perf_counter()
                runner.forward([seq])
                if runner.device.type == "cuda":
                    torch.cuda.synchronize(runner.device)
                best[r] = min(best[r], time.perf_counter() - t0)
                cache.discard_pending()
    finally:
        cache.release()
    out = tuple((r, best[r]) for r in rows)
    log.info(
        "verify pass timed by rows",
        seconds=round(time.perf_counter() - t_start, 2),
        ms={r: round(1e3 * s, 1) for r, s in out if r in (1, 2, 4, 8, 9, 16, 17, 32, rows[-1])},
    )
    return out
