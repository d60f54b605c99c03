"""The draft gate: who drafts, the first-node record, and the probe interval's back-off."""

from __future__ import annotations

import pytest

from common.spec.types import GREEDY
from services.router.control import SpeculationControl
from services.router.gate import FIRST_ACCEPT_START, MAX_PROBE_EVERY, PROBE_EVERY, PROBE_SLOTS, DraftGate, probe_order
from services.router.requests import Request
from services.router.settings import RouterSettings


def request(rid: str, first_accept: float, domain: str = "", guess: str = "") -> Request:
    return Request(
        rid, (1, 2, 3), 16, GREEDY, frozenset(), domain=domain, domain_guess=guess, first_accept=first_accept
    )


def loaded_control() -> SpeculationControl:
    """A verifier at 60 ms + 4 ms a row, committing 16 tokens a pass of 16 requests."""
    control = SpeculationControl()
    for rows in (16, 32, 24, 48, 16, 40):
        control.observe_pass(rows, 0.060 + 0.004 * rows, 16)
    return control


def test_a_request_drafts_only_while_its_first_node_pays_and_is_probed_on_the_interval():
    gate = DraftGate(RouterSettings(), loaded_control())
    good, poor = request("good", 0.99), request("poor", 0.01)
    assert gate.drafts(good, 16, round_index=3, pipelined=False)
    assert not gate.drafts(poor, 16, round_index=3, pipelined=False) and not poor.probing
    assert gate.drafts(poor, 16, round_index=PROBE_EVERY, pipelined=False) and poor.probing
    # without cost control everyone drafts; without speculation nobody does
    assert DraftGate(RouterSettings(cost_control=False), loaded_control()).drafts(poor, 16, 3, False)
    assert not DraftGate(RouterSettings(speculate=False), loaded_control()).drafts(good, 16, PROBE_EVERY, False)


def test_the_first_node_record_counts_a_draft_the_pass_left_out_as_a_rejection():
    gate = DraftGate(RouterSettings(), loaded_control())
    r = request("r", 0.5)
    gate.observe(r, drafted=True, verified_model_nodes=True, first_accepted_is_model=True)
    assert r.first_accept == pytest.approx(0.65)
    gate.observe(r, drafted=True, verified_model_nodes=False, first_accepted_is_model=False)
    assert r.first_accept == pytest.approx(0.65 * 0.7)
    before = r.first_accept
    gate.observe(r, drafted=False, verified_model_nodes=False, first_accepted_is_model=False)  # plain decoding: no news
    assert r.first_accept == before


def test_probe_rounds_back_off_while_they_find_nothing_and_reset_once_they_pay():
    gate = DraftGate(RouterSettings(), loaded_control())
    intervals = []
    round_index = 0
    for _ in range(5):  # probe rounds whose first nodes are all rejected
        round_index = (round_index // gate.probe_every + 1) * gate.probe_every  # the next probe round
        assert not gate.drafts(request("x", 0.01), 16, round_index - 1, False)
        batch = [request(f"p{i}", 0.01) for i in range(16)]
        assert sum(gate.drafts(r, 16, round_index, False) for r in batch) == PROBE_SLOTS
        for r in batch:
            gate.observe(r, drafted=True, verified_model_nodes=True, first_accepted_is_model=False)
        gate.settle(batch)
        assert not any(r.probing for r in batch)
        intervals.append(gate.probe_every)
    assert intervals == [16, 32, 64, MAX_PROBE_EVERY, MAX_PROBE_EVERY]
    round_index = (round_index // gate.probe_every + 1) * gate.probe_every
    batch = [request(f"q{i}", 0.01) for i in range(16)]
    for r in batch:  # the text changed: the probe's first node is accepted
        drafted = gate.drafts(r, 16, round_index, False)
        gate.observe(r, drafted=drafted, verified_model_nodes=drafted, first_accepted_is_model=drafted)
    gate.settle(batch)
    assert gate.probe_every == PROBE_EVERY


def test_a_new_request_starts_from_what_drafting_did_for_the_recent_ones():
    gate = DraftGate(RouterSettings(), loaded_control())
    start = gate.first_accept_prior
    for i in range(60):  # under this load the drafters' first nodes keep missing
        gate.observe(request(f"m{i}", 0.5), drafted=True, verified_model_nodes=True, first_accepted_is_model=False)
    assert gate.first_accept_prior < 0.1 * start
    newcomer = request("new", gate.first_accept_prior)
    assert not gate.drafts(newcomer, 16, round_index=3, pipelined=False)  # it does not draft to find out
    for i in range(60):
        gate.observe(request(f"h{i}", 0.5), drafted=True, verified_model_nodes=True, first_accepted_is_model=True)
    assert gate.first_accept_prior > 0.9


@pytest.mark.parametrize("by_domain", [True, False])
def test_misses_on_one_domain_do_not_turn_drafting_off_for_another(by_domain):
    """A mixed stream: the drafters' first nodes keep missing on chat and hit on arithmetic. Per
    domain, a new arithmetic request starts from arithmetic's record and drafts, a new chat request
    does not; with one record for every request, the chat misses turn the arithmetic newcomer off too."""
    gate = DraftGate(RouterSettings(domain_gate=by_domain), loaded_control())
    for i in range(40):
        chat = request(f"c{i}", 0.5, domain="chat")
        gate.observe(chat, drafted=True, verified_model_nodes=True, first_accepted_is_model=False)
        gate.observe(chat, drafted=True, verified_model_nodes=True, first_accepted_is_model=False)
        gate.observe(chat, drafted=True, verified_model_nodes=True, first_accepted_is_model=False)
        gate.observe(
            request(f"a{i}", 0.5, guess="arithmetic"),
            drafted=True,
            verified_model_nodes=True,
            first_accepted_is_model=True,
        )
    arithmetic = request("a-new", gate.start("arithmetic"), guess="arithmetic")
    chat = request("c-new", gate.start("chat"), domain="chat")
    assert not gate.drafts(chat, 16, round_index=3, pipelined=False)
    assert gate.drafts(arithmetic, 16, round_index=3, pipelined=False) == by_domain
    # a request whose domain nobody knows starts from every request's record (3 misses to a hit here)
    assert gate.start("") == gate.first_accept_prior < 0.5
    if by_domain:  # a domain never seen starts from the optimistic default: it finds out once
        assert gate.start("records") == FIRST_ACCEPT_START and gate.start("arithmetic") > 0.9 > 0.1 > gate.start("chat")


def test_probes_back_off_per_domain():
    """Probes that keep missing on chat space out chat's probes only; code's stay every 8 rounds."""
    gate = DraftGate(RouterSettings(), loaded_control())
    for round_index in (8, 16, 32):
        batch = [request(f"c{round_index}-{i}", 0.01, domain="chat") for i in range(4)]
        batch += [request(f"k{round_index}-{i}", 0.01, guess="code") for i in range(4)]
        probing = [r for r in batch if gate.drafts(r, 8, round_index, False)]
        assert all(r.probing for r in probing) and sorted(r.domain or r.domain_guess for r in probing) == [
            "chat",
            "code",
        ]
        for r in probing:
            gate.observe(r, drafted=True, verified_model_nodes=True, first_accepted_is_model=r.domain != "chat")
        gate.settle(batch)
    assert gate.record("chat").probe_every == 8 * 2**3 == MAX_PROBE_EVERY
    assert gate.record("code").probe_every == PROBE_EVERY
    assert gate.drafts(request("k", 0.01, guess="code"), 8, 40, False)  # a code probe round
    assert not gate.drafts(request("c", 0.01, domain="chat"), 8, 40, False)  # not chat's
    # once routed, a request is gated by its routing domain, not by the guess it was submitted with
    routed = request("r", 0.01, domain="chat", guess="code")
    assert not gate.drafts(routed, 8, 40, False)


def test_a_probe_round_probes_one_request_a_domain_and_the_requests_take_turns():
    """Sixteen turned-down requests of two domains: each probe round drafts for one of each domain
    (a probe catches a request's drafters up on everything committed since it last drafted, so all
    of them at once would stall the batch), the least recently probed one, until every one had its turn."""
    gate = DraftGate(RouterSettings(), loaded_control())
    batch = [request(f"c{i}", 0.01, guess="chat") for i in range(8)] + [
        request(f"k{i}", 0.01, guess="code") for i in range(8)
    ]
    turns: list[list[str]] = []
    for round_index in range(PROBE_EVERY, 9 * PROBE_EVERY, PROBE_EVERY):
        probing = [r.request_id for r in probe_order(batch) if gate.drafts(r, 16, round_index, False)]
        turns.append(sorted(probing))
        for r in batch:  # the probes' first nodes are accepted (the interval stays at 8 rounds)...
            gate.observe(r, drafted=r.probing, verified_model_nodes=r.probing, first_accepted_is_model=r.probing)
            r.first_accept = 0.01  # ...but every request stays turned down
        gate.settle(batch)
        assert not gate.drafts(batch[0], 16, round_index + 1, False)  # no probe between probe rounds
    assert all(len(t) == 2 and t[0].startswith("c") and t[1].startswith("k") for t in turns)
    assert sorted(rid for t in turns for rid in t) == sorted(r.request_id for r in batch)  # everyone once


def test_probes_take_at_most_their_share_of_the_time_and_domains_still_probe_together():
    """Probes charged 0.3 s of drafting at a 3% share: no probe round is granted for the next 10 s,
    whatever the round intervals say, and a closed window does not use up a domain's slot: on the
    first probe round after it, every domain probes again, together."""
    now = [100.0]
    gate = DraftGate(RouterSettings(probe_share=0.03), loaded_control(), clock=lambda: now[0])

    def probes(round_index: int) -> list[str]:
        batch = [request(f"{d}{round_index}", 0.01, guess=d) for d in ("chat", "code")]
        got = sorted(r.domain_guess for r in batch if gate.drafts(r, 16, round_index, False))
        for r in batch:  # the probes find nothing new, but their interval is not the point here
            r.probe_hit = True
        gate.settle(batch)
        return got

    assert probes(PROBE_EVERY) == ["chat", "code"]
    gate.charge_probes(0.4, probes=2, requests=4)  # the probes' half of a 0.4 s call
    gate.charge_probes(0.1, probes=1, requests=1)  # charges add up
    assert gate.probes_open_at == pytest.approx(110.0)
    now[0] = 109.9
    assert probes(2 * PROBE_EVERY) == []
    now[0] = 110.0
    assert probes(2 * PROBE_EVERY + 1) == []  # not a probe round
    assert probes(3 * PROBE_EVERY) == ["chat", "code"]
    # a request whose first node pays drafts whatever the probes' window
    gate.charge_probes(1.0, probes=1, requests=1)
    assert gate.drafts(request("good", 0.99, guess="chat"), 16, 3 * PROBE_EVERY + 1, False)
