"""The ``cpu_kernel`` attention backend: the project's own CPU kernel (``csrc/cache_attention.cpp``,
built into one extension with the projection kernels of :mod:`common.runtime.streamed_linear`) for
every sequence of a pass with a few new tokens, all in one call a layer; a prompt's many new tokens
go to ``sdpa`` (:class:`~common.runtime.attention.SdpaBackend`). What it computes is what every
backend computes (:mod:`common.runtime.attention`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.runtime.attention import KV, BatchLayout, GroupPlan, SdpaBackend, dense_plans
from common.runtime.streamed_linear import extension

SHORT = 32  # new tokens up to which a sequence is attended by the kernel; a longer one (a prompt) by sdpa


@dataclass
class KernelPlan:
    """One pass of :class:`CpuKernelBackend`: every sequence's rows (the kernel writes every one's new
    keys and values), which ones it attends (``attend``, their ancestor masks flattened one after the
    other), and the long ones planned as ``sdpa`` plans them."""

    offsets: list[int]
    lens: list[int]
    attend: list[bool]
    mask: torch.Tensor  # bool, sum of t_b * t_b over the attended sequences
    mask_offsets: list[int]
    long: tuple[GroupPlan, ...]


class CpuKernelBackend(SdpaBackend):
    """Every sequence with at most :data:`SHORT` new tokens (a decode step, a draft tree) attended in
    one call a layer by the project's kernel (``csrc/cache_attention.cpp``), which also writes every
    sequence's new keys and values into its cache; the others (prompts) attended alone by ``sdpa``.
    float32 on the CPU, ``head_dim`` a multiple of 16.

    Why: ``sdpa`` and the per-sequence tensor operations around it (writing the cache, slicing the
    rows, putting them back) cost a fixed overhead per sequence and layer on the CPU, which for a
    small model is a large share of a request's pass; the kernel's one call a layer pays it once for
    the whole pass, and reads each key and value row once for the query heads that share it. Each
    query row is computed alone in a fixed order (float32 softmax), so a sequence's result does not
    depend on the batch around it.

    A bfloat16 model (on a CPU with AMX, its projections row-invariant:
    :mod:`common.runtime.invariant_bf16`) keeps its keys and values in float32 (bfloat16 values,
    exact in float32) and is attended in float32, its output rounded to bfloat16 once: a row's result
    is still the row's alone, and the same kernel serves both dtypes. There every sequence goes to the
    kernel (``short=None``), a prompt too: whether a prompt's rows met ``sdpa`` or the kernel would
    depend on what else its pass held (a prompt alone, or a prompt and a draft tree), and ``sdpa``'s
    sums differ from the kernel's in the last bits, which bfloat16's rounding turns into different
    tokens (in float32, only at exact ties). The kernel's cost grows with a prompt's length squared
    (32 rows at a time), so ``sdpa`` keeps float32's prompts."""

    name = "cpu_kernel"
    writes_new_kv = True
    cache_dtype = torch.float32

    def __init__(self, kernel: Callable[..., None], short: int | None = SHORT) -> None:
        super().__init__(together=False)
        self.kernel = kernel
        self.short = short  # None: every sequence by the kernel (bfloat16: a prompt's rows too, see above)

    def plan(self, layout: BatchLayout, device: torch.device) -> KernelPlan:
        lens = list(layout.new_lens)
        short = self.short if self.short is not None else max(lens, default=0)
        attend = [0 < t <= short for t in lens]
        masks, mask_offsets, at = [], [], 0
        for b, t in enumerate(lens):
            mask_offsets.append(at)
            if attend[b]:
                masks.append(layout.ancestor_mask(b).reshape(-1) if t > 1 else torch.ones(1, dtype=torch.bool))
                at += t * t
        mask = torch.cat(masks) if masks else torch.ones(0, dtype=torch.bool)
        long = frozenset(b for b, t in enumerate(lens) if t > short)
        return KernelPlan(
            list(layout.offsets),
            lens,
            attend,
            mask,
            mask_offsets,
            dense_plans(layout, device, together=False, only=long) if long else (),
        )

    def attend(self, q: torch.Tensor, kvs: Sequence[KV], plan: KernelPlan, scale: float) -> torch.Tensor:
        """With the new keys/values already in ``kvs`` (each sequence's last ``t_b`` entries)."""
        k, v = (torch.cat([kv[i][:, -t:].transpose(0, 1) for kv, t in zip(kvs, plan.lens)]) for i in (0, 1))
        return self.attend_writing(q, k, v, kvs, plan, scale)

    def attend_writing(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kvs: Sequence[KV], plan: KernelPlan, scale: float
    ) -> torch.Tensor:
        dtype = q.dtype  # float32, or bfloat16 attended in float32
        q = q.float().contiguous()
        out = torch.empty_like(q)
        self.kernel(
            q,
            k.float().contiguous(),
            v.float().contiguous(),
            [kv[0] for kv in kvs],
            [kv[1] for kv in kvs],
            plan.offsets,
            plan.lens,
            plan.attend,
            plan.mask,
            plan.mask_offsets,
            scale,
            out,
        )
        for p in plan.long:
            rows = slice(None) if p.rows is None else p.rows
            out[rows] = self.attend_group(q[rows], [kvs[b] for b in p.seqs], p, scale)
        return out.to(dtype)


def cpu_kernel_backend(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> CpuKernelBackend | None:
    """The kernel's backend where it can run (see :func:`cpu_kernel_available`, and ``head_dim`` a
    multiple of 16): short sequences only in float32, every sequence in bfloat16."""
    kernel = cpu_kernel_available(device, dtype) if head_dim % 16 == 0 else None
    return None if kernel is None else CpuKernelBackend(kernel, SHORT if dtype == torch.float32 else None)


def cpu_kernel_available(device: torch.device | str, dtype: torch.dtype) -> Callable[..., None] | None:
    """The kernel where it can run: float32 or bfloat16 (attended in float32) on a CPU whose projection
    kernels build (AVX-512 or AVX2)."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    module = extension()
    return None if module is None else module.cache_attention
