"""Attention backends for batched forwards over per-request KV caches with arbitrary tree masks.

One interface, three implementations, chosen once at start-up (:func:`select_backend`):

- ``eager``: matmul + masked softmax in fp32; the reference.
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with an explicit boolean mask;
  the CPU default.
- ``flash_attn``: flash-attn's varlen kernel (CUDA, fp16/bf16). The kernel only knows causal
  masks, so every sequence's new tokens are expanded into root-to-leaf paths: each path is one
  varlen sequence ``past + path`` with a bottom-right aligned causal mask. A node shared by several
  paths is computed once per path (identical values: it sees the same keys each time).

Both dense backends attend each sequence alone, on its cache in place, with its own mask
(:func:`alone_plans`).

What every backend computes, per sequence ``b`` of the batch: the new tokens (``t_b`` of them) attend
to the ``L_b`` committed cache entries and to the new tokens that are their ancestors-or-self (a
chain for ordinary causal decoding, a tree for verification). The layout of one forward pass is
described once by :class:`BatchLayout`; each backend turns it into a plan (masks, index tensors)
reused by every layer.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from common.logs import get_logger

log = get_logger(__name__)

BACKENDS = ("eager", "sdpa", "flash_attn")

KV = tuple[torch.Tensor, torch.Tensor]  # ([Hkv, L_b + t_b, D], [Hkv, L_b + t_b, D])


@dataclass(frozen=True)
class BatchLayout:
    """Shape of one batched forward pass.

    ``parents[b][i]``: index among sequence ``b``'s new tokens of token ``i``'s parent, or -1 when
    it hangs off the committed cache (a chain is ``[-1, 0, 1, ...]``). Parents precede children.
    New tokens are packed in sequence order: sequence ``b`` occupies rows
    ``offsets[b] : offsets[b] + new_lens[b]`` of the packed ``[N, ...]`` activations.
    """

    past_lens: tuple[int, ...]
    parents: tuple[tuple[int, ...], ...]

    @property
    def batch(self) -> int:
        return len(self.past_lens)

    @property
    def new_lens(self) -> tuple[int, ...]:
        return tuple(len(p) for p in self.parents)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self.new_lens:
            out.append(acc)
            acc += n
        return tuple(out)

    @property
    def num_tokens(self) -> int:
        return sum(self.new_lens)

    def depths(self, b: int) -> list[int]:
        """Depth of each new token of sequence ``b`` below the committed cache (0 = first new)."""
        d: list[int] = []
        for p in self.parents[b]:
            d.append(0 if p < 0 else d[p] + 1)
        return d

    def positions(self, b: int) -> list[int]:
        """Position ids: ``past_len + depth`` (depth in the tree, not index in the array)."""
        return [self.past_lens[b] + d for d in self.depths(b)]

    def ancestor_mask(self, b: int) -> torch.Tensor:
        """``[t_b, t_b]`` bool: entry ``[i, j]`` is True when new token ``j`` is ``i`` or an ancestor of ``i``."""
        par = self.parents[b]
        t = len(par)
        m = torch.zeros((t, t), dtype=torch.bool)
        for i, p in enumerate(par):
            if p >= 0:
                m[i] = m[p]
            m[i, i] = True
        return m

    def paths(self, b: int) -> list[list[int]]:
        """Root-to-leaf chains of new-token indices (ancestors first), one per leaf."""
        par = self.parents[b]
        has_child = [False] * len(par)
        for p in par:
            if p >= 0:
                has_child[p] = True
        out = []
        for leaf in (i for i, c in enumerate(has_child) if not c):
            path, node = [], leaf
            while node >= 0:
                path.append(node)
                node = par[node]
            out.append(path[::-1])
        return out

    def is_chain(self, b: int) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents[b]))


class AttentionBackend:
    """``attend(q, kvs, plan, scale)``: ``q: [N, H, D]`` packed new-token queries;
    ``kvs[b]``: keys/values ``[Hkv, L_b + t_b, D]`` of sequence ``b`` (cache + new tokens);
    returns ``[N, H, D]``. ``H`` must be a multiple of ``Hkv`` (GQA)."""

    name = "abstract"

    def plan(self, layout: BatchLayout, device: torch.device) -> Any:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, kvs: Sequence[KV], plan: Any, scale: float) -> torch.Tensor:
        raise NotImplementedError


# ---- dense backends: each sequence alone, on its cache in place ------------------------------------


def pad_kv(kvs: Sequence[KV], total: int) -> KV:
    """Stack per-sequence keys/values ``[Hkv, S_b, D]`` into ``[B, Hkv, total, D]`` (zero padded);
    one sequence of ``total`` keys is returned as a view of its own storage, not copied."""
    if len(kvs) == 1 and kvs[0][0].shape[1] == total:
        return kvs[0][0].unsqueeze(0), kvs[0][1].unsqueeze(0)
    k0 = kvs[0][0]
    shape = (len(kvs), k0.shape[0], total, k0.shape[2])
    k = torch.zeros(shape, dtype=k0.dtype, device=k0.device)
    v = torch.zeros(shape, dtype=k0.dtype, device=k0.device)
    for b, (kb, vb) in enumerate(kvs):
        k[b, :, : kb.shape[1]] = kb
        v[b, :, : vb.shape[1]] = vb
    return k, v


@dataclass
class SeqPlan:
    """How the dense backends attend one sequence of a pass: alone, its keys read where they are."""

    seq: int  # its index in the batch
    rows: slice | None  # its packed rows; None: every row of the pass (a pass of this one sequence)
    new: int  # t: its new tokens
    total: int  # its keys: its cache and its new tokens
    mask: torch.Tensor | None  # [1, 1, t, total] bool (True = may attend); None: one new token, sees every key
    additive: torch.Tensor | None = None  # the mask as 0 / -inf in the queries' dtype, made by the first layer

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as an additive one (sdpa turns a boolean mask into that in every call)."""
        if self.mask is None:
            return None
        if self.additive is None or self.additive.dtype != dtype:
            self.additive = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(~self.mask, float("-inf"))
        return self.additive


def alone_plans(layout: BatchLayout, device: torch.device) -> tuple[SeqPlan, ...]:
    """How the sequences of a pass are attended: each alone, on its cache in place.

    A sequence's keys and values (its cache and, after it, its new tokens) are one contiguous view,
    so a sequence attended alone needs no copy: a sequence with one new token (every request of a
    plain decode pass, the plain requests of a verify pass) attends every key, and a tree or a
    prompt attends with its own ``[t, L + t]`` mask (its cache, and its new tokens'
    ancestors-or-self). Padding the sequences to a common shape copied every sequence's keys and
    values into fresh tensors in every layer instead: a plain pass of 16 requests of the default
    zoo's target, 2 threads, 80 ms against 83 at 300 tokens of context and 115 against 268 at 600
    (where the fresh tensors cost more than the copying itself); a verify pass of 12 requests with a
    4-node chain each at 300 tokens, 176.5 ms against 193.6 with the trees padded together per count
    of new tokens.
    """
    whole = layout.batch == 1  # every row of the pass is the sequence's: attended without putting rows back
    plans = []
    for b, (off, L, t) in enumerate(zip(layout.offsets, layout.past_lens, layout.new_lens)):
        if not t:
            continue
        mask = None
        if t > 1:
            mask = torch.ones((1, 1, t, L + t), dtype=torch.bool)
            mask[0, 0, :, L:] = layout.ancestor_mask(b)
            mask = mask.to(device)
        plans.append(SeqPlan(b, None if whole else slice(off, off + t), t, L + t, mask))
    return tuple(plans)


class DenseBackend(AttentionBackend):
    """A backend that attends each sequence alone (:func:`alone_plans`); a subclass gives
    :meth:`attend_one` (one sequence's attention)."""

    def plan(self, layout: BatchLayout, device: torch.device) -> tuple[SeqPlan, ...]:
        return alone_plans(layout, device)

    def attend(self, q: torch.Tensor, kvs: Sequence[KV], plan: tuple[SeqPlan, ...], scale: float) -> torch.Tensor:
        if len(plan) == 1 and plan[0].rows is None:
            return self.attend_one(q, kvs[plan[0].seq], plan[0], scale)
        out = torch.empty_like(q)
        for p in plan:  # each sequence's rows put back in place
            out[p.rows] = self.attend_one(q[p.rows], kvs[p.seq], p, scale)
        return out

    def attend_one(self, q: torch.Tensor, kv: KV, plan: SeqPlan, scale: float) -> torch.Tensor:
        """``q: [t, H, D]`` -> ``[t, H, D]``."""
        raise NotImplementedError


class EagerBackend(DenseBackend):
    """Reference: explicit scores, masked softmax in fp32, GQA by repeating key/value heads."""

    name = "eager"

    def attend_one(self, q: torch.Tensor, kv: KV, plan: SeqPlan, scale: float) -> torch.Tensor:
        qp = q.transpose(0, 1).unsqueeze(0)  # [1, H, t, D]
        k, v = pad_kv([kv], plan.total)  # [1, Hkv, S, D], in place
        rep = qp.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(qp, k.transpose(2, 3)) * scale  # [1, H, t, S]
        if plan.mask is not None:
            scores = scores.masked_fill(~plan.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qp.dtype)
        return torch.matmul(probs, v)[0].transpose(0, 1)


class SdpaBackend(DenseBackend):
    """``scaled_dot_product_attention`` with an explicit mask (native GQA)."""

    name = "sdpa"

    def attend_one(self, q: torch.Tensor, kv: KV, plan: SeqPlan, scale: float) -> torch.Tensor:
        qp = q.transpose(0, 1).unsqueeze(0)
        k, v = pad_kv([kv], plan.total)
        o = F.scaled_dot_product_attention(
            qp, k, v, attn_mask=plan.additive_mask(qp.dtype), scale=scale, enable_gqa=qp.shape[1] != k.shape[1]
        )
        return o[0].transpose(0, 1)


# ---- flash-attn varlen ---------------------------------------------------------------------------


@dataclass
class VarlenPlan:
    max_total: int  # S: the most keys of a sequence (cache and new tokens), what the keys are padded to
    q_index: torch.Tensor  # [Nq] packed-row index of every query of every path
    k_index: torch.Tensor  # [Nk] index into the flattened padded keys [B * S] of every key of every path
    cu_q: torch.Tensor  # [P + 1] int32
    cu_k: torch.Tensor  # [P + 1] int32
    max_q: int
    max_k: int


VarlenFn = Callable[..., torch.Tensor]


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal=True):
    """Pure-PyTorch stand-in for ``flash_attn_varlen_func`` (bottom-right aligned causal mask).

    Used to test the path expansion of :class:`FlashAttnBackend` without CUDA.
    """
    out = torch.empty_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        qi = q[cq[i] : cq[i + 1]].transpose(0, 1)  # [H, tq, D]
        ki = k[ck[i] : ck[i + 1]].transpose(0, 1)
        vi = v[ck[i] : ck[i + 1]].transpose(0, 1)
        tq, tk = qi.shape[1], ki.shape[1]
        mask = torch.ones((tq, tk), dtype=torch.bool, device=q.device)
        if causal:
            mask = torch.arange(tk, device=q.device)[None, :] <= torch.arange(tq, device=q.device)[:, None] + (tk - tq)
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale, enable_gqa=qi.shape[0] != ki.shape[0])
        out[cq[i] : cq[i + 1]] = o.transpose(0, 1)
    return out


class FlashAttnBackend(AttentionBackend):
    """flash-attn varlen kernels; trees are expanded into root-to-leaf causal paths.

    ``varlen_fn`` defaults to ``flash_attn.flash_attn_varlen_func`` (imported on first use);
    tests inject :func:`reference_varlen` to check the expansion on CPU.
    """

    name = "flash_attn"

    def __init__(self, varlen_fn: VarlenFn | None = None) -> None:
        if varlen_fn is None:
            from flash_attn import flash_attn_varlen_func as varlen_fn  # type: ignore[no-redef]
        self.varlen_fn = varlen_fn

    def plan(self, layout: BatchLayout, device: torch.device) -> VarlenPlan:
        S = max((p + n for p, n in zip(layout.past_lens, layout.new_lens)), default=0)
        q_index: list[int] = []
        k_parts: list[torch.Tensor] = []
        cu_q, cu_k = [0], [0]
        max_q = max_k = 0
        for b, off in enumerate(layout.offsets):
            L = layout.past_lens[b]
            for path in layout.paths(b) if layout.new_lens[b] else []:
                q_index += [off + i for i in path]
                k_parts += [torch.arange(b * S, b * S + L), torch.tensor(path, dtype=torch.long) + (b * S + L)]
                cu_q.append(cu_q[-1] + len(path))
                cu_k.append(cu_k[-1] + L + len(path))
                max_q, max_k = max(max_q, len(path)), max(max_k, L + len(path))
        k_index = torch.cat(k_parts) if k_parts else torch.zeros(0, dtype=torch.long)

        def t(x, dt=torch.long):
            return torch.tensor(x, dtype=dt, device=device)

        return VarlenPlan(S, t(q_index), k_index.to(device), t(cu_q, torch.int32), t(cu_k, torch.int32), max_q, max_k)

    def attend(self, q: torch.Tensor, kvs: Sequence[KV], plan: VarlenPlan, scale: float) -> torch.Tensor:
        k, v = pad_kv(kvs, plan.max_total)  # [B, Hkv, S, D]
        B, Hkv, S, D = k.shape
        kf = k.transpose(1, 2).reshape(B * S, Hkv, D)[plan.k_index]
        vf = v.transpose(1, 2).reshape(B * S, Hkv, D)[plan.k_index]
        o = self.varlen_fn(
            q[plan.q_index].contiguous(), kf.contiguous(), vf.contiguous(), plan.cu_q, plan.cu_k,
            plan.max_q, plan.max_k, softmax_scale=scale, causal=True,
        )
        out = torch.empty_like(q)
        out[plan.q_index] = o  # a node on several paths gets the same value from each
        return out


# ---- selection -----------------------------------------------------------------------------------


def flash_attn_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    return (
        torch.device(device).type == "cuda"
        and torch.cuda.is_available()
        and dtype in (torch.float16, torch.bfloat16)
        and importlib.util.find_spec("flash_attn") is not None
    )


def select_backend(name: str, device: torch.device | str, dtype: torch.dtype) -> AttentionBackend:
    """``auto`` = ``flash_attn`` when importable on a CUDA device with a half dtype, else ``sdpa``.

    Raises ``ValueError`` for an unknown name or an explicit ``flash_attn`` that cannot run here.
    """
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
