"""The lookup drafter's part of a round: its chains in each request's tree (no model, no gRPC).

Two sources (see ``lookup.py`` and ``lookup_corpus.py``): the request's own text, and the lookup
corpus once loaded from Redis (and reloaded whenever it is seeded anew). Each chain's nodes are
priced by their verify rows alone, since the lookup drafter costs no drafter time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from common.fusion import DraftTree
from services.router.control import SpeculationControl
from services.router.gate import gate_domain
from services.router.lookup import CORPUS, TEXT, LookupCalibration, LookupNodes, add_lookup_chain
from services.router.lookup_corpus import DomainCorpora
from services.router.requests import Counters, Request, RouterConfig

# load_corpus(known_version): the corpus and its version when the seeded version differs, else None
CorpusLoader = Callable[[int], Awaitable[tuple[int, DomainCorpora | None] | None]]


class LookupDrafting:
    def __init__(self, config: RouterConfig, control: SpeculationControl, counters: Counters,
                 load_corpus: CorpusLoader | None = None):
        self.config = config
        self.control = control
        self.counters = counters
        self.calibration = LookupCalibration(max_ngram=config.lookup_max_ngram)
        self.corpus: DomainCorpora | None = None  # the lookup corpus, once loaded
        self.load_corpus = load_corpus if config.lookup and config.lookup_corpus else None

    async def keep_corpus_loaded(self, closed: Callable[[], bool], every_s: float = 2.0) -> None:
        """Load the lookup corpus, and again whenever it is seeded anew, until ``closed()``."""
        assert self.load_corpus is not None
        version = 0
        while not closed():
            got = await self.load_corpus(version)
            if got is not None:
                version, self.corpus = got
                self.counters.corpus_sequences = self.corpus.sequences if self.corpus is not None else 0
            await asyncio.sleep(every_s)

    def chains(self, r: Request, tree: DraftTree) -> tuple[LookupNodes, ...]:
        """Add the lookup chains of ``r`` to its tree (own text, then the corpus); the ones that kept
        at least one node."""
        k = min(self.config.max_k, r.max_new_tokens - len(r.generated) - 1)
        proposals = [(TEXT, *r.lookup.propose(r.sequence, k))]
        if self.corpus is not None:
            proposals.append((CORPUS, *self.corpus.propose(gate_domain(r), r.sequence, k)))
        theta = self.control.threshold() if self.config.cost_control else 0.0
        width = self.config.tree_width if self.config.fusion == "token" else max(1, self.config.drafters_per_request)
        added = (add_lookup_chain(tree, chain, match, r.sampling.greedy, self.calibration, theta, width, source)
                 for source, chain, match in proposals if chain)
        return tuple(c for c in added if c.nodes)

    def step_depths(self, greedy: bool, threshold: float) -> tuple[int, ...]:
        """How far the verifier drafts from a request's text at a plain step (``VerifyItem.step_lookup``):
        per match length, as many tokens as the calibrated chain repays a verify row each
        (``threshold`` expected tokens), as :func:`~services.router.lookup.add_lookup_chain` prices
        the router's own chains."""
        depths = []
        for match in range(1, self.config.lookup_max_ngram + 1):
            value, depth = 1.0, 0
            while depth < self.config.max_k:
                value *= self.calibration(greedy, match, depth, TEXT)
                if value < threshold:
                    break
                depth += 1
            depths.append(depth)
        return tuple(depths)
