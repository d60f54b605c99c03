"""Weights that are exactly 8-bit codes in blocks: found in a float32 weight, kept in the block-code
panel kernel's layout (``csrc/streamed_linear.cpp``: ``block_panel_linear``).

A checkpoint converted from a quantized one holds float32 weights that are each ``d * q + m`` for an
integer code ``q`` and a scale ``d`` and offset ``m`` per block of 32 inner elements of an output row
(float16 both): GGUF's Q8_0 (``m`` = 0, ``q`` in -127..127) and Q4_1 (``m`` = the block's least
weight, ``q`` in 0..15) are that form, and SmolLM2-135M's GGUF holds every projection as Q4_1 and its
tied embedding as Q8_0. Read as float32, such a pass moves 538 MB of weights; read as codes and
scales, 151 MB. The kernel dequantizes the codes in registers (past 16 rows into a chunk that stays
in L1) and sums with the panel kernel's products in its order, so its results are the panel
kernel's bit for bit.

:func:`find_block_codes` recovers the codes where they exist and nowhere else: for every block it
tries the two forms (``d`` = the largest magnitude / 127 with no offset; ``d`` = the range / 15 in
float16 with the least weight as offset), rounds each weight to its code, and keeps the weight only
if every one of its blocks gives back every weight exactly (``d * q + m`` in float32 equal to the
weight, bit for bit, with ``d`` and ``m`` float16 values). A trained float32 weight is never taken
(its first block already fails), so a model of ordinary weights is served as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # inner elements of one output row that share a scale and an offset
PANEL = 16  # outputs of a panel (the panel kernel's width)


@dataclass(frozen=True)
class BlockCodes:
    """A weight ``[N, K]`` as ``codes`` (int8 ``[N, K]``) and ``scales`` (float16 ``[N, K / BLOCK, 2]``: d, m)."""

    codes: torch.Tensor
    scales: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 weight: ``d * q + m`` block by block."""
        n, k = self.codes.shape
        s = self.scales.float()
        q = self.codes.float().view(n, k // BLOCK, BLOCK)
        return (q * s[..., :1] + s[..., 1:]).view(n, k)

    def panels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's layout: codes ``[N/16, K, 16]`` and scales ``[N/16, K/BLOCK, 2, 16]``."""
        n, k = self.codes.shape
        codes = self.codes.view(n // PANEL, PANEL, k).transpose(1, 2).contiguous()
        scales = self.scales.view(n // PANEL, PANEL, k // BLOCK, 2).permute(0, 2, 3, 1).contiguous()
        return codes, scales


def _codes(blocks: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each weight's code under scale ``d`` and offset ``m`` per block, and whether every weight of a
    block comes back exactly from it (``d`` and ``m`` float16 values, codes within int8)."""
    live = d > 0
    q = torch.where(
        live, torch.round((blocks - m) / torch.where(live, d, torch.ones_like(d))), torch.zeros_like(blocks)
    )
    exact = (q * d + m == blocks).all(-1) & (q.abs() <= 127).all(-1)
    exact &= (d.half().float() == d).squeeze(-1) & (m.half().float() == m).squeeze(-1)
    return q, exact


def _fit(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks ``[n, K / BLOCK, BLOCK]`` under the two forms: each weight's code (int8), each block's
    scale and offset (float16 ``[..., 2]``) and whether the block comes back exactly under either
    (the symmetric form where both do)."""
    zero = torch.zeros_like(blocks[..., :1])
    d_sym = blocks.abs().amax(-1, keepdim=True) / 127
    q_sym, ok_sym = _codes(blocks, d_sym, zero)
    low = blocks.amin(-1, keepdim=True)
    d_aff = ((blocks.amax(-1, keepdim=True) - low) / 15).half().float()
    q_aff, ok_aff = _codes(blocks, d_aff, low)
    sym = ok_sym.unsqueeze(-1)
    q = torch.where(sym, q_sym, q_aff).to(torch.int8)
    scales = torch.cat((torch.where(sym, d_sym, d_aff), torch.where(sym, zero, low)), dim=-1).half()
    return q, scales, ok_sym | ok_aff


def find_block_codes(weight: torch.Tensor) -> BlockCodes | None:
    """``weight``'s 8-bit block codes if every block of it is exactly of that form, else None
    (a float32 CPU ``[N, K]`` weight with ``N`` a multiple of 16 and ``K`` of 32; any other: None)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    n, k = weight.shape
    if n % PANEL or k % BLOCK or n == 0:
        return None
    with torch.no_grad():
        blocks = weight.detach().reshape(n, k // BLOCK, BLOCK)
        if not bool(_fit(blocks[:1])[2].all()):  # a trained weight fails on its first row: no pass over the rest
            return None
        q, scales, exact = _fit(blocks)
        if not bool(exact.all()):
            return None
    return BlockCodes(q.view(n, k), scales)
