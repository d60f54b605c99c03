"""Paged attention that reads the arena in place: ``torch.nn.attention.flex_attention`` over every
slot of a layer, with a block mask that says which slots each new token sees.

:func:`~common.runtime.paged_attention.paged_attend` gathers each sequence's entries into a padded
``[B, S]`` view before ``sdpa``; this instead hands flex attention the layer's slots as they lie
(``k[layer]: [slots, Hkv, D]`` viewed as ``[1, Hkv, slots, D]``, no copy) and every new token of
the pass as one query sequence ``[1, H, N, D]``. What token ``n`` (of sequence ``b``, new token ``i``)
may see is a mask over physical slots, built once per pass (:class:`FlexPlan`) from the pass's
:class:`~common.runtime.paged_attention.PagedPlan`:

- ``slot_seq [slots]``: the sequence of this pass whose entry a slot holds (-1: none of them);
- ``slot_entry [slots]``: that entry's logical index;
- ``allowed [B, T, S]``: the plan's tree mask (committed entries and ancestors-or-self).

``mask_mod(n, slot) = slot_seq[slot] == seq(n) and allowed[seq(n), i(n), slot_entry[slot]]``, and the
block mask made from it lets flex attention skip every 128-slot block that holds none of a query's
entries. It computes what every backend computes (:mod:`common.runtime.attention`). On a CPU flex
attention runs eagerly, slowly, which is enough for tests; on CUDA it is compiled once with dynamic
shapes. ``--attention flex`` asks for it; ``auto`` never picks it, having no figure yet that says it is
faster than the gathered view anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from common.runtime.kv_arena import KVArena
from common.runtime.paged_attention import PagedPlan


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def _flex(device_type: str) -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=True)
    return flex_attention


@dataclass(frozen=True)
class FlexPlan:
    block_mask: Any  # torch.nn.attention.flex_attention.BlockMask over [N, slots]


def plan_flex(plan: PagedPlan, arena: KVArena) -> FlexPlan:
    """The block mask of one pass over ``arena`` (shapes in the module docstring)."""
    from torch.nn.attention.flex_attention import create_block_mask

    dev = arena.device
    slots = arena.k.shape[1]
    B, T = plan.q_index.shape
    S = plan.kv_index.shape[1]
    cols = torch.arange(S, device=dev)
    valid = cols[None, :] < plan.seq_lens[:, None]  # [B, S]: entries that exist
    slot_seq = torch.full((slots,), -1, dtype=torch.long, device=dev)
    slot_entry = torch.zeros(slots, dtype=torch.long, device=dev)
    owners = torch.arange(B, device=dev)[:, None].expand(B, S)
    slot_seq[plan.kv_index[valid]] = owners[valid]
    slot_entry[plan.kv_index[valid]] = cols[None, :].expand(B, S)[valid]
    allowed = plan.mask[:, 0] == 0  # [B, T, S]
    q_seq = plan.out_index // T  # [N]: each packed row's sequence and new-token index
    q_pos = plan.out_index % T

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        seq = q_seq[q]
        return (slot_seq[kv] == seq) & allowed[seq, q_pos[q], slot_entry[kv]]

    n = plan.out_index.shape[0]
    return FlexPlan(create_block_mask(mask_mod, 1, None, n, slots, device=dev))


def flex_attend(q: torch.Tensor, arena: KVArena, layer: int, plan: FlexPlan, scale: float) -> torch.Tensor:
    """``q: [N, H, D]`` packed new-token queries -> ``[N, H, D]``, reading ``layer``'s slots in place
    (the new tokens' keys and values written first: :func:`~common.runtime.paged_attention.write_kv`)."""
    k = arena.k[layer].permute(1, 0, 2).unsqueeze(0).to(q.dtype)  # [1, Hkv, slots, D]
    v = arena.v[layer].permute(1, 0, 2).unsqueeze(0).to(q.dtype)
    out = _flex(q.device.type)(
        q.transpose(0, 1).unsqueeze(0),
        k,
        v,
        block_mask=plan.block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)
