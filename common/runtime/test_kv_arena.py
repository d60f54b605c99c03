"""KV arena: block tables, commits that move only kept rows, rollback, the budget, blocks reused."""

from __future__ import annotations

import pytest
import torch

from common.runtime.kv_arena import KVArena, PagedCache, select_kv_cache
from common.spec.types import KVBudgetExceeded


def arena(budget: int | None = None, block: int = 4, **kw) -> KVArena:
    return KVArena(
        num_layers=2,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device="cpu",
        token_budget=budget,
        block_size=block,
        **kw,
    )


def fill(cache: PagedCache, values: list[float]) -> None:
    """One pass of new tokens whose keys are ``values`` (+ layer) and values ``-values``, written
    through the slot mapping as the runner writes them."""
    cache.will_write(len(values))
    slots = torch.tensor(cache.slots(cache.length, cache.length + len(values)))
    t = torch.tensor(values, dtype=torch.float32).view(-1, 1, 1).expand(-1, 1, 2)
    for layer in range(2):
        cache.arena.k[layer].index_copy_(0, slots, t + layer)
        cache.arena.v[layer].index_copy_(0, slots, -t)


def keys(cache: PagedCache, layer: int = 0, values: bool = False) -> list[float]:
    store = cache.arena.v if values else cache.arena.k
    return store[layer][torch.tensor(cache.slots(0, cache.length), dtype=torch.long)][:, 0, 0].tolist()


def test_slots_follow_the_block_table() -> None:
    a = arena(block=4)
    c = a.new_cache()
    c.reserve(6)
    assert len(c.blocks) == 2 and c.capacity == 8 and a.reserved_tokens == 8
    b0, b1 = c.blocks
    assert c.slots(0, 6) == [b0 * 4, b0 * 4 + 1, b0 * 4 + 2, b0 * 4 + 3, b1 * 4, b1 * 4 + 1]


def test_commit_all_and_truncate_without_copy_free_the_tail_blocks() -> None:
    a = arena()
    c = a.new_cache()
    c.reserve(9)
    fill(c, [0, 1, 2, 3, 4, 5, 6, 7, 8])
    c.commit(9)
    assert keys(c) == [0, 1, 2, 3, 4, 5, 6, 7, 8] and keys(c, 1)[:3] == [1, 2, 3]
    assert len(c.blocks) == 3 and a.used_blocks == 3
    storage, first = a.k.data_ptr(), c.blocks[:1]
    c.truncate(3)
    assert c.length == 3 and keys(c) == [0, 1, 2] and a.k.data_ptr() == storage
    assert c.blocks == first and a.used_blocks == 1  # two blocks back on the free list
    c.reserve(1)
    fill(c, [9])
    c.commit(1)
    assert keys(c) == [0, 1, 2, 9] and keys(c, values=True) == [0, -1, -2, -9]


def test_commit_of_a_tree_moves_only_the_accepted_rows_and_frees_the_rejected_blocks() -> None:
    a = arena(block=4)
    c = a.new_cache()
    c.reserve(2)
    fill(c, [10, 11])
    c.commit(2)
    c.reserve(10)  # 1 uncached token + a 9-node tree: 12 entries, 3 blocks
    fill(c, [20, 21, 22, 23, 24, 25, 26, 27, 28, 29])
    assert a.used_blocks == 3
    before = a.k.clone()
    c.commit([0, 2, 5])  # the uncached token and the accepted path nodes 1 and 4
    assert c.length == 5 and c.pending == 0
    assert keys(c) == [10, 11, 20, 22, 25] and keys(c, 1) == [11, 12, 21, 23, 26]
    changed = (a.k != before).any(-1).any(-1).any(0).nonzero().flatten().tolist()
    assert changed == c.slots(3, 5)  # only the two moved rows were written (in both layers)
    assert len(c.blocks) == 2 and a.used_blocks == 2  # the rejected nodes' last block is free again


def test_commit_prefix_in_place_and_empty_keep() -> None:
    a = arena()
    c = a.new_cache()
    c.reserve(3)
    fill(c, [1, 2, 3])
    before = a.k.clone()
    c.commit([0, 1])
    assert keys(c) == [1, 2] and torch.equal(a.k, before)
    c.reserve(2)
    fill(c, [7, 8])
    c.commit([])
    assert keys(c) == [1, 2]


@pytest.mark.parametrize("bad", [[1, 0], [0, 0], [3], [-1]])
def test_commit_rejects_bad_indices(bad: list[int]) -> None:
    c = arena().new_cache()
    c.reserve(3)
    fill(c, [1, 2, 3])
    with pytest.raises(ValueError):
        c.commit(bad)


def test_discard_keeps_the_reserved_room_and_a_tree_commit_gives_it_back() -> None:
    a = arena(block=4)
    c = a.new_cache()
    c.reserve(4)
    fill(c, [1, 2, 3, 4])
    c.commit(4)
    c.reserve(5)
    for _ in range(2):  # the same pass again after a discard, as a contiguous cache allows
        fill(c, [5, 6, 7, 8, 9])
        c.discard_pending()
        assert c.length == 4 and c.pending == 0 and a.used_blocks == 3 and keys(c) == [1, 2, 3, 4]
    fill(c, [5, 6, 7, 8, 9])
    c.commit([0])
    assert c.length == 5 and a.used_blocks == 2 and keys(c) == [1, 2, 3, 4, 5]


def test_reserve_once_then_commit_chains_into_that_room() -> None:
    """Today's contract: room reserved stays until used, whatever the commits in between."""
    a = arena(block=4)
    c = a.new_cache()
    c.reserve(10)
    for i in range(10):
        fill(c, [float(i)])
        c.commit(1)
        assert len(c.blocks) == 3
    assert keys(c) == [float(i) for i in range(10)] and c.promised == 0  # used up
    c.truncate(2)
    assert len(c.blocks) == 1


def test_reserve_after_a_truncation_point_keeps_its_room_through_the_truncate() -> None:
    """The drafter's order: room after the truncated length first (may refuse), then truncate."""
    a = arena(block=4)
    c = a.new_cache()
    c.reserve(8)
    fill(c, list(range(8)))
    c.commit(8)
    c.reserve(6, after=2)  # 8 entries: the two blocks it holds
    c.truncate(2)
    assert len(c.blocks) == 2 and c.capacity >= 8
    fill(c, [40, 41, 42, 43, 44, 45])
    c.commit(6)
    assert keys(c) == [0, 1, 40, 41, 42, 43, 44, 45]


def test_budget_refusal_touches_nothing() -> None:
    a = arena(budget=16, block=4)
    other = a.new_cache()
    other.reserve(6)
    fill(other, list(range(6)))
    other.commit(6)
    c = a.new_cache()
    c.reserve(2)
    fill(c, [1, 2])
    c.commit(2)
    state = (list(c.blocks), c.length, list(other.blocks), other.length, a.used_blocks, list(a._free))
    data = a.k.clone()
    with pytest.raises(KVBudgetExceeded, match="budget"):
        c.reserve(7)  # 9 entries: 2 blocks more, 1 free of 4
    assert (list(c.blocks), c.length, list(other.blocks), other.length, a.used_blocks, list(a._free)) == state
    assert torch.equal(a.k, data) and keys(other) == list(range(6))
    c.reserve(6)  # 8 entries: 1 block more fits
    assert a.reserved_tokens == 16 and a.free_tokens == 0


def test_a_request_larger_than_the_arena_is_refused_before_anything_is_allocated() -> None:
    a = arena(budget=16, block=4)
    c = a.new_cache()
    with pytest.raises(KVBudgetExceeded):
        c.reserve(17)
    assert c.blocks == [] and a.used_blocks == 0 and a.num_blocks == 4


def test_released_blocks_are_reused() -> None:
    a = arena(budget=16, block=4, preallocate=True)
    assert a.num_blocks == 4  # the whole budget up front
    c = a.new_cache()
    c.reserve(16)
    held = set(c.blocks)
    c.release()
    assert a.used_blocks == 0 and c.released
    d = a.new_cache()
    d.reserve(16)
    assert set(d.blocks) == held
    with pytest.raises(RuntimeError):
        c.reserve(1)


def test_the_arena_grows_without_losing_entries() -> None:
    a = arena(block=4, initial_tokens=4)
    assert a.num_blocks == 1
    c = a.new_cache()
    c.reserve(3)
    fill(c, [1, 2, 3])
    c.commit(3)
    d = a.new_cache()
    d.reserve(12)  # the arena grows; c's entries are copied with it
    assert a.num_blocks >= 4 and keys(c) == [1, 2, 3]
    fill(d, list(range(12)))
    d.commit(12)
    assert keys(d) == list(range(12)) and keys(c) == [1, 2, 3]


def test_overflow_without_reserve_is_an_error() -> None:
    c = arena().new_cache()
    c.reserve(2)
    with pytest.raises(RuntimeError, match="reserve first"):
        c.will_write(5)


def test_selection() -> None:
    assert select_kv_cache("auto", "cpu")[0] == "contiguous"
    assert select_kv_cache("auto", "cuda")[0] == "paged"
    assert select_kv_cache("auto", "cuda", "sdpa", "bfloat16")[0] == "paged"
    assert select_kv_cache("auto", "cuda", "flash_attn", "bfloat16")[0] == "contiguous"  # that backend's caches
    assert select_kv_cache("paged", "cpu")[0] == "paged"
    assert select_kv_cache("contiguous", "cuda")[0] == "contiguous"
    with pytest.raises(ValueError, match="unknown kv cache"):
        select_kv_cache("ring", "cpu")
    with pytest.raises(ValueError, match="flash_attn runs on contiguous caches"):
        select_kv_cache("paged", "cuda", "flash_attn")
    with pytest.raises(ValueError, match="row-invariant"):
        select_kv_cache("paged", "cpu", "auto", "bfloat16")


def test_the_scratch_block_is_taken_once_from_the_budget_and_is_no_request_s():
    a = arena(budget=8, block=4)
    c = a.new_cache()
    c.reserve(4)
    block = a.take_scratch()
    assert a.take_scratch() == block and block not in c.blocks
    assert a.reserved_tokens == 4 and a.used_blocks == 2  # counted against the budget, reported as no cache's
    with pytest.raises(KVBudgetExceeded):
        a.new_cache().reserve(1)  # the budget's last block is the scratch block
    c.release()
    assert a.reserved_tokens == 0 and a.take_scratch() == block
    full = arena(budget=4, block=4)
    full.new_cache().reserve(4)
    with pytest.raises(KVBudgetExceeded):
        full.take_scratch()
    assert full.scratch_block is None
