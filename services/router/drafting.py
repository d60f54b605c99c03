"""Drafting strategies of a round (no gRPC here): who drafts each request, token fusion, chunk fusion.

- :meth:`Drafting.select`: the drafters of one request (routing by expertise, or a fixed set).
- :meth:`Drafting.tokens`: token fusion. k steps; at each step every selected drafter proposes its
  top-n, the routing-weighted best becomes the next node and is appended by all of them,
  runners-up become siblings. Every node is priced by :class:`~services.router.control.SpeculationControl`
  (a node, and a step, are kept only while they pay).
- :meth:`Drafting.chunks`: chunk fusion. Each drafter drafts a whole k-chain in one message; the
  chains are merged into a prefix tree, then priced and pruned.

Drafter caches are synced to the committed sequence with :func:`sync_item` (rolled back to the
longest common prefix, the rest appended): the committed prefix is never recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from common.logs import get_logger
from common.spec_types import DraftItem, DraftResult
from services.router.control import SpeculationControl
from services.router.fusion import DraftTree, Proposal, fuse, fuse_chains
from services.router.matching import match_draft_results
from services.router.requests import DrafterPool, Request, RouterConfig

log = get_logger("router")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def sync_item(cache: Sequence[int], sequence: Sequence[int], top_n: int, chain_len: int = 0, score: bool = False) -> tuple[DraftItem, list[int]]:
    """The draft item that brings a drafter cache holding ``cache`` to ``sequence`` and proposes
    the next position. Returns the item and the cache contents afterwards (the whole sequence).
    At least one token is always appended so the drafter has fresh logits to propose from."""
    keep = min(common_prefix(cache, sequence), len(sequence) - 1)
    truncate_to = keep if keep < len(cache) else -1
    item = DraftItem(request_id="", truncate_to=truncate_to, append_ids=tuple(sequence[keep:]), top_n=top_n)
    if chain_len or score:
        item = replace(item, chain_len=chain_len, score_append=score)
    return item, list(sequence)


class Drafting:
    """Drafts the trees of a round through a :class:`~services.router.requests.DrafterPool`."""

    def __init__(self, config: RouterConfig, drafters: DrafterPool, control: SpeculationControl,
                 clock: Callable[[], float]) -> None:
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

    async def tokens(self, batch: list[Request], ks: Mapping[str, int]) -> tuple[dict[str, DraftTree], dict[str, list[str]]]:
        live = list(self.drafters.live())
        width = self.config.tree_width
        selected = {r.request_id: self.select(r, live) if ks[r.request_id] > 0 else [] for r in batch}
        trees = {r.request_id: DraftTree(drafter_ids=list(selected[r.request_id])) for r in batch}
        tips = {r.request_id: -1 for r in batch}
        fused: dict[str, list[int]] = {r.request_id: [] for r in batch}
        by_id = {r.request_id: r for r in batch}
        active = {rid for rid, sel in selected.items() if sel}
        values = {rid: 1.0 for rid in active}  # expected acceptance of each request's fused tip
        theta = self.control.threshold() if self.config.cost_control else 0.0
        pipelined = self.config.rounds_in_flight > 1 and self.control.pipelining
        step = 0
        while active:
            per_drafter: dict[str, list[tuple[str, DraftItem]]] = {}
            for rid in sorted(active):
                r = by_id[rid]
                for d in selected[rid]:
                    if step == 0:
                        item, after = sync_item(r.drafter_cache.get(d, []), r.sequence, top_n=width)
                        r.drafter_cache[d] = after
                    else:
                        item = DraftItem(request_id="", append_ids=(fused[rid][-1],), top_n=width)
                        r.drafter_cache[d].append(fused[rid][-1])
                    per_drafter.setdefault(d, []).append((rid, replace(item, request_id=rid)))
            t_step = self.clock()
            answers = await self.call(per_drafter)
            self.control.observe_draft_step(self.clock() - t_step, first_of=len(active) if step == 0 else 0)
            proposals: dict[str, list[Proposal]] = {rid: [] for rid in active}
            for d, pairs in per_drafter.items():
                results = match_draft_results([rid for rid, _ in pairs], answers.get(d))
                for (rid, _), res in zip(pairs, results):
                    cache = by_id[rid].drafter_cache.get(d, [])
                    if res is not None and res.ok and res.token_ids and res.cache_len in (0, len(cache)):
                        proposals[rid].append(Proposal(d, tuple(res.token_ids), tuple(res.probs)))
                    else:  # the drafter failed for this request: it leaves the request's round
                        by_id[rid].drafter_cache.pop(d, None)
                        selected[rid] = [x for x in selected[rid] if x != d]
            step += 1
            next_values = []
            for rid in list(active):
                ranked = fuse(proposals[rid], by_id[rid].routing.weights(selected[rid]))
                # a node is verified only when its expected tokens repay its verify row
                kept = [c for c in ranked[:width] if self.control.node_value(values[rid], c.score) >= theta]
                if not kept or kept[0] is not ranked[0]:
                    active.discard(rid)
                    if kept:  # the fused token does not pay but a runner-up does: keep the runners-up as leaves
                        for c in kept:
                            trees[rid].add(tips[rid], c.token, c.score, c.sources, c.top1)
                    continue
                tips[rid] = trees[rid].add_fused_step(tips[rid], kept, len(kept))
                values[rid] = self.control.node_value(values[rid], ranked[0].score)
                fused[rid].append(ranked[0].token)
                if step >= ks[rid] or not selected[rid]:
                    active.discard(rid)
                else:
                    next_values.append(values[rid])
            if active and self.config.cost_control and not self.control.worth_a_step(next_values, pipelined):
                active.clear()
        return trees, selected

    async def chunks(self, batch: list[Request], ks: Mapping[str, int]) -> tuple[dict[str, DraftTree], dict[str, list[str]]]:
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
        answers = await self.call(per_drafter)
        if per_drafter:  # the whole chunk is the round's first (and only) draft message
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
            r.request_id: fuse_chains(chains[r.request_id], r.routing.weights(chains[r.request_id]), max(1, len(chains[r.request_id])))
            for r in batch
        }
        if self.config.cost_control:
            trees = {rid: self.control.prune(tree) for rid, tree in trees.items()}
        return trees, {rid: sorted(c) for rid, c in chains.items()}

    async def call(self, per_drafter: Mapping[str, list[tuple[str, DraftItem]]]) -> dict[str, list[DraftResult] | None]:
        """One draft step for every drafter involved (one message per drafter process). A failed
        drafter answers None and has left the pool; its requests go on without it."""
        answers = await self.drafters.draft_many({d: [item for _, item in pairs] for d, pairs in per_drafter.items()})
        for d, results in answers.items():
            if results is None:
                log.warning("drafter failed; its requests go on without it", drafter=d)
        return answers
