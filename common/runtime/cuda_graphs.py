"""CUDA graphs for the passes that repeat: the verifier's decode and tree passes and the drafters'
steps, over the paged arena (:mod:`common.runtime.kv_arena`).

A pass is launch-bound on a GPU when its model is small or its batch is: every tensor operation is a
kernel launch from Python, and the arithmetic takes less time than the launches. A CUDA graph records
the launches of one pass once and replays them with one call. It needs fixed shapes and fixed
addresses, so passes are padded to a **bucket** (:class:`Bucket`):

- ``batch``: sequences, padded to the next of :data:`BATCH_BUCKETS`;
- ``tokens``: new tokens per sequence, padded to the next of :data:`TOKEN_BUCKETS` (1 for a decode
  step, up to 16 for a chain or a tree; a longer prefill runs eagerly);
- ``entries``: attended entries per sequence (committed + new): the next multiple of
  :data:`MIN_ENTRIES` up to four of them, then the next doubling, at most the model's context (a
  gathered view of padded entries costs memory traffic, so the small contexts that are common get
  fine steps).

The activations of a bucketed pass are ``[batch * tokens, hidden]`` in padded order (row ``b * tokens +
i`` is sequence ``b``'s new token ``i``). Its inputs live in static buffers (:class:`StaticInputs`),
refilled before each replay with one copy each:

- ``ids, pos [batch * tokens]``: token ids and positions (padding: id 0, position 0);
- a :class:`~common.runtime.paged_attention.PagedPlan` over the padded rows (the same attention as
  the eager paged pass, :func:`~common.runtime.paged_attention.paged_attend`), whose
  ``slot_mapping [batch * tokens]`` is the arena slot each row's keys and values go to; padding rows go to a
  **scratch block** that is no request's (:meth:`~common.runtime.kv_arena.KVArena.take_scratch`),
  so a replay never touches an entry of any request; its
- ``kv_index [batch, entries]``: the slots of each sequence's entries in order (padding: scratch slots);
- and its ``mask [batch, 1, tokens, entries]``: additive (0 / -inf), committed entries and the tree's
  ancestors-or-self, as :func:`~common.runtime.paged_attention.plan_paged` builds it; a padding row
  sees its first entry only, so no row is all -inf.

:func:`static_forward` is the pass itself: the same layers and the same operations as the runner's
paged pass, on those buffers; the logits of every row come back in one buffer and the wanted rows
are copied out. Masked entries weigh exactly zero, so the real rows' outputs do not depend on the
padding.

:class:`PassGraphs` holds one captured graph per bucket met (captured the first time a pass fits it,
after a warm-up, all in one memory pool), and counts what each pass did: ``replayed``, ``captured``
(then replayed), ``eager`` (no bucket fits, or the graph limit is reached: the runner's eager paged
pass runs, never an error). When the arena grows (a new tensor, new addresses) every graph is dropped
and recaptured on demand; a preallocated arena never grows. ``capture=False`` runs
:func:`static_forward` eagerly instead of replaying, which is how a CPU tests the bucketed pass
that a GPU captures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from common.logs import get_logger
from common.runtime.attention import BatchLayout
from common.runtime.kv_arena import KVArena, PagedCache
from common.runtime.paged_attention import PagedPlan, ancestor_rows, entry_view, paged_attend, write_kv
from common.spec.types import KVBudgetExceeded

log = get_logger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (1, 2, 4, 8, 16)
MIN_ENTRIES = 256
MAX_GRAPHS = 48  # beyond it a pass that needs a new bucket runs eagerly (each graph holds its buffers)


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int
    tokens: int
    entries: int

    @property
    def rows(self) -> int:
        return self.batch * self.tokens


def _first_at_least(values: Sequence[int], x: int) -> int | None:
    return next((v for v in values if v >= x), None)


def bucket_for(layout: BatchLayout, max_entries: int) -> Bucket | None:
    """The smallest bucket the pass fits, or None (too many sequences, tokens or entries)."""
    batch = _first_at_least(BATCH_BUCKETS, layout.batch)
    tokens = _first_at_least(TOKEN_BUCKETS, max(layout.new_lens))
    need = max(p + t for p, t in zip(layout.past_lens, layout.new_lens))
    entries = MIN_ENTRIES
    while entries < need:  # steps of MIN_ENTRIES up to four of them, then doubling
        entries = entries + MIN_ENTRIES if entries < 4 * MIN_ENTRIES else 2 * entries
    entries = min(entries, max_entries)
    if batch is None or tokens is None or need > entries:
        return None
    return Bucket(batch, tokens, entries)


@dataclass
class StaticInputs:
    """A bucket's input buffers (shapes in the module docstring): the token ids and positions, and a
    :class:`~common.runtime.paged_attention.PagedPlan` over the padded rows (its row maps the
    identity, its ``slot_mapping`` the ``slots``; the block table and lengths are not read)."""

    ids: torch.Tensor
    pos: torch.Tensor
    plan: PagedPlan

    FILLED = ("slot_mapping", "kv_index", "q_index", "out_index", "mask")

    def tensors(self) -> list[torch.Tensor]:
        return [self.ids, self.pos, *(getattr(self.plan, n) for n in self.FILLED)]

    def fill(self, other: StaticInputs) -> None:
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine.copy_(theirs, non_blocking=True)

    def to(self, device: torch.device) -> StaticInputs:
        """A copy on ``device`` (a bucket's own buffers)."""
        plan = replace(self.plan, **{n: getattr(self.plan, n).to(device).clone() for n in self.FILLED})
        return StaticInputs(self.ids.to(device).clone(), self.pos.to(device).clone(), plan)


def plan_static(
    layout: BatchLayout,
    caches: Sequence[PagedCache],
    ids: Sequence[int],
    bucket: Bucket,
    scratch: int,
    block_size: int,
    dtype: torch.dtype,
) -> StaticInputs:
    """The bucket's inputs for this pass, built on the host (``ids``: the packed new tokens, in the
    model's id space; ``scratch``: the scratch block). Padding sequences have no entries and no tokens."""
    B, T, S = bucket.batch, bucket.tokens, bucket.entries
    width = -(-S // block_size)
    table = [[scratch] * width for _ in range(B)]
    past = [0] * B
    tok, pos, slots = [0] * (B * T), [0] * (B * T), [scratch * block_size] * (B * T)
    anc = [[[False] * T for _ in range(T)] for _ in range(B)]
    for b, (cache, off, t, p) in enumerate(zip(caches, layout.offsets, layout.new_lens, layout.past_lens)):
        blocks = cache.blocks[:width]
        table[b][: len(blocks)] = blocks
        past[b] = p
        tok[b * T : b * T + t] = ids[off : off + t]
        pos[b * T : b * T + t] = layout.positions(b)
        slots[b * T : b * T + t] = cache.slots(p, p + t)
        for i, row in enumerate(ancestor_rows(layout.parents[b])):
            anc[b][i][:t] = row
    long = torch.long
    anc_t = torch.tensor(anc, dtype=torch.bool)
    kv_index, mask = entry_view(
        torch.tensor(table, dtype=long), torch.tensor(past, dtype=long), anc_t, S, block_size, dtype
    )
    rows = torch.arange(B * T)
    plan = PagedPlan(
        torch.tensor(slots, dtype=long), torch.zeros(0), torch.zeros(0), kv_index, rows.view(B, T), rows, mask
    )
    return StaticInputs(torch.tensor(tok, dtype=long), torch.tensor(pos, dtype=long), plan)


def static_forward(runner: Any, arena: KVArena, bucket: Bucket, inp: StaticInputs) -> torch.Tensor:
    """One bucketed pass: float32 logits ``[batch * tokens, vocab]`` of every row (padding rows'
    included, meaningless); writes the real rows' keys and values into their slots."""
    ids = inp.ids if runner.draft_vocab is None else runner.draft_vocab.to_draft[inp.ids]
    h, cos, sin = runner.embed_at(ids, inp.pos)

    def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_kv(arena, li, k, v, inp.plan)
        return paged_attend(q, arena, li, inp.plan, runner.scale)

    h = runner.layers_over(h, cos, sin, attend)
    return runner.lm_head(runner.norm(h)).float()


@dataclass
class _Graph:
    inputs: StaticInputs
    output: torch.Tensor | None = None
    graph: Any = None  # torch.cuda.CUDAGraph when captured


class PassGraphs:
    """The runner's graphs over one arena (module docstring). :meth:`run` returns the pass's logits
    (the runner's ``forward`` contract) or None when the pass should run eagerly."""

    def __init__(self, runner: Any, arena: KVArena, capture: bool, max_graphs: int = MAX_GRAPHS) -> None:
        self.runner, self.arena, self.capture, self.max_graphs = runner, arena, capture, max_graphs
        self.counts: Counter[str] = Counter()
        self.graphs: dict[Bucket, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._arena_k = arena.k.data_ptr()
        try:
            self._scratch: int | None = arena.take_scratch()  # the padding rows' slots
        except KVBudgetExceeded:
            self._scratch = None
        max_context = getattr(runner, "max_context", None) or MIN_ENTRIES
        self.max_entries = -(-max_context // arena.block_size) * arena.block_size

    def run(self, seqs: Sequence[Any], layout: BatchLayout, ids: Sequence[int]) -> list[torch.Tensor] | None:
        bucket = bucket_for(layout, self.max_entries)
        if self._scratch is None or bucket is None or any(s.cache.arena is not self.arena for s in seqs):
            self.counts["eager"] += 1
            return None
        if self.arena.k.data_ptr() != self._arena_k:  # the arena grew: new addresses
            self.graphs.clear()
            self._arena_k = self.arena.k.data_ptr()
        g = self.graphs.get(bucket)
        if g is None and len(self.graphs) >= self.max_graphs:
            self.counts["eager"] += 1
            return None
        for s, t in zip(seqs, layout.new_lens):
            s.cache.will_write(t)  # checks the room the slots need
        dev = self.runner.device
        host = plan_static(
            layout,
            [s.cache for s in seqs],
            ids,
            bucket,
            self._scratch,
            self.arena.block_size,
            self.runner.dtype,
        )
        if g is None:
            g = self.graphs[bucket] = self._new(bucket, host)
            self.counts["captured"] += 1
        else:
            self.counts["replayed"] += 1
        g.inputs.fill(host)
        if g.graph is not None:
            g.graph.replay()
            out = g.output
        else:
            out = static_forward(self.runner, self.arena, bucket, g.inputs)
        assert out is not None
        rows, counts = [], []
        for b, (s, t) in enumerate(zip(seqs, layout.new_lens)):
            want = (t - 1,) if s.logit_rows is None else s.logit_rows
            rows += [b * bucket.tokens + r for r in want]
            counts.append(len(want))
        logits = out[torch.tensor(rows, dtype=torch.long, device=dev)]  # a copy: the next replay overwrites ``out``
        if self.runner.draft_vocab is not None:
            logits = self.runner.draft_vocab.full_logits(logits)
        return list(torch.split(logits, counts))

    def _new(self, bucket: Bucket, host: StaticInputs) -> _Graph:
        dev = self.runner.device
        g = _Graph(host.to(dev))
        if not self.capture:
            return g
        assert self._scratch is not None
        scratch = self._scratch * self.arena.block_size  # warm-up and capture write only there
        g.inputs.plan.slot_mapping.fill_(scratch)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                static_forward(self.runner, self.arena, bucket, g.inputs)
        torch.cuda.current_stream(dev).wait_stream(stream)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.output = static_forward(self.runner, self.arena, bucket, g.inputs)
        log.debug("cuda graph captured", batch=bucket.batch, tokens=bucket.tokens, entries=bucket.entries)
        return g

    def close(self) -> None:
        """Drop the graphs (the runner moved to another arena; the old one keeps its scratch block)."""
        self.graphs.clear()

    def stats(self) -> dict[str, int]:
        """Passes by what they did (``replayed``, ``captured``, ``eager``) and the graphs held."""
        return {**{k: self.counts[k] for k in ("replayed", "captured", "eager")}, "graphs": len(self.graphs)}
