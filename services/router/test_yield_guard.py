"""The yield guard on a simulated router (rounds whose yields per arm and level are set by the
test, on a clock the test moves, so every decision is exact), and in the router core with the
real engines, where drafted rows are made dearer than the cost control can see."""

from __future__ import annotations

import asyncio

import pytest

from common.spec.types import GREEDY
from services.router.conftest import MAX_NEW
from services.router.core import RouterCore
from services.router.inprocess import LocalDrafterPool, LocalVerifier, output_of
from services.router.settings import RouterSettings
from services.router.yield_guard import (
    EXPLORE_MAX,
    EXPLORE_START,
    WARMUP_ROUNDS,
    Level,
    YieldGuard,
    covered,
    level_label,
    level_of,
)


class Sim:
    """A router whose rounds at each level take ``round_s`` and commit ``rates[arm]`` tokens per second."""

    def __init__(self, epoch_rounds: int = 4, epoch_s: float = 0.05) -> None:
        self.now = 0.0
        self.settled: list[tuple[int, str]] = []
        self.guard = YieldGuard(
            epoch_rounds, epoch_s, 16, lambda: self.now, lambda level, rec, flip: self.settled.append((level, flip))
        )
        self.arms: list[bool] = []  # plain or not, every round

    def rounds(
        self, n: int, pool: int, speculate: float, plain: float, round_s: float = 0.02, sampled: bool = False
    ) -> None:
        for _ in range(n):
            ticket = self.guard.begin(pool, sampled)
            self.arms.append(ticket.plain)
            self.now += round_s
            rate = plain if ticket.plain else speculate
            self.guard.end(ticket, round(rate * round_s), round_s / 2)

    def flips(self, flip: str) -> int:
        return sum(f == flip for _, f in self.settled)


def test_levels_are_pool_sizes_up_to_a_power_of_two_capped_at_a_rounds_requests():
    assert [level_of(n, 16) for n in (0, 1, 2, 3, 4, 5, 9, 16, 40)] == [1, 1, 2, 4, 4, 8, 16, 16, 16]
    assert [level_label(x) for x in (1, 2, 4, 16)] == ["1", "2", "3-4", "9-16"]


def test_covered_time_counts_overlapping_rounds_once_and_gaps_not_at_all():
    assert covered([(0.0, 1.0), (0.5, 1.5), (3.0, 4.0), (3.2, 3.4)]) == pytest.approx(2.5)
    assert covered([]) == 0.0


def test_speculation_that_yields_less_than_plain_is_withdrawn_after_one_epoch_of_each():
    sim = Sim()
    sim.rounds(40, pool=16, speculate=800, plain=1000)
    rec = sim.guard.record(16)
    assert rec.withdrawn
    assert sim.flips("withdrawn") == 1
    # one epoch of speculation (4 rounds), one of plain, and from then on plain but for control groups
    assert sim.arms[:4] == [False] * 4 and sim.arms[4:8] == [True] * 4
    assert sum(not plain for plain in sim.arms[8:]) <= 4 * (len(sim.arms[8:]) // (4 * EXPLORE_START) + 1)
    assert rec.speculate.per_s == pytest.approx(800, rel=0.05) and rec.plain.per_s == pytest.approx(1000, rel=0.05)


def test_speculation_that_pays_keeps_its_level_and_plain_runs_only_as_a_thinning_control_group():
    sim = Sim()
    sim.rounds(4 * 200, pool=1, speculate=1300, plain=1000)
    assert sim.guard.record(1).explore_every == EXPLORE_MAX
    sim = Sim()  # near break-even the control group confirms narrowly: the interval grows by halves
    sim.rounds(4 * 8, pool=1, speculate=1050, plain=1000)
    assert sim.guard.record(1).explore_every == 2 * EXPLORE_START
    sim = Sim()
    sim.rounds(4 * 200, pool=1, speculate=1300, plain=1000)
    rec = sim.guard.record(1)
    assert not rec.withdrawn and sim.flips("withdrawn") == 0
    assert rec.explore_every == EXPLORE_MAX
    # the early plain epoch plus control groups, each confirming by a clear margin: every 16, then 64 epochs
    assert sum(sim.arms) / len(sim.arms) < 0.04


def test_withdrawn_speculation_is_readmitted_once_its_rows_are_cheap_again():
    sim = Sim()
    sim.rounds(4 * 100, pool=16, speculate=500, plain=1000)  # long enough for the control group to thin out
    rec = sim.guard.record(16)
    assert rec.withdrawn and rec.explore_every == EXPLORE_MAX
    start = len(sim.arms)
    sim.rounds(4 * (EXPLORE_MAX + 3), pool=16, speculate=1500, plain=1000)
    assert not rec.withdrawn and sim.flips("readmitted") == 1
    readmitted_at = next(i for i, (_, f) in enumerate(sim.settled) if f == "readmitted")
    assert readmitted_at > 0
    # and from the flip on, speculation runs but for the control groups
    tail = sim.arms[start + 4 * (EXPLORE_MAX + 1) :]
    assert tail and sum(tail) / len(tail) <= 0.25


def test_each_load_level_has_its_own_verdict_and_sampling_pools_are_levels_of_their_own():
    sim = Sim()
    for _ in range(30):
        sim.rounds(4, pool=1, speculate=1300, plain=1000)
        sim.rounds(4, pool=16, speculate=700, plain=1000)
        sim.rounds(4, pool=4, speculate=1300, plain=1000)
        sim.rounds(4, pool=4, speculate=800, plain=1000, sampled=True)
    assert not sim.guard.record(1).withdrawn
    assert sim.guard.record(16).withdrawn
    assert not sim.guard.record(4).withdrawn
    assert sim.guard.record(Level(4, sampled=True)).withdrawn
    assert Level(4, sampled=True).label == "3-4 sampled"


def test_an_epochs_first_round_pays_for_the_switch_and_is_not_measured():
    sim = Sim(epoch_rounds=4)
    guard = sim.guard
    for i in range(8):
        ticket = guard.begin(4)
        slow = i % 4 < WARMUP_ROUNDS  # the switch's round: ten times the time, no tokens
        sim.now += 0.2 if slow else 0.02
        guard.end(ticket, 0 if slow else 20, 0.01)
    guard.begin(4)  # closes the second epoch
    rec = guard.record(4)
    assert rec.speculate.per_s == pytest.approx(1000) and rec.plain.per_s == pytest.approx(1000)
    assert not rec.withdrawn


def test_a_failed_round_is_not_measured_and_does_not_hold_its_epoch_open():
    sim = Sim(epoch_rounds=2, epoch_s=0.0)
    guard = sim.guard
    first = guard.begin(2)
    second = guard.begin(2)
    sim.now += 0.02
    guard.end(first, 30, 0.01)  # the warm-up round
    guard.abandon(second)
    guard.begin(2)  # the epoch closes with nothing measured: no figure yet
    assert guard.record(2).speculate.epochs == 0
    assert guard.current is not None and guard.current.rounds == 1


class RowPricedVerifier(LocalVerifier):
    """A verifier whose passes take ``pass_s`` each, reported as busy time as the real one reports
    its own, and ``row_s`` more per drafted row that it does not report: a cost the cost control's
    pass-time model cannot see (as drafters that share the verifier's cores slow its passes)."""

    def __init__(self, engine, pass_s: float, row_s: float):
        super().__init__(engine)
        self.pass_s, self.row_s = pass_s, row_s

    async def verify(self, items):
        verdicts, busy_ns = await super().verify(items)
        passes = 1 + max((v.step_passes for v in verdicts if v.ok), default=0)
        rows = sum(len(it.tree.tokens) for it in items)
        await asyncio.sleep(self.pass_s * passes + self.row_s * rows)
        return verdicts, busy_ns + int(self.pass_s * passes * 1e9)


def test_the_router_withdraws_speculation_whose_rows_cost_more_than_they_bring_and_readmits_it(engines, reference):
    """One client, a drafter that always agrees with the target, and drafted rows that cost 50 ms
    each where the cost control cannot see it: the control goes on drafting, the guard measures
    fewer tokens per second than its plain epochs and withdraws speculation within a few epochs.
    Once the rows are cheap again, its next control group measures that drafting pays and lets it
    back in. Passes take 30 ms, so that a pass saved by an accepted draft is worth clearly more than
    the drafters' own time, on a busy machine too (at 10 ms the two arms' yields came within the
    noise of each other once rows were free). Every output is the target's own throughout."""
    verifier, drafters = engines
    prompts, expected = reference
    ids = sorted(prompts)
    pool = LocalDrafterPool({"self": drafters["self"]})
    backend = RowPricedVerifier(verifier, pass_s=0.03, row_s=0.05)
    config = RouterSettings(
        drafters_per_request=1, tree_width=1, rounds_in_flight=1, yield_epoch_rounds=4, yield_epoch_s=0.0
    )
    core = RouterCore(config, pool, backend)

    async def until(done, most_requests: int) -> int:
        """Requests one after another (a closed loop of one client) until ``done()``; the rounds it took."""
        start = core.counters.rounds
        for i in range(most_requests):
            rid = ids[i % len(ids)]
            out = await asyncio.wait_for(
                output_of(core.submit(f"{rid}-{start}-{i}", prompts[rid], MAX_NEW, GREEDY)), 60
            )
            assert out == expected[rid]
            if done():
                return core.counters.rounds - start
        raise AssertionError(f"not within {most_requests} requests: {core.guard.record(1)}")

    async def run() -> tuple[int, int]:
        core.start()
        try:
            withdrawn = await until(lambda: core.guard.record(1).withdrawn, 12)
            backend.row_s = 0.0
            rec = core.guard.record(1)
            before = rec.speculate.epochs, rec.plain.epochs
            readmitted = await until(lambda: not core.guard.record(1).withdrawn, 24)
            return withdrawn, readmitted, rec.speculate.epochs - before[0], rec.plain.epochs - before[1]
        finally:
            await core.stop()

    withdrawn, readmitted, groups, plain_epochs = asyncio.run(run())
    assert core.counters.draft_tokens > 0 and core.counters.guard_withdrawals == 1
    assert core.counters.guard_readmissions == 1 and core.counters.guard_plain_rounds > 0
    # one epoch of each arm, then the verdict (its requests' last rounds besides)
    assert withdrawn <= 3 * 4 + 8, withdrawn
    # readmitted by a control group of speculation, at most the third (the first may pay for the
    # drafters' catch-up and fall short, and a group that falls short stretches the interval to the
    # next: how many plain epochs that takes rests on the machine's timing); the rounds are those
    # epochs' (4 each), and the requests' last rounds besides
    assert 1 <= groups <= 3, groups
    assert readmitted <= (groups + plain_epochs) * 4 + 8, (readmitted, groups, plain_epochs)
