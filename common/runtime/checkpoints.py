"""Loading transformers checkpoints by path, with errors an operator can act on.

Every model in CoSine (the zoo's or a real Llama/Qwen2/Mistral checkpoint) is loaded here with
``AutoTokenizer.from_pretrained(path)`` / ``AutoModelForCausalLM.from_pretrained(path)``. Problems
that would otherwise surface as a traceback from deep inside transformers (missing directory,
missing config or weights, unreadable tokenizer) become one :class:`CheckpointError` naming the
path.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, incomplete or inconsistent. The message names the path."""


def check_checkpoint_dir(path: str | Path, need_weights: bool = True, need_tokenizer: bool = False) -> Path:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint directory")
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a directory (expected a transformers checkpoint directory)")
    if not (p / "config.json").is_file():
        raise CheckpointError(f"{p}: config.json is missing (not a transformers checkpoint?)")
    try:
        json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{p / 'config.json'}: unreadable ({exc})") from exc
    if need_weights and not any((p / name).is_file() for name in WEIGHT_FILES):
        raise CheckpointError(f"{p}: no weights found (expected one of {', '.join(WEIGHT_FILES)})")
    if need_tokenizer and not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{p}: no tokenizer found (expected one of {', '.join(TOKENIZER_FILES)})")
    return p


def read_config(path: str | Path) -> dict[str, Any]:
    p = check_checkpoint_dir(path, need_weights=False)
    return json.loads((p / "config.json").read_text())


def check_tokenizer_dir(path: str | Path) -> Path:
    """A directory holding a tokenizer (a model checkpoint or a tokenizer alone; no config.json needed)."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{p}: no such tokenizer directory")
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{p}: no tokenizer found (expected one of {', '.join(TOKENIZER_FILES)})")
    return p


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    p = check_tokenizer_dir(path)
    try:
        return AutoTokenizer.from_pretrained(str(p))
    except Exception as exc:  # transformers raises many types here
        raise CheckpointError(f"{p}: cannot load tokenizer ({type(exc).__name__}: {exc})") from exc


def load_causal_lm(path: str | Path, dtype: str = "float32", device: str = "cpu") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    p = check_checkpoint_dir(path)
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise CheckpointError(f"{p}: unsupported dtype {dtype!r} (float32, float16, bfloat16)")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per checkpoint is noise in service logs
    try:
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch_dtype)
    except Exception as exc:
        raise CheckpointError(f"{p}: cannot load model ({type(exc).__name__}: {exc})") from exc
    return model.to(device).eval()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short stable hash of what token ids mean: the vocabulary and the special tokens.

    Two tokenizers with equal fingerprints map text to the same ids, so a drafter and a target
    with equal fingerprints can share token ids.
    """
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for token, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    specials = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    h.update(json.dumps(specials, sort_keys=True).encode())
    return h.hexdigest()[:16]


def check_same_tokenizer(reference: str | Path, others: Iterable[str | Path]) -> str:
    """Raise CheckpointError naming the first checkpoint whose tokenizer differs from ``reference``'s.

    Drafters must share the target's tokenizer (token ids are exchanged, never text). Returns the
    shared fingerprint.
    """
    expected = tokenizer_fingerprint(load_tokenizer(reference))
    for other in others:
        got = tokenizer_fingerprint(load_tokenizer(other))
        if got != expected:
            raise CheckpointError(
                f"{Path(other)}: tokenizer does not match {Path(reference)} (fingerprint {got} != {expected}); "
                "drafters must share the target's tokenizer"
            )
    return expected
