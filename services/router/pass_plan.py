"""Which drafted nodes go into a verify pass: those that repay their rows for every request of the pass.

A verify pass's time is not linear in its rows, and its shape depends on the target's hardware
and kernels. On a CPU the pass is bound by reading the weights: with the runner's few-row kernels
(``common/runtime/cpu_linear.py``) a pass costs about the same for one row and two, then rises in
steps where the kernels start a new tile of rows (with torch's plain ``linear`` it was uneven, and
the first drafted row the dearest); on a GPU a pass is flat up to a few hundred rows. A line through
such passes (``CostModel``) misprices both ends.

:class:`PassCurve` keeps the measured pass time by rows instead (one running mean per bin of rows,
interpolated between bins, extrapolated with the fitted line beyond the largest measured pass, so
a larger tree is tried and then measured; passes that prefill a prompt stay out of it). A line
between two bins misses a step between them, though (the CPU kernels take rows a tile at a time),
and the bins measured are those the plan keeps. So where the verifier timed its pass by rows when
it loaded the target (``common/runtime/pass_times.py``), that curve gives the shape between and
beyond the bins, and the bins its level (:meth:`PassCurve.predict`); the plan then prices rows from
the first round on.
:func:`choose_nodes` then keeps the drafted nodes of the whole batch that maximise

    sum over the batch's requests of log(1 + expected accepted tokens of the request)
        - requests in the batch * log(pass time(plain rows + kept nodes))

that is, the geometric mean of the requests' progress per second (proportional fairness). With one
request this is its tokens per second; in a batch, a node's row delays every request of the pass,
so it is kept only when its tokens repay that delay for all of them, not only for its own request
(the throughput of the pass alone would let a few repetitive requests slow down everyone else).
A round costs more than its pass, though: the round trip around it (the reply, the router's work
on it, the next request) leaves the verifier idle, and a round that drafts nothing may have the
verifier decode a few plain steps back to back before it answers (``scheduler.plain_steps``),
paying that round trip once for all of them. A drafted node forfeits those steps. So, given the
round's measured overhead ``o`` and the ``s`` plain steps the round would take without drafts, the
rounds compared are: drafted, progress ``1 + expected tokens`` for each request in ``pass time + o``;
plain, ``s`` tokens for each request in ``s * plain pass time + o``. With ``s`` = 1 and ``o`` = 0 this
is the objective above. Through the services on one machine a round trip is a small fraction of a
pass, so rounds go plain where their drafted rows are near break-even; the larger the round trip (a
verifier across a network), the more a round of plain steps is worth.
Nodes are taken greedily, the one adding the most to its request's log progress first, and the
count with the best objective is kept. A node's expected tokens are the product of its calibrated
acceptance rates along its path, and a node is only taken after its parent, so the kept nodes are
whole subtrees. Dropping nodes only changes which proposals are verified, never what is accepted:
lossless.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from common.spec.fusion import DraftTree
from services.router.lookup import LOOKUP_ID, LookupNodes

EXACT_ROWS = 8  # passes of up to this many rows have a bin each; larger ones share power-of-two bins


def _bin(rows: int) -> int:
    if rows <= EXACT_ROWS:
        return rows
    return 1 << (rows - 1).bit_length()


STALE_AFTER = 16  # passes after which a bin that was not measured again no longer counts (PassCurve)


@dataclass
class PassCurve:
    """Verify pass seconds by rows in the pass, measured (see the module docstring).

    A bin counts while it was measured within the last ``stale_after`` passes. The pass plan keeps
    only the rows the curve says pay, so a bin measured in a slow moment would never be measured
    again and would keep its rows (and, the curve never falling, every larger pass) out of every
    plan: at a fresh router, passes several times slower for its first seconds left the few-row bins
    far above their true cost, and one request after another decoded far fewer tokens a pass than it
    could. Once stale, a bin's rows
    are priced by the bins around it (or the fitted line beyond them), so the plan tries them again,
    and its next pass starts it afresh.

    Sixteen passes, not more: a workload of four clients is about a hundred rounds, and with a longer
    window a slow first drafted pass kept most drafted rows out of the plan for most of the workload.
    A bin that truly costs what it measured is tried again every sixteen passes at most, which costs
    nothing measurable where the plan avoids those rows for what they really cost.
    """

    smoothing: float = 0.2
    stale_after: int = STALE_AFTER
    _points: dict[int, list[float]] = field(default_factory=dict)  # bin -> [mean rows, mean seconds, its latest pass]
    _passes: int = 0  # passes observed
    _prior_rows: tuple[float, ...] = ()  # the verifier's pass times by rows, timed at load: rows ascending
    _prior_seconds: tuple[float, ...] = ()  # and their seconds, never falling
    # the measured bins as predict reads them, (rows, seconds or measured over prior seconds), until
    # the next pass or prior: the router prices every request's first node and every tree's nodes on
    # it, dozens of predictions a round that would otherwise each sort and rescale every bin
    _table: tuple[list[float], list[float]] | None = field(default=None, repr=False)

    def set_prior(self, points: Sequence[tuple[int, float]]) -> None:
        """The verifier's own pass times by rows (``common/runtime/pass_times.py``): the curve's
        shape between and beyond the bins measured here, scaled to their level (see :meth:`predict`)."""
        xs: list[float] = []
        ys: list[float] = []
        for rows, seconds in sorted((float(r), float(s)) for r, s in points if r > 0 and s > 0):
            if xs and rows == xs[-1]:
                continue
            xs.append(rows)
            ys.append(max(seconds, ys[-1]) if ys else seconds)
        self._prior_rows, self._prior_seconds = tuple(xs), tuple(ys)
        self._table = None

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        self._passes += 1
        self._table = None
        point = self._points.get(_bin(rows))
        if point is None or self._stale(point):
            self._points[_bin(rows)] = [float(rows), seconds, self._passes]
            return
        a = self.smoothing
        point[0] = (1 - a) * point[0] + a * rows
        point[1] = (1 - a) * point[1] + a * seconds
        point[2] = self._passes

    def _stale(self, point: list[float]) -> bool:
        return self._passes - point[2] > self.stale_after

    def predict(self, rows: int, slope: float) -> float | None:
        """Seconds of a pass of ``rows`` rows; ``slope``: seconds per row beyond the measured
        passes (the fitted line's). None before any pass was measured and without a prior.

        With a prior (:meth:`set_prior`), its time at ``rows`` scaled by the measured over prior
        time of the bins here (interpolated between the bins around ``rows``, the nearest one's
        beyond them; 1 before any): a step of the prior between two measured bins, or beyond
        them, stays a step."""
        if self._table is None:
            self._table = self._measured()
        xs, ys = self._table
        if not xs:
            return self._prior_at(rows) if self._prior_rows else None
        if self._prior_rows:  # ys: the measured over the prior's seconds
            return self._prior_at(rows) * _interpolate(xs, ys, rows)
        if rows <= xs[0]:
            return max(0.0, ys[0] - slope * (xs[0] - rows))
        if rows <= xs[-1]:
            return _interpolate(xs, ys, rows)
        return ys[-1] + slope * (rows - xs[-1])

    def _measured(self) -> tuple[list[float], list[float]]:
        """The bins that count, rows ascending, with their seconds never falling as rows grow (noise
        aside, a larger pass is not quicker); with a prior, those seconds over the prior's."""
        points = sorted((x, y) for x, y, _ in (p for p in self._points.values() if not self._stale(p)))
        xs: list[float] = []
        ys: list[float] = []
        for x, y in points:
            xs.append(x)
            ys.append(max(y, ys[-1]) if ys else y)
        if self._prior_rows:
            ys = [y / self._prior_at(x) for x, y in zip(xs, ys)]
        return xs, ys

    def _prior_at(self, rows: float) -> float:
        """The prior's seconds at ``rows``: linear between its points, its last segment's slope
        beyond the last one (its first point's time below the first)."""
        xs, ys = self._prior_rows, self._prior_seconds
        if rows > xs[-1] and len(xs) > 1:
            return ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (rows - xs[-1])
        return _interpolate(xs, ys, rows)


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys), xs ascending; the end values beyond the ends."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1]) if xs[i] > xs[i - 1] else 1.0
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return ys[-1]


def node_values(tree: DraftTree, rate: Callable[[float], float], lookup_rates: Mapping[int, float]) -> list[float]:
    """Expected tokens of every node: the product of acceptance rates along its path. A drafter
    node's rate is its calibrated confidence; a lookup node's its own calibrated rate (the higher
    one where both proposed it)."""
    only_lookup = 1 << tree.drafter_ids.index(LOOKUP_ID) if lookup_rates else -1
    values: list[float] = []
    for i, (parent, prob) in enumerate(zip(tree.parents, tree.probs)):
        r = rate(prob)
        if i in lookup_rates:
            r = lookup_rates[i] if tree.source_masks[i] == only_lookup else max(r, lookup_rates[i])
        values.append((1.0 if parent < 0 else values[parent]) * r)
    return values


def choose_nodes(
    values: Mapping[str, Sequence[float]],
    parents: Mapping[str, Sequence[int]],
    plain_rows: int,
    seconds: Callable[[int], float | None],
    overhead_s: float = 0.0,
    plain_steps: int = 1,
) -> dict[str, set[int]]:
    """The nodes of each request to verify (see the module docstring): taken one at a time, the one
    that raises its request's expected progress the most (in log terms) first, while their parents
    are in; the count kept is the one with the best objective, against a plain round of
    ``plain_steps`` steps, each round paying ``overhead_s`` beside its passes. All of them while the
    pass time cannot be predicted yet."""
    every = {rid: set(range(len(vals))) for rid, vals in values.items()}
    batch = len(values)
    base = seconds(plain_rows)
    if base is None or base <= 0 or batch == 0:
        return every
    overhead_s, plain_steps = max(0.0, overhead_s), max(1, plain_steps)
    children: dict[tuple[str, int], list[int]] = {}
    heap: list[tuple[float, str, int]] = []
    for rid, ps in parents.items():
        for i, p in enumerate(ps):
            if p < 0:
                heapq.heappush(heap, (-math.log1p(values[rid][i]), rid, i))
            else:
                children.setdefault((rid, p), []).append(i)
    progress = {rid: 0.0 for rid in values}  # expected accepted tokens of each request so far
    log_gain, taken = 0.0, []
    best_n, best = 0, batch * (math.log(plain_steps) - math.log(plain_steps * base + overhead_s))
    while heap:
        neg, rid, i = heapq.heappop(heap)
        gain = math.log1p(progress[rid] + values[rid][i]) - math.log1p(progress[rid])
        if gain < -neg - 1e-12:  # its request gained since this was queued: requeue at its real gain
            heapq.heappush(heap, (-gain, rid, i))
            continue
        progress[rid] += values[rid][i]
        log_gain += gain
        taken.append((rid, i))
        for c in children.get((rid, i), ()):
            heapq.heappush(heap, (-(math.log1p(progress[rid] + values[rid][c]) - math.log1p(progress[rid])), rid, c))
        t = seconds(plain_rows + len(taken))
        if t is not None and t > 0 and log_gain - batch * math.log(t + overhead_s) > best:
            best_n, best = len(taken), log_gain - batch * math.log(t + overhead_s)
    keep: dict[str, set[int]] = {rid: set() for rid in values}
    for rid, i in taken[:best_n]:
        keep[rid].add(i)
    return keep


def keep_nodes(
    tree: DraftTree, keep: set[int], lookups: Sequence[LookupNodes]
) -> tuple[DraftTree, tuple[LookupNodes, ...]]:
    """The tree with only ``keep`` (parent-closed), and its lookup chains renumbered."""
    if len(keep) == len(tree):
        return tree, tuple(lookups)
    out, index = tree.subtree(keep)
    cut = []
    for lookup in lookups:
        kept = []
        for n in lookup.nodes:  # a path: cut where the first node was dropped
            if n not in index:
                break
            kept.append(index[n])
        cut.append(lookup.cut(kept))
    return out, tuple(cut)


def plan_pass(
    trees: dict[str, DraftTree],
    lookups: Mapping[str, Sequence[LookupNodes]],
    plain_rows: int,
    rates: Mapping[str, Callable[[float], float]],
    seconds: Callable[[int], float | None],
    overhead_s: float = 0.0,
    plain_steps: int = 1,
) -> tuple[dict[str, DraftTree], dict[str, tuple[LookupNodes, ...]]]:
    """The batch's trees cut to the nodes that pay on the pass-time curve (see the module
    docstring). ``plain_rows``: rows of the pass without any drafted node (a row per request plus
    the prompts being prefilled). ``lookups``: each request's lookup chains. ``rates``: each
    request's P(accept | confidence) of its drafter nodes (greedy and sampled requests differ).
    ``overhead_s``: a round's time beside its passes; ``plain_steps``: the steps the round would
    decode if it drafted nothing (see the module docstring)."""
    values, parents = {}, {}
    for rid, tree in trees.items():
        lookup_rates: dict[int, float] = {}
        for lookup in lookups.get(rid, ()):
            for node, r in zip(lookup.nodes, lookup.rates):
                lookup_rates[node] = max(r, lookup_rates.get(node, 0.0))  # a node both chains proposed: the surer one
        values[rid] = node_values(tree, rates[rid], lookup_rates)
        parents[rid] = tree.parents
    keep = choose_nodes(values, parents, plain_rows, seconds, overhead_s, plain_steps)
    out_trees, out_lookups = {}, {}
    for rid, tree in trees.items():
        out_trees[rid], out_lookups[rid] = keep_nodes(tree, keep[rid], lookups.get(rid, ()))
    return out_trees, out_lookups
