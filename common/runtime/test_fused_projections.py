"""Stacked projections give each part's output exactly (the kernels compute every output on its own),
hold the only copy of the weights (the parts become views), and are refused where parts differ."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.runtime.cpu_linear import KernelTable, use_cpu_linears
from common.runtime.fused_projections import stack
from common.runtime.runner import LMRunner, SeqInput
from common.runtime.streamed_linear import extension
from common.runtime.test_block_weights import q4_1
from cosine_zoo.random_checkpoints import make_checkpoint


def parts(bias: bool, seed: int) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(64, n, bias=bias) for n in (48, 16, 16)]


@pytest.mark.parametrize("bias", [False, True])
def test_the_parts_become_views_of_the_stacked_weight_and_keep_their_outputs(bias: bool) -> None:
    mods = parts(bias, seed=1)
    x = torch.randn(5, 64)
    with torch.no_grad():
        before = [m(x) for m in mods]
        stacked = stack(mods)
        assert stacked is not None and stacked.sizes == (48, 16, 16)
        base = stacked.linear.weight.data_ptr()
        row = stacked.linear.weight.stride(0) * stacked.linear.weight.element_size()
        assert [m.weight.data_ptr() for m in mods] == [base, base + 48 * row, base + 64 * row]
        for m, want, got in zip(mods, before, stacked(x)):
            assert torch.equal(m(x), want)  # the model's own forward reads the same weights
            assert torch.equal(got, want)
        # a change to a part's weight in place is a change to the stacked one
        mods[2].weight.add_(1.0)
        assert torch.equal(stacked(x)[2], mods[2](x))


@pytest.mark.parametrize("kernel", ["block_panel", "panel"])
@pytest.mark.parametrize("rows", [1, 3, 9, 40])
def test_a_stacked_product_is_each_parts_product_bit_for_bit(kernel: str, rows: int) -> None:
    if extension() is None:
        pytest.skip("own kernels not offered here")

    def make() -> list[nn.Linear]:
        mods = [nn.Linear(576, n, bias=False) for n in (96, 32, 32)]
        with torch.no_grad():
            for i, m in enumerate(mods):
                m.weight.copy_(q4_1(m.out_features, 576, seed=i))
        return mods

    alone, stacked = make(), stack(make())
    assert stacked is not None
    use_cpu_linears(nn.ModuleList(alone), measure=False)
    use_cpu_linears(nn.ModuleList([stacked.linear]), measure=False)
    for m in (*alone, stacked.linear):
        m.table = KernelTable((1,), (kernel,))
    assert stacked.linear.has_blocks()
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        for got, m in zip(stacked(x), alone):
            assert torch.equal(got, m(x))


def test_parts_that_differ_are_left_as_they_are() -> None:
    with_bias, without = nn.Linear(64, 32), nn.Linear(64, 32, bias=False)
    weight = with_bias.weight
    assert stack([with_bias, without]) is None
    assert with_bias.weight is weight and with_bias.weight.data_ptr() == weight.data_ptr()
    assert stack([nn.Linear(64, 32), nn.Linear(32, 32)]) is None  # different inputs
    assert stack([nn.Linear(64, 32), nn.Linear(64, 32).double()]) is None


def test_a_cpu_float32_runner_calls_four_products_a_layer(tmp_path) -> None:
    path = make_checkpoint(tmp_path / "m", "qwen2", seed=3)  # q/k/v with biases
    runner = LMRunner.from_checkpoint(path, backend="sdpa")
    assert runner.products is not None and len(runner.products) == len(runner.layers)
    calls = 0

    def count(*_: object) -> None:
        nonlocal calls
        calls += 1

    for module in runner.model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(count)
    for prod in runner.products:
        for linear in (prod.qkv.linear, prod.gate_up.linear):
            linear.register_forward_pre_hook(count)
    pool = runner.new_pool(None)
    cache = pool.new_cache()
    cache.reserve(3)
    runner.forward([SeqInput(cache, (1, 2, 3))])
    assert calls == 4 * len(runner.layers) + 1  # and lm_head
