"""Row-invariant bfloat16 on an AMX CPU: a token's logits are bit for bit the same whether it is
decoded alone, verified in a token tree, or batched with other sequences; where the CPU lacks the
property, bfloat16 is not picked."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.runtime import invariant_bf16
from common.runtime.attention_selection import pick_backend
from common.runtime.cpu_attention import CpuKernelBackend
from common.runtime.invariant_bf16 import (
    InvariantAttention,
    InvariantLinear,
    bf16_available,
    pad_keys,
    use_invariant_linears,
)
from common.runtime.runner import LMRunner, SeqInput, resolve_dtype
from cosine_zoo.random_checkpoints import make_checkpoint

needs_bf16 = pytest.mark.skipif(
    not bf16_available(), reason="this CPU's bfloat16 products are not row-invariant (no AMX)"
)


@pytest.fixture(scope="module")
def gqa_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with grouped-query attention (4 query heads on 2 key/value heads)."""
    return make_checkpoint(tmp_path_factory.mktemp("bf16_target"), "llama", seed=3, num_hidden_layers=2)


def test_auto_is_bfloat16_exactly_where_the_products_are_row_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if bf16_available() else "float32")
    assert resolve_dtype("auto", "cuda") == "float32"
    assert resolve_dtype("float16", "cpu") == "float16"
    monkeypatch.setattr(invariant_bf16, "amx_available", lambda: False)
    assert invariant_bf16.invariant_rows() == 0 and not bf16_available()
    assert resolve_dtype("auto", "cpu") == "float32"
    assert pick_backend("auto", "cpu", torch.bfloat16).name == "sdpa"  # bfloat16 asked for by name: torch's own kernels
    with pytest.raises(ValueError, match="row-invariant"):
        pick_backend("invariant", "cpu", torch.bfloat16)


def test_the_invariant_backend_is_for_bfloat16_on_a_cpu() -> None:
    with pytest.raises(ValueError, match="bfloat16 on a CPU"):
        pick_backend("invariant", "cpu", torch.float32)


def test_pad_keys_pads_with_zeros_to_the_block() -> None:
    x = torch.ones(2, 33, 4, dtype=torch.bfloat16)
    padded = pad_keys(x, 1)
    assert padded.shape == (2, 2 * invariant_bf16.KEY_BLOCK, 4)
    assert torch.equal(padded[:, :33], x) and not padded[:, 33:].any()
    assert pad_keys(padded, 1) is padded


@needs_bf16
def test_each_row_of_a_projection_is_the_row_projected_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(48, 80).to(torch.bfloat16)
    assert use_invariant_linears(torch.nn.Sequential(layer), limit=16) == 16
    assert isinstance(layer, InvariantLinear) and layer.rows == 16
    x = torch.randn(37, 48, generator=gen).to(torch.bfloat16)  # three chunks, the last one short
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(37)])
    assert torch.equal(together, alone)
    reference = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    torch.testing.assert_close(together.float(), reference, rtol=2e-2, atol=2e-2)
    with torch.no_grad():  # a weight changed in place is packed again
        layer.weight.mul_(2)
    torch.testing.assert_close(layer(x).float(), 2 * together.float() - layer.bias.float(), rtol=3e-2, atol=3e-2)


def random_tree(rng: random.Random, n: int) -> tuple[int, ...]:
    parents = [-1]
    for i in range(1, n):
        parents.append(rng.choice([-1, *range(i)]) if rng.random() < 0.35 else i - 1)
    return tuple(parents)


@needs_bf16
@pytest.mark.parametrize("backend", ["auto", "invariant"])
def test_tree_nodes_in_a_batch_get_the_logits_of_their_path_decoded_alone(gqa_target: Path, backend: str) -> None:
    """Random batches of random trees (branches, several roots, more nodes than a query chunk): every
    node's logits equal, bit for bit, those of decoding its root-to-node path one token at a time,
    with the project's attention kernel (``auto``: float32 attention on float32 keys/values) and the
    eager row-invariant one."""
    runner = LMRunner.from_checkpoint(gqa_target, dtype="auto", backend=backend)
    assert runner.dtype == torch.bfloat16
    if backend == "auto":
        assert isinstance(runner.backend, CpuKernelBackend) and runner.new_pool(None).dtype == torch.float32
        for m in runner.model.modules():  # projections in chunks of five rows: chunking is exercised
            if isinstance(m, InvariantLinear):
                m.rows = 5
    else:
        assert isinstance(runner.backend, InvariantAttention)
        runner.backend.rows = 6  # chunks of three tokens (two query heads per key/value head): chunking is exercised
    pool = runner.new_pool(None)
    rng = random.Random(5)
    vocab = runner.vocab_size
    checked = 0
    for _ in range(4):
        caches, trees = [], []
        for _ in range(rng.choice((1, 3))):
            prompt = tuple(rng.randrange(vocab) for _ in range(rng.randint(3, 70)))
            cache = pool.new_cache()
            cache.reserve(len(prompt))
            runner.forward([SeqInput(cache, prompt)])
            cache.commit(len(prompt))
            n = rng.randint(1, 11)
            caches.append(cache)
            trees.append((tuple(rng.randrange(vocab) for _ in range(n)), random_tree(rng, n)))
        for cache, (tokens, _) in zip(caches, trees):
            cache.reserve(len(tokens))
        logits = runner.forward(
            [SeqInput(c, toks, par, tuple(range(len(toks)))) for c, (toks, par) in zip(caches, trees)]
        )
        for cache, (tokens, parents), got in zip(caches, trees, logits):
            cache.discard_pending()
            base = cache.length
            for node in range(len(tokens)):
                path, x = [], node
                while x >= 0:
                    path.append(x)
                    x = parents[x]
                for x in reversed(path):
                    cache.reserve(1)
                    alone = runner.forward([SeqInput(cache, (tokens[x],))])[0][0]
                    cache.commit(1)
                assert torch.equal(alone, got[node]), f"node {node} of a {len(tokens)}-node tree"
                cache.truncate(base)
                checked += 1
    assert checked > 20


@pytest.fixture(scope="module")
def wide_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with head_dim 64 (4 query heads on 2 key/value heads, hidden 256), where ``sdpa``'s sums
    differ from the kernel's often enough to show up in bfloat16 logits."""
    return make_checkpoint(
        tmp_path_factory.mktemp("bf16_wide"),
        "llama",
        seed=3,
        num_hidden_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
    )


@needs_bf16
@pytest.mark.parametrize("backend", ["auto", "invariant"])
def test_a_prompt_with_its_draft_tree_in_one_pass_gets_the_logits_of_the_prompt_alone(
    wide_target: Path, backend: str
) -> None:
    """A request's first pass may hold its prompt and a draft tree while the target alone prefills
    the prompt by itself and then decodes: every row's logits must be the same either way, bit for
    bit, for prompts on both sides of the float32 kernel's 32 new tokens (with the prompts' rows
    sent to ``sdpa`` past 32, as float32 does, 5 of these 307 rows differed)."""
    runner = LMRunner.from_checkpoint(wide_target, dtype="auto", backend=backend)
    pool = runner.new_pool(None)
    rng = random.Random(3)
    vocab = runner.vocab_size
    for length in (20, 28, 31, 33, 40, 45, 75):
        prompt = tuple(rng.randrange(vocab) for _ in range(length))
        tree = tuple(rng.randrange(vocab) for _ in range(5))
        parents = tuple(p + length if p >= 0 else length - 1 for p in random_tree(rng, 5))
        together = pool.new_cache()
        together.reserve(length + 5)
        got = runner.forward(
            [SeqInput(together, prompt + tree, tuple(range(-1, length - 1)) + parents, tuple(range(length + 5)))]
        )[0]
        alone = pool.new_cache()
        alone.reserve(length)
        first = runner.forward([SeqInput(alone, prompt, None, tuple(range(length)))])[0]
        alone.commit(length)
        assert torch.equal(got[:length], first), f"prompt of {length}"
        for node in range(5):
            path, x = [], node
            while x >= 0:
                path.append(x)
                x = parents[x] - length
            for x in reversed(path):
                alone.reserve(1)
                logits = runner.forward([SeqInput(alone, (tree[x],))])[0][0]
                alone.commit(1)
            assert torch.equal(logits, got[length + node]), f"node {node} after a prompt of {length}"
            alone.truncate(length)


def test_bfloat16_is_not_offered_where_zero_padded_keys_are_not_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe of zero-padded key blocks decides too, not only the row bounds."""
    if not invariant_bf16.amx_available():
        pytest.skip("no AMX: the row bounds already rule bfloat16 out")
    assert invariant_bf16._zero_blocks_exact(torch.Generator().manual_seed(0)) == bf16_available()
    invariant_bf16._invariant_rows.cache_clear()
    monkeypatch.setattr(invariant_bf16, "_zero_blocks_exact", lambda gen: False)
    try:
        assert invariant_bf16.invariant_rows() == 0 and not bf16_available()
    finally:
        invariant_bf16._invariant_rows.cache_clear()
