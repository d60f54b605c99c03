"""Randomly initialised Llama / Mistral / Qwen2 checkpoints written to disk, for tests and benchmarks.

No download: the model is built from a config with random weights and the tokenizer is a
word-level vocabulary built in memory (``<t0> <t1> ...``). Both are saved with
``save_pretrained`` so engines load them by path exactly like a real checkpoint.

``initializer_range`` defaults higher than transformers' 0.02 so that a random model has peaked
next-token distributions: greedy comparisons then do not hinge on near-ties at the 1e-6 level.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2")


def make_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>")


def make_config(family: str = "llama", **overrides: Any) -> Any:
    """A small config of ``family``; ``overrides`` replace any field (e.g. ``rope_parameters``)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    base: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    if family == "llama":
        return LlamaConfig(**base)
    if family == "mistral":
        base.setdefault("sliding_window", None)  # transformers' default (4096) is narrower than the context
        return MistralConfig(**base)
    if family == "qwen2":
        base.setdefault("use_sliding_window", False)
        return Qwen2Config(**base)
    raise ValueError(f"unknown family {family!r} (choose {', '.join(FAMILIES)})")


def make_checkpoint(path: str | Path, family: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a random ``family`` checkpoint (fp32 weights + tokenizer) to ``path`` and return it."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = make_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    model.save_pretrained(str(path))
    make_tokenizer(config.vocab_size).save_pretrained(str(path))
    return path


def make_perturbed_checkpoint(src: str | Path, dst: str | Path, noise: float = 0.1, seed: int = 0) -> Path:
    """Copy ``src`` with every weight perturbed by Gaussian noise of ``noise`` times its std: a drafter
    that agrees with ``src`` often but not always."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dst = Path(dst)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            std = float(p.std()) if p.numel() > 1 else 0.0
            p.add_(torch.randn(p.shape, generator=gen) * noise * std)
    model.save_pretrained(str(dst))
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(dst))
    return dst
