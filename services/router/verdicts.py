"""Verdict application (no gRPC here): what a request's verdict from the verifier does to the
request and to everything that learns from it.

A verdict commits the accepted path and the target's next token; it credits the drafters whose
proposals were accepted (routing vector, per-drafter counters, the expertise-profile updates for
Redis), feeds the cost models (node calibration, draft gate, lookup calibration) and the request's
speculation length, and streams the new tokens to the submitter. A failed verdict either marks the
request for a re-prefill (the verifier lost it) or fails it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.logs import get_logger
from common.spec.fusion import DraftTree, credit
from common.spec.types import Verdict
from services.router.control import SpeculationControl
from services.router.gate import DraftGate
from services.router.lookup import CORPUS, LOOKUP_ID, LookupCalibration, LookupNodes, lookup_only, observe_lookup
from services.router.requests import FINISH_EOS, FINISH_LENGTH, Counters, Event, Request, RequestFailed
from services.router.resume import lost_by_verifier, mark_for_resume

log = get_logger("router")

# one profile update: (drafter, domain, accepted tokens, drafted depth)
ProfileUpdate = tuple[str, str, float, float]


@dataclass(frozen=True)
class Outcome:
    """How a request stands after its verdict: going on (both empty), finished, or failed."""

    finish_reason: str = ""
    error: RequestFailed | None = None

    @property
    def ends(self) -> bool:
        return bool(self.finish_reason) or self.error is not None


GOING_ON = Outcome()


class VerdictApplication:
    """Applies one request's verdict; the round collects the profile updates of its batch."""

    def __init__(
        self,
        control: SpeculationControl,
        gate: DraftGate,
        lookup_calibration: LookupCalibration,
        counters: Counters,
        metrics: Any = None,
    ) -> None:
        self.control = control
        self.gate = gate
        self.lookup_calibration = lookup_calibration
        self.counters = counters
        self.metrics = metrics  # services.router.metrics.RouterMetrics, or None

    def apply(
        self,
        r: Request,
        tree: DraftTree,
        selected: list[str],
        verdict: Verdict,
        updates: list[ProfileUpdate],
        round_ns: int,
        lookups: Sequence[LookupNodes] = (),
    ) -> Outcome:
        if not verdict.ok:
            if lost_by_verifier(verdict) and r.verifier_synced and mark_for_resume(r):
                log.info(
                    "verifier lost the request; re-prefilling its committed tokens",
                    request_id=r.request_id,
                    committed=len(r.sequence),
                )
                return GOING_ON
            return Outcome(error=RequestFailed(verdict.error, getattr(verdict, "error_kind", "") or "internal"))
        r.verifier_synced = True
        r.resumes = 0
        # the drafter models' own view of the round: the nodes only the lookup drafter proposed left out
        only = lookup_only(tree, lookups)
        model_accepted = sum(1 for n in verdict.accepted_nodes if n not in only)
        if len(tree) > len(only):
            self.control.observe_verdict(tree, verdict.accepted_nodes, skip=only, greedy=r.sampling.greedy)
        first = verdict.accepted_nodes[:1]
        self.gate.observe(r, bool(selected), len(tree) > len(only), bool(first) and first[0] not in only)
        if any(lookup.nodes for lookup in lookups):
            self._credit_lookup(r, tree, lookups, verdict)
        for s in verdict.step_lookups:  # the plain steps' lookup drafts calibrate as the router's own chains do
            self.lookup_calibration.observe_chain(r.sampling.greedy, s.match, s.tried, s.accepted, s.source)
        self._count(r, tree, verdict)
        credited = credit(tree, verdict.accepted_nodes)
        depth = tree.depth(without=only)
        for d in selected:
            self._credit_drafter(r, d, credited.get(d, 0), depth, updates)
        confidence = {d: mean_confidence(tree, d) for d in selected}
        r.routing.update(credited, confidence, selected, model_accepted, depth)
        r.spec.update(model_accepted, depth)
        return self._commit(r, tree, verdict, round_ns)

    def _credit_lookup(self, r: Request, tree: DraftTree, lookups: Sequence[LookupNodes], verdict: Verdict) -> None:
        """Calibrate each lookup chain by its source, and credit the lookup drafter once per node
        (a node both chains proposed counts once)."""
        proposed: set[int] = set()
        accepted: set[int] = set()
        for lookup in lookups:
            got = observe_lookup(self.lookup_calibration, tree, lookup, verdict.accepted_nodes)
            proposed.update(lookup.nodes)
            accepted.update(lookup.nodes[:got])
            if lookup.source == CORPUS:
                self.counters.corpus_tokens += len(lookup.nodes)
                self.counters.corpus_accepted += got
        self.counters.lookup_tokens += len(proposed)
        self.counters.lookup_accepted += len(accepted)
        r.stats.credit(LOOKUP_ID, len(accepted))

    def _count(self, r: Request, tree: DraftTree, verdict: Verdict) -> None:
        # the tree's nodes, and what the verifier drafted at the plain steps (VerifyItem.step_lookup):
        # the lookup drafter's proposals too, so they count as drafted and accepted tokens like any
        accepted = len(verdict.accepted_nodes) + verdict.step_accepted
        drafted = len(tree) + verdict.step_drafted
        r.stats.rounds += 1 + verdict.step_passes  # the verify passes it was in: its plain steps' too
        self.counters.step_lookup_tokens += verdict.step_drafted
        self.counters.step_lookup_accepted += verdict.step_accepted
        self.counters.grammar_pruned += verdict.grammar_pruned
        r.stats.grammar_pruned_tokens += verdict.grammar_pruned
        if verdict.step_drafted:
            r.stats.credit(LOOKUP_ID, verdict.step_accepted)
        r.stats.draft_tokens += drafted
        r.stats.accepted_tokens += accepted
        self.counters.draft_tokens += drafted
        self.counters.accepted_tokens += accepted

    def _credit_drafter(self, r: Request, d: str, got: int, depth: int, updates: list[ProfileUpdate]) -> None:
        r.stats.credit(d, got)
        stats = self.counters.by_drafter.setdefault(d, [0.0, 0.0])
        stats[0] += 1
        stats[1] += got
        if r.domain:
            updates.append((d, r.domain, float(got), float(depth)))

    def _commit(self, r: Request, tree: DraftTree, verdict: Verdict, round_ns: int) -> Outcome:
        """Append the verdict's new tokens up to a stop token or the length limit and stream them,
        their log-probabilities (when asked) cut at the same token."""
        new: list[int] = []
        reason = ""
        for tok in verdict.new_tokens:
            new.append(int(tok))
            if tok in r.stop_ids:
                reason = FINISH_EOS
                break
            if len(r.generated) + len(new) >= r.max_new_tokens:
                reason = FINISH_LENGTH
                break
        r.generated.extend(new)
        self.counters.tokens_committed += len(new)
        if self.metrics is not None:
            self.metrics.verdict(tree, verdict.accepted_nodes, len(new), verdict.grammar_pruned)
        r.events.put_nowait(Event(tokens=tuple(new), logprobs=verdict.logprobs[: len(new)], round_ns=round_ns))
        return Outcome(finish_reason=reason) if reason else GOING_ON


def mean_confidence(tree: DraftTree, drafter: str) -> float:
    """The mean probability ``drafter`` gave the nodes it proposed as its top choice."""
    probs = [p for p, top in zip(tree.probs, tree.top1) if drafter in top]
    return sum(probs) / len(probs) if probs else 0.0
