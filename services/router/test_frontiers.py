"""Verification frontiers (``frontiers.py``): the chunk depth, what a verdict leaves of the next
chunk, the rows counted; the chunked procedure's sampled output against the target's exact law;
and the router end to end with chunks on: greedy output equal to the target's with chunks of
different depths in one pass, a rejection inside the first chunk, a drafter that dies while
drafting a chunk, and a verifier that restarts in the middle of a chunked draft."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from common.platform.metrics import ServiceMetrics
from common.spec.acceptance import SamplingRule, target_probs
from common.spec.fusion import DraftTree
from common.spec.types import SamplingParams, TokenTree, Verdict
from services.router.conftest import MAX_NEW
from services.router.core import RouterCore
from services.router.frontiers import (
    DraftWait,
    Frontiers,
    NextChunk,
    below,
    beyond_rejection,
    chunk_depth,
    main_path,
    next_depth,
    survivor,
)
from services.router.inprocess import LocalDrafterPool, LocalVerifier
from services.router.metrics import RouterMetrics
from services.router.requests import Counters, Request
from services.router.settings import RouterSettings, check_verify_chunks
from services.router.test_core import generate_all
from tests.support.stats import tv_check


def chain(tokens: Sequence[int], drafter: str = "d") -> DraftTree:
    tree = DraftTree(drafter_ids=[drafter])
    tree.add_chain(tokens, [0.9] * len(tokens), drafter, width=4)
    return tree


# ---- the pieces -----------------------------------------------------------------------------------


def test_the_setting_takes_auto_off_or_a_depth():
    assert [check_verify_chunks(v) for v in ("auto", "off", "1", "12")] == [None] * 4
    assert all(check_verify_chunks(v) for v in ("0", "-2", "on", "", "2.5"))


def test_chunk_depth_follows_the_setting_and_the_request_s_acceptance():
    assert chunk_depth("off", 6, 0.3) == 6
    assert chunk_depth("2", 6, None) == 2
    assert chunk_depth("5", 6, 0.3) == 6  # a next chunk of one token would only guess the next token
    assert chunk_depth("auto", 6, None) == 6  # no record yet: not cut
    assert chunk_depth("auto", 6, 1.0) == 6
    assert chunk_depth("auto", 6, 0.5) == 1  # 0.5^1 is not above a half: the tail is more likely pruned
    assert chunk_depth("auto", 6, 0.75) == 3  # 0.75^2 > 1/2 >= 0.75^3
    assert chunk_depth("auto", 8, 0.95) == 8  # the cut would come too late to leave a next chunk
    # later chunks: the request's chunk depth, at least two, the draft's rest where too little would be left
    assert [next_depth(2, left) for left in (6, 4, 3, 2)] == [2, 2, 3, 2]
    assert [next_depth(1, 5), next_depth(3, 4)] == [2, 4]


def test_the_main_path_is_the_first_child_at_each_level():
    tree = DraftTree(drafter_ids=["a", "b"])
    tree.add_chain([5, 6, 7], [0.9, 0.9, 0.9], "a", width=3)
    tree.add_chain([5, 8, 9, 10], [0.5, 0.5, 0.5, 0.5], "b", width=3)
    assert [tree.tokens[n] for n in main_path(tree)] == [5, 6, 7]
    assert main_path(DraftTree(drafter_ids=[])) == []


def test_below_re_roots_a_node_s_subtree():
    tree = DraftTree(drafter_ids=["a", "b"])
    tree.add_chain([1, 2, 3], [0.9] * 3, "a", width=3)
    tree.add_chain([1, 4], [0.5] * 2, "b", width=3)
    sub = below(tree, 0)  # under token 1: 2 -> 3, and 4
    assert (sub.tokens, sub.parents) == ([2, 3, 4], [-1, 0, -1])


def test_a_chunk_survives_only_where_the_verdict_runs_through_its_first_token():
    drafted_on = [7, 1, 2]  # committed 7, the main path 1, 2 verified this round
    nxt = DraftTree(drafter_ids=["a", "b"])
    nxt.add_chain([3, 4, 5], [0.9] * 3, "a", width=3)
    nxt.add_chain([6, 8], [0.5] * 2, "b", width=3)
    # the whole path accepted and the target's next token is the chunk's first: the rest is next
    kept, pruned = survivor(nxt, drafted_on, [7, 1, 2, 3])
    assert kept is not None and (kept.tokens, kept.parents, pruned) == ([4, 5], [-1, 0], 2)
    # the other drafter's branch
    kept, pruned = survivor(nxt, drafted_on, [7, 1, 2, 6])
    assert kept is not None and (kept.tokens, pruned) == ([8], 3)
    # a correction token the chunk did not guess: pruned whole
    assert survivor(nxt, drafted_on, [7, 1, 2, 9]) == (None, 5)
    # a rejection inside the verified chunk: pruned whole, never verified
    assert survivor(nxt, drafted_on, [7, 1, 9]) == (None, 5)
    # nothing committed (the verifier failed): pruned
    assert survivor(nxt, drafted_on, [7]) == (None, 5)
    # the verdict went deeper than the hypothesis (plain steps): followed down the chunk
    kept, pruned = survivor(nxt, drafted_on, [7, 1, 2, 3, 4])
    assert kept is not None and (kept.tokens, pruned) == ([5], 2)


def test_rows_beyond_a_rejection_are_those_under_a_node_that_was_not_accepted():
    # 0 -> 1 -> 2, and a sibling root 3 -> 4
    parents = [-1, 0, 1, -1, 3]
    assert beyond_rejection(parents, [0, 1, 2]) == 1  # 4 hangs under the rejected root 3
    assert beyond_rejection(parents, [0]) == 2  # 2 and 4
    assert beyond_rejection(parents, []) == 3  # 1, 2 and 4: only the roots were tried
    assert beyond_rejection([-1, -1], []) == 0  # roots are always a real try


def test_the_verifier_waits_only_while_a_round_drafts_and_no_verify_call_is_in_flight():
    now = [0.0]
    wait = DraftWait(lambda: now[0])
    with wait.drafting():
        now[0] = 2.0
        with wait.verifying():
            now[0] = 5.0  # drafting beside a pass: the verifier was busy
        now[0] = 6.0
    with wait.drafting(False):
        now[0] = 9.0  # a round that drafts nothing
    assert wait.seconds == pytest.approx(3.0)


def test_the_rows_reach_the_counters_and_the_prometheus_families():
    now = [0.0]
    registry = ServiceMetrics("router")
    counters = Counters()
    frontiers = Frontiers("2", counters, lambda: now[0], RouterMetrics(registry, lambda: 0, lambda: 0))
    with frontiers.wait.drafting():
        now[0] = 1.5
    tree = DraftTree(drafter_ids=["a", "b"])
    tree.add_chain([1, 2], [0.9, 0.9], "a", width=3)
    tree.add_chain([3, 4], [0.5, 0.5], "b", width=3)  # 1 -> 2, 3 -> 4
    frontiers.count({"r": tree}, {"r": Verdict("r", accepted_nodes=(0,), accepted_tokens=(1,), next_token=5)})
    r = Request("r", prompt=(7,), max_new_tokens=8, sampling=SamplingParams(), stop_ids=frozenset(), generated=[1, 5])
    frontiers.settle([r], {"r": NextChunk(chain([2, 6, 8]), ("a",), (7, 1, 2), 0)})  # drafted on 1, 2: 2 was rejected
    assert (counters.rows_verified, counters.rows_accepted, counters.rows_beyond_rejection) == (4, 1, 1)
    assert (counters.rows_pruned, counters.verifier_wait_s, r.ahead) == (3, 1.5, None)
    value = registry.registry.get_sample_value
    assert [value("cosine_router_draft_rows_total", {"outcome": o}) for o in ("verified", "accepted")] == [4, 1]
    assert [value("cosine_router_draft_rows_total", {"outcome": o}) for o in ("beyond_rejection", "pruned")] == [1, 3]
    assert value("cosine_router_verifier_wait_seconds_total") == 1.5


# ---- the sampled law ------------------------------------------------------------------------------

V = 3  # vocabulary of the toy target
NEW = 4  # tokens whose joint law is compared


def toy_logits(context: Sequence[int]) -> torch.Tensor:
    """The toy target's logits after ``context`` (a fixed function of it)."""
    seed = 7
    for t in context:
        seed = (seed * 31 + t + 1) % (2**31)
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 1.5


def toy_pass(context: Sequence[int], tree: TokenTree) -> torch.Tensor:
    """One verify pass's logits ``[n + 1, V]``: row 0 after ``context``, row 1 + i after node i."""
    paths: list[list[int]] = []
    for tok, parent in zip(tree.tokens, tree.parents):
        paths.append([*(paths[parent] if parent >= 0 else []), tok])
    return torch.stack([toy_logits(context), *(toy_logits([*context, *p]) for p in paths)])


def best(context: Sequence[int], rank: int = 0) -> int:
    return int(torch.argsort(toy_logits(context), descending=True)[rank])


def frontier_run(
    prompt: list[int], rule: SamplingRule, g: torch.Generator, lossy: bool = False
) -> tuple[tuple[int, ...], bool]:
    """The first ``NEW`` tokens of the chunked procedure and whether its next chunk was kept: a first
    chunk of depth 2 verified, the next chunk (two branches, drafted on its main path) kept by
    :func:`survivor` and verified next, then plain steps. ``lossy``: commit the next chunk's first
    token whenever the first chunk was accepted whole, whatever the target drew (a broken frontier
    the check must catch)."""
    first = [best(prompt)]
    first.append(best([*prompt, *first]))
    chunk1 = chain(first)
    drafted_on = [*prompt, *first]
    nxt = DraftTree(drafter_ids=["a", "b"])
    for rank, drafter in ((0, "a"), (1, "b")):
        x1 = best(drafted_on, rank)
        nxt.add_chain([x1, best([*drafted_on, x1])], [0.9 - 0.4 * rank] * 2, drafter, width=3)
    tree = chunk1.to_token_tree()
    d = rule.decide(tree, toy_pass(prompt, tree), g)
    committed = [*prompt, *(tree.tokens[a] for a in d.accepted_nodes), d.next_token]
    if lossy and len(d.accepted_nodes) == len(tree):
        committed[-1] = nxt.tokens[0]
    kept, _ = survivor(nxt, drafted_on, committed)
    tree = (kept or DraftTree(drafter_ids=[])).to_token_tree()
    while len(committed) - len(prompt) < NEW:
        d = rule.decide(tree, toy_pass(committed, tree), g)
        committed += [*(tree.tokens[a] for a in d.accepted_nodes), d.next_token]
        tree = TokenTree()
    return tuple(committed[len(prompt) : len(prompt) + NEW]), kept is not None


def exact_law(prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NEW):
        grown = {}
        for seq, p in law.items():
            probs = target_probs(toy_logits([*prompt, *seq]), params)
            for t in range(V):
                if probs[t] > 0:
                    grown[(*seq, t)] = p * float(probs[t])
        law = grown
    return law


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=2)])
def test_chunked_verification_samples_the_target_s_own_law(params):
    prompt = [0, 2]
    rule = SamplingRule(params)
    g = torch.Generator().manual_seed(11)
    runs = [frontier_run(prompt, rule, g) for _ in range(8000)]
    tv, threshold = tv_check(Counter(tokens for tokens, _ in runs), exact_law(prompt, params), seed=5)
    assert tv <= threshold, (tv, threshold)
    kept = sum(k for _, k in runs)
    assert 0.05 * len(runs) < kept < len(runs)  # both the kept chunk's path and the pruned one were taken


def test_the_law_check_catches_a_frontier_that_keeps_a_chunk_the_target_did_not_draw():
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(11)
    counts = Counter(frontier_run([0, 2], SamplingRule(params), g, lossy=True)[0] for _ in range(8000))
    tv, threshold = tv_check(counts, exact_law([0, 2], params), seed=5)
    assert tv > threshold


# ---- the router end to end ------------------------------------------------------------------------

# chunks of depth 2 in drafts of 6, every node verified (no cost control), one round at a time so that
# a pass holds first chunks of some requests beside the kept later chunks of others
CHUNKED = RouterSettings(
    drafters_per_request=2,
    fusion="chunk",
    cost_control=False,
    adaptive_k=False,
    initial_k=6,
    verify_chunks="2",
    lookup_drafts=False,
    rounds_in_flight=1,
)


class DepthRecordingVerifier(LocalVerifier):
    """Records the tree depth of every item of every pass."""

    def __init__(self, engine):
        super().__init__(engine)
        self.depths: list[list[int]] = []

    async def verify(self, items):
        self.depths.append([item.tree.depth for item in items])
        return await super().verify(items)


def imperfect(drafters):
    """The two drafters that are not the target itself: their drafts are rejected now and then."""
    return {d: drafters[d] for d in ("near", "small")}


def test_chunked_drafts_equal_the_target_s_greedy_output_with_chunks_of_different_depths_in_a_pass(engines, reference):
    verifier, drafters = engines
    prompts, expected = reference
    backend = DepthRecordingVerifier(verifier)
    core = RouterCore(CHUNKED, LocalDrafterPool(imperfect(drafters)), backend)
    assert asyncio.run(generate_all(core, prompts, MAX_NEW)) == expected
    c = core.counters
    # later chunks were drafted beside passes; some were verified next, others (a rejection inside
    # the first chunk, or a correction the chunk did not guess) dropped unverified
    assert 0 < c.frontier_chunks_kept < c.frontier_chunks and c.rows_pruned > 0
    # a first chunk (depth 2) and a kept later one (depth 1) in the same pass
    assert any({1, 2} <= set(depths) for depths in backend.depths)
    # no pass verified a whole draft of 6: only a request's last tokens go whole (a draft of 3 or fewer
    # would leave a next chunk too short to gain anything)
    assert max(max(depths) for depths in backend.depths) <= 3
    assert c.rows_accepted <= c.rows_verified and c.rows_beyond_rejection < c.rows_verified
    assert verifier.active_requests == 0 and all(e.active_requests == 0 for e in drafters.values())


def test_chunks_in_auto_mode_with_token_fusion_stay_lossless(engines, reference):
    verifier, drafters = engines
    prompts, expected = reference
    config = RouterSettings(fusion="token", tree_width=2, cost_control=False, initial_k=6, verify_chunks="auto")
    core = RouterCore(config, LocalDrafterPool(imperfect(drafters)), LocalVerifier(verifier))
    assert asyncio.run(generate_all(core, prompts, MAX_NEW)) == expected
    assert core.counters.frontier_chunks > 0  # acceptance below 1 cut some drafts


class ChunkKillingPool(LocalDrafterPool):
    """A drafter that dies on its second call while a next chunk is being drafted."""

    def __init__(self, engines, victim: str):
        super().__init__(engines)
        self.victim = victim
        self.in_chunk = False
        self.chunk_calls = 0
        self.killed_in_chunk = False

    async def draft(self, drafter_id, items):
        if self.in_chunk and drafter_id == self.victim and drafter_id not in self.failed:
            self.chunk_calls += 1
            if self.chunk_calls >= 2:
                self.killed_in_chunk = True
                raise ConnectionError(f"drafter {drafter_id} is gone")
        return await super().draft(drafter_id, items)


def test_a_drafter_that_dies_while_drafting_a_chunk_does_not_fail_its_requests(engines, reference):
    verifier, drafters = engines
    prompts, expected = reference
    pool = ChunkKillingPool(imperfect(drafters), victim="near")
    core = RouterCore(CHUNKED, pool, LocalVerifier(verifier))
    draft_chunks = core.frontiers._draft

    async def marked(draft, plans):
        pool.in_chunk = True
        try:
            return await draft_chunks(draft, plans)
        finally:
            pool.in_chunk = False

    core.frontiers._draft = marked
    assert asyncio.run(generate_all(core, prompts, MAX_NEW)) == expected
    assert pool.killed_in_chunk and set(pool.failed) == {"near"}
    assert verifier.active_requests == 0 and drafters["small"].active_requests == 0
    for rid in prompts:  # a dead drafter process takes its caches with it; here the engine lives on
        drafters["near"].release(rid)


class MidChunkRestartingVerifier:
    """The real verifier engine, whose stream breaks (the call raises) on the first pass after a later
    chunk was kept, and which restarts (loses every request) on the first pass after three more were:
    both in the middle of chunked drafts, with next chunks being drafted beside those passes."""

    def __init__(self, engine):
        self.inner = LocalVerifier(engine)
        self.engine = engine
        self.core: RouterCore | None = None
        self.broke = self.restarted = False

    async def verify(self, items):
        assert self.core is not None
        kept = self.core.counters.frontier_chunks_kept
        if kept >= 1 and not self.broke:
            self.broke = True
            raise ConnectionError("verifier stream broke")
        if kept >= 4 and not self.restarted:
            self.restarted = True
            for rid in list(self.engine._requests):
                self.engine.release(rid)
        return await self.inner.verify(items)

    def release(self, request_ids):
        self.inner.release(request_ids)


def test_a_verifier_restart_in_the_middle_of_a_chunked_draft_resumes_with_identical_output(engines, reference):
    verifier, drafters = engines
    prompts, expected = reference
    backend = MidChunkRestartingVerifier(verifier)
    core = RouterCore(CHUNKED, LocalDrafterPool(imperfect(drafters)), backend)
    backend.core = core
    assert asyncio.run(generate_all(core, prompts, MAX_NEW)) == expected
    assert backend.broke and backend.restarted
    assert verifier.active_requests == 0 and all(e.active_requests == 0 for e in drafters.values())
