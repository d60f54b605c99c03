"""The project's own CPU projection kernels (``csrc/streamed_linear.cpp``), built into one extension
with its CPU attention kernel (``csrc/cache_attention.cpp``: the ``cpu_kernel`` backend of
:mod:`common.runtime.cpu_attention`).

- *streamed*: a few rows times a weight, the weight read once. A verify pass on a CPU is bound by
  reading the weights up to a dozen or so rows, so a pass of eight rows should cost about what a
  pass of one costs; MKL's and oneDNN's few-row kernels do not get there (a pass jumped at its
  fourth row). This kernel streams blocks of three weight rows once (prefetched ahead) and
  multiplies each block by the input rows eight at a time (four on AVX2) with the accumulators in
  registers.
- *panel*: written for passes past a few rows, which are bound by arithmetic (where it was
  measured it was also the fastest down to one row). The weight is packed once into column panels
  (``[N/16, K, 16]``, a copy as large as the weight); each accumulator is a vector of 16 outputs, an
  input element is broadcast into three panels at once (no horizontal sums), and a thread walks its
  panels in chunks of 128 inner steps that stay in L1 while every group of eight rows adds its
  products.
- *block_panel*: the panel kernel on a weight held as 8-bit codes with a float16 scale and offset
  per block of 32 inputs (GGUF's Q8_0 and Q4_1 forms, found exactly in a float32 weight by
  :mod:`common.runtime.block_weights`): a quarter of the bytes a pass. Up to 16 rows the codes are
  dequantized in registers as the tile steps through them, past that into a chunk that stays in L1;
  either way each output is summed with the panel kernel's fused multiply-adds in its order on the
  same weights, so the products are the panel kernel's bit for bit. The AVX2 build's register tile
  is four rows of one panel (16 registers: 8 accumulators, the block's scales and offsets, a step's
  weights and a broadcast), since dequantizing every step into the chunk buffer left a pass of one
  row far from the machine's memory bandwidth. Five or six rows take one tile of ten or twelve
  accumulators, the block's scales and offsets read from L1 by the instructions that dequantize
  (its steps in assembly: in intrinsics the compiler stored the accumulators at every step), where a
  tile of four and one of one or two would wait on their short chains of multiply-adds. From nine
  rows to 48 the tile's four rows dequantize each block once and the other rows read its weights
  from L1, six at a time, instead of a tile per four rows dequantizing again.

Every kernel splits its work into items (blocks of weight rows, panels, a sequence's key/value head)
that its threads claim (``claim_for`` in ``csrc/vec.h``): each thread takes its own contiguous share
from the front and, once done, takes items from the back of whichever share has most left. A
serving process shares its cores with the router, the gateway and the drafters; with a fixed split
every kernel call waited for a thread another process had preempted. Which thread computes an item
never changes its bits.

The extension is built from source once per machine, with the machine's C++ compiler and
``-march=native``, and cached in ``$COSINE_CACHE_DIR/kernels`` under a name that follows the source,
the flags, the CPU's flags and torch, so a cache shared with another kind of CPU is never loaded;
every load is checked against ``linear`` on a small case. ``cosine kernels build`` (run by ``make
setup``) builds it ahead and says what it built for which instruction set, or why it is left out;
a cached build only loads. Where that did not happen, the first process that asks for the kernels
builds them itself (a first request then waits for the compiler) or, where they cannot be had,
logs why once and goes on without them.

It compiles for the instruction set the CPU has: AVX-512, or AVX2 with FMA (``isa()`` says which),
whose kernels hold fewer accumulators in their 16 registers (four input rows a streamed block, six
rows of one panel a panel micro-tile) with the same packing. Without either, a compiler, ninja or a
successful build neither kernel is offered (:func:`extension` returns None, logged once), and
:mod:`common.runtime.cpu_linear` measures the other kernels as before. Results equal ``linear``'s up
to float rounding (the summation order differs), as any other kernel's do; both kernels sum each
output in the same order whatever the number of rows.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from common.logs import get_logger
from common.runtime.threads import cache_dir

log = get_logger("streamed_linear")

SOURCE = Path(__file__).with_name("csrc") / "streamed_linear.cpp"
ATTENTION_SOURCE = SOURCE.with_name("cache_attention.cpp")  # the same extension's attention (cpu_attention.py)
VEC_HEADER = SOURCE.with_name("vec.h")  # the vector type and row dispatch both sources include
K_MULTIPLE = 16  # the streamed kernel's inner dimension steps by one AVX-512 register of float32 (two AVX2 ones)
PANEL_WIDTH = 16  # the panel kernel's outputs come in panels of one AVX-512 register of float32 (two AVX2 ones)
FLAGS = ("-O3", "-march=native", "-fopenmp")
AVX2_FLAGS = ("-mno-avx512f",)  # the AVX2 kernels on a CPU that has AVX-512 too (tests, comparisons)
CAPABILITIES = ("AVX2", "AVX512", "AMX")  # torch's names for the CPUs the kernels compile for

StreamedLinear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_name(extra_flags: tuple[str, ...] = ()) -> str:
    """The extension's name: changes with the source, the compile flags, this CPU's flags and torch,
    and with where the sources and torch are. The build's commands name the sources and torch's
    headers by path, so two checkouts (or two environments) sharing one cache under one name would
    each find the other's commands in the build directory and compile again on every load; with the
    paths in the name each keeps its own build, and a cached build only loads."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (SOURCE, ATTENTION_SOURCE, VEC_HEADER)))
    digest.update(" ".join(FLAGS + extra_flags).encode())
    digest.update(torch.__version__.encode())
    for where in (SOURCE.parent, Path(torch.__file__).parent):
        digest.update(str(where.resolve()).encode() + b"\0")
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    digest.update(flags.encode())
    return f"cosine_streamed_linear_{digest.hexdigest()[:12]}"


def ninja_dir() -> Path | None:
    """Where ``ninja`` is: on ``PATH``, or beside this interpreter (the ``ninja`` package of the
    project's virtual environment, whose ``bin`` a service started by path does not have on ``PATH``)."""
    found = shutil.which("ninja")
    if found is not None:
        return Path(found).parent
    beside = Path(sys.executable).parent / "ninja"
    return beside.parent if beside.is_file() else None


def unavailable_reason() -> str | None:
    """Why the kernel cannot be had on this machine before trying to build it, or None."""
    if torch.backends.cpu.get_cpu_capability() not in CAPABILITIES:
        return f"the CPU has neither AVX-512 nor AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    if ninja_dir() is None:
        return "no ninja on PATH or beside the interpreter (torch builds extensions with it: pip install ninja)"
    missing = [str(p) for p in (SOURCE, ATTENTION_SOURCE, VEC_HEADER) if not p.is_file()]
    if missing:
        return f"its sources {', '.join(missing)} are missing"
    return None


def build_directory(extra_flags: tuple[str, ...] = ()) -> Path:
    """Where the build for this source, these flags, this CPU and this torch is cached."""
    return cache_dir() / "kernels" / build_name(extra_flags)


def is_cached(extra_flags: tuple[str, ...] = ()) -> bool:
    """Whether that build is in the cache already: loading it then compiles nothing."""
    return any(build_directory(extra_flags).glob("*.so"))


@functools.cache
def extension() -> ModuleType | None:
    """The built extension (``isa``, ``streamed_linear``, ``pack_panels``, ``panel_linear``,
    ``block_panel_linear``, ``cache_attention``), built on
    first use for this CPU and checked against ``linear``; None where it cannot be had (the reason is
    logged once)."""
    return build()


STALE_LOCK_S = 600.0  # a build lock older than this was left by a build that was killed (a build takes far less)


def clear_stale_lock(build_dir: Path, older_than_s: float = STALE_LOCK_S) -> bool:
    """Remove the build's ``lock`` file when it is older than ``older_than_s``; whether it did.

    torch's extension builder takes that file while it compiles and removes it when done; a build
    killed meanwhile (Ctrl-C on a first start, a pod evicted) leaves it behind, and every later start
    would wait for it forever, silently. A younger one belongs to a build still running (the
    verifier and a drafter starting together on a fresh machine), which the caller waits for."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < older_than_s:
        return False
    lock.unlink(missing_ok=True)
    log.warning(
        "removed a stale kernel build lock (a build was killed while compiling)", lock=str(lock), age_s=round(age)
    )
    return True


@dataclass(frozen=True)
class KernelBuild:
    """What :func:`build_kernels` did: ``module`` the checked extension, or None with ``reason``
    saying why it is left out; ``cached``: it was loaded from an earlier build in ``build_dir``
    (nothing compiled). ``build_dir`` is None where the kernels are not offered at all."""

    module: ModuleType | None
    reason: str | None = None
    build_dir: Path | None = None
    cached: bool = False

    @property
    def isa(self) -> str | None:
        return None if self.module is None else str(self.module.isa())


def build(extra_flags: tuple[str, ...] = ()) -> ModuleType | None:
    """Build (or load from the cache) and check the extension with ``extra_flags`` after
    :data:`FLAGS` (:data:`AVX2_FLAGS`: the AVX2 kernels on an AVX-512 CPU); None where it cannot be had."""
    return build_kernels(extra_flags).module


def build_kernels(extra_flags: tuple[str, ...] = ()) -> KernelBuild:
    """:func:`build`, saying what it did: built, loaded from the cache, or left out and why. A failed
    build or check is logged once and returned as a reason, never raised: it only costs the
    candidates, never the service."""
    reason = unavailable_reason()
    if reason is not None:
        log.info("own cpu kernels not offered", reason=reason)
        return KernelBuild(None, reason)
    from torch.utils.cpp_extension import load

    where = ninja_dir()
    if where is not None and shutil.which("ninja") is None:  # torch runs `ninja` by name
        os.environ["PATH"] = f"{where}{os.pathsep}{os.environ.get('PATH', '')}"
    name = build_name(extra_flags)
    build_dir = build_directory(extra_flags)
    t0 = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(build_dir)
        fresh = not any(build_dir.glob("*.so"))
        if fresh:
            log.info("building the own cpu kernels (once per machine)", build_dir=str(build_dir))
        module = load(
            name=name,
            sources=[str(p) for p in (SOURCE, ATTENTION_SOURCE)],
            extra_cflags=list(FLAGS + extra_flags),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
        check(module)
    except Exception as exc:  # a failed build or check only costs the candidates, never the service
        log.warning("own cpu kernels unavailable; using torch's", error=str(exc)[-500:], build_dir=str(build_dir))
        last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        return KernelBuild(None, f"the build failed ({last[-300:]})", build_dir)
    if fresh:
        log.info("own cpu kernels built", isa=module.isa(), seconds=round(time.perf_counter() - t0, 1))
    return KernelBuild(module, None, build_dir, cached=not fresh)


def check(module: ModuleType) -> None:
    """Raise RuntimeError unless the streamed and panel kernels agree with ``linear`` on a small case."""
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(48, 48, generator=gen), torch.randn(11, 48, generator=gen)
    want = torch.nn.functional.linear(x, weight)
    for what, got in (
        ("streamed", module.streamed_linear(x, weight[:29])),
        ("panel", module.panel_linear(x, module.pack_panels(weight))),
    ):
        if not torch.allclose(got, want[:, : got.shape[1]], rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"the {what} kernel disagrees with torch's linear on a small case")


def describe(result: KernelBuild) -> str:
    """One line for an operator: what was built or loaded, for which instruction set, and where; or
    that the kernels are left out, why, and what serves instead."""
    if result.module is None:
        return f"the project's CPU kernels are left out: {result.reason}; the services use torch's kernels instead"
    how = "loaded from the cache in" if result.cached else "built into"
    return f"the project's CPU kernels for {result.isa}: {how} {result.build_dir}"


def streamed_kernel() -> StreamedLinear | None:
    """``streamed_linear(x [M, K], weight [N, K]) -> x @ weight.T`` (float32, ``K`` a multiple of 16),
    or None where the extension cannot be had."""
    module = extension()
    return None if module is None else module.streamed_linear
