"""Tree layouts (positions, masks, paths) and agreement of the attention backends."""

from __future__ import annotations

import math

import pytest
import torch

from common.runtime.attention import (
    BatchLayout,
    EagerBackend,
    FlashAttnBackend,
    SdpaBackend,
    pad_kv,
    reference_varlen,
)
from common.runtime.attention_selection import select_backend

# committed cache of 5, then: 2 uncached tokens (chain), and a tree under the last of them:
#   u0 -> u1 -> {a(2) -> {c(4), d(5) -> e(6)}, b(3)}
TREE_PARENTS = (-1, 0, 1, 1, 2, 2, 5)


def test_positions_are_depths_not_indices() -> None:
    layout = BatchLayout(past_lens=(5,), parents=(TREE_PARENTS,))
    assert layout.depths(0) == [0, 1, 2, 2, 3, 3, 4]
    assert layout.positions(0) == [5, 6, 7, 7, 8, 8, 9]


def test_chain_positions_follow_the_cache() -> None:
    layout = BatchLayout(past_lens=(0, 3), parents=((-1, 0, 1), (-1,)))
    assert layout.positions(0) == [0, 1, 2]
    assert layout.positions(1) == [3]
    assert layout.offsets == (0, 3) and layout.num_tokens == 4
    assert layout.is_chain(0) and layout.is_chain(1)


def test_ancestor_mask_sees_self_and_ancestors_only() -> None:
    m = BatchLayout(past_lens=(5,), parents=(TREE_PARENTS,)).ancestor_mask(0)
    expect = {
        0: {0},
        1: {0, 1},
        2: {0, 1, 2},
        3: {0, 1, 3},
        4: {0, 1, 2, 4},
        5: {0, 1, 2, 5},
        6: {0, 1, 2, 5, 6},
    }
    for i, visible in expect.items():
        assert {j for j in range(7) if m[i, j]} == visible, i


def test_paths_are_root_to_leaf() -> None:
    layout = BatchLayout(past_lens=(5,), parents=(TREE_PARENTS,))
    assert layout.paths(0) == [[0, 1, 3], [0, 1, 2, 4], [0, 1, 2, 5, 6]]
    assert BatchLayout(past_lens=(0,), parents=((-1, 0, 1),)).paths(0) == [[0, 1, 2]]
    assert BatchLayout(past_lens=(0,), parents=((-1, -1),)).paths(0) == [[0], [1]]


def brute_force(q, kvs, layout, scale):
    """Per query: softmax over exactly the keys it may see (cache + ancestors-or-self)."""
    out = torch.empty_like(q)
    H = q.shape[1]
    for b, off in enumerate(layout.offsets):
        k, v = kvs[b]
        rep = H // k.shape[0]
        L = layout.past_lens[b]
        anc = layout.ancestor_mask(b)
        for i in range(layout.new_lens[b]):
            idx = list(range(L)) + [L + j for j in range(layout.new_lens[b]) if anc[i, j]]
            kk = k[:, idx].repeat_interleave(rep, 0)  # [H, n, D]
            vv = v[:, idx].repeat_interleave(rep, 0)
            w = torch.softmax((kk @ q[off + i].unsqueeze(-1)).squeeze(-1) * scale, dim=-1)  # [H, n]
            out[off + i] = (w.unsqueeze(-1) * vv).sum(1)
    return out


def random_batch(seed: int, H: int = 4, Hkv: int = 2, D: int = 8, layout: BatchLayout | None = None):
    g = torch.Generator().manual_seed(seed)
    layout = layout or BatchLayout(
        past_lens=(5, 0, 12, 3),
        parents=(TREE_PARENTS, (-1, 0, 1, 2), (-1,), (-1, -1, 0, 1, 1, 1)),
    )
    q = torch.randn(layout.num_tokens, H, D, generator=g)
    kvs = []
    for L, t in zip(layout.past_lens, layout.new_lens):
        kvs.append((torch.randn(Hkv, L + t, D, generator=g), torch.randn(Hkv, L + t, D, generator=g)))
    return layout, q, kvs


@pytest.mark.parametrize(
    "backend",
    [
        EagerBackend(),
        SdpaBackend(),
        EagerBackend(together=True),
        SdpaBackend(together=True),
        FlashAttnBackend(varlen_fn=reference_varlen),
    ],
    ids=lambda b: b.name + ("-together" if getattr(b, "together", None) else ""),
)
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
def test_backends_match_brute_force(backend, heads) -> None:
    layout, q, kvs = random_batch(0, H=heads[0], Hkv=heads[1])
    scale = 1 / math.sqrt(q.shape[-1])
    want = brute_force(q, kvs, layout, scale)
    got = backend.attend(q, kvs, backend.plan(layout, torch.device("cpu")), scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_single_sequence_without_padding() -> None:
    layout = BatchLayout(past_lens=(7,), parents=((-1,),))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 8, generator=g)
    kvs = [(torch.randn(2, 8, 8, generator=g), torch.randn(2, 8, 8, generator=g))]
    plan = SdpaBackend().plan(layout, torch.device("cpu"))
    assert len(plan) == 1 and plan[0].mask is None and plan[0].rows is None  # every row of the pass: not put back
    torch.testing.assert_close(SdpaBackend().attend(q, kvs, plan, 0.3), brute_force(q, kvs, layout, 0.3))


# a verify pass: plain requests (one new token each) beside trees, two of them of one size
VERIFY_PASS = BatchLayout(
    past_lens=(5, 9, 12, 3, 7, 2),
    parents=((-1,), (-1, 0, 0), (-1,), (-1, -1, 0), (-1,), TREE_PARENTS),
)


@pytest.mark.parametrize("backend", [EagerBackend(), SdpaBackend()], ids=lambda b: b.name)
def test_on_the_cpu_every_sequence_is_attended_alone_on_its_cache_in_place(backend) -> None:
    layout, q, kvs = random_batch(2, layout=VERIFY_PASS)
    plan = backend.plan(layout, torch.device("cpu"))
    assert [g.seqs for g in plan] == [(b,) for b in range(layout.batch)]
    for g in plan:
        (b,) = g.seqs
        L, t = layout.past_lens[b], layout.new_lens[b]
        # its own rows, its keys read where they are (no padded copy)
        assert g.rows == slice(layout.offsets[b], layout.offsets[b] + t)
        assert g.new == t and g.total == kvs[b][0].shape[1] == L + t
        assert pad_kv([kvs[b]], g.total)[0].data_ptr() == kvs[b][0].data_ptr()
        if t == 1:  # sees every key: no mask
            assert g.mask is None
        else:  # its cache, and its new tokens' ancestors-or-self
            assert torch.equal(g.mask[0, 0, :, :L], torch.ones(t, L, dtype=torch.bool))
            assert torch.equal(g.mask[0, 0, :, L:], layout.ancestor_mask(b))
    scale = 1 / math.sqrt(q.shape[-1])
    torch.testing.assert_close(
        backend.attend(q, kvs, plan, scale), brute_force(q, kvs, layout, scale), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("backend", [EagerBackend(together=True), SdpaBackend(together=True)], ids=lambda b: b.name)
def test_together_the_sequences_of_one_count_of_new_tokens_are_padded_into_one_call(backend) -> None:
    layout, q, kvs = random_batch(3, layout=VERIFY_PASS)
    plan = backend.plan(layout, torch.device("cpu"))
    assert sorted((g.new, g.seqs) for g in plan) == [(1, (0, 2, 4)), (3, (1, 3)), (7, (5,))]
    for g in plan:
        assert g.total == max(layout.past_lens[b] for b in g.seqs) + g.new
        rows = [layout.offsets[b] + i for b in g.seqs for i in range(g.new)]
        assert (g.rows.tolist() if isinstance(g.rows, torch.Tensor) else list(range(g.rows.start, g.rows.stop))) == rows
        for i, b in enumerate(g.seqs):  # its cache and its new tokens' ancestors-or-self; its padding never
            L, t = layout.past_lens[b], g.new
            want = torch.zeros(t, g.total, dtype=torch.bool)
            want[:, :L] = True
            want[:, L : L + t] = layout.ancestor_mask(b)
            assert torch.equal(g.mask[i, 0], want)
    scale = 1 / math.sqrt(q.shape[-1])
    torch.testing.assert_close(
        backend.attend(q, kvs, plan, scale), brute_force(q, kvs, layout, scale), rtol=1e-5, atol=1e-5
    )


def test_away_from_the_cpu_the_dense_backends_pad_together_unless_told() -> None:
    layout = BatchLayout(past_lens=(4, 9, 6), parents=((-1,), (-1,), (-1, 0)))
    meta = torch.device("meta")  # any device but the CPU: the choice is made by device type
    assert [g.seqs for g in SdpaBackend().plan(layout, meta)] == [(0, 1), (2,)]
    assert [g.seqs for g in SdpaBackend(together=False).plan(layout, meta)] == [(0,), (1,), (2,)]
    assert [g.seqs for g in SdpaBackend().plan(layout, torch.device("cpu"))] == [(0,), (1,), (2,)]
    # one count of new tokens, one length: one call, every row in place, no mask
    (g,) = SdpaBackend(together=True).plan(BatchLayout(past_lens=(5, 5), parents=((-1,), (-1,))), torch.device("cpu"))
    assert g.rows is None and g.mask is None and g.total == 6


def test_select_backend() -> None:
    from common.runtime.streamed_linear import extension

    own = "cpu_kernel" if extension() is not None else "sdpa"  # float32 on a CPU: the project's kernel where it builds
    assert select_backend("auto", "cpu", torch.float32).name == own
    assert select_backend("auto", "cpu", torch.float32, head_dim=24).name == "sdpa"  # not a multiple of 16
    assert select_backend("auto", "cpu", torch.bfloat16).name == "sdpa"
    with pytest.raises(ValueError, match="cpu_kernel needs"):
        select_backend("cpu_kernel", "cpu", torch.float32, head_dim=24)
    assert select_backend("eager", "cpu", torch.float32).name == "eager"
    with pytest.raises(ValueError, match="flash_attn needs"):
        select_backend("flash_attn", "cpu", torch.float32)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("xformers", "cpu", torch.float32)
