"""`cosine kernels build` (what `make setup` runs), as a process: a build already in the cache is
reported with its instruction set and only loaded (nothing compiled, which is what keeps a repeated
`make setup` quick), and a machine without a C++ compiler gets one line saying the kernels are left
out and why, and exit status 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.runtime import streamed_linear
from common.runtime.streamed_linear import build_directory, extension, unavailable_reason

ROOT = Path(__file__).resolve().parents[1]


def kernels_build(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cosine_cli.main", "kernels", "build", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def compiled(build_dir: Path) -> dict[str, int]:
    """The build's objects and library with their modification times (a compile or a link changes them)."""
    return {p.name: p.stat().st_mtime_ns for p in build_dir.iterdir() if p.suffix in (".o", ".so")}


def test_a_cached_build_is_reported_with_its_isa_and_only_loaded() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"own kernels not offered here: {reason}")
    own = extension()  # built here unless an earlier test or `make setup` did
    assert own is not None
    build_dir = build_directory()
    before = compiled(build_dir)
    proc = kernels_build()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = f"the project's CPU kernels for {own.isa()}: loaded from the cache in {build_dir}"
    assert proc.stdout.splitlines() == [said]
    assert before and compiled(build_dir) == before  # nothing compiled or linked again


def test_without_a_compiler_one_line_says_the_kernels_are_left_out(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    missing = str(tmp_path / "no-such-c++")
    monkeypatch.setenv("CXX", missing)
    reason = streamed_linear.unavailable_reason()  # "no C++ compiler ..." (or, first, a CPU it cannot build for)
    assert reason is not None
    cache = tmp_path / "cache"
    proc = kernels_build(CXX=missing, COSINE_CACHE_DIR=str(cache))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        f"the project's CPU kernels are left out: {reason}; the services use torch's kernels instead"
    ]
    assert proc.stderr == ""
    assert not cache.exists()  # no build was tried
    assert kernels_build("--require", CXX=missing, COSINE_CACHE_DIR=str(cache)).returncode == 1
