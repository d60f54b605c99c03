"""Confidence-based token fusion and token-tree construction (no gRPC here).

Token-level fusion (the CoSine paper's): at every draft step each selected drafter proposes its
top-n candidates with probabilities. A candidate's fused score is the routing-weighted sum of the
drafters' probabilities for it (weights normalised over the drafters that answered):

    score(x) = sum_d w_d * p_d(x) / sum_d w_d

The best-scoring candidate becomes the next node of the fused chain, and every selected drafter
appends it; the runners-up (distinct tokens) become sibling leaves of that node, up to
``width - 1`` of them. Depth of the tree = number of draft steps.

Chunk-level fusion (cheaper: one message per drafter per round): each drafter drafts a whole
chain greedily on its own and the chains are merged into a prefix tree; children of a node are
ordered by fused score and bounded by ``width``.

The tree is flattened as in the protocol: ``tokens[i]``, ``parents[i]`` (-1 = child of the last
committed token), parents before children.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from common.spec.types import TokenTree


@dataclass(frozen=True)
class Proposal:
    """One drafter's top-n candidates for one position, best first."""

    drafter_id: str
    token_ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclass(frozen=True)
class FusedCandidate:
    token: int
    score: float
    sources: frozenset[str]  # drafters that listed this token among their candidates
    top1: frozenset[str]  # drafters whose best candidate it was


def fuse(proposals: Sequence[Proposal], weights: Mapping[str, float]) -> list[FusedCandidate]:
    """Rank all candidates of one position by routing-weighted confidence, best first.

    Drafters with a non-positive or missing weight count with a small floor so that a new drafter
    still contributes. Ties are broken by the number of drafters proposing, then by token id, so
    fusion is deterministic.
    """
    floor = 1e-3
    total = sum(max(weights.get(p.drafter_id, 0.0), floor) for p in proposals)
    if not proposals or total <= 0:
        return []
    scores: dict[int, float] = {}
    sources: dict[int, set[str]] = {}
    top1: dict[int, set[str]] = {}
    for p in proposals:
        w = max(weights.get(p.drafter_id, 0.0), floor) / total
        for rank, (tok, prob) in enumerate(zip(p.token_ids, p.probs)):
            scores[tok] = scores.get(tok, 0.0) + w * float(prob)
            sources.setdefault(tok, set()).add(p.drafter_id)
            if rank == 0:
                top1.setdefault(tok, set()).add(p.drafter_id)
    ranked = sorted(scores, key=lambda t: (-scores[t], -len(sources[t]), t))
    return [FusedCandidate(t, scores[t], frozenset(sources[t]), frozenset(top1.get(t, ()))) for t in ranked]


@dataclass
class DraftTree:
    """A token tree under construction. ``drafter_ids`` indexes the bits of ``source_masks``."""

    drafter_ids: list[str]
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    source_masks: list[int] = field(default_factory=list)
    top1: list[frozenset[str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def to_token_tree(self) -> TokenTree:
        """The finished tree as the verifier's contract (:class:`~common.spec.types.TokenTree`)."""
        return TokenTree(
            tokens=tuple(self.tokens),
            parents=tuple(self.parents),
            draft_probs=tuple(self.probs),
            source_masks=tuple(self.source_masks),
            drafter_ids=tuple(self.drafter_ids),
        )

    def mask_of(self, drafters: frozenset[str] | set[str]) -> int:
        mask = 0
        for d in drafters:
            if d not in self.drafter_ids:
                self.drafter_ids.append(d)
            mask |= 1 << self.drafter_ids.index(d)
        return mask

    def add(self, parent: int, token: int, prob: float, sources: frozenset[str], top1: frozenset[str]) -> int:
        if parent >= len(self.tokens) or parent < -1:
            raise ValueError(f"parent {parent} out of range for a tree of {len(self.tokens)} nodes")
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.probs.append(float(prob))
        self.source_masks.append(self.mask_of(sources))
        self.top1.append(top1)
        return len(self.tokens) - 1

    def children(self, parent: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == parent]

    def depth(self, without: Collection[int] = ()) -> int:
        """Nodes on the longest root-to-leaf path (``without``: leaving out these nodes' subtrees)."""
        depths: list[int] = []
        for i, p in enumerate(self.parents):
            depths.append(0 if i in without or (p >= 0 and depths[p] == 0) else 1 if p < 0 else depths[p] + 1)
        return max(depths, default=0)

    def subtree(self, keep: Collection[int]) -> tuple[DraftTree, dict[int, int]]:
        """The tree with only the nodes in ``keep`` (each kept node's parent must be kept too), and
        where each kept node went (old index -> new index)."""
        out = DraftTree(drafter_ids=list(self.drafter_ids))
        index: dict[int, int] = {}
        for i, parent in enumerate(self.parents):
            if i in keep:
                index[i] = len(out.tokens)
                out.tokens.append(self.tokens[i])
                out.parents.append(-1 if parent < 0 else index[parent])
                out.probs.append(self.probs[i])
                out.source_masks.append(self.source_masks[i])
                out.top1.append(self.top1[i])
        return out, index

    def add_fused_step(self, parent: int, ranked: Sequence[FusedCandidate], width: int) -> int:
        """Add the winner of one fused step under ``parent`` and up to width-1 runners-up as
        sibling leaves. Returns the winner's node index (the parent of the next step)."""
        if not ranked:
            raise ValueError("nothing to fuse")
        best = ranked[0]
        node = self.add(parent, best.token, best.score, best.sources, best.top1)
        for cand in ranked[1 : max(1, width)]:
            self.add(parent, cand.token, cand.score, cand.sources, cand.top1)
        return node

    def add_chain(self, chain: Sequence[int], probs: Sequence[float], drafter_id: str, width: int) -> int:
        """Merge one drafter's greedy chain into the tree (prefix sharing). A shared node keeps the
        highest confidence any drafter gave it. Returns how many of the chain's tokens made it into
        the tree (a chain is cut where a node already has ``width`` children)."""
        parent = -1
        merged = 0
        for tok, prob in zip(chain, probs):
            existing = next((c for c in self.children(parent) if self.tokens[c] == tok), None)
            if existing is not None:
                self.probs[existing] = max(self.probs[existing], float(prob))
                self.source_masks[existing] |= self.mask_of({drafter_id})
                self.top1[existing] = self.top1[existing] | {drafter_id}
                parent = existing
            else:
                if len(self.children(parent)) >= width:
                    break
                parent = self.add(parent, tok, float(prob), frozenset({drafter_id}), frozenset({drafter_id}))
            merged += 1
        return merged

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def fuse_chains(
    chains: Mapping[str, tuple[Sequence[int], Sequence[float]]],
    weights: Mapping[str, float],
    width: int,
) -> DraftTree:
    """Chunk-level fusion: merge whole drafted chains into one tree, the most confident first.

    A chain's confidence is its drafter's weight times the product of its probabilities, so the
    fused (best) chain is always complete and comes first among the siblings.
    """

    def confidence(item: tuple[str, tuple[Sequence[int], Sequence[float]]]) -> float:
        drafter_id, (_, probs) = item
        c = max(weights.get(drafter_id, 0.0), 1e-3)
        for p in probs:
            c *= float(p)
        return c

    tree = DraftTree(drafter_ids=sorted(chains))
    for drafter_id, (chain, probs) in sorted(chains.items(), key=lambda it: (-confidence(it), it[0])):
        tree.add_chain(chain, probs, drafter_id, width)
    return tree


def credit(tree: DraftTree, accepted_nodes: Sequence[int]) -> dict[str, int]:
    """Accepted draft tokens per drafter: a drafter is credited for an accepted node when the
    node's token was its best candidate at that position."""
    out: dict[str, int] = {}
    for node in accepted_nodes:
        for d in tree.top1[node]:
            out[d] = out.get(d, 0) + 1
    return out
