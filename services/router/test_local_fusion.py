"""Token fusion inside the drafter process: the same trees as the router's step-by-step fusion, in
one call per round, and the output is still the target's own."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.spec.types import GREEDY
from services.router.conftest import MAX_NEW
from services.router.control import SpeculationControl
from services.router.core import RouterCore
from services.router.drafting import Drafting
from services.router.inprocess import LocalDrafterPool, LocalVerifier
from services.router.requests import Request
from services.router.settings import RouterSettings
from services.router.test_core import generate_all


class StepCountingPool(LocalDrafterPool):
    """Counts the draft steps that go through :meth:`draft_many` (a prompt's scoring aside)."""

    def __init__(self, engines, fuse_locally: bool):
        super().__init__(engines, fuse_locally=fuse_locally)
        self.draft_steps = 0

    async def draft_many(self, calls):
        if any(item.top_n > 0 for items in calls.values() for item in items):
            self.draft_steps += 1
        return await super().draft_many(calls)


@pytest.mark.parametrize(
    "config",
    [
        RouterSettings(drafters_per_request=2, tree_width=3, rounds_in_flight=2, fusion="token"),
        RouterSettings(drafters_per_request=3, tree_width=2, cost_control=False, fusion="token"),
    ],
    ids=["priced", "unpriced"],
)
def test_local_fusion_answers_each_round_in_one_call_and_stays_lossless(engines, reference, config):
    verifier, drafters = engines
    prompts, expected = reference
    pool = StepCountingPool(drafters, fuse_locally=True)
    core = RouterCore(config, pool, LocalVerifier(verifier))
    got = asyncio.run(generate_all(core, prompts, MAX_NEW))
    assert got == expected
    assert pool.fused_rounds > 0
    if not config.cost_control:  # priced, the machine's timings may rightly prune every node (as in test_core)
        assert core.counters.accepted_tokens > 0 and core.counters.draft_tokens > 0
    assert pool.draft_steps == 0  # every draft step ran inside the pool: no message per step
    assert verifier.active_requests == 0
    assert all(e.active_requests == 0 for e in drafters.values())


def fed_control() -> SpeculationControl:
    """A control that has seen passes, draft steps and verdicts, so that it prunes nodes and steps."""
    control = SpeculationControl()
    for rows, seconds in ((1, 0.010), (4, 0.012), (8, 0.016), (16, 0.030)):
        control.observe_pass(rows, seconds, committed=rows)
    for _ in range(5):
        control.observe_draft_step(0.004, first_of=2)
    for i in range(40):  # about half of the least confident nodes accepted, nine in ten of the others
        for p in (0.05, 0.15, 0.25, 0.35, 0.95):
            control.calibration.observe(p, accepted=i % 2 == 0 or (p > 0.1 and i % 10 != 1))
    assert 0.05 < control.threshold() < 0.5
    return control


@pytest.mark.parametrize("cost_control", [True, False])
def test_a_tree_does_not_depend_on_where_it_was_fused(engines, reference, cost_control):
    """The same requests drafted by the router step by step and inside the pool give the same trees,
    the same drafters and the same mirrors of the drafters' caches."""
    _, drafters = engines
    prompts, _ = reference
    config = RouterSettings(
        drafters_per_request=3, tree_width=3, max_k=6, cost_control=cost_control, routing=False, fusion="token"
    )
    out = {}
    for local in (False, True):
        control = fed_control() if cost_control else SpeculationControl(enabled=False)
        pool = LocalDrafterPool(drafters, fuse_locally=local)
        drafting = Drafting(config, pool, control, time.monotonic)
        batch = [
            Request(
                request_id=f"{rid}-{local}",
                prompt=tuple(p),
                max_new_tokens=MAX_NEW,
                sampling=GREEDY,
                stop_ids=frozenset(),
            )
            for rid, p in sorted(prompts.items())
        ]
        ks = {r.request_id: 2 + i % 4 for i, r in enumerate(batch)}
        first = asyncio.run(drafting.tokens(batch, ks))
        for r in batch:  # a second round from the caches the first left behind, one token further on
            r.generated.append(first[0][r.request_id].tokens[0] if len(first[0][r.request_id]) else 1)
        second = asyncio.run(drafting.tokens(batch, ks))
        out[local] = [
            (
                [(t.tokens, t.parents, t.probs, t.top1) for t in (trees[r.request_id] for r in batch)],
                [selected[r.request_id] for r in batch],
            )
            for trees, selected in (first, second)
        ] + [[r.drafter_cache for r in batch]]
        for r in batch:
            for d in drafters:
                drafters[d].release(r.request_id)
    assert out[True] == out[False]
    trees = out[True][0][0]
    assert sum(len(tokens) for tokens, *_ in trees) > len(trees)  # more than one node a request: fusion ran
    if cost_control:  # the pricing cut some trees short of their speculation length
        assert any(len(tokens) < 3 * (2 + i % 4) for i, (tokens, *_) in enumerate(trees))


def test_a_fused_rounds_steps_are_priced_at_the_wall_time_the_round_waited(engines, reference):
    """The process reports model time per step; what the round waited beyond it (the message,
    queueing) is shared among the steps, so the draft-step pricing sees what a step costs the round."""
    _, drafters = engines
    prompts, _ = reference

    class SlowMessages(LocalDrafterPool):
        async def fuse(self, host, width, pricing, requests):
            await asyncio.sleep(0.06)  # the message and the queue, beyond the steps' model time
            outcomes, seconds = await super().fuse(host, width, pricing, requests)
            return outcomes, [0.001] * len(seconds)

    control = SpeculationControl(enabled=False)
    pool = SlowMessages(drafters, fuse_locally=True)
    drafting = Drafting(
        RouterSettings(drafters_per_request=2, routing=False, cost_control=False, fusion="token"),
        pool,
        control,
        time.monotonic,
    )
    rid, prompt = sorted(prompts.items())[0]
    batch = [
        Request(request_id="wall", prompt=tuple(prompt), max_new_tokens=MAX_NEW, sampling=GREEDY, stop_ids=frozenset())
    ]
    trees, _ = asyncio.run(drafting.tokens(batch, {"wall": 3}))
    assert len(trees["wall"]) >= 3 and pool.fused_rounds == 1  # three steps in one call
    assert control.draft_step_s >= 0.001 + 0.06 / 3 * 0.9  # each step carries a third of the wait
    assert control.first_step.observed == 1
    for d in drafters:
        drafters[d].release("wall")
