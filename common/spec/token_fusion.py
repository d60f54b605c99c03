"""Token fusion's step loop, wherever it runs (no gRPC here).

Token fusion (see ``fusion.py``) takes k draft steps per round: at each step every selected drafter
of a request proposes its top-n, the routing-weighted best becomes the next node of the request's
tree and is appended by all of them, the runners-up become siblings. Each step needs every
drafter's answer before the next can start, so when the router drives the loop a round costs k
message round trips to the drafter processes.

:class:`TokenFusion` is that loop as a state machine: :meth:`TokenFusion.step` says what each
drafter must run next, :meth:`TokenFusion.take` takes their answers. The router drives it over the
network when a request's drafters live in different processes; a drafter process that hosts every
selected drafter of a request drives it locally (``services/drafter/server.py``), and the round
costs one message. Both run this same code with the same inputs, so a tree does not depend on
where it was fused.

What the router's cost control says about nodes and steps travels with the round as a
:class:`StepPricing` snapshot (taken when the round starts): a node is kept only while its
expected acceptance repays its verify row, and one more step is taken only while the expected
tokens it can add repay the drafters' step time and the rows (see ``services/router/control.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from common.spec.fusion import DraftTree, Proposal, fuse
from common.spec.types import DraftItem, DraftResult


def match_draft_results(request_ids: Sequence[str], results: Sequence[DraftResult] | None) -> list[DraftResult | None]:
    """The drafter's answer for each request id in order (None where it gave none). Results
    without ids (older drafters) fall back to position when the counts agree."""
    if results is None:
        return [None] * len(request_ids)
    by_id = {r.request_id: r for r in results if r.request_id}
    if not by_id and len(results) == len(request_ids):
        return list(results)
    return [by_id.get(rid) for rid in request_ids]


def confidence_bin(confidence: float, bins: int) -> int:
    """The bin of ``confidence`` among ``bins`` equal bins of [0, 1] (clamped)."""
    return min(bins - 1, max(0, int(min(1.0, max(0.0, confidence)) * bins)))


@dataclass(frozen=True)
class StepPricing:
    """The cost control's word on nodes and steps for one round (a snapshot; see the module doc).

    ``calibration``: P(accept) by confidence, in equal bins of [0, 1] (empty: the confidence itself).
    A node of value ``parent * cal(confidence)`` is kept when it is at least ``threshold``; one more
    step is taken while the next nodes' values add up to ``step_tokens + row_tokens * nodes``.
    Unpriced: every step up to the request's speculation length, every candidate up to the width."""

    priced: bool = False
    threshold: float = 0.0
    calibration: tuple[float, ...] = ()
    step_tokens: float = 0.0
    row_tokens: float = 0.0

    def node_value(self, parent_value: float, confidence: float) -> float:
        if not self.calibration:
            return parent_value * confidence
        return parent_value * self.calibration[confidence_bin(confidence, len(self.calibration))]

    def keeps(self, value: float) -> bool:
        return not self.priced or value >= self.threshold

    def worth_a_step(self, next_values: Sequence[float]) -> bool:
        return not self.priced or sum(next_values) >= self.step_tokens + self.row_tokens * len(next_values)


@dataclass(frozen=True)
class FusionSource:
    """One selected drafter of a request: its routing weight and the item that brings its cache to
    the committed sequence (``cache_len`` tokens) and proposes the first position."""

    drafter_id: str
    weight: float
    first: DraftItem
    cache_len: int


@dataclass(frozen=True)
class FusionRequest:
    request_id: str
    steps: int  # speculation length: at most this many fused steps
    sources: tuple[FusionSource, ...]


@dataclass
class FusionOutcome:
    """A request's round: its tree, the fused chain, each surviving drafter's cache length (it holds
    the committed sequence plus ``cache_len - committed`` fused tokens), and the drafters that failed."""

    tree: DraftTree
    fused: list[int] = field(default_factory=list)
    cache_len: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


class TokenFusion:
    """The k-step loop of token fusion over a batch of requests (see the module doc)."""

    def __init__(self, requests: Sequence[FusionRequest], width: int, pricing: StepPricing) -> None:
        self.width = max(1, width)
        self.pricing = pricing
        self.requests = {r.request_id: r for r in requests}
        self.weights = {r.request_id: {s.drafter_id: s.weight for s in r.sources} for r in requests}
        self.outcomes = {
            r.request_id: FusionOutcome(DraftTree(drafter_ids=[s.drafter_id for s in r.sources])) for r in requests
        }
        self.active = {rid for rid, r in self.requests.items() if r.sources and r.steps > 0}
        self.tips = {rid: -1 for rid in self.requests}
        self.values = {rid: 1.0 for rid in self.requests}  # expected acceptance of each fused tip
        self.taken = 0  # steps answered so far
        self._sent: dict[str, list[str]] = {}  # drafter -> request ids of the step in flight

    def step(self) -> dict[str, list[DraftItem]]:
        """The next step's items per drafter (empty when the loop is done)."""
        calls: dict[str, list[DraftItem]] = {}
        self._sent = {}
        for rid in sorted(self.active):
            out = self.outcomes[rid]
            for s in self.requests[rid].sources:
                if s.drafter_id not in out.cache_len and self.taken > 0:
                    continue  # failed earlier
                if self.taken == 0:
                    item = replace(s.first, request_id=rid, top_n=self.width)
                    out.cache_len[s.drafter_id] = s.cache_len
                else:
                    item = DraftItem(request_id=rid, append_ids=(out.fused[-1],), top_n=self.width)
                    out.cache_len[s.drafter_id] += 1
                calls.setdefault(s.drafter_id, []).append(item)
                self._sent.setdefault(s.drafter_id, []).append(rid)
        return calls

    def take(self, answers: Mapping[str, Sequence[DraftResult] | None]) -> None:
        """The drafters' answers to the last :meth:`step` (None: that drafter failed)."""
        proposals: dict[str, list[Proposal]] = {rid: [] for rid in self.active}
        for d, rids in self._sent.items():
            for rid, res in zip(rids, match_draft_results(rids, answers.get(d))):
                out = self.outcomes[rid]
                if res is not None and res.ok and res.token_ids and res.cache_len in (0, out.cache_len.get(d, -1)):
                    proposals[rid].append(Proposal(d, tuple(res.token_ids), tuple(res.probs)))
                else:  # the drafter failed for this request: it leaves the request's round
                    out.cache_len.pop(d, None)
                    out.failed[d] = (
                        res.error
                        if res is not None and res.error
                        else "no answer"
                        if res is None
                        else "unexpected cache length"
                    )
        self.taken += 1
        next_values = []
        for rid in sorted(self.active):
            out, live = self.outcomes[rid], self.outcomes[rid].cache_len
            ranked = fuse(proposals[rid], {d: w for d, w in self.weights[rid].items() if d in live})
            # a node is verified only when its expected tokens repay its verify row
            kept = [
                c
                for c in ranked[: self.width]
                if self.pricing.keeps(self.pricing.node_value(self.values[rid], c.score))
            ]
            if not kept or kept[0] is not ranked[0]:
                self.active.discard(rid)
                for c in kept:  # the fused token does not pay but a runner-up does: the runners-up as leaves
                    out.tree.add(self.tips[rid], c.token, c.score, c.sources, c.top1)
                continue
            self.tips[rid] = out.tree.add_fused_step(self.tips[rid], kept, len(kept))
            self.values[rid] = self.pricing.node_value(self.values[rid], ranked[0].score)
            out.fused.append(ranked[0].token)
            if self.taken >= self.requests[rid].steps or not live:
                self.active.discard(rid)
            else:
                next_values.append(self.values[rid])
        if self.active and not self.pricing.worth_a_step(next_values):
            self.active.clear()

    @property
    def done(self) -> bool:
        return not self.active
