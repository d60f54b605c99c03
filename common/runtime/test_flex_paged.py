"""``--attention flex``: flex attention reading the paged arena in place through a block mask gives
the gathered-view pass's logits (prompts, trees, mixed batches, committed tree paths) and greedy
decoding equal to transformers; asked for where it cannot run, it is refused with the way out."""

from __future__ import annotations

import pytest
import torch

from common.runtime.checkpoints import load_causal_lm
from common.runtime.kv_arena import select_kv_cache
from common.runtime.runner import LMRunner, SeqInput
from cosine_zoo.random_checkpoints import make_checkpoint

TREE = ((5, 6, 7, 8, 9), (-1, 0, 0, 1, 3))


pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:.*flex_attention.*"),  # its note that it runs uncompiled on a CPU
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("flex"), "llama", seed=5)


def mixed_passes(runner: LMRunner) -> list[torch.Tensor]:
    """The logits of three prompts (one spanning blocks), then one pass of a tree beside a chain
    beside a decode step, the tree's path 0-1-3 committed, and one decode step of each."""
    pool = runner.new_pool(None)
    caches = [pool.new_cache() for _ in range(3)]
    lens = (5, 37, 9)
    for c, n in zip(caches, lens):
        c.reserve(n)
    prompts = [SeqInput(c, tuple(range(1, n + 1)), logit_rows=tuple(range(n))) for c, n in zip(caches, lens)]
    out = runner.forward(prompts)
    for c, n in zip(caches, lens):
        c.commit(n)
    for c in caches:
        c.reserve(len(TREE[0]))
    out += runner.forward(
        [
            SeqInput(caches[0], TREE[0], TREE[1], tuple(range(5))),
            SeqInput(caches[1], (3, 4), None, (0, 1)),
            SeqInput(caches[2], (8,), None, (0,)),
        ]
    )
    caches[0].commit([0, 1, 3])
    caches[1].commit(2)
    caches[2].commit(1)
    for c in caches:
        c.reserve(1)
    return out + runner.forward([SeqInput(c, (11,), None, (0,)) for c in caches])


def test_flex_gives_the_gathered_view_s_logits_for_prompts_trees_and_committed_paths(checkpoint):
    flex = LMRunner.from_checkpoint(checkpoint, backend="flex")
    sdpa = LMRunner.from_checkpoint(checkpoint, backend="sdpa", kv_cache="paged")
    assert flex.kv_cache == "paged" and flex.attention_name == "paged_flex"
    for a, b in zip(mixed_passes(flex), mixed_passes(sdpa)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_greedy_decoding_with_flex_equals_transformers(checkpoint):
    from common.runtime.verifier_engine import VerifierEngine
    from common.spec.types import VerifyItem

    engine = VerifierEngine.from_checkpoint(checkpoint, attention_backend="flex", seed=0)
    assert engine.model_info().attention_backend == "paged_flex"
    model = load_causal_lm(checkpoint)
    prompts = [tuple(range(3, 3 + n)) for n in (4, 11)]
    outcome = engine.verify([VerifyItem(f"r{i}", append_ids=p, plain_steps=8) for i, p in enumerate(prompts)])
    for p, v in zip(prompts, outcome.verdicts):
        want = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
        assert list(v.new_tokens)[:8] == want


def test_flex_where_it_cannot_run_is_refused_with_the_way_out():
    assert select_kv_cache("auto", "cpu", "flex")[0] == "paged"  # on a CPU too: it reads the arena
    with pytest.raises(ValueError, match="flex reads the paged arena; use --kv-cache paged or auto"):
        select_kv_cache("contiguous", "cpu", "flex")
    with pytest.raises(ValueError, match="not row-invariant"):
        select_kv_cache("auto", "cpu", "flex", "bfloat16")
