"""Random small checkpoints on disk shared by the drafter and verifier tests (built once per session)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cosine_zoo.random_checkpoints import make_checkpoint, make_perturbed_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The test models are tiny: intra-op threads only add synchronisation cost (and stall badly
    when another process holds a core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="session")
def llama_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama, GQA (4 query / 2 kv heads), llama3 RoPE scaling, untied embeddings."""
    return make_checkpoint(
        tmp_path_factory.mktemp("llama_target"), "llama", seed=1, num_hidden_layers=3, rope_parameters=LLAMA3_ROPE
    )


@pytest.fixture(scope="session")
def qwen2_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 (q/k/v biases), GQA, tied embeddings."""
    return make_checkpoint(
        tmp_path_factory.mktemp("qwen2_target"), "qwen2", seed=2, num_hidden_layers=3, tie_word_embeddings=True
    )


@pytest.fixture(scope="session")
def mistral_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mistral, GQA, with a sliding window as wide as its context (1024 tokens): full attention."""
    return make_checkpoint(
        tmp_path_factory.mktemp("mistral_target"), "mistral", seed=6, num_hidden_layers=3, sliding_window=1024
    )


@pytest.fixture(scope="session")
def llama_near(tmp_path_factory: pytest.TempPathFactory, llama_target: Path) -> Path:
    """A drafter that agrees with ``llama_target`` often but not always."""
    return make_perturbed_checkpoint(llama_target, tmp_path_factory.mktemp("llama_near"), noise=0.03, seed=3)


@pytest.fixture(scope="session")
def qwen2_near(tmp_path_factory: pytest.TempPathFactory, qwen2_target: Path) -> Path:
    return make_perturbed_checkpoint(qwen2_target, tmp_path_factory.mktemp("qwen2_near"), noise=0.03, seed=4)


@pytest.fixture(scope="session")
def mistral_near(tmp_path_factory: pytest.TempPathFactory, mistral_target: Path) -> Path:
    return make_perturbed_checkpoint(mistral_target, tmp_path_factory.mktemp("mistral_near"), noise=0.03, seed=7)


@pytest.fixture(scope="session")
def llama_small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An unrelated smaller Llama with the same vocabulary (its drafts are mostly wrong)."""
    return make_checkpoint(
        tmp_path_factory.mktemp("llama_small"),
        "llama",
        seed=5,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
