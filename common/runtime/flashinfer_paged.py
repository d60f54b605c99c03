"""Paged attention by FlashInfer's batch prefill kernel over the arena, with the tree as its custom mask.

The arena's layer tensors ``k[layer]: [blocks * block_size, Hkv, D]`` are, viewed as ``[blocks,
block_size, Hkv, D]``, FlashInfer's paged KV cache in its ``NHD`` layout, so the kernel reads them in
place. What it needs besides, in FlashInfer's CSR form, is built once per pass from the pass's
:class:`~common.runtime.paged_attention.PagedPlan` by vectorised operations (:func:`plan_flashinfer`):

- ``qo_indptr [B + 1]``: sequence ``b``'s new tokens are packed rows ``qo_indptr[b]:qo_indptr[b+1]``
  (the packed order of the pass: sequences in order, each one's new tokens together);
- ``kv_indptr [B + 1]``, ``kv_indices [pages]``, ``last_page_len [B]``: the blocks that hold
  sequence ``b``'s ``L_b + t_b`` entries, in logical order, and how many entries its last one holds;
- ``custom_mask [sum_b t_b * (L_b + t_b)]``: for each sequence, row-major, which entries each new
  token sees (the committed ones and its ancestors-or-self in the tree): the plan's mask cut to
  the sequence's own rows and entries, no padding.

The wrapper is planned once per pass (one host-to-device copy of that metadata) and run once a
layer. :func:`reference_attend` computes from the same metadata what the kernel is documented to
compute, in plain torch: on a CPU, where FlashInfer does not run, it is what tests hold against
:func:`~common.runtime.paged_attention.paged_attend`, so the metadata a GPU will be given is checked
everywhere. ``--attention flashinfer`` asks for it (CUDA, the ``flashinfer-python`` package);
``auto`` does not pick it until a GPU run of the suite says it is faster than the gathered view.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from common.runtime.kv_arena import KVArena
from common.runtime.paged_attention import PagedPlan

PACKAGE = "flashinfer-python"
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's float workspace, one per device


def flashinfer_available(device: torch.device | str) -> bool:
    """Whether the kernel can run here: a CUDA device and the ``flashinfer`` module importable."""
    return missing_reason(device) is None


def missing_reason(device: torch.device | str) -> str | None:
    """Why ``--attention flashinfer`` cannot run on ``device`` (one line, naming the way out), or None."""
    if torch.device(device).type != "cuda":
        return (
            f"attention backend flashinfer runs on CUDA only (device {device}); use --attention auto, "
            "or flex for the arena read in place"
        )
    if importlib.util.find_spec("flashinfer") is None:
        return (
            f"attention backend flashinfer needs the {PACKAGE} package (pip install {PACKAGE}); "
            "or use --attention flex or auto"
        )
    return None


@dataclass(frozen=True)
class FlashInferPlan:
    """FlashInfer's metadata of one pass (module docstring), on the arena's device, int32 as it wants."""

    qo_indptr: torch.Tensor  # [B + 1]
    kv_indptr: torch.Tensor  # [B + 1]
    kv_indices: torch.Tensor  # [pages]
    last_page_len: torch.Tensor  # [B]
    custom_mask: torch.Tensor  # [sum_b t_b * (L_b + t_b)] bool
    wrapper: Any = None  # the planned BatchPrefillWithPagedKVCacheWrapper (CUDA), else None


def plan_flashinfer(
    plan: PagedPlan, arena: KVArena, num_heads: int, head_dim: int, scale: float, wrapper: Any = None
) -> FlashInferPlan:
    """The metadata of ``plan``'s pass; with ``wrapper`` (a FlashInfer prefill wrapper over the
    arena's device), the wrapper planned with it for queries of ``arena``'s dtype."""
    bs = arena.block_size
    B, T = plan.q_index.shape
    S = plan.kv_index.shape[1]
    dev = plan.seq_lens.device
    new = torch.bincount(plan.out_index // T, minlength=B)  # [B]: t_b
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    qo_indptr = torch.cat([zero, new.cumsum(0)])
    pages = (plan.seq_lens + bs - 1) // bs  # [B]
    kv_indptr = torch.cat([zero, pages.cumsum(0)])
    width = plan.block_table.shape[1]
    kv_indices = plan.block_table[torch.arange(width, device=dev)[None, :] < pages[:, None]]
    last_page_len = plan.seq_lens - (pages - 1) * bs
    rows = torch.arange(T, device=dev)[None, :] < new[:, None]  # [B, T]: real new tokens
    cols = torch.arange(S, device=dev)[None, :] < plan.seq_lens[:, None]  # [B, S]: existing entries
    allowed = plan.mask[:, 0] == 0  # [B, T, S]
    custom_mask = allowed[rows[:, :, None] & cols[:, None, :]]  # row-major per sequence, b then i then j
    i32 = [t.to(torch.int32) for t in (qo_indptr, kv_indptr, kv_indices, last_page_len)]
    if wrapper is not None:
        wrapper.plan(
            *i32,
            num_heads,
            arena.num_kv_heads,
            head_dim,
            bs,
            custom_mask=custom_mask,
            causal=False,
            sm_scale=scale,
            q_data_type=arena.dtype,
            kv_data_type=arena.dtype,
        )
    return FlashInferPlan(*i32, custom_mask, wrapper)


def new_wrapper(device: torch.device | str) -> Any:
    """FlashInfer's batch prefill wrapper over a paged cache in the ``NHD`` layout, with its workspace."""
    import flashinfer  # type: ignore[import-not-found]

    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")


def pages_of(arena: KVArena, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer``'s keys and values as FlashInfer's ``NHD`` pages ``[blocks, block_size, Hkv, D]`` (views)."""
    shape = (-1, arena.block_size, arena.num_kv_heads, arena.head_dim)
    return arena.k[layer].view(shape), arena.v[layer].view(shape)


def flashinfer_attend(q: torch.Tensor, arena: KVArena, layer: int, plan: FlashInferPlan) -> torch.Tensor:
    """``q: [N, H, D]`` packed new-token queries -> ``[N, H, D]`` by the planned kernel (the new
    tokens' keys and values written first: :func:`~common.runtime.paged_attention.write_kv`)."""
    return plan.wrapper.run(q.to(arena.dtype), pages_of(arena, layer)).to(q.dtype)


def reference_attend(q: torch.Tensor, arena: KVArena, layer: int, plan: FlashInferPlan, scale: float) -> torch.Tensor:
    """What the kernel computes from ``plan``, in plain torch, sequence by sequence: the check of
    the metadata where FlashInfer does not run (a test's, never a pass's: it loops in Python)."""
    k_pages, v_pages = pages_of(arena, layer)
    out = torch.empty_like(q)
    qo, kv, idx, last = (t.tolist() for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.last_page_len))
    mask_at = 0
    for b in range(len(qo) - 1):
        blocks = idx[kv[b] : kv[b + 1]]
        n = (len(blocks) - 1) * arena.block_size + last[b]
        k = k_pages[blocks].reshape(-1, arena.num_kv_heads, arena.head_dim)[:n].to(q.dtype)
        v = v_pages[blocks].reshape(-1, arena.num_kv_heads, arena.head_dim)[:n].to(q.dtype)
        rows = q[qo[b] : qo[b + 1]]  # [t, H, D]
        t = rows.shape[0]
        seen = plan.custom_mask[mask_at : mask_at + t * n].view(t, n)
        mask_at += t * n
        group = rows.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("thd,nhd->htn", rows, k) * scale
        scores = scores.masked_fill(~seen[None], float("-inf"))
        out[qo[b] : qo[b + 1]] = torch.einsum("htn,nhd->thd", scores.softmax(-1), v)
    return out
