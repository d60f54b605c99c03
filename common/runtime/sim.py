"""A minimal in-process speculative loop (no router, no gRPC), for tests and benchmarks.

Tree sources stand in for the router's drafting side: :class:`DrafterSource` drives a
:class:`~common.runtime.drafter_engine.DrafterEngine` exactly as the router does over the Draft stream
(truncate to the committed prefix, append the newly committed tokens, then ``depth`` steps that
each append the chosen token and ask for ``width`` candidates); :class:`RandomSource` proposes
random trees (almost surely all wrong); :class:`EmptySource` proposes nothing (plain decode).
:func:`speculative_generate` runs rounds until every request has ``max_new`` new tokens, with all
active requests verified together in one batch per round; :func:`plain_generate` is the target's
own decode through the same engine, the reference both are compared with.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Protocol

from common.runtime.drafter_engine import DrafterEngine
from common.runtime.verifier_engine import VerifierEngine
from common.spec.types import GREEDY, DraftItem, SamplingParams, TokenTree, VerifyItem


class TreeSource(Protocol):
    def trees(self, committed: Mapping[str, list[int]]) -> dict[str, TokenTree]:
        """Draft one tree per request from its committed sequence (one batch)."""
        ...

    def release(self, request_id: str) -> None: ...


class EmptySource:
    def trees(self, committed: Mapping[str, list[int]]) -> dict[str, TokenTree]:
        return {rid: TokenTree() for rid in committed}

    def release(self, request_id: str) -> None:
        pass


class RandomSource:
    """Random trees of ``size`` nodes (each node's parent uniformly among earlier nodes or the root)."""

    def __init__(self, vocab_size: int, size: int, seed: int = 0, chain: bool = False) -> None:
        self.vocab_size, self.size, self.chain = vocab_size, size, chain
        self.rng = random.Random(seed)

    def trees(self, committed: Mapping[str, list[int]]) -> dict[str, TokenTree]:
        out = {}
        for rid in committed:
            tokens = tuple(self.rng.randrange(self.vocab_size) for _ in range(self.size))
            if self.chain:
                out[rid] = TokenTree.chain(tokens)
            else:
                out[rid] = TokenTree(tokens, tuple(self.rng.randrange(-1, i) for i in range(self.size)))
        return out

    def release(self, request_id: str) -> None:
        pass


class DrafterSource:
    """Trees from a drafter engine: at each of ``depth`` levels the top ``width`` candidates become
    siblings and the best one is extended (a chain when ``width == 1``)."""

    def __init__(self, engine: DrafterEngine, depth: int, width: int = 1) -> None:
        self.engine, self.depth, self.width = engine, depth, width
        self.synced: dict[str, int] = {}  # committed tokens the drafter's cache agrees with

    def trees(self, committed: Mapping[str, list[int]]) -> dict[str, TokenTree]:
        tokens: dict[str, list[int]] = {rid: [] for rid in committed}
        parents: dict[str, list[int]] = {rid: [] for rid in committed}
        tip = {rid: -1 for rid in committed}
        items = []
        for rid, seq in committed.items():
            n = self.synced.get(rid, 0)
            items.append(DraftItem(rid, truncate_to=n, append_ids=tuple(seq[n:]), top_n=self.width))
            self.synced[rid] = len(seq)
        for level in range(self.depth):
            results = self.engine.run_step(items).results
            items = []
            for r in results:
                if not r.ok:
                    raise RuntimeError(f"drafter failed for {r.request_id}: {r.error}")
                first = len(tokens[r.request_id])
                for tok in r.token_ids:
                    tokens[r.request_id].append(tok)
                    parents[r.request_id].append(tip[r.request_id])
                tip[r.request_id] = first
                if level + 1 < self.depth:
                    items.append(DraftItem(r.request_id, append_ids=(r.token_ids[0],), top_n=self.width))
        return {rid: TokenTree(tuple(tokens[rid]), tuple(parents[rid])) for rid in committed}

    def release(self, request_id: str) -> None:
        self.synced.pop(request_id, None)
        self.engine.release(request_id)


def speculative_generate(
    verifier: VerifierEngine,
    prompts: Mapping[str, list[int]],
    sources: Mapping[str, TreeSource],
    max_new: int,
    sampling: SamplingParams | Mapping[str, SamplingParams] = GREEDY,
) -> dict[str, list[int]]:
    """Generate exactly ``max_new`` tokens per request (extra tokens of the last round are cut).

    ``sources[rid]`` drafts for request ``rid``; requests sharing a source are drafted in one batch.
    Returns the new tokens per request. Requests are released from the verifier and the sources at the end.
    """
    committed = {rid: list(p) for rid, p in prompts.items()}
    fresh = set(prompts)
    done: dict[str, list[int]] = {}
    while len(done) < len(prompts):
        active = [rid for rid in prompts if rid not in done]
        trees: dict[str, TokenTree] = {}
        by_source: dict[int, list[str]] = {}
        for rid in active:
            by_source.setdefault(id(sources[rid]), []).append(rid)
        for rids in by_source.values():
            trees.update(sources[rids[0]].trees({rid: committed[rid] for rid in rids}))
        items = []
        for rid in active:
            sp = sampling if isinstance(sampling, SamplingParams) else sampling[rid]
            append = tuple(prompts[rid]) if rid in fresh else ()
            items.append(VerifyItem(rid, append_ids=append, tree=trees[rid], sampling=sp))
        fresh.clear()
        for v in verifier.verify(items).verdicts:
            if not v.ok:
                raise RuntimeError(f"verify failed for {v.request_id}: {v.error}")
            committed[v.request_id] += v.new_tokens
            if v.committed_len != len(committed[v.request_id]):
                raise RuntimeError(f"{v.request_id}: committed_len {v.committed_len} != {len(committed[v.request_id])}")
            if len(committed[v.request_id]) - len(prompts[v.request_id]) >= max_new:
                done[v.request_id] = committed[v.request_id][len(prompts[v.request_id]) :][:max_new]
                verifier.release(v.request_id)
                sources[v.request_id].release(v.request_id)
    return done


def plain_generate(
    verifier: VerifierEngine,
    prompts: Mapping[str, Sequence[int]],
    max_new: int,
    eos: int | None = None,
    concurrency: int | None = None,
) -> tuple[dict[str, list[int]], int]:
    """The target's own greedy decode: plain steps (empty trees) through ``verifier``, up to
    ``max_new`` new tokens per request, through ``eos`` when it comes.

    ``concurrency`` requests are in flight (default: all); a finished request's place goes to the
    next one at the next step (continuous batching). Returns the new tokens per request and the
    passes it took; every request is released from the verifier at the end.
    """
    queue = list(prompts)
    limit = len(queue) if concurrency is None else concurrency
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    active: list[str] = []
    fresh: set[str] = set()
    passes = 0
    while queue or active:
        while queue and len(active) < limit:
            rid = queue.pop(0)
            active.append(rid)
            fresh.add(rid)
        items = [VerifyItem(r, append_ids=tuple(prompts[r]) if r in fresh else (), tree=TokenTree()) for r in active]
        fresh.clear()
        for v in verifier.verify(items).verdicts:
            out[v.request_id] += v.new_tokens
        passes += 1
        for rid in [r for r in active if len(out[r]) >= max_new or (eos is not None and eos in out[r])]:
            active.remove(rid)
            verifier.release(rid)
    for rid, tokens in out.items():
        tokens = tokens[:max_new]
        out[rid] = tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens
    return out, passes
