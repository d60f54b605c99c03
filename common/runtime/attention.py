"""Attention for batched forwards over per-request KV caches with arbitrary tree masks: what every
backend computes, the interface they share, and the backends on library kernels.

What every backend computes, per sequence ``b`` of the batch: the new tokens (``t_b`` of them) attend
to the ``L_b`` committed cache entries and to the new tokens that are their ancestors-or-self (a
chain for ordinary causal decoding, a tree for verification). The layout of one forward pass is
described once by :class:`BatchLayout`; each backend turns it into a plan (masks, index tensors)
reused by every layer.

One interface (:class:`AttentionBackend`), four implementations, chosen once at start-up
(:mod:`common.runtime.attention_selection`):

- ``eager``: matmul + masked softmax in fp32; the reference.
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with an explicit boolean mask.
- ``flash_attn``: flash-attn's varlen kernel (CUDA, fp16/bf16). The kernel only knows causal
  masks, so every sequence's new tokens are expanded into root-to-leaf paths: each path is one
  varlen sequence ``past + path`` with a bottom-right aligned causal mask. A node shared by several
  paths is computed once per path (identical values: it sees the same keys each time).
- ``cpu_kernel``: the project's own CPU kernel (:mod:`common.runtime.cpu_attention`), for every
  sequence of a pass with a few new tokens, all in one call a layer; a prompt's many new tokens go
  to ``sdpa``. The CPU default in float32 where the kernels can be built (else ``sdpa``).

Both dense backends (``eager``, ``sdpa``) attend each sequence alone, on its cache in place, with its
own mask, on the CPU, and pad the sequences of a pass together per count of new tokens on a GPU
(:func:`dense_plans`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

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
    writes_new_kv = False  # True: the runner hands the new keys/values to attend_writing instead of writing them
    cache_dtype: torch.dtype | None = None  # the keys/values' dtype in the cache; None: the model's

    def plan(self, layout: BatchLayout, device: torch.device) -> Any:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, kvs: Sequence[KV], plan: Any, scale: float) -> torch.Tensor:
        raise NotImplementedError

    def attend_writing(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kvs: Sequence[KV], plan: Any, scale: float
    ) -> torch.Tensor:
        """:meth:`attend`, after writing the packed new keys/values ``k, v: [N, Hkv, D]`` into the last
        ``t_b`` entries of each ``kvs[b]`` (for a backend with :attr:`writes_new_kv`)."""
        raise NotImplementedError


# ---- dense backends: each sequence alone on its cache, or padded per count of new tokens --------


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
class GroupPlan:
    """How the dense backends attend a group of the sequences of a pass, all with the same number of
    new tokens: one sequence alone, its keys read where they are, or several padded together."""

    seqs: tuple[int, ...]  # their indices in the batch
    rows: slice | torch.Tensor | None  # their packed rows, sequence after sequence; None: every row of the pass
    new: int  # t: new tokens of each
    total: int  # S: keys of the longest (cache and new tokens); the others are padded to it
    mask: torch.Tensor | None  # [G, 1, t, S] bool (True = may attend); None: every key of every sequence
    additive: torch.Tensor | None = None  # the mask as 0 / -inf in the queries' dtype, made by the first layer

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as an additive one (sdpa turns a boolean mask into that in every call)."""
        if self.mask is None:
            return None
        if self.additive is None or self.additive.dtype != dtype:
            additive = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self.additive = additive.masked_fill_(~self.mask, float("-inf"))
        return self.additive


def dense_plans(
    layout: BatchLayout, device: torch.device, together: bool, only: frozenset[int] | None = None
) -> tuple[GroupPlan, ...]:
    """How the sequences of a pass are attended: each alone on its cache in place, or (``together``)
    padded together with the others of its count of new tokens, one call per count.

    A sequence's keys and values (its cache and, after it, its new tokens) are one contiguous view,
    so a sequence attended alone needs no copy: a sequence with one new token (every request of a
    plain decode pass, the plain requests of a verify pass) attends every key, and a tree or a
    prompt attends with its own ``[t, L + t]`` mask (its cache, and its new tokens'
    ancestors-or-self). Padding copies the keys and values of the group's sequences into fresh
    tensors in every layer, and masks each one's padding.

    On the CPU alone is faster, and more so the longer the context: the copies padding makes grow
    with it, and a call per sequence costs little. On a GPU every call is a kernel launch and the
    copies are cheap, so together is faster past a few sequences, plain requests and trees alike.
    The measurements behind the choice are in the project's performance notes.

    ``only``: plan just those sequences (the others are attended elsewhere).
    """
    groups: dict[int, list[int]] = {}
    for b, t in enumerate(layout.new_lens):
        if t and (only is None or b in only):
            groups.setdefault(t if together else -1 - b, []).append(b)
    # every sequence with new tokens in the one group: its rows are the pass's, attended without putting them back
    whole = len(groups) == 1 and sum(map(len, groups.values())) == sum(1 for t in layout.new_lens if t)
    offsets, past = layout.offsets, layout.past_lens
    plans = []
    for seqs in groups.values():
        t = layout.new_lens[seqs[0]]
        totals = [past[b] + t for b in seqs]
        S = max(totals)
        mask = None
        if t > 1 or min(totals) < S:
            mask = torch.zeros((len(seqs), 1, t, S), dtype=torch.bool)
            for g, b in enumerate(seqs):
                mask[g, 0, :, : past[b]] = True
                mask[g, 0, :, past[b] : past[b] + t] = layout.ancestor_mask(b)
            mask = mask.to(device)
        if whole:
            rows: slice | torch.Tensor | None = None
        elif len(seqs) == 1:
            rows = slice(offsets[seqs[0]], offsets[seqs[0]] + t)
        else:
            rows = torch.tensor([offsets[b] + i for b in seqs for i in range(t)], dtype=torch.long, device=device)
        plans.append(GroupPlan(tuple(seqs), rows, t, S, mask))
    return tuple(plans)


class DenseBackend(AttentionBackend):
    """A backend that attends the sequences of a pass group by group (:func:`dense_plans`): alone
    on the CPU, together per count of new tokens on a GPU (``together`` overrides the choice); a
    subclass gives :meth:`attend_group` (one group's attention)."""

    def __init__(self, together: bool | None = None) -> None:
        self.together = together

    def plan(self, layout: BatchLayout, device: torch.device) -> tuple[GroupPlan, ...]:
        together = torch.device(device).type != "cpu" if self.together is None else self.together
        return dense_plans(layout, device, together)

    def attend(self, q: torch.Tensor, kvs: Sequence[KV], plan: tuple[GroupPlan, ...], scale: float) -> torch.Tensor:
        if len(plan) == 1 and plan[0].rows is None:
            return self.attend_group(q, [kvs[b] for b in plan[0].seqs], plan[0], scale)
        out = torch.empty_like(q)
        for p in plan:  # each group's rows put back in place
            out[p.rows] = self.attend_group(q[p.rows], [kvs[b] for b in p.seqs], p, scale)
        return out

    def attend_group(self, q: torch.Tensor, kvs: Sequence[KV], plan: GroupPlan, scale: float) -> torch.Tensor:
        """``q: [G * t, H, D]`` (sequence after sequence) -> ``[G * t, H, D]``."""
        raise NotImplementedError


def group_queries(q: torch.Tensor, plan: GroupPlan) -> torch.Tensor:
    """``[G * t, H, D]`` -> ``[G, H, t, D]``."""
    return q.view(len(plan.seqs), plan.new, *q.shape[1:]).transpose(1, 2)


def ungroup(o: torch.Tensor) -> torch.Tensor:
    """``[G, H, t, D]`` -> ``[G * t, H, D]``."""
    return o.transpose(1, 2).reshape(-1, o.shape[1], o.shape[3])


class EagerBackend(DenseBackend):
    """Reference: explicit scores, masked softmax in fp32, GQA by repeating key/value heads."""

    name = "eager"

    def attend_group(self, q: torch.Tensor, kvs: Sequence[KV], plan: GroupPlan, scale: float) -> torch.Tensor:
        qp = group_queries(q, plan)  # [G, H, t, D]
        k, v = pad_kv(kvs, plan.total)  # [G, Hkv, S, D]; one sequence in place
        rep = qp.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(qp, k.transpose(2, 3)) * scale  # [G, H, t, S]
        if plan.mask is not None:
            scores = scores.masked_fill(~plan.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qp.dtype)
        return ungroup(torch.matmul(probs, v))


class SdpaBackend(DenseBackend):
    """``scaled_dot_product_attention`` with an explicit mask (native GQA)."""

    name = "sdpa"

    def attend_group(self, q: torch.Tensor, kvs: Sequence[KV], plan: GroupPlan, scale: float) -> torch.Tensor:
        qp = group_queries(q, plan)
        k, v = pad_kv(kvs, plan.total)
        o = F.scaled_dot_product_attention(
            qp, k, v, attn_mask=plan.additive_mask(qp.dtype), scale=scale, enable_gqa=qp.shape[1] != k.shape[1]
        )
        return ungroup(o)


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
        o = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, scale=softmax_scale, enable_gqa=qi.shape[0] != ki.shape[0]
        )
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
            q[plan.q_index].contiguous(),
            kf.contiguous(),
            vf.contiguous(),
            plan.cu_q,
            plan.cu_k,
            plan.max_q,
            plan.max_k,
            softmax_scale=scale,
            causal=True,
        )
        out = torch.empty_like(q)
        out[plan.q_index] = o  # a node on several paths gets the same value from each
        return out


def flash_attn_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    return (
        torch.device(device).type == "cuda"
        and torch.cuda.is_available()
        and dtype in (torch.float16, torch.bfloat16)
        and importlib.util.find_spec("flash_attn") is not None
    )
