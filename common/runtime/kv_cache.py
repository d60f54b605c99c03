"""Per-request KV caches with a shared token budget.

Each request owns one :class:`KVCache`: two preallocated, growable buffers
``k, v: [num_layers, num_kv_heads, capacity, head_dim]``. The first ``length`` slots hold the
**committed** entries. A forward pass writes the keys/values of its new tokens into the **pending**
slots ``[length, length + t)`` (the runner does that); the engine then keeps what it wants with
:meth:`KVCache.commit` (the drafter keeps everything, the verifier only the appended tokens and the
accepted path) and drops the rest. :meth:`KVCache.truncate` rolls back by moving ``length``;
nothing before it is recomputed or copied.

Memory is bounded by :class:`KVPool`: the sum of the capacities of all live caches never exceeds
``token_budget`` tokens. Capacity grows in blocks (geometrically while the budget allows, exactly
to the rounded need when it is tight); a growth that cannot fit raises :class:`KVBudgetExceeded`
before anything is allocated, so a request is refused with a clear error instead of an OOM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.spec.types import KVBudgetExceeded


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


class KVStore:
    """What a KV store holds per token and the budget it keeps (the base of :class:`KVPool` and of
    the paged :class:`~common.runtime.kv_arena.KVArena`).

    ``token_budget=None`` means unbounded (tests, benchmarks). One token costs
    ``2 * num_layers * num_kv_heads * head_dim * itemsize`` bytes (:attr:`bytes_per_token`); the
    store's tokens are counted in ``reserved_tokens``.
    """

    reserved_tokens: int

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        token_budget: int | None,
        block_size: int = 16,
    ) -> None:
        if token_budget is not None and token_budget <= 0:
            raise ValueError(f"token_budget must be positive or None, got {token_budget}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.token_budget = token_budget
        self.block_size = block_size

    @property
    def bytes_per_token(self) -> int:
        return (
            2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        )

    @property
    def free_tokens(self) -> int | None:
        return None if self.token_budget is None else self.token_budget - self.reserved_tokens


class KVPool(KVStore):
    """Allocates per-request caches and accounts their capacity against ``token_budget``
    (:class:`KVStore`)."""

    def __init__(self, **shape) -> None:
        super().__init__(**shape)
        self.reserved_tokens = 0  # sum of the capacities of live caches

    def new_cache(self) -> KVCache:
        return KVCache(self)

    def _grant(self, old_capacity: int, needed: int) -> int:
        """New capacity for a cache of ``old_capacity`` that needs ``needed`` slots; raises
        :class:`KVBudgetExceeded` when even the rounded need does not fit."""
        need = _round_up(needed, self.block_size)
        want = max(need, 2 * old_capacity)
        if self.token_budget is not None:
            available = self.token_budget - (self.reserved_tokens - old_capacity)
            if need > available:
                raise KVBudgetExceeded(
                    f"KV cache budget exceeded: {needed} tokens needed for this request, "
                    f"{available} of {self.token_budget} available"
                )
            want = min(want, available)
        self.reserved_tokens += want - old_capacity
        return want

    def _return(self, capacity: int) -> None:
        self.reserved_tokens -= capacity


class KVCache:
    """One request's keys and values.

    ``k``, ``v``: ``[num_layers, num_kv_heads, capacity, head_dim]``; slots ``[0, length)`` are
    committed, slots ``[length, length + pending)`` were written by the last forward pass.
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.length = 0
        self.pending = 0
        self.k: torch.Tensor = self._alloc(0)
        self.v: torch.Tensor = self._alloc(0)
        self.released = False

    def _alloc(self, capacity: int) -> torch.Tensor:
        p = self.pool
        return torch.empty((p.num_layers, p.num_kv_heads, capacity, p.head_dim), dtype=p.dtype, device=p.device)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, extra: int, after: int | None = None) -> None:
        """Make room for ``extra`` slots after the first ``after`` (default: all committed) ones.

        Raises :class:`KVBudgetExceeded` (and leaves the cache untouched) when the pool cannot grant it.
        """
        if self.released:
            raise RuntimeError("cache was released")
        needed = (self.length if after is None else after) + extra
        if needed <= self.capacity:
            return
        new_capacity = self.pool._grant(self.capacity, needed)
        k, v = self._alloc(new_capacity), self._alloc(new_capacity)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write the new tokens' ``k_new, v_new: [num_kv_heads, t, head_dim]`` into the pending slots."""
        t = k_new.shape[1]
        end = self.length + t
        self._check_room(t)
        self.k[layer, :, self.length : end] = k_new
        self.v[layer, :, self.length : end] = v_new
        self.pending = t

    def will_write(self, t: int) -> None:
        """The next ``t`` slots of every layer are about to be written in place through :meth:`view`
        (by an attention backend that writes them itself): they are pending from now."""
        self._check_room(t)
        self.pending = t

    def _check_room(self, t: int) -> None:
        if self.length + t > self.capacity:
            raise RuntimeError(
                f"cache overflow: {self.length + t} slots needed, capacity {self.capacity} (reserve first)"
            )

    def view(self, layer: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the committed slots plus the first ``extra`` pending ones:
        ``[num_kv_heads, length + extra, head_dim]`` each (views, no copy)."""
        end = self.length + extra
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def commit(self, keep: int | Sequence[int]) -> None:
        """Keep pending slots and make them committed.

        ``keep`` is either a count (the first ``keep`` pending slots, in place) or increasing
        pending indices (e.g. the appended tokens then the accepted path of a tree); those entries
        are moved down to follow the committed ones. Every other pending slot is dropped.
        """
        if isinstance(keep, int):
            if not 0 <= keep <= self.pending:
                raise ValueError(f"cannot keep {keep} of {self.pending} pending slots")
            self.length += keep
            self.pending = 0
            return
        idx = list(keep)
        if any(b <= a for a, b in zip(idx, idx[1:])) or (idx and not 0 <= idx[0] <= idx[-1] < self.pending):
            raise ValueError(f"keep indices must be increasing within [0, {self.pending}): {idx}")
        n = len(idx)
        if idx != list(range(n)):  # the prefix that is already in place needs no move
            src = torch.tensor(idx, device=self.k.device) + self.length
            # advanced indexing gathers into a fresh tensor first, so overlapping moves are safe
            self.k[:, :, self.length : self.length + n] = self.k[:, :, src]
            self.v[:, :, self.length : self.length + n] = self.v[:, :, src]
        self.length += n
        self.pending = 0

    def discard_pending(self) -> None:
        self.pending = 0

    def truncate(self, length: int) -> None:
        """Roll back to the first ``length`` committed entries (no recomputation, no copy)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length
        self.pending = 0

    def release(self) -> None:
        """Give the memory back to the pool. The cache cannot be used afterwards."""
        if not self.released:
            self.pool._return(self.capacity)
            self.k = self.v = self._alloc(0)
            self.length = self.pending = 0
            self.released = True
