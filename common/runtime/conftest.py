"""Fixtures of the CPU kernel tests in this package."""

from __future__ import annotations

import pytest
import torch

from common.runtime.streamed_linear import AVX2_FLAGS, build, extension, unavailable_reason


@pytest.fixture(scope="module", params=["native", "avx2"])
def own(request):
    """The built extension: for this CPU, and on an AVX-512 CPU its AVX2 kernels too."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"own kernels not offered here: {reason}")
    if request.param == "native":
        got = extension()
    elif torch.backends.cpu.get_cpu_capability() == "AVX2":
        pytest.skip("this CPU's own build is the AVX2 one")
    else:
        got = build(AVX2_FLAGS)
        assert got is not None and got.isa() == "avx2"
    assert got is not None
    return got


@pytest.fixture
def torch_threads():
    """Sets torch's thread count for one test and puts the old one back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a whole module (its figures do not depend on what else the machine runs),
    the old count put back after it; a module takes it with ``pytestmark``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
