"""Plain steps from the router's side: a round that drafts nothing and holds the whole pool has the
verifier decode several tokens of each request before it answers, and nothing of the output changes."""

from __future__ import annotations

import asyncio

from common.spec.types import SamplingParams, VerifyItem
from services.router.conftest import MAX_NEW
from services.router.core import RouterCore
from services.router.inprocess import LocalDrafterPool, LocalVerifier, output_of
from services.router.scheduler import PLAIN_STREAK, plain_steps
from services.router.settings import RouterSettings


class RecordingVerifier(LocalVerifier):
    """Keeps every batch's items, to see what the router asked for."""

    def __init__(self, engine):
        super().__init__(engine)
        self.items: list[list[VerifyItem]] = []

    async def verify(self, items):
        self.items.append(list(items))
        return await super().verify(items)


def test_plain_steps_only_for_a_round_that_drafts_nothing_and_holds_the_pool() -> None:
    settled = [PLAIN_STREAK] * 3
    assert plain_steps(4, [10, 7, 30], settled, drafts=False, whole_pool=True) == 4
    assert plain_steps(4, [10, 2, 30], settled, drafts=False, whole_pool=True) == 2  # no request runs out mid-call
    assert plain_steps(4, [10, 7], settled, drafts=True, whole_pool=True) == 1
    assert plain_steps(4, [10, 7], settled, drafts=False, whole_pool=False) == 1
    assert plain_steps(1, [10, 7], settled, drafts=False, whole_pool=True) == 1
    # a request that drafted in its latest rounds may draft again after the next token
    assert plain_steps(4, [10, 7], [PLAIN_STREAK, PLAIN_STREAK - 1], drafts=False, whole_pool=True) == 1


async def _run(core: RouterCore, prompts: dict[str, list[int]], sampling: SamplingParams, stop: int | None = None):
    core.start()
    try:
        reqs = {
            rid: core.submit(rid, p, MAX_NEW, sampling, [stop] if stop is not None else [])
            for rid, p in prompts.items()
        }
        return {rid: await asyncio.wait_for(output_of(req), 120) for rid, req in reqs.items()}
    finally:
        await core.stop()


def test_plain_decoding_in_steps_equals_the_targets_greedy_decode(engines, reference) -> None:
    verifier, _ = engines
    prompts, expected = reference
    recording = RecordingVerifier(verifier)
    core = RouterCore(RouterSettings(speculate=False, plain_steps=4), LocalDrafterPool({}), recording)
    assert asyncio.run(_run(core, prompts, SamplingParams())) == expected
    asked = [item.plain_steps for batch in recording.items for item in batch]
    assert max(asked) == 4 and core.counters.plain_step_passes > 0
    # fewer rounds than tokens a request, and every cache freed
    assert core.counters.rounds < MAX_NEW and verifier.active_requests == 0


def test_a_sampled_request_gets_the_same_tokens_in_steps_and_a_round_a_token(engines, reference) -> None:
    verifier, _ = engines
    prompts, _ = reference
    sampling = SamplingParams(temperature=0.9, seed=11)
    outs = []
    for steps in (1, 4):
        core = RouterCore(
            RouterSettings(speculate=False, plain_steps=steps), LocalDrafterPool({}), LocalVerifier(verifier)
        )
        outs.append(asyncio.run(_run(core, {rid: prompts[rid] for rid in sorted(prompts)[:2]}, sampling)))
    assert outs[0] == outs[1]


def test_a_stop_token_ends_a_request_inside_its_steps(engines, reference) -> None:
    verifier, _ = engines
    prompts, expected = reference
    rid = sorted(prompts)[0]
    stop = expected[rid][5]
    core = RouterCore(RouterSettings(speculate=False, plain_steps=8), LocalDrafterPool({}), LocalVerifier(verifier))
    out = asyncio.run(_run(core, {rid: prompts[rid]}, SamplingParams(), stop))
    assert out[rid] == expected[rid][: expected[rid].index(stop) + 1]
    assert verifier.active_requests == 0


def test_an_overloaded_pool_serves_first_come_first_served_in_steps(engines, reference) -> None:
    """More requests than slots: the requests under way keep their slots until they finish (no
    rotation through the batch), and since the new ones could not join before then, the verifier
    decodes the full batch in steps meanwhile; the outputs stay the target's own."""
    verifier, _ = engines
    prompts, expected = reference
    recording = RecordingVerifier(verifier)
    core = RouterCore(
        RouterSettings(speculate=False, plain_steps=4, max_batch_requests=2, rounds_in_flight=1),
        LocalDrafterPool({}),
        recording,
    )
    assert asyncio.run(_run(core, prompts, SamplingParams())) == expected
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, batch in enumerate(recording.items):
        for item in batch:
            if not item.release:
                first.setdefault(item.request_id, i)
                last[item.request_id] = i
    assert len(first) == len(prompts)
    for i in range(len(recording.items)):
        assert sum(first[r] <= i <= last[r] for r in first) <= 2  # never a third request under way
    assert max(item.plain_steps for batch in recording.items for item in batch) == 4
    assert verifier.active_requests == 0


class SlowVerifier(RecordingVerifier):
    """A verifier a network away: the clients' next requests arrive while a call is under way."""

    async def verify(self, items):
        await asyncio.sleep(0.02)
        return await super().verify(items)


def test_a_slot_freed_by_a_finished_request_is_refilled_after_one_step(engines, reference) -> None:
    """Two clients in a closed loop, one with short requests: when its request finishes, the next
    round decodes a single step for the other, so that the client's next request (sent at once,
    arriving during that step) joins after one pass rather than after all the plain steps."""
    verifier, _ = engines
    prompts, expected = reference
    (long_id, long_prompt), *shorts = list(prompts.items())[:4]
    recording = SlowVerifier(verifier)
    core = RouterCore(
        RouterSettings(speculate=False, plain_steps=4, max_batch_requests=2, rounds_in_flight=1),
        LocalDrafterPool({}),
        recording,
    )
    short_new = 6

    async def short_client() -> dict[str, list[int]]:
        out = {}
        for rid, prompt in shorts:
            out[rid] = await asyncio.wait_for(output_of(core.submit(rid, prompt, short_new, SamplingParams())), 120)
        return out

    async def main():
        core.start()
        try:
            long_req = core.submit(long_id, long_prompt, MAX_NEW, SamplingParams())
            got = await short_client()
            got[long_id] = await asyncio.wait_for(output_of(long_req), 120)
            return got
        finally:
            await core.stop()

    got = asyncio.run(main())
    assert got == {long_id: expected[long_id], **{rid: expected[rid][:short_new] for rid, _ in shorts}}
    calls = [[item for item in batch if not item.release] for batch in recording.items]
    present = [{item.request_id for item in batch} for batch in calls]
    checked = 0
    for (done, _), (nxt, _) in zip(shorts, shorts[1:]):
        last = max(i for i, ids in enumerate(present) if done in ids)
        if long_id not in present[last + 1]:
            continue  # the long request was done first
        assert all(item.plain_steps == 1 for item in calls[last + 1])  # one step for the request left alone
        assert nxt in present[last + 2]  # and the next request is in the round after it
        checked += 1
    assert checked >= 1
    assert max(item.plain_steps for batch in calls for item in batch) == 4  # steps otherwise
    assert verifier.active_requests == 0


def test_the_verifier_drafts_from_each_request_s_text_in_its_steps_and_the_output_is_the_targets(
    engines, reference
) -> None:
    verifier, _ = engines
    prompts, expected = reference
    recording = RecordingVerifier(verifier)
    core = RouterCore(RouterSettings(rounds_in_flight=1, plain_steps=8), LocalDrafterPool({}), recording)
    assert asyncio.run(_run(core, prompts, SamplingParams())) == expected
    items = [item for batch in recording.items for item in batch]
    stepped = [item for item in items if item.plain_steps > 1]
    assert stepped and all(len(item.step_lookup) == core.config.lookup_max_ngram for item in stepped)
    assert all(not item.step_lookup and not item.max_tokens for item in items if item.plain_steps == 1)
    assert (
        core.counters.step_lookup_tokens > 0
    )  # chains were drafted in the steps (the engine's tests see them accepted)
    # a round's passes are its own and its steps', however many tokens the steps' chains brought
    assert core.counters.verify_passes <= core.counters.tokens_committed


def test_no_step_lookup_when_it_is_off_or_the_lookup_drafter_is(engines, reference) -> None:
    verifier, _ = engines
    prompts, expected = reference
    for config in (
        RouterSettings(rounds_in_flight=1, plain_steps=8, step_lookup=False),
        RouterSettings(rounds_in_flight=1, plain_steps=8, lookup_drafts=False),
        RouterSettings(speculate=False, plain_steps=8),
    ):
        recording = RecordingVerifier(verifier)
        core = RouterCore(config, LocalDrafterPool({}), recording)
        assert asyncio.run(_run(core, prompts, SamplingParams())) == expected
        items = [item for batch in recording.items for item in batch]
        assert any(item.plain_steps > 1 for item in items) and not any(item.step_lookup for item in items)
        assert core.counters.step_lookup_tokens == 0
