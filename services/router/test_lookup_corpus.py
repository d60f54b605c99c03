"""The router drafting from the lookup corpus (``common/spec/lookup_corpus.py``): calibrated apart from a
request's own text, and in process with the real engines, losslessly."""

from __future__ import annotations

import asyncio

from common.spec.lookup_corpus import DomainCorpora
from services.router.conftest import MAX_NEW
from services.router.core import RouterCore
from services.router.inprocess import LocalDrafterPool, LocalVerifier
from services.router.lookup import CORPUS, TEXT, LookupCalibration
from services.router.settings import RouterSettings
from services.router.test_core import generate_all


def test_corpus_matches_are_calibrated_apart_from_the_request_s_own_text():
    cal = LookupCalibration()
    assert cal(True, 2, 0, CORPUS) < cal(True, 2, 0, TEXT)
    for _ in range(50):
        cal.observe(True, 6, 0, False, CORPUS)
    assert cal(True, 6, 0, CORPUS) < 0.1 and cal(True, 4, 0, TEXT) == LookupCalibration.prior(4, 0)


def corpus_of(prompts: dict[str, list[int]], outputs: dict[str, list[int]]):
    async def load(known_version: int) -> tuple[int, DomainCorpora] | None:
        if known_version == 1:
            return None  # unchanged
        return 1, DomainCorpora.build({"any": [prompts[rid] + outputs[rid] for rid in prompts]})

    return load


def test_the_router_drafts_from_the_corpus_and_the_output_stays_the_target_s(engines, reference):
    """No drafter model: a corpus holding what the target wrote for these prompts before (a repeated
    request) is accepted, far fewer rounds than tokens; a corpus of wrong continuations is rejected
    and changes nothing. Cost control off: every proposal is verified, whatever this machine's timings."""
    verifier, _ = engines
    prompts, expected = reference
    config = RouterSettings(cost_control=False, rounds_in_flight=1)
    core = RouterCore(config, LocalDrafterPool({}), LocalVerifier(verifier), load_corpus=corpus_of(prompts, expected))
    assert asyncio.run(generate_all(core, prompts, MAX_NEW)) == expected
    assert core.counters.corpus_sequences == len(prompts)
    assert core.counters.corpus_accepted > len(prompts) * MAX_NEW // 2
    assert core.counters.rounds < len(prompts) * MAX_NEW // 2

    wrong = {rid: [(t + 1) % verifier.runner.vocab_size for t in out] for rid, out in expected.items()}
    core = RouterCore(config, LocalDrafterPool({}), LocalVerifier(verifier), load_corpus=corpus_of(prompts, wrong))
    assert asyncio.run(generate_all(core, prompts, MAX_NEW)) == expected
    assert core.counters.corpus_tokens > 0 and core.counters.corpus_accepted < core.counters.corpus_tokens // 4

    off = RouterCore(
        RouterSettings(cost_control=False, lookup_corpus=False),
        LocalDrafterPool({}),
        LocalVerifier(verifier),
        load_corpus=corpus_of(prompts, expected),
    )
    assert asyncio.run(generate_all(off, prompts, MAX_NEW)) == expected
    assert off.counters.corpus_tokens == 0 and off.lookups.corpus is None
    assert verifier.active_requests == 0


def test_the_verifier_drafts_from_the_same_corpus_at_plain_steps(engines, reference):
    """A round of lookup nodes alone goes on in plain steps, and the verifier, holding the corpus the
    router drafts from, drafts from it at each step (``VerifyItem.step_corpus``, the request's domain):
    most tokens come from steps' drafts, far fewer passes than tokens, the output the target's own."""
    verifier, _ = engines
    prompts, expected = reference
    load = corpus_of(prompts, expected)
    verifier.corpus = asyncio.run(load(0))[1]
    try:
        # one lookup token a node (max_k 1), so the round's own tree leaves most tokens to the steps
        config = RouterSettings(cost_control=False, rounds_in_flight=1, plain_steps=4, min_k=1, initial_k=1, max_k=1)
        core = RouterCore(config, LocalDrafterPool({}), LocalVerifier(verifier), load_corpus=load)
        assert asyncio.run(generate_all(core, prompts, MAX_NEW)) == expected
    finally:
        verifier.corpus = None
    c = core.counters
    assert c.plain_step_passes > 0 and c.step_lookup_accepted > c.tokens_committed // 4
    assert c.verify_passes < c.tokens_committed // 3
    # the steps' drafts count as drafted and accepted tokens like the trees' (no drafter model here:
    # every accepted tree node is a lookup node)
    assert c.accepted_tokens == c.lookup_accepted + c.step_lookup_accepted
    assert c.draft_tokens >= c.lookup_tokens + c.step_lookup_tokens
