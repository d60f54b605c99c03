"""Fixtures of the router's in-process tests: the real engines on small random checkpoints, and
the prompts with the target's own greedy continuations."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.runtime.drafter_engine import DrafterEngine
from common.runtime.test_greedy_equality import hf_greedy, make_prompts
from common.runtime.verifier_engine import VerifierEngine

MAX_NEW = 24  # new tokens per request of the reference


@pytest.fixture(scope="module")
def engines(llama_target: Path, llama_near: Path, llama_small: Path):
    verifier = VerifierEngine.from_checkpoint(llama_target, attention_backend="sdpa")
    drafters = {
        "near": DrafterEngine.from_checkpoint(llama_near, domains=("near-domain",)),
        "small": DrafterEngine.from_checkpoint(llama_small, domains=("small-domain",)),
        "self": DrafterEngine.from_checkpoint(llama_target, domains=("self-domain",)),
    }
    return verifier, drafters


@pytest.fixture(scope="module")
def reference(llama_target: Path, engines) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    prompts = make_prompts(6, engines[0].runner.vocab_size, seed=21)
    return prompts, hf_greedy(llama_target, prompts, MAX_NEW)
