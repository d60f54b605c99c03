"""The draft gate: which requests of a round are drafted for by the drafter models (no gRPC here).

A request drafts in a round when the chain it may draft (up to its speculation length) is expected
to repay what it costs: its verify rows on the measured pass-time curve and, with draft pricing,
its share of the round's draft steps (:meth:`SpeculationControl.first_node_threshold`, which turns
that into the lowest acceptance rate of the first node at which the best chain length pays, each
further node taken to be accepted at the same rate given its parent). The rate is the request's own record:
an EWMA of how often its first drafted node was accepted (a round in which none of its nodes was
worth a row of the pass counts as a rejection). A new request starts from the recent requests'
record, so under a load where the drafters do not pay, new requests do not draft to find out.

A request turned down to plain decoding is *probed*: on the router's rounds that are multiples of
the probe interval every such request drafts, all at once, so they share one draft step. The
interval starts at 8 rounds, doubles after each probe round in which fewer first nodes were
accepted than drafting needs (up to 64), and falls back to 8 after one that paid: a change of load
or of text turns drafting back on, and probes never cost much more than they find.

The lookup drafter is not gated: it costs no drafter time (see ``lookup.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.control import SpeculationControl
from services.router.requests import Request, RouterConfig

PROBE_EVERY, MAX_PROBE_EVERY = 8, 64  # rounds between probe rounds (see the module docstring)
FIRST_ACCEPT_WEIGHT = 0.3  # EWMA weight of a round's outcome in a request's first-node record
PRIOR_WEIGHT = 0.05  # EWMA weight of any request's outcome in the record a new request starts from


class DraftGate:
    def __init__(self, config: RouterConfig, control: SpeculationControl) -> None:
        self.config = config
        self.control = control
        self.probe_every = PROBE_EVERY
        self._theta = 0.0  # the threshold of the current round's decisions
        self.first_accept_prior = 0.7  # a new request's first-node record: the recent requests' (EWMA)

    def drafts(self, r: Request, batch_size: int, round_index: int, pipelined: bool, chain: int = 1) -> bool:
        """Whether the drafters draft for ``r`` in a round of ``batch_size`` requests, the router's
        ``round_index``-th; ``pipelined``: another round is in flight and overlaps this one's drafting;
        ``chain``: the most nodes ``r`` may draft in a chain (its speculation length)."""
        if not self.config.speculate:
            return False
        if not self.config.cost_control:
            return True
        if self.config.draft_pricing:
            self._theta = self.control.first_node_threshold(batch_size, pipelined=pipelined, chain=chain)
        else:
            self._theta = self.control.threshold()
        r.probing = r.first_accept < self._theta and round_index % self.probe_every == 0
        return r.first_accept >= self._theta or r.probing

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
            self.first_accept_prior = (1 - PRIOR_WEIGHT) * self.first_accept_prior + PRIOR_WEIGHT * outcome
        r.probe_hit = r.probing and drafted and verified_model_nodes and first_accepted_is_model

    def settle(self, batch: Sequence[Request]) -> None:
        """After a round's verdicts: a probe round pays when as many first nodes were accepted as
        drafting needed; the probe interval follows."""
        probed = [r for r in batch if r.probing]
        if not probed:
            return
        paid = sum(r.probe_hit for r in probed) >= self._theta * len(probed)
        self.probe_every = PROBE_EVERY if paid else min(MAX_PROBE_EVERY, 2 * self.probe_every)
        for r in probed:
            r.probing = r.probe_hit = False
