"""The paged arena's part of the runner's forward pass (:mod:`common.runtime.kv_arena`).

:meth:`LMRunner.forward <common.runtime.runner.LMRunner.forward>` runs the same layers over either
kind of cache; when the caches are :class:`~common.runtime.kv_arena.PagedCache` s, what differs is
the cache plumbing, which :class:`PagedPass` holds. The metadata of the pass (slot mapping, block
table, gathered-view indices, tree mask: :func:`~common.runtime.paged_attention.plan_paged`) is
built once before the layers; each
layer then writes the new keys/values of every sequence with one indexed copy and attends them all
with one call (:func:`~common.runtime.paged_attention.paged_attend`). No Python runs per sequence
inside the layer loop, so the tensor operations of a pass are the same in number at any batch size:
the property that CUDA-graph capture and launch-bound GPUs care about.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from common.runtime.attention import BatchLayout
from common.runtime.flashinfer_paged import flashinfer_attend, plan_flashinfer
from common.runtime.flex_paged import flex_attend, plan_flex
from common.runtime.kv_arena import PagedCache
from common.runtime.paged_attention import paged_attend, plan_paged, write_kv


class PagedPass:
    """One pass's plan over the arena: built once for ``caches`` (every one a :class:`PagedCache`
    of one arena, with room reserved for its new tokens, in the batch's order), then each layer's
    new keys/values written and attended in one call each (:meth:`attend`)."""

    def __init__(
        self,
        caches: Sequence[PagedCache],
        layout: BatchLayout,
        dtype: torch.dtype,
        attention: str = "sdpa",
        kernel: Any = None,
    ) -> None:
        """``attention``: "sdpa" (a gathered view), "flex" (the arena in place through a block mask)
        or "flashinfer" (FlashInfer's kernel in place; ``kernel``: ``(wrapper, num_heads, head_dim,
        scale)``, the runner's wrapper and the shapes it is planned for)."""
        arena = caches[0].arena
        if any(not isinstance(c, PagedCache) or c.arena is not arena for c in caches):
            raise ValueError("a paged pass needs every sequence's cache in the same arena")
        for c, t in zip(caches, layout.new_lens):
            c.will_write(t)  # checks the room the slot mapping needs
        self.arena = arena
        self.plan = plan_paged(layout, caches, arena, dtype)
        self.flex = plan_flex(self.plan, arena) if attention == "flex" else None
        self.flashinfer = None
        if attention == "flashinfer":
            wrapper, heads, head_dim, scale = kernel
            self.flashinfer = plan_flashinfer(self.plan, arena, heads, head_dim, scale, wrapper)

    def attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Layer ``li``: write ``k, v: [N, Hkv, D]`` into the arena, attend ``q: [N, H, D]`` -> ``[N, H, D]``."""
        write_kv(self.arena, li, k, v, self.plan)
        if self.flex is not None:
            return flex_attend(q, self.arena, li, self.flex, scale)
        if self.flashinfer is not None:
            return flashinfer_attend(q, self.arena, li, self.flashinfer)
        return paged_attend(q, self.arena, li, self.plan, scale)
