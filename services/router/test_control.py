"""Cost-aware speculation control: calibration, the verify cost fit, pricing of nodes and steps."""

from __future__ import annotations

import random

import pytest

from common.spec.fusion import DraftTree
from services.router.control import Calibration, CostModel, SpeculationControl, chain_pays


def test_calibration_learns_the_acceptance_rate_per_confidence():
    cal = Calibration()
    assert cal(0.95) == pytest.approx(0.95) and cal(0.05) == pytest.approx(0.05)  # priors at the midpoints
    rng = random.Random(0)
    for _ in range(2000):  # an overconfident drafter: says 0.9, is right 40% of the time
        cal.observe(0.9, rng.random() < 0.4)
    assert cal(0.91) == pytest.approx(0.4, abs=0.05)
    assert cal(0.35) == pytest.approx(0.35)  # other bins untouched


def test_cost_model_recovers_fixed_and_per_token_cost():
    model = CostModel()
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(1, 80)
        model.observe(n, 0.060 + 0.004 * n + rng.uniform(-0.001, 0.001))
    assert model.fixed_s == pytest.approx(0.060, abs=0.003)
    assert model.slope() == pytest.approx(0.004, rel=0.05)
    assert model.predict(10) == pytest.approx(0.1, rel=0.05)


def fed(control: SpeculationControl, batch: int, accepted_per_request: float) -> SpeculationControl:
    """Feed passes of a verifier costing 60 ms + 4 ms/token at the given batch (k = 4 chains)."""
    for n in (batch * 5, batch * 2, batch * 9, batch * 5):
        busy = 0.060 + 0.004 * n
        control.observe_pass(n, busy, round(batch * (1 + accepted_per_request)))
    return control


def test_threshold_rises_with_load_so_speculation_shrinks():
    idle = fed(SpeculationControl(), batch=1, accepted_per_request=1.5)
    loaded = fed(SpeculationControl(), batch=16, accepted_per_request=1.5)
    assert 0.02 < idle.threshold() < loaded.threshold()
    # at batch 1 a 35%-likely node pays; under load it does not
    assert idle.node_value(1.0, 0.35) >= idle.threshold()
    assert loaded.node_value(1.0, 0.35) < loaded.threshold()


def test_disabled_control_keeps_every_node():
    control = fed(SpeculationControl(enabled=False), batch=16, accepted_per_request=0.1)
    tree = DraftTree(drafter_ids=["a"])
    tree.add(-1, 5, 0.01, frozenset({"a"}), frozenset({"a"}))
    assert control.threshold() == control.min_threshold
    assert len(control.prune(tree)) == 1
    assert control.worth_a_step([0.0], pipelined=False)


def test_prune_drops_cheap_nodes_with_their_descendants():
    control = fed(SpeculationControl(), batch=8, accepted_per_request=1.0)
    theta = control.threshold()
    tree = DraftTree(drafter_ids=["a", "b"])
    n0 = tree.add(-1, 10, 0.95, frozenset({"a"}), frozenset({"a"}))
    n1 = tree.add(n0, 11, 0.95, frozenset({"a"}), frozenset({"a"}))
    low = tree.add(-1, 12, 0.01, frozenset({"b"}), frozenset({"b"}))  # sibling not worth a row
    tree.add(low, 13, 0.99, frozenset({"b"}), frozenset({"b"}))  # its child goes with it
    tree.add(n1, 14, 0.95, frozenset({"a"}), frozenset({"a"}))
    out = control.prune(tree)
    values = []
    for parent, p in zip(out.parents, out.probs):
        values.append(control.node_value(1.0 if parent < 0 else values[parent], p))
    assert all(v >= theta for v in values)
    assert 12 not in out.tokens and 13 not in out.tokens
    assert out.tokens[:2] == [10, 11]
    assert all(p < i for i, p in enumerate(out.parents))  # parents before children, indices remapped
    assert out.source_masks[0] == tree.source_masks[0] and out.drafter_ids == tree.drafter_ids


def test_draft_steps_and_drafters_follow_the_bottleneck():
    control = fed(SpeculationControl(), batch=4, accepted_per_request=2.0)
    control.observe_draft_step(0.010)
    assert control.worth_a_step([0.9, 0.9, 0.8], pipelined=True)
    control.observe_draft_step(5.0)  # drafting got very slow: a step no longer pays
    control.observe_draft_step(5.0)
    assert not control.worth_a_step([0.2], pipelined=True)
    control.observe_round(draft_s=0.05, verify_s=0.20)
    assert control.drafters_per_request(2) == 2
    for _ in range(20):
        control.observe_round(draft_s=0.5, verify_s=0.20)  # drafters are the bottleneck: draft less
    assert control.drafters_per_request(2) == 1


def test_calibration_is_fed_by_the_nodes_the_verifier_tried():
    control = SpeculationControl()
    tree = DraftTree(drafter_ids=["a"])
    n0 = tree.add(-1, 1, 0.85, frozenset({"a"}), frozenset({"a"}))
    tree.add(-1, 2, 0.85, frozenset({"a"}), frozenset({"a"}))
    n2 = tree.add(n0, 3, 0.85, frozenset({"a"}), frozenset({"a"}))
    tree.add(n2, 4, 0.85, frozenset({"a"}), frozenset({"a"}))  # never tried: its parent was rejected
    before = control.calibration.seen[8]
    control.observe_verdict(tree, [n0])
    assert control.calibration.seen[8] == before + 3  # n0 (accepted), its sibling and n2 (rejected)


def test_sampled_requests_have_a_calibration_of_their_own():
    """Greedy verdicts that accept every node at 0.85 do not make a sampled request's 0.85 node look
    sure, and sampled verdicts that reject them leave greedy pricing alone."""
    control = SpeculationControl(min_threshold=0.1)  # no pass measured: the node threshold is this floor
    for accepted in (True, False):
        for _ in range(40):
            tree = DraftTree(drafter_ids=["a"])
            n0 = tree.add(-1, 1, 0.85, frozenset({"a"}), frozenset({"a"}))
            control.observe_verdict(tree, [n0] if accepted else [], greedy=accepted)
    assert control.node_value(1.0, 0.85, greedy=True) > 0.95
    assert control.node_value(1.0, 0.85, greedy=False) < 0.1
    assert control.calibration_for(False) is control.sampled_calibration
    greedy, sampled = control.step_pricing(False, greedy=True), control.step_pricing(False, greedy=False)
    assert greedy.node_value(1.0, 0.85) > 0.95 and sampled.node_value(1.0, 0.85) < 0.1
    tree = DraftTree(drafter_ids=["a"])
    tree.add(-1, 1, 0.85, frozenset({"a"}), frozenset({"a"}))
    assert len(control.prune(tree, greedy=True)) == 1 and len(control.prune(tree, greedy=False)) == 0


def test_the_first_draft_step_is_priced_per_request_so_a_lone_request_stops_paying_for_weak_drafters():
    control = fed(SpeculationControl(), batch=1, accepted_per_request=0.5)
    row = control.first_row_threshold(1)  # a linear pass time here: the first row costs the line's slope
    assert row == pytest.approx(control.threshold())
    assert control.first_node_threshold(1, pipelined=False) == row  # no step measured yet
    for n in (1, 4, 16, 2, 8):  # a first step costs 10 ms + 1 ms per request drafted
        control.observe_draft_step(0.010 + 0.001 * n, first_of=n)
    control.observe_draft_step(0.5)  # a later step: not a first one, the fit ignores it
    alone, batched = control.first_node_threshold(1, pipelined=False), control.first_node_threshold(16, pipelined=False)
    assert control.first_row_threshold(16) < batched < alone
    # a lone request pays the whole step: 11 ms at the verifier's throughput, on top of its row
    assert alone == pytest.approx(row + control.throughput * 0.011, rel=0.05)
    overlapped = control.first_node_threshold(1, pipelined=True)
    assert overlapped == pytest.approx(row + (alone - row) / 2)
    assert (
        SpeculationControl(enabled=False).first_node_threshold(1, pipelined=False) == SpeculationControl().min_threshold
    )


def test_a_second_round_in_flight_pays_only_while_drafting_outlasts_the_verify_pass():
    control = SpeculationControl()
    assert control.pipeline_pays()  # nothing measured yet: as configured
    for _ in range(30):  # verifier-bound: 60 ms passes, 20 ms of drafting per round
        control.observe_pass(16, 0.060, 16)
        control.observe_round(draft_s=0.020, verify_s=0.060)
    assert not control.pipeline_pays() and not control.pipelining
    for _ in range(30):  # drafting now takes 0.9x the pass: inside the hysteresis band, stays off
        control.observe_round(draft_s=0.054, verify_s=0.060)
    assert not control.pipeline_pays()
    for _ in range(30):  # drafter-bound: overlap pays
        control.observe_round(draft_s=0.120, verify_s=0.060)
    assert control.pipeline_pays()
    assert SpeculationControl(enabled=False).pipeline_pays()


def stepped(control: SpeculationControl, passes: int = 40) -> SpeculationControl:
    """Passes as a one-thread CPU target runs them: 46 ms for one row, 77 ms for two, then 3 ms a row."""
    for i in range(passes):
        rows = (1, 2, 5, 9, 1, 1)[i % 6]
        control.observe_pass(rows, 0.046 if rows == 1 else 0.077 + 0.003 * (rows - 2), 1 + rows // 3)
    return control


def test_the_pass_curve_prices_the_first_drafted_row_at_what_it_costs_not_at_the_line():
    control = stepped(SpeculationControl())
    assert control.pass_seconds(1) == pytest.approx(0.046)
    assert control.pass_seconds(2) == pytest.approx(0.077)
    assert control.pass_seconds(7) == pytest.approx(0.092)  # between the 5- and 9-row passes
    assert control.pass_seconds(20) > control.pass_seconds(9)  # beyond: the line's slope
    # the line through these passes says a row costs a few ms; the first one really costs 31
    assert control.cost.slope() < 0.010
    assert control.first_row_threshold(1) == pytest.approx(control.throughput * 0.031, rel=0.01)
    assert control.first_row_threshold(1) > 3 * control.threshold()


def test_a_deeper_drafted_row_is_priced_at_its_own_step_of_the_curve():
    """The plain steps' lookup depths pay each row at its depth: on this curve a request's second
    row costs 31 ms, its third 3 ms, and the third is priced at the 3."""
    control = stepped(SpeculationControl())
    first, second = control.first_row_threshold(1), control.first_row_threshold(1, depth=1)
    assert first == pytest.approx(control.throughput * 0.031, rel=0.01)
    assert second == pytest.approx(control.throughput * 0.003, rel=0.05)
    assert control.first_row_threshold(1, depth=2) == pytest.approx(second, rel=0.05)
    assert (
        SpeculationControl(enabled=False).first_row_threshold(1, depth=1)
        == SpeculationControl(enabled=False).threshold()
    )


def flat(control: SpeculationControl, passes: int = 40) -> SpeculationControl:
    """Passes flat over the first rows, as the runner's CPU kernels make them: 45 ms for one to six
    rows, then 4 ms a row; a pass commits 1.5 tokens; a round's first draft step (which brings the
    drafter's cache up to date) costs 12 ms, a later one 3 ms."""
    for i in range(passes):
        rows = (1, 2, 4, 6, 9, 1)[i % 6]
        control.observe_pass(rows, 0.045 + 0.004 * max(0, rows - 6), 1 + (i % 2))
    return draft_steps(control)


def draft_steps(control: SpeculationControl) -> SpeculationControl:
    """A round's first draft step costs 12 ms, a later one 3 ms."""
    for n in (1, 1, 2):
        control.observe_draft_step(0.012, first_of=n)
        for _ in range(20):
            control.observe_draft_step(0.003)
    return control


def test_a_request_drafts_when_the_best_chain_pays_although_its_first_node_alone_does_not():
    control = flat(SpeculationControl())
    first_only = control.first_node_threshold(1, pipelined=False)
    chain = control.first_node_threshold(1, pipelined=False, chain=5)
    # one node: a free row but a whole first draft step (~0.4 tokens at ~33 tokens/s); a chain on the
    # flat rows shares that step's cost among up to a + a^2 + ... expected tokens
    assert first_only == pytest.approx(control.throughput * 0.012, rel=0.05)
    assert chain < 0.9 * first_only
    costs = control.chain_costs(1, 5, share=1.0)
    assert costs is not None and len(costs) == 5
    assert chain_pays(chain + 0.01, costs) and not chain_pays(chain - 0.01, costs)
    # beyond the flat rows a longer chain costs its rows: a 5-chain then needs a better first node
    steep = draft_steps(stepped(SpeculationControl()))
    assert steep.first_node_threshold(1, pipelined=False, chain=5) > chain
    # the chain never asks more of the first node than the first node alone
    assert steep.first_node_threshold(1, pipelined=False, chain=5) <= steep.first_node_threshold(1, pipelined=False)


def test_a_few_drafting_requests_draft_while_the_rest_is_verified_but_most_make_the_round_wait():
    """On the flat curve (45 ms up to six rows, a 12 ms first draft step): two drafting requests of
    twelve draft while the other ten are verified (22 request-rounds in 61 + 101 ms against 12 in
    21 + 101 ms); three of four make the round wait (5 in 45 + 61 ms against 4 in 15 + 61 ms)."""
    control = flat(SpeculationControl())
    assert control.drafting_ahead_pays(12, 2, chain=4)
    assert not control.drafting_ahead_pays(4, 3, chain=2)
    assert not control.drafting_ahead_pays(12, 12, chain=4)  # nobody left to verify meanwhile
    assert not control.drafting_ahead_pays(12, 0, chain=4)
    assert not SpeculationControl().drafting_ahead_pays(12, 2, chain=4)  # nothing measured yet
    assert not flat(SpeculationControl(enabled=False)).drafting_ahead_pays(12, 2, chain=4)
    # slow drafters: the rest go on in several passes while they work
    slow = flat(SpeculationControl())
    for n in (1, 2, 3):
        slow.observe_draft_step(0.2, first_of=n)
    assert slow.drafting_ahead_pays(4, 3, chain=2)


def test_drafting_ahead_pays_for_the_slowdown_of_the_pass_beside_it():
    """Passes that ran beside drafter work measured 2.5x their prediction (drafters sharing the
    verifier's cores): the others' pass during the drafting costs that much more, and two drafting
    requests of twelve no longer draft ahead (22 request-rounds in 152 + 101 ms against 12 in
    21 + 101 ms). Passes beside drafters as quick as the others change nothing."""
    control = flat(SpeculationControl())
    assert control.overlap_slowdown() == 1.0  # nothing measured beside drafters yet
    same = flat(SpeculationControl())
    for _ in range(10):
        same.observe_pass(6, 0.045, 1, beside=True)
    assert abs(same.overlap_slowdown() - 1.0) < 0.05
    assert same.drafting_ahead_pays(12, 2, chain=4)
    for _ in range(10):
        control.observe_pass(6, 2.5 * 0.045, 1, beside=True)
    assert 2.2 < control.overlap_slowdown() < 2.6
    assert not control.drafting_ahead_pays(12, 2, chain=4)
    # slow drafters still draft ahead: the rest go on while they work, however slowly
    for n in (1, 2, 3):
        control.observe_draft_step(0.5, first_of=n)
    assert control.drafting_ahead_pays(4, 3, chain=2)


def test_a_round_s_time_beside_its_passes_is_learned_but_a_lone_stall_barely_moves_it():
    control = SpeculationControl()
    assert control.round_overhead_s == 0.0  # unmeasured: the plan prices passes alone
    for _ in range(30):  # a far verifier: 30 ms on the way, every round
        control.observe_overhead(0.030)
    assert control.round_overhead_s == pytest.approx(0.030)
    control.observe_overhead(1.0)  # a one-off stall of a second (a collection, a swapped page)
    assert control.round_overhead_s < 0.050
    control.observe_overhead(-0.001)  # a clock that stepped back: ignored
    assert control.round_overhead_s < 0.050
    near = SpeculationControl()
    near.observe_overhead(0.0005)
    for _ in range(40):  # the verifier moved far away: learned within a few dozen rounds
        near.observe_overhead(0.030)
    assert near.round_overhead_s == pytest.approx(0.030, rel=0.05)
