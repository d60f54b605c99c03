"""Projections of a verify pass on a CPU, computed with the kernels a CPU is fast at for them.

A verify pass multiplies every weight matrix by a handful of rows (one per tree node of the
batch), and on a CPU the pass is bound by reading the weights, not by arithmetic: SmolLM2-135M's
projections and lm_head are 538 MB of float32 read once per pass. Ideally a pass of one row and a
pass of six rows cost the same. ``torch.nn.functional.linear`` is far from that on x86 CPUs: it
hands ``x @ W.T`` with a few rows of ``x`` to MKL's GEMM, whose few-row kernels are slow and uneven
there (one torch thread, those 211 products: 53 ms for one row, 94 for two, 112 for three, 84 for
six, 164 for 32). Two kernels get close to the weight-reading bound instead:

- one or two rows: ``(W @ x.T).T``, the weight on the left and the rows as the narrow operand
  (a single row is doubled to two: the one-column case falls back to the slow matrix-vector
  routine): 36 ms for one row and for two;
- three rows and more: oneDNN's matmul on a copy of the weight packed once into oneDNN's blocked
  layout (:func:`torch.ops.mkldnn._reorder_linear_weight`, the kernel PyTorch's own CPU compiler
  uses for frozen weights): 39 ms for three to six rows, 49 for eight, 68 for sixteen, 118 for 32,
  and still ahead of ``linear`` for a 128-row prefill (401 vs 497 ms).

So a pass with five drafted tokens costs about what a plain decode step does, and the verifier's
pass-time curve (which the router's control measures and prices; see
``services/router/pass_plan.py``) is nearly flat up to half a dozen rows per pass.

:func:`use_cpu_linears` switches a CPU float32 model's ``nn.Linear`` modules to :class:`CpuLinear` in
place; the weights, their names and the state dict stay as they are. The packed copy costs as much
memory again as the projections' weights, and is packed anew when a weight is changed in place
(``load_state_dict``) or replaced. Where oneDNN is missing (or fails a first check against
``linear``), three rows and more use ``linear``. Results equal ``linear``'s up to float rounding
(the summation order differs), as any change of batch size already does.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from common.logs import get_logger

log = get_logger("cpu_linear")

TRANSPOSED_MAX_ROWS = 2  # at and below: (W @ x.T).T; above: the packed oneDNN product
PACK_BATCH_HINT = 32  # the batch size oneDNN packs for (measured as good as 2 or 8 at 1..128 rows)


@functools.cache
def onednn_ready() -> bool:
    """Whether the packed oneDNN product is there and agrees with ``linear`` on a small case."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight, x = torch.randn(24, 16, generator=gen), torch.randn(5, 16, generator=gen)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(got, torch.nn.functional.linear(x, weight), rtol=1e-4, atol=1e-4))
    except (RuntimeError, AttributeError) as exc:
        log.warning("oneDNN packed linear unavailable; using torch's linear above two rows", error=str(exc))
        return False


class CpuLinear(nn.Linear):
    """An ``nn.Linear`` whose float32 CPU products use the fast kernel for their row count."""

    _packed: torch.Tensor | None = None
    _packed_of: tuple[int, int] = (0, -1)  # (data_ptr, version) of the weight that was packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0:
            return super().forward(x)
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1])
        if rows <= TRANSPOSED_MAX_ROWS:
            if rows == 1:
                out = torch.mm(weight, torch.cat((flat, flat)).t())[:, :1]
            else:
                out = torch.mm(weight, flat.t())
            out = out.t().contiguous()
            if self.bias is not None:
                out += self.bias
        else:
            packed = self._packed_weight()
            if packed is None:
                return super().forward(x)
            out = torch.ops.mkldnn._linear_pointwise(flat, packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def _packed_weight(self) -> torch.Tensor | None:
        if not onednn_ready():
            return None
        weight = self.weight
        key = (weight.data_ptr(), weight._version)
        if self._packed is None or self._packed_of != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
            self._packed_of = key
        return self._packed


def use_cpu_linears(model: nn.Module) -> int:
    """Switch every ``nn.Linear`` of a CPU float32 ``model`` to :class:`CpuLinear`; returns how many.

    A model on any other device, or of another dtype, is left alone (GPU kernels have no such gap;
    the gap was measured for float32 kernels) and 0 is returned. The packed weights are made here,
    so that the first pass does not pay for them.
    """
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32:
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = CpuLinear
            module._packed_weight()
            count += 1
    return count
