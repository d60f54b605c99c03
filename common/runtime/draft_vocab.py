"""Reduced draft vocabularies: a drafter that predicts over the N most frequent target tokens.

A drafter's output layer over the target's whole vocabulary (49,152 tokens for SmolLM2) costs
more than its transformer layers. A drafter with a reduced vocabulary (as EAGLE-3 and FR-Spec
do) predicts over ``N`` target tokens only and maps its ids back to target ids. The map is part
of the checkpoint, declared in ``config.json``::

    "cosine_draft_vocab": {"file": "draft_vocab.json", "size": N, "target_vocab_size": V}

and ``draft_vocab.json`` holds ``{"target_ids": [...]}``: draft id ``i`` is target id
``target_ids[i]``. A target token outside the map is fed to the drafter as draft id 0 (the map's
first entry), so any target token sequence can be drafted from.

Lossless by construction: the drafter only proposes (target ids, after mapping); the verifier
only ever sees target ids and decides acceptance from the target's own distribution.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.runtime.checkpoints import CheckpointError

CONFIG_KEY = "cosine_draft_vocab"
FILE_NAME = "draft_vocab.json"


@dataclass(frozen=True)
class DraftVocab:
    """``to_target[i]``: target id of draft id ``i``; ``to_draft[t]``: draft id of target id ``t`` (0 if absent)."""

    to_target: torch.Tensor  # [N] long
    to_draft: torch.Tensor  # [V] long
    target_vocab_size: int

    @property
    def size(self) -> int:
        return int(self.to_target.shape[0])

    @classmethod
    def from_target_ids(cls, target_ids: Sequence[int], target_vocab_size: int) -> DraftVocab:
        ids = [int(t) for t in target_ids]
        if not ids or len(set(ids)) != len(ids) or not all(0 <= t < target_vocab_size for t in ids):
            raise ValueError(f"draft vocabulary: target ids must be distinct and within [0, {target_vocab_size})")
        to_target = torch.tensor(ids, dtype=torch.long)
        to_draft = torch.zeros(target_vocab_size, dtype=torch.long)
        to_draft[to_target] = torch.arange(len(ids))
        return cls(to_target, to_draft, target_vocab_size)

    def to(self, device: torch.device | str) -> DraftVocab:
        return DraftVocab(self.to_target.to(device), self.to_draft.to(device), self.target_vocab_size)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[rows, N]`` draft logits -> ``[rows, V]`` target logits (-inf outside the map)."""
        out = logits.new_full((logits.shape[0], self.target_vocab_size), float("-inf"))
        out[:, self.to_target] = logits
        return out

    def save(self, checkpoint: Path, config: Any) -> None:
        """Write the map next to the weights and declare it in ``config`` (saved with the model)."""
        (checkpoint / FILE_NAME).write_text(json.dumps({"target_ids": self.to_target.tolist()}) + "\n")
        setattr(config, CONFIG_KEY, {"file": FILE_NAME, "size": self.size, "target_vocab_size": self.target_vocab_size})


def load_draft_vocab(path: str | Path, config: dict[str, Any]) -> DraftVocab | None:
    """The checkpoint's draft vocabulary, or None when ``config`` declares none.

    Raises :class:`CheckpointError` naming the file when the declaration and the map disagree.
    """
    decl = config.get(CONFIG_KEY)
    if not decl:
        return None
    f = Path(path) / str(decl.get("file", FILE_NAME))
    try:
        ids = json.loads(f.read_text())["target_ids"]
        vocab = DraftVocab.from_target_ids(ids, int(decl["target_vocab_size"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{f}: unreadable draft vocabulary ({type(exc).__name__}: {exc})") from exc
    if vocab.size != int(decl.get("size", vocab.size)) or vocab.size != int(config.get("vocab_size", vocab.size)):
        raise CheckpointError(
            f"{f}: {vocab.size} draft tokens, but config.json declares "
            f"{decl.get('size')} and a model vocabulary of {config.get('vocab_size')}"
        )
    return vocab


def in_target_space(model: Any, vocab: DraftVocab) -> Any:
    """Make a reduced-vocabulary drafter speak target ids in place, for code that expects the
    target's vocabulary (transformers' assisted generation): its forward maps ``input_ids`` to
    draft ids and returns ``[batch, seq, target_vocab]`` logits (-inf outside the map)."""
    base = type(model)

    class TargetSpace(base):  # type: ignore[misc, valid-type]
        def forward(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
            out = super().forward(input_ids=None if input_ids is None else vocab.to_draft[input_ids], **kwargs)
            b, t, _ = out.logits.shape
            out.logits = vocab.full_logits(out.logits.reshape(b * t, -1)).reshape(b, t, -1)
            return out

    TargetSpace.__name__ = TargetSpace.__qualname__ = base.__name__
    model.__class__ = TargetSpace
    model.config.vocab_size = vocab.target_vocab_size
    return model
