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
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

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
