"""Pricing the drafters beyond a request's first: what they bring, what they cost, the decision."""

from __future__ import annotations

import pytest

from common.spec.fusion import DraftTree
from services.router.control import EXTRAS_MIN_ROUNDS, EXTRAS_PROBE_EVERY, SpeculationControl
from services.router.drafting import extras_gain, extras_seconds
from services.router.lookup import LOOKUP_ID


def tree_of(nodes: list[tuple[int, int, set[str]]]) -> DraftTree:
    """(parent, token, proposers) per node, in order."""
    tree = DraftTree(drafter_ids=[])
    for parent, token, by in nodes:
        tree.add(parent, token, 0.5, frozenset(by), frozenset(by))
    return tree


def test_gain_is_the_accepted_path_from_the_first_node_the_lead_did_not_propose():
    # lead "g" proposed nodes 0 and 1; node 2 (child of 1) only the extra "x"; node 3 (child of 2) both
    tree = tree_of([(-1, 10, {"g", "x"}), (0, 11, {"g"}), (1, 12, {"x"}), (2, 13, {"g", "x"})])
    assert extras_gain(tree, ["g", "x"], (0, 1, 2, 3)) == 2  # nodes 2 and 3 hang on x's proposal
    assert extras_gain(tree, ["g", "x"], (0, 1)) == 0  # the extra's node was not accepted
    assert extras_gain(tree, ["x", "g"], (0, 1, 2, 3)) == 3  # with x leading, g alone brought node 1 on
    assert extras_gain(tree, ["g"], (0, 1, 2, 3)) == 0  # one drafter: nothing extra
    # a node the lookup drafter proposed too would have been there without the extra drafter
    tree.source_masks[2] |= tree.mask_of({LOOKUP_ID})
    assert extras_gain(tree, ["g", "x"], (0, 1, 2, 3)) == 0


def test_gain_of_a_lead_missing_from_the_tree_is_zero():
    tree = tree_of([(-1, 10, {"x"})])
    assert extras_gain(tree, ["g", "x"], (0,)) == 0


def test_seconds_are_the_share_of_drafters_that_are_nobody_s_first():
    assert extras_seconds({"a": ["g", "x"]}, 0.020) == pytest.approx(0.010)
    # x leads request b: it would run anyway, so only y is extra
    assert extras_seconds({"a": ["g", "x"], "b": ["x", "y"]}, 0.030) == pytest.approx(0.010)
    assert extras_seconds({"a": ["g"], "b": []}, 0.030) == 0.0
    assert extras_seconds({}, 0.030) == 0.0


def loaded(control: SpeculationControl) -> SpeculationControl:
    """A verifier committing 36 tokens per busy second (one client's figure)."""
    for n in (2, 5, 3, 6):
        control.observe_pass(n, 0.05 + 0.002 * n, 2)
    assert control.throughput > 0
    return control


def test_extras_that_do_not_repay_their_time_are_dropped_then_probed_and_restored():
    control = loaded(SpeculationControl())
    assert control.drafters_per_request(2) == 2  # nothing measured yet
    for _ in range(EXTRAS_MIN_ROUNDS + 2):
        control.observe_extras(0, 0.012, pipelined=False)  # 12 ms of draft time for nothing
    assert not control.extras_pay()
    asked = [control.drafters_per_request(2) for _ in range(2 * EXTRAS_PROBE_EVERY)]
    assert asked.count(2) == 2 and asked.count(1) == 2 * EXTRAS_PROBE_EVERY - 2  # probes only
    for _ in range(20):
        control.observe_extras(2, 0.012, pipelined=False)  # the probes find two tokens a round
    assert control.extras_pay()
    assert all(control.drafters_per_request(2) == 2 for _ in range(EXTRAS_PROBE_EVERY))


def test_overlapped_drafting_halves_the_extras_cost():
    seq, piped = loaded(SpeculationControl()), loaded(SpeculationControl())
    for _ in range(EXTRAS_MIN_ROUNDS):
        seq.observe_extras(1, 0.010, pipelined=False)
        piped.observe_extras(1, 0.010, pipelined=True)
    assert piped.extras_cost == pytest.approx(seq.extras_cost / 2)


def test_without_cost_control_the_configured_count_stands():
    control = loaded(SpeculationControl(enabled=False))
    for _ in range(EXTRAS_MIN_ROUNDS + 2):
        control.observe_extras(0, 1.0, pipelined=False)
    assert control.drafters_per_request(3) == 3
