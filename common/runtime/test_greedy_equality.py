"""Lossless greedy: speculative output equals the target's own ``generate(do_sample=False)``.

Every case drives the verifier with trees from real sources (a near drafter, an unrelated drafter,
the target itself, random tokens, nothing) over batches that mix prompt lengths and tree shapes,
and compares token for token with transformers' greedy decode of the target loaded by path.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.runtime.checkpoints import load_causal_lm
from common.runtime.cpu_attention import cpu_kernel_available
from common.runtime.drafter_engine import DrafterEngine
from common.runtime.sim import DrafterSource, EmptySource, RandomSource, speculative_generate
from common.runtime.verifier_engine import VerifierEngine


def hf_greedy(path: Path, prompts: dict[str, list[int]], max_new: int) -> dict[str, list[int]]:
    model = load_causal_lm(path)
    out = {}
    for rid, prompt in prompts.items():
        ids = torch.tensor([prompt])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            eos_token_id=None,
            pad_token_id=0,
        )
        out[rid] = gen[0, len(prompt) :].tolist()
    return out


def make_prompts(n: int, vocab: int, seed: int, lengths: tuple[int, ...] = (1, 3, 7, 16, 40)) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)}


def mixed_sources(target: Path, near: Path, vocab: int, backend: str = "sdpa") -> list:
    """One of each kind of tree: chains and wide trees from a near drafter, the target as drafter
    (all right), random trees and chains (all wrong), empty drafts."""
    near_engine = DrafterEngine.from_checkpoint(near, attention_backend=backend)
    self_engine = DrafterEngine.from_checkpoint(target, attention_backend=backend)
    return [
        DrafterSource(near_engine, depth=4, width=1),
        DrafterSource(near_engine, depth=3, width=3),
        DrafterSource(self_engine, depth=5, width=1),
        RandomSource(vocab, size=6, seed=11),
        RandomSource(vocab, size=4, seed=12, chain=True),
        EmptySource(),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_mixed_batch_equals_hf_greedy(family: str, request: pytest.FixtureRequest) -> None:
    target: Path = request.getfixturevalue(f"{family}_target")
    near: Path = request.getfixturevalue(f"{family}_near")
    verifier = VerifierEngine.from_checkpoint(target)  # the default backend: the project's CPU kernel where it builds
    vocab = verifier.runner.vocab_size
    sources = mixed_sources(target, near, vocab)
    # near-drafter sources share one engine: give them distinct requests
    prompts = make_prompts(12, vocab, seed=7)
    assign = {rid: sources[i % len(sources)] for i, rid in enumerate(prompts)}
    max_new = 40
    got = speculative_generate(verifier, prompts, assign, max_new)
    want = hf_greedy(target, prompts, max_new)
    for rid in prompts:
        assert got[rid] == want[rid], f"{family} {rid} ({type(assign[rid]).__name__}) diverged"
    assert verifier.active_requests == 0 and verifier.kv_reserved_tokens == 0


@pytest.mark.slow
def test_long_generation_equals_hf_greedy(llama_target: Path, llama_near: Path) -> None:
    """220 new tokens for a batch of 4 (chains, a wide tree, an all-right drafter, empty drafts)."""
    verifier = VerifierEngine.from_checkpoint(llama_target)
    near = DrafterEngine.from_checkpoint(llama_near)
    selfd = DrafterEngine.from_checkpoint(llama_target)
    prompts = make_prompts(4, verifier.runner.vocab_size, seed=3, lengths=(2, 9, 25, 5))
    sources = dict(
        zip(prompts, [DrafterSource(near, 4), DrafterSource(near, 2, 2), DrafterSource(selfd, 6), EmptySource()])
    )
    max_new = 220
    got = speculative_generate(verifier, prompts, sources, max_new)
    want = hf_greedy(llama_target, prompts, max_new)
    for rid in prompts:
        assert got[rid] == want[rid], rid


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "sdpa", "cpu_kernel"])
def test_backends_equal_hf_greedy(backend: str, qwen2_target: Path, qwen2_near: Path) -> None:
    if backend == "cpu_kernel" and cpu_kernel_available("cpu", torch.float32) is None:
        pytest.skip("the project's CPU kernels are not built here")
    verifier = VerifierEngine.from_checkpoint(qwen2_target, attention_backend=backend)
    near = DrafterEngine.from_checkpoint(qwen2_near, attention_backend=backend)
    prompts = make_prompts(4, verifier.runner.vocab_size, seed=5)
    sources = dict(
        zip(prompts, [DrafterSource(near, 3, 2), DrafterSource(near, 3, 2), RandomSource(512, 5), EmptySource()])
    )
    got = speculative_generate(verifier, prompts, sources, 24)
    assert got == hf_greedy(qwen2_target, prompts, 24)


@pytest.mark.slow
def test_tiny_zoo_equals_hf_greedy(tiny_zoo) -> None:
    """The project's tiny zoo: every drafter against the target, in one mixed batch."""
    zoo = tiny_zoo
    target = Path(zoo.target.path)
    verifier = VerifierEngine.from_checkpoint(target)
    vocab = verifier.runner.vocab_size
    sources: list = []
    for i, drafter in enumerate(zoo.drafters.values()):
        engine = DrafterEngine.from_checkpoint(Path(drafter.path))
        sources += [DrafterSource(engine, depth=4), DrafterSource(engine, depth=3, width=3)]
    sources += [RandomSource(vocab, 5, seed=1), EmptySource()]
    prompts = make_prompts(len(sources) * 2, vocab, seed=9)
    assign = {rid: sources[i % len(sources)] for i, rid in enumerate(prompts)}
    got = speculative_generate(verifier, prompts, assign, 48)
    assert got == hf_greedy(target, prompts, 48)
