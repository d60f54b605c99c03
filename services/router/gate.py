"""The draft gate: which requests of a round are drafted for by the drafter models (no gRPC here).

A request drafts in a round when the chain it may draft (up to its speculation length) is expected
to repay what it costs: its verify rows on the measured pass-time curve and, with draft pricing,
its share of the round's draft steps (:meth:`SpeculationControl.first_node_threshold`, which turns
that into the lowest acceptance rate of the first node at which the best chain length pays, each
further node taken to be accepted at the same rate given its parent). The rate is the request's own record:
an EWMA of how often its first drafted node was accepted (a round in which none of its nodes was
worth a row of the pass counts as a rejection). A new request starts from the recent requests'
record, so under a load where the drafters do not pay, new requests do not draft to find out.

Records are kept per domain (``--domain-gate``): whether drafting pays depends on the text more than
on the load, and a mixed stream must not let the drafters' misses on chat turn drafting off for the
arithmetic they predict well. A request's domain for the gate is its routing domain, or before it
is routed the domain lexicon's best guess at submission (:attr:`Request.domain_guess`, no drafter
pass); a domain's first request starts from the default record, so each domain finds out once, and
a request with no domain at all starts from the record of every request. Probe intervals are kept
per domain too: probes that keep missing on one domain do not space out another's.

A request turned down to plain decoding is *probed*: on the router's rounds that are multiples of
its domain's probe interval, one such request of the domain (``PROBE_SLOTS``) drafts, the one whose
last probe is oldest (the router offers a round's requests least recently probed first), so the
requests of a domain take turns. One probe tells whether the domain's drafting pays again as well
as all of them would, and a probe costs a drafter catch-up of every token committed since the
request last drafted: sixteen requests probing at once held a 16-client batch's verifier to passes
of one or two requests for many passes. The interval starts at 8 rounds, doubles after each probe round
in which fewer first nodes were accepted than drafting needs (up to 64), and falls back to 8 after
one that paid: a change of load or of text turns drafting back on, and probes never cost much more
than they find.

Probes are also held to a share of the router's time (``--probe-share``, :attr:`RouterSettings.probe_share`): a
probe round's drafter time (mostly the catch-up of each probing request) is charged, and the next probe round waits
until that time is the share of the time since (:meth:`DraftGate.charge_probes`). Under load the catch-ups are
long (a request that last drafted a hundred tokens ago) and, where the drafters share the verifier's
cores, slow the passes beside them as much as they take: five domains probing at once under a
16-client load stretched the pass beside them to several times its length, every 64 rounds. With
the share, the domains still take turns and still probe together, but never spend more than a few
percent of the time finding out; at one client, where a catch-up is short, probes
stay as frequent as their intervals allow.

The lookup drafter is not gated: it costs no drafter time (see ``lookup.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.router.control import SpeculationControl
from services.router.requests import Request
from services.router.settings import RouterSettings

PROBE_EVERY, MAX_PROBE_EVERY = 8, 64  # rounds between probe rounds (see the module docstring)
PROBE_SLOTS = 1  # requests of one domain that probe in one probe round
FIRST_ACCEPT_WEIGHT = 0.3  # EWMA weight of a round's outcome in a request's first-node record
PRIOR_WEIGHT = 0.05  # EWMA weight of any request's outcome in the record a new request starts from
DOMAIN_WEIGHT = 0.15  # the same within a domain (fewer outcomes: it must learn from a request or two)
FIRST_ACCEPT_START = 0.7  # the record before any outcome: optimistic, so that drafting is tried


@dataclass
class DomainRecord:
    """What drafting did for a domain's recent requests: their first-node record and probe interval."""

    first_accept: float = FIRST_ACCEPT_START
    probe_every: int = PROBE_EVERY
    probe_round: int = -1  # the round of the latest probes
    probes: int = 0  # requests that probe in that round

    def probe_slot(self, round_index: int) -> bool:
        """Whether a request of this domain may probe in round ``round_index``: a probe round with
        a slot left (``PROBE_SLOTS``), which it takes."""
        if round_index % self.probe_every:
            return False
        if self.probe_round != round_index:
            self.probe_round, self.probes = round_index, 0
        if self.probes >= PROBE_SLOTS:
            return False
        self.probes += 1
        return True


class DraftGate:
    def __init__(
        self, config: RouterSettings, control: SpeculationControl, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.control = control
        self.clock = clock
        self.probes_open_at = 0.0  # the clock time from which a probe may be granted (RouterSettings.probe_share)
        self._theta = 0.0  # the threshold of the current round's decisions
        # first-node thresholds by (batch size, pipelined, chain) for one round's decisions, which
        # price every request alike but for its chain; cleared by :meth:`new_round`
        self._thetas: dict[tuple[int, bool, int], float] = {}
        self.overall = DomainRecord()  # every request's outcomes: for requests with no domain
        self.domains: dict[str, DomainRecord] = {}

    @property
    def first_accept_prior(self) -> float:
        """The first-node record of the recent requests, whatever their domain (EWMA)."""
        return self.overall.first_accept

    @property
    def probe_every(self) -> int:
        """The probe interval of requests with no domain (every request's, without ``--domain-gate``)."""
        return self.overall.probe_every

    def record(self, domain: str) -> DomainRecord:
        """The record a request of ``domain`` is gated by (created for a domain's first request)."""
        if not domain or not self.config.domain_gate:
            return self.overall
        return self.domains.setdefault(domain, DomainRecord())

    def start(self, domain: str) -> float:
        """The first-node record a new request of ``domain`` ("" when unknown) starts from."""
        return self.record(domain).first_accept

    def new_round(self) -> None:
        """Before a round's decisions: the prices of the last round's may have moved since."""
        self._thetas.clear()

    def drafts(self, r: Request, batch_size: int, round_index: int, pipelined: bool, chain: int = 1) -> bool:
        """Whether the drafters draft for ``r`` in a round of ``batch_size`` requests, the router's
        ``round_index``-th; ``pipelined``: another round is in flight and overlaps this one's drafting;
        ``chain``: the most nodes ``r`` may draft in a chain (its speculation length). Ask in the
        order of :func:`probe_order`, so that a domain's probe goes to its least recently probed request."""
        if not self.config.speculate:
            return False
        if not self.config.cost_control:
            return True
        if self.config.draft_pricing:
            key = (batch_size, pipelined, chain)
            if key not in self._thetas:
                self._thetas[key] = self.control.first_node_threshold(batch_size, pipelined=pipelined, chain=chain)
            self._theta = self._thetas[key]
        else:
            self._theta = self.control.threshold()
        if r.first_accept >= self._theta:
            r.probing = False
            return True
        r.probing = self.clock() >= self.probes_open_at and self.record(gate_domain(r)).probe_slot(round_index)
        if r.probing:
            r.probed_at = round_index
        return r.probing

    def charge_probes(self, seconds: float, probes: int, requests: int) -> None:
        """A drafter call of ``seconds`` for ``requests`` requests, ``probes`` of them probing: the
        probes' share of it is charged, and the next probe waits until that is the configured share
        (:attr:`RouterSettings.probe_share`) of the time since (charges add up when probe rounds' drafting overlaps)."""
        if seconds > 0 and probes > 0:
            charged = seconds * probes / max(requests, probes)
            self.probes_open_at = max(self.probes_open_at, self.clock()) + charged / self.config.probe_share

    def observe(self, r: Request, drafted: bool, verified_model_nodes: bool, first_accepted_is_model: bool) -> None:
        """One verdict of ``r``: whether it drafted, whether any of the drafters' nodes was verified,
        and whether the first accepted node was one of theirs."""
        a = FIRST_ACCEPT_WEIGHT
        outcome = None
        if verified_model_nodes:
            outcome = 1.0 if first_accepted_is_model else 0.0
        elif drafted:  # it drafted, but none of its nodes was worth a row of the pass: as good as rejected
            outcome = 0.0
        if outcome is not None:
            r.first_accept = (1 - a) * r.first_accept + a * outcome
            self.overall.first_accept += PRIOR_WEIGHT * (outcome - self.overall.first_accept)
            own = self.record(gate_domain(r))
            if own is not self.overall:
                own.first_accept += DOMAIN_WEIGHT * (outcome - own.first_accept)
        r.probe_hit = r.probing and drafted and verified_model_nodes and first_accepted_is_model

    def settle(self, batch: Sequence[Request]) -> None:
        """After a round's verdicts: a probe round pays for a domain when as many of its first nodes
        were accepted as drafting needed; the domain's probe interval follows."""
        by_record: dict[int, tuple[DomainRecord, list[Request]]] = {}
        for r in batch:
            if r.probing:
                rec = self.record(gate_domain(r))
                by_record.setdefault(id(rec), (rec, []))[1].append(r)
        for rec, probed in by_record.values():
            paid = sum(r.probe_hit for r in probed) >= self._theta * len(probed)
            rec.probe_every = PROBE_EVERY if paid else min(MAX_PROBE_EVERY, 2 * rec.probe_every)
            for r in probed:
                r.probing = r.probe_hit = False


def probe_order(batch: Sequence[Request]) -> list[Request]:
    """``batch`` least recently probed first (never probed before all): the order to ask
    :meth:`DraftGate.drafts` in, so that the requests of a domain take turns probing."""
    return sorted(batch, key=lambda r: r.probed_at)


def gate_domain(r: Request) -> str:
    """The domain ``r`` is gated by: its routing domain, else the lexicon's guess at submission."""
    return r.domain or r.domain_guess
