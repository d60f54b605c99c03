"""Section 3 of ``benchmarks.verify_micro``: the runner's verify pass against a plain transformers
forward over a ``DynamicCache`` on the same shapes, and the bound both are held against.

Shapes: ``batch`` requests of ``context`` cached tokens each; a pass over 1 new token per request
(decode), a chain of 5, and (ours only: transformers has no tree cache) a tree of 10 nodes. The
transformers side runs the checkpoint's own module with ``past_key_values`` and crops the cache
back after every repetition, so both sides always see the same context length.

The bound is the larger of the memory time (weights plus the batch's KV cache read once) and the
compute time (2 FLOPs per parameter per new token plus attention over the context), at the
device's peak bandwidth and throughput: given with ``--peak-gbs``/``--peak-tflops``, or known for
H100 and H200 GPUs; not printed otherwise.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.runtime.runner import LMRunner, SeqInput

# parents of the 10-node tree (relative to the last committed token): two branches of five
TREE10 = (-1, 0, 1, 2, 3, -1, 5, 6, 7, 8)
# (bandwidth GB/s, dense 16-bit TFLOP/s) by a substring of the CUDA device name (SXM parts)
KNOWN_PEAKS = {"H200": (4800.0, 989.0), "H100": (3350.0, 989.0)}


@dataclass(frozen=True)
class Peaks:
    gbs: float
    tflops: float


def device_peaks(device: torch.device, gbs: float | None, tflops: float | None) -> Peaks | None:
    if gbs and tflops:
        return Peaks(gbs, tflops)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (bw, fl) in KNOWN_PEAKS.items():
            if key in name:
                return Peaks(gbs or bw, tflops or fl)
    return None


def bound_s(runner: LMRunner, batch: int, context: int, new: int, peaks: Peaks) -> float:
    item = torch.empty((), dtype=runner.dtype).element_size()
    params = runner.num_parameters
    kv = batch * context * runner.num_layers * 2 * runner.num_kv_heads * runner.head_dim * item
    flops = (
        2 * params * batch * new + 4 * batch * new * context * runner.num_layers * runner.num_heads * runner.head_dim
    )
    return max((params * item + kv) / (peaks.gbs * 1e9), flops / (peaks.tflops * 1e12))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


class Shapes:
    """``batch`` requests of ``context`` cached tokens, both in the runner's caches and in a
    transformers ``DynamicCache`` (same token ids)."""

    def __init__(self, runner: LMRunner, batch: int, context: int, seed: int = 0):
        self.runner, self.batch, self.context = runner, batch, context
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, runner.vocab_size, (batch, context + 16), generator=gen)
        pool = runner.new_pool(None)
        self.caches = []
        for b in range(batch):
            cache = pool.new_cache()
            cache.reserve(context + 16)
            runner.forward([SeqInput(cache, tuple(self.ids[b, :context].tolist()))])
            cache.commit(context)
            self.caches.append(cache)
        with torch.inference_mode():
            out = runner.model(self.ids[:, :context].to(runner.device), use_cache=True)
        self.hf_cache = out.past_key_values

    def seqs(self, parents: Sequence[int]) -> list[SeqInput]:
        """The pass's inputs: the new tokens ``ids[:, context:context + len(parents)]`` with that
        tree shape on every request's cache."""
        t = len(parents)
        return [
            SeqInput(c, tuple(self.ids[b, self.context : self.context + t].tolist()), tuple(parents), tuple(range(t)))
            for b, c in enumerate(self.caches)
        ]

    def ours(self, parents: Sequence[int]) -> list[torch.Tensor]:
        """One pass over :meth:`seqs`; returns per request the logits of every new token (the caches
        are left as they were)."""
        logits = self.runner.forward(self.seqs(parents))
        self.discard()
        return logits

    def discard(self) -> None:
        for c in self.caches:
            c.discard_pending()

    @torch.inference_mode()
    def hf(self, new: int) -> torch.Tensor:
        """The same as a chain through transformers: logits ``[batch, new, vocab]``."""
        ids = self.ids[:, self.context : self.context + new].to(self.runner.device)
        out = self.runner.model(ids, past_key_values=self.hf_cache, use_cache=True)
        self.hf_cache.crop(-new)  # back to the context length
        return out.logits


def compare(
    runner: LMRunner, context: int, batches: Sequence[int], repeats: int, peaks: Peaks | None
) -> list[dict[str, float]]:
    """Print the table; return its rows (seconds)."""
    dev = runner.device
    print(f"\n3) verify pass vs a transformers forward with a DynamicCache, {context} cached tokens per request")
    print("   (HF has no tree cache: a tree of 10 is held against its chain of 10, the same rows)")
    head = "   batch  ours decode  HF decode  ours chain5  HF chain5  ours tree10  HF chain10  chain5 HF/ours"
    print(head + ("  bound chain5  ours/bound" if peaks else ""))
    rows = []
    for b in batches:
        s = Shapes(runner, b, context)
        row = {
            "batch": b,
            "ours_decode": timed(lambda: s.ours((-1,)), repeats, dev),
            "hf_decode": timed(lambda: s.hf(1), repeats, dev),
            "ours_chain5": timed(lambda: s.ours((-1, 0, 1, 2, 3)), repeats, dev),
            "hf_chain5": timed(lambda: s.hf(5), repeats, dev),
            "ours_tree10": timed(lambda: s.ours(TREE10), repeats, dev),
            "hf_chain10": timed(lambda: s.hf(10), repeats, dev),
        }
        line = (
            f"   {b:5d}  {row['ours_decode'] * 1e3:8.2f} ms  {row['hf_decode'] * 1e3:6.2f} ms  "
            f"{row['ours_chain5'] * 1e3:8.2f} ms  {row['hf_chain5'] * 1e3:6.2f} ms  {row['ours_tree10'] * 1e3:8.2f} "
            f"ms  {row['hf_chain10'] * 1e3:7.2f} ms  "
            f"{row['hf_chain5'] / row['ours_chain5']:14.2f}"
        )
        if peaks:
            row["bound_chain5"] = bound_s(runner, b, context, 5, peaks)
            line += f"  {row['bound_chain5'] * 1e3:9.3f} ms  {row['ours_chain5'] / row['bound_chain5']:10.1f}"
        print(line)
        rows.append(row)
        s = None  # this batch's caches go before the next batch's are built
    return rows
