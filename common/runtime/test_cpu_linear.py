"""The CPU kernels of a projection equal ``nn.Linear``, the fastest is measured per row count, and
they are switched on only where they apply."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from common.runtime import cpu_linear
from common.runtime.cpu_linear import (
    KERNELS,
    UNMEASURED,
    CpuLinear,
    KernelTable,
    measure_kernels,
    one_kernel,
    onednn_ready,
    use_cpu_linears,
)
from common.runtime.streamed_linear import extension, streamed_kernel, unavailable_reason


def pair(bias: bool, seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    plain = nn.Linear(48, 80, bias=bias)
    fast = nn.Linear(48, 80, bias=bias)
    fast.load_state_dict(plain.state_dict())
    use_cpu_linears(fast)
    return plain, fast


def test_onednn_is_there_on_this_build() -> None:
    # the packed kernel is what makes three rows and more fast; a build without it must be noticed
    assert onednn_ready()


def test_the_streamed_kernel_builds_where_it_can() -> None:
    # on an AVX-512 machine with a compiler, a missing streamed kernel must be noticed, not measured around
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"streamed kernel not offered here: {reason}")
    assert streamed_kernel() is not None


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (2, 48), (3, 48), (5, 48), (3, 4, 48), (64, 48), (200, 48), (0, 48)])
def test_every_kernel_equals_linear_for_every_row_count_and_leading_shape(
    kernel: str, bias: bool, shape: tuple[int, ...]
) -> None:
    plain, fast = pair(bias)
    fast.table = KernelTable((1,), (kernel,))
    x = torch.randn(*shape)
    with torch.inference_mode():
        want, got = plain(x), fast(x)
    assert got.shape == want.shape
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["streamed", "panel"])
def test_a_width_the_own_kernels_cannot_step_through_is_computed_by_linear(kernel: str) -> None:
    torch.manual_seed(3)
    plain = nn.Linear(40, 24)  # 40 inputs, 24 outputs: neither a multiple of 16
    fast = nn.Linear(40, 24)
    fast.load_state_dict(plain.state_dict())
    use_cpu_linears(fast, measure=False)
    fast.table = KernelTable((1,), (kernel,))
    x = torch.randn(5, 40)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)
    assert fast._panels is None


def test_copies_of_kernels_the_table_never_picks_are_freed() -> None:
    _, fast = pair(False)
    fast.table = KernelTable((1,), ("panel",))
    fast._packed_weight(), fast._panel_weight()
    fast.drop_unused_copies()
    assert fast._packed is None
    assert (fast._panels is not None) == (extension() is not None)
    fast.table = KernelTable((3,), ("packed",))
    fast.drop_unused_copies()
    assert fast._panels is None and fast._packed is None  # packed again on its first use
    with torch.inference_mode():
        fast(torch.randn(2, 48))
    assert (fast._packed is not None) == onednn_ready()


@pytest.mark.parametrize("rows", [2, 6, 11])
def test_a_row_is_not_computed_from_its_neighbours(rows: int) -> None:
    # each output row depends on its own input row only (neither kernel may mix them)
    _, fast = pair(True)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        alone = torch.cat([fast(x[i : i + 1]) for i in range(rows)])
        together = fast(x)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_each_row_count_takes_the_kernel_its_table_names(monkeypatch: pytest.MonkeyPatch) -> None:
    _, fast = pair(False)
    used: list[str] = []
    real_mm = torch.mm
    monkeypatch.setattr(cpu_linear.torch, "mm", lambda *a, **k: used.append("transposed") or real_mm(*a, **k))
    fast._packed_weight = lambda: used.append("onednn") or None  # type: ignore[method-assign]
    fast.table = UNMEASURED  # what a CpuLinear made by hand starts from
    assert fast.table.describe() == "1-2 transposed, 3+ packed"
    with torch.inference_mode():
        fast(torch.randn(1, 48))
        fast(torch.randn(2, 48))
        fast(torch.randn(3, 48))  # the packed kernel is asked for; unavailable, so linear answers
        fast.to(torch.bfloat16)(torch.randn(3, 48, dtype=torch.bfloat16))
        fast.to(torch.float32).table = KernelTable((1, 4), ("linear", "transposed"))
        fast(torch.randn(1, 48))
        fast(torch.randn(4, 48))
        fast(torch.randn(9, 48))  # beyond the last measured row count: the last kernel
    assert used == ["transposed", "transposed", "onednn", "transposed", "transposed"]


def test_the_table_takes_the_fastest_kernel_at_each_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels slowed by 3 ms a call where they should lose: linear from four rows on, the transposed
    streamed and panel products everywhere, the packed one under four rows. The table follows, and reads as ranges."""
    slow = {
        "linear": lambda n: n >= 4,
        "transposed": lambda n: True,
        "packed": lambda n: n < 4,
        "streamed": lambda n: True,
        "panel": lambda n: True,
    }
    real = CpuLinear.product

    def product(self: CpuLinear, flat: torch.Tensor, kernel: str) -> torch.Tensor:
        if slow[kernel](flat.shape[0]):
            time.sleep(0.003)
        return real(self, flat, kernel)

    monkeypatch.setattr(CpuLinear, "product", product)
    _, fast = pair(False)
    table = measure_kernels([fast], rows=(1, 2, 3, 4, 8), tries=2)
    assert table.kernels == ("linear", "linear", "linear", "packed", "packed")
    assert table.describe() == "1-3 linear, 4+ packed"
    assert [table.pick(n) for n in (1, 3, 4, 5, 100)] == ["linear", "linear", "packed", "packed", "packed"]


def test_a_switched_model_shares_one_measured_table() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    assert use_cpu_linears(model) == 2
    tables = {id(m.table) for m in model}
    assert len(tables) == 1 and model[0].table is not UNMEASURED
    assert set(model[0].table.kernels) <= set(KERNELS)
    assert use_cpu_linears(nn.Linear(4, 4), measure=False) == 1


def test_a_model_of_the_same_shapes_and_threads_is_not_measured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = cpu_linear.measure_kernels
    monkeypatch.setattr(
        cpu_linear, "measure_kernels", lambda linears: calls.append(len(linears)) or real(linears, tries=1)
    )
    monkeypatch.setattr(cpu_linear, "_measured", {})
    first, second = (
        nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 24)),
        nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 24)),
    )
    use_cpu_linears(first)
    use_cpu_linears(second)
    assert calls == [2] and second[0].table is first[0].table
    use_cpu_linears(nn.Sequential(nn.Linear(24, 48)))  # other shapes: measured
    saved = torch.get_num_threads()
    torch.set_num_threads(1 if saved > 1 else 2)
    try:
        use_cpu_linears(nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 24)))  # other threads: measured
    finally:
        torch.set_num_threads(saved)
    assert calls == [2, 1, 2]


@pytest.mark.parametrize("kernel", ["packed", "panel"])
def test_a_weight_changed_in_place_is_packed_anew(kernel: str) -> None:
    plain, fast = pair(False)
    fast.table = KernelTable((1,), (kernel,))
    x = torch.randn(4, 48)
    with torch.inference_mode():
        fast(x)
    torch.manual_seed(7)
    new = nn.Linear(48, 80, bias=False)
    plain.load_state_dict(new.state_dict())
    fast.load_state_dict(new.state_dict())  # copies into the same storage: only the version moves
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)


def test_switch_keeps_weights_and_names_and_only_touches_linears() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Sequential(nn.Linear(8, 4, bias=False)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_cpu_linears(model) == 2
    assert isinstance(model[0], CpuLinear) and isinstance(model[2][0], CpuLinear)
    assert type(model[1]) is nn.LayerNorm
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert use_cpu_linears(model) == 0  # already switched


@pytest.mark.parametrize("model", [nn.Linear(4, 4, device="meta"), nn.Linear(4, 4, dtype=torch.bfloat16)])
def test_a_model_off_the_cpu_or_not_float32_is_left_alone(model: nn.Linear) -> None:
    assert use_cpu_linears(model) == 0
    assert type(model) is nn.Linear


def test_one_kernel_fixes_the_kernel_and_puts_the_tables_back() -> None:
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
    use_cpu_linears(model, measure=False)
    first, second = model
    first.table = KernelTable((2, 3), ("transposed", "packed"))
    with one_kernel(model.modules()):
        assert first.table.pick(1) == first.table.pick(64) == "transposed"
        assert second.table.pick(64) == second.table.pick(1)
    assert first.table.pick(64) == "packed" and "table" not in second.__dict__
