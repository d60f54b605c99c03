"""Log-probabilities through the router (in process, the real engines): each event carries one
entry per token it streams, also when a request ends on a stop token or at max_new_tokens inside
a verdict that committed more, and the figures are the target's own."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.runtime.checkpoints import load_causal_lm
from common.spec.types import SamplingParams
from services.router.core import RouterCore
from services.router.inprocess import LocalDrafterPool, LocalVerifier
from services.router.settings import RouterSettings

SETTINGS = {
    # the target drafting for itself: every draft is accepted, so verdicts commit several tokens
    "self-drafter": (RouterSettings(drafters_per_request=1, cost_control=False, initial_k=6, min_k=6), ("self",)),
    "plain-steps": (RouterSettings(speculate=False, plain_steps=6), ()),
}


class CountingVerifier(LocalVerifier):
    """Counts the tokens the verdicts committed per request (more than were streamed: some were cut)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.committed: dict[str, int] = {}

    async def verify(self, items):
        verdicts, busy = await super().verify(items)
        for v in verdicts:
            self.committed[v.request_id] = self.committed.get(v.request_id, 0) + len(v.new_tokens)
        return verdicts, busy


async def _collect(core: RouterCore, prompts, max_new: int, stops: dict[str, int], top: int):
    """Every request's events as (tokens, logprobs) pairs until it finishes."""
    core.start()
    try:
        reqs = {
            rid: core.submit(rid, p, max_new, SamplingParams(), [stops[rid]] if rid in stops else [], logprobs=top)
            for rid, p in prompts.items()
        }
        out = {}
        for rid, req in reqs.items():
            events = []
            while True:
                ev = await asyncio.wait_for(req.events.get(), 120)
                assert ev.error is None, ev.error
                events.append((ev.tokens, ev.logprobs))
                if ev.finished:
                    break
            out[rid] = events
        return out
    finally:
        await core.stop()


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_logprobs_stay_aligned_with_tokens_through_stops_and_the_length_limit(name, engines, reference, llama_target):
    verifier, drafters = engines
    prompts, expected = reference
    config, drafter_ids = SETTINGS[name]
    rids = sorted(prompts)[:4]
    max_new = 9  # not a multiple of a verdict's length: the last verdict is cut
    stops = {rids[0]: expected[rids[0]][4], rids[1]: expected[rids[1]][6]}  # inside a verdict
    pool = LocalDrafterPool({d: drafters[d] for d in drafter_ids})
    counting = CountingVerifier(verifier)
    core = RouterCore(config, pool, counting)
    got = asyncio.run(_collect(core, {r: prompts[r] for r in rids}, max_new, stops, top=3))
    hf = load_causal_lm(llama_target)
    for rid in rids:
        tokens = [t for toks, _ in got[rid] for t in toks]
        want = expected[rid][:max_new]
        if rid in stops:
            want = want[: want.index(stops[rid]) + 1]
        assert tokens == want, rid  # lossless: the tokens are the target's greedy decode
        for toks, entries in got[rid]:
            assert [e.token for e in entries] == list(toks)  # aligned event by event
        entries = [e for _, es in got[rid] for e in es]
        seq = [*prompts[rid], *tokens]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)[len(prompts[rid]) - 1 : -1]
        for e, row in zip(entries, ref, strict=True):
            assert e.logprob == pytest.approx(float(row[e.token]), abs=1e-4)
            assert len(e.top) == 3 and e.top[0][0] == e.token  # greedy: the chosen token leads
    if drafter_ids:  # the case was exercised: verdicts committed tokens past a stop or the limit
        assert any(counting.committed[r] > sum(len(t) for t, _ in got[r]) for r in rids)
    assert verifier.active_requests == 0


def test_a_request_that_does_not_ask_gets_no_logprobs(engines, reference):
    verifier, _ = engines
    prompts, _ = reference
    rid = sorted(prompts)[0]
    core = RouterCore(RouterSettings(speculate=False, plain_steps=4), LocalDrafterPool({}), LocalVerifier(verifier))
    got = asyncio.run(_collect(core, {rid: prompts[rid]}, 6, {}, top=-1))
    assert sum(len(toks) for toks, _ in got[rid]) == 6
    assert all(entries == () for _, entries in got[rid])
