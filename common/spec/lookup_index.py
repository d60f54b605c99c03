"""The n-gram index behind lookup drafting: what followed the longest earlier occurrence of a
sequence's suffix. The router drafts from it between rounds (``services.router.lookup``); the
verifier drafts from it during a round's plain steps (``VerifyItem.step_lookup``), with no round
trip between the steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# where a lookup chain came from: the request's own text (this index), or the lookup corpus
# (common/spec/lookup_corpus.py); the router's calibration and the verifier's step verdicts name them so
TEXT, CORPUS = "text", "corpus"


@dataclass
class LookupIndex:
    """The latest end of every n-gram (n <= ``max_ngram``) of one request's committed sequence.

    Built incrementally: the sequence only grows, so each round indexes only its new tokens."""

    max_ngram: int = 4
    _last: dict[tuple[int, ...], int] = field(default_factory=dict)
    _indexed: int = 0  # n-grams ending at positions < _indexed are in the index

    def propose(self, sequence: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the longest earlier occurrence of the sequence's suffix,
        and the length of the match (0 and no tokens when no suffix occurred before)."""
        length = len(sequence)
        if k <= 0 or length < 2:
            return [], 0
        for end in range(max(self._indexed, 1), length):  # every end before the suffix's own
            for n in range(1, min(self.max_ngram, end) + 1):
                self._last[tuple(sequence[end - n : end])] = end
        self._indexed = max(self._indexed, length)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            start = self._last.get(tuple(sequence[length - n :]))
            if start is None:
                continue
            out: list[int] = []
            for j in range(k):  # past the end of the sequence, the proposal continues itself
                i = start + j
                out.append(sequence[i] if i < length else out[i - length])
            return out, n
        return [], 0
