"""Block codes are found in a weight exactly where every weight is ``d * q + m`` per block of 32 (GGUF's
Q8_0 and Q4_1 forms), never in a trained weight or one off by a single bit; the block-code kernel's
products are the panel kernel's bit for bit (on this CPU's build and, on an AVX-512 CPU, the AVX2
one), and a model whose weights have codes is served from them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.runtime.block_weights import BLOCK, find_block_codes
from common.runtime.cpu_linear import CpuLinear, KernelTable, use_cpu_linears
from common.runtime.streamed_linear import extension


def q8_0(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight as GGUF's Q8_0 holds it: int8 codes times a float16 scale per block, no offset."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k // BLOCK, BLOCK), generator=gen).float()
    q[..., 3] = (
        127 * torch.randint(0, 2, (n, k // BLOCK), generator=gen).float() * 2 - 127
    )  # a block's largest magnitude is 127
    d = (torch.rand(n, k // BLOCK, 1, generator=gen) * 0.01 + 1e-4).half().float()
    return (q * d).view(n, k)


def q4_1(n: int, k: int, seed: int) -> torch.Tensor:
    """A weight as GGUF's Q4_1 holds it: 4-bit codes (0..15) times a float16 scale plus a float16 offset."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // BLOCK, BLOCK), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantizer maps a block's least weight to 0 and its largest to 15
    d = (torch.rand(n, k // BLOCK, 1, generator=gen) * 0.004 + 1e-4).half().float()
    m = (-torch.rand(n, k // BLOCK, 1, generator=gen) * 0.03).half().float()
    return (q * d + m).view(n, k)


@pytest.mark.parametrize("make", [q8_0, q4_1])
def test_the_codes_of_a_quantized_weight_give_it_back_bit_for_bit(make) -> None:
    weight = make(48, 96, seed=1)
    found = find_block_codes(weight)
    assert found is not None
    assert found.codes.dtype == torch.int8 and found.scales.dtype == torch.float16
    assert torch.equal(found.dequantize(), weight)


def test_a_weight_with_both_forms_and_a_constant_block_is_found() -> None:
    weight = torch.cat((q8_0(16, 64, seed=2), q4_1(16, 64, seed=3)), dim=0)
    weight[5, :BLOCK] = 0.25  # every weight of a block alike: d = 0
    found = find_block_codes(weight)
    assert found is not None and torch.equal(found.dequantize(), weight)


@pytest.mark.parametrize("spoil", ["trained", "one_bit", "scale_not_half"])
def test_weights_not_exactly_of_the_form_are_refused(spoil: str) -> None:
    weight = q4_1(32, 64, seed=4)
    if spoil == "trained":
        weight = torch.randn(32, 64)
    elif spoil == "one_bit":  # one weight of the last row one unit in the last place off
        weight.view(torch.int32)[31, 40] += 1
    else:  # codes times a scale that float16 cannot hold
        weight = torch.randint(-127, 128, (32, 64)).float() * 0.0012345678
    assert find_block_codes(weight) is None


def test_shapes_the_kernel_cannot_take_are_refused() -> None:
    assert find_block_codes(q8_0(24, 64, seed=5)) is None  # outputs not a multiple of 16
    assert find_block_codes(q8_0(16, 64, seed=5)[:, :48]) is None  # inputs not a multiple of 32
    assert find_block_codes(q8_0(16, 64, seed=5).double()) is None


# rows: the register path (AVX-512 up to 16: one and two groups of eight rows, and remainders; AVX2 up to
# 48: a four-row tile up to 4, one tile of five or six, two tiles to 8, then four rows dequantizing for
# groups of six and a remainder) and the chunk path beyond; outputs: whole groups of three panels and one
# or two left over; inputs: one block, the target's widths
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 6, 7, 8, 9, 11, 16, 17, 40, 48, 49])
@pytest.mark.parametrize("out_in", [(16, 32), (32, 160), (48, 576), (80, 576), (64, 1536)])
def test_the_block_kernel_is_the_panel_kernel_bit_for_bit(own, rows: int, out_in: tuple[int, int]) -> None:
    n, k = out_in
    weight = q4_1(n, k, seed=rows + n) if rows % 2 else q8_0(n, k, seed=rows + n)
    found = find_block_codes(weight)
    assert found is not None
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = own.block_panel_linear(x, *found.panels())
    assert torch.equal(got, own.panel_linear(x, own.pack_panels(weight)))
    torch.testing.assert_close(got, (x.double() @ weight.double().T).float(), rtol=1e-4, atol=1e-4)


def test_the_block_kernel_refuses_what_it_cannot_take(own) -> None:
    codes, scales = find_block_codes(q8_0(16, 64, seed=6)).panels()
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        own.block_panel_linear(torch.randn(2, 32), codes, scales)
    with pytest.raises(RuntimeError, match="int8 codes"):
        own.block_panel_linear(torch.randn(2, 64), codes.float(), scales)
    with pytest.raises(RuntimeError, match="scales"):
        own.block_panel_linear(torch.randn(2, 64), codes, scales[:, :1].contiguous())


def test_a_model_of_quantized_weights_is_served_from_its_codes_and_a_trained_one_is_not() -> None:
    if extension() is None:
        pytest.skip("own kernels not offered here")
    quantized, trained = nn.Sequential(nn.Linear(64, 48, bias=False), nn.Linear(48, 32)), nn.Linear(64, 48)
    with torch.no_grad():
        quantized[0].weight.copy_(q4_1(48, 64, seed=7))
        quantized[1].weight.copy_(torch.randn(32, 48))  # 48 inputs: not whole blocks, no codes
    reference = [nn.Linear(64, 48, bias=False), nn.Linear(48, 32)]
    for ref, mod in zip(reference, quantized):
        ref.load_state_dict(mod.state_dict())
    use_cpu_linears(quantized, measure=False)
    use_cpu_linears(trained, measure=False)
    for module in (*quantized, trained):
        module.table = KernelTable((1,), ("block_panel",))
    assert [m.has_blocks() for m in quantized] == [True, False] and not trained.has_blocks()
    x = torch.randn(3, 64)
    with torch.inference_mode():
        got = quantized(x)
        torch.testing.assert_close(got, reference[1](reference[0](x)), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            trained(x), nn.functional.linear(x, trained.weight, trained.bias), rtol=1e-5, atol=1e-5
        )
        with torch.no_grad():  # the weight changed in place: its codes are found again (none now)
            quantized[0].weight.add_(torch.randn(48, 64) * 1e-3)
        torch.testing.assert_close(
            quantized(x), reference[1](nn.functional.linear(x, quantized[0].weight)), rtol=1e-5, atol=1e-5
        )
    assert not quantized[0].has_blocks()
    quantized[0].drop_unused_copies()
    assert quantized[0]._panels is not None  # a weight without codes keeps the panel kernel's copy
    assert isinstance(quantized[0], CpuLinear)
