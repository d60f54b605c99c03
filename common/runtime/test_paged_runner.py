"""The runner on the paged arena equals transformers and the contiguous path: prompts, trees, mixed
batches, commits of a tree's path, rollback and resume, blocks reused; and its pass runs the same
number of tensor operations at any batch size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.runtime.checkpoints import load_causal_lm
from common.runtime.kv_arena import KVArena, PagedCache
from common.runtime.op_count import forward_ops
from common.runtime.runner import LMRunner, SeqInput
from cosine_zoo.random_checkpoints import make_checkpoint

VARIANTS = {
    "llama-gqa": ("llama", {}),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2-mqa": ("qwen2", dict(num_key_value_heads=1)),
    "mistral-gqa-no-window": ("mistral", dict(sliding_window=None)),
}
TREE = ((5, 6, 7, 8, 9), (-1, 0, 0, 1, 3))  # two branches: 0-1-3-4 and 0-2


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: make_checkpoint(tmp_path_factory.mktemp(name), fam, seed=i, **kw)
        for i, (name, (fam, kw)) in enumerate(VARIANTS.items())
    }


@pytest.fixture(scope="module")
def llama(checkpoints: dict[str, Path]) -> tuple[LMRunner, LMRunner, object]:
    """(paged runner, contiguous runner, transformers model) of the GQA Llama."""
    path = checkpoints["llama-gqa"]
    return (
        LMRunner.from_checkpoint(path, backend="sdpa", kv_cache="paged"),
        LMRunner.from_checkpoint(path, backend="sdpa", kv_cache="contiguous"),
        load_causal_lm(path),
    )


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def path_ids(tokens: tuple[int, ...], parents: tuple[int, ...], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


def prefill(runner: LMRunner, pool, seqs: list[list[int]]):
    caches = [pool.new_cache() for _ in seqs]
    for c, s in zip(caches, seqs):
        c.reserve(len(s))
    out = runner.forward([SeqInput(c, tuple(s), logit_rows=tuple(range(len(s)))) for c, s in zip(caches, seqs)])
    for c, s in zip(caches, seqs):
        c.commit(len(s))
    return caches, out


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_trees_equal_hf(variant: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[variant]
    runner = LMRunner.from_checkpoint(path, backend="sdpa", kv_cache="paged")
    model = load_causal_lm(path)
    pool = runner.new_pool(None)
    assert isinstance(pool, KVArena) and runner.attention_name == "paged_sdpa"
    seqs = prompts(1, 7, 40)  # 40 spans three blocks
    caches, out = prefill(runner, pool, seqs)
    assert all(isinstance(c, PagedCache) for c in caches)
    for s, lg in zip(seqs, out):
        torch.testing.assert_close(lg, hf_logits(model, s), rtol=1e-4, atol=1e-4)
    tokens, parents = TREE
    for c in caches:
        c.reserve(len(tokens))
    out = runner.forward([SeqInput(c, tokens, parents, tuple(range(len(tokens)))) for c in caches])
    for s, lg in zip(seqs, out):
        for node in range(len(tokens)):
            want = hf_logits(model, s + path_ids(tokens, parents, node))[-1]
            torch.testing.assert_close(lg[node], want, rtol=1e-4, atol=1e-4)


def test_a_mixed_batch_equals_each_sequence_on_the_contiguous_path(llama) -> None:
    """One pass with a prompt, a tree, a chain and a plain decode step, against the same inputs on
    today's per-request caches."""
    paged, contiguous, _ = llama
    seqs = prompts(3, 17, 33, 5, seed=1)
    tokens, parents = TREE
    outs = []
    for runner in (paged, contiguous):
        pool = runner.new_pool(None)
        caches, _ = prefill(runner, pool, seqs[1:])
        fresh = pool.new_cache()
        batch = [
            SeqInput(fresh, tuple(seqs[0]), logit_rows=(0, 1, 2)),
            SeqInput(caches[0], tokens, parents, tuple(range(len(tokens)))),
            SeqInput(caches[1], (4, 3, 2), None, (0, 1, 2)),
            SeqInput(caches[2], (11,)),
        ]
        for s in batch:
            s.cache.reserve(len(s.token_ids))
        outs.append(runner.forward(batch))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_committed_path_rollback_and_resume_equal_hf(llama) -> None:
    paged, _, model = llama
    pool = paged.new_pool(None)
    [prompt] = prompts(14, seed=2)  # 14 + 1 + a 5-node tree: a pass across a block boundary
    [c], _ = prefill(paged, pool, [prompt])
    tokens, parents = TREE
    feed = (3, *tokens)  # one uncached committed token, then the tree below it
    par = (-1, *(0 if p < 0 else p + 1 for p in parents))
    c.reserve(len(feed))
    paged.forward([SeqInput(c, feed, par, tuple(range(len(feed))))])
    c.commit([0, 1, 2, 4, 5])  # the token and the path 0-1-3-4 (feed rows 1, 2, 4, 5); node 2 rejected
    committed = [*prompt, 3, 5, 6, 8, 9]
    assert c.length == len(committed) == 19 and len(c.blocks) == 2
    c.reserve(1)
    [lg] = paged.forward([SeqInput(c, (42,))])
    torch.testing.assert_close(lg[0], hf_logits(model, [*committed, 42])[-1], rtol=1e-4, atol=1e-4)
    c.commit(1)
    c.truncate(10)  # rollback: the next pass continues from the first 10 tokens
    assert len(c.blocks) == 1
    c.reserve(2)
    [lg] = paged.forward([SeqInput(c, (7, 8), logit_rows=(0, 1))])
    torch.testing.assert_close(lg, hf_logits(model, [*prompt[:10], 7, 8])[-2:], rtol=1e-4, atol=1e-4)


def test_released_blocks_reused_by_another_request_hold_its_own_entries(llama) -> None:
    paged, _, model = llama
    pool = paged.new_pool(None)
    a_prompt, b_prompt = prompts(40, 36, seed=3)
    [a], _ = prefill(paged, pool, [a_prompt])
    held = list(a.blocks)
    a.release()
    [b], [lg] = prefill(paged, pool, [b_prompt])
    assert set(b.blocks) <= set(held)  # b lives in a's old blocks
    torch.testing.assert_close(lg, hf_logits(model, b_prompt), rtol=1e-4, atol=1e-4)
    b.reserve(1)
    [lg] = paged.forward([SeqInput(b, (1,))])
    torch.testing.assert_close(lg[0], hf_logits(model, [*b_prompt, 1])[-1], rtol=1e-4, atol=1e-4)


def test_a_pass_refuses_caches_of_two_arenas(llama) -> None:
    paged, _, _ = llama
    a, b = paged.new_pool(None).new_cache(), paged.new_pool(None).new_cache()
    a.reserve(1)
    b.reserve(1)
    with pytest.raises(ValueError, match="same arena"):
        paged.forward([SeqInput(a, (1,)), SeqInput(b, (2,))])


def verify_pass_ops(runner: LMRunner, batch: int) -> int:
    """Kernel operations (views left out) of one verify pass at ``batch``: every request its last
    committed token plus a 5-node tree, on caches of different lengths."""
    pool = runner.new_pool(None)
    caches, _ = prefill(runner, pool, prompts(*(20 + 3 * i for i in range(batch)), seed=batch))
    tokens, parents = TREE
    par = (-1, *(0 if p < 0 else p + 1 for p in parents))
    return forward_ops(runner, [SeqInput(c, (1, *tokens), par, tuple(range(6))) for c in caches])


def test_a_paged_verify_pass_runs_as_many_tensor_ops_at_batch_1_8_and_32(llama) -> None:
    paged, contiguous, _ = llama
    counts = [verify_pass_ops(paged, b) for b in (1, 8, 32)]
    assert counts[0] > 0 and counts == [counts[0]] * 3, counts
    today = [verify_pass_ops(contiguous, b) for b in (1, 32)]
    assert today[1] > today[0]  # what the property rules out: per-sequence work in every layer
