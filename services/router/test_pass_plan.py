"""Which drafted nodes a verify pass carries: the measured pass-time curve and the plan over a batch."""

from __future__ import annotations

import pytest

from common.spec.fusion import DraftTree
from services.router.core import RouterCore
from services.router.inprocess import LocalDrafterPool
from services.router.lookup import LOOKUP_ID, LookupCalibration, add_lookup_chain
from services.router.pass_plan import PassCurve, choose_nodes, plan_pass
from services.router.settings import RouterSettings


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
    return (
        {f"r{i}": v for i, v in enumerate(values)},
        {f"r{i}": [j - 1 for j in range(len(v))] for i, v in enumerate(values)},
    )


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
    assert choose_nodes(*chains([0.95, 0.9, 0.05]), 1, seconds) == {
        "r0": {0, 1}
    }  # the unlikely third is not worth its row
    assert choose_nodes(*chains([0.4]), 1, lambda rows: None) == {
        "r0": {0}
    }  # nothing measured: verify all, and measure


def test_a_row_slows_every_request_of_the_pass_so_a_full_batch_takes_only_near_certain_nodes():
    def linear(rows: int) -> float:  # 60 ms + 8 ms a row
        return 0.060 + 0.008 * rows

    assert choose_nodes(*chains([0.4]), 1, linear) == {"r0": {0}}  # alone, a 40% node repays its row
    sixteen = chains([0.4], [0.99], *([[]] * 14))
    kept = choose_nodes(*sixteen, 16, linear)
    assert kept["r0"] == set() and kept["r1"] == {0}  # with 15 others waiting on the row, only the sure one


def test_a_drafted_round_is_priced_against_the_plain_steps_it_forfeits_round_trip_included():
    """Four sampled requests on the AVX-512 Xeon's pass curve (four rows 22 ms, then about 1.5 ms a
    row), each with one lookup node worth 0.3 tokens."""

    def xeon(rows: int) -> float:
        return {4: 0.0220, 5: 0.0238, 6: 0.0251, 7: 0.0270, 8: 0.0279}[rows]

    four = chains([0.3], [0.3], [0.3], [0.3])
    # against one plain pass, with the round trip left out: every node repays its row
    assert all(k == {0} for k in choose_nodes(*four, 4, xeon).values())
    # with the round's 2.5 ms beside its pass on both sides, one plain pass is dearer than it looked,
    # and the rows still pay
    assert all(k == {0} for k in choose_nodes(*four, 4, xeon, overhead_s=0.0025).values())
    # against four plain steps for one round trip (4 tokens in 90.5 ms): 1.2 tokens in 30.4 ms do not
    assert all(k == set() for k in choose_nodes(*four, 4, xeon, overhead_s=0.0025, plain_steps=4).values())
    # nodes that are right four times in five still beat the steps
    sure = chains([0.8], [0.8], [0.8], [0.8])
    assert all(k == {0} for k in choose_nodes(*sure, 4, xeon, overhead_s=0.0025, plain_steps=4).values())
    # steps with no round trip to save are plain passes: nothing changes
    assert choose_nodes(*four, 4, xeon, plain_steps=4) == choose_nodes(*four, 4, xeon)


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


def tiled_prior() -> list[tuple[int, float]]:
    """A CPU's pass by rows, timed at load: 16 ms for one row, 1 ms more a row up to eight, a tile
    of eight more rows costs 6 ms at once and 1 ms a row (2 more past sixteen): sixteen rows 37 ms, seventeen 48."""

    def t(rows: int) -> float:
        tiles = (rows - 1) // 8
        return 0.016 + 0.001 * (rows - 1) + 0.006 * tiles + (0.002 if rows > 16 else 0.0) * tiles

    return [(r, t(r)) for r in (*range(1, 21), 24, 32)]


def test_the_prior_prices_a_step_that_no_pass_here_has_measured():
    prior = dict(tiled_prior())
    curve = PassCurve()
    curve.set_prior(list(prior.items()))
    assert curve.predict(17, 0.001) == pytest.approx(prior[17])  # nothing measured yet: the prior itself
    # a loaded machine: sixteen plain rows and a 24-row pass measured at 1.5 times the prior
    for _ in range(3):
        curve.observe(16, 1.5 * prior[16])
        curve.observe(24, 1.5 * prior[24])
    assert curve.predict(16, 0.001) == pytest.approx(1.5 * prior[16])
    assert curve.predict(17, 0.001) == pytest.approx(1.5 * prior[17])  # the step, at the measured level
    assert curve.predict(40, 0.001) > curve.predict(32, 0.001) > curve.predict(24, 0.001)  # beyond: the prior's slope
    plain = PassCurve()  # the same passes without the prior: a line between 16 and 24 rows misses the step
    for _ in range(3):
        plain.observe(16, 1.5 * prior[16])
        plain.observe(24, 1.5 * prior[24])
    assert plain.predict(17, 0.001) < 1.5 * prior[17] - 0.004
    # four requests with two nodes each: the first four fill the tile of eight rows; with the step
    # at nine priced, the second nodes (54% each) do not repay it; on a line from 4 to 16 rows they do
    four = chains([0.9, 0.6], [0.9, 0.6], [0.9, 0.6], [0.9, 0.6])
    level = PassCurve()
    level.set_prior(list(prior.items()))
    line = PassCurve()
    for rows in (4, 16):
        level.observe(rows, prior[rows])
        line.observe(rows, prior[rows])
    assert all(k == {0} for k in choose_nodes(*four, 4, lambda n: level.predict(n, 0.001)).values())
    assert all(k == {0, 1} for k in choose_nodes(*four, 4, lambda n: line.predict(n, 0.001)).values())


def test_the_prior_takes_the_level_of_the_bins_around_each_size():
    curve = PassCurve()
    curve.set_prior([(1, 0.010), (4, 0.012), (8, 0.016), (2, 0.005)])  # a noisy quick point never lowers the curve
    assert curve.predict(2, 0.0) == pytest.approx(0.010)
    curve.observe(1, 0.020)  # one row at twice the prior, eight at 1.5 times: four between the two
    curve.observe(8, 0.024)
    ratio_at_4 = 2.0 + (4 - 1) / (8 - 1) * (1.5 - 2.0)
    assert curve.predict(4, 0.0) == pytest.approx(0.012 * ratio_at_4)
    assert curve.predict(12, 0.0) == pytest.approx(
        1.5 * (0.016 + 0.001 * 4)
    )  # the last segment's slope, the last bin's level


class UntimedVerifier:
    """A verifier backend without ``pass_times`` (one that did not time its pass at load)."""

    async def verify(self, items):
        raise AssertionError("not called")

    def release(self, request_ids):
        pass


class TimedVerifier(UntimedVerifier):
    pass_times = ((1, 0.020), (8, 0.024), (9, 0.031), (16, 0.040))


def test_the_router_prices_rows_by_the_verifier_s_timing_before_any_pass_of_its_own():
    core = RouterCore(RouterSettings(), LocalDrafterPool({}), TimedVerifier())
    assert core.control.pass_seconds(8) == pytest.approx(0.024)
    assert core.control.pass_seconds(9) == pytest.approx(0.031)  # the step, not a line from 8 to 16
    untimed = RouterCore(RouterSettings(), LocalDrafterPool({}), UntimedVerifier())
    assert untimed.control.pass_seconds(8) is None  # every node verified until passes are measured
