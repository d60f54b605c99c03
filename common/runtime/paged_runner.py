"""The runner's forward pass over the paged arena (:mod:`common.runtime.kv_arena`).

Same inputs and outputs as :meth:`LMRunner.forward <common.runtime.runner.LMRunner.forward>` (it is
called from there when the caches are :class:`~common.runtime.kv_arena.PagedCache` s); what differs
is the cache plumbing. The metadata of the pass (slot mapping, block table, gathered-view indices,
tree mask: :func:`~common.runtime.paged_attention.plan_paged`) is built once before the layers; each
layer then writes the new keys/values of every sequence with one indexed copy and attends them all
with one call (:func:`~common.runtime.paged_attention.paged_attend`). No Python runs per sequence
inside the layer loop, so the tensor operations of a pass are the same in number at any batch size:
the property that CUDA-graph capture and launch-bound GPUs care about.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from common.runtime.kv_arena import PagedCache
from common.runtime.paged_attention import paged_attend, plan_paged, write_kv

if TYPE_CHECKING:
    from common.runtime.runner import LMRunner, SeqInput


def forward_paged(runner: LMRunner, seqs: Sequence[SeqInput]) -> list[torch.Tensor]:
    """One forward pass of ``seqs`` (every cache a :class:`PagedCache` of one arena, with room
    reserved for its new tokens); returns per sequence the float32 logits of its wanted rows."""
    caches = [s.cache for s in seqs]
    arena = caches[0].arena  # type: ignore[union-attr]
    if any(not isinstance(c, PagedCache) or c.arena is not arena for c in caches):
        raise ValueError("a paged pass needs every sequence's cache in the same arena")
    layout, ids, h, cos, sin = runner.prepare(seqs)
    for c, t in zip(caches, layout.new_lens):
        c.will_write(t)  # checks the room the slot mapping needs
    plan = plan_paged(layout, caches, arena, h.dtype)  # type: ignore[arg-type]
    N, H, D = ids.shape[0], runner.num_heads, runner.head_dim
    for li, layer in enumerate(runner.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q, k, v = runner.qkv(li, x, cos, sin)
        write_kv(arena, li, k, v, plan)
        o = paged_attend(q, arena, li, plan, runner.scale)  # [N, H, D]
        h = runner.mlp(li, h + attn.o_proj(o.reshape(N, H * D)))
    return runner.logits(h, seqs, layout)
