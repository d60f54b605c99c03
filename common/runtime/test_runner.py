"""The batched runner equals the checkpoint's own transformers forward (fp32, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.runtime.attention import FlashAttnBackend, SdpaBackend, reference_varlen
from common.runtime.checkpoints import CheckpointError, load_causal_lm
from common.runtime.cpu_attention import CpuKernelBackend, cpu_kernel_available
from common.runtime.runner import LMRunner, SeqInput, UnsupportedArchitecture
from cosine_zoo.random_checkpoints import make_checkpoint

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
VARIANTS = {
    "llama-gqa": ("llama", {}),
    "llama-mha-tied-llama3rope": (
        "llama",
        dict(num_key_value_heads=4, tie_word_embeddings=True, rope_parameters=LLAMA3),
    ),
    "llama-linear-rope": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0})),
    "qwen2-gqa-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-mqa": ("qwen2", dict(num_key_value_heads=1)),
    "mistral-gqa-no-window": ("mistral", dict(sliding_window=None)),
    "mistral-mqa-window-as-wide-as-the-context": ("mistral", dict(num_key_value_heads=1, sliding_window=1024)),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: make_checkpoint(tmp_path_factory.mktemp(name), fam, seed=i, **kw)
        for i, (name, (fam, kw)) in enumerate(VARIANTS.items())
    }


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def prefill(runner: LMRunner, pool, seqs: list[list[int]]):
    caches = [pool.new_cache() for _ in seqs]
    for c, s in zip(caches, seqs):
        c.reserve(len(s))
    out = runner.forward([SeqInput(c, tuple(s), logit_rows=tuple(range(len(s)))) for c, s in zip(caches, seqs)])
    for c, s in zip(caches, seqs):
        c.commit(len(s))
    return caches, out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_prefill_and_decode_equal_hf(variant: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[variant]
    runner = LMRunner.from_checkpoint(path, backend="sdpa")
    model = load_causal_lm(path)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 7, 40)]
    caches, out = prefill(runner, runner.new_pool(None), seqs)
    for s, lg in zip(seqs, out):
        torch.testing.assert_close(lg, hf_logits(model, s), rtol=1e-4, atol=1e-4)
    # three batched decode steps on caches of different lengths
    for _ in range(3):
        nxt = [int(torch.randint(0, 512, (1,), generator=g)) for _ in seqs]
        for c in caches:
            c.reserve(1)
        out = runner.forward([SeqInput(c, (t,)) for c, t in zip(caches, nxt)])
        for c, s, t, lg in zip(caches, seqs, nxt, out):
            c.commit(1)
            s.append(t)
            torch.testing.assert_close(lg[0], hf_logits(model, s)[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-gqa-tied"])
def test_tree_nodes_equal_hf_on_their_root_to_node_path(variant: str, checkpoints: dict[str, Path]) -> None:
    """Each tree node's logits equal the HF forward of prefix + its ancestors + itself: the mask
    hides siblings and cousins, and positions are depths."""
    path = checkpoints[variant]
    runner = LMRunner.from_checkpoint(path, backend="sdpa")
    model = load_causal_lm(path)
    prefix = [5, 17, 300, 2, 9]
    cache = runner.new_pool(None).new_cache()
    cache.reserve(len(prefix) - 1)
    runner.forward([SeqInput(cache, tuple(prefix[:-1]))])
    cache.commit(len(prefix) - 1)
    # last committed token, then a tree: roots 10, 11; 12 under 10; 13, 14 under 12; 15 under 11
    tokens = (prefix[-1], 10, 11, 12, 13, 14, 15)
    parents = (-1, 0, 0, 1, 3, 3, 2)
    cache.reserve(len(tokens))
    [lg] = runner.forward([SeqInput(cache, tokens, parents, logit_rows=tuple(range(len(tokens))))])
    for i in range(len(tokens)):
        chain, j = [], i
        while j >= 0:
            chain.append(tokens[j])
            j = parents[j]
        ref = hf_logits(model, prefix[:-1] + chain[::-1])[-1]
        torch.testing.assert_close(lg[i], ref, rtol=1e-4, atol=1e-4)


def test_backends_agree_on_a_mixed_tree_batch(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["llama-gqa"]
    runners = {
        "eager": LMRunner.from_checkpoint(path, backend="eager"),
        "sdpa": LMRunner.from_checkpoint(path, backend="sdpa"),
    }
    base = runners["sdpa"]
    runners["flash_attn(reference kernel)"] = LMRunner(
        base.model, FlashAttnBackend(varlen_fn=reference_varlen), name="x"
    )
    runners["sdpa(padded together, as on a GPU)"] = LMRunner(base.model, SdpaBackend(together=True), name="x")
    kernel = cpu_kernel_available("cpu", torch.float32)
    if kernel is not None:
        runners["cpu_kernel"] = LMRunner(base.model, CpuKernelBackend(kernel), name="x")
    results = {}
    for name, runner in runners.items():
        pool = runner.new_pool(None)
        caches, _ = prefill(runner, pool, [[1, 2, 3], [4] * 11, [7]])
        batch = [
            SeqInput(caches[0], (8, 9, 10, 11), (-1, 0, 0, 2), logit_rows=(0, 1, 2, 3)),
            SeqInput(caches[1], (12,), logit_rows=(0,)),
            SeqInput(caches[2], (13, 14, 15, 16, 17), (-1, -1, 0, 1, 1), logit_rows=(0, 1, 2, 3, 4)),
        ]
        for s in batch:
            s.cache.reserve(len(s.token_ids))
        results[name] = torch.cat(runner.forward(batch))
    for name, lg in results.items():
        torch.testing.assert_close(lg, results["eager"], rtol=1e-5, atol=1e-5, msg=name)


def test_unsupported_architecture_is_refused_at_load(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    refusal = "unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"
    with pytest.raises(UnsupportedArchitecture, match=refusal) as refused:
        LMRunner.from_checkpoint(tmp_path)
    assert issubclass(UnsupportedArchitecture, CheckpointError)
    for family in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert family in str(refused.value)


def test_sliding_window_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"],
            }
        )
    )
    with pytest.raises(UnsupportedArchitecture, match="sliding-window"):
        LMRunner.from_checkpoint(tmp_path)


def test_a_mistral_window_narrower_than_the_context_is_refused_at_load(tmp_path: Path) -> None:
    narrow = make_checkpoint(tmp_path / "narrow", "mistral", seed=0, sliding_window=512)  # context: 1024
    with pytest.raises(UnsupportedArchitecture, match="sliding_window 512 is narrower than the context of 1024"):
        LMRunner.from_checkpoint(narrow)
    # a config that leaves the window out has transformers' default one (4096, under the default context)
    (tmp_path / "unsaid").mkdir()
    (tmp_path / "unsaid" / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    with pytest.raises(UnsupportedArchitecture, match="sliding_window 4096 is narrower"):
        LMRunner.from_checkpoint(tmp_path / "unsaid")


def test_missing_checkpoint_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        LMRunner.from_checkpoint(tmp_path / "nope")


def test_facts(checkpoints: dict[str, Path]) -> None:
    runner = LMRunner.from_checkpoint(checkpoints["qwen2-gqa-tied"], backend="auto")
    assert runner.architecture == "Qwen2ForCausalLM"
    assert runner.backend.name == ("cpu_kernel" if cpu_kernel_available("cpu", torch.float32) else "sdpa")
    assert runner.vocab_size == 512 and runner.max_context == 1024
    assert runner.num_kv_heads == 2 and runner.head_dim == 16
    assert runner.num_parameters == sum(p.numel() for p in runner.model.parameters())
    assert len(runner.tokenizer_fingerprint) == 16


def test_forward_builds_no_autograd_graph(tmp_path):
    """Serving never trains: logits must come out of inference mode (no graph, no grad memory)."""
    from common.runtime.runner import LMRunner, SeqInput
    from cosine_zoo.random_checkpoints import make_checkpoint

    runner = LMRunner.from_checkpoint(make_checkpoint(tmp_path / "m", "llama", seed=0), backend="sdpa")
    pool = runner.new_pool(None)
    cache = pool.new_cache()
    cache.reserve(3)
    (logits,) = runner.forward([SeqInput(cache, (1, 2, 3))])
    assert not logits.requires_grad and logits.is_inference()
