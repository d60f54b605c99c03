"""The router's rounds: gate, route, draft, plan, verify, apply; pipelined, drafting ahead.

The request pool they draw from is ``pool.py``'s (:class:`RequestPool`, a base of
:class:`RouterCore`), the drafter work they start off the verifier's path ``ahead.py``'s
(:class:`OffPathDrafting`, another), what a round teaches the router ``feedback.py``'s
(:class:`RoundFeedback`, a third), and whether a round may speculate at all ``yield_guard.py``'s;
where every other part lives: the package docstring. No gRPC here: drafters and the verifier are
reached through the small :class:`DrafterPool` and :class:`VerifierBackend` protocols (gRPC stream
clients in production, in-process engines in tests), so the whole round logic is unit-testable.

A **round** for a batch of requests (see DESIGN.md):

0. *guard*: the yield guard's epoch decides whether the round may speculate at all: where its
   measurements say speculation commits fewer tokens a second than plain decoding at this load, or
   while it runs plain decoding as a control group, the round drafts nothing and looks nothing up.
1. *gate + route*: the draft gate decides which requests the drafter models draft for (their
   first node must repay its verify row and its share of the draft step; the others decode
   plainly and are probed now and then). A drafting request without a routing vector gets one:
   its domain (the lexicon's, or the drafters' scores of the prompt) seeds it from the expertise
   profiles.
2. *draft*: every selected drafter's cache is brought to the committed sequence (rolled back to
   the longest common prefix, the rest appended), then token fusion (k steps; at each step every
   selected drafter proposes top-n, the routing-weighted best becomes the next tree node and is
   appended by all of them, runners-up become sibling leaves) or chunk fusion (each drafter
   drafts a k-chain, chains merged). The lookup drafter adds its chains from the request's own
   text and from the lookup corpus to every tree, for free.
3. *plan + verify*: the batch's nodes are cut to the count that maximises expected tokens per
   second of the pass on the measured pass-time curve; all trees go to the verifier in one message.
   With ``--verify-chunks`` a draft goes by chunks (``frontiers.py``): the round drafts and verifies
   its first chunk, the drafters draft the next beside the pass, and the verdict keeps it for the
   next pass or prunes it unverified.
4. *apply*: committed tokens grow by the accepted path + the next token; drafters that proposed
   accepted tokens are credited; routing vectors, speculation length, calibrations and the Redis
   profiles are updated; the tokens are streamed to the request's submitter.

A round's drafting requests may *draft ahead* and its new requests be *routed ahead* (``ahead.py``),
so a round does not hold the verifier for the drafters of a few of its requests; a round of one
request scores its new prompt inline, as nothing else would be verified meanwhile.

``rounds_in_flight`` workers run rounds concurrently over disjoint batches, so one batch drafts
while another verifies; a request is in at most one round at a time. With cost control they do so
only while pipelining pays (``SpeculationControl.pipeline_pays``: drafting outlasts the verify
pass), each round then taking its share of the pool; otherwise one round carries the whole pool,
so the verifier pays its fixed cost per pass once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from common.logs import get_logger
from common.spec.fusion import DraftTree
from common.spec.types import Verdict, VerifyItem
from services.corpus import CorpusLoader
from services.router.admission import SubmitLimits
from services.router.control import SpeculationControl
from services.router.domain import RequestRouting, SharedLexicon, infer_domain
from services.router.drafting import Drafting, common_prefix, sync_item, unread_tokens
from services.router.feedback import RoundFacts, RoundFeedback
from services.router.frontiers import Frontiers
from services.router.gate import DraftGate, gate_domain, probe_order
from services.router.lexicon import DomainLexicon
from services.router.lookup import LookupNodes
from services.router.lookup_drafting import LookupDrafting
from services.router.matching import match_verdicts
from services.router.pass_plan import plan_pass
from services.router.requests import (
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    Counters,
    DrafterPool,
    Event,
    ProfileSink,
    ProfileSource,
    Request,
    RequestFailed,
    RequestStats,
    VerifierBackend,
)
from services.router.scheduler import PLAIN_STREAK, LoadControl, plain_steps
from services.router.settings import RouterSettings
from services.router.verdicts import ProfileUpdate, VerdictApplication
from services.router.yield_guard import YieldGuard

# the names the servicer, the benchmarks and the tests import from here
__all__ = [
    "FINISH_CANCELLED",
    "FINISH_EOS",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Counters",
    "DrafterPool",
    "Event",
    "ProfileSink",
    "ProfileSource",
    "Request",
    "RequestFailed",
    "RequestStats",
    "RouterCore",
    "VerifierBackend",
    "common_prefix",
    "infer_domain",
    "sync_item",
]

log = get_logger("router")

# committed tokens a request's drafters may have left unread and still catch up inline, in the round
# that drafts for it; more are read off the verifier's path first (see ``_round``)
CATCH_UP_TOKENS = 16


class RouterCore(RoundFeedback):
    def __init__(
        self,
        config: RouterSettings,
        drafters: DrafterPool,
        verifier: VerifierBackend,
        profiles: ProfileSource | None = None,
        record: ProfileSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: Any = None,
        limits: SubmitLimits | None = None,
        load_lexicon: Callable[[], Awaitable[DomainLexicon | None]] | None = None,
        record_lexicon: Callable[[str, Sequence[int]], Awaitable[None]] | None = None,
        load_corpus: CorpusLoader | None = None,
    ):
        self.config = config
        self.limits = limits  # the target's vocabulary and context, for checking submissions
        self.drafters = drafters
        self.verifier = verifier
        self.profiles = profiles
        self.record = record
        self.clock = clock
        self.metrics = metrics  # services.router.metrics.RouterMetrics, or None
        self.requests: dict[str, Request] = {}
        self.counters = Counters()
        self.load = LoadControl()
        self.control = SpeculationControl(enabled=config.cost_control)
        self.control.curve.set_prior(getattr(verifier, "pass_times", ()))  # the pass's shape by rows (pass_plan.py)
        self.lookups = LookupDrafting(config, self.control, self.counters, load_corpus)
        self.drafting = Drafting(config, drafters, self.control, clock)
        self.gate = DraftGate(config, self.control, clock)
        # the domain lexicon shared through Redis (the zoo's seed + what routers learned), when given
        shared = (
            None
            if load_lexicon is None or record_lexicon is None
            else SharedLexicon(load_lexicon, lambda domain, prompt: self._background(record_lexicon(domain, prompt)))
        )
        self.routing = RequestRouting(config, self.drafting, DomainLexicon(), self.counters, profiles, shared, clock)
        self.verdicts = VerdictApplication(self.control, self.gate, self.lookups.calibration, self.counters, metrics)
        self.frontiers = Frontiers(config.verify_chunks, self.counters, clock, metrics)
        self._wakeup = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []
        self._bg: set[asyncio.Task[Any]] = set()
        self._off_path_tasks: set[asyncio.Task[None]] = set()
        self._off_path_started = 0  # off-path drafter calls started so far (a pass they overlap runs slower)
        self.rounds_in_flight = 0
        self._finished_seen = 0  # requests finished when the latest round began (a slot freed since: _round)
        self._closed = False
        # speculation only where it is measured to commit more than plain decoding (yield_guard.py)
        self.guarding = config.yield_guard and config.speculate and config.cost_control
        self.guard = YieldGuard(
            config.yield_epoch_rounds, config.yield_epoch_s, config.max_batch_requests, clock, self._guard_settled
        )

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        # the shared lexicon from the start: the draft gate keys new requests by its guess of their domain
        self._background(self.routing.reload(throttled=False))
        if self.lookups.load_corpus is not None:
            self._background(self.lookups.keep_corpus_loaded(lambda: self._closed))
        for i in range(max(1, self.config.rounds_in_flight)):
            self._workers.append(asyncio.create_task(self._worker(i), name=f"round-worker-{i}"))

    async def stop(self) -> None:
        self._closed = True
        for task in (*self._workers, *self._off_path_tasks):
            task.cancel()
        await asyncio.gather(*self._workers, *self._off_path_tasks, return_exceptions=True)
        for req in list(self.requests.values()):
            self._finish(req, error=RequestFailed("router shutting down", "unavailable"))
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)

    # ---- rounds ------------------------------------------------------------------------------

    async def _worker(self, index: int) -> None:
        while True:
            await asyncio.sleep(0)  # let submissions and cancellations in between rounds
            if self.rounds_in_flight >= self._rounds_allowed():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self._pick()
            if not batch:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self.rounds_in_flight += 1
            try:
                await self._round(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not kill the worker; fail the batch loudly
                log.exception("round failed", error=str(exc), requests=[r.request_id for r in batch])
                for req in batch:
                    if not req.drafting_ahead:
                        self._finish(req, error=RequestFailed(f"internal error in round: {exc}", "internal"))
            finally:
                self.rounds_in_flight -= 1
                for req in batch:
                    if not req.drafting_ahead:  # _draft_ahead hands those back
                        self._hand_back(req)
                self._wakeup.set()

    async def _round(self, batch: list[Request]) -> None:
        """One round, in the yield guard's current epoch when it guards (its arm may make the round plain)."""
        if not self.guarding:
            await self._run_round(batch, plain=False)
            return
        sampled = 2 * sum(not r.sampling.greedy for r in self.requests.values()) > len(self.requests)
        ticket = self.guard.begin(len(self.requests), sampled)
        self.counters.guard_plain_rounds += ticket.plain
        result = None
        try:
            result = await self._run_round(batch, plain=ticket.plain)
        finally:
            if result is None:
                self.guard.abandon(ticket)
            else:
                self.guard.end(ticket, *result)

    async def _run_round(self, batch: list[Request], plain: bool) -> tuple[int, float] | None:
        """The round proper; ``plain``: nothing is drafted or looked up (the yield guard's plain arm).
        Returns the tokens it committed and its verifier-busy seconds (None when the verifier failed)."""
        t0 = self.clock()
        ahead = {
            r.request_id: r.ahead
            for r in batch
            if not plain and r.ahead is not None and r.ahead.committed == len(r.sequence)
        }
        for r in batch:
            r.ahead = None
        # another round in flight overlaps this one's drafting (this round counts itself)
        ks = {r.request_id: min(self._k(r), r.max_new_tokens - len(r.generated)) for r in batch}
        # with no drafter model live (all down, or none started) nothing is drafted or routed by
        # them: the lookup drafter alone, and plain steps where its chains do not pay
        models = bool(self.drafters.live())
        self.gate.new_round()
        for r in probe_order(batch):  # a domain's probe goes to its least recently probed request
            if (
                plain
                or not models
                or r.request_id in ahead
                or r.routing_ahead
                or not self.gate.drafts(
                    r, len(batch), self.counters.rounds, self.rounds_in_flight > 1, chain=ks[r.request_id]
                )
            ):
                ks[r.request_id] = 0
        # a new prompt (unscored, or its first pass: the target's prefill) is routed and read by its
        # drafters while the request's first passes run, the target's prefill among them: it drafts
        # once its drafters hold its prompt, and no pass waits for the drafters' prefill of it. So is
        # a request whose drafters have more than CATCH_UP_TOKENS of its tokens left to read (it decoded
        # plainly since they last drafted for it, or they never read its prompt): the round would
        # otherwise hold every request's pass while they read them.
        # A round of one request has no other pass to hide that behind: it happens inline, since
        # drafter work beside a round's own passes only slows them on shared cores
        fresh = [
            r
            for r in batch
            if ks[r.request_id] > 0
            and (self.routing.needs_scores(r) or not r.verifier_synced or unread_tokens(r) > CATCH_UP_TOKENS)
        ]
        routed_ahead = 0
        if fresh and len(batch) > 1 and self.config.draft_ahead and self.config.cost_control:
            for r in fresh:
                ks[r.request_id] = 0
                r.routing_ahead = True
            routed_ahead = len(fresh)
            self._off_path(self._route_ahead(fresh))
        probes = sum(r.probing and ks[r.request_id] > 0 for r in batch)
        drafting = [r for r in batch if ks[r.request_id] > 0]
        drafted_ahead = 0
        if self._drafts_ahead(batch, drafting, ks):
            # the drafters would hold the whole pass for a few requests: those draft while the others
            # are verified now, and join the next pass with their trees
            for r in drafting:
                r.drafting_ahead = True
            drafted_ahead = len(drafting)
            self.counters.rounds_drafted_ahead += 1
            self._off_path(self._draft_ahead(drafting, {r.request_id: ks[r.request_id] for r in drafting}))
            batch = [r for r in batch if not r.drafting_ahead]
            ks = {r.request_id: 0 for r in batch}
        left = self.frontiers.cut(batch, ks)  # a draft verified by chunks drafts its first now (frontiers.py)
        with self.frontiers.wait.drafting(any(ks.values())):
            trees, selected = await self._draft(batch, ks)
        waited = any(selected.values())  # a drafter model was asked, and this round waited for it
        for rid, got in ahead.items():
            trees[rid], selected[rid] = got.tree, list(got.selected)
            left[rid] = got.depth_left  # a chunk's: its draft's next chunk is drafted beside this pass
        lookups = (
            {r.request_id: self.lookups.chains(r, trees[r.request_id]) for r in batch}
            if self.config.lookup_drafts and self.config.speculate and not plain
            else {}
        )
        # a request that left the pool since the latest round began freed a slot that its client (in
        # a closed loop) refills within a round trip: unless the batch is full again, this round
        # decodes one step, so that the next request joins after one pass, not after all the steps
        refilling = (
            self.counters.requests_finished > self._finished_seen and len(batch) < self.config.max_batch_requests
        )
        self._finished_seen = self.counters.requests_finished
        whole_pool = (
            self.rounds_in_flight == 1 and not self._off_path_tasks and not refilling and self._holds_every_slot(batch)
        )
        remaining = [r.max_new_tokens - len(r.generated) for r in batch]
        if self.config.cost_control and any(len(t) for t in trees.values()):
            # the whole batch's nodes against the measured pass-time curve, and against the plain
            # steps the round would decode without them, were its requests' streaks long enough
            # (pass_plan.py)
            plain_rows = sum(1 + (0 if r.verifier_synced else len(r.sequence)) for r in batch)
            rates = {r.request_id: self.control.calibration_for(r.sampling.greedy) for r in batch}
            # (with the verifier drafting at plain steps, lookup nodes forfeit none: only model nodes do)
            forgone = (
                plain_steps(
                    self.config.plain_steps, remaining, [PLAIN_STREAK] * len(batch), drafts=False, whole_pool=whole_pool
                )
                if self.lookups.forfeits_steps(batch, trees, lookups)
                else 1
            )
            trees, lookups = plan_pass(
                trees, lookups, plain_rows, rates, self.control.pass_seconds, self.control.round_overhead_s, forgone
            )
        t1 = self.clock()
        if drafting and not drafted_ahead:
            self.gate.charge_probes(t1 - t0, probes, len(drafting))  # the probes' share of the drafting
            log.debug(
                "round waited for its drafters",
                round=self.counters.rounds,
                requests=len(batch),
                drafting=len(drafting),
                probing=probes,
                draft_ms=round(1e3 * (t1 - t0), 1),
            )
        steps = plain_steps(
            self.config.plain_steps,
            remaining,
            [r.plain_streak for r in batch],
            drafts=self.lookups.forfeits_steps(batch, trees, lookups),
            whole_pool=whole_pool,
        )
        step_lookup = self.lookups.at_steps(batch) if steps > 1 and not plain else {}
        depths = [step_lookup.get(r.sampling.greedy, ((), ())) for r in batch]  # (own text, corpus) each
        items = [
            VerifyItem(
                request_id=r.request_id,
                append_ids=()
                if r.verifier_synced
                else tuple(r.sequence),  # a resumed request re-prefills what is committed
                tree=trees[r.request_id].to_token_tree(),
                sampling=r.sampling,
                plain_steps=steps,
                stop_ids=tuple(r.stop_ids) if steps > 1 else (),
                step_lookup=text,
                step_corpus=corpus,
                domain=gate_domain(r) if step_lookup else "",
                max_tokens=left if steps > 1 else 0,
                logprobs=r.logprobs,
                prompt_len=0 if r.verifier_synced else r.prompt_len,
            )
            for r, left, (text, corpus) in zip(batch, remaining, depths)
        ]
        # drafter work off the path runs beside this pass if it was running or started meanwhile
        busy_before, started_before = bool(self._off_path_tasks), self._off_path_started
        chunks = self.frontiers.start(self._draft, batch, trees, left)  # the next chunks, beside this pass
        self._off_path_started += chunks is not None
        try:
            with self.frontiers.wait.verifying():
                verdicts, busy_ns = await self.verifier.verify(items)
        except asyncio.CancelledError:
            if chunks is not None:
                chunks.cancel()
            raise
        except Exception as exc:  # broken stream: the verifier may be restarting; resume on it
            await self.frontiers.finish(chunks)  # drafted on a hypothesis no verdict confirmed: dropped
            await self._verifier_failed(batch, exc)
            return None
        t2 = self.clock()
        next_chunks = await self.frontiers.finish(chunks)
        updates: list[ProfileUpdate] = []
        committed_before = self.counters.tokens_committed
        matched = match_verdicts([(r.request_id, len(r.prompt) + len(r.generated)) for r in batch], verdicts)
        for r in batch:
            self._apply(
                r,
                trees[r.request_id],
                selected.get(r.request_id, []),
                matched[r.request_id],
                updates,
                int((t2 - t0) * 1e9),
                lookups.get(r.request_id, ()),
            )
        self.gate.settle(batch)
        for r in batch:
            r.plain_streak = 0 if self.lookups.forfeits_steps([r], trees, lookups) else r.plain_streak + 1
        self._observe_extras(batch, trees, selected, matched, set(ahead), t1 - t0)
        self.frontiers.count(trees, matched)
        self.frontiers.settle(batch, next_chunks)
        facts = RoundFacts(
            batch=batch,
            items=items,
            verdicts=matched,
            committed=self.counters.tokens_committed - committed_before,
            busy_s=busy_ns / 1e9,
            times=(t0, t1, t2),
            plain=plain,
            waited=waited or chunks is not None,
            beside=busy_before or self._off_path_started != started_before,
            drafted_ahead=drafted_ahead,
            routed_ahead=routed_ahead,
            probes=probes,
        )
        self._measure(facts)
        if updates and self.record is not None:
            self._background(self.record(updates))
        self.counters.apply_s += self.clock() - t2
        return facts.committed, facts.busy_s

    def _apply(
        self,
        r: Request,
        tree: DraftTree,
        selected: list[str],
        verdict: Verdict,
        updates: list[ProfileUpdate],
        round_ns: int,
        lookups: Sequence[LookupNodes] = (),
    ) -> None:
        if r.done:
            return
        outcome = self.verdicts.apply(r, tree, selected, verdict, updates, round_ns, lookups)
        if outcome.ends:
            self._finish(r, outcome.finish_reason, outcome.error)
