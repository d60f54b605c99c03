"""The reference of the structured-output tests: the target alone (transformers) under
llguidance's matcher driven directly, step by step, with none of the verifier's tree logic."""

from __future__ import annotations

from typing import Any

import llguidance.hf
import numpy as np
import torch
from llguidance import LLMatcher

from common.spec.grammar import grammar_text
from common.spec.types import Constraint


class Reference:
    """The target alone under llguidance's matcher: masked logits and constrained greedy decoding."""

    def __init__(self, hf: Any, tok: Any, constraint: Constraint) -> None:
        self.hf, self.eos = hf, tok.eos_token_id
        self.vocab = hf.config.vocab_size
        self.lltok = llguidance.hf.from_tokenizer(tok, n_vocab=self.vocab)
        self.text = grammar_text(constraint)

    def allowed(self, output: list[int]) -> torch.Tensor:
        m = LLMatcher(self.lltok, self.text, log_level=0)
        assert m.consume_tokens(output) or not output
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[: self.vocab]
        return torch.from_numpy(bits.astype(bool))

    def logits(self, prompt, output: list[int], masked: bool = True) -> torch.Tensor:
        with torch.no_grad():
            row = self.hf(torch.tensor([[*prompt, *output]])).logits[0, -1].float()
        return row.masked_fill(~self.allowed(output), float("-inf")) if masked else row

    def greedy(self, prompt, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n and (not out or out[-1] != self.eos):
            out.append(int(self.logits(prompt, out).argmax()))
        return out

    def forbidden(self, output: list[int]) -> int:
        """A token the grammar forbids after ``output``."""
        return int((~self.allowed(output)).nonzero()[0])

    def wrong(self, prompt, output: list[int]) -> int | None:
        """A token the grammar allows after ``output`` that the constrained target does not pick
        (None where the grammar allows one token only)."""
        logits = self.logits(prompt, output)
        ok = torch.isfinite(logits).nonzero().flatten().tolist()
        best = int(logits.argmax())
        return next((t for t in ok if t != best), None)
