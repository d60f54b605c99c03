"""Cost-aware speculation control: draft and verify a token only where it pays (no gRPC here).

Speculation trades verifier work for tokens. A drafted node that the target ends up rejecting
still costs a row of the verify pass, and on a target whose passes cost a few milliseconds per
token (a CPU, or a GPU at large batch) a tree that is too long or too wide makes the system
*slower* than plain decoding. So every node is priced:

    value(node)  = P(target accepts it)  ~= prod over its path of cal(p)     (expected tokens)
    cost(node)   = per_token_s                                               (verifier seconds)
    keep it iff    value(node) >= throughput * per_token_s                   (= threshold)

``cal(p)`` maps a drafter's (fused) confidence to the acceptance rate measured so far for that
confidence (:class:`Calibration`, binned, learned online from every verdict). ``per_token_s`` is
the slope of the verifier's pass time against the tokens in the pass (:class:`CostModel`, fitted
online by recursive least squares from the verifier's own busy times). ``throughput`` is what the
verifier currently commits per busy second: a node is worth a verify row only when its expected
tokens beat what that row's time earns on average. The threshold therefore moves with load:
at batch 1 a pass costs mostly its fixed part, the threshold is low and trees grow long; under
load the fixed part is amortised, throughput per second rises, the threshold rises and
speculation shrinks, down to plain decoding (no node at all) when no node pays. This is the
two-sided negative feedback of the design: verification the bottleneck -> verify less.

Drafting is priced the same way: one more fused draft step for the batch costs the drafters'
step time; it is taken only while the expected tokens it can add repay that time. The first step
of a round is priced per request before it is sent (:meth:`SpeculationControl.first_node_threshold`):
a request drafts only when its first node's acceptance rate repays its verify row *and* its share of
the first step's time (:attr:`SpeculationControl.first_step`, a fixed + per-request fit like the
verifier's). At one client nothing overlaps the drafters' time, so weak drafters are turned off and
the request decodes plainly; with a full batch the step's time is shared and drafting goes on. When
drafting takes longer than verifying (drafters the bottleneck), requests are drafted by one drafter
instead of several: draft less. The drafters beyond a request's first are priced as well
(:meth:`SpeculationControl.extras_pay`): what they add (accepted tokens the first drafter and the
lookup drafter would not have proposed) against what they cost (their share of the round's draft
time, at the verifier's throughput); while they do not repay it, one drafter drafts, and every
``EXTRAS_PROBE_EVERY``-th request drafted for takes the configured number again, to find out.

Pipelining is priced too (:meth:`SpeculationControl.pipeline_pays`). A second round in flight
lets one batch draft while another verifies, but it splits the pool into two batches, and each
verify pass pays the pass's fixed cost again (on a CPU target, the weights read once per pass):
when verification takes longer than drafting, the verifier is the bottleneck and the second pass
is pure loss. So a second round starts only while a round's drafting takes at least as long as
its verifier time (with hysteresis: it stops below 0.8 of it); otherwise one round with the whole
pool is in flight, and the verifier sees full batches.

Lossless by construction: control only decides which proposals are verified; acceptance is
decided by the verifier from the target alone.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from common.spec.fusion import DraftTree
from common.spec.token_fusion import StepPricing, confidence_bin
from services.router.pass_plan import PassCurve

EXTRAS_PROBE_EVERY = 8  # while extra drafters do not pay, one in this many requests drafted for still takes them
EXTRAS_MIN_ROUNDS = 4  # rounds with extra drafters measured before they may be turned off


@dataclass
class Calibration:
    """P(accept | confidence p), in ``bins`` equal bins of p, each with a Beta prior at its midpoint."""

    bins: int = 10
    prior_weight: float = 4.0
    accepted: list[float] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.seen:
            mids = [(i + 0.5) / self.bins for i in range(self.bins)]
            self.accepted = [m * self.prior_weight for m in mids]
            self.seen = [self.prior_weight] * self.bins

    def _bin(self, p: float) -> int:
        return confidence_bin(p, self.bins)

    def __call__(self, p: float) -> float:
        b = self._bin(p)
        return self.accepted[b] / self.seen[b]

    def observe(self, p: float, accepted: bool) -> None:
        b = self._bin(p)
        self.seen[b] += 1.0
        self.accepted[b] += 1.0 if accepted else 0.0


@dataclass
class CostModel:
    """Verify pass seconds ~= ``fixed_s + per_token_s * tokens``, by recursive least squares with forgetting.

    Starts from a prior (``per_token_s`` = ``prior_share`` of a pass's time per token at the first
    observation) so that the first rounds already have a slope; the fit takes over as passes of
    different sizes (prefills, trees) arrive.
    """

    forget: float = 0.98
    fixed_s: float = 0.0
    per_token_s: float = 0.0
    _p: list[list[float]] = field(default_factory=lambda: [[1e3, 0.0], [0.0, 1e3]])
    observed: int = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if self.observed == 0:  # prior: half the pass is fixed cost, half is per token
            self.fixed_s, self.per_token_s = seconds / 2, seconds / 2 / tokens
        x = (1.0, float(tokens))
        p = self._p
        px = [p[0][0] * x[0] + p[0][1] * x[1], p[1][0] * x[0] + p[1][1] * x[1]]
        denom = self.forget + x[0] * px[0] + x[1] * px[1]
        gain = [px[0] / denom, px[1] / denom]
        err = seconds - (self.fixed_s + self.per_token_s * tokens)
        self.fixed_s += gain[0] * err
        self.per_token_s += gain[1] * err
        self._p = [[(p[i][j] - gain[i] * px[j]) / self.forget for j in range(2)] for i in range(2)]
        self.observed += 1

    def slope(self) -> float:
        """Marginal seconds per verified token (never negative)."""
        return max(self.per_token_s, 0.0)

    def predict(self, tokens: int) -> float:
        return max(0.0, self.fixed_s) + self.slope() * tokens


@dataclass
class SpeculationControl:
    """Prices draft nodes and draft steps (see the module docstring); fed by every round."""

    enabled: bool = True
    smoothing: float = 0.2  # EWMA weight of the newest round
    min_threshold: float = 0.02  # below this a node is never worth a row, however cheap
    calibration: Calibration = field(default_factory=Calibration)  # greedy requests' nodes
    # sampled requests' nodes: a token is accepted by rejection sampling there, not by matching the
    # target's argmax, so the same confidence earns another rate (see ``calibration_for``)
    sampled_calibration: Calibration = field(default_factory=Calibration)
    cost: CostModel = field(default_factory=CostModel)
    curve: PassCurve = field(default_factory=PassCurve)  # measured pass time by rows (not a line: see pass_plan)
    throughput: float = 0.0  # tokens committed per verifier-busy second (EWMA)
    draft_step_s: float = 0.0  # one fused draft step for a batch (EWMA)
    first_step: CostModel = field(default_factory=CostModel)  # a round's first draft step: seconds ~ requests drafted
    draft_round_s: float = 0.0
    verify_round_s: float = 0.0
    verify_pass_s: float = 0.0  # verifier busy time of one round's pass (EWMA): no queueing in it
    round_overhead_s: float = 0.0  # a round's time beside its passes, with no drafter model to wait for (EWMA)
    pipelining: bool = True  # whether a second round in flight currently pays (see pipeline_pays)
    pass_ratio: float = 0.0  # measured over predicted pass time, passes with no drafter work beside them (EWMA)
    pass_ratio_beside: float = 0.0  # the same, passes that ran beside drafting ahead or a prompt's scoring (EWMA)
    extras_gain: float = 0.0  # accepted tokens only the drafters beyond each request's first proposed, per round (EWMA)
    extras_cost: float = 0.0  # their share of the round's draft time, in tokens of verifier throughput (EWMA)
    extras_rounds: int = 0  # rounds in which some request had extra drafters
    _extras_asked: int = 0

    # ---- decisions -------------------------------------------------------------------------------

    def threshold(self) -> float:
        """Expected tokens a node must bring to earn its verify row."""
        if not self.enabled or self.cost.observed == 0 or self.throughput <= 0:
            return self.min_threshold
        return max(self.min_threshold, self.throughput * self.cost.slope())

    def pass_seconds(self, rows: int) -> float | None:
        """Predicted seconds of a verify pass of ``rows`` rows, from the measured curve."""
        return self.curve.predict(rows, self.cost.slope())

    def first_row_threshold(self, requests: int, depth: int = 0) -> float:
        """Expected tokens a request's drafted node at ``depth`` must bring to repay its verify row,
        when each of ``requests`` requests drafts to that depth beside its plain row: the measured
        pass-time curve's step from ``depth + 1`` to ``depth + 2`` rows a request (on a CPU the first
        rows beyond one per request are the dearest, the later ones cheaper), else the fitted line's slope."""
        fewer, more = self.pass_seconds((depth + 1) * requests), self.pass_seconds((depth + 2) * requests)
        if not self.enabled or self.throughput <= 0 or fewer is None or more is None or requests <= 0:
            return self.threshold()
        return max(self.min_threshold, self.throughput * (more - fewer) / requests)

    def first_node_threshold(self, requests: int, pipelined: bool, chain: int = 1) -> float:
        """The lowest acceptance rate of a request's first node at which the request drafts this round.

        Its verify row (:meth:`first_row_threshold`) plus its share of the first draft step of
        ``requests`` requests (half of it when another round is in flight, as in :meth:`worth_a_step`).
        With ``chain`` > 1 the request may draft a chain of up to that many nodes, and the rate is the
        lowest at which the best length pays (:meth:`chain_pays`): on a pass-time curve that is flat
        over the first few rows the first node alone may not repay the draft step while four do."""
        theta = self.first_row_threshold(requests)
        if not self.enabled or self.throughput <= 0 or requests <= 0:
            return theta
        share = 0.5 if pipelined else 1.0
        theta += self.throughput * share * self._first_step_s(requests) / requests
        if chain <= 1:
            return theta
        costs = self.chain_costs(requests, chain, share)
        if costs is None or not chain_pays(1.0, costs):
            return theta
        lo, hi = 0.0, 1.0  # the rate at which the best chain breaks even, by bisection
        for _ in range(24):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if chain_pays(mid, costs) else (mid, hi)
        return max(self.min_threshold, min(theta, hi))

    def chain_costs(self, requests: int, chain: int, share: float) -> list[float] | None:
        """What a chain of k = 1..``chain`` drafted nodes per request costs each request, in expected
        tokens: its k verify rows on the pass-time curve plus its share of the k draft steps, at the
        verifier's current throughput. None while the pass time cannot be predicted."""
        plain = self.pass_seconds(requests)
        if plain is None:
            return None
        first_step = self._first_step_s(requests)
        costs = []
        for k in range(1, chain + 1):
            more = self.pass_seconds(requests * (1 + k))
            if more is None:
                return None
            steps = first_step + (k - 1) * self.draft_step_s
            costs.append(self.throughput * ((more - plain) + share * steps) / requests)
        return costs

    def _first_step_s(self, requests: int) -> float:
        """Predicted seconds of a round's first draft step for ``requests`` requests (0 until measured)."""
        return self.first_step.predict(requests) if self.first_step.observed else 0.0

    def drafting_ahead_pays(self, requests: int, drafting: int, chain: int) -> bool:
        """Whether the ``drafting`` of a round's ``requests`` requests that draft (chains of up to
        ``chain`` nodes) should draft while the others are verified, joining a later pass with their
        trees, rather than the whole round waiting for the drafters.

        Request-rounds per second of the verifier either way. Waiting: ``requests`` in the draft
        time plus the pass of everyone's rows. Drafting ahead: the others go on in passes of their
        own while the drafters work (at least one), then everyone's pass. The extra pass is the price:
        on a CPU target a pass's first rows cost nearly as much as a whole batch's, so a round in
        which most requests draft, quickly, waits for them, and a round in which a few do lets the
        rest go on. The others' pass runs beside the drafters, so it is priced at the measured
        :meth:`overlap_slowdown`: where drafters share the verifier's cores, the overlap is not free."""
        if not self.enabled or not 0 < drafting < requests or not self.first_step.observed:
            return False
        rest, whole = self.pass_seconds(requests - drafting), self.pass_seconds(requests + drafting * chain)
        if rest is None or whole is None or rest <= 0:
            return False
        rest *= self.overlap_slowdown()  # the others' pass runs beside the drafters
        draft = self._first_step_s(drafting) + (chain - 1) * self.draft_step_s
        meanwhile = (requests - drafting) * max(1.0, draft / rest)
        return (meanwhile + requests) / (max(draft, rest) + whole) > requests / (draft + whole)

    def overlap_slowdown(self) -> float:
        """How much longer a verify pass takes while drafter work runs beside it (drafting ahead, a new
        prompt's scoring): measured over predicted pass time for such passes, against the same ratio for
        passes with nothing beside them. 1.0 until both were measured. Where the drafters have cores
        of their own it stays near 1; where they share the verifier's, the others' pass that overlaps
        the drafting is that much dearer, and drafting ahead must pay for it."""
        if self.pass_ratio <= 0 or self.pass_ratio_beside <= 0:
            return 1.0
        return max(1.0, self.pass_ratio_beside / self.pass_ratio)

    def calibration_for(self, greedy: bool) -> Calibration:
        """P(accept | confidence) of a drafter node, for greedy or for sampled requests. Kept apart
        because one calibration fed by both prices a sampled request's nodes at greedy rates wherever
        greedy requests are the majority (a router's history, or a bench's earlier workloads); then
        its passes keep rows that do not pay."""
        return self.calibration if greedy else self.sampled_calibration

    def node_value(self, parent_value: float, confidence: float, greedy: bool = True) -> float:
        return parent_value * self.calibration_for(greedy)(confidence)

    def worth_a_step(self, next_values: Sequence[float], pipelined: bool) -> bool:
        """Whether one more fused draft step (for the requests whose next nodes are ``next_values``)
        repays the drafters' time and the nodes' rows. Pipelined, the step overlaps another batch's
        verification and only half of its time is counted (see :meth:`step_pricing`)."""
        return self.step_pricing(pipelined).worth_a_step(next_values)

    def step_pricing(self, pipelined: bool, greedy: bool = True) -> StepPricing:
        """This round's word on nodes and steps, for token fusion wherever it runs (a snapshot:
        the node threshold, the calibration of ``greedy`` or sampled requests, and what one more
        step must bring, as in :meth:`threshold`, :meth:`node_value` and :meth:`worth_a_step`)."""
        if not self.enabled:
            return StepPricing()
        cal = self.calibration_for(greedy)
        rates = tuple(a / n for a, n in zip(cal.accepted, cal.seen))
        step_tokens = row_tokens = 0.0
        if self.throughput > 0 and self.draft_step_s > 0:
            share = 0.5 if pipelined else 1.0
            step_tokens = self.throughput * share * self.draft_step_s
            row_tokens = self.throughput * self.cost.slope()
        return StepPricing(
            priced=True, threshold=self.threshold(), calibration=rates, step_tokens=step_tokens, row_tokens=row_tokens
        )

    def pipeline_pays(self) -> bool:
        """Whether a second round in flight pays: while drafting takes at least as long as the
        verifier's pass (on below 1.0x, off below 0.8x: hysteresis). Unmeasured or disabled: yes."""
        if not self.enabled or self.draft_round_s <= 0 or self.verify_pass_s <= 0:
            return True
        ratio = self.draft_round_s / self.verify_pass_s
        if self.pipelining and ratio < 0.8:
            self.pipelining = False
        elif not self.pipelining and ratio >= 1.0:
            self.pipelining = True
        return self.pipelining

    def drafters_per_request(self, configured: int) -> int:
        """Draft less when drafting is the bottleneck (one drafter per request while a round's
        drafting takes longer than its verification) or when the drafters beyond the first do not
        repay their time (:meth:`extras_pay`; every ``EXTRAS_PROBE_EVERY``-th request asked about
        still takes ``configured``, so that a change is seen)."""
        if not self.enabled or configured <= 1:
            return configured
        if self.draft_round_s > self.verify_round_s > 0:
            return 1
        if not self.extras_pay():
            self._extras_asked += 1
            return configured if self._extras_asked % EXTRAS_PROBE_EVERY == 0 else 1
        return configured

    def extras_pay(self) -> bool:
        """Whether the drafters beyond each request's first bring more accepted tokens than their
        draft time costs (:meth:`observe_extras`); true until measured."""
        return self.extras_rounds < EXTRAS_MIN_ROUNDS or self.extras_gain >= self.extras_cost

    def observe_extras(self, gained: int, seconds: float, pipelined: bool) -> None:
        """One round in which some requests had drafters beyond their first: ``gained``, the accepted
        tokens only those drafters proposed (:func:`services.router.drafting.extras_gain`), and
        ``seconds``, their share of the round's draft time; half of it counts while another round
        is in flight (as in :meth:`worth_a_step`)."""
        share = 0.5 if pipelined else 1.0
        self.extras_rounds += 1
        self.extras_gain = self._ewma_zero(self.extras_gain, float(gained), self.extras_rounds)
        self.extras_cost = self._ewma_zero(self.extras_cost, self.throughput * share * seconds, self.extras_rounds)

    def prune(self, tree: DraftTree, greedy: bool = True) -> DraftTree:
        """The tree without the nodes (and their descendants) whose value is under the threshold."""
        theta = self.threshold()
        values: list[float] = []
        keep: list[bool] = []
        for parent, prob in zip(tree.parents, tree.probs):
            base = 1.0 if parent < 0 else values[parent]
            v = self.node_value(base, prob, greedy)
            values.append(v)
            keep.append(v >= theta and (parent < 0 or keep[parent]))
        if all(keep):
            return tree
        return tree.subtree({i for i, ok in enumerate(keep) if ok})[0]

    # ---- feedback --------------------------------------------------------------------------------

    def _ewma(self, old: float, new: float) -> float:
        return new if old <= 0 else (1 - self.smoothing) * old + self.smoothing * new

    def _ewma_zero(self, old: float, new: float, count: int) -> float:
        """As :meth:`_ewma`, for a figure that may well be 0: the first observation starts it."""
        return new if count <= 1 else (1 - self.smoothing) * old + self.smoothing * new

    def observe_pass(
        self, tokens: int, busy_s: float, committed: int, prefill: bool = False, beside: bool = False
    ) -> None:
        """One verify pass: ``tokens`` rows took ``busy_s`` of verifier time and committed ``committed``.
        A pass that prefilled a prompt stays out of the pass-time curve: a prompt's rows cost less
        each than a batch's decode and tree rows, and the curve prices those. So does a pass that
        ran ``beside`` drafter work: the curve prices a pass on its own, and what the drafters beside
        it cost is measured apart (:meth:`overlap_slowdown`)."""
        self.cost.observe(tokens, busy_s)
        if not prefill:
            predicted = self.pass_seconds(tokens)
            if predicted and busy_s > 0:
                if beside:
                    self.pass_ratio_beside = self._ewma(self.pass_ratio_beside, busy_s / predicted)
                else:
                    self.pass_ratio = self._ewma(self.pass_ratio, busy_s / predicted)
            if not beside or predicted is None:
                self.curve.observe(tokens, busy_s)
        if busy_s > 0:
            self.throughput = self._ewma(self.throughput, committed / busy_s)
            self.verify_pass_s = self._ewma(self.verify_pass_s, busy_s)

    def observe_draft_step(self, seconds: float, first_of: int = 0) -> None:
        """One draft step took ``seconds``; ``first_of``: it was a round's first, for that many requests."""
        self.draft_step_s = self._ewma(self.draft_step_s, seconds)
        if first_of:
            self.first_step.observe(first_of, seconds)

    def observe_overhead(self, seconds: float) -> None:
        """One round's time beside its verifier passes (its lookup chains and plan, the round trip,
        the verdicts' application) while it was the only round in flight and waited for no drafter
        model: what a plain round's steps pay once and a drafted round pays every pass (see
        ``pass_plan``). One round counts for at most three times the estimate so far, so that a lone
        stall (a collection, the event loop busy elsewhere) barely moves it while a verifier that
        moved far away is learned within a few dozen rounds."""
        if seconds < 0:
            return
        if self.round_overhead_s > 0:
            seconds = min(seconds, 3 * self.round_overhead_s)
        self.round_overhead_s = self._ewma(self.round_overhead_s, seconds)

    def observe_round(self, draft_s: float, verify_s: float) -> None:
        self.draft_round_s = self._ewma(self.draft_round_s, draft_s)
        self.verify_round_s = self._ewma(self.verify_round_s, verify_s)

    def observe_verdict(
        self, tree: DraftTree, accepted_nodes: Sequence[int], skip: Collection[int] = (), greedy: bool = True
    ) -> None:
        """Calibration (of greedy or of sampled requests) from one verdict: every node whose parent
        was accepted (or that hangs off the committed sequence) was tried; it either was accepted or
        not. ``skip``: nodes no drafter model proposed (the lookup drafter's, calibrated on their own)."""
        calibration = self.calibration_for(greedy)
        accepted = set(accepted_nodes)
        for i, parent in enumerate(tree.parents):
            if i in skip:
                continue
            if parent < 0 or parent in accepted:
                calibration.observe(tree.probs[i], i in accepted)


def chain_pays(rate: float, costs: Sequence[float]) -> bool:
    """Whether some chain length pays when each node is accepted with ``rate`` given its parent:
    expected tokens rate + rate^2 + ... + rate^k against ``costs[k - 1]``."""
    value, term = 0.0, 1.0
    for cost in costs:
        term *= rate
        value += term
        if value >= cost:
            return True
    return False
