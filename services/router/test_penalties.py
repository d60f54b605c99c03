"""Penalised requests through the router with the real engines: the drafters propose as they
always do (the target itself among them, whose drafts the penalties often reject), and every
penalised request's output is still the penalised target's own greedy decode, beside unpenalised
requests that stay the plain target's, also across a verifier restart (the re-prefilled requests'
earlier output still counts as output)."""

from __future__ import annotations

import asyncio

from common.runtime.checkpoints import load_causal_lm
from common.runtime.test_verifier_penalties import penalised_greedy
from common.spec.types import GREEDY, SamplingParams
from services.router.conftest import MAX_NEW
from services.router.core import RouterCore
from services.router.inprocess import LocalDrafterPool
from services.router.settings import RouterSettings
from services.router.test_core import RestartingVerifier, generate_all

PENALTIES = (
    SamplingParams(repetition_penalty=1.6),
    SamplingParams(presence_penalty=1.2, frequency_penalty=0.8),
    SamplingParams(repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=1.5),
)


def test_penalised_requests_are_the_penalised_targets_own_across_a_restart(llama_target, engines, reference):
    verifier, drafters = engines
    prompts, expected = reference
    rids = sorted(prompts)
    sampling = {rid: PENALTIES[i % len(PENALTIES)] for i, rid in enumerate(rids[::2])}
    hf = load_causal_lm(llama_target)
    want = {
        rid: penalised_greedy(hf, prompts[rid], MAX_NEW, sampling[rid]) if rid in sampling else expected[rid]
        for rid in rids
    }
    assert all(want[rid] != expected[rid] for rid in sampling)  # each penalty changes its request's output
    backend = RestartingVerifier(verifier)
    core = RouterCore(RouterSettings(drafters_per_request=2), LocalDrafterPool(drafters), backend)
    got = asyncio.run(generate_all(core, prompts, MAX_NEW, sampling={**{r: GREEDY for r in rids}, **sampling}))
    assert backend.n > 6  # the restart and the broken stream happened while requests were running
    assert got == want
    assert verifier.active_requests == 0
