"""KV cache: pending writes, commit of a kept subset, rollback without copies, the token budget."""

from __future__ import annotations

import pytest
import torch

from common.runtime.kv_cache import KVPool
from common.spec.types import KVBudgetExceeded


def pool(budget: int | None = None, block: int = 4) -> KVPool:
    return KVPool(
        num_layers=2,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device="cpu",
        token_budget=budget,
        block_size=block,
    )


def fill(cache, values: list[float]) -> None:
    """Write one pass of new tokens whose keys are ``values`` (values are ``-values``)."""
    t = torch.tensor(values).view(1, -1, 1).expand(1, -1, 2)
    for layer in range(2):
        cache.write(layer, t + layer, -t)


def keys(cache, layer: int = 0) -> list[float]:
    return cache.view(layer, 0)[0][0, :, 0].tolist()


def test_commit_all_and_truncate_keeps_prefix_without_copy() -> None:
    c = pool().new_cache()
    c.reserve(5)
    fill(c, [0, 1, 2, 3, 4])
    c.commit(5)
    assert c.length == 5 and keys(c) == [0, 1, 2, 3, 4] and keys(c, 1) == [1, 2, 3, 4, 5]
    storage = c.k.data_ptr()
    c.truncate(3)
    assert c.length == 3 and keys(c) == [0, 1, 2] and c.k.data_ptr() == storage
    c.reserve(1)
    fill(c, [9])
    c.commit(1)
    assert keys(c) == [0, 1, 2, 9]
    assert c.view(0, 0)[1][0, :, 0].tolist() == [0, -1, -2, -9]


def test_commit_subset_moves_kept_entries_down_in_order() -> None:
    c = pool().new_cache()
    c.reserve(2)
    fill(c, [10, 11])
    c.commit(2)
    c.reserve(6)
    fill(c, [20, 21, 22, 23, 24, 25])  # e.g. 1 uncached token + a 5-node tree
    c.commit([0, 2, 5])  # the uncached token and the accepted path nodes 1 and 4
    assert c.length == 5
    assert keys(c) == [10, 11, 20, 22, 25]
    assert keys(c, 1) == [11, 12, 21, 23, 26]
    assert c.pending == 0


def test_commit_prefix_and_empty_keep() -> None:
    c = pool().new_cache()
    c.reserve(3)
    fill(c, [1, 2, 3])
    c.commit([0, 1])
    assert keys(c) == [1, 2]
    c.reserve(2)
    fill(c, [7, 8])
    c.commit([])
    assert keys(c) == [1, 2]


@pytest.mark.parametrize("bad", [[1, 0], [0, 0], [3], [-1]])
def test_commit_rejects_bad_indices(bad: list[int]) -> None:
    c = pool().new_cache()
    c.reserve(3)
    fill(c, [1, 2, 3])
    with pytest.raises(ValueError):
        c.commit(bad)


def test_truncate_bounds() -> None:
    c = pool().new_cache()
    c.reserve(2)
    fill(c, [1, 2])
    c.commit(2)
    with pytest.raises(ValueError):
        c.truncate(3)
    c.truncate(0)
    assert c.length == 0


def test_write_beyond_reservation_is_an_error() -> None:
    c = pool(block=4).new_cache()
    c.reserve(3)
    with pytest.raises(RuntimeError, match="reserve first"):
        fill(c, [1, 2, 3, 4, 5])


def test_growth_keeps_contents() -> None:
    c = pool(block=2).new_cache()
    for i in range(20):
        c.reserve(1)
        fill(c, [i])
        c.commit(1)
    assert keys(c) == list(range(20))


def test_budget_counts_capacity_and_refuses_cleanly() -> None:
    p = pool(budget=16, block=4)
    a, b = p.new_cache(), p.new_cache()
    a.reserve(5)  # rounded up to 8
    assert a.capacity == 8 and p.reserved_tokens == 8
    b.reserve(8)
    assert p.reserved_tokens == 16 and p.free_tokens == 0
    with pytest.raises(KVBudgetExceeded, match="budget exceeded"):
        b.reserve(9)
    assert b.capacity == 8 and p.reserved_tokens == 16  # untouched
    a.release()
    assert p.reserved_tokens == 8
    b.reserve(12)
    assert b.capacity >= 12 and p.reserved_tokens <= 16


def test_growth_is_geometric_while_the_budget_allows() -> None:
    p = pool(budget=100, block=4)
    c = p.new_cache()
    c.reserve(4)
    c.reserve(5)
    assert c.capacity == 8
    c.reserve(9)
    assert c.capacity == 16
    c.reserve(70)  # doubling would be 32 < 72: exact rounded need
    assert c.capacity == 72
    c.reserve(73)  # doubling would be 144 > budget: capped at what is available
    assert c.capacity == 100


def test_release_is_idempotent() -> None:
    p = pool(budget=8)
    c = p.new_cache()
    c.reserve(8)
    c.release()
    c.release()
    assert p.reserved_tokens == 0
    with pytest.raises(RuntimeError):
        c.reserve(1)
