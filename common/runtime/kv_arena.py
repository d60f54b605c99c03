"""A paged KV arena: every request's keys and values in fixed-size blocks of one tensor per device.

Layout: ``k, v: [num_layers, num_slots, num_kv_heads, head_dim]`` (``num_slots = num_blocks *
block_size``; ``k[layer]`` is that layer's slots, slot-major as vLLM's and FlashInfer's paged caches
keep them). A request (:class:`PagedCache`) owns a **block table**, the list of its blocks in order:
its logical entry ``i`` lives in slot ``blocks[i // block_size] * block_size + i % block_size``.
Blocks are handed out from a free list and returned to it.

It keeps the contract of :class:`~common.runtime.kv_cache.KVCache` and
:class:`~common.runtime.kv_cache.KVPool` that the engines use (``reserve``, ``commit``,
``discard_pending``, ``truncate``, ``release``, ``length``, the token budget):

- the budget counts blocks in use (``reserved_tokens = used blocks * block_size``); a reserve that
  cannot fit raises :class:`KVBudgetExceeded` before anything changes (no block taken, the cache
  as it was, no other request touched);
- a pass writes its new tokens into the **pending** entries ``[length, length + pending)`` (the
  runner does that, all sequences of a layer in one indexed write: :meth:`PagedCache.slots` gives
  the slot mapping);
- ``commit``, ``truncate`` and ``discard_pending`` edit ``length`` and the block table, never
  copying a cache; committing a tree's accepted path (kept indices) moves only the accepted nodes'
  rows into place (one gather and one scatter across every layer), and the blocks no kept entry
  needs (a rejected branch's) go back to the free list in the same call.

Invariant after every commit and truncate: a cache holds ``ceil(max(length, promised) /
block_size)`` blocks. ``promised`` is the entry count its last ``reserve`` made room for, kept as today's caches keep
their capacity (a caller may reserve once and commit chains of tokens into that room, or repeat a
pass after ``discard_pending``) until it is used up (``length`` reaches it), a tree's commit ends
it, or the cache is released; ``truncate`` frees the blocks beyond it and the new length.

The arena's tensor grows geometrically (one copy of the arena, never during a pass: only ``reserve``
grows it) up to the budget, or is allocated whole up front (``preallocate``: what a GPU's CUDA graphs
need, fixed addresses).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.logs import get_logger
from common.runtime.kv_cache import KVStore
from common.spec.types import KVBudgetExceeded

log = get_logger(__name__)

KV_CACHES = ("auto", "paged", "contiguous")
ARENA_BACKENDS = ("flex", "flashinfer")  # attention backends that read the arena in place: paged only


def select_kv_cache(
    name: str, device: torch.device | str, attention: str = "auto", dtype: str = "float32"
) -> tuple[str, str]:
    """``(mode, reason)``: ``paged`` or ``contiguous`` for the setting ``name`` on ``device``, with
    the attention backend setting ``attention`` and the resolved weight ``dtype``.

    ``auto`` is ``paged`` on CUDA (one batched write and one attention call a layer whatever the
    batch) unless an attention backend other than ``sdpa`` is asked for by name (those run on
    per-request caches), and ``contiguous`` on a CPU, where the per-request caches with the
    project's CPU kernel (one call a layer too) are faster than the paged path's ``sdpa`` over a
    per-pass gathered view (``benchmarks.verify_micro``, section 4). Raises ``ValueError`` for an
    unknown name, for ``paged`` with a named attention backend other than ``sdpa`` (the arena
    attends with its own), and for ``paged`` in bfloat16 on a CPU (exact there only with the
    row-invariant attention of per-request caches: :mod:`common.runtime.invariant_bf16`).
    """
    if name not in KV_CACHES:
        raise ValueError(f"unknown kv cache {name!r} (choose {', '.join(KV_CACHES)})")
    on_cpu = torch.device(device).type == "cpu"
    if attention in ARENA_BACKENDS:  # reads the arena in place: paged whatever auto would pick
        if name == "contiguous":
            raise ValueError(f"attention backend {attention} reads the paged arena; use --kv-cache paged or auto")
        if on_cpu and dtype == "bfloat16":
            raise ValueError(f"attention backend {attention} computes in bfloat16, which on a CPU is not row-invariant")
        return "paged", f"attention backend {attention} asked for by name: it reads the paged arena"
    if name == "paged":
        if attention not in ("auto", "sdpa"):
            raise ValueError(
                f"kv cache paged attends with sdpa over the arena; attention backend {attention} runs on "
                "contiguous caches (use --kv-cache contiguous or --attention auto)"
            )
        if on_cpu and dtype == "bfloat16":
            raise ValueError(
                "kv cache paged computes attention in bfloat16, which on a CPU is not row-invariant "
                "(a token could depend on its batch); use --kv-cache contiguous or float32"
            )
        return "paged", "asked for by name"
    if name == "contiguous":
        return "contiguous", "asked for by name"
    if on_cpu:
        return "contiguous", "auto on a CPU: per-request caches and the CPU kernel are faster there than the paged path"
    if attention not in ("auto", "sdpa"):
        return "contiguous", f"auto with attention backend {attention} asked for by name: it runs on contiguous caches"
    return "paged", "auto off the CPU: paged arena, one batched write and one attention call a layer"


def _blocks_for(tokens: int, block: int) -> int:
    return -(-tokens // block)


class KVArena(KVStore):
    """Blocks of ``block_size`` tokens in ``k, v: [num_layers, num_blocks * block_size, Hkv, D]``
    and their free list; the pool of :class:`PagedCache` s (``new_cache``).

    ``token_budget=None`` means unbounded (the arena grows as needed). ``initial_tokens``: the first
    allocation (default: the budget when ``preallocate``, else the smaller of the budget and 64 blocks).
    """

    def __init__(self, *, preallocate: bool = False, initial_tokens: int | None = None, **shape) -> None:
        super().__init__(**shape)
        token_budget, block_size = self.token_budget, self.block_size
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.max_blocks = None if token_budget is None else token_budget // block_size
        if initial_tokens is None:
            initial_tokens = token_budget if preallocate and token_budget is not None else 64 * block_size
        first = _blocks_for(initial_tokens, block_size)
        if self.max_blocks is not None:
            first = min(first, self.max_blocks)
        self.k = self._alloc(max(first, 1))
        self.v = self._alloc(max(first, 1))
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out the lowest first
        self.used_blocks = 0
        self.scratch_block: int | None = None  # take_scratch

    def _alloc(self, blocks: int) -> torch.Tensor:
        shape = (self.num_layers, blocks * self.block_size, self.num_kv_heads, self.head_dim)
        # zeros, not empty: a gathered view's padding reads slots nobody wrote, and a masked score's
        # zero weight times a NaN left in fresh memory would still be NaN
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ---- the pool's facts (KVPool's names) -----------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1] // self.block_size

    @property
    def reserved_tokens(self) -> int:
        """Tokens of the blocks live caches hold (the scratch block is no cache's)."""
        return (self.used_blocks - (self.scratch_block is not None)) * self.block_size

    def take_scratch(self) -> int:
        """A block no cache owns, for writes that must land somewhere harmless (the padding rows of a
        CUDA graph's pass): taken once from the budget, then the same block every call; raises
        :class:`KVBudgetExceeded` when the budget has no block left for it."""
        if self.scratch_block is None:
            self.scratch_block = self._take(1, self.block_size)[0]
        return self.scratch_block

    def new_cache(self) -> PagedCache:
        return PagedCache(self)

    # ---- blocks ------------------------------------------------------------------------------

    def _take(self, n: int, needed: int) -> list[int]:
        """``n`` free blocks for a cache that needs ``needed`` entries; raises
        :class:`KVBudgetExceeded` (nothing taken) when the budget cannot grant them."""
        if self.max_blocks is not None and self.used_blocks + n > self.max_blocks:
            available = (self.max_blocks - self.used_blocks) * self.block_size
            raise KVBudgetExceeded(
                f"KV cache budget exceeded: {needed} tokens needed for this request, "
                f"{n * self.block_size} more of {self.token_budget} asked, {available} available"
            )
        if n > len(self._free):
            self._grow(self.used_blocks + n)
        self.used_blocks += n
        return [self._free.pop() for _ in range(n)]

    def _give(self, blocks: Sequence[int]) -> None:
        self._free.extend(reversed(blocks))
        self.used_blocks -= len(blocks)

    def _grow(self, blocks: int) -> None:
        """At least ``blocks`` blocks in all (doubling, up to the budget): one copy of the arena."""
        old = self.num_blocks
        new = max(blocks, 2 * old)
        if self.max_blocks is not None:
            new = min(new, self.max_blocks)
        k, v = self._alloc(new), self._alloc(new)
        k[:, : old * self.block_size] = self.k
        v[:, : old * self.block_size] = self.v
        self.k, self.v = k, v
        self._free[:0] = range(new - 1, old - 1, -1)  # after the free blocks already listed
        log.debug("kv_arena_grown", blocks=new, tokens=new * self.block_size)

    def move(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the entries of slots ``src`` into slots ``dst`` in every layer (gathered first, so
        overlapping moves are safe)."""
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]


class PagedCache:
    """One request's entries in a :class:`KVArena`, addressed through its block table ``blocks``.

    Entries ``[0, length)`` are committed, ``[length, length + pending)`` were written by the last pass.
    """

    def __init__(self, arena: KVArena) -> None:
        self.arena = arena
        self.blocks: list[int] = []
        self.length = 0
        self.pending = 0
        self.promised = 0  # entries the last reserve made room for (module docstring)
        self.released = False

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.arena.block_size

    def reserve(self, extra: int, after: int | None = None) -> None:
        """Make room for ``extra`` entries after the first ``after`` (default: all committed) ones.

        Raises :class:`KVBudgetExceeded` (and leaves the cache and the arena untouched) when the
        arena cannot grant it."""
        if self.released:
            raise RuntimeError("cache was released")
        needed = (self.length if after is None else after) + extra
        more = _blocks_for(needed, self.arena.block_size) - len(self.blocks)
        if more > 0:
            self.blocks += self.arena._take(more, needed)
        self.promised = needed

    def slots(self, start: int, end: int) -> list[int]:
        """Arena slots of the logical entries ``[start, end)`` (the slot mapping of a pass)."""
        bs, blocks = self.arena.block_size, self.blocks
        return [blocks[i // bs] * bs + i % bs for i in range(start, end)]

    def will_write(self, t: int) -> None:
        """The next ``t`` entries are about to be written by a pass: they are pending from now."""
        if self.length + t > self.capacity:
            raise RuntimeError(
                f"cache overflow: {self.length + t} slots needed, capacity {self.capacity} (reserve first)"
            )
        self.pending = t

    def commit(self, keep: int | Sequence[int]) -> None:
        """Keep pending entries and make them committed (as :meth:`KVCache.commit
        <common.runtime.kv_cache.KVCache.commit>`): a count keeps the first ``keep`` in place (the
        reserved room after them stays); increasing indices (a tree's accepted path) move only the
        entries whose slot is not already theirs, end the reserve's promise and give every block
        no kept entry needs back to the arena."""
        if isinstance(keep, int):
            if not 0 <= keep <= self.pending:
                raise ValueError(f"cannot keep {keep} of {self.pending} pending slots")
            self.length += keep
            self.pending = 0
            if self.length >= self.promised:  # the reserved room is used up
                self.promised = 0
            self._trim(max(self.length, self.promised))
            return
        idx = list(keep)
        if any(b <= a for a, b in zip(idx, idx[1:])) or (idx and not 0 <= idx[0] <= idx[-1] < self.pending):
            raise ValueError(f"keep indices must be increasing within [0, {self.pending}): {idx}")
        moved = [(j, i) for j, i in enumerate(idx) if i != j]  # the prefix already in place stays
        if moved:
            base = self.length
            self.arena.move([self._slot(base + i) for _, i in moved], [self._slot(base + j) for j, _ in moved])
        self.length += len(idx)
        self.pending = self.promised = 0
        self._trim(self.length)

    def discard_pending(self) -> None:
        """Drop the pending entries; the reserved room stays (the same pass may run again)."""
        self.pending = 0

    def truncate(self, length: int) -> None:
        """Roll back to the first ``length`` committed entries: the blocks beyond them and beyond the
        room the last reserve promised go back (no copy)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length
        self.pending = 0
        self._trim(max(length, self.promised))

    def release(self) -> None:
        """Give every block back to the arena. The cache cannot be used afterwards."""
        if not self.released:
            self.arena._give(self.blocks)
            self.blocks = []
            self.length = self.pending = self.promised = 0
            self.released = True

    def _slot(self, i: int) -> int:
        bs = self.arena.block_size
        return self.blocks[i // bs] * bs + i % bs

    def _trim(self, entries: int) -> None:
        keep = _blocks_for(entries, self.arena.block_size)
        if keep < len(self.blocks):
            self.arena._give(self.blocks[keep:])
            del self.blocks[keep:]
