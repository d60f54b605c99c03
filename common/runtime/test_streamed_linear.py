"""The streamed and panel kernels equal ``x @ W.T`` for every block and group remainder, a row's
result does not depend on the rows beside it, and a failed build costs only the candidates. Every
kernel test runs on the build for this CPU and, where it has AVX-512, on the AVX2 build too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.runtime import streamed_linear
from common.runtime.streamed_linear import AVX2_FLAGS, build_name, extension, streamed_kernel, unavailable_reason


@pytest.fixture
def kernel(own) -> streamed_linear.StreamedLinear:
    return own.streamed_linear


def test_the_services_get_the_kernels_built_for_this_cpu() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"own kernels not offered here: {reason}")
    own = extension()
    assert own is not None and streamed_kernel() is own.streamed_linear
    assert own.isa() == ("avx2" if torch.backends.cpu.get_cpu_capability() == "AVX2" else "avx512")


# rows: under, at and over a group of eight (four on AVX2), and several groups; outputs: whole blocks of three and
# one or two left over; inputs: one AVX-512 step and the target's widths
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("out_in", [(1, 16), (2, 32), (3, 16), (49, 576), (192, 576), (50, 1536)])
def test_it_equals_the_product_for_every_remainder(
    kernel: streamed_linear.StreamedLinear, rows: int, out_in: tuple[int, int]
) -> None:
    out_features, in_features = out_in
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    got = kernel(x, weight)
    assert got.shape == (rows, out_features) and got.is_contiguous()
    torch.testing.assert_close(got, (x.double() @ weight.double().T).float(), rtol=1e-4, atol=1e-4)


# rows: under, at and over a group of eight (six on AVX2); outputs: whole groups of three panels and one or two
# left over; inputs: any width (the panel kernel steps through them one at a time)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 9, 12, 16, 17, 40])
@pytest.mark.parametrize("out_in", [(16, 1), (32, 7), (48, 16), (64, 48), (80, 576), (192, 576), (576, 1536)])
def test_the_panel_kernel_equals_the_product_for_every_remainder(own, rows: int, out_in: tuple[int, int]) -> None:
    out_features, in_features = out_in
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    panels = own.pack_panels(weight)
    assert panels.shape == (out_features // 16, in_features, 16)
    got = own.panel_linear(x, panels)
    assert got.shape == (rows, out_features) and got.is_contiguous()
    torch.testing.assert_close(got, (x.double() @ weight.double().T).float(), rtol=1e-4, atol=3e-4)


@pytest.mark.parametrize("which", ["streamed", "panel"])
def test_a_row_gets_the_same_bits_alone_or_among_others(own, which: str) -> None:
    gen = torch.Generator().manual_seed(11)
    weight, x = torch.randn(96, 576, generator=gen), torch.randn(21, 576, generator=gen)
    if which == "panel":
        panels = own.pack_panels(weight)
        product = lambda rows: own.panel_linear(rows, panels)  # noqa: E731
    else:
        product = lambda rows: own.streamed_linear(rows, weight)  # noqa: E731
    together = product(x)
    for i in (0, 7, 8, 20):
        assert torch.equal(product(x[i : i + 1]), together[i : i + 1])


def test_the_panel_kernel_refuses_what_it_cannot_take(own) -> None:
    with pytest.raises(RuntimeError, match="multiple of 16"):
        own.pack_panels(torch.randn(40, 32))
    with pytest.raises(RuntimeError, match="float32"):
        own.panel_linear(torch.randn(2, 32, dtype=torch.float64), own.pack_panels(torch.randn(16, 32)))
    with pytest.raises(RuntimeError, match="panels"):
        own.panel_linear(torch.randn(2, 31), own.pack_panels(torch.randn(16, 32)))


def test_a_non_contiguous_input_is_read_as_its_values(kernel: streamed_linear.StreamedLinear) -> None:
    gen = torch.Generator().manual_seed(5)
    weight, wide = torch.randn(10, 32, generator=gen), torch.randn(32, 6, generator=gen)
    x = wide.T  # [6, 32], strided
    torch.testing.assert_close(
        kernel(x, weight), torch.nn.functional.linear(x.contiguous(), weight), rtol=1e-4, atol=1e-4
    )


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


def building_with(monkeypatch: pytest.MonkeyPatch, tmp_path, load: Callable[..., None]) -> Said:
    """The extension built by ``load`` in place of torch's builder, cached under ``tmp_path``; what
    the build logs goes to the returned ``Said``."""
    import torch.utils.cpp_extension as ext

    said = Said()
    monkeypatch.setattr(streamed_linear, "log", said)
    monkeypatch.setattr(streamed_linear, "unavailable_reason", lambda: None)
    monkeypatch.setattr(ext, "load", load)
    monkeypatch.setenv("COSINE_CACHE_DIR", str(tmp_path))
    return said


def fresh_extension() -> object:
    """``extension()`` built anew (not the process's cached one), and the cache left clear."""
    extension.cache_clear()
    try:
        return extension()
    finally:
        extension.cache_clear()


def test_a_failed_build_leaves_the_kernel_out_and_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    def broken(**_: object) -> None:
        raise RuntimeError("g++: internal compiler error")

    said = building_with(monkeypatch, tmp_path, broken)
    assert fresh_extension() is None
    assert any("unavailable" in event and "internal compiler error" in str(kw["error"]) for event, kw in said.lines)
    assert str(tmp_path) in str(said.lines[-1][1]["build_dir"])


def test_where_the_kernels_cannot_be_had_a_first_use_goes_on_without_them_after_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    def never(**_: object) -> None:
        raise AssertionError("no build is tried where the kernels cannot be had")

    said = building_with(monkeypatch, tmp_path, never)
    monkeypatch.setattr(streamed_linear, "unavailable_reason", lambda: "no C++ compiler (c++) on PATH")
    assert fresh_extension() is None
    assert said.lines == [("own cpu kernels not offered", {"reason": "no C++ compiler (c++) on PATH"})]
    assert not (tmp_path / "kernels").exists()


def test_a_failed_build_is_described_in_one_line_with_its_last_error_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    def broken(**_: object) -> None:
        raise RuntimeError("Error building extension\ng++: internal compiler error")

    building_with(monkeypatch, tmp_path, broken)
    result = streamed_linear.build_kernels()
    assert result.module is None and result.build_dir == streamed_linear.build_directory()
    assert streamed_linear.describe(result) == (
        "the project's CPU kernels are left out: the build failed (g++: internal compiler error); "
        "the services use torch's kernels instead"
    )


@pytest.mark.parametrize("age_s", [3600.0, 5.0])
def test_a_lock_left_by_a_killed_build_is_removed_but_a_running_build_s_is_waited_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path, age_s: float
) -> None:
    import os
    import time

    lock_at_load: list[bool] = []

    def load(**kw: object) -> None:
        lock_at_load.append((Path(str(kw["build_directory"])) / "lock").exists())
        raise RuntimeError("not built here")

    said = building_with(monkeypatch, tmp_path, load)
    lock = tmp_path / "kernels" / build_name() / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    assert fresh_extension() is None
    stale = age_s > streamed_linear.STALE_LOCK_S
    assert lock_at_load == [not stale]  # torch's builder would wait on it: forever, for a killed build's
    assert any("stale kernel build lock" in event for event, _ in said.lines) == stale


def test_the_build_name_follows_the_source_and_the_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    name = build_name()
    assert name.startswith("cosine_streamed_linear_") and name == build_name()
    # the same sources in another checkout: a build of its own (the build's commands name the sources by path)
    (tmp_path / "checkout").mkdir()
    for source in (streamed_linear.SOURCE, streamed_linear.ATTENTION_SOURCE, streamed_linear.VEC_HEADER):
        (tmp_path / "checkout" / source.name).write_bytes(source.read_bytes())
    for attr in ("SOURCE", "ATTENTION_SOURCE", "VEC_HEADER"):
        monkeypatch.setattr(streamed_linear, attr, tmp_path / "checkout" / getattr(streamed_linear, attr).name)
    assert build_name() != name
    changed = tmp_path / "streamed_linear.cpp"
    changed.write_text(streamed_linear.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(streamed_linear, "SOURCE", changed)
    assert build_name() != name
    assert build_name(AVX2_FLAGS) not in (name, build_name())


def test_ninja_is_found_beside_the_interpreter_when_not_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    # a service started as .venv/bin/cosine has the venv's ninja beside its python, not on PATH
    monkeypatch.setattr(streamed_linear.shutil, "which", lambda name: None if name == "ninja" else f"/usr/bin/{name}")
    monkeypatch.setattr(streamed_linear.sys, "executable", str(tmp_path / "python"))
    assert streamed_linear.ninja_dir() is None
    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX"):
        assert "ninja" in (streamed_linear.unavailable_reason() or "")
    (tmp_path / "ninja").write_text("")
    assert streamed_linear.ninja_dir() == tmp_path


# items (outputs of three, panels and groups of 16, from fewer than the threads to hundreds) are claimed by
# whichever thread is free, so which thread computes an output changes from pass to pass: never its bits. Seven
# threads on a small machine keep some preempted, so their items are taken by the others.
@pytest.mark.parametrize("out_features", [16, 48, 1536])
@pytest.mark.parametrize("rows", [1, 5, 14, 40])
def test_every_kernel_gives_the_same_bits_on_any_number_of_threads(
    own, torch_threads, out_features: int, rows: int
) -> None:
    from common.runtime.block_weights import find_block_codes
    from common.runtime.test_block_weights import q8_0

    weight = q8_0(out_features, 576, seed=out_features + rows)
    found = find_block_codes(weight)
    assert found is not None
    codes, panels = found.panels(), own.pack_panels(weight)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    kernels = {
        "streamed": lambda: own.streamed_linear(x, weight),
        "panel": lambda: own.panel_linear(x, panels),
        "block": lambda: own.block_panel_linear(x, *codes),
    }
    torch_threads(1)
    alone = {name: kernel() for name, kernel in kernels.items()}
    for threads in (2, 3, 7):
        torch_threads(threads)
        for _ in range(3):
            for name, kernel in kernels.items():
                assert torch.equal(kernel(), alone[name]), (name, threads)
    torch.testing.assert_close(alone["block"], (x.double() @ weight.double().T).float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("which", ["panel", "block", "attention"])
def test_a_kernel_lets_other_python_threads_run(own, torch_threads, which: str) -> None:
    # a service's event loop keeps serving while its model thread is in a kernel: with the GIL held, this thread
    # could not take a single Python step in the middle of a kernel call
    import threading
    import time

    from common.runtime.block_weights import find_block_codes
    from common.runtime.test_block_weights import q8_0

    torch_threads(1)  # a core left for this thread
    gen = torch.Generator().manual_seed(3)
    if which == "attention":
        H, Hkv, D, past, B = 9, 3, 64, 16000, 4
        q, k_new, v_new = (
            torch.randn(B, H, D, generator=gen),
            torch.randn(B, Hkv, D, generator=gen),
            torch.randn(B, Hkv, D, generator=gen),
        )
        ks = [torch.randn(Hkv, past + 1, D, generator=gen) for _ in range(B)]
        vs = [torch.randn(Hkv, past + 1, D, generator=gen) for _ in range(B)]
        out = torch.empty_like(q)

        def call():
            mask = torch.ones(B, dtype=torch.bool)
            return own.cache_attention(
                q, k_new, v_new, ks, vs, list(range(B)), [1] * B, [True] * B, mask, list(range(B)), 0.125, out
            )

    else:
        weight = q8_0(49152, 576, seed=5)  # a vocabulary's output projection
        x = torch.randn(48, 576, generator=gen)
        if which == "block":
            found = find_block_codes(weight)
            assert found is not None
            codes = found.panels()
            call = lambda: own.block_panel_linear(x, *codes)  # noqa: E731
        else:
            panels = own.pack_panels(weight)
            call = lambda: own.panel_linear(x, panels)  # noqa: E731
    calls: list[tuple[float, float]] = []

    def kernel() -> None:
        for _ in range(3):
            t0 = time.perf_counter()
            call()
            calls.append((t0, time.perf_counter()))

    steps: list[float] = []
    worker = threading.Thread(target=kernel)
    worker.start()
    while worker.is_alive():
        steps.append(time.perf_counter())
    worker.join()
    # the middle half of each call: its first quarter may still be the wait for the GIL before the kernel starts
    middles = [(s + (e - s) / 4, e - (e - s) / 4) for s, e in calls]
    inside = sum(1 for t in steps for lo, hi in middles if lo < t < hi)
    assert inside > 10, (
        f"{inside} Python steps of another thread amid kernel calls of {[round(e - s, 3) for s, e in calls]} s"
    )
