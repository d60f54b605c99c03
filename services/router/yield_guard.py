"""The yield guard: speculation only where it is measured to commit more than plain decoding (no gRPC here).

The cost control (``control.py``, ``gate.py``, ``pass_plan.py``) prices rows and draft steps with
a model of the verifier's pass time and the drafters' step time, fitted online. A model can be
wrong in ways it cannot see: drafters that share the verifier's cores slow its passes, a CPU whose
kernels take rows at another price than the curve's shape, a serving path whose per-round costs
differ by machine. Then it keeps drafting where each second commits fewer tokens than plain
decoding would, and nothing notices. The guard notices: it measures what the router's choices
actually yield, and overrules the model where they yield less.

**Arms.** Rounds run in *epochs* of at least ``yield_epoch_rounds`` rounds and ``yield_epoch_s``
seconds, each epoch under one arm: *speculate* (the cost control decides, as without the guard)
or *plain* (nothing is drafted, no lookup chain is verified, one round is in flight and the
verifier takes its plain steps: what the same services do with speculation off). An epoch's
yield is the tokens its rounds committed over the wall time they covered (the union of their
intervals, so two rounds in flight are not counted twice and an empty pool is not counted at
all); its first round is left out, since it pays for the switch (drafters catching up on the
tokens committed without them, plain steps waiting for their streak). Committed tokens per
verifier-busy second are kept beside it, for the logs and the metrics.

**Levels.** Whether speculation pays depends on the load: at one client a drafted row is nearly
free, at sixteen it competes with fifteen other requests' rows. It depends on sampling too: a
sampled request's drafts are accepted far less often than a greedy one's. So every figure is kept
per *level*, the pool's size rounded up to a power of two (capped at a round's most requests) and
whether most of its requests sample, and an epoch ends early when the level changes (it still
counts, weighted by its share of a full epoch).

**Verdict.** Each level starts with speculation on (the model is the prior) and runs one plain
epoch early to measure the other arm. Speculation is withdrawn at a level when its measured yield
falls under ``1 - YIELD_MARGIN`` of plain's, and re-admitted when it rises over ``1 + YIELD_MARGIN``
of it (hysteresis against noise). Whichever arm is out is still measured now and then, as a
control group: one epoch in every ``explore_every`` at the level, an interval that doubles each time
such an epoch confirms the verdict and quadruples when it does so by a clear margin
(``CLEAR_MARGIN``), from ``EXPLORE_START`` up to ``EXPLORE_MAX``; it halves when one does not, and
falls back to the start when the verdict flips. Where speculation wins clearly (one client) the
control groups thus soon take a few percent of the time; near break-even, where either arm costs
little, they stay frequent. A control group's epoch weighs more in its
arm's figure than a winning arm's epoch in its own (``CONTROL_WEIGHT``): it is measured rarely, and
one epoch that beats the winner by a clear margin flips the verdict. The guard therefore costs at
most a small share of the time where one arm clearly wins, and follows a change of machine, text
or load within a few epochs.

Lossless by construction: an arm only decides whether drafts are verified; every committed token is
still the target's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from common.logs import get_logger

log = get_logger("router")

YIELD_MARGIN = 0.01  # withdraw under (1 - margin) x plain's yield, re-admit over (1 + margin) x
EXPLORE_START = 4  # epochs of the winning arm between two of the other, after a flip
EXPLORE_MAX = 64  # ... at most, while the other keeps confirming the verdict
CLEAR_MARGIN = 0.1  # a control group under (1 - this) x the winner's yield confirms clearly: 4x the interval
EPOCH_WEIGHT = 0.3  # EWMA weight of a full epoch's yield in the winning arm's figure
CONTROL_WEIGHT = 0.8  # ... in the losing arm's, measured far more rarely: its latest epoch counts most
WARMUP_ROUNDS = 1  # an epoch's first rounds are not measured: they pay for the switch


def level_of(pool: int, max_batch: int) -> int:
    """The load level of a pool of ``pool`` requests: its size capped at ``max_batch`` (a round's
    most requests), rounded up to a power of two (1, 2, 4, 8, 16, ...)."""
    n = max(1, min(pool, max_batch))
    return 1 << (n - 1).bit_length()


def level_label(level: int) -> str:
    """How a level's size is named in logs and metrics: the pool sizes it holds ("1", "2", "3-4", "5-8", ...)."""
    return str(level) if level <= 2 else f"{level // 2 + 1}-{level}"


@dataclass(frozen=True)
class Level:
    """A load level: the pool's size (:func:`level_of`) and whether most of its requests sample."""

    size: int
    sampled: bool = False

    @property
    def label(self) -> str:
        return level_label(self.size) + (" sampled" if self.sampled else "")


@dataclass
class ArmYield:
    """What one arm committed at one level: tokens per wall second and per verifier-busy second (EWMA over epochs)."""

    per_s: float = 0.0
    per_busy_s: float = 0.0
    epochs: int = 0

    def observe(self, per_s: float, per_busy_s: float, weight: float) -> None:
        """One epoch's yields; ``weight``: the EWMA weight of a full epoch times its share of one."""
        a = 1.0 if self.epochs == 0 else weight
        self.per_s += a * (per_s - self.per_s)
        self.per_busy_s += a * (per_busy_s - self.per_busy_s)
        self.epochs += 1


@dataclass
class LevelRecord:
    """One level's two arms, its verdict and its control-group schedule."""

    speculate: ArmYield = field(default_factory=ArmYield)
    plain: ArmYield = field(default_factory=ArmYield)
    withdrawn: bool = False  # the verdict: speculation is off at this level
    explore_every: int = EXPLORE_START
    since_explored: int = 0  # epochs of the winning arm since the other's last one

    def next_arm_plain(self) -> bool:
        """Whether the level's next epoch is plain: the plain arm once early (the speculate arm
        runs first), then the losing arm every ``explore_every``-th epoch."""
        if self.speculate.epochs == 0:
            return False
        if self.plain.epochs == 0:
            return True
        explore = self.since_explored + 1 >= self.explore_every
        return explore != self.withdrawn

    def minority(self, plain: bool) -> bool:
        """Whether an epoch of this arm is the control group (the arm the verdict has out)."""
        return plain != self.withdrawn

    def settle(self, plain: bool, per_s: float) -> str:
        """After an epoch of either arm was measured (``per_s``: its own yield): the verdict follows
        the two yields. Returns "withdrawn" or "readmitted" when it flipped, else ""."""
        minority = self.minority(plain)
        if minority:
            self.since_explored = 0
        else:
            self.since_explored += 1
        if not self.speculate.epochs or not self.plain.epochs:
            return ""
        spec, base = self.speculate.per_s, self.plain.per_s
        if not self.withdrawn and spec < (1 - YIELD_MARGIN) * base:
            self.withdrawn, self.explore_every, self.since_explored = True, EXPLORE_START, 0
            return "withdrawn"
        if self.withdrawn and spec > (1 + YIELD_MARGIN) * base:
            self.withdrawn, self.explore_every, self.since_explored = False, EXPLORE_START, 0
            return "readmitted"
        if minority:
            # the control group confirmed the verdict: measure it more rarely (far more rarely when
            # by a clear margin); it did not: sooner again
            other = spec if plain else base
            if per_s < (1 - CLEAR_MARGIN) * other:
                self.explore_every = min(EXPLORE_MAX, 4 * self.explore_every)
            elif per_s < other:
                self.explore_every = min(EXPLORE_MAX, 2 * self.explore_every)
            else:
                self.explore_every = max(EXPLORE_START, self.explore_every // 2)
        return ""


@dataclass
class Epoch:
    """A run of rounds under one arm at one level (see the module docstring)."""

    level: Level
    plain: bool
    opened_at: float
    rounds: int = 0  # rounds begun in it
    pending: int = 0  # of them, not ended yet
    closed: bool = False  # no further round joins it
    tokens: int = 0  # committed by its measured rounds
    busy_s: float = 0.0  # their verifier-busy time
    spans: list[tuple[float, float]] = field(default_factory=list)  # their (start, end)


@dataclass(frozen=True)
class Ticket:
    """A round's place in its epoch, from :meth:`YieldGuard.begin` to :meth:`YieldGuard.end`."""

    epoch: Epoch
    started_at: float
    measured: bool

    @property
    def plain(self) -> bool:
        return self.epoch.plain


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of the ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


class YieldGuard:
    """The epochs, the levels' records and their verdicts (see the module docstring).

    ``observer(level, record, flip)`` is told of every settled epoch (the router's metrics)."""

    def __init__(
        self,
        epoch_rounds: int,
        epoch_s: float,
        max_batch: int,
        clock: Callable[[], float],
        observer: Callable[[Level, LevelRecord, str], None] | None = None,
    ) -> None:
        self.epoch_rounds = max(WARMUP_ROUNDS + 1, epoch_rounds)
        self.epoch_s = epoch_s
        self.max_batch = max_batch
        self.clock = clock
        self.observer = observer
        self.levels: dict[Level, LevelRecord] = {}
        self.current: Epoch | None = None

    def record(self, level: Level | int) -> LevelRecord:
        """The record of ``level`` (a pool size alone: its greedy level)."""
        return self.levels.setdefault(level if isinstance(level, Level) else Level(level), LevelRecord())

    @property
    def plain_now(self) -> bool:
        """Whether the current epoch is plain (then one round is in flight)."""
        return self.current is not None and self.current.plain

    def begin(self, pool: int, sampled: bool = False) -> Ticket:
        """A round begins with ``pool`` requests in the router (``sampled``: most of them sample):
        the epoch it belongs to (a new one when the current one is full or the level moved), whose
        arm the round must follow."""
        now = self.clock()
        level = Level(level_of(pool, self.max_batch), sampled)
        epoch = self.current
        if epoch is None or epoch.level != level or self._full(epoch, now):
            if epoch is not None:
                self._close(epoch)
            epoch = self.current = Epoch(level, self.record(level).next_arm_plain(), now)
        epoch.rounds += 1
        epoch.pending += 1
        return Ticket(epoch, now, measured=epoch.rounds > WARMUP_ROUNDS)

    def end(self, ticket: Ticket, committed: int, busy_s: float) -> None:
        """The round of ``ticket`` ended, having committed ``committed`` tokens in ``busy_s`` of verifier time."""
        epoch = ticket.epoch
        epoch.pending -= 1
        if ticket.measured:
            epoch.tokens += committed
            epoch.busy_s += busy_s
            epoch.spans.append((ticket.started_at, self.clock()))
        if epoch.closed and epoch.pending == 0:
            self._settle(epoch)

    def abandon(self, ticket: Ticket) -> None:
        """The round of ``ticket`` failed (the verifier's stream broke, a bug): it is not measured."""
        ticket.epoch.pending -= 1
        if ticket.epoch.closed and ticket.epoch.pending == 0:
            self._settle(ticket.epoch)

    def _full(self, epoch: Epoch, now: float) -> bool:
        return epoch.rounds >= self.epoch_rounds and now - epoch.opened_at >= self.epoch_s

    def _close(self, epoch: Epoch) -> None:
        epoch.closed = True
        if epoch.pending == 0:
            self._settle(epoch)

    def _settle(self, epoch: Epoch) -> None:
        wall = covered(epoch.spans)
        if wall <= 0 or not epoch.spans:
            return  # nothing measured (the level moved after a round or two)
        rec = self.record(epoch.level)
        share = min(1.0, len(epoch.spans) / (self.epoch_rounds - WARMUP_ROUNDS))
        weight = share * (CONTROL_WEIGHT if rec.minority(epoch.plain) else EPOCH_WEIGHT)
        arm = rec.plain if epoch.plain else rec.speculate
        per_s = epoch.tokens / wall
        arm.observe(per_s, epoch.tokens / epoch.busy_s if epoch.busy_s > 0 else 0.0, weight)
        flip = rec.settle(epoch.plain, per_s)
        if flip:
            log.info(
                f"speculation {flip}",
                level=epoch.level.label,
                speculate_tokens_per_s=round(rec.speculate.per_s, 1),
                plain_tokens_per_s=round(rec.plain.per_s, 1),
                speculate_tokens_per_busy_s=round(rec.speculate.per_busy_s, 1),
                plain_tokens_per_busy_s=round(rec.plain.per_busy_s, 1),
            )
        if self.observer is not None:
            self.observer(epoch.level, rec, flip)
