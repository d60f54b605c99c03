"""The draft gate: who drafts, the first-node record, and the probe interval's back-off."""

from __future__ import annotations

import pytest

from common.spec_types import GREEDY
from services.router.control import SpeculationControl
from services.router.gate import MAX_PROBE_EVERY, PROBE_EVERY, DraftGate
from services.router.requests import Request, RouterConfig


def request(rid: str, first_accept: float) -> Request:
    return Request(rid, (1, 2, 3), 16, GREEDY, frozenset(), first_accept=first_accept)


def loaded_control() -> SpeculationControl:
    """A verifier at 60 ms + 4 ms a row, committing 16 tokens a pass of 16 requests."""
    control = SpeculationControl()
    for rows in (16, 32, 24, 48, 16, 40):
        control.observe_pass(rows, 0.060 + 0.004 * rows, 16)
    return control


def test_a_request_drafts_only_while_its_first_node_pays_and_is_probed_on_the_interval():
    gate = DraftGate(RouterConfig(), loaded_control())
    good, poor = request("good", 0.99), request("poor", 0.01)
    assert gate.drafts(good, 16, round_index=3, pipelined=False)
    assert not gate.drafts(poor, 16, round_index=3, pipelined=False) and not poor.probing
    assert gate.drafts(poor, 16, round_index=PROBE_EVERY, pipelined=False) and poor.probing
    # without cost control everyone drafts; without speculation nobody does
    assert DraftGate(RouterConfig(cost_control=False), loaded_control()).drafts(poor, 16, 3, False)
    assert not DraftGate(RouterConfig(speculate=False), loaded_control()).drafts(good, 16, PROBE_EVERY, False)


def test_the_first_node_record_counts_a_draft_the_pass_left_out_as_a_rejection():
    gate = DraftGate(RouterConfig(), loaded_control())
    r = request("r", 0.5)
    gate.observe(r, drafted=True, verified_model_nodes=True, first_accepted_is_model=True)
    assert r.first_accept == pytest.approx(0.65)
    gate.observe(r, drafted=True, verified_model_nodes=False, first_accepted_is_model=False)
    assert r.first_accept == pytest.approx(0.65 * 0.7)
    before = r.first_accept
    gate.observe(r, drafted=False, verified_model_nodes=False, first_accepted_is_model=False)  # plain decoding: no news
    assert r.first_accept == before


def test_probe_rounds_back_off_while_they_find_nothing_and_reset_once_they_pay():
    gate = DraftGate(RouterConfig(), loaded_control())
    intervals = []
    round_index = 0
    for _ in range(5):  # probe rounds whose first nodes are all rejected
        round_index = (round_index // gate.probe_every + 1) * gate.probe_every  # the next probe round
        assert not gate.drafts(request("x", 0.01), 16, round_index - 1, False)
        batch = [request(f"p{i}", 0.01) for i in range(16)]
        assert all(gate.drafts(r, 16, round_index, False) for r in batch)
        for r in batch:
            gate.observe(r, drafted=True, verified_model_nodes=True, first_accepted_is_model=False)
        gate.settle(batch)
        assert not any(r.probing for r in batch)
        intervals.append(gate.probe_every)
    assert intervals == [16, 32, 64, MAX_PROBE_EVERY, MAX_PROBE_EVERY]
    round_index = (round_index // gate.probe_every + 1) * gate.probe_every
    batch = [request(f"q{i}", 0.01) for i in range(16)]
    for r in batch:  # the text changed: every probe's first node is accepted
        assert gate.drafts(r, 16, round_index, False)
        gate.observe(r, drafted=True, verified_model_nodes=True, first_accepted_is_model=True)
    gate.settle(batch)
    assert gate.probe_every == PROBE_EVERY


def test_a_new_request_starts_from_what_drafting_did_for_the_recent_ones():
    gate = DraftGate(RouterConfig(), loaded_control())
    start = gate.first_accept_prior
    for i in range(60):  # under this load the drafters' first nodes keep missing
        gate.observe(request(f"m{i}", 0.5), drafted=True, verified_model_nodes=True, first_accepted_is_model=False)
    assert gate.first_accept_prior < 0.1 * start
    newcomer = request("new", gate.first_accept_prior)
    assert not gate.drafts(newcomer, 16, round_index=3, pipelined=False)  # it does not draft to find out
    for i in range(60):
        gate.observe(request(f"h{i}", 0.5), drafted=True, verified_model_nodes=True, first_accepted_is_model=True)
    assert gate.first_accept_prior > 0.9
