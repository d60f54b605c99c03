"""The comparison with transformers measures the same computation: on the same caches and new
tokens, the runner's chain pass and the transformers forward give the same logits; the tree pass's
first branch is that chain; the bound grows with the batch."""

import torch

from benchmarks.verify_vs_hf import TREE10, Peaks, Shapes, bound_s
from common.runtime.runner import LMRunner
from cosine_zoo.random_checkpoints import make_checkpoint


def test_ours_and_transformers_compute_the_same_pass(tmp_path):
    path = make_checkpoint(
        tmp_path / "t",
        "llama",
        seed=0,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
    )
    runner = LMRunner.from_checkpoint(path, backend="sdpa")
    s = Shapes(runner, batch=3, context=20)
    ours = torch.stack(s.ours((-1, 0, 1, 2, 3)))
    theirs = s.hf(5)
    assert torch.allclose(ours, theirs.float(), atol=1e-4), (ours - theirs).abs().max()
    again = torch.stack(s.ours((-1, 0, 1, 2, 3)))  # caches cropped back: the same pass again
    assert torch.allclose(ours, again) and torch.allclose(theirs, s.hf(5))
    tree = s.ours(TREE10)
    assert torch.allclose(tree[0][:5], ours[0], atol=1e-4)  # the first branch is the same chain
    peaks = Peaks(gbs=100.0, tflops=1.0)
    assert bound_s(runner, 32, 512, 5, peaks) > bound_s(runner, 8, 512, 5, peaks) > 0
