"""Projections of a verify pass on a CPU, computed with the kernels this CPU is fast at for them.

A verify pass multiplies every weight matrix by a handful of rows (one per tree node of the
batch), and on a CPU the pass is bound by reading the weights, not by arithmetic: SmolLM2-135M's
projections and lm_head are 538 MB of float32 read once per pass. Ideally a pass of one row and a
pass of six rows cost the same. Which kernel comes closest to that depends on the CPU, so there
are six, and the fastest is measured for each row count when a model is loaded:

- ``linear``: ``torch.nn.functional.linear``, which hands ``x @ W.T`` to MKL's GEMM;
- ``transposed``: ``(W @ x.T).T``, the weight on the left and the rows as the narrow operand (a
  single row is doubled to two: the one-column case falls back to the matrix-vector routine);
- ``packed``: oneDNN's matmul on a copy of the weight packed once into oneDNN's blocked layout
  (:func:`torch.ops.mkldnn._reorder_linear_weight`, the kernel PyTorch's own CPU compiler uses for
  frozen weights);
- ``streamed``: the project's own kernel (:mod:`common.runtime.streamed_linear`, AVX-512 or AVX2), which
  streams the weight once and keeps the products of eight rows (four on AVX2) in registers; built on
  a machine's first use and left out where it cannot be (neither instruction set, no compiler);
- ``panel``: the project's other kernel (same extension), on a copy of the weight packed
  once into column panels of 16 outputs, whose accumulators need no horizontal sums: the fastest
  from one row to 64 where it was measured.
- ``block_panel``: the panel kernel on the weight's 8-bit block codes, where the float32 weight is
  exactly of that form (:mod:`common.runtime.block_weights`: a checkpoint converted from GGUF's Q8_0 or
  Q4_1); a quarter of the bytes a pass, the panel kernel's products bit for bit. Offered only where
  some projection has codes; a projection without them takes the panel kernel.

Which is fastest differs between CPUs, and not by a little: on one 2-core x86 machine MKL's few-row
kernels were slow and uneven and ``transposed`` was the fastest at one or two rows; on another (a CPU
with AMX) ``transposed`` was the slowest at one row and ``packed`` the fastest from four rows on. A
fixed choice made on one machine cost the other a factor of two on a decode step, so the choice is
measured on the machine at hand.

:func:`use_cpu_linears` switches a CPU float32 model's ``nn.Linear`` modules to :class:`CpuLinear`
in place (the weights, their names and the state dict stay as they are) and measures the kernels on
the model's own weights (:func:`measure_kernels`: every projection in the order a pass reads it, at
row counts from one to 64, the kernels interleaved and the fastest of three tries kept, so a noisy
neighbour slows them alike; once per process for models of the same shapes). The packed and panel
copies each cost as much memory again as the projections' weights; a copy the measured table never
picks is freed, and a copy is made anew when a weight is changed in place (``load_state_dict``) or
replaced. Where oneDNN is missing (or fails a first check against ``linear``), it is not among the
candidates; likewise the project's own kernels. Results equal ``linear``'s up to float rounding (the
summation order differs), as any change of batch size already does.
"""

from __future__ import annotations

import contextlib
import functools
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from common.logs import get_logger
from common.runtime.block_weights import BLOCK, find_block_codes
from common.runtime.streamed_linear import K_MULTIPLE, PANEL_WIDTH, extension, streamed_kernel

log = get_logger("cpu_linear")

PACK_BATCH_HINT = 32  # the batch size oneDNN packs for (measured as good as 2 or 8 at 1..128 rows)
MEASURED_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # row counts the kernels are timed at (larger: as at 64)
KERNELS = ("linear", "transposed", "packed", "streamed", "panel", "block_panel")  # see the module docstring
MEASURE_TRIES = 3  # each kernel's time at a row count is the fastest of this many passes


@dataclass(frozen=True)
class KernelTable:
    """The kernel for each row count: ``kernels[i]`` up to ``rows[i]`` rows (beyond the last: the last)."""

    rows: tuple[int, ...]
    kernels: tuple[str, ...]

    def pick(self, rows: int) -> str:
        return self.kernels[min(bisect_left(self.rows, rows), len(self.kernels) - 1)]

    def describe(self) -> str:
        """E.g. ``"1-3 linear, 4+ packed"``."""
        parts, lo = [], 1
        for i, (hi, kernel) in enumerate(zip(self.rows, self.kernels)):
            if i + 1 < len(self.kernels) and self.kernels[i + 1] == kernel:
                continue
            last = i + 1 == len(self.kernels)
            parts.append(f"{lo}+ {kernel}" if last else f"{lo}-{hi} {kernel}" if hi > lo else f"{lo} {kernel}")
            lo = hi + 1
        return ", ".join(parts)


# before a model's own measurement (a CpuLinear made by hand): what was fastest on the first machine measured
UNMEASURED = KernelTable((2, 3), ("transposed", "packed"))


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
    _panels: torch.Tensor | None = None
    _panels_of: tuple[int, int] = (0, -1)  # likewise for the panel kernel's copy
    _blocks: tuple[torch.Tensor, torch.Tensor] | None = None  # the block-code kernel's codes and scales
    _blocks_of: tuple[int, int] = (0, -1)  # likewise (also when the weight turned out to have none)

    table: KernelTable = UNMEASURED  # set for the whole model by use_cpu_linears (measure_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0:
            return super().forward(x)
        rows = x.numel() // x.shape[-1]
        out = self.product(x.reshape(rows, x.shape[-1]), self.table.pick(rows))
        return out.view(*x.shape[:-1], self.out_features)

    def product(self, flat: torch.Tensor, kernel: str) -> torch.Tensor:
        """``flat @ W.T + b`` for a 2-d float32 ``flat``, by ``kernel`` (``packed``, ``streamed`` and
        ``panel`` fall back to ``linear`` where they are unavailable for this weight)."""
        out = self._without_bias(flat, kernel)
        if out is not None:
            if self.bias is not None:
                out += self.bias
            return out
        packed = self._packed_weight() if kernel == "packed" else None
        if packed is None:
            return torch.nn.functional.linear(flat, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(flat, packed, self.bias, "none", [], "")

    def _without_bias(self, flat: torch.Tensor, kernel: str) -> torch.Tensor | None:
        """``flat @ W.T`` by the kernels that take no bias (``transposed``, ``streamed``, ``panel``,
        ``block_panel``, which is ``panel`` for a weight without codes); None for the others, and
        where ``streamed`` or ``panel`` is unavailable for this weight."""
        if kernel == "block_panel":
            blocks = self._block_weight()
            if blocks is not None:
                return extension().block_panel_linear(flat, *blocks)
            kernel = "panel"  # a weight that is not of the block form: the panel kernel on its float32
        if kernel == "panel":
            panels = self._panel_weight()
            return None if panels is None else extension().panel_linear(flat, panels)
        if kernel == "streamed":
            streamed = streamed_kernel() if self.in_features % K_MULTIPLE == 0 and self.weight.is_contiguous() else None
            return None if streamed is None else streamed(flat, self.weight)
        if kernel == "transposed":
            if flat.shape[0] == 1:
                out = torch.mm(self.weight, torch.cat((flat, flat)).t())[:, :1]
            else:
                out = torch.mm(self.weight, flat.t())
            return out.t().contiguous()
        return None

    def _packed_weight(self) -> torch.Tensor | None:
        return pack_once(self, PACK_BATCH_HINT) if onednn_ready() else None

    def _panel_weight(self) -> torch.Tensor | None:
        """The weight in the panel kernel's layout, made once and again when the weight changes."""
        if self.out_features % PANEL_WIDTH or extension() is None:
            return None
        weight = self.weight
        key = (weight.data_ptr(), weight._version)
        if self._panels is None or self._panels_of != key:
            with torch.no_grad():
                self._panels = extension().pack_panels(weight.detach())
            self._panels_of = key
        return self._panels

    def _block_weight(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The weight's 8-bit block codes and scales in the block-code kernel's layout, where the
        weight is exactly of that form (:func:`common.runtime.block_weights.find_block_codes`); found once
        and again when the weight changes. None for any other weight."""
        if self.out_features % PANEL_WIDTH or self.in_features % BLOCK or extension() is None:
            return None
        weight = self.weight
        key = (weight.data_ptr(), weight._version)
        if self._blocks_of != key:
            found = find_block_codes(weight)
            self._blocks = None if found is None else found.panels()
            self._blocks_of = key
        return self._blocks

    def has_blocks(self) -> bool:
        return self._block_weight() is not None

    def drop_unused_copies(self) -> None:
        """Free the packed copies of kernels this module's table never picks (each is as large as
        the weight, the block codes a quarter of it); a kernel picked later packs its copy again.
        The block-code kernel falls back to the panel kernel for a weight without codes."""
        if "packed" not in self.table.kernels:
            self._packed, self._packed_of = None, (0, -1)
        blocks = "block_panel" in self.table.kernels
        if not blocks:
            self._blocks, self._blocks_of = None, (0, -1)
        if "panel" not in self.table.kernels and not (blocks and self._blocks is None):
            self._panels, self._panels_of = None, (0, -1)


def pack_once(module: nn.Linear, hint: int) -> torch.Tensor:
    """``module``'s weight in oneDNN's blocked layout for batches of ``hint`` rows, kept on the
    module (``_packed``) and packed again when the weight is changed in place or replaced."""
    weight = module.weight
    key = (weight.data_ptr(), weight._version)
    if getattr(module, "_packed", None) is None or module._packed_of != key:
        with torch.no_grad():
            module._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), hint)
        module._packed_of = key
    return module._packed


def use_cpu_linears(model: nn.Module, measure: bool = True) -> int:
    """Switch every ``nn.Linear`` of a CPU float32 ``model`` to :class:`CpuLinear`; returns how many.

    A model on any other device, or of another dtype, is left alone (GPU kernels have no such gap;
    the gap was measured for float32 kernels) and 0 is returned. The packed weights are made here,
    so that the first pass does not pay for them, and with ``measure`` the kernels are timed on
    these weights (:func:`measure_kernels`), under the torch threads set now: set them first.
    """
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32:
        return 0
    switched: list[CpuLinear] = []
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = CpuLinear
            assert isinstance(module, CpuLinear)
            module._packed_weight()
            module._panel_weight()
            module._block_weight()
            switched.append(module)
    if switched and measure:
        # the kernels' speed follows the shapes and the threads, not the weights' values: a model of
        # the same shapes (a drafter process's other drafters, a target loaded again) is not measured again
        key = (tuple((m.out_features, m.in_features, m.has_blocks()) for m in switched), torch.get_num_threads())
        table = _measured.get(key)
        if table is None:
            extension()  # built (on a machine's first use) before the timing starts
            t0 = time.perf_counter()
            table = _measured[key] = measure_kernels(switched)
            log.info(
                "cpu projection kernels measured",
                kernels=table.describe(),
                projections=len(switched),
                block_coded=sum(m.has_blocks() for m in switched),
                threads=key[1],
                seconds=round(time.perf_counter() - t0, 2),
            )
        for module in switched:
            module.table = table
            module.drop_unused_copies()
    return len(switched)


_measured: dict[
    tuple[tuple[tuple[int, int, bool], ...], int], KernelTable
] = {}  # use_cpu_linears' tables by shapes and threads


def measure_kernels(
    linears: Sequence[CpuLinear], rows: Sequence[int] = MEASURED_ROWS, tries: int = MEASURE_TRIES
) -> KernelTable:
    """The fastest kernel at each of ``rows`` for a pass through every one of ``linears`` in turn
    (a model's projections: each weight read once, as a pass reads them). The kernels take turns
    within each try, and each keeps its fastest of ``tries`` passes."""
    own = extension() is not None
    blocks = own and any(m.has_blocks() for m in linears)  # else the block-code kernel is the panel kernel
    kernels = [
        k
        for k in KERNELS
        if (k != "packed" or onednn_ready())
        and (k not in ("streamed", "panel") or own)
        and (k != "block_panel" or blocks)
    ]
    gen = torch.Generator().manual_seed(0)
    inputs = {n: {m.in_features: torch.randn(n, m.in_features, generator=gen) for m in linears} for n in rows}
    best = {(n, k): float("inf") for n in rows for k in kernels}
    with torch.inference_mode():
        for _ in range(tries):
            for n in rows:
                for kernel in kernels:
                    t0 = time.perf_counter()
                    for m in linears:
                        m.product(inputs[n][m.in_features], kernel)
                    best[n, kernel] = min(best[n, kernel], time.perf_counter() - t0)
    return KernelTable(tuple(rows), tuple(min(kernels, key=lambda k: best[n, k]) for n in rows))


@contextlib.contextmanager
def one_kernel(modules: Iterable[nn.Module], rows: int = 1) -> Iterator[None]:
    """Within the block, every :class:`CpuLinear` among ``modules`` uses the kernel its table picks
    at ``rows`` rows, whatever its input's row count (the tables are put back after). For counting a
    pass's tensor operations at different batch sizes: which kernel is fastest at a row count is the
    CPU's choice, and some kernels run an operation more than others."""
    fixed = [m for m in modules if isinstance(m, CpuLinear)]
    before = [m.__dict__.get("table") for m in fixed]
    for m in fixed:
        kernel = m.table.pick(rows)
        m.table = KernelTable((rows,), (kernel,))
    try:
        yield
    finally:
        for m, table in zip(fixed, before):
            if table is None:
                del m.table
            else:
                m.table = table
