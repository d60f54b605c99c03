"""Which drafted nodes a verify pass carries: the measured pass-time curve and the plan over a batch."""

from __future__ import annotations

import pytest

from common.fusion import DraftTree
from services.router.lookup import LOOKUP_ID, LookupCalibration, add_lookup_chain
from services.router.pass_plan import PassCurve, choose_nodes, plan_pass


def cpu_curve() -> PassCurve:
    """46 ms for one row, 77 ms for two, 3 ms a row after (a one-thread CPU target)."""
    curve = PassCurve()
    for rows in (1, 2, 3, 4, 6, 9, 16):
        curve.observe(rows, 0.046 if rows == 1 else 0.077 + 0.003 * (rows - 2))
    return curve


def seconds(rows: int) -> float | None:
    return cpu_curve().predict(rows, 0.003)


def test_the_curve_interpolates_never_falls_and_extends_with_the_slope():
    curve = PassCurve()
    assert curve.predict(3, 0.001) is None
    curve.observe(1, 0.050)
    curve.observe(4, 0.040)  # a noisy quick pass: a larger pass is not predicted quicker
    curve.observe(12, 0.090)
    curve.observe(13, 0.094)  # shares the 16-row bin with the 12-row pass
    assert curve.predict(1, 0.001) == pytest.approx(0.050)
    assert curve.predict(4, 0.001) == pytest.approx(0.050)
    assert curve.predict(100, 0.001) > curve.predict(16, 0.001) > curve.predict(8, 0.001) >= 0.050


def test_a_bin_not_measured_again_stops_counting_and_starts_afresh():
    # a slow moment: two to eight rows measured at three times their cost, then plain passes only
    curve = PassCurve(stale_after=20)
    for rows in range(1, 9):  # passes 1-8
        curve.observe(rows, 0.090 + 0.005 * rows)
    for _ in range(12):  # passes 9-20: the slow bins still count
        curve.observe(1, 0.030)
    assert curve.predict(4, 0.002) > 0.1
    assert choose_nodes(*chains([0.6, 0.4, 0.25]), 1, lambda n: curve.predict(n, 0.002)) == {"r0": set()}
    for _ in range(9):  # passes 21-29: more than 20 passes since the last slow one
        curve.observe(1, 0.030)
    one = curve.predict(1, 0.002)
    assert one == pytest.approx(0.030, abs=1e-3)
    assert curve.predict(4, 0.002) == pytest.approx(one + 3 * 0.002)
    assert choose_nodes(*chains([0.6, 0.4, 0.25]), 1, lambda n: curve.predict(n, 0.002)) == {"r0": {0, 1, 2}}
    # its next pass starts the bin afresh, not averaged with the slow mean
    curve.observe(4, 0.036)
    assert curve.predict(4, 0.002) == pytest.approx(0.036)
    # a bin measured again and again keeps its smoothed mean
    for _ in range(3):
        curve.observe(4, 0.040)
    assert 0.036 < curve.predict(4, 0.002) < 0.040


def chains(*values: list[float]) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Requests r0, r1, ... each with one chain of nodes whose expected tokens are ``values``."""
    return ({f"r{i}": v for i, v in enumerate(values)},
            {f"r{i}": [j - 1 for j in range(len(v))] for i, v in enumerate(values)})


def test_a_slow_start_stops_pricing_rows_out_well_within_a_short_workload():
    # a fresh router's first drafted passes (four requests) ran in a slow moment, as in one bench
    # run: five rows 157 ms, twelve 132, twenty-two 155, where four plain rows take 65
    curve = PassCurve()
    for rows, s in ((5, 0.157), (12, 0.132), (22, 0.155)):
        curve.observe(rows, s)
    curve.observe(4, 0.065)
    four = chains([0.6], [0.6], [0.6], [0.6])  # each request with one node, right 60% of the time

    def plan() -> dict[str, set[int]]:
        return choose_nodes(*four, 4, lambda n: curve.predict(n, 0.0015))

    assert plan() == {f"r{i}": set() for i in range(4)}  # every drafted row priced out: plain rounds
    for _ in range(20):  # the plain rounds of a short workload (a few hundred rounds in all)
        curve.observe(4, 0.065)
    assert plan() == {f"r{i}": {0} for i in range(4)}  # the slow bins no longer count: drafting resumes


def test_one_lone_request_verifies_a_tree_only_when_it_repays_the_jump_to_two_rows():
    # one plain row commits 1 token in 46 ms; a second row costs 31 ms more
    assert choose_nodes(*chains([0.3, 0.2, 0.1]), 1, seconds) == {"r0": set()}
    assert choose_nodes(*chains([0.95, 0.9, 0.85, 0.8]), 1, seconds) == {"r0": {0, 1, 2, 3}}
    assert choose_nodes(*chains([0.95, 0.9, 0.05]), 1, seconds) == {"r0": {0, 1}}  # the unlikely third is not worth its row
    assert choose_nodes(*chains([0.4]), 1, lambda rows: None) == {"r0": {0}}  # nothing measured: verify all, and measure


def test_a_row_slows_every_request_of_the_pass_so_a_full_batch_takes_only_near_certain_nodes():
    def linear(rows: int) -> float:  # 60 ms + 8 ms a row
        return 0.060 + 0.008 * rows

    assert choose_nodes(*chains([0.4]), 1, linear) == {"r0": {0}}  # alone, a 40% node repays its row
    sixteen = chains([0.4], [0.99], *([[]] * 14))
    kept = choose_nodes(*sixteen, 16, linear)
    assert kept["r0"] == set() and kept["r1"] == {0}  # with 15 others waiting on the row, only the sure one


def chain(tokens: list[int], probs: list[float]) -> DraftTree:
    tree = DraftTree(drafter_ids=["a"])
    parent = -1
    for t, p in zip(tokens, probs):
        parent = tree.add(parent, t, p, frozenset({"a"}), frozenset({"a"}))
    return tree


def test_the_plan_keeps_the_likeliest_nodes_of_the_whole_batch_as_whole_subtrees():
    trees = {"strong": chain([1, 2, 3], [0.95, 0.95, 0.95]), "weak": chain([7, 8], [0.15, 0.95])}
    cal = LookupCalibration()
    for _ in range(100):
        for depth in range(4):
            cal.observe(True, 4, depth, True)
    lookups = {"strong": (), "weak": (add_lookup_chain(trees["weak"], [9, 10], 4, True, cal, 0.0, width=2),)}
    out, lk = plan_pass(trees, lookups, plain_rows=2, rates=dict.fromkeys(trees, lambda p: p), seconds=seconds)
    assert out["strong"].tokens == [1, 2, 3]
    # the weak drafter's chain goes (0.15, then 0.14 below it); the lookup branch beside it stays
    assert out["weak"].tokens == [9, 10] and out["weak"].parents == [-1, 0]
    (kept,) = lk["weak"]
    assert kept.nodes == (0, 1) and out["weak"].top1[0] == {LOOKUP_ID}
    assert kept.rates == lookups["weak"][0].rates and lk["strong"] == ()


def test_each_request_is_priced_by_its_own_rates():
    """Two requests with the same drafted chain: the one whose confidences are accepted at a fifth of
    their value (a sampled request's calibration, say) is not worth its rows; the other is."""
    trees = {"greedy": chain([1, 2, 3], [0.9, 0.9, 0.9]), "sampled": chain([1, 2, 3], [0.9, 0.9, 0.9])}
    rates = {"greedy": lambda p: p, "sampled": lambda p: p / 5}
    out, _ = plan_pass(trees, {}, plain_rows=2, rates=rates, seconds=seconds)
    assert out["greedy"].tokens == [1, 2, 3]
    assert len(out["sampled"]) < len(out["greedy"])
    same, _ = plan_pass(trees, {}, plain_rows=2, rates=dict.fromkeys(trees, lambda p: p), seconds=seconds)
    assert same["sampled"].tokens == [1, 2, 3]  # priced alike, kept alike
