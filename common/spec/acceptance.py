"""Acceptance rules: how the verifier decides which draft nodes the target agrees with.

A rule sees one request's token tree and the target's logits for it and returns the accepted
path and the next token. It is chosen per request from the request's :class:`SamplingParams` by
a rule factory injected into the engine (:func:`default_rule_factory`), so the engine itself has
no greedy/sampling branches.

``logits`` layout, shared by every rule: ``[n + 1, vocab]`` where row 0 is the target's
distribution for the tree's roots (the position after the last committed token) and row
``1 + i`` is the distribution for the children of node ``i``.

Both rules are lossless:

- greedy: the committed sequence is exactly the target's argmax continuation, because a node is
  kept only when it equals the argmax at its parent, and the next token is the argmax where the
  walk stopped.
- sampling: drafts are deterministic proposals (q = a point mass), so speculative sampling's
  accept probability ``min(1, p(x) / q(x))`` is ``p(x)`` and its residual ``norm(max(p - q, 0))`` is
  ``p`` with ``x`` zeroed. Trying the siblings in order against the successively zeroed and
  renormalised ``p`` (SpecInfer's multi-step rule) yields exactly ``p``:
  P(out = y) = p(y) for a tried-and-accepted ``y`` and the residual mass for the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from common.spec.types import SamplingParams, TokenTree


@dataclass(frozen=True)
class Decision:
    """Accepted node indices (root first) and the target's next token after them."""

    accepted_nodes: tuple[int, ...]
    next_token: int


class AcceptanceRule(Protocol):
    def decide(self, tree: TokenTree, logits: torch.Tensor, generator: torch.Generator | None) -> Decision:
        """``logits: [len(tree) + 1, vocab]`` (see the module docstring)."""
        ...


RuleFactory = Callable[[SamplingParams], AcceptanceRule]


class GreedyRule:
    """Walk the tree following the child equal to the target's argmax; stop where none matches."""

    def decide(self, tree: TokenTree, logits: torch.Tensor, generator: torch.Generator | None = None) -> Decision:
        argmax = logits.argmax(dim=-1).tolist()  # [n + 1]
        children = tree.children
        accepted: list[int] = []
        node = -1
        while True:
            target = argmax[node + 1]  # row 0 for the roots, row 1 + i below node i
            match = next((c for c in children[node] if tree.tokens[c] == target), None)
            if match is None:
                return Decision(tuple(accepted), target)  # correction (or bonus at a leaf)
            accepted.append(match)
            node = match


NUCLEUS_TRIES = (64, 1024)  # top-p: candidate counts taken with topk before a full sort


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution for one position: temperature, then top-k, then top-p.

    ``logits: [vocab]`` -> float64 probabilities ``[vocab]`` on the CPU. Top-p keeps the smallest
    prefix of the sorted distribution whose mass reaches ``top_p`` (at least one token).
    """
    x = logits.detach().to("cpu", torch.float64)
    # shift first (softmax does not change): the best logit is 0 and stays 0 at any temperature, so
    # a tiny one (even subnormal) gives -inf to the others, never inf - inf = NaN
    x = (x - x.max()) / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if 0.0 < params.top_p < 1.0:
        p = nucleus(p, params.top_p)
    return p


def nucleus(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """``p`` (1-D) cut to its smallest most-probable prefix whose mass reaches ``top_p``, renormalised.

    The prefix is found among the ``NUCLEUS_TRIES`` most probable tokens (``topk``, sorted) when
    their mass reaches ``top_p`` before the last of them, and by sorting the whole vocabulary only
    otherwise: an LM's nucleus is usually a few dozen tokens, and sorting SmolLM2's 49k
    probabilities at every sampled position cost about as much as the forward pass spends on a request row.
    """
    vocab = p.shape[-1]
    for k in (*(n for n in NUCLEUS_TRIES if n < vocab), vocab):
        top, order = torch.topk(p, k) if k < vocab else torch.sort(p, descending=True)
        mass_before = torch.cumsum(top, dim=-1) - top
        if k == vocab or bool(mass_before[-1] >= top_p):  # every token past the prefix is in here
            break
    keep = max(1, int((mass_before < top_p).sum()))
    out = torch.zeros_like(p)
    out[order[:keep]] = top[:keep]
    return out / out.sum()


def sample_index(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw index ``i`` with probability ``weights[i] / weights.sum()`` (1-D, non-negative, some > 0).

    Inverse CDF: one uniform against the running sum. ``torch.multinomial`` draws an exponential for
    every entry of the vocabulary instead, which is slow for SmolLM2's 49k tokens; this is a
    cumulative sum and a binary search. A zero weight is never drawn: its running
    sum equals its predecessor's, which the search has already passed.
    """
    cdf = torch.cumsum(weights, dim=-1)
    u = torch.rand((1,), generator=generator, dtype=cdf.dtype) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    if i >= cdf.shape[-1]:  # u rounded up to the total: the last index with weight
        i = int(torch.nonzero(weights)[-1])
    return i


class SamplingRule:
    """Speculative sampling with deterministic drafts over a tree (see the module docstring)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params

    def decide(self, tree: TokenTree, logits: torch.Tensor, generator: torch.Generator | None) -> Decision:
        children = tree.children
        accepted: list[int] = []
        node = -1
        while True:
            p = target_probs(logits[node + 1], self.params)
            chosen = None
            for c in children[node]:
                x = tree.tokens[c]
                mass = float(p.sum())
                px = float(p[x]) / mass if mass > 0 else 0.0
                # accept x with probability p(x) under the renormalised residual ...
                if px > 0.0 and float(torch.rand((), generator=generator, dtype=torch.float64)) < px:
                    chosen = c
                    break
                # ... otherwise remove it: the residual is p with x zeroed
                p[x] = 0.0
            if chosen is None:
                if float(p.sum()) <= 0.0:  # only reachable through rounding: every token was tried
                    p = target_probs(logits[node + 1], self.params)
                return Decision(tuple(accepted), sample_index(p, generator))
            accepted.append(chosen)
            node = chosen


def default_rule_factory(params: SamplingParams) -> AcceptanceRule:
    """Greedy at temperature 0, speculative sampling otherwise."""
    return GreedyRule() if params.greedy else SamplingRule(params)
