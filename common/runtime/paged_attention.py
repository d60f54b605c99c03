"""Attention of a batched pass over the paged arena (:mod:`common.runtime.kv_arena`), with the
metadata of the pass built once, before the layers, in a fixed number of tensor operations.

What it computes is what every backend computes (:mod:`common.runtime.attention`): each new token
of sequence ``b`` attends its ``L_b`` committed entries and its new-token ancestors-or-self.

:class:`PagedPlan` holds, for ``B`` sequences, ``N`` new tokens, at most ``T`` new tokens and ``S``
entries (committed + new) per sequence:

- ``slot_mapping [N]``: the arena slot of every new token (its logical entry ``L_b + i``), so one
  ``index_copy_`` a layer writes the keys/values of the whole pass;
- ``block_table [B, max_blocks]`` and ``seq_lens [B]``: what a paged kernel reads (FlashInfer's
  paged prefill and vLLM's paged attention take exactly these, with the tree mask);
- ``kv_index [B, S]``: the slots of every sequence's entries in logical order (padding: slot 0),
  the gathered view that ``sdpa`` reads on backends without a paged kernel (the fallback used
  here: on a CPU ``flex_attention`` is far slower eagerly, and compiled it takes tens of seconds
  per shape to build and is still slower than ``sdpa`` at a verify pass's shapes);
- ``q_index [B, T]`` and ``out_index [N]``: packed rows to padded ``[B, T]`` and back;
- ``mask [B, 1, T, S]`` additive (0 / -inf): committed entries, then the tree's ancestor masks at
  columns ``L_b + j``. A padding query row sees entry 0 (its output is dropped; no NaN).

Nothing in :func:`paged_attend` loops over sequences: its tensor operations per layer are the same
at any batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.runtime.attention import BatchLayout
from common.runtime.kv_arena import KVArena, PagedCache


@dataclass(frozen=True)
class PagedPlan:
    """Metadata of one pass over the arena (shapes in the module docstring)."""

    slot_mapping: torch.Tensor  # [N] long
    block_table: torch.Tensor  # [B, max_blocks] long (padding: block 0)
    seq_lens: torch.Tensor  # [B] long: L_b + t_b
    kv_index: torch.Tensor  # [B, S] long
    q_index: torch.Tensor  # [B, T] long (padding: row 0)
    out_index: torch.Tensor  # [N] long, into the flattened [B * T]
    mask: torch.Tensor  # [B, 1, T, S] additive, in the queries' dtype


def plan_paged(layout: BatchLayout, caches: Sequence[PagedCache], arena: KVArena, dtype: torch.dtype) -> PagedPlan:
    """Build the metadata of a pass: Python lists over the sequences' new tokens, turned into tensors
    and expanded by a fixed number of vectorised operations (none per sequence)."""
    dev, bs = arena.device, arena.block_size
    B, T = layout.batch, max(layout.new_lens)
    past, lens = layout.past_lens, layout.new_lens
    S = max(p + t for p, t in zip(past, lens))
    width = max(1, -(-S // bs))
    table = [c.blocks[:width] + [0] * (width - len(c.blocks[:width])) for c in caches]
    seq_of, entry_of, anc, q_rows, out_rows = [], [], [], [], []
    for b, (off, t) in enumerate(zip(layout.offsets, lens)):
        seq_of += [b] * t
        entry_of += range(past[b], past[b] + t)
        anc += [row + [False] * (T - t) for row in ancestor_rows(layout.parents[b])] + [[False] * T] * (T - t)
        q_rows += [*range(off, off + t), *([0] * (T - t))]
        out_rows += range(b * T, b * T + t)

    def long(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=dev)

    block_table, past_t, seq_lens = long(table), long(list(past)), long([p + t for p, t in zip(past, lens)])
    seq_t, entry_t = long(seq_of), long(entry_of)
    slot_mapping = block_table[seq_t, entry_t // bs] * bs + entry_t % bs
    anc_t = torch.tensor(anc, dtype=torch.bool, device=dev).view(B, T, T)
    kv_index, mask = entry_view(block_table, past_t, anc_t, S, bs, dtype)
    return PagedPlan(slot_mapping, block_table, seq_lens, kv_index, long(q_rows).view(B, T), long(out_rows), mask)


def entry_view(
    block_table: torch.Tensor, past: torch.Tensor, anc: torch.Tensor, S: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_index [B, S]`` and the additive ``mask [B, 1, T, S]`` (module docstring) of sequences with
    ``block_table [B, blocks]``, ``past [B]`` committed entries and new tokens' ancestor masks ``anc
    [B, T, T]`` (row ``i``: token ``i`` and its ancestors; all False for a padding row)."""
    B, T = anc.shape[0], anc.shape[1]
    dev = block_table.device
    cols = torch.arange(S, device=dev)
    kv_index = block_table[:, (cols // block_size)] * block_size + cols % block_size  # [B, S]
    allowed = cols[None, None, :] < past[:, None, None]  # [B, 1, S]: the committed entries
    allowed = allowed.expand(B, T, S).clone()
    tree_cols = (past[:, None] + torch.arange(T, device=dev)[None, :])[:, None, :].expand(B, T, T)
    # full, not zeros: zeros dispatches small and large tensors differently, which a count of ops would see
    wide = torch.full((B, T, S + T), False, dtype=torch.bool, device=dev)
    wide.scatter_(2, tree_cols, anc)
    allowed |= wide[:, :, :S]
    allowed[:, :, 0] |= ~allowed.any(-1)  # padding rows: see entry 0, dropped afterwards
    mask = torch.full((B, 1, T, S), float("-inf"), dtype=dtype, device=dev).masked_fill_(allowed[:, None], 0.0)
    return kv_index, mask


def ancestor_rows(parents: Sequence[int]) -> list[list[bool]]:
    """``[t][t]``: row ``i`` is True at ``i`` and its ancestors (plain Python: no tensor per sequence)."""
    rows: list[list[bool]] = []
    for i, p in enumerate(parents):
        row = list(rows[p]) if p >= 0 else [False] * len(parents)
        row[i] = True
        rows.append(row)
    return rows


def write_kv(arena: KVArena, layer: int, k: torch.Tensor, v: torch.Tensor, plan: PagedPlan) -> None:
    """Write the pass's new ``k, v: [N, Hkv, D]`` into their slots of ``layer``: one indexed copy each."""
    arena.k[layer].index_copy_(0, plan.slot_mapping, k.to(arena.dtype))
    arena.v[layer].index_copy_(0, plan.slot_mapping, v.to(arena.dtype))


def paged_attend(q: torch.Tensor, arena: KVArena, layer: int, plan: PagedPlan, scale: float) -> torch.Tensor:
    """``q: [N, H, D]`` packed new-token queries -> ``[N, H, D]``, over the entries of ``layer``
    (the new tokens' included: :func:`write_kv` first)."""
    N, H, D = q.shape
    B, T = plan.q_index.shape
    qp = q[plan.q_index].transpose(1, 2)  # [B, H, T, D]
    k = arena.k[layer][plan.kv_index].transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
    v = arena.v[layer][plan.kv_index].transpose(1, 2).to(q.dtype)
    o = F.scaled_dot_product_attention(qp, k, v, attn_mask=plan.mask, scale=scale, enable_gqa=H != k.shape[1])
    return o.transpose(1, 2).reshape(B * T, H, D)[plan.out_index]
