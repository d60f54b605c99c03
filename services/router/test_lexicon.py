"""Domain detection by lexicon: it imitates the drafters' scores once it has seen enough of them,
audits itself, and hands detection back when it stops agreeing."""

from __future__ import annotations

import asyncio
import random

import pytest

from common.platform.store import Store
from common.spec.types import GREEDY
from services.router import domain as domain_module
from services.router.core import RouterCore
from services.router.inprocess import LocalDrafterPool
from services.router.lexicon import DomainLexicon
from services.router.profiles import ProfileStore
from services.router.settings import RouterSettings

RANGES = {"code": range(10, 60), "prose": range(200, 250)}


def prompt(domain: str, rng: random.Random, n: int = 48) -> list[int]:
    own = list(RANGES[domain])
    shared = list(range(100, 110))  # tokens every domain uses
    return [rng.choice(own if rng.random() < 0.7 else shared) for _ in range(n)]


def test_predicts_nothing_until_two_domains_have_examples():
    lex = DomainLexicon(min_examples=3)
    rng = random.Random(0)
    for _ in range(3):
        lex.learn("code", prompt("code", rng))
    assert lex.predict(prompt("code", rng)) == (None, 0.0)
    for _ in range(2):
        lex.learn("prose", prompt("prose", rng))
    assert lex.predict(prompt("prose", rng))[0] is None  # prose has 2 < 3 examples
    lex.learn("prose", prompt("prose", rng))
    for domain in RANGES:
        guess, margin = lex.predict(prompt(domain, rng))
        assert guess == domain and margin > 4


def test_decide_uses_the_lexicon_and_audits_every_nth():
    lex = DomainLexicon(min_examples=2, audit_every=4)
    rng = random.Random(1)
    for _ in range(6):
        for d in RANGES:
            lex.learn(d, prompt(d, rng))
    used = [lex.decide(prompt("code", rng)) for _ in range(12)]
    assert [u for u, _ in used].count(None) == 3  # every fourth goes to the drafters
    assert all(g == "code" for _, g in used) and all(u in (None, "code") for u, _ in used)


def test_disagreement_hands_detection_back_to_the_drafters():
    lex = DomainLexicon(min_examples=2)
    rng = random.Random(2)
    for _ in range(2):
        for d in RANGES:
            lex.learn(d, prompt(d, rng))
    # the drafters now call code prompts "records" (say, a new specialist joined)
    for _ in range(3):
        p = prompt("code", rng)
        lex.learn("records", p, guess=lex.predict(p)[0])
    assert lex.agreement < lex.min_agreement
    assert lex.decide(prompt("code", rng))[0] is None


def test_ambiguous_prompt_is_left_to_the_drafters():
    lex = DomainLexicon(min_examples=2)
    rng = random.Random(3)
    for _ in range(3):
        for d in RANGES:
            lex.learn(d, prompt(d, rng))
    assert lex.decide([100, 101, 102])[0] is None  # only shared tokens: no margin


@pytest.fixture
def scored(monkeypatch) -> list[str]:
    """The drafters' scoring of new prompts, faked: the ids of the requests scored, in order; a
    prompt mostly of tokens under 100 is code, else prose."""
    ids: list[str] = []

    async def fake_detect(drafting, reqs, live):
        for r in reqs:
            ids.append(r.request_id)
            r.domain = "code" if sum(t < 100 for t in r.prompt) > len(r.prompt) / 2 else "prose"

    monkeypatch.setattr(domain_module, "detect_domains", fake_detect)
    return ids


def test_router_scores_with_drafters_only_until_the_lexicon_agrees(scored):
    """Through RouterCore: the first requests of each domain are scored by the drafters, later
    ones get the lexicon's domain (the same the drafters would give) with no drafter call."""
    rng = random.Random(4)
    for detection in ("lexicon", "drafters"):
        scored.clear()
        core = RouterCore(RouterSettings(domain_detection=detection), LocalDrafterPool({}), None)
        reqs = [core.submit(f"{detection}-{i}", prompt(("code", "prose")[i % 2], rng), 4, GREEDY) for i in range(60)]

        async def detect_one_by_one():
            for r in reqs:
                await core.routing.detect([r], ["a", "b"])

        asyncio.run(detect_one_by_one())
        assert [r.domain for r in reqs] == [("code", "prose")[i % 2] for i in range(len(reqs))]
        assert core.counters.domains_by_lexicon + core.counters.domains_by_drafters == len(reqs)
        if detection == "lexicon":
            assert len(scored) < 20 and core.counters.domains_by_lexicon > 40
        else:
            assert len(scored) == len(reqs) and core.counters.domains_by_lexicon == 0


def test_a_new_router_routes_by_the_shared_lexicon_from_its_first_request(scored, redis_url, redis_prefix):
    """The zoo's seed in Redis (written after the router started, as `cosine up` does) gives the
    requests their domain with no drafter scoring. A seed is labelled prompts, so the lexicon is the
    reference: no audit asks the drafters, and a prompt it cannot call (only tokens every domain
    uses) goes to them without being learned into the shared lexicon."""
    rng = random.Random(7)
    seed = {}
    for d in ("code", "prose"):
        counts: dict[int, int] = {}
        for _ in range(20):
            for t in prompt(d, rng):
                counts[t] = counts.get(t, 0) + 1
        seed[d] = (20, counts)

    async def body():
        store = Store.from_url(redis_url, prefix=redis_prefix)
        profiles = ProfileStore(store)
        core = RouterCore(
            RouterSettings(), LocalDrafterPool({}), None, load_lexicon=profiles.lexicon, record_lexicon=profiles.learned
        )
        await store.seed_lexicon(seed)
        reqs = [core.submit(f"r{i}", prompt(("code", "prose")[i % 2], rng), 4, GREEDY) for i in range(24)]
        vague = core.submit("vague", [104, 105], 4, GREEDY)  # only tokens every domain uses: no margin
        for r in [*reqs, vague]:
            await core.routing.detect([r], ["a", "b"])
        await core.stop()  # waits for any background write of what was learned
        shared = await store.load_lexicon()
        await store.close()
        return reqs, vague, shared, core.routing.lexicon

    reqs, vague, shared, lexicon = asyncio.run(body())
    assert lexicon.reference and lexicon.labelled == {"code", "prose"}
    assert [r.domain for r in reqs] == [("code", "prose")[i % 2] for i in range(24)]
    assert scored == ["vague"] and vague.domain == "prose"  # (the fake drafters' call)
    assert shared["prose"][0] == 20 and shared["code"][0] == 20  # nothing learned from the drafters


def test_a_labelled_seed_is_trusted_without_audits_and_learns_nothing_from_the_drafters():
    """Drafters that call every prompt "code" (specialists that do not specialise) neither make a
    labelled lexicon distrust itself nor teach it; a lexicon learned from the drafters' own scores
    still audits itself against them and hands detection back when they disagree."""
    rng = random.Random(9)
    labelled, learned = DomainLexicon(min_examples=2, audit_every=4), DomainLexicon(min_examples=2, audit_every=4)
    for d in RANGES:
        counts: dict[int, int] = {}
        for _ in range(6):
            for t in prompt(d, rng):
                counts[t] = counts.get(t, 0) + 1
        labelled.absorb(d, 6, counts, labelled=True)
        learned.absorb(d, 6, counts)
    assert labelled.reference and not learned.reference
    before = dict(labelled.examples)
    for lex in (labelled, learned):
        for _ in range(12):
            p = prompt("prose", rng)
            use, guess = lex.decide(p)
            if use is None:  # the drafters were asked (an audit), and they say code
                lex.learn("code", p, guess)
    assert labelled.audited == 0 and labelled.predicted == 12 and labelled.examples == before
    assert not labelled.learn("code", prompt("prose", rng)) and labelled.examples == before
    assert learned.audited >= 2 and learned.agreement < learned.min_agreement
    assert learned.decide(prompt("prose", rng))[0] is None and labelled.decide(prompt("prose", rng))[0] == "prose"


def test_a_submitted_request_is_gated_by_the_lexicons_guess_until_it_is_routed():
    """At submission the lexicon's best guess (no drafter pass) picks the draft gate's record the
    request starts from; a domain hint wins; with an empty lexicon there is no guess."""
    rng = random.Random(5)
    core = RouterCore(RouterSettings(), LocalDrafterPool({}), None)
    early = core.submit("early", prompt("code", rng), 4, GREEDY)
    assert early.domain_guess == "" and early.first_accept == core.gate.first_accept_prior
    for _ in range(4):
        for d in RANGES:
            core.routing.lexicon.learn(d, prompt(d, rng))
    core.gate.record("prose").first_accept = 0.05  # drafting has not paid on prose lately
    code, prose = (core.submit(f"{d}-1", prompt(d, rng), 4, GREEDY) for d in RANGES)
    assert (code.domain_guess, prose.domain_guess) == ("code", "prose") and not code.domain and not prose.domain
    assert prose.first_accept == 0.05 and code.first_accept == core.gate.record("code").first_accept > 0.5
    hinted = core.submit("hinted", prompt("code", rng), 4, GREEDY, domain_hint="prose")
    assert hinted.domain_guess == "prose" and hinted.first_accept == 0.05
    unkeyed = RouterCore(RouterSettings(domain_gate=False), LocalDrafterPool({}), None)
    unkeyed.routing.lexicon = core.routing.lexicon
    assert unkeyed.submit("x", prompt("prose", rng), 4, GREEDY).domain_guess == ""


def test_a_router_reads_the_shared_lexicon_when_it_starts(redis_url, redis_prefix):
    """A router started after the seed was written guesses its first requests' domains from it
    (for the draft gate) before any prompt was scored; one started before the seed reads it again
    when its drafters would first score a prompt (the previous test)."""
    rng = random.Random(8)
    seed = {d: (20, {t: 1 for _ in range(20) for t in prompt(d, rng)}) for d in RANGES}

    async def body():
        store = Store.from_url(redis_url, prefix=redis_prefix)
        await store.seed_lexicon(seed)
        profiles = ProfileStore(store)
        core = RouterCore(
            RouterSettings(), LocalDrafterPool({}), None, load_lexicon=profiles.lexicon, record_lexicon=profiles.learned
        )
        before = core.routing.guess(prompt("prose", rng))
        core.start()
        for _ in range(100):
            if not core._bg:
                break
            await asyncio.sleep(0.01)
        after = [core.submit(f"r{d}", prompt(d, rng), 4, GREEDY) for d in RANGES]
        await core.stop()  # before a round: nothing was scored or drafted
        await store.close()
        return before, after

    before, after = asyncio.run(body())
    assert before == ""
    assert [r.domain_guess for r in after] == list(RANGES) and not any(r.domain for r in after)
