"""The verifier engine's per-request state (:class:`RequestState`) and a batch item ready for its
pass (:class:`Planned`), shared by ``verifier_engine.py`` and ``plain_steps.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.runtime.kv_cache import KVCache
from common.spec.grammar import Constrained, GrammarState
from common.spec.lookup_index import LookupIndex
from common.spec.types import TokenTree, VerifyItem


@dataclass
class RequestState:
    """One request's committed sequence, cache (all committed tokens but the last) and generator."""

    request_id: str
    tokens: list[int]
    cache: KVCache
    generator: torch.Generator | None = None
    verdicts: int = field(default=0)
    lookup: LookupIndex | None = None  # the n-grams its plain steps draft from (VerifyItem.step_lookup)
    prompt_len: int = 0  # where its output begins in ``tokens`` (the penalties count from there)
    grammar: GrammarState | None = None  # its constraint's matcher (SamplingParams.constraint), if any


@dataclass
class Planned:
    """A verify item that passed validation, with its request's state and the uncached tokens its pass feeds."""

    index: int
    state: RequestState
    item: VerifyItem
    uncached: list[int]
    new: bool
    constrained: Constrained | None = None  # the tree as the request's grammar cut it, with its masks

    @property
    def tree(self) -> TokenTree:
        """The tree the pass verifies: the item's, less the nodes its grammar forbids."""
        return self.item.tree if self.constrained is None else self.constrained.tree
