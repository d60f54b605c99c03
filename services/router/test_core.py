"""The router core end to end in one process, with the real engines: greedy output through
routing, token fusion, chunk fusion, trees and pipelined rounds equals the target's own greedy
decode; a drafter that dies mid-request does not fail it; caches are freed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import pytest
import structlog
import structlog.testing

from common.runtime.test_greedy_equality import hf_greedy, make_prompts
from common.spec.types import GREEDY, SamplingParams
from services.router.conftest import MAX_NEW
from services.router.core import RouterCore, common_prefix, sync_item
from services.router.domain import detect_domains
from services.router.inprocess import LocalDrafterPool, LocalVerifier
from services.router.settings import RouterSettings


async def generate_all(
    core: RouterCore,
    prompts: dict[str, list[int]],
    max_new: int,
    drain: bool = False,
    sampling: Mapping[str, SamplingParams] | None = None,
) -> dict[str, list[int]]:
    """Every prompt's output; ``drain``: let drafter work still running off the verifier's path
    (a prompt's scoring) finish before the core stops, instead of cancelling it; ``sampling``: the
    requests that sample, and how (the others are greedy)."""
    core.start()
    try:
        reqs = {rid: core.submit(rid, p, max_new, (sampling or {}).get(rid, GREEDY)) for rid, p in prompts.items()}
        out: dict[str, list[int]] = {}
        for rid, req in reqs.items():
            tokens: list[int] = []
            while True:
                ev = await asyncio.wait_for(req.events.get(), 120)
                assert ev.error is None, ev.error
                tokens += ev.tokens
                if ev.finished:
                    assert ev.finish_reason == "length"
                    break
            out[rid] = tokens
        if drain:
            await asyncio.wait_for(asyncio.gather(*core._off_path_tasks), 60)
        return out
    finally:
        await core.stop()


CONFIGS = {
    "token-fusion-2-drafters": RouterSettings(drafters_per_request=2, fusion="token", tree_width=3, rounds_in_flight=2),
    "token-fusion-width-1": RouterSettings(
        drafters_per_request=1, fusion="token", tree_width=1, rounds_in_flight=1, max_batch_requests=2
    ),
    "chunk-fusion": RouterSettings(drafters_per_request=2, fusion="chunk", rounds_in_flight=2),
    "all-drafters-no-routing": RouterSettings(all_drafters=True, routing=False, adaptive_k=False, initial_k=3),
    "tight-budget": RouterSettings(drafters_per_request=3, fusion="token", verify_token_budget=8, max_k=8, initial_k=6),
    "no-cost-control": RouterSettings(drafters_per_request=2, fusion="token", tree_width=3, cost_control=False),
    "chunk-no-cost-control": RouterSettings(drafters_per_request=2, fusion="chunk", cost_control=False),
    "no-speculation": RouterSettings(speculate=False),
    # the drafters alone under cost control; the draft gate prices the drafters' time too, and with the
    # tiny test models a drafter step can cost more than a verify pass, so on a loaded machine the gate
    # may rightly turn drafting off and leave nothing speculative to check: here it prices rows only
    "no-lookup": RouterSettings(drafters_per_request=2, tree_width=3, lookup_drafts=False, draft_pricing=False),
    # verification frontiers (frontiers.py): drafts verified chunk by chunk, the next drafted beside the pass
    "chunks-2-no-cost-control": RouterSettings(
        drafters_per_request=2, fusion="chunk", cost_control=False, adaptive_k=False, initial_k=6, verify_chunks="2"
    ),
    "chunks-1-token-fusion-no-cost-control": RouterSettings(
        fusion="token", tree_width=2, cost_control=False, adaptive_k=False, initial_k=5, verify_chunks="1"
    ),
    "chunks-auto": RouterSettings(drafters_per_request=2, tree_width=3, max_k=8, verify_chunks="auto"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_router_output_equals_target_greedy(name, engines, reference):
    verifier, drafters = engines
    prompts, expected = reference
    pool = LocalDrafterPool(drafters)
    core = RouterCore(CONFIGS[name], pool, LocalVerifier(verifier))
    got = asyncio.run(generate_all(core, prompts, MAX_NEW))
    assert got == expected
    assert core.counters.rounds > 0
    if CONFIGS[name].speculate:
        # the drafters were asked (a new request's gate record starts optimistic). What they proposed
        # is asserted only where nothing prices it: under cost control the machine's own timings decide,
        # and on a loaded machine they may rightly drop every node (a CI run of the width-1 case drafted
        # twice and pruned both trees whole, another verified 9 nodes and accepted none)
        assert any(pool.calls.values())
        if not CONFIGS[name].cost_control:
            assert core.counters.draft_tokens > 0 and core.counters.accepted_tokens > 0
    else:  # plain decoding: no drafter was ever asked, and the lookup drafter proposed nothing
        assert core.counters.draft_tokens == 0 and not any(pool.calls.values())
    if not CONFIGS[name].lookup_drafts or not CONFIGS[name].speculate:
        assert core.counters.lookup_tokens == 0
    # every cache was freed
    assert verifier.active_requests == 0
    assert all(e.active_requests == 0 for e in drafters.values())


def test_rounds_with_two_drafters_per_request_price_the_second(engines, reference):
    """One request, rounds one at a time, drafting inline: every round in which it drafted with two
    drafters feeds the extras' pricing (what the second drafter brought and cost), losslessly."""
    verifier, drafters = engines
    prompts, expected = reference
    rid = sorted(prompts)[0]
    # probes on every interval: the tiny engines' catch-ups cost several rounds each, and the share
    # of time a router lets probes take would leave this short run one probe; a round a token (no
    # plain steps), so that rounds come often enough to probe
    config = RouterSettings(
        drafters_per_request=2,
        rounds_in_flight=1,
        draft_ahead=False,
        lookup_drafts=False,
        probe_share=1.0,
        plain_steps=1,
    )
    core = RouterCore(config, LocalDrafterPool(drafters), LocalVerifier(verifier))
    assert asyncio.run(generate_all(core, {rid: prompts[rid]}, MAX_NEW)) == {rid: expected[rid]}
    assert core.counters.draft_tokens > 0
    assert core.control.extras_rounds > 0 and core.control.extras_cost > 0


def test_dead_drafter_does_not_fail_its_requests(engines, reference):
    verifier, drafters = engines
    prompts, expected = reference
    pool = LocalDrafterPool(drafters, fail_after={"near": 2, "self": 3})
    core = RouterCore(RouterSettings(drafters_per_request=2), pool, LocalVerifier(verifier))
    got = asyncio.run(generate_all(core, prompts, MAX_NEW))
    assert got == expected
    assert set(pool.failed) == {"near", "self"}
    assert verifier.active_requests == 0 and drafters["small"].active_requests == 0
    for d in pool.failed:  # a dead drafter process takes its caches with it; here the engines live on
        for rid in prompts:
            drafters[d].release(rid)


def test_no_drafter_falls_back_to_plain_decoding(engines, reference):
    verifier, _ = engines
    prompts, expected = reference
    core = RouterCore(RouterSettings(lookup_drafts=False), LocalDrafterPool({}), LocalVerifier(verifier))
    assert asyncio.run(generate_all(core, prompts, MAX_NEW)) == expected
    assert core.counters.draft_tokens == 0


def test_every_round_logs_its_rows_prompt_rows_and_committed_tokens_at_debug_level(engines, reference):
    """The per-round debug line accounts for the whole run: every prompt token is prefilled once,
    every committed token is counted once, and a pass has at least a row per request."""
    verifier, drafters = engines
    prompts, expected = reference
    core = RouterCore(
        RouterSettings(drafters_per_request=2, fusion="chunk"), LocalDrafterPool(drafters), LocalVerifier(verifier)
    )
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs() as logs:
            got = asyncio.run(generate_all(core, prompts, MAX_NEW))
    finally:
        structlog.configure(**saved)
    assert got == expected
    rounds = [e for e in logs if e["event"] == "round"]
    assert len(rounds) == core.counters.rounds
    assert sum(e["prefill_rows"] for e in rounds) == sum(len(p) for p in prompts.values())
    assert sum(e["committed"] for e in rounds) == sum(len(t) for t in got.values()) == core.counters.tokens_committed
    assert all(e["rows"] >= e["requests"] + e["prefill_rows"] and e["pass_ms"] > 0 for e in rounds)
    assert [e["round"] for e in rounds] == list(range(len(rounds)))


@pytest.mark.parametrize("rounds_in_flight", [1, 2])
def test_the_lookup_drafter_alone_speeds_up_repetitive_text_losslessly(engines, llama_target, rounds_in_flight):
    """No drafter model at all: the lookup drafter's proposals from each request's own text are the
    whole tree. On prompts that repeat a phrase, where the target goes on repeating, they are
    accepted (fewer rounds than tokens) and the output is the target's own. Cost control is off:
    every proposal is verified, so what is accepted does not hang on this machine's timings. A round
    a token (no plain steps): a round without proposals would otherwise decode several tokens before
    the next lookup, and this tiny target repeats the phrase only now and then."""
    verifier, _ = engines
    phrases = make_prompts(4, verifier.runner.vocab_size, seed=5)
    prompts = {rid: (p[:5] * 4) for rid, p in phrases.items()}
    expected = hf_greedy(llama_target, prompts, MAX_NEW)
    core = RouterCore(
        RouterSettings(rounds_in_flight=rounds_in_flight, cost_control=False, plain_steps=1),
        LocalDrafterPool({}),
        LocalVerifier(verifier),
    )
    assert asyncio.run(generate_all(core, prompts, MAX_NEW)) == expected
    assert core.counters.lookup_accepted > 0
    assert core.counters.accepted_tokens == core.counters.lookup_accepted  # every accepted token was a lookup token
    assert core.counters.rounds < len(prompts) * MAX_NEW
    assert verifier.active_requests == 0


def test_with_no_drafter_model_live_nothing_is_routed_ahead_and_plain_steps_still_come(engines, reference):
    """Every drafter down (or none started): the rounds do not route their requests ahead to
    drafters that are not there, round after round, which kept every batch from holding the pool
    (no plain steps) and marked every pass as run beside drafter work. Output is the target's own."""
    verifier, _ = engines
    prompts, expected = reference
    core = RouterCore(RouterSettings(rounds_in_flight=1, plain_steps=4), LocalDrafterPool({}), LocalVerifier(verifier))
    assert asyncio.run(generate_all(core, prompts, MAX_NEW)) == expected
    assert core.counters.routed_ahead == 0
    assert core.counters.plain_step_passes > 0


def test_each_round_s_plan_is_told_the_round_trip_and_the_plain_steps_it_would_forfeit(
    engines, llama_target, monkeypatch
):
    """Each round's plan is told the round's measured time beside its passes and the plain steps the
    round would decode without drafts (``pass_plan.choose_nodes`` weighs them): a verifier 30 ms
    away is measured as such, one in process as far less, and while the batch holds the pool the
    steps are the configured four (lookup nodes forfeit them only while the verifier does not draft
    at plain steps itself: with it, they forfeit none). Either way the output is the target's own."""
    import services.router.core as core_module

    told: list[tuple[float, int]] = []
    plan_pass = core_module.plan_pass

    def recording_plan_pass(*args, **kwargs):
        told.append((args[5], args[6]))  # overhead_s, plain_steps
        return plan_pass(*args, **kwargs)

    monkeypatch.setattr(core_module, "plan_pass", recording_plan_pass)
    verifier, _ = engines
    phrases = make_prompts(4, verifier.runner.vocab_size, seed=5)
    prompts = {rid: (p[:5] * 4) for rid, p in phrases.items()}
    expected = hf_greedy(llama_target, prompts, MAX_NEW)
    overhead = {}
    for name, delay_s in (("near", 0.0), ("far", 0.03)):
        told.clear()
        config = RouterSettings(rounds_in_flight=1, plain_steps=4, step_lookup=False)
        core = RouterCore(config, LocalDrafterPool({}), LocalVerifier(verifier, round_trip_s=delay_s))
        assert asyncio.run(generate_all(core, prompts, MAX_NEW)) == expected
        assert len(told) > 1 and max(steps for _, steps in told) == 4
        overhead[name] = told[-1][0]
    assert overhead["far"] >= 0.025 and 0 < overhead["near"] < overhead["far"]
    told.clear()
    core = RouterCore(RouterSettings(rounds_in_flight=1, plain_steps=4), LocalDrafterPool({}), LocalVerifier(verifier))
    assert asyncio.run(generate_all(core, prompts, MAX_NEW)) == expected
    assert told and all(steps == 1 for _, steps in told) and core.counters.plain_step_passes > 0


@pytest.fixture
def uncut_passes(monkeypatch):
    """The pass plan keeps every drafted node: on a busy machine the measured pass-time curve can
    price every node out (rightly), while the tests using this assert that drafts are verified."""
    import services.router.core as core_module

    monkeypatch.setattr(core_module, "plan_pass", lambda trees, lookups, *args, **kw: (trees, dict(lookups)))


class SlowDrafterPool(LocalDrafterPool):
    """Drafters whose every step takes ``delay_s`` (a drafter far slower than the verifier); it
    records the round count when each step was sent and when each call ran."""

    def __init__(self, engines, delay_s: float):
        super().__init__(engines)
        self.delay_s = delay_s
        self.rounds_drafted: list[int] = []
        self.spans: list[tuple[float, float]] = []
        self.core: RouterCore | None = None

    async def draft_many(self, calls):
        self.rounds_drafted.append(self.core.counters.rounds)
        t0 = time.monotonic()
        try:
            await asyncio.sleep(self.delay_s)
            return await super().draft_many(calls)
        finally:
            self.spans.append((t0, time.monotonic()))


def test_a_lone_request_stops_drafting_when_the_drafters_time_does_not_pay(engines, reference):
    """One request, a drafter that always agrees with the target but whose step costs 50 ms against
    a verify pass of a few: with the drafters' time priced, the request decodes plainly and drafts
    only on its probes (every eighth round), since plain decoding commits more per second; without,
    each node needs to pay only its verify row, so the request drafts in more rounds (the two runs
    compared with each other, not with a fixed share: how many rounds the unpriced rule drafts in
    follows the measured row cost, which a busy machine moves). Output is the target's own either way."""
    verifier, drafters = engines
    prompts, expected = reference
    rid = sorted(prompts)[0]

    def run(pricing: bool) -> tuple[list[int], int]:
        pool = SlowDrafterPool({"self": drafters["self"]}, delay_s=0.05)
        # routed inline (not while it decodes plainly: here scoring outlasts the whole request)
        # a token a round in both runs, so both have the same rounds and probes (plain steps would fold
        # the rounds of a request that stopped drafting, and its probes with them)
        config = RouterSettings(
            drafters_per_request=1,
            tree_width=1,
            rounds_in_flight=1,
            draft_pricing=pricing,
            draft_ahead=False,
            fusion="token",
            plain_steps=1,
        )
        core = pool.core = RouterCore(config, pool, LocalVerifier(verifier))
        assert asyncio.run(generate_all(core, {rid: prompts[rid]}, MAX_NEW)) == {rid: expected[rid]}
        return sorted(set(pool.rounds_drafted)), core.counters.rounds

    priced, rounds = run(True)
    unpriced, _ = run(False)
    # once the first rounds have measured both sides, only the probes draft
    assert [r for r in priced if r >= 4 and r % 8] == [], (priced, rounds)
    assert len(priced) < rounds / 2
    assert len(unpriced) > len(priced), (unpriced, priced)


def test_probes_of_a_request_the_gate_turned_down_take_at_most_their_share_of_the_time(
    engines, reference, llama_target
):
    """The lone request of the test above, 96 tokens long, its drafter's step costing 50 ms: once
    drafting is turned down, its probes' drafter time stays within ``probe_share`` of the run's time
    (plus the probe round that opened the window), where the round intervals alone would have
    probed on more rounds. Output is the target's own."""
    verifier, drafters = engines
    prompts, _ = reference
    rid = sorted(prompts)[0]
    expected = hf_greedy(llama_target, {rid: prompts[rid]}, 96)
    share = 0.05

    def run(probe_share: float) -> tuple[list[int], float, float]:
        pool = SlowDrafterPool({"self": drafters["self"]}, delay_s=0.05)
        config = RouterSettings(
            drafters_per_request=1,
            tree_width=1,
            rounds_in_flight=1,
            draft_ahead=False,
            fusion="token",
            probe_share=probe_share,
        )
        core = pool.core = RouterCore(config, pool, LocalVerifier(verifier))
        t0 = time.monotonic()
        assert asyncio.run(generate_all(core, {rid: prompts[rid]}, 96)) == expected
        wall = time.monotonic() - t0
        probe_rounds = sorted({r for r in pool.rounds_drafted if r >= 4 and r % 8 == 0})
        probe_s = sum(end - start for (start, end), r in zip(pool.spans, pool.rounds_drafted) if r in probe_rounds)
        return probe_rounds, probe_s, wall

    held, held_s, wall = run(share)
    free, _, _ = run(1e6)  # a window a few nanoseconds long: the round intervals alone
    longest = 0.05 * 4 + 0.05  # the most one probe round drafts here: k steps of 50 ms, and slack
    assert held_s <= share * wall + longest, (held, held_s, wall)
    assert held and len(held) < len(free), (held, free)


class SlowVerifier(LocalVerifier):
    """A verifier whose every pass takes ``delay_s`` more (and reports it as busy time); it
    records how many rounds were in flight at each call and when each call ran."""

    def __init__(self, engine, delay_s: float):
        super().__init__(engine)
        self.delay_s = delay_s
        self.in_flight: list[int] = []
        self.spans: list[tuple[float, float]] = []
        self.core: RouterCore | None = None

    async def verify(self, items):
        self.in_flight.append(self.core.rounds_in_flight)
        t0 = time.monotonic()
        try:
            await asyncio.sleep(self.delay_s)
            verdicts, busy_ns = await super().verify(items)
            return verdicts, busy_ns + int(self.delay_s * 1e9)
        finally:
            self.spans.append((t0, time.monotonic()))


@pytest.mark.parametrize("bound", ["verifier", "drafters"])
def test_a_second_round_is_in_flight_only_while_drafting_outlasts_verifying(engines, reference, bound):
    """Verifier-bound (a 40 ms pass, quick drafters): after the first rounds one round carries the
    whole pool, since a second would only pay the pass's fixed cost again. Drafter-bound (40 ms
    draft steps, a quick pass): two rounds overlap. Output is the target's own either way. Drafting
    ahead is off: it overlaps drafting with verification by itself, and a round whose requests drafted
    ahead measures no drafting on its path, which turned pipelining off in about half the runs."""
    verifier, drafters = engines
    prompts, expected = reference
    slow_verifier = bound == "verifier"
    # a weak drafter where the verifier is slow (many rounds), a perfect one where drafting is
    pool = SlowDrafterPool(
        {"small" if slow_verifier else "self": drafters["small" if slow_verifier else "self"]},
        delay_s=0.0 if slow_verifier else 0.04,
    )
    backend = SlowVerifier(verifier, delay_s=0.04 if slow_verifier else 0.0)
    config = RouterSettings(
        drafters_per_request=1, tree_width=1, rounds_in_flight=2, draft_pricing=False, draft_ahead=False
    )
    core = pool.core = backend.core = RouterCore(config, pool, backend)
    assert asyncio.run(generate_all(core, prompts, MAX_NEW)) == expected
    later = backend.in_flight[6:]
    if slow_verifier:
        assert later and max(later) == 1, backend.in_flight
        assert not core.control.pipelining
    else:
        assert max(later) == 2, backend.in_flight
        assert core.control.pipelining


@pytest.mark.parametrize("ahead", [True, False])
def test_drafting_requests_draft_while_the_rest_of_their_round_is_verified(engines, reference, ahead):
    """One round in flight, half the requests turned down by the draft gate (its decision forced
    here): with drafting ahead, the drafting half drafts while the other half's pass runs (a verify call overlaps a
    drafter call) and joins the next pass with its trees; without, every pass waits for the drafters.
    Output is the target's own either way."""
    verifier, drafters = engines
    prompts, expected = reference
    pool = SlowDrafterPool({"self": drafters["self"]}, delay_s=0.05)
    backend = SlowVerifier(verifier, delay_s=0.02)
    config = RouterSettings(
        drafters_per_request=1, tree_width=1, rounds_in_flight=1, draft_pricing=False, draft_ahead=ahead
    )
    core = pool.core = backend.core = RouterCore(config, pool, backend)
    turned_down = set(sorted(prompts)[::2])
    gate = core.gate.drafts
    core.gate.drafts = lambda r, *args, **kw: r.request_id not in turned_down and gate(r, *args, **kw)
    assert asyncio.run(generate_all(core, prompts, MAX_NEW)) == expected
    overlapping = [(d, v) for d in pool.spans for v in backend.spans if v[0] < d[1] and d[0] < v[1]]
    if ahead:
        assert core.counters.rounds_drafted_ahead > 0
        assert core.counters.draft_ahead_s > 0
        assert overlapping
        assert core.control.pass_ratio_beside > 0  # the passes beside the drafters are measured apart
    else:
        assert core.counters.rounds_drafted_ahead == 0
        assert not overlapping, overlapping[:3]
        assert core.control.pass_ratio_beside == 0
    assert core.counters.accepted_tokens > 0  # the drafting half drafted and was verified


@pytest.mark.parametrize("max_new", [MAX_NEW, 2])
def test_new_requests_decode_plainly_while_the_drafters_score_their_prompts(engines, reference, uncut_passes, max_new):
    """Scoring a new prompt (its domain) is a prefill in every drafter; it runs while the request's
    first passes (the target's prefill, then plain decoding) do, and the request drafts once routed.
    A request that finishes while being scored (two tokens against a scoring slower than two passes)
    leaves no cache behind in any drafter."""
    verifier, drafters = engines
    prompts, expected = reference
    pool = SlowDrafterPool(drafters, delay_s=0.05 if max_new == MAX_NEW else 0.5)
    backend = SlowVerifier(verifier, delay_s=0.02)
    config = RouterSettings(
        drafters_per_request=1, tree_width=1, rounds_in_flight=1, draft_pricing=False, fusion="token"
    )
    core = pool.core = backend.core = RouterCore(config, pool, backend)
    got = asyncio.run(generate_all(core, prompts, max_new, drain=True))
    assert got == {rid: toks[:max_new] for rid, toks in expected.items()}
    # (a request the cost control turns down later has its drafters catch up beside a pass too)
    assert core.counters.routed_ahead >= len(prompts) and core.counters.domains_by_drafters == len(prompts)
    scoring = pool.spans[0]  # the first drafter call scores every prompt
    assert any(v[0] < scoring[1] and scoring[0] < v[1] for v in backend.spans)  # a pass ran meanwhile
    if max_new == MAX_NEW:
        assert any(accepted for _, accepted in core.counters.by_drafter.values())  # they drafted once routed
    else:
        assert scoring[1] > max(v[1] for v in backend.spans)  # every pass was over before the scoring
    assert all(engine.active_requests == 0 for engine in drafters.values())


def test_new_requests_first_pass_does_not_wait_for_their_drafters_to_read_their_prompts(
    engines, reference, uncut_passes
):
    """A batch of new requests whose drafters need no scores (fixed drafters, no routing): their first
    pass, the target's prefill, goes to the verifier at once, while the drafters read the prompts
    (one call with nothing to propose) beside it; from then on they draft, their drafters holding
    the prompts. Output is the target's own."""
    verifier, drafters = engines
    prompts, expected = reference

    class RecordingPool(SlowDrafterPool):
        def __init__(self, engines, delay_s):
            super().__init__(engines, delay_s)
            self.top_ns: list[set[int]] = []

        async def draft_many(self, calls):
            self.top_ns.append({item.top_n for items in calls.values() for item in items})
            return await super().draft_many(calls)

    pool = RecordingPool(drafters, delay_s=0.05)
    backend = SlowVerifier(verifier, delay_s=0.02)
    config = RouterSettings(
        routing=False, drafters_per_request=1, tree_width=1, rounds_in_flight=1, draft_pricing=False, fusion="token"
    )
    core = pool.core = backend.core = RouterCore(config, pool, backend)
    got = asyncio.run(generate_all(core, prompts, MAX_NEW, drain=True))
    assert got == expected
    assert core.counters.routed_ahead >= len(prompts)  # their prompts (and any catch-up beside a pass)
    reading, first_pass = pool.spans[0], backend.spans[0]
    assert pool.top_ns[0] == {0}  # the first call only reads the prompts
    assert pool.rounds_drafted[0] == 0 and first_pass[0] < reading[1]  # the first pass did not wait for it
    assert any(v[0] < reading[1] and reading[0] < v[1] for v in backend.spans)  # it ran beside a pass
    assert any(accepted for _, accepted in core.counters.by_drafter.values())  # they drafted afterwards


def test_drafters_left_behind_by_plain_rounds_catch_up_beside_a_pass(engines, reference, monkeypatch):
    """A request that decoded plainly for more tokens than its drafters catch up inline (the gate
    turns it down from its second token to its twelfth here) has them read what it committed
    meanwhile off the verifier's path, as its prompt was read: a call that only reads, and the
    drafting calls after it bring them no more than the catch-up bound. Output is the target's own."""
    import services.router.core as core_module

    monkeypatch.setattr(core_module, "CATCH_UP_TOKENS", 4)
    verifier, drafters = engines
    prompts, expected = reference

    class RecordingPool(SlowDrafterPool):
        def __init__(self, engines, delay_s):
            super().__init__(engines, delay_s)
            self.items: list[tuple[str, int, int]] = []  # (request, top_n, tokens appended)

        async def draft_many(self, calls):
            self.items += [
                (item.request_id, item.top_n, len(item.append_ids)) for items in calls.values() for item in items
            ]
            return await super().draft_many(calls)

    pool = RecordingPool(drafters, delay_s=0.05)
    backend = SlowVerifier(verifier, delay_s=0.02)
    # (the lookup drafter's rounds without steps, so each plain token is a round of its own as the gate sees it)
    config = RouterSettings(
        routing=False,
        drafters_per_request=1,
        tree_width=1,
        rounds_in_flight=1,
        draft_pricing=False,
        fusion="token",
        step_lookup=False,
    )
    core = pool.core = backend.core = RouterCore(config, pool, backend)
    gate = core.gate.drafts
    core.gate.drafts = lambda r, *args, **kw: not 2 <= len(r.generated) < 12 and gate(r, *args, **kw)
    assert asyncio.run(generate_all(core, prompts, MAX_NEW, drain=True)) == expected
    # their prompts, then what they decoded plainly; on a busy machine the cost control can turn a
    # request down for a few more rounds of its own, and its drafters then catch up once more
    assert core.counters.routed_ahead >= 2 * len(prompts)
    seen: set[str] = set()
    catch_ups: dict[str, list[int]] = {}
    for rid, top_n, appended in pool.items:
        if rid in seen and top_n == 0:
            catch_ups.setdefault(rid, []).append(appended)
        seen.add(rid)  # a request's first item reads its prompt
    assert set(catch_ups) == set(prompts)  # every request caught up off the path at least once
    assert min(a for got in catch_ups.values() for a in got) > 4  # never what an inline catch-up takes
    drafting = [(rid, appended) for rid, top_n, appended in pool.items if top_n > 0]
    assert drafting and all(appended <= 4 + 1 for _, appended in drafting)  # at most the bound, and a fused token


def test_a_lone_new_request_is_scored_before_its_first_pass(engines, reference, uncut_passes):
    """Alone in its round, a new request has no other pass to hide its scoring behind: the drafters
    score its prompt before its first pass (no verify call overlaps the scoring), and it drafts from
    that first round on."""
    verifier, drafters = engines
    prompts, expected = reference
    rid = sorted(prompts)[0]
    pool = SlowDrafterPool(drafters, delay_s=0.05)
    backend = SlowVerifier(verifier, delay_s=0.02)
    config = RouterSettings(
        drafters_per_request=1, tree_width=1, rounds_in_flight=1, draft_pricing=False, fusion="token"
    )
    core = pool.core = backend.core = RouterCore(config, pool, backend)
    assert asyncio.run(generate_all(core, {rid: prompts[rid]}, MAX_NEW)) == {rid: expected[rid]}
    assert core.counters.routed_ahead == 0 and core.counters.domains_by_drafters == 1
    scoring = pool.spans[0]
    assert not any(v[0] < scoring[1] and scoring[0] < v[1] for v in backend.spans)
    assert pool.rounds_drafted[:2] == [0, 0]  # scored, then drafted for the first pass
    assert any(accepted for _, accepted in core.counters.by_drafter.values())


def test_domain_signal_picks_the_drafter_that_knows_the_text(engines, reference):
    """A prompt written by the target is most likely under the target-like drafters."""
    verifier, drafters = engines
    prompts, expected = reference
    text = {rid: prompts[rid] + expected[rid] for rid in prompts}

    async def body():
        core = RouterCore(
            RouterSettings(),
            LocalDrafterPool({"near": drafters["near"], "small": drafters["small"]}),
            LocalVerifier(verifier),
        )
        reqs = [core.submit(rid, t, 4, GREEDY) for rid, t in text.items()]
        await detect_domains(core.drafting, reqs, ["near", "small"])
        for r in reqs:
            core._finish(r, "cancelled")
        return [r.domain for r in reqs]

    assert asyncio.run(body()) == ["near-domain"] * len(text)


def test_cancel_frees_caches(engines, reference):
    verifier, drafters = engines
    prompts, _ = reference

    async def body():
        core = RouterCore(RouterSettings(), LocalDrafterPool(drafters), LocalVerifier(verifier))
        core.start()
        req = core.submit("c1", prompts["r1"], 200, GREEDY)
        await asyncio.wait_for(req.events.get(), 60)  # first round done
        core.cancel("c1")
        while True:
            ev = await asyncio.wait_for(req.events.get(), 60)
            if ev.finished:
                break
        await core.stop()
        return ev

    ev = asyncio.run(body())
    assert ev.finish_reason == "cancelled"
    assert verifier.active_requests == 0 and all(e.active_requests == 0 for e in drafters.values())


def test_sync_item_rolls_back_to_common_prefix():
    item, after = sync_item([1, 2, 3, 9, 9], [1, 2, 3, 4], top_n=2)
    assert (item.truncate_to, item.append_ids, after) == (3, (4,), [1, 2, 3, 4])
    item, _ = sync_item([1, 2], [1, 2, 3, 4], top_n=2)
    assert (item.truncate_to, item.append_ids) == (-1, (3, 4))
    item, _ = sync_item([1, 2, 3], [1, 2, 3], top_n=2)  # nothing new: re-feed the last token
    assert (item.truncate_to, item.append_ids) == (2, (3,))
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2


class RestartingVerifier:
    """The real verifier engine, which 'restarts' (loses every request's state) after batch 3 and
    whose stream 'breaks' (the call raises) on batch 6."""

    def __init__(self, engine):
        self.inner = LocalVerifier(engine)
        self.engine = engine
        self.n = 0

    async def verify(self, items):
        self.n += 1
        if self.n == 3:
            for rid in list(self.engine._requests):
                self.engine.release(rid)
        if self.n == 6:
            raise ConnectionError("verifier stream broke")
        return await self.inner.verify(items)

    def release(self, request_ids):
        self.inner.release(request_ids)


def test_verifier_restart_resumes_every_request_with_identical_output(engines, reference):
    verifier, drafters = engines
    prompts, expected = reference
    backend = RestartingVerifier(verifier)
    core = RouterCore(RouterSettings(drafters_per_request=2), LocalDrafterPool(drafters), backend)
    got = asyncio.run(generate_all(core, prompts, MAX_NEW))
    assert backend.n > 6  # both failures happened while requests were running
    assert got == expected
    assert verifier.active_requests == 0 and all(e.active_requests == 0 for e in drafters.values())


# chunks: drafts of 6 verified by chunks of 2, every node verified (frontiers.py)
@pytest.mark.parametrize(
    "chunks",
    [{}, dict(verify_chunks="2", cost_control=False, adaptive_k=False, initial_k=6)],
    ids=["whole", "chunks"],
)
def test_greedy_and_sampled_requests_in_one_batch_feed_their_own_calibrations(engines, reference, chunks):
    """Greedy and sampled requests drafted in the same rounds (token fusion groups them by pricing):
    the greedy outputs still equal the target's own, the sampled ones finish, and each kind's verdicts
    feed its own calibration of drafter nodes; so with drafts verified by chunks (frontiers.py)."""
    verifier, drafters = engines
    prompts, expected = reference
    rids = sorted(prompts)
    sampled = set(rids[1::2])
    config = RouterSettings(
        drafters_per_request=2,
        fusion="token",
        tree_width=2,
        rounds_in_flight=1,
        draft_ahead=False,
        lookup_drafts=False,
        probe_share=1.0,
        plain_steps=1,
        **chunks,
    )
    core = RouterCore(config, LocalDrafterPool(drafters), LocalVerifier(verifier))
    prior = sum(core.control.sampled_calibration.seen)

    got = asyncio.run(
        generate_all(
            core,
            {rid: prompts[rid] for rid in rids},
            MAX_NEW,
            sampling=dict.fromkeys(sampled, SamplingParams(temperature=0.8, seed=7)),
        )
    )
    assert {rid: got[rid] for rid in rids if rid not in sampled} == {
        rid: expected[rid] for rid in rids if rid not in sampled
    }
    assert all(len(got[rid]) == MAX_NEW for rid in sampled)
    assert sum(core.control.sampled_calibration.seen) > prior
    assert sum(core.control.calibration.seen) > prior
    if chunks:  # later chunks were drafted beside passes, and some verified next
        assert core.counters.frontier_chunks_kept > 0
