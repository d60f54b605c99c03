"""Projections of a few rows on a CPU, computed the way the CPU's BLAS is fast at.

A verify pass multiplies every weight matrix by a handful of rows (one per tree node of the
batch). ``torch.nn.functional.linear`` hands that to the BLAS as ``x @ W.T`` with ``x`` of a few
rows, and on x86 CPUs with MKL that shape is slow and uneven: on SmolLM2-135M's weights (2 cores)
the thirty layers' projections and the lm_head took 52 ms for one row, 89 ms for two and 107 ms for
three, then 60 ms for five. The same product computed as ``(W @ x.T).T`` (the weight on the left,
the rows as the narrow operand) took 32, 26, 30 and 49 ms: the extra rows of a speculative pass
become almost free, and one row gets faster too once it is doubled to two (a single column
falls back to the BLAS's matrix-vector routine, the slow one here). Whole verify passes of the
runner on that model, one request: 65 -> 33 ms for a plain decode step, 102 -> 34 ms for one
drafted token, 85 -> 50 ms for four; sixteen requests with one drafted token each (32 rows) 213 -> 177 ms,
48 rows 251 -> 214 ms. Above ``SKINNY_MAX_ROWS`` rows (prompt prefill) ``linear`` is kept.

:func:`use_skinny_linears` switches a CPU model's ``nn.Linear`` modules to that form in place;
the weights, their names and the state dict stay as they are. Results equal ``linear``'s up to
float rounding (the summation order differs), like any change of batch size already does.
"""

from __future__ import annotations

import torch
from torch import nn

# at and below this many rows the transposed product is used (measured no slower up to 48 rows)
SKINNY_MAX_ROWS = 64


class SkinnyLinear(nn.Linear):
    """An ``nn.Linear`` whose few-row products run as ``(W @ x.T).T``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if rows == 0 or rows > SKINNY_MAX_ROWS or x.dtype != torch.float32 or self.weight.dtype != torch.float32:
            return super().forward(x)
        flat = x.reshape(rows, x.shape[-1])
        if rows == 1:
            out = torch.mm(self.weight, torch.cat((flat, flat)).t())[:, :1]
        else:
            out = torch.mm(self.weight, flat.t())
        out = out.t().contiguous()
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


def use_skinny_linears(model: nn.Module) -> int:
    """Switch every ``nn.Linear`` of a CPU ``model`` to :class:`SkinnyLinear`; returns how many.

    Only float32 products take the skinny form (the gap was measured for float32 MKL kernels).

    A model on any other device is left alone (GPU kernels have no such gap) and 0 is returned.
    """
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu":
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SkinnyLinear
            count += 1
    return count
