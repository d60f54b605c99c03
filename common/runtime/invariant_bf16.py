"""bfloat16 on a CPU with AMX, computed so that a row's result never depends on the rest of its pass.

Speculative decoding is lossless only if the target gives a token the same logits whether it is
verified in a tree of sixteen nodes, decoded alone, or batched with fifteen other requests. In
float32 that holds up to rounding (a different row count picks a different GEMM kernel, whose
summation order differs by about 1e-7), and a greedy choice flips only at an exact tie. In
bfloat16, every projection rounds its output to 8 bits of mantissa, so such a difference would
show up as a whole unit in the last place and flip near-ties often: in torch's stock bfloat16 path
(``linear`` and ``scaled_dot_product_attention``), 9 of 24 greedy outputs of the default zoo left
the target alone's at one request in flight.

On a CPU with AMX, oneDNN's bfloat16 matrix products are row-invariant up to a number of rows:
each row of the output is bit for bit the row computed alone, whatever the other rows are (for
SmolLM2-135M's projections: 128 rows with weights packed for one row, 32 packed for 16 to 256;
beyond the bound some rows go through another kernel). This module keeps every product inside its
bound and gives every row the same sums:

- :class:`InvariantLinear`: projections in chunks of at most the bound, each a oneDNN product on a
  weight packed once;
- :class:`InvariantAttention`: eager attention, scores and weighted values as batched bfloat16
  products, the softmax in float32. Two things make a product's sum follow more than its row:
  *positions*: a tree node's ancestors sit among its siblings in the pass, while decoding puts
  them right after the cache, and a product sums key by key in an order that follows the position
  (so a tree is attended path by path, each root-to-leaf path a causal chain on its cache, as
  decoding would see it); and *length*: a token decoded alone sees ``S`` keys, in a pass it sees
  more, the rest weighted zero, and oneDNN sums ``S`` keys and ``S + 5`` with five zero weights
  with different tail kernels. Over keys padded to a multiple of :data:`KEY_BLOCK` the sums agree
  (whole blocks of zero products add exact zeros), so the keys are padded to that.

Norms, rotary embedding, activations and residual adds are per-row elementwise and invariant
already. The bounds and the zero blocks are probed on the machine at hand, under the torch threads
set at load (:func:`invariant_rows`; :func:`linear_rows` on the model's own shapes); where the
products are not invariant to :data:`MIN_ROWS` rows (no AMX, or a oneDNN without the property)
bfloat16 is not offered for the target (``dtype auto`` picks float32 there). Test:
``common/runtime/test_invariant_bf16.py`` (random batches of random trees, every node against its
path decoded alone).

Why bother: with AMX, a bfloat16 product of many rows costs far less than the float32 one, while a
decode step of one token costs about the same in both dtypes. A verify pass of many rows then costs
little more than a decode step, which is what speculation needs (figures in docs/runtime.md).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from common.logs import get_logger
from common.runtime.attention import KV, AttentionBackend, BatchLayout
from common.runtime.cpu_linear import pack_once

log = get_logger("invariant_bf16")

MIN_ROWS = 8  # below this bound chunking would cost more than bfloat16 saves: use float32
PROBE_ROWS = 64  # the most rows the attention products' probe tries
LINEAR_PROBE_ROWS = 128  # the most rows the projections' probe tries (a pass beyond: chunks of the bound)
# oneDNN packs a weight for a batch size; packed for one row, SmolLM2-135M's projections stay
# row-invariant to 128 rows or more (packed for 16 to 256 rows: to 32), at the same speed
PACK_BATCH_HINT = 1
KEY_BLOCK = 32  # keys of the weighted-value product are padded to a multiple of this (probed)


def amx_available() -> bool:
    """Whether this CPU has AMX tiles and torch knows how to use them."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return False


def _bound(fn: Any, width: int, gen: torch.Generator, limit: int) -> int:
    """The largest ``m <= limit`` such that every row of ``fn(x[:n])``, ``n <= m``, equals ``fn`` of
    that row alone."""
    x = torch.randn(limit, width, generator=gen).to(torch.bfloat16)
    alone = torch.cat([fn(x[i : i + 1]) for i in range(limit)])
    for n in range(2, limit + 1):
        if not torch.equal(fn(x[:n]), alone[:n]):
            return n - 1
    return limit


def invariant_rows(limit: int = PROBE_ROWS) -> int:
    """How many rows a bfloat16 product on this CPU takes, under the torch threads set now, with
    every row computed as if alone: the smallest bound over a packed projection and the two batched
    products of attention. 0 where there is no AMX or oneDNN fails."""
    return _invariant_rows(limit, torch.get_num_threads()) if amx_available() else 0


@functools.cache
def _invariant_rows(limit: int, threads: int) -> int:
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            weight = torch.randn(96, 80, generator=gen).to(torch.bfloat16)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            keys = torch.randn(2, 40, 64, generator=gen).to(torch.bfloat16)
            values = torch.randn(2, 40, 64, generator=gen).to(torch.bfloat16)
            bounds = (
                _bound(lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), 80, gen, limit),
                _bound(
                    lambda x: (
                        torch.matmul(x.view(1, -1, 64).expand(2, -1, -1), keys.transpose(1, 2))
                        .transpose(0, 1)
                        .reshape(x.shape[0], -1)
                    ),
                    64,
                    gen,
                    limit,
                ),
                _bound(
                    lambda x: (
                        torch.matmul(x.view(1, -1, 40).expand(2, -1, -1), values)
                        .transpose(0, 1)
                        .reshape(x.shape[0], -1)
                    ),
                    40,
                    gen,
                    limit,
                ),
            )
        exact = _zero_blocks_exact(gen)
    except (RuntimeError, AttributeError) as exc:
        log.warning("bfloat16 oneDNN products unavailable", error=str(exc))
        return 0
    if not exact:
        log.warning("bfloat16 products over zero-padded keys are not exact on this CPU; bfloat16 not offered")
        return 0
    return min(bounds)


def pad_keys(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` zero-padded along ``dim`` to a multiple of :data:`KEY_BLOCK`."""
    extra = -x.shape[dim] % KEY_BLOCK
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat((x, x.new_zeros(shape)), dim=dim)


def _zero_blocks_exact(gen: torch.Generator, tries: int = 24) -> bool:
    """Whether weights over ``S`` keys give the values' product bit for bit what the same weights
    followed by zeros over more keys give, both padded to :data:`KEY_BLOCK` (decoding vs a tree)."""
    for i in range(tries):
        keys, extra = 1 + 13 * i, 1 + (7 * i) % 45
        weights = torch.rand(2, 12, keys, generator=gen).to(torch.bfloat16)
        values = torch.randn(2, keys + extra, 64, generator=gen).to(torch.bfloat16)
        alone = torch.matmul(pad_keys(weights, 2), pad_keys(values[:, :keys], 1))
        masked = torch.cat((weights, weights.new_zeros(2, 12, extra)), dim=2)
        if not torch.equal(alone, torch.matmul(pad_keys(masked, 2), pad_keys(values, 1))):
            return False
    return True


def bf16_available() -> bool:
    """Whether the target may run in bfloat16 on this CPU without giving up losslessness."""
    return invariant_rows() >= MIN_ROWS


class InvariantLinear(nn.Linear):
    """An ``nn.Linear`` whose bfloat16 CPU products go through oneDNN in chunks of ``rows`` rows."""

    rows: int = MIN_ROWS
    _packed: torch.Tensor | None = None
    _packed_of: tuple[int, int] = (0, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.numel() == 0:
            return super().forward(x)
        n = x.numel() // x.shape[-1]
        flat = x.reshape(n, x.shape[-1])
        packed = self.packed()
        if n <= self.rows:
            out = torch.ops.mkldnn._linear_pointwise(flat, packed, self.bias, "none", [], "")
        else:
            out = torch.cat(
                [
                    torch.ops.mkldnn._linear_pointwise(flat[i : i + self.rows], packed, self.bias, "none", [], "")
                    for i in range(0, n, self.rows)
                ]
            )
        return out.view(*x.shape[:-1], self.out_features)

    def packed(self) -> torch.Tensor:
        """The weight in oneDNN's blocked layout, packed again after an in-place change."""
        return pack_once(self, PACK_BATCH_HINT)


def linear_rows(shapes: Sequence[tuple[int, int]], limit: int = LINEAR_PROBE_ROWS) -> int:
    """The row bound of packed bfloat16 projections of these ``(out, in)`` shapes (kernels differ by
    shape and by the batch size a weight is packed for)."""
    bound = limit
    for out_features, in_features in sorted(set(shapes)):
        bound = min(bound, _linear_rows(out_features, in_features, limit, torch.get_num_threads()))
    return bound


@functools.cache
def _linear_rows(out_features: int, in_features: int, limit: int, threads: int) -> int:
    gen = torch.Generator().manual_seed(out_features * 7919 + in_features)
    with torch.inference_mode():
        weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        return _bound(
            lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), in_features, gen, limit
        )


def use_invariant_linears(model: nn.Module, limit: int = LINEAR_PROBE_ROWS) -> int:
    """Switch every ``nn.Linear`` of a CPU bfloat16 ``model`` to :class:`InvariantLinear`, in chunks
    of the row bound its shapes have on this CPU (at most ``limit``); returns that bound, 0 for any
    other model (left alone)."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.bfloat16 or limit < 1:
        return 0
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    if not linears:
        return limit
    t0 = time.perf_counter()
    rows = linear_rows([(m.out_features, m.in_features) for m in linears], limit)
    for module in linears:
        module.__class__ = InvariantLinear
        assert isinstance(module, InvariantLinear)
        module.rows = max(1, rows)
        module.packed()
    log.info(
        "bfloat16 projections row-invariant",
        rows=rows,
        projections=len(linears),
        seconds=round(time.perf_counter() - t0, 2),
    )
    return rows


@dataclass(frozen=True)
class PathEntry:
    """One root-to-leaf path of a sequence's new tokens, attended as decoding would see it."""

    seq: int  # the sequence's index in the pass
    past: int  # its committed cache length
    slots: torch.Tensor | None  # the path's new tokens' cache slots, in depth order; None: all new tokens, in order


@dataclass
class PathPlan:
    """One pass of :class:`InvariantAttention`: every root-to-leaf path of every sequence's new
    tokens is an entry (a causal chain on its sequence's cache), the entries padded to ``new``
    query rows and ``keys`` keys (a multiple of :data:`KEY_BLOCK`)."""

    entries: tuple[PathEntry, ...]
    new: int  # t: the longest path
    keys: int  # S': the most keys of an entry, padded
    index: torch.Tensor  # [E * t] packed row of each entry row (padding rows repeat row 0)
    out_index: (
        torch.Tensor | None
    )  # [N] the entry row each packed row's output is read from; None: row n is entry row n
    mask: torch.Tensor  # [E, 1, t, S'] additive (0 / -inf), in the queries' dtype from the first layer on
    keys_buf: torch.Tensor | None = None  # [E, Hkv, S', D] padded keys, made by the first layer, rewritten by each
    values_buf: torch.Tensor | None = None


class InvariantAttention(AttentionBackend):
    """Eager attention with every query row computed as if decoded alone (see the module docstring).

    A token tree is attended path by path: a token must see its ancestors at the key positions
    that decoding would put them at (right after the cache, in depth order), since a product sums
    in an order that follows the positions. The paths of a pass are padded together and attended
    by two batched products per layer; the query heads of a key/value head are stacked into rows
    of one product, in chunks of at most ``rows`` rows."""

    name = "invariant"

    def __init__(self, rows: int) -> None:
        if rows < 1:
            raise ValueError("rows must be at least 1")
        self.rows = rows

    def plan(self, layout: BatchLayout, device: torch.device) -> PathPlan:
        entries: list[PathEntry] = []
        rows: list[list[int]] = []  # per entry, the packed rows of its path
        read_from: dict[int, tuple[int, int]] = {}  # packed row -> (entry, depth) of its first path
        for b, (off, n, past) in enumerate(zip(layout.offsets, layout.new_lens, layout.past_lens)):
            if not n:
                continue
            paths = [list(range(n))] if layout.is_chain(b) else layout.paths(b)
            for path in paths:
                slots = None if len(paths) == 1 else torch.tensor(path, dtype=torch.long, device=device) + past
                entries.append(PathEntry(b, past, slots))
                rows.append([off + i for i in path])
                for j, row in enumerate(rows[-1]):
                    read_from.setdefault(row, (len(entries) - 1, j))
        t = max(len(r) for r in rows)
        keys = -(-max(e.past + len(r) for e, r in zip(entries, rows)) // KEY_BLOCK) * KEY_BLOCK
        E = len(entries)
        allowed = torch.zeros((E, 1, t, keys), dtype=torch.bool)
        index = torch.zeros((E, t), dtype=torch.long)
        for e, (entry, r) in enumerate(zip(entries, rows)):
            n, past = len(r), entry.past
            allowed[e, 0, :n, :past] = True
            allowed[e, 0, :n, past : past + n] = torch.ones((n, n), dtype=torch.bool).tril_()
            allowed[e, 0, n:, 0] = True  # padding rows attend one key (their output is dropped)
            index[e, :n] = torch.tensor(r)
        flat = [e * t + j for e, j in (read_from[row] for row in range(layout.num_tokens))]
        gather = None if flat == list(range(E * t)) else torch.tensor(flat, dtype=torch.long, device=device)
        mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        return PathPlan(tuple(entries), t, keys, index.view(-1).to(device), gather, mask.to(device))

    def attend(self, q: torch.Tensor, kvs: Sequence[KV], plan: PathPlan, scale: float) -> torch.Tensor:
        H, D = q.shape[1:]
        E, t = len(plan.entries), plan.new
        Hkv = kvs[0][0].shape[0]
        rep = H // Hkv
        if plan.keys_buf is None or plan.values_buf is None:  # zeros at first: padding keys stay finite (weighted zero)
            plan.keys_buf = q.new_zeros((E, Hkv, plan.keys, D))
            plan.values_buf = q.new_zeros((E, Hkv, plan.keys, D))
            plan.mask = plan.mask.to(q.dtype)
        k, v = plan.keys_buf, plan.values_buf
        for e, entry in enumerate(plan.entries):
            kb, vb = kvs[entry.seq]
            if entry.slots is None:  # the sequence's new tokens are one chain: in place already
                k[e, :, : kb.shape[1]] = kb
                v[e, :, : vb.shape[1]] = vb
                continue
            past, n = entry.past, entry.slots.shape[0]
            k[e, :, :past] = kb[:, :past]
            v[e, :, :past] = vb[:, :past]
            k[e, :, past : past + n] = kb[:, entry.slots]
            v[e, :, past : past + n] = vb[:, entry.slots]
        # [E, t, H, D] -> [E, Hkv, t, rep, D]: a key/value head's rows are (token, query head)
        qp = (q * scale)[plan.index].view(E, t, Hkv, rep, D).permute(0, 2, 1, 3, 4)
        kt = k.transpose(2, 3)
        step = max(1, self.rows // rep)
        outs = []
        for s in range(0, t, step):
            m = min(step, t - s)
            rows = qp[:, :, s : s + m].reshape(E, Hkv, m * rep, D)
            scores = torch.matmul(rows, kt).view(E, Hkv, m, rep, plan.keys)
            scores = scores + plan.mask[:, :, s : s + m].unsqueeze(3)
            probs = torch.softmax(scores.view(E, Hkv, m * rep, plan.keys), dim=-1)
            outs.append(torch.matmul(probs, v).view(E, Hkv, m, rep, D))
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [E, Hkv, t, rep, D]
        o = o.permute(0, 2, 1, 3, 4).reshape(E * t, H, D)
        return o if plan.out_index is None else o[plan.out_index]
