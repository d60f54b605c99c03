"""The lookup chains of a plain step: what the verifier drafts from a request's own text (and
the lookup corpus) when the router sent no tree, and what each chain then did.

A chain's depth is earned by its match length (``depths[match - 1]``); a token of a chain was
*tried* when every token before it was accepted, and *accepted* when the accepted path went through
it (:class:`~common.spec.types.StepLookup`, which calibrates the router's lookup rates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.spec.types import StepLookup, TokenTree


@dataclass(frozen=True)
class StepChain:
    """One lookup chain of a plain step's tree: its source, its match length and its tokens in the tree."""

    source: str
    match: int
    tokens: list[int]


def earned_chain(proposal: tuple[list[int], int], depths: Sequence[int]) -> tuple[int, list[int]]:
    """(match length, a lookup proposal cut to the depth that length earns: ``depths[match - 1]``)."""
    chain, match = proposal
    return match, (chain[: depths[min(match, len(depths)) - 1]] if match else [])


def held_depth(tree: TokenTree, chain: Sequence[int]) -> int:
    """How many of ``chain``'s first tokens are a path of ``tree`` from its roots."""
    children = tree.children
    node, held = -1, 0
    for token in chain:
        node = next((c for c in children[node] if tree.tokens[c] == token), None)
        if node is None:
            break
        held += 1
    return held


def chain_outcomes(chains: Sequence[StepChain], accepted: Sequence[int]) -> tuple[StepLookup, ...]:
    """What each chain of a step did (``Verdict.step_lookups``): a token was tried when every one
    before it in the chain was accepted, and accepted when the accepted path went through it."""
    out = []
    for c in chains:
        if not c.tokens:
            continue
        hits = 0
        while hits < min(len(c.tokens), len(accepted)) and c.tokens[hits] == accepted[hits]:
            hits += 1
        out.append(StepLookup(c.source, c.match, min(len(c.tokens), hits + 1), hits))
    return tuple(out)
