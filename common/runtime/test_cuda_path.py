"""The verifier on a CUDA device: the same passes as on the CPU, and lossless there.

Skipped where no CUDA device is visible (CI has none). On a GPU node:
``python -m pytest common/runtime/test_cuda_path.py``. The checks run in float32 with TF32 off,
so that greedy ties break as they do on the CPU; bfloat16 is compared with a tolerance.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.runtime.attention import flash_attn_available
from common.runtime.runner import LMRunner, SeqInput
from common.runtime.sim import plain_generate, speculative_generate
from common.runtime.test_greedy_equality import make_prompts, mixed_sources
from common.runtime.verifier_engine import VerifierEngine

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def exact_float32() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def mixed_batch(runner: LMRunner) -> list[SeqInput]:
    """A prompt, a plain decode step, a chain and a branching tree, over caches filled by a prompt pass."""
    pool = runner.new_pool(None)
    caches = [pool.new_cache() for _ in range(4)]
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(4)]
    for c, p in zip(caches[1:], prompts[1:]):
        c.reserve(len(p))
    runner.forward([SeqInput(c, tuple(p)) for c, p in zip(caches[1:], prompts[1:])])
    for c, p in zip(caches[1:], prompts[1:]):
        c.commit(len(p))
    seqs = [
        SeqInput(caches[0], tuple(prompts[0]), logit_rows=(0, len(prompts[0]) - 1)),
        SeqInput(caches[1], (7,)),
        SeqInput(caches[2], (8, 9, 10, 11), logit_rows=(0, 1, 2, 3)),
        SeqInput(caches[3], (12, 13, 14, 15, 16), parents=(-1, 0, 0, 1, 2), logit_rows=(0, 1, 2, 3, 4)),
    ]
    for s in seqs:
        s.cache.reserve(len(s.token_ids))
    return seqs


CACHES = [("sdpa", "contiguous"), ("eager", "contiguous"), ("sdpa", "paged")]  # (attention, kv cache)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-4), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("backend, kv_cache", CACHES)
def test_a_mixed_pass_on_cuda_gives_the_cpu_logits(
    llama_target: Path, backend: str, kv_cache: str, dtype: str, tolerance: float
) -> None:
    cpu = LMRunner.from_checkpoint(llama_target, backend="eager")
    gpu = LMRunner.from_checkpoint(llama_target, device=DEVICE, dtype=dtype, backend=backend, kv_cache=kv_cache)
    assert gpu.kv_cache == kv_cache
    assert gpu.device.type == "cuda"
    want = cpu.forward(mixed_batch(cpu))
    got = gpu.forward(mixed_batch(gpu))
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        assert g.device.type == "cuda"
        error = (g.cpu() - w).norm() / w.norm()
        assert error < tolerance, f"relative error {error:.2e}"


@pytest.mark.parametrize("backend, kv_cache", CACHES)
def test_speculative_greedy_on_cuda_equals_plain_decoding_on_cuda(
    llama_target: Path, llama_near: Path, backend: str, kv_cache: str
) -> None:
    """Chains and wide trees from a near drafter, the target as its own drafter, random trees and
    empty drafts, in one batch on the GPU: the output is the GPU target's own greedy decode."""
    verifier = VerifierEngine.from_checkpoint(llama_target, device=DEVICE, attention_backend=backend, kv_cache=kv_cache)
    vocab = verifier.runner.vocab_size
    sources = mixed_sources(llama_target, llama_near, vocab)  # drafters on the CPU: drafts are token ids
    prompts = make_prompts(12, vocab, seed=7)
    assign = {rid: sources[i % len(sources)] for i, rid in enumerate(prompts)}
    got = speculative_generate(verifier, prompts, assign, 40)
    want, _ = plain_generate(verifier, prompts, 40)
    assert got == want
    assert verifier.active_requests == 0 and verifier.kv_reserved_tokens == 0


@pytest.mark.skipif(
    not torch.cuda.is_available() or not flash_attn_available(DEVICE, torch.bfloat16),
    reason="needs flash-attn on a CUDA device",
)
def test_flash_attn_gives_the_sdpa_logits(llama_target: Path) -> None:
    sdpa = LMRunner.from_checkpoint(
        llama_target, device=DEVICE, dtype="bfloat16", backend="sdpa", kv_cache="contiguous"
    )
    flash = LMRunner.from_checkpoint(llama_target, device=DEVICE, dtype="bfloat16", backend="flash_attn")
    for g, w in zip(flash.forward(mixed_batch(flash)), sdpa.forward(mixed_batch(sdpa))):
        assert ((g - w).norm() / w.norm()) < 2e-2
