"""Drafting strategies of a round (no gRPC here): who drafts each request, token fusion, chunk fusion.

- :meth:`Drafting.select`: the drafters of one request (routing by expertise, or a fixed set).
- :meth:`Drafting.tokens`: token fusion (the loop is ``common/spec/token_fusion.py``). k steps; at each
  step every selected drafter proposes its top-n, the routing-weighted best becomes the next node
  and is appended by all of them, runners-up become siblings. Every node is priced by
  :class:`~services.router.control.SpeculationControl` (a node, and a step, are kept only while they
  pay). A request whose drafters all live in one drafter process is fused there, the round in one
  message; the rest are fused from here, one message per step.
- :meth:`Drafting.chunks`: chunk fusion. Each drafter drafts a whole k-chain in one message; the
  chains are merged into a prefix tree, then priced and pruned.

Drafter caches are synced to the committed sequence with :func:`sync_item` (rolled back to the
longest common prefix, the rest appended): the committed prefix is never recomputed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from common.logs import get_logger
from common.spec.fusion import DraftTree, fuse_chains
from common.spec.token_fusion import FusionOutcome, FusionRequest, FusionSource, StepPricing, TokenFusion
from common.spec.types import DraftItem, DraftResult
from services.router.control import SpeculationControl
from services.router.lookup import LOOKUP_ID
from services.router.matching import match_draft_results
from services.router.requests import DrafterPool, Request
from services.router.settings import RouterSettings

log = get_logger("router")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def sync_item(
    cache: Sequence[int], sequence: Sequence[int], top_n: int, chain_len: int = 0, score: bool = False
) -> tuple[DraftItem, list[int]]:
    """The draft item that brings a drafter cache holding ``cache`` to ``sequence`` and proposes
    the next position. Returns the item and the cache contents afterwards (the whole sequence).
    At least one token is always appended so the drafter has fresh logits to propose from."""
    keep = min(common_prefix(cache, sequence), len(sequence) - 1)
    truncate_to = keep if keep < len(cache) else -1
    item = DraftItem(request_id="", truncate_to=truncate_to, append_ids=tuple(sequence[keep:]), top_n=top_n)
    if chain_len or score:
        item = replace(item, chain_len=chain_len, score_append=score)
    return item, list(sequence)


def extras_gain(tree: DraftTree, selected: Sequence[str], accepted_nodes: Sequence[int]) -> int:
    """Accepted tokens of a request's round that only its drafters beyond the first (``selected[0]``,
    the best routed) brought: the accepted path from its first node that neither the first drafter
    (among any of its candidates) nor the lookup drafter (never gated: its nodes are there anyway)
    proposed, as the tree's source masks record. Without the extras the path would have stopped
    there. A lower bound on what they add: their votes may also have put one of the first drafter's
    runners-up on the chain that drafting goes on from, which this does not count. 0 with one drafter."""
    if len(selected) < 2 or selected[0] not in tree.drafter_ids:
        return 0
    anyway = 0
    for d in (selected[0], LOOKUP_ID):
        if d in tree.drafter_ids:
            anyway |= 1 << tree.drafter_ids.index(d)
    for i, node in enumerate(accepted_nodes):
        if not tree.source_masks[node] & anyway:
            return len(accepted_nodes) - i
    return 0


def extras_seconds(selected: Mapping[str, Sequence[str]], draft_s: float) -> float:
    """The share of a round's ``draft_s`` that its extra drafters cost: the drafters that are only
    ever some request's second or later (no request's first), each taken to cost an equal share of
    the round (the drafter models of a zoo are one shape, and a drafter host runs them one after
    another)."""
    every = {d for chosen in selected.values() for d in chosen}
    leads = {chosen[0] for chosen in selected.values() if chosen}
    return draft_s * len(every - leads) / len(every) if every else 0.0


class Drafting:
    """Drafts the trees of a round through a :class:`~services.router.requests.DrafterPool`."""

    def __init__(
        self, config: RouterSettings, drafters: DrafterPool, control: SpeculationControl, clock: Callable[[], float]
    ) -> None:
        self.config = config
        self.drafters = drafters
        self.control = control
        self.clock = clock

    def select(self, r: Request, live: list[str]) -> list[str]:
        if not live:
            return []
        if self.config.all_drafters:
            return sorted(live)
        count = self.control.drafters_per_request(self.config.drafters_per_request)
        if not self.config.routing:
            return sorted(live)[:count]
        chosen = r.routing.select(count, self.config.explore_threshold)
        return [d for d in chosen if d in live]

    async def tokens(
        self, batch: list[Request], ks: Mapping[str, int]
    ) -> tuple[dict[str, DraftTree], dict[str, list[str]]]:
        """Token fusion (``common/spec/token_fusion.py``). A request whose drafters all live in one drafter
        process is fused there, the whole round in one message (``local_fusion``); the others are
        fused here, one message per draft step. Both run the same loop with this round's pricing."""
        live = list(self.drafters.live())
        width = self.config.tree_width
        selected = {r.request_id: self.select(r, live) if ks[r.request_id] > 0 else [] for r in batch}
        pipelined = self.config.rounds_in_flight > 1 and self.control.pipelining
        # greedy and sampled requests are priced with their own calibration, so fused apart
        pricing = {
            greedy: self.control.step_pricing(pipelined, greedy) if self.config.cost_control else StepPricing()
            for greedy in (True, False)
        }
        greedy_of = {r.request_id: r.sampling.greedy for r in batch}
        requests: list[FusionRequest] = []
        for r in batch:
            weights = r.routing.weights(selected[r.request_id])
            sequence = r.sequence
            sources = []
            for d in selected[r.request_id]:
                item, after = sync_item(r.drafter_cache.get(d, []), sequence, top_n=width)
                sources.append(FusionSource(d, weights[d], item, len(after)))
            requests.append(FusionRequest(r.request_id, ks[r.request_id], tuple(sources)))
        by_host: dict[tuple[str | None, bool], list[FusionRequest]] = {}
        host_of = getattr(self.drafters, "fusion_host", None) if self.config.local_fusion else None
        for fr in requests:
            host = host_of(fr.request_id, [s.drafter_id for s in fr.sources]) if host_of and fr.sources else None
            by_host.setdefault((host, greedy_of[fr.request_id]), []).append(fr)
        outcomes: dict[str, FusionOutcome] = {}
        for part in await asyncio.gather(
            *(
                self._fuse_here(reqs, pricing[greedy]) if host is None else self._fuse_at(host, reqs, pricing[greedy])
                for (host, greedy), reqs in by_host.items()
            )
        ):
            outcomes.update(part)
        trees: dict[str, DraftTree] = {}
        for r in batch:
            rid = r.request_id
            out = outcomes.get(rid) or FusionOutcome(
                DraftTree(drafter_ids=list(selected[rid])), failed=dict.fromkeys(selected[rid], "no answer")
            )
            sequence = r.sequence
            for d in selected[rid]:  # the router's mirror of each drafter's cache
                if d in out.cache_len:
                    r.drafter_cache[d] = sequence + out.fused[: max(0, out.cache_len[d] - len(sequence))]
                else:
                    r.drafter_cache.pop(d, None)
            selected[rid] = [d for d in selected[rid] if d in out.cache_len]
            trees[rid] = out.tree
        return trees, selected

    async def prefill(self, batch: list[Request], live: list[str]) -> None:
        """Bring the drafters each request would draft with to its committed sequence, without
        drafting: a new prompt's prefill in the drafters, run beside the target's own, so that the
        request's first draft step appends only what was committed since. Drafters that already
        hold the sequence (they scored the prompt) are not called."""
        by_id = {r.request_id: r for r in batch}
        sent = {r.request_id: list(r.sequence) for r in batch}  # a request may commit meanwhile
        calls: dict[str, list[DraftItem]] = {}
        for r in batch:
            for d in self.select(r, live):
                cache = r.drafter_cache.get(d, [])
                if cache != sent[r.request_id]:
                    item, _ = sync_item(cache, sent[r.request_id], top_n=0)
                    calls.setdefault(d, []).append(replace(item, request_id=r.request_id))
        if not calls:
            return
        answers = await self.call(calls)
        for d, items in calls.items():
            ids = [item.request_id for item in items]
            for rid, res in zip(ids, match_draft_results(ids, answers.get(d))):
                if res is not None and res.ok:
                    by_id[rid].drafter_cache[d] = sent[rid]
                else:
                    by_id[rid].drafter_cache.pop(d, None)

    async def _fuse_here(self, requests: list[FusionRequest], pricing: StepPricing) -> dict[str, FusionOutcome]:
        """Token fusion driven from the router: one message per drafter process per draft step."""
        loop = TokenFusion(requests, self.config.tree_width, pricing)
        drafting = len(loop.active)  # the requests of the round's first step
        while not loop.done:
            calls = loop.step()
            t_step = self.clock()
            answers = await self.call(calls)
            self.control.observe_draft_step(self.clock() - t_step, first_of=drafting if loop.taken == 0 else 0)
            loop.take(answers)
        return loop.outcomes

    async def _fuse_at(
        self, host: str, requests: list[FusionRequest], pricing: StepPricing
    ) -> dict[str, FusionOutcome]:
        """Token fusion inside the drafter process ``host``: the whole round in one message. Its
        steps feed the draft-step pricing as the router's own would: each step's model time plus
        its share of what the round waited beyond them (the message, queueing), so a step is
        priced at the wall time the round spends on it, as on the router-driven path. A process
        that fails fails every drafter of these requests for this round (they go on without drafting)."""
        t0 = self.clock()
        answer = await self.drafters.fuse(host, self.config.tree_width, pricing, requests)
        if answer is None:
            log.warning("drafter process failed during a fused round; its requests go on without it", host=host)
            return {}
        outcomes, step_seconds = answer
        waited = max(0.0, self.clock() - t0 - sum(step_seconds)) / max(1, len(step_seconds))
        drafting = sum(1 for fr in requests if fr.sources and fr.steps > 0)
        for i, seconds in enumerate(step_seconds):
            self.control.observe_draft_step(seconds + waited, first_of=drafting if i == 0 else 0)
        return outcomes

    async def chunks(
        self, batch: list[Request], ks: Mapping[str, int]
    ) -> tuple[dict[str, DraftTree], dict[str, list[str]]]:
        live = list(self.drafters.live())
        selected = {r.request_id: self.select(r, live) if ks[r.request_id] > 0 else [] for r in batch}
        per_drafter: dict[str, list[tuple[str, DraftItem]]] = {}
        by_id = {r.request_id: r for r in batch}
        for r in batch:
            for d in selected[r.request_id]:
                item, after = sync_item(r.drafter_cache.get(d, []), r.sequence, top_n=1, chain_len=ks[r.request_id])
                r.drafter_cache[d] = after
                per_drafter.setdefault(d, []).append((r.request_id, replace(item, request_id=r.request_id)))
        t_call = self.clock()
        answers = await self.call({d: [item for _, item in pairs] for d, pairs in per_drafter.items()})
        # the whole chunk feeds both the round's first step and every later one, so a chain of k is
        # priced at about k messages, and a probe's catch-up is priced in too. Both overstate what a
        # round's drafting costs; pricing a step at a time, without catch-ups, was measured: the gate
        # then let the drafter models draft where the lookup drafter already proposed the same tokens,
        # and cosine / autoregressive fell (on an AVX2-only CPU, in short alternated runs)
        if per_drafter:
            self.control.observe_draft_step(self.clock() - t_call, first_of=sum(1 for s in selected.values() if s))
        chains: dict[str, dict[str, tuple[list[int], list[float]]]] = {r.request_id: {} for r in batch}
        for d, pairs in per_drafter.items():
            results = answers.get(d)
            for (rid, _), res in zip(pairs, match_draft_results([rid for rid, _ in pairs], results)):
                if res is None:
                    by_id[rid].drafter_cache.pop(d, None)
                    continue
                positions = getattr(res, "positions", None) or ((res.token_ids, res.probs),)
                if res.ok and positions and positions[0][0]:
                    chain = [int(ids[0]) for ids, _ in positions]
                    probs = [float(ps[0]) for _, ps in positions]
                    chains[rid][d] = (chain, probs)
                    by_id[rid].drafter_cache[d].extend(chain[:-1])
                else:
                    by_id[rid].drafter_cache.pop(d, None)
            if results is None:
                for rid, _ in pairs:
                    by_id[rid].drafter_cache.pop(d, None)
        trees = {
            r.request_id: fuse_chains(
                chains[r.request_id], r.routing.weights(chains[r.request_id]), max(1, len(chains[r.request_id]))
            )
            for r in batch
        }
        if self.config.cost_control:
            greedy = {r.request_id: r.sampling.greedy for r in batch}
            trees = {rid: self.control.prune(tree, greedy[rid]) for rid, tree in trees.items()}
        return trees, {rid: sorted(c) for rid, c in chains.items()}

    async def call(self, calls: Mapping[str, Sequence[DraftItem]]) -> dict[str, list[DraftResult] | None]:
        """One draft step for every drafter involved (one message per drafter process). A failed
        drafter answers None and has left the pool; its requests go on without it."""
        answers = await self.drafters.draft_many(calls)
        for d, results in answers.items():
            if results is None:
                log.warning("drafter failed; its requests go on without it", drafter=d)
        return answers


def unread_tokens(r: Request) -> int:
    """Committed tokens of ``r`` that none of its drafters holds (all of them before any has read its prompt)."""
    sequence = r.sequence
    return len(sequence) - max((common_prefix(cache, sequence) for cache in r.drafter_cache.values()), default=0)
