"""Verification frontiers (FASER): a request's draft is verified chunk by chunk while its drafters
draft the next chunk, and the tail after a rejection is pruned unverified (no gRPC here).

A request's draft of depth ``k`` is cut into chunks by depth: the first chunk (depth ``c``,
:func:`chunk_depth`) is drafted inline and verified in the round; while that pass runs, the
drafters draft the next chunk (:class:`NextChunk`) on the round's *hypothesis*: the committed
sequence plus the tree's main path (:func:`main_path`, the first child at each level: the fused
winner, or the most confident chain). A later token only counts when every earlier one was
accepted, so after the verdict the next chunk is kept only where the committed sequence runs
through it (:func:`survivor`):

    committed before   S                 (the verifier's cache: all of S but its last token)
    hypothesis         S + h_1..h_m      (the main path verified this round)
    next chunk         x_1 .. x_d        drafted on the hypothesis; x_1 guesses the token after h_m
    verdict            S + h_1..h_m + t  (the whole path accepted, t the target's next token)
    kept iff           x_1 == t          then x_2..x_d (as a tree: every node below x_1) is the
                                         next round's tree, verified on a cache that already holds
                                         S + h (t is the new last committed token, uncached, as the
                                         verifier's cache invariant has it): nothing recomputed

Any other verdict (a rejection inside the path, a correction token other than ``x_1``, an error)
prunes the whole chunk: its rows are never verified and the next round drafts afresh from the
correction token, the drafters rolled back to the committed sequence by the next sync
(``drafting.sync_item``). The kept part is verified next round beside other requests' first chunks
and plain rows, and priced by the pass plan like any node (it travels as ``Request.ahead``, with the
depth the draft has left, so its own round drafts the chunk after it beside that pass).

Output-neutral, greedy and sampled alike: the verifier decides every committed token with the
same acceptance rule on the target's own logits, and the router only chooses what is proposed, as a
function of the committed sequence. For sampling, ``t`` is drawn from the target's distribution
``p``; it equals ``x_1`` with probability ``p(x_1)``, and otherwise follows the residual ``p`` with
``x_1`` zeroed and renormalised: exactly the rule's outcome had ``x_1`` been verified as a child of
``h_m`` in one pass (with siblings at that depth, the same holds child by child).

The counters (``Counters``, and the router's Prometheus families) tell the waste this removes:
drafted rows verified, accepted, pruned before verification, and verified *beyond a rejection*
(a node whose parent was not accepted: its prefix was already rejected, so nothing could commit
it); and the time the verifier waited for drafts (:class:`DraftWait`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from common.logs import get_logger
from common.spec.fusion import DraftTree
from common.spec.types import Verdict
from services.router.requests import AheadDraft, Counters, Request

log = get_logger("router")

OFF, AUTO = "off", "auto"
KEEP_ODDS = 0.5  # auto: a chunk ends where its prefix is more likely rejected than accepted (see chunk_depth)
MIN_NEXT = 2  # a later chunk drafts at least two tokens: its first only guesses the next token (free)

DraftFn = Callable[[list[Request], dict[str, int]], Awaitable[tuple[dict[str, DraftTree], dict[str, list[str]]]]]


def chunk_size(setting: str, acceptance: float | None) -> int | None:
    """The depth of a request's chunks; None where its drafts are not cut.

    ``setting``: ``off``, ``auto`` or a fixed depth. ``auto`` follows the request's recent acceptance
    (its accepted tokens per drafted depth, ``RoutingVector.recent_acceptance``, as its ``k`` follows
    them), taken as a per-token rate ``a``: a chunk ends at the first depth where the
    whole prefix is more likely rejected than accepted, ``a^c <= 1/2``, so the tail it defers is
    more likely pruned than verified; a request with no record, or one that accepts everything, is
    not cut."""
    if setting == OFF:
        return None
    if setting != AUTO:
        return int(setting)
    if acceptance is None or acceptance >= 1.0:
        return None
    return 1 if acceptance <= 0.0 else max(1, math.ceil(math.log(KEEP_ODDS) / math.log(acceptance)))


def chunk_depth(setting: str, k: int, acceptance: float | None) -> int:
    """The depth of the first chunk of a draft of depth ``k`` (:func:`chunk_size`); ``k`` where the
    draft is not cut. A cut leaves at least ``MIN_NEXT`` tokens for the next chunk, or none is made."""
    c = chunk_size(setting, acceptance)
    return k if c is None or k - c < MIN_NEXT else c


def next_depth(size: int, left: int) -> int:
    """The depth of a later chunk of a draft with ``left`` tokens to go: ``size`` (at least
    ``MIN_NEXT``), or all of them where fewer than ``MIN_NEXT`` would be left after it."""
    depth = max(MIN_NEXT, size)
    return left if left - depth < MIN_NEXT else depth


def main_path(tree: DraftTree) -> list[int]:
    """The tree's main path (node indices, root first): the first child at each level, which is the
    fused winner in token fusion and the most confident chain in chunk fusion (``fusion.py``)."""
    first: dict[int, int] = {}
    for i, p in enumerate(tree.parents):
        first.setdefault(p, i)
    path, node = [], -1
    while node in first:
        node = first[node]
        path.append(node)
    return path


def below(tree: DraftTree, node: int) -> DraftTree:
    """Every node under ``node``, re-rooted: its children become roots (node order kept)."""
    out = DraftTree(drafter_ids=list(tree.drafter_ids))
    index = {node: -1}
    for i, p in enumerate(tree.parents):
        if p in index and i != node:
            index[i] = len(out.tokens)
            out.tokens.append(tree.tokens[i])
            out.parents.append(index[p])
            out.probs.append(tree.probs[i])
            out.source_masks.append(tree.source_masks[i])
            out.top1.append(tree.top1[i])
    return out


def survivor(tree: DraftTree, drafted_on: Sequence[int], committed: Sequence[int]) -> tuple[DraftTree | None, int]:
    """What a chunk drafted on the sequence ``drafted_on`` keeps once ``committed`` is the committed
    sequence: the nodes below the end of the committed tokens' path through it (re-rooted on
    ``committed``), or None where that path leaves it (see the module docstring); and how many of
    its nodes were pruned (neither on that path nor kept)."""
    if len(committed) <= len(drafted_on) or list(committed[: len(drafted_on)]) != list(drafted_on):
        return None, len(tree)
    node, walked = -1, 0
    for token in committed[len(drafted_on) :]:
        node = next((c for c in tree.children(node) if tree.tokens[c] == token), -2)
        if node == -2:
            return None, len(tree)
        walked += 1
    kept = below(tree, node)
    return kept, len(tree) - walked - len(kept)


def beyond_rejection(parents: Sequence[int], accepted_nodes: Sequence[int]) -> int:
    """Verified nodes whose parent was not accepted: their prefix was rejected, so their rows
    could never commit anything (a root, or a child of an accepted node, was a real try)."""
    accepted = set(accepted_nodes)
    return sum(1 for p in parents if p >= 0 and p not in accepted)


@dataclass(frozen=True)
class NextChunk:
    """A chunk drafted beside a verify pass: on ``drafted_on`` (the committed sequence plus the main
    path verified), with the draft's depth left after it."""

    tree: DraftTree
    selected: tuple[str, ...]
    drafted_on: tuple[int, ...]
    depth_left: int


class DraftWait:
    """Seconds the verifier waited for drafts: time in which some round was drafting inline (or
    waited for a chunk after its verdict) while no verify call of this router was in flight."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.seconds = 0.0
        self._drafting = 0
        self._verifying = 0
        self._since = clock()

    def _tick(self) -> None:
        now = self.clock()
        if self._drafting and not self._verifying:
            self.seconds += now - self._since
        self._since = now

    @contextmanager
    def drafting(self, active: bool = True) -> Iterator[None]:
        """A round drafts meanwhile (``active`` False: it does not, nothing is counted)."""
        self._tick()
        self._drafting += active
        try:
            yield
        finally:
            self._tick()
            self._drafting -= active

    @contextmanager
    def verifying(self) -> Iterator[None]:
        """A verify call is in flight meanwhile."""
        self._tick()
        self._verifying += 1
        try:
            yield
        finally:
            self._tick()
            self._verifying -= 1


class Frontiers:
    """The frontier part of a round (:class:`services.router.core.RouterCore` calls it in order):
    :meth:`cut` the first chunk's depth, :meth:`start` the next chunks beside the pass,
    :meth:`count` the rows of the verdicts, :meth:`settle` what the verdicts left of the chunks."""

    def __init__(self, setting: str, counters: Counters, clock: Callable[[], float], metrics: Any = None) -> None:
        self.setting = setting
        self.counters = counters
        self.metrics = metrics  # services.router.metrics.RouterMetrics, or None
        self.wait = DraftWait(clock)

    @property
    def on(self) -> bool:
        return self.setting != OFF

    def cut(self, batch: Sequence[Request], ks: dict[str, int]) -> dict[str, int]:
        """Cut each drafting request's depth in ``ks`` to its first chunk; the depth each draft has
        left after that chunk (0: not cut)."""
        left: dict[str, int] = {}
        if not self.on:
            return left
        for r in batch:
            k = ks[r.request_id]
            c = chunk_depth(self.setting, k, r.routing.recent_acceptance())
            if c < k:
                ks[r.request_id], left[r.request_id] = c, k - c
        return left

    def start(
        self, draft: DraftFn, batch: Sequence[Request], trees: Mapping[str, DraftTree], left: Mapping[str, int]
    ) -> asyncio.Task[dict[str, NextChunk]] | None:
        """Draft the next chunk of every request of ``batch`` whose draft has depth left and whose
        tree this round is not empty, on its hypothesis, as a task beside the pass; None when none."""
        plans: list[tuple[Request, int, int]] = []  # the hypothesis request, its chunk depth, the depth left after
        for r in batch:
            depth_left, tree = left.get(r.request_id, 0), trees[r.request_id]
            path = [tree.tokens[n] for n in main_path(tree)]
            size = chunk_size(self.setting, r.routing.recent_acceptance()) or depth_left
            depth = min(next_depth(size, depth_left), r.max_new_tokens - len(r.generated) - len(path))
            if not path or depth < MIN_NEXT or r.drafting_ahead or r.routing_ahead:
                continue
            hypothesis = replace(r, generated=[*r.generated, *path])  # shares the drafter-cache mirror and routing
            plans.append((hypothesis, depth, depth_left - depth))
        if not plans:
            return None
        self.counters.frontier_chunks += len(plans)
        return asyncio.ensure_future(self._draft(draft, plans))

    async def _draft(self, draft: DraftFn, plans: list[tuple[Request, int, int]]) -> dict[str, NextChunk]:
        try:
            trees, selected = await draft([h for h, _, _ in plans], {h.request_id: d for h, d, _ in plans})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failed chunk costs the requests their next chunk, not their round
            log.warning("drafting the next chunks failed", error=str(exc), requests=[h.request_id for h, _, _ in plans])
            return {}
        return {
            h.request_id: NextChunk(
                trees[h.request_id], tuple(selected.get(h.request_id, ())), tuple(h.sequence), after
            )
            for h, _, after in plans
            if h.request_id in trees
        }

    async def finish(self, task: asyncio.Task[dict[str, NextChunk]] | None) -> dict[str, NextChunk]:
        """The next chunks, once drafted (the round waits for them after its verdicts, if need be)."""
        if task is None:
            return {}
        if task.done():
            return task.result()
        with self.wait.drafting():
            return await task

    def count(self, trees: Mapping[str, DraftTree], verdicts: Mapping[str, Verdict]) -> None:
        """The drafted rows the round's verdicts verified, accepted, and verified beyond a rejection."""
        verified = accepted = beyond = 0
        for rid, tree in trees.items():
            verdict = verdicts.get(rid)
            if verdict is None or not verdict.ok:
                continue
            verified += len(tree)
            accepted += len(verdict.accepted_nodes)
            beyond += beyond_rejection(tree.parents, verdict.accepted_nodes)
        self.counters.rows_verified += verified
        self.counters.rows_accepted += accepted
        self.counters.rows_beyond_rejection += beyond
        self.counters.verifier_wait_s = self.wait.seconds
        if self.metrics is not None:
            self.metrics.rows(verified=verified, accepted=accepted, beyond_rejection=beyond)
            self.metrics.verifier_wait(self.wait.seconds)

    def settle(self, batch: Sequence[Request], chunks: Mapping[str, NextChunk]) -> None:
        """Keep what the verdicts left of each next chunk as its request's next tree (``Request.ahead``);
        prune the rest, unverified."""
        pruned = 0
        for r in batch:
            chunk = chunks.get(r.request_id)
            if chunk is None:
                continue
            kept, dropped = (None, len(chunk.tree)) if r.done else survivor(chunk.tree, chunk.drafted_on, r.sequence)
            pruned += dropped
            if kept is not None and len(kept):
                r.ahead = AheadDraft(kept, chunk.selected, len(r.sequence), chunk.depth_left)
                self.counters.frontier_chunks_kept += 1
        self.counters.rows_pruned += pruned
        if self.metrics is not None and pruned:
            self.metrics.rows(pruned=pruned)
