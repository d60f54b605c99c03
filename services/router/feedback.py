"""What a round teaches the router once its verdicts are applied (no gRPC here): the pass-time
curve, the round's draft and verify times, the overhead beside its passes, what the extra
drafters brought, the counters, the metrics and the round's debug line; and the yield guard's
verdicts to the counters and the metrics.

A part of :class:`services.router.core.RouterCore` (a base of it, as ``pool.py`` and ``ahead.py``
are), kept apart so that the round itself reads as its steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.logs import get_logger
from common.spec.fusion import DraftTree
from common.spec.types import Verdict, VerifyItem
from services.router.ahead import OffPathDrafting
from services.router.drafting import extras_gain, extras_seconds
from services.router.requests import Request
from services.router.yield_guard import Level, LevelRecord

log = get_logger("router")


@dataclass(frozen=True)
class RoundFacts:
    """What one round did, for :meth:`RoundFeedback._measure`."""

    batch: list[Request]
    items: list[VerifyItem]
    verdicts: dict[str, Verdict]  # by request id
    committed: int  # tokens the round committed, plain steps included
    busy_s: float  # the verifier's busy time for it
    times: tuple[float, float, float]  # the round's start, the end of its drafting, the verdicts' arrival
    plain: bool  # the yield guard's plain arm
    waited: bool  # a drafter model was asked, and the round waited for it
    beside: bool  # drafter work off the path ran beside its pass
    drafted_ahead: int
    routed_ahead: int
    probes: int


class RoundFeedback(OffPathDrafting):
    """The feedback part of :class:`services.router.core.RouterCore`, which sets its attributes."""

    metrics: Any

    def _measure(self, f: RoundFacts) -> None:
        t0, t1, t2 = f.times
        rows = sum(len(it.append_ids) + len(it.tree.tokens) + 1 for it in f.items)
        prefill_rows = sum(len(it.append_ids) for it in f.items)
        # plain steps: the verifier ran a pass per step, the first one this round's rows, each later
        # one a row per request still stepping; the curve learns the average pass
        passes = max((1 + v.step_passes for v in f.verdicts.values() if v.ok), default=1)
        step_rows = sum(v.step_passes + v.step_drafted for v in f.verdicts.values() if v.ok)
        self.counters.plain_step_passes += passes - 1
        if passes == 1 or not prefill_rows:
            self.control.observe_pass(
                round((rows + step_rows) / passes),
                f.busy_s / passes,
                round(f.committed / passes),
                prefill=prefill_rows > 0,
                beside=f.beside,
            )
        if not f.plain:  # the plain arm's rounds would teach the pipeline's pricing that drafting is free
            self.control.observe_round(t1 - t0, (t2 - t1) / passes)
        # one line a round at debug level: where a slow pass came from (its rows, a prompt in it,
        # drafter work beside it on shared cores) without a profiler
        log.debug(
            "round",
            round=self.counters.rounds,
            requests=len(f.batch),
            pool=len(self.requests),
            rows=rows,
            prefill_rows=prefill_rows,
            beside=f.beside,
            drafted_ahead=f.drafted_ahead,
            routed_ahead=f.routed_ahead,
            probes=f.probes,
            passes=passes,
            plain=f.plain,
            slowdown=round(self.control.overlap_slowdown(), 2),
            committed=f.committed,
            draft_ms=round(1e3 * (t1 - t0), 1),
            verify_ms=round(1e3 * (t2 - t1), 1),
            pass_ms=round(f.busy_s * 1e3, 1),
        )
        if self.metrics is not None:
            self.metrics.round(len(f.batch), t1 - t0, t2 - t1, self.clock() - t2, f.busy_s)
        self.counters.rounds += 1
        self.counters.draft_s += t1 - t0
        self.counters.verify_s += t2 - t1
        self.counters.verifier_busy_s += f.busy_s
        if t2 > t0:
            self.load.observe(min(1.0, f.busy_s / max(t2 - t0, 1e-9)))
        if self.rounds_in_flight == 1 and not f.waited:  # alone, and no drafter model waited for
            self.control.observe_overhead(self.clock() - t0 - f.busy_s)

    def _guard_settled(self, level: Level, record: LevelRecord, flip: str) -> None:
        """The yield guard measured an epoch at ``level``: its verdict to the counters and the metrics."""
        self.counters.guard_withdrawals += flip == "withdrawn"
        self.counters.guard_readmissions += flip == "readmitted"
        if self.metrics is not None:
            self.metrics.guard(level, record, flip)

    def _observe_extras(
        self,
        batch: list[Request],
        trees: dict[str, DraftTree],
        selected: dict[str, list[str]],
        matched: dict[str, Verdict],
        ahead: set[str],
        draft_s: float,
    ) -> None:
        """What the drafters beyond each request's first brought this round and what they cost
        (``SpeculationControl.observe_extras``); rounds whose trees were drafted ahead do not count
        (their draft time is not this round's)."""
        inline = {r.request_id: selected.get(r.request_id, []) for r in batch if r.request_id not in ahead}
        if not self.config.cost_control or not any(len(chosen) > 1 for chosen in inline.values()):
            return
        gained = sum(extras_gain(trees[rid], chosen, matched[rid].accepted_nodes) for rid, chosen in inline.items())
        self.control.observe_extras(gained, extras_seconds(inline, draft_s), pipelined=self.rounds_in_flight > 1)
