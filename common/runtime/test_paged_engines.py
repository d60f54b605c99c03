"""The engines on the paged arena: lossless greedy against transformers (mixed batches of prompts,
trees and plain steps, the drafters' rollbacks), the budget refusing one request and no other, and
every block back on the free list once the requests are released."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.runtime.drafter_engine import DrafterEngine
from common.runtime.kv_arena import KVArena
from common.runtime.runner import SeqInput
from common.runtime.sim import DrafterSource, EmptySource, RandomSource, speculative_generate
from common.runtime.test_greedy_equality import hf_greedy, make_prompts
from common.runtime.verifier_engine import VerifierEngine
from common.spec.types import DraftItem, TokenTree, VerifyItem


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_paged_engines_equal_hf_greedy(family: str, request: pytest.FixtureRequest) -> None:
    target: Path = request.getfixturevalue(f"{family}_target")
    near: Path = request.getfixturevalue(f"{family}_near")
    verifier = VerifierEngine.from_checkpoint(target, kv_cache="paged")
    drafter = DrafterEngine.from_checkpoint(near, kv_cache="paged")
    assert isinstance(verifier.pool, KVArena) and isinstance(drafter.pool, KVArena)
    vocab = verifier.runner.vocab_size
    sources = [
        DrafterSource(drafter, depth=4, width=1),
        DrafterSource(drafter, depth=3, width=3),
        RandomSource(vocab, size=6, seed=11),
        EmptySource(),
    ]
    prompts = make_prompts(8, vocab, seed=7)
    assign = {rid: sources[i % len(sources)] for i, rid in enumerate(prompts)}
    got = speculative_generate(verifier, prompts, assign, 32)
    want = hf_greedy(target, prompts, 32)
    for rid in prompts:
        assert got[rid] == want[rid], f"{family} {rid} ({type(assign[rid]).__name__}) diverged"
    assert verifier.active_requests == 0 and verifier.kv_reserved_tokens == 0
    assert verifier.pool.used_blocks == 0


def test_paged_budget_refuses_one_request_and_touches_no_other(llama_target: Path) -> None:
    engine = VerifierEngine.from_checkpoint(
        llama_target, attention_backend="sdpa", kv_cache="paged", kv_token_budget=64
    )
    [a] = engine.verify([VerifyItem("a", append_ids=tuple(range(40)))]).verdicts
    assert a.ok
    blocks_a, len_a = list(engine._state("a").cache.blocks), engine.cache_len("a")
    verdicts = engine.verify(
        [VerifyItem("b", append_ids=tuple(range(30))), VerifyItem("a", tree=TokenTree.chain([1, 2]))]
    ).verdicts
    b, a2 = verdicts
    assert "KV cache budget exceeded" in b.error and not engine.holds("b")
    assert a2.ok and engine.cache_len("a") > len_a
    assert engine._state("a").cache.blocks[: len(blocks_a)] == blocks_a
    assert engine.kv_reserved_tokens <= 64
    engine.release("a")
    assert engine.kv_reserved_tokens == 0 and engine.pool.used_blocks == 0


def test_paged_drafter_rolls_back_and_refuses_past_the_budget(llama_target: Path) -> None:
    engine = DrafterEngine.from_checkpoint(llama_target, attention_backend="sdpa", kv_cache="paged", kv_token_budget=48)
    contiguous = DrafterEngine.from_checkpoint(llama_target, attention_backend="sdpa", kv_cache="contiguous")
    for e in (engine, contiguous):
        e.prefill("a", list(range(20)))
        e.append("a", [5, 6, 7])
        e.rollback("a", 18)
    [p], [q] = (
        e.run_step([DraftItem("a", append_ids=(9,), top_n=3)]).results for e in (engine, contiguous)
    )  # the same candidates after the same rollback
    assert p.ok and q.ok and p.token_ids == q.token_ids and p.cache_len == 19
    [big, a] = engine.run_step(
        [DraftItem("b", append_ids=tuple(range(40)), top_n=1), DraftItem("a", append_ids=(4,), top_n=1)]
    ).results
    assert not big.ok and "budget" in big.error and not engine.holds("b")
    assert a.ok and a.cache_len == 20
    assert engine.cache_len("a") == 20


def test_pass_times_on_the_arena(llama_target: Path) -> None:
    """The pass-time curve on the arena: one reserve, then passes discarded one after the other."""
    from common.runtime.pass_times import measure_pass_times

    engine = VerifierEngine.from_checkpoint(llama_target, attention_backend="sdpa", kv_cache="paged")
    times = measure_pass_times(engine.runner, rows=(1, 20, 40), context=8, tries=1)
    assert [r for r, _ in times] == [1, 20, 40] and all(s > 0 for _, s in times)
    assert engine.pool.used_blocks == 0


def test_paged_rollback_keeps_exactly_the_accepted_path(llama_target: Path) -> None:
    """After verdicts that drop rejected siblings (a tree across a block boundary), the arena holds,
    slot by block-table slot, what a fresh prefill of the committed sequence minus its last token holds."""
    engine = VerifierEngine.from_checkpoint(llama_target, attention_backend="sdpa", kv_cache="paged")
    prompt = tuple(range(3, 17))  # 14 tokens: the first tree's nodes cross into a second block
    right = hf_greedy(llama_target, {"a": list(prompt)}, 2)["a"]
    trees = [
        TokenTree(tokens=(9, right[0], 8, right[1], 7), parents=(-1, -1, 1, 1, 3)),  # nodes 1, 3 accepted: moved
        TokenTree(tokens=(1, 2, 3), parents=(-1, -1, -1)),
        TokenTree(),
    ]
    engine.verify([VerifyItem("a", append_ids=prompt, tree=trees[0])])
    for t in trees[1:]:
        engine.verify([VerifyItem("a", tree=t)])
    committed = engine.committed("a")
    assert list(committed[len(prompt) : len(prompt) + 2]) == right
    cache = engine._state("a").cache
    fresh = engine.pool.new_cache()
    n = len(committed) - 1
    fresh.reserve(n)
    engine.runner.forward([SeqInput(fresh, committed[:-1])])
    fresh.commit(n)
    assert cache.length == n and len(cache.blocks) == -(-n // engine.pool.block_size)
    arena = engine.pool
    for store in (arena.k, arena.v):
        got, want = store[:, torch.tensor(cache.slots(0, n))], store[:, torch.tensor(fresh.slots(0, n))]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_resumed_request_continues_as_the_running_one(llama_target: Path) -> None:
    """Resume: a request re-prefilled with another's committed tokens (as a replacement verifier
    does), in one pass beside the running request's plain step, decodes the same next token."""
    engine = VerifierEngine.from_checkpoint(llama_target, attention_backend="sdpa", kv_cache="paged")
    engine.verify([VerifyItem("a", append_ids=tuple(range(5, 25)), tree=TokenTree.chain([1, 2, 3]))])
    engine.verify([VerifyItem("a", tree=TokenTree((4, 5, 6), (-1, 0, -1)))])
    committed = engine.committed("a")
    a, b = engine.verify([VerifyItem("a"), VerifyItem("b", append_ids=committed)]).verdicts
    assert a.ok and b.ok and a.next_token == b.next_token
    assert engine.committed("a") == engine.committed("b")
    want = hf_greedy(llama_target, {"a": list(committed)}, 1)["a"]
    assert [a.next_token] == want


@pytest.mark.slow
def test_paged_sampling_keeps_the_target_s_law(llama_target: Path) -> None:
    """Sampling on the arena: the next two tokens' law over 2000 verdicts on a good tree is the target's."""
    from collections import Counter

    from common.runtime.checkpoints import load_causal_lm
    from common.runtime.test_sampling_distribution import PROMPT, exact_law, good_tree
    from common.spec.types import SamplingParams
    from tests.support.stats import tv_check

    params = SamplingParams(temperature=1.0)
    model = load_causal_lm(llama_target)
    tree = good_tree(model, params)
    engine = VerifierEngine.from_checkpoint(llama_target, kv_cache="paged", seed=99)
    counts: Counter = Counter()
    for start in range(0, 2000, 500):
        items = [
            VerifyItem(f"q{i}", append_ids=tuple(PROMPT), tree=tree, sampling=params) for i in range(start, start + 500)
        ]
        for v in engine.verify(items).verdicts:
            assert v.ok, v.error
            toks = v.new_tokens
            counts[(toks[0], toks[1]) if v.accepted_nodes else (toks[0], None)] += 1
            engine.release(v.request_id)
    tv, threshold = tv_check(counts, exact_law(model, tree, params), seed=5)
    assert tv <= threshold, (tv, threshold)
    assert engine.pool.used_blocks == 0
