"""The projections of a layer that read the same input, stacked into one product on a CPU.

A verify pass of a few rows on a CPU pays a fixed cost for every projection it calls, whatever its
size: the module call, the kernel's dispatch and the wake-up of its threads. With the block-code
kernel a row of SmolLM2-135M's projections is cheap enough that its 211 calls a pass take a large
share of the pass. Attention's q, k and v read the same normed input, and so do the
MLP's gate and up: one product over their weights stacked by output rows gives every output exactly
what its own product gave (each output is its own dot product, summed in the kernel's order over
the same weight row), in four calls a layer instead of seven, and k and v, 192 outputs each, no
longer split twelve panels over two threads.

The stacked weight is the only copy: the parts keep their parameters, now views of its rows, so the
model's own forward, its parameters and its state dict read as before (a model served so is not to
be saved with safetensors, which refuses tensors sharing storage; nothing here saves one). Parts of
different dtypes or devices, or with a bias on some but not all, are left as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Stacked:
    """One product for ``parts``: ``split(linear(x))`` gives each part's output."""

    linear: nn.Linear
    sizes: tuple[int, ...]  # the parts' output features, in order

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)


@dataclass(frozen=True)
class LayerProducts:
    """A decoder layer's stacked products: attention's q/k/v and the MLP's gate/up."""

    qkv: Stacked
    gate_up: Stacked


def stack(parts: Sequence[nn.Module]) -> Stacked | None:
    """``parts`` (plain ``nn.Linear`` of the same input width, dtype and device; all with a bias or
    none) as one product whose weight holds theirs, their parameters becoming views of it; None
    where they cannot be."""
    if stack_refusal(parts):
        return None
    sizes = tuple(p.out_features for p in parts)
    linear = nn.Linear(parts[0].in_features, sum(sizes), bias=parts[0].bias is not None, device="meta")
    with torch.no_grad():
        linear.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        row = 0
        for p, n in zip(parts, sizes):
            p.weight.data = linear.weight.data[row : row + n]
            if p.bias is not None:
                p.bias.data = linear.bias.data[row : row + n]
            row += n
    return Stacked(linear, sizes)


def stack_layers(layers: Sequence[nn.Module]) -> list[LayerProducts] | None:
    """Every layer's q/k/v and gate/up stacked (Llama and Qwen2 decoder layers); None, with every
    layer left as it was, where some layer's parts cannot be stacked."""
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if stack_refusal((attn.q_proj, attn.k_proj, attn.v_proj)) or stack_refusal((mlp.gate_proj, mlp.up_proj)):
            return None
    out = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = stack((attn.q_proj, attn.k_proj, attn.v_proj)), stack((mlp.gate_proj, mlp.up_proj))
        assert qkv is not None and gate_up is not None  # checked above
        out.append(LayerProducts(qkv, gate_up))
    return out


def stack_refusal(parts: Sequence[nn.Module]) -> bool:
    """Whether :func:`stack` would refuse ``parts`` (checked for every layer before any is changed)."""
    if not all(type(p) is nn.Linear for p in parts):
        return True
    first = parts[0].weight
    return len({p.bias is not None for p in parts}) > 1 or any(
        p.in_features != parts[0].in_features or p.weight.dtype != first.dtype or p.weight.device != first.device
        for p in parts
    )
