"""The router's Prometheus families: speculative-decoding counters, rounds, queue (no gRPC here).

Counted per verdict, in the shape production engines export:

- ``cosine_spec_draft_tokens_total{drafter}`` / ``cosine_spec_accepted_tokens_total{drafter}``:
  every verified tree node is owned by one drafter (the first, by id, whose best candidate it
  was; else the first that proposed it), so per-drafter sums equal the totals;
- ``cosine_spec_draft_tokens_by_position_total{position}`` / ``..._accepted_...``: by depth in the
  tree (1 = the first drafted token), again summing to the totals;
- ``cosine_spec_acceptance_rate``: accepted / drafted so far;
- ``cosine_router_rounds_total``, ``cosine_router_batch_requests`` (histogram),
  ``cosine_router_round_seconds_total{stage="draft"|"verify"|"orchestration"}``,
  ``cosine_router_verifier_busy_fraction``, ``cosine_router_queue_depth``,
  ``cosine_router_active_requests``, ``cosine_router_tokens_committed_total``;
- the yield guard's figures by load level (``yield_guard.py``): ``cosine_router_yield_tokens_per_second
  {level, arm="speculate"|"plain", basis="wall"|"verifier_busy"}`` (``level``: ``1``, ``2``, ``3-4``, ...,
  with `` sampled`` where most requests sample), ``cosine_router_speculation_withdrawn
  {level}`` (1 where the guard turned speculation off) and ``cosine_router_speculation_flips_total{level,
  verdict="withdrawn"|"readmitted"}``;
- ``cosine_spec_grammar_pruned_tokens_total``: draft tokens a request's constraint forbade, pruned
  by the verifier before its pass (structured output; not among the verified tokens above);
- the verification frontiers' rows (``frontiers.py``): ``cosine_router_draft_rows_total{outcome=
  "verified"|"accepted"|"beyond_rejection"|"pruned"}`` (drafted tree nodes the verifier checked, those it
  accepted, those it checked under a node it had rejected, and later chunks' nodes dropped unverified
  after a rejection) and ``cosine_router_verifier_wait_seconds_total`` (time the verifier had no verify
  call of this router while a round drafted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from common.platform.metrics import ServiceMetrics
from common.spec.fusion import DraftTree
from services.router.yield_guard import Level, LevelRecord

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 64)


def node_owner(tree: DraftTree, node: int) -> str:
    """The one drafter a node is counted for."""
    owners = tree.top1[node] or {d for i, d in enumerate(tree.drafter_ids) if tree.source_masks[node] >> i & 1}
    return min(owners) if owners else "unknown"


def node_depths(tree: DraftTree) -> list[int]:
    depths: list[int] = []
    for p in tree.parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


class RouterMetrics:
    def __init__(self, metrics: ServiceMetrics, queue_depth: Callable[[], float], active: Callable[[], float]) -> None:
        m = metrics
        self.draft = m.counter("cosine_spec_draft_tokens_total", "draft tokens verified, by drafter", ["drafter"])
        self.accepted = m.counter(
            "cosine_spec_accepted_tokens_total", "draft tokens the target accepted, by drafter", ["drafter"]
        )
        self.draft_pos = m.counter(
            "cosine_spec_draft_tokens_by_position_total", "draft tokens verified, by depth in the tree", ["position"]
        )
        self.accepted_pos = m.counter(
            "cosine_spec_accepted_tokens_by_position_total", "draft tokens accepted, by depth in the tree", ["position"]
        )
        self.rate = m.gauge("cosine_spec_acceptance_rate", "accepted / verified draft tokens since start")
        self.rounds = m.counter("cosine_router_rounds_total", "rounds (draft + verify of one batch)")
        self.batch = m.histogram("cosine_router_batch_requests", "requests per round", buckets=BATCH_BUCKETS)
        self.stage = m.counter("cosine_router_round_seconds_total", "time of rounds by stage", ["stage"])
        self.busy = m.gauge("cosine_router_verifier_busy_fraction", "verifier busy time / round time, last round")
        self.committed = m.counter("cosine_router_tokens_committed_total", "tokens committed to requests")
        m.gauge("cosine_router_queue_depth", "requests waiting for a round").set_function(queue_depth)
        m.gauge("cosine_router_active_requests", "requests in the router").set_function(active)
        self.yields = m.gauge(
            "cosine_router_yield_tokens_per_second",
            "tokens committed per second by each arm of the yield guard, by load level",
            ["level", "arm", "basis"],
        )
        self.withdrawn = m.gauge(
            "cosine_router_speculation_withdrawn",
            "1 where the yield guard withdrew speculation, by load level",
            ["level"],
        )
        self.flips = m.counter(
            "cosine_router_speculation_flips_total", "the yield guard's verdicts that changed", ["level", "verdict"]
        )
        self.grammar_pruned = m.counter(
            "cosine_spec_grammar_pruned_tokens_total",
            "draft tokens a request's grammar forbade, pruned before the verify pass (never verified)",
        )
        self.draft_rows = m.counter(
            "cosine_router_draft_rows_total",
            "drafted tree nodes by outcome: verified, accepted, verified beyond a rejection, pruned unverified",
            ["outcome"],
        )
        self.wait = m.counter(
            "cosine_router_verifier_wait_seconds_total", "seconds the verifier waited for drafts (no verify call)"
        )
        self._waited = 0.0
        self._drafted = 0
        self._accepted = 0

    def verdict(self, tree: DraftTree, accepted_nodes: Sequence[int], committed: int, grammar_pruned: int = 0) -> None:
        if grammar_pruned:
            self.grammar_pruned.inc(grammar_pruned)
        depths = node_depths(tree)
        accepted = set(accepted_nodes)
        for node in range(len(tree)):
            owner, pos = node_owner(tree, node), str(depths[node])
            self.draft.labels(owner).inc()
            self.draft_pos.labels(pos).inc()
            if node in accepted:
                self.accepted.labels(owner).inc()
                self.accepted_pos.labels(pos).inc()
        self._drafted += len(tree)
        self._accepted += len(accepted)
        if self._drafted:
            self.rate.set(self._accepted / self._drafted)
        self.committed.inc(committed)

    def rows(self, verified: int = 0, accepted: int = 0, beyond_rejection: int = 0, pruned: int = 0) -> None:
        """Drafted rows of a round by outcome (``frontiers.py``)."""
        for outcome, n in (
            ("verified", verified),
            ("accepted", accepted),
            ("beyond_rejection", beyond_rejection),
            ("pruned", pruned),
        ):
            if n:
                self.draft_rows.labels(outcome).inc(n)

    def verifier_wait(self, total_s: float) -> None:
        """The verifier's wait for drafts so far (a running total: the counter takes the increase)."""
        if total_s > self._waited:
            self.wait.inc(total_s - self._waited)
            self._waited = total_s

    def round(self, requests: int, draft_s: float, verify_s: float, other_s: float, busy_s: float) -> None:
        self.rounds.inc()
        self.batch.observe(requests)
        self.stage.labels("draft").inc(max(0.0, draft_s))
        self.stage.labels("verify").inc(max(0.0, verify_s))
        self.stage.labels("orchestration").inc(max(0.0, other_s))
        total = draft_s + verify_s + other_s
        if total > 0:
            self.busy.set(min(1.0, busy_s / total))

    def guard(self, level: Level, record: LevelRecord, flip: str) -> None:
        """One settled epoch of the yield guard at ``level``: both arms' yields and the verdict."""
        name = level.label
        for arm, y in (("speculate", record.speculate), ("plain", record.plain)):
            if y.epochs:
                self.yields.labels(name, arm, "wall").set(y.per_s)
                self.yields.labels(name, arm, "verifier_busy").set(y.per_busy_s)
        self.withdrawn.labels(name).set(1.0 if record.withdrawn else 0.0)
        if flip:
            self.flips.labels(name, flip).inc()
