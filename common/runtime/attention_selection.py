"""Which attention backend a runner gets: chosen once at start-up from the device, the dtype and
the head size, or asked for by name (the services' attention setting), and refused with a
``ValueError`` where the named one cannot run here. The backends themselves: :mod:`common.runtime.attention`
(``eager``, ``sdpa``, ``flash_attn``), :mod:`common.runtime.cpu_attention` (``cpu_kernel``) and
:mod:`common.runtime.invariant_bf16` (``invariant``).
"""

from __future__ import annotations

import torch

from common.runtime.attention import AttentionBackend, EagerBackend, FlashAttnBackend, SdpaBackend, flash_attn_available
from common.runtime.cpu_attention import cpu_kernel_backend
from common.runtime.invariant_bf16 import InvariantAttention, invariant_rows

BACKENDS = ("eager", "sdpa", "cpu_kernel", "flash_attn")


def select_backend(name: str, device: torch.device | str, dtype: torch.dtype, head_dim: int = 64) -> AttentionBackend:
    """``auto`` = ``flash_attn`` when importable on a CUDA device with a half dtype, ``cpu_kernel``
    in float32 on a CPU where it builds (``head_dim`` a multiple of 16), else ``sdpa``; ``cpu_kernel``
    by name also in bfloat16.

    Raises ``ValueError`` for an unknown name or an explicit ``flash_attn`` or ``cpu_kernel`` that
    cannot run here.
    """
    if name == "cpu_kernel" or (name == "auto" and dtype == torch.float32):  # bfloat16's auto: pick_backend below
        backend = cpu_kernel_backend(device, dtype, head_dim)
        if backend is not None:
            return backend
        if name == "cpu_kernel":
            raise ValueError(
                f"attention backend cpu_kernel needs float32 or bfloat16 on a CPU with AVX-512 or AVX2, "
                f"the project's kernels built and head_dim a multiple of 16 (device={device}, "
                f"dtype={dtype}, head_dim={head_dim}); use sdpa or eager"
            )
    if name == "auto":
        name = "flash_attn" if flash_attn_available(device, dtype) else "sdpa"
    if name == "eager":
        return EagerBackend()
    if name == "sdpa":
        return SdpaBackend()
    if name == "flash_attn":
        if not flash_attn_available(device, dtype):
            raise ValueError(
                "attention backend flash_attn needs the flash-attn package, a CUDA device and "
                f"float16/bfloat16 weights (device={device}, dtype={dtype}); use sdpa or eager"
            )
        return FlashAttnBackend()
    raise ValueError(f"unknown attention backend {name!r} (choose auto, {', '.join(BACKENDS)})")


def pick_backend(name: str, device: str | torch.device, dtype: torch.dtype, head_dim: int = 64) -> AttentionBackend:
    """The attention backend: ``auto`` on a CPU in bfloat16, where this CPU's bfloat16 products are
    row-invariant, is the project's kernel (float32 attention on float32 keys/values, every row
    alone) where it builds, else the row-invariant eager one
    (:class:`~common.runtime.invariant_bf16.InvariantAttention`); otherwise :func:`select_backend`."""
    if name in ("auto", InvariantAttention.name) and torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        rows = invariant_rows()
        if rows and name == "auto" and (kernel := cpu_kernel_backend(device, dtype, head_dim)) is not None:
            return kernel
        if rows:
            return InvariantAttention(rows)
        if name != "auto":
            raise ValueError("attention backend invariant needs a CPU whose bfloat16 products are row-invariant (AMX)")
    if name == InvariantAttention.name:
        raise ValueError("attention backend invariant is for bfloat16 on a CPU")
    return select_backend(name, device, dtype, head_dim)
