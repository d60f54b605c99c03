"""The project's CPU attention kernel (``cpu_kernel``): it equals attention computed by brute force
for decode steps, trees and prompts in one pass, writes every sequence's new keys and values into its
cache, and gives a sequence the same bits whatever the batch around it."""

from __future__ import annotations

import math

import pytest
import torch

from common.runtime.attention import BatchLayout, SdpaBackend
from common.runtime.cpu_attention import SHORT, CpuKernelBackend, cpu_kernel_available
from common.runtime.kv_cache import KVPool
from common.runtime.test_attention import TREE_PARENTS, brute_force


@pytest.fixture(scope="module")
def backend() -> CpuKernelBackend:
    kernel = cpu_kernel_available("cpu", torch.float32)
    if kernel is None:
        pytest.skip("the project's CPU kernels are not built here")
    return CpuKernelBackend(kernel)


# decode steps, a chain, a tree, a prompt longer than SHORT (attended by sdpa), and a new sequence
PASS = BatchLayout(
    past_lens=(30, 0, 12, 5, 7, 0),
    parents=((-1,), tuple(range(-1, SHORT + 4)), (-1, 0, 1, 2), TREE_PARENTS, (-1,), (-1, 0, 1)),
)


def batch(layout: BatchLayout, H: int, Hkv: int, D: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(layout.num_tokens, H, D, generator=g)
    # each sequence's keys/values are a view of a larger cache (room beyond it), as the runner's are
    kvs = []
    for L, t in zip(layout.past_lens, layout.new_lens):
        k, v = torch.randn(Hkv, L + t + 5, D, generator=g), torch.randn(Hkv, L + t + 5, D, generator=g)
        kvs.append((k[:, : L + t], v[:, : L + t]))
    return q, kvs


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("D", [16, 64])
def test_it_equals_brute_force_for_every_kind_of_sequence(backend: CpuKernelBackend, heads, D: int) -> None:
    q, kvs = batch(PASS, *heads, D, seed=D + heads[1])
    scale = 1 / math.sqrt(D)
    plan = backend.plan(PASS, torch.device("cpu"))
    assert plan.attend == [t <= SHORT for t in PASS.new_lens] and [g.seqs for g in plan.long] == [(1,)]
    torch.testing.assert_close(
        backend.attend(q, kvs, plan, scale), brute_force(q, kvs, PASS, scale), rtol=1e-5, atol=1e-5
    )


def test_it_writes_every_new_key_and_value_into_the_caches(backend: CpuKernelBackend) -> None:
    q, kvs = batch(PASS, 9, 3, 64, seed=7)
    N = PASS.num_tokens
    g = torch.Generator().manual_seed(8)
    k_new, v_new = torch.randn(N, 3, 64, generator=g), torch.randn(N, 3, 64, generator=g)
    out = backend.attend_writing(q, k_new, v_new, kvs, backend.plan(PASS, torch.device("cpu")), 0.125)
    for (k, v), off, t in zip(kvs, PASS.offsets, PASS.new_lens):
        assert torch.equal(k[:, -t:], k_new[off : off + t].transpose(0, 1))
        assert torch.equal(v[:, -t:], v_new[off : off + t].transpose(0, 1))
    torch.testing.assert_close(out, brute_force(q, kvs, PASS, 0.125), rtol=1e-5, atol=1e-5)


def test_a_sequence_gets_the_same_bits_alone_or_in_any_batch(backend: CpuKernelBackend) -> None:
    q, kvs = batch(PASS, 9, 3, 64, seed=3)
    together = backend.attend(q, kvs, backend.plan(PASS, torch.device("cpu")), 0.125)
    for b in (0, 2, 3):  # decode step, chain, tree
        off, t = PASS.offsets[b], PASS.new_lens[b]
        alone = BatchLayout(past_lens=(PASS.past_lens[b],), parents=(PASS.parents[b],))
        got = backend.attend(q[off : off + t], [kvs[b]], backend.plan(alone, torch.device("cpu")), 0.125)
        assert torch.equal(got, together[off : off + t])


def test_a_pass_gets_the_same_bits_on_any_number_of_threads(backend: CpuKernelBackend, torch_threads) -> None:
    # (sequence, head) items are claimed by whichever thread is free; seven threads on a small machine keep some
    # preempted, so their items are taken by the others
    q, kvs = batch(PASS, 9, 3, 64, seed=5)
    plan = backend.plan(PASS, torch.device("cpu"))
    torch_threads(1)
    alone = backend.attend(q, kvs, plan, 0.125)
    for threads in (2, 3, 7):
        torch_threads(threads)
        for _ in range(3):
            assert torch.equal(backend.attend(q, kvs, plan, 0.125), alone), threads


def test_it_agrees_with_sdpa_on_a_decode_pass(backend: CpuKernelBackend) -> None:
    layout = BatchLayout(past_lens=tuple(range(40, 56)), parents=((-1,),) * 16)
    q, kvs = batch(layout, 9, 3, 64, seed=5)
    sdpa = SdpaBackend()
    torch.testing.assert_close(
        backend.attend(q, kvs, backend.plan(layout, torch.device("cpu")), 0.125),
        sdpa.attend(q, kvs, sdpa.plan(layout, torch.device("cpu")), 0.125),
        rtol=1e-5,
        atol=1e-5,
    )


def test_shapes_it_cannot_take_are_refused(backend: CpuKernelBackend) -> None:
    layout = BatchLayout(past_lens=(3,), parents=((-1,),))
    q, kvs = batch(layout, 4, 2, 8, seed=1)  # head_dim 8: not a multiple of 16
    with pytest.raises(RuntimeError, match="multiple of 16"):
        backend.attend(q, kvs, backend.plan(layout, torch.device("cpu")), 0.3)


def test_a_cache_without_room_is_refused_before_anything_is_written() -> None:
    pool = KVPool(num_layers=2, num_kv_heads=1, head_dim=16, dtype=torch.float32, device="cpu", token_budget=None)
    cache = pool.new_cache()
    cache.reserve(3)
    with pytest.raises(RuntimeError, match="reserve first"):
        cache.will_write(cache.capacity + 1)
    cache.will_write(3)
    assert cache.pending == 3 and cache.view(0, 3)[0].shape == (1, 3, 16)


def test_a_tree_row_gets_the_bits_of_the_plain_step_for_its_token(backend: CpuKernelBackend) -> None:
    # row i of a tree sees the cache and its ancestors-or-self; a plain step on a cache holding exactly
    # those keys must give the same bits, so verifying a node computes what decoding it would
    layout = BatchLayout(past_lens=(20,), parents=(TREE_PARENTS,))
    q, kvs = batch(layout, 9, 3, 64, seed=9)
    tree = backend.attend(q, kvs, backend.plan(layout, torch.device("cpu")), 0.125)
    k, v = kvs[0]
    anc = layout.ancestor_mask(0)
    for i in range(len(TREE_PARENTS)):
        keep = list(range(20)) + [20 + j for j in range(len(TREE_PARENTS)) if anc[i, j]]
        step = BatchLayout(past_lens=(len(keep) - 1,), parents=((-1,),))
        got = backend.attend(
            q[i : i + 1],
            [(k[:, keep].contiguous(), v[:, keep].contiguous())],
            backend.plan(step, torch.device("cpu")),
            0.125,
        )
        assert torch.equal(got, tree[i : i + 1]), i
