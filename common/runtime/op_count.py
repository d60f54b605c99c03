"""How many tensor operations a piece of work runs: the ``aten::`` operators torch's profiler
records (nested ones included), on whatever device runs them.

Why count: on a GPU every operation that touches data is at least one kernel launch, so a pass whose
count grows with the batch is launch-bound at large batches and cannot be replayed from one CUDA
graph. A count that is the same at batch 1, 8 and 32 is the structural property the paged path
promises, and it can be checked on a CPU. Views (:data:`VIEW_OPS`: a new shape or offset over the
same storage, no data touched, no kernel) are left out of :func:`kernel_ops`: a pass hands back one
logits view per sequence, which is the API, not work.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from torch.profiler import ProfilerActivity, profile

from common.runtime.cpu_linear import one_kernel

VIEW_OPS = frozenset(
    "aten::" + name
    for name in (
        "as_strided",
        "view",
        "_unsafe_view",
        "reshape",
        "slice",
        "select",
        "narrow",
        "split",
        "split_with_sizes",
        "unsqueeze",
        "squeeze",
        "transpose",
        "t",
        "expand",
        "permute",
        "alias",
        "unbind",
    )
)


def aten_ops(fn: Callable[[], object]) -> Counter[str]:
    """Run ``fn`` once under the profiler; the number of calls of each ``aten::`` operator."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def kernel_ops(counts: Counter[str]) -> int:
    """The calls of ``counts`` that are not views."""
    return sum(n for name, n in counts.items() if name not in VIEW_OPS)


def forward_ops(runner: Any, seqs: Sequence[Any]) -> int:
    """Kernel operations (views left out) of one ``runner.forward(seqs)``, room reserved before
    and the pending entries discarded after (the caches end as they began). One warm-up pass runs
    first, so that state built lazily on a first call is not counted. The CPU projections keep one
    kernel whatever the row count (:func:`~common.runtime.cpu_linear.one_kernel`): their choice by
    row count is the CPU's, not work per sequence."""

    def one_pass() -> None:
        for s in seqs:
            s.cache.reserve(len(s.token_ids))
        runner.forward(seqs)
        for s in seqs:
            s.cache.discard_pending()

    products = [m for p in runner.products or () for m in (p.qkv.linear, p.gate_up.linear)]
    with one_kernel([*runner.model.modules(), *products]):
        one_pass()
        return kernel_ops(aten_ops(one_pass))
