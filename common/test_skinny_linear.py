"""The skinny form of a projection equals ``nn.Linear`` and is switched on only where it applies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common import skinny_linear
from common.skinny_linear import SkinnyLinear, use_skinny_linears


def pair(bias: bool, seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    plain = nn.Linear(48, 80, bias=bias)
    skinny = nn.Linear(48, 80, bias=bias)
    skinny.load_state_dict(plain.state_dict())
    use_skinny_linears(skinny)
    return plain, skinny


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (2, 48), (5, 48), (3, 4, 48), (64, 48), (65, 48), (0, 48)])
def test_equals_linear_for_every_row_count_and_leading_shape(bias: bool, shape: tuple[int, ...]) -> None:
    plain, skinny = pair(bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        want, got = plain(x), skinny(x)
    assert got.shape == want.shape
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_row_is_not_computed_from_its_neighbours() -> None:
    # each output row depends on its own input row only (the transposed product must not mix them)
    _, skinny = pair(True)
    x = torch.randn(4, 48)
    with torch.inference_mode():
        alone = torch.cat([skinny(x[i : i + 1]) for i in range(4)])
        together = skinny(x)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_many_rows_and_other_dtypes_take_plain_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(skinny_linear.torch, "mm", lambda *a, **k: calls.append(1) or real_mm(*a, **k))
    _, skinny = pair(False)
    with torch.inference_mode():
        skinny(torch.randn(3, 48))
        assert len(calls) == 1
        skinny(torch.randn(skinny_linear.SKINNY_MAX_ROWS + 1, 48))
        skinny.to(torch.bfloat16)(torch.randn(3, 48, dtype=torch.bfloat16))
    assert len(calls) == 1


def test_switch_keeps_weights_and_names_and_only_touches_linears() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Sequential(nn.Linear(8, 4, bias=False)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_skinny_linears(model) == 2
    assert isinstance(model[0], SkinnyLinear) and isinstance(model[2][0], SkinnyLinear)
    assert type(model[1]) is nn.LayerNorm
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert use_skinny_linears(model) == 0  # already switched


def test_a_model_off_the_cpu_is_left_alone() -> None:
    model = nn.Linear(4, 4, device="meta")
    assert use_skinny_linears(model) == 0
    assert type(model) is nn.Linear
