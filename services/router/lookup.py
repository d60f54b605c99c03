"""Lookup drafting: free draft tokens from a request's own text (no model, no gRPC).

Text repeats itself: records repeat their field names, code its identifiers, and a small target's
greedy continuation often loops. The lookup drafter finds the longest suffix of a request's
committed sequence (at most ``max_ngram`` tokens) that occurred earlier in it and proposes the
tokens that followed that occurrence (continuing through the proposal itself when the occurrence
runs into the suffix, so a loop of period ``p`` is proposed as a loop; the index is
``common/spec/lookup_index.py``, which the verifier drafts from too, during a round's plain steps).

It costs no drafter time, only verify rows, so its nodes are priced by their verify rows alone
(:meth:`~services.router.control.SpeculationControl.threshold`): a request whose model drafting does
not pay this round still gets the lookup nodes that do. Its proposals join the round's tree as one
more chain beside the drafters' (a node both propose is shared), and the verifier treats them like
any draft: a deterministic proposal, so acceptance stays the target's own (lossless). A second
chain may come from the lookup corpus, what the target wrote for other prompts
(``common/spec/lookup_corpus.py``); the two are siblings where they differ.

How likely a lookup token is accepted depends on how long the match was and how deep the token
is (a token after an accepted lookup token is far likelier right). :class:`LookupCalibration` learns
that online from every verdict, per (greedy or sampling, match length, depth), from Beta priors.
Measured on the default zoo's prompts (greedy, 40 new tokens): a first token after a 1-token match
is right a third of the time, after a 4-token match 95% of the time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from common.spec.fusion import DraftTree
from common.spec.lookup_index import CORPUS, TEXT

LOOKUP_ID = "lookup"  # the drafter id lookup nodes are credited to (in stats, metrics and trees)
CORPUS_MAX_MATCH = 8  # longest corpus match the calibration tells apart


@dataclass
class LookupCalibration:
    """P(a lookup token is accepted | its parent was), per (source, greedy, match length, depth), online.

    A match in the request's own text (``TEXT``) and one in the lookup corpus (``CORPUS``) are told
    apart: the same match length predicts less in other text."""

    max_ngram: int = 4
    max_depth: int = 3  # depths from here on share one estimate
    prior_weight: float = 4.0
    _counts: dict[tuple[str, bool, int, int], list[float]] = field(default_factory=dict)

    def _key(self, source: str, greedy: bool, n: int, depth: int) -> tuple[str, bool, int, int]:
        longest = CORPUS_MAX_MATCH if source == CORPUS else self.max_ngram
        return source, greedy, max(1, min(n, longest)), min(depth, self.max_depth)

    @staticmethod
    def prior(n: int, depth: int, source: str = TEXT) -> float:
        """Before any verdict: a first token is as good as its match is long; one after an accepted
        lookup token is likely right (the text is repeating). A corpus match needs to be longer."""
        if source == CORPUS:
            return 0.6 if depth > 0 else min(0.2 + 0.06 * n, 0.6)
        if depth > 0:
            return 0.7
        return {1: 0.3, 2: 0.4}.get(n, 0.6)

    def _entry(self, key: tuple[str, bool, int, int]) -> list[float]:
        entry = self._counts.get(key)
        if entry is None:
            p = self.prior(key[2], key[3], key[0])
            entry = self._counts[key] = [p * self.prior_weight, self.prior_weight]
        return entry

    def __call__(self, greedy: bool, n: int, depth: int, source: str = TEXT) -> float:
        accepted, seen = self._entry(self._key(source, greedy, n, depth))
        return accepted / seen

    def observe(self, greedy: bool, n: int, depth: int, accepted: bool, source: str = TEXT) -> None:
        entry = self._entry(self._key(source, greedy, n, depth))
        entry[0] += 1.0 if accepted else 0.0
        entry[1] += 1.0

    def observe_chain(self, greedy: bool, n: int, tried: int, accepted: int, source: str = TEXT) -> None:
        """One chain's outcome: its first ``tried`` tokens were tried (each after its parent was
        accepted), the first ``accepted`` of them accepted; one observation per tried depth."""
        for depth in range(tried):
            self.observe(greedy, n, depth, depth < accepted, source)


@dataclass(frozen=True)
class LookupNodes:
    """The nodes of one tree that the lookup chain proposed (``nodes[j]`` at depth ``j``)."""

    greedy: bool
    match: int
    nodes: tuple[int, ...] = ()
    rates: tuple[float, ...] = ()  # each node's calibrated acceptance rate when it was proposed
    source: str = TEXT

    def cut(self, kept: Sequence[int]) -> LookupNodes:
        """The same chain with its nodes renumbered to ``kept`` (a prefix of the path)."""
        return replace(self, nodes=tuple(kept), rates=self.rates[: len(kept)])


def add_lookup_chain(
    tree: DraftTree,
    chain: Sequence[int],
    match: int,
    greedy: bool,
    calibration: LookupCalibration,
    threshold: float,
    width: int,
    source: str = TEXT,
) -> LookupNodes:
    """Merge a lookup chain into ``tree`` while each node's expected tokens (the product of the
    calibrated rates along its path) repay a verify row (``threshold``). A node the drafters
    proposed too is shared (and credited to both); a new one becomes a sibling, so a level may hold
    one node more than ``width``."""
    parent, value, nodes, rates = -1, 1.0, [], []
    for depth, token in enumerate(chain):
        rate = calibration(greedy, match, depth, source)
        value *= rate
        if value < threshold:
            break
        siblings = tree.children(parent)
        node = next((c for c in siblings if tree.tokens[c] == token), None)
        if node is None:
            if len(siblings) > width:
                break
            node = tree.add(parent, token, rate, frozenset({LOOKUP_ID}), frozenset({LOOKUP_ID}))
        else:
            tree.source_masks[node] |= tree.mask_of({LOOKUP_ID})
            tree.top1[node] = tree.top1[node] | {LOOKUP_ID}
        nodes.append(node)
        rates.append(rate)
        parent = node
    return LookupNodes(greedy, match, tuple(nodes), tuple(rates), source)


def observe_lookup(
    calibration: LookupCalibration, tree: DraftTree, lookup: LookupNodes, accepted_nodes: Sequence[int]
) -> int:
    """Calibrate from one verdict: each lookup node whose parent was accepted was tried. Returns
    how many lookup nodes were accepted."""
    accepted = set(accepted_nodes)
    tried = got = 0
    for node in lookup.nodes:
        parent = tree.parents[node]
        if parent >= 0 and parent not in accepted:
            break
        tried += 1
        if node not in accepted:
            break
        got += 1
    calibration.observe_chain(lookup.greedy, lookup.match, tried, got, lookup.source)
    return got


def lookup_only(tree: DraftTree, lookups: Sequence[LookupNodes]) -> frozenset[int]:
    """The nodes of ``tree`` that only the lookup drafter proposed (no drafter model shares them)."""
    nodes = [n for lookup in lookups for n in lookup.nodes]
    if not nodes:
        return frozenset()
    bit = 1 << tree.drafter_ids.index(LOOKUP_ID)
    return frozenset(n for n in nodes if tree.source_masks[n] == bit)
