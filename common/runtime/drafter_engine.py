"""Drafter engine: one small causal LM proposing next-token candidates for many requests.

Per request the engine keeps the token ids it has been given, their KV cache (the cache holds
**every** token of the request, ``cache_len == len(tokens)``) and the next-token distribution at
the end of the cache (softmax of the logits at temperature 1), so a step that appends nothing can
still answer with candidates.

:meth:`DrafterEngine.run_step` is the batched primitive the service uses: for every item
truncate -> append -> top-n, with the appends of all items run as **one** batched forward pass
(requests of different lengths and different append counts together). The issue-level operations
(:meth:`prefill`, :meth:`step`, :meth:`append`, :meth:`rollback`, :meth:`release`) are thin
wrappers around it that raise instead of returning per-item errors.

Rollback (``truncate_to``) only moves the cache length: the committed prefix is never recomputed.
When a rollback leaves no stored distribution for the new end and candidates are wanted without
an append, the last kept token alone is re-run (one token, not the prefix).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from common.logs import get_logger
from common.runtime.engine_base import RequestEngine
from common.runtime.kv_cache import KVCache
from common.runtime.runner import LMRunner, SeqInput
from common.spec.types import (
    ContextTooLong,
    DraftItem,
    DraftOutcome,
    DraftResult,
    InvalidInput,
    SpecError,
    StageTimings,
    UnknownRequest,
)

log = get_logger(__name__)


@dataclass
class DraftState:
    """One request: its tokens, their cache, and the distribution after the last one (``[vocab]``)."""

    request_id: str
    tokens: list[int]
    cache: KVCache
    next_probs: torch.Tensor | None = None


@dataclass
class _Planned:
    index: int
    item: DraftItem
    state: DraftState
    feed: list[int]  # tokens to run through the model in this step
    new: bool


class DrafterEngine(RequestEngine[DraftState]):
    """A drafter model plus per-request caches. Not thread-safe: call from one worker."""

    def __init__(
        self,
        runner: LMRunner,
        *,
        kv_token_budget: int | None = None,
        domains: Sequence[str] = (),
        max_top_n: int | None = None,
        max_chain_len: int | None = None,
    ) -> None:
        super().__init__(runner, kv_token_budget, "drafter")
        self.domains = tuple(domains)
        self.max_top_n = max_top_n  # most candidates one item may ask for
        self.max_chain_len = max_chain_len  # most positions one item may draft on its own (chunk drafting)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        attention_backend: str = "auto",
        kv_cache: str = "auto",  # paged, contiguous or auto (common.runtime.kv_arena.select_kv_cache)
        cuda_graphs: bool = True,  # on CUDA with the paged arena (common.runtime.cuda_graphs)
        kv_token_budget: int | None = None,
        domains: Sequence[str] = (),
        max_top_n: int | None = None,
        max_chain_len: int | None = None,
    ) -> DrafterEngine:
        runner = LMRunner.from_checkpoint(
            path, dtype=dtype, device=device, backend=attention_backend, kv_cache=kv_cache, cuda_graphs=cuda_graphs
        )
        return cls(
            runner, kv_token_budget=kv_token_budget, domains=domains, max_top_n=max_top_n, max_chain_len=max_chain_len
        )

    # ---- introspection -----------------------------------------------------------------------

    def tokens(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._state(request_id).tokens)

    # ---- issue-level operations (raise on failure) ---------------------------------------------

    def prefill(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Start (or extend) a request with its prompt; returns the cache length."""
        return self._one(DraftItem(request_id, append_ids=tuple(token_ids))).cache_len

    def step(self, request_ids: Sequence[str], top_n: int) -> list[DraftResult]:
        """Top-``top_n`` candidates for the next position of every request, from one batched pass."""
        return self._many([DraftItem(r, top_n=top_n) for r in request_ids])

    def append(self, request_id: str, tokens: Sequence[int]) -> int:
        """Append tokens (the fused token, or committed tokens after a verdict); returns the cache length."""
        return self._one(DraftItem(request_id, append_ids=tuple(tokens))).cache_len

    def rollback(self, request_id: str, committed_len: int) -> int:
        """Truncate the cache to its first ``committed_len`` tokens (no recomputation)."""
        return self._one(DraftItem(request_id, truncate_to=committed_len)).cache_len

    def _one(self, item: DraftItem) -> DraftResult:
        return self._many([item])[0]

    def _many(self, items: Sequence[DraftItem]) -> list[DraftResult]:
        results, errors, _timings, _tokens = self._run(items)
        for e in errors:
            if e is not None:
                raise e
        return list(results)

    # ---- the batched primitive ---------------------------------------------------------------

    def run_step(self, items: Sequence[DraftItem]) -> DraftOutcome:
        """truncate -> append -> top-n for every item, the appends in one batched forward pass.

        A failing item gets ``error`` set and leaves its request unchanged; the others still run.
        """
        t0 = time.perf_counter_ns()
        results, _errors, timings, batch_tokens = self._run(items)
        return DraftOutcome(
            results=tuple(results),
            batch_tokens=batch_tokens,
            timings=StageTimings(*timings, total_ns=time.perf_counter_ns() - t0),
        )

    def _run(
        self, items: Sequence[DraftItem]
    ) -> tuple[list[DraftResult], list[SpecError | None], tuple[int, int, int], int]:
        """Results and the exception of each failed item (None otherwise), the stage times
        ``(prefill_ns, forward_ns, decode_ns)`` and the number of tokens run through the model."""
        t0 = time.perf_counter_ns()
        results: list[DraftResult | None] = [None] * len(items)
        errors: list[SpecError | None] = [None] * len(items)
        planned: list[_Planned] = []
        seen: set[str] = set()
        for i, item in enumerate(items):
            try:
                if item.request_id in seen:
                    raise InvalidInput(f"request_id: request {item.request_id!r} appears twice in one draft step")
                seen.add(item.request_id)
                if item.release:
                    self.release(item.request_id)
                    results[i] = DraftResult(item.request_id)
                    continue
                p = self._plan(i, item)
            except SpecError as exc:
                results[i], errors[i] = DraftResult(item.request_id, error=str(exc)), exc
                continue
            planned.append(p)

        t1 = time.perf_counter_ns()
        running = [p for p in planned if p.feed]
        seqs = [
            SeqInput(
                p.state.cache, tuple(p.feed), logit_rows=tuple(range(len(p.feed))) if p.item.score_append else None
            )
            for p in running
        ]
        try:
            logits = self.runner.forward(seqs)
        except Exception as exc:  # e.g. a device OOM: fail the items that needed the pass
            log.error("draft_forward_failed", error=repr(exc), batch=len(seqs))
            for p in running:
                p.state.cache.discard_pending()
                del p.state.tokens[p.state.cache.length :]  # back to what the cache holds
                p.state.next_probs = None
                if p.new:
                    self._drop(p.state)
                err = SpecError(f"draft forward failed: {exc}")
                results[p.index], errors[p.index] = DraftResult(p.item.request_id, error=str(err)), err
            failed = {p.index for p in running}
            planned = [p for p in planned if p.index not in failed]
            running, logits = [], []
        scores: dict[int, float] = {}
        for p, lg in zip(running, logits):
            p.state.cache.commit(len(p.feed))
            p.state.next_probs = torch.softmax(lg[-1], dim=-1)  # [vocab], temperature 1
            if p.item.score_append and len(p.feed) > 1:
                scores[p.index] = mean_logprob(lg[:-1], p.feed[1:])
        t2 = time.perf_counter_ns()

        for p in planned:
            state, top_n = p.state, p.item.top_n
            ids: tuple[int, ...] = ()
            probs: tuple[float, ...] = ()
            if top_n > 0:
                vals, idx = torch.topk(state.next_probs, min(top_n, state.next_probs.shape[-1]))
                ids, probs = tuple(idx.tolist()), tuple(vals.tolist())
            results[p.index] = DraftResult(
                p.item.request_id, ids, probs, cache_len=state.cache.length, append_logprob=scores.get(p.index)
            )
        t3 = time.perf_counter_ns()
        batch_tokens = sum(len(s.token_ids) for s in seqs)
        return results, errors, (t1 - t0, t2 - t1, t3 - t2), batch_tokens  # type: ignore[return-value]

    def _plan(self, index: int, item: DraftItem) -> _Planned:
        """Validate an item, apply its truncation and reserve room for its feed.

        Raises :class:`SpecError` before changing anything when the item is invalid.
        """
        vocab = self.runner.vocab_size
        if not 0 <= item.top_n <= (self.max_top_n if self.max_top_n is not None else item.top_n):
            raise InvalidInput(f"top_n: must be between 0 and {self.max_top_n}, got {item.top_n}")
        if not 0 <= item.chain_len <= (self.max_chain_len if self.max_chain_len is not None else item.chain_len):
            raise InvalidInput(f"chain_len: must be between 0 and {self.max_chain_len}, got {item.chain_len}")
        if item.truncate_to < -1:
            raise InvalidInput(f"truncate_to: must be -1 (keep the cache) or a length >= 0, got {item.truncate_to}")
        for t in item.append_ids:
            if not 0 <= t < vocab:
                raise InvalidInput(f"append_ids: token id {t} outside the vocabulary [0, {vocab})")
        state = self._requests.get(item.request_id)
        new = state is None
        if new:
            if not item.append_ids:
                raise UnknownRequest(
                    f"request_id: unknown request {item.request_id!r}: the first draft item must carry the prompt in "
                    "append_ids"
                )
            if item.truncate_to > 0:
                raise InvalidInput(
                    f"truncate_to: request {item.request_id!r} is new: cannot truncate to {item.truncate_to}"
                )
            state = DraftState(item.request_id, [], self.pool.new_cache())
        keep = len(state.tokens) if item.truncate_to < 0 else item.truncate_to
        if keep > len(state.tokens):
            raise InvalidInput(
                f"truncate_to: cannot truncate request {item.request_id!r} to {keep} tokens: its cache holds "
                f"{len(state.tokens)}"
            )
        total = keep + len(item.append_ids)
        if total > self.runner.max_context:
            raise ContextTooLong(
                f"append_ids: request {item.request_id!r}: {total} tokens exceed the model's maximum context of "
                f"{self.runner.max_context}"
            )
        if keep == 0 and not item.append_ids and item.top_n > 0:
            raise InvalidInput(f"top_n: request {item.request_id!r} has no tokens to propose from")

        # What must run through the model: the appended tokens; and when candidates are wanted after a
        # rollback that discarded the stored distribution, the last kept token again (one token).
        stale = keep < len(state.tokens) or state.next_probs is None
        rerun = bool(item.top_n > 0 and not item.append_ids and stale)
        base = keep - 1 if rerun else keep
        feed = ([state.tokens[keep - 1]] if rerun else []) + list(item.append_ids)
        if feed:
            try:  # room after the truncated length, without changing the cache yet
                state.cache.reserve(len(feed), after=base)
            except SpecError:
                if new:
                    state.cache.release()
                raise

        # from here on the item is valid: apply the truncation
        if keep < len(state.tokens):
            state.next_probs = None
        state.cache.truncate(base)
        del state.tokens[keep:]
        if rerun:
            state.tokens.pop()
        state.tokens += feed
        if new:
            self._requests[item.request_id] = state
        return _Planned(index, item, state, feed, new)


def mean_logprob(logits: torch.Tensor, targets: Sequence[int]) -> float:
    """Mean log p(targets[i] | row i of ``logits``), the drafter's score of a prompt.

    A token the drafter cannot propose (outside its reduced draft vocabulary: -inf) counts as
    a uniform guess over the target's vocabulary, ``-log(V)``, instead of -inf: otherwise one such
    token makes every drafter that shares the map score the prompt -inf, and domain detection
    compares nothing but ties (most prompts of code, prose and chat hold one)."""
    logp = torch.log_softmax(logits, dim=-1)
    got = logp.gather(1, torch.tensor(list(targets), dtype=torch.long, device=logp.device).unsqueeze(1))
    floor = -math.log(logits.shape[-1])
    return float(torch.where(torch.isfinite(got), got, torch.full_like(got, floor)).mean())
