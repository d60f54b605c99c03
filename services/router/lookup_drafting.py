"""The lookup drafter's part of a round: its chains in each request's tree (no model, no gRPC).

Two sources (see ``lookup.py`` and ``common/spec/lookup_corpus.py``): the request's own text, and the lookup
corpus once loaded from Redis (and reloaded whenever it is seeded anew). Each chain's nodes are
priced by their verify rows alone, since the lookup drafter costs no drafter time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from common.spec.fusion import DraftTree
from common.spec.lookup_corpus import DomainCorpora
from services.corpus import CorpusLoader, keep_corpus_loaded
from services.router.control import SpeculationControl
from services.router.gate import gate_domain
from services.router.lookup import (
    CORPUS,
    CORPUS_MAX_MATCH,
    TEXT,
    LookupCalibration,
    LookupNodes,
    add_lookup_chain,
    lookup_only,
)
from services.router.requests import Counters, Request
from services.router.settings import RouterSettings


class LookupDrafting:
    def __init__(
        self,
        config: RouterSettings,
        control: SpeculationControl,
        counters: Counters,
        load_corpus: CorpusLoader | None = None,
    ):
        self.config = config
        self.control = control
        self.counters = counters
        self.calibration = LookupCalibration(max_ngram=config.lookup_max_ngram)
        self.corpus: DomainCorpora | None = None  # the lookup corpus, once loaded
        self.load_corpus = load_corpus if config.lookup_drafts and config.lookup_corpus else None

    async def keep_corpus_loaded(self, closed: Callable[[], bool], every_s: float = 2.0) -> None:
        """Load the lookup corpus, and again whenever it is seeded anew, until ``closed()``."""
        assert self.load_corpus is not None

        def use(corpora: DomainCorpora | None) -> None:
            self.corpus = corpora
            self.counters.corpus_sequences = corpora.sequences if corpora is not None else 0

        await keep_corpus_loaded(self.load_corpus, use, closed, every_s)

    def chains(self, r: Request, tree: DraftTree) -> tuple[LookupNodes, ...]:
        """Add the lookup chains of ``r`` to its tree (own text, then the corpus); the ones that kept
        at least one node."""
        k = min(self.config.max_k, r.max_new_tokens - len(r.generated) - 1)
        proposals = [(TEXT, *r.lookup.propose(r.sequence, k))]
        if self.corpus is not None:
            proposals.append((CORPUS, *self.corpus.propose(gate_domain(r), r.sequence, k)))
        theta = self.control.threshold() if self.config.cost_control else 0.0
        width = self.config.tree_width if self.config.fusion == "token" else max(1, self.config.drafters_per_request)
        added = (
            add_lookup_chain(tree, chain, match, r.sampling.greedy, self.calibration, theta, width, source)
            for source, chain, match in proposals
            if chain
        )
        return tuple(c for c in added if c.nodes)

    @property
    def drafts_at_steps(self) -> bool:
        """The verifier drafts at plain steps as the lookup drafter would (``VerifyItem.step_lookup``)."""
        return self.config.step_lookup and self.config.lookup_drafts and self.config.speculate

    def forfeits_steps(
        self, batch: Sequence[Request], trees: Mapping[str, DraftTree], lookups: Mapping[str, Sequence[LookupNodes]]
    ) -> bool:
        """Whether the batch's trees keep the round from plain steps (``scheduler.plain_steps``): any
        node at all, or, while the verifier drafts at plain steps as the lookup drafter would, any
        node a drafter model proposed (a round of lookup nodes alone goes on in steps that draft the same way)."""
        if not self.drafts_at_steps:
            return any(len(trees[r.request_id]) for r in batch)
        return any(
            len(trees[r.request_id]) > len(lookup_only(trees[r.request_id], lookups.get(r.request_id, ())))
            for r in batch
        )

    def at_steps(self, batch: Sequence[Request]) -> dict[bool, tuple[tuple[int, ...], tuple[int, ...]]]:
        """How far the verifier may draft at each request's plain steps, from its own text and from
        the corpus, by greedy or sampled (:meth:`step_depths`): nothing unless it drafts at steps;
        with cost control, each token must repay its row beside the request's plain one, priced at
        its depth (``SpeculationControl.first_row_threshold``: a request's first draft row is dearer
        than its later ones)."""
        if not self.drafts_at_steps:
            return {}
        depths = range(self.config.max_k)
        prices = tuple(
            self.control.first_row_threshold(len(batch), d) if self.config.cost_control else 0.0 for d in depths
        )
        return {greedy: self.step_depths(greedy, prices) for greedy in {r.sampling.greedy for r in batch}}

    def step_depths(self, greedy: bool, prices: Sequence[float]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """How far the verifier drafts at a plain step (``VerifyItem.step_lookup`` and
        ``step_corpus``): per match length in the request's own text and in the corpus (none
        while the router has no corpus: the verifier reads the same one), as many tokens as the
        calibrated chain repays their verify rows (``prices[depth]`` expected tokens each, the last
        price for any deeper), as :func:`~services.router.lookup.add_lookup_chain` prices the router's own chains."""
        text = self._depths(greedy, prices, TEXT, self.config.lookup_max_ngram)
        corpus = self._depths(greedy, prices, CORPUS, CORPUS_MAX_MATCH) if self.corpus is not None else ()
        return text, corpus

    def _depths(self, greedy: bool, prices: Sequence[float], source: str, longest: int) -> tuple[int, ...]:
        depths = []
        for match in range(1, longest + 1):
            value, depth = 1.0, 0
            while depth < self.config.max_k:
                value *= self.calibration(greedy, match, depth, source)
                if value < prices[min(depth, len(prices) - 1)]:
                    break
                depth += 1
            depths.append(depth)
        return tuple(depths)
