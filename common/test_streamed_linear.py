"""The streamed kernel equals ``x @ W.T`` for every block and group remainder, and a failed build
costs only the candidate."""

from __future__ import annotations

import pytest
import torch

from common import streamed_linear
from common.streamed_linear import build_name, streamed_kernel, unavailable_reason


@pytest.fixture
def kernel() -> streamed_linear.StreamedLinear:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"streamed kernel not offered here: {reason}")
    got = streamed_kernel()
    assert got is not None
    return got


# rows: under, at and over a group of eight, and several groups; outputs: whole blocks of three and
# one or two left over; inputs: one AVX-512 step and the target's widths
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("out_in", [(1, 16), (2, 32), (3, 16), (49, 576), (192, 576), (50, 1536)])
def test_it_equals_the_product_for_every_remainder(kernel: streamed_linear.StreamedLinear, rows: int, out_in: tuple[int, int]) -> None:
    out_features, in_features = out_in
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    got = kernel(x, weight)
    assert got.shape == (rows, out_features) and got.is_contiguous()
    torch.testing.assert_close(got, (x.double() @ weight.double().T).float(), rtol=1e-4, atol=1e-4)


def test_a_non_contiguous_input_is_read_as_its_values(kernel: streamed_linear.StreamedLinear) -> None:
    gen = torch.Generator().manual_seed(5)
    weight, wide = torch.randn(10, 32, generator=gen), torch.randn(32, 6, generator=gen)
    x = wide.T  # [6, 32], strided
    torch.testing.assert_close(kernel(x, weight), torch.nn.functional.linear(x.contiguous(), weight), rtol=1e-4, atol=1e-4)


def test_shapes_it_cannot_take_are_refused(kernel: streamed_linear.StreamedLinear) -> None:
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel(torch.randn(2, 40), torch.randn(8, 40))
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.randn(2, 32, dtype=torch.float64), torch.randn(8, 32, dtype=torch.float64))


class Said:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, object]]] = []

    def info(self, event: str, **kw: object) -> None:
        self.lines.append((event, kw))

    warning = info


def test_a_failed_build_leaves_the_kernel_out_and_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import torch.utils.cpp_extension as ext

    def broken(**_: object) -> None:
        raise RuntimeError("g++: internal compiler error")

    said = Said()
    monkeypatch.setattr(streamed_linear, "log", said)
    monkeypatch.setattr(streamed_linear, "unavailable_reason", lambda: None)
    monkeypatch.setattr(ext, "load", broken)
    monkeypatch.setenv("COSINE_CACHE_DIR", str(tmp_path))
    streamed_kernel.cache_clear()
    try:
        assert streamed_kernel() is None
    finally:
        streamed_kernel.cache_clear()
    assert any("unavailable" in event and "internal compiler error" in str(kw["error"]) for event, kw in said.lines)
    assert str(tmp_path) in str(said.lines[-1][1]["build_dir"])


def test_the_build_name_follows_the_source_and_the_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    name = build_name()
    assert name.startswith("cosine_streamed_linear_") and name == build_name()
    changed = tmp_path / "streamed_linear.cpp"
    changed.write_text(streamed_linear.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(streamed_linear, "SOURCE", changed)
    assert build_name() != name


def test_ninja_is_found_beside_the_interpreter_when_not_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    # a service started as .venv/bin/cosine has the venv's ninja beside its python, not on PATH
    monkeypatch.setattr(streamed_linear.shutil, "which", lambda name: None if name == "ninja" else f"/usr/bin/{name}")
    monkeypatch.setattr(streamed_linear.sys, "executable", str(tmp_path / "python"))
    assert streamed_linear.ninja_dir() is None
    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX"):
        assert "ninja" in (streamed_linear.unavailable_reason() or "")
    (tmp_path / "ninja").write_text("")
    assert streamed_linear.ninja_dir() == tmp_path
