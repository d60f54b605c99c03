"""Micro-benchmark of the verifier's forward pass.

Prints, for the target model (a random Llama created on the fly unless ``--target`` is given):

1. the cost of verifying ``k = 1..8`` drafted tokens (a chain) for one request, relative to one
   plain decode step (an empty tree) on the same cache;
2. the throughput of one batched verify pass at batch 1/4/16 relative to verifying the same
   requests one by one (same caches, same trees);
3. the verify pass (decode, chain of 5, tree of 10) at batch 1/8/32 against a plain transformers
   forward with a ``DynamicCache`` on the same shapes, and the bound (see
   :mod:`benchmarks.verify_vs_hf`), e.g. on a GPU:
   ``python -m benchmarks.verify_micro --device cuda --dtype bfloat16 --context 512 --hidden 2048 --layers 16``;
4. the verify pass at batch 1/8/32 on the paged arena against today's per-request caches (same
   requests, same trees), as a ratio.

``--op-count`` prints instead the tensor operations of one verify pass (the runner's forward,
views left out: :mod:`common.runtime.op_count`) at batch 1/8/32, for the paged path and for
today's: ``ops per pass: B=1 <n>, B=8 <n>, B=32 <n>``.

A "verify pass" is what the engine runs per batch: the runner's forward over the last committed
token plus the tree on top of each request's cache, and the greedy acceptance walk. Caches are
left unchanged between repetitions (the pending entries are discarded), so every repetition sees
the same context length.

    python -m benchmarks.verify_micro --help
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common.runtime.runner import LMRunner, SeqInput
from common.spec.acceptance import GreedyRule
from common.spec.types import TokenTree


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.verify_micro", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, help="target checkpoint directory (default: a random Llama)")
    ap.add_argument("--hidden", type=int, default=512, help="random model: hidden size (default 512)")
    ap.add_argument("--layers", type=int, default=4, help="random model: layers (default 4)")
    ap.add_argument("--vocab", type=int, default=8192, help="random model: vocabulary size (default 8192)")
    ap.add_argument("--context", type=int, default=256, help="cached tokens per request (default 256)")
    ap.add_argument("--batch-k", type=int, default=4, help="drafted tokens per request in the batch test (default 4)")
    ap.add_argument("--repeats", type=int, default=20, help="timed repetitions, median reported (default 20)")
    ap.add_argument("--backend", default="auto", help="attention backend: auto, sdpa, eager, flash_attn")
    ap.add_argument("--kv-cache", default="auto", help="KV cache of sections 1-3: auto, paged, contiguous")
    ap.add_argument("--op-count", action="store_true", help="print the tensor ops of one verify pass and stop")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--batches", default="1,8,32", help="batch sizes of the comparison with transformers (section 3)")
    ap.add_argument("--sections", default="1,2,3,4", help="sections to run (default: all)")
    ap.add_argument(
        "--peak-gbs",
        type=float,
        default=None,
        help="device memory bandwidth, GB/s, for the bound (known for H100/H200)",
    )
    ap.add_argument("--peak-tflops", type=float, default=None, help="device dense throughput, TFLOP/s, for the bound")
    return ap.parse_args(argv)


def build_random_target(args: argparse.Namespace, root: Path) -> Path:
    from cosine_zoo.random_checkpoints import make_checkpoint

    heads = max(1, args.hidden // 64)
    return make_checkpoint(
        root / "target",
        "llama",
        seed=0,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        vocab_size=args.vocab,
        max_position_embeddings=4096,
        initializer_range=0.02,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Bench:
    def __init__(self, runner: LMRunner, context: int, repeats: int) -> None:
        self.runner, self.context, self.repeats = runner, context, repeats
        self.pool = runner.new_pool(None)
        self.rule = GreedyRule()
        self.gen = torch.Generator().manual_seed(0)

    def new_request(self, context: int):
        """A cache holding ``context - 1`` tokens and the last committed token (not yet cached)."""
        ids = torch.randint(0, self.runner.vocab_size, (context,), generator=self.gen).tolist()
        cache = self.pool.new_cache()
        cache.reserve(context - 1 + 64)
        self.runner.forward([SeqInput(cache, tuple(ids[:-1]))])
        cache.commit(context - 1)
        return cache, ids[-1]

    def tree(self, k: int) -> TokenTree:
        return TokenTree.chain(torch.randint(0, self.runner.vocab_size, (k,), generator=self.gen).tolist())

    def verify_pass(self, reqs: list[tuple], trees: list[TokenTree]) -> None:
        seqs = [
            SeqInput(
                cache, (last, *t.tokens), (-1, *(0 if p < 0 else p + 1 for p in t.parents)), tuple(range(len(t) + 1))
            )
            for (cache, last), t in zip(reqs, trees)
        ]
        logits = self.runner.forward(seqs)
        for t, lg in zip(trees, logits):
            self.rule.decide(t, lg, None)
        for cache, _ in reqs:
            cache.discard_pending()
        sync(self.runner.device)

    def time(self, fn) -> float:
        for _ in range(3):
            fn()
        samples = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.target or build_random_target(args, Path(tmp))
        runner = LMRunner.from_checkpoint(
            path, dtype=args.dtype, device=args.device, backend=args.backend, kv_cache=args.kv_cache
        )
        sections = {int(x) for x in args.sections.split(",") if x.strip()}
        paged = contiguous = runner
        if args.op_count or 4 in sections:  # the other kind of cache too, to compare
            contiguous = LMRunner.from_checkpoint(
                path, dtype=args.dtype, device=args.device, backend=args.backend, kv_cache="contiguous"
            )
            # the arena attends with its own sdpa whatever --backend names
            paged = LMRunner.from_checkpoint(path, dtype=args.dtype, device=args.device, kv_cache="paged")
    if args.op_count:
        section_op_count(paged, contiguous, args)
        return
    cfg = runner.config
    print(
        f"target: {runner.architecture} hidden={cfg.hidden_size} layers={runner.num_layers} "
        f"heads={runner.num_heads}/{runner.num_kv_heads} vocab={runner.vocab_size} "
        f"params={runner.num_parameters / 1e6:.1f}M dtype={args.dtype} device={args.device} "
        f"backend={runner.attention_name} kv_cache={runner.kv_cache} threads={torch.get_num_threads()} "
        f"context={args.context}"
    )
    bench = Bench(runner, args.context, args.repeats)
    if 1 in sections:
        section_chain(bench, args)
    if 2 in sections:
        section_batch(bench, args)
    if 3 in sections:
        from benchmarks.verify_vs_hf import compare, device_peaks

        peaks = device_peaks(runner.device, args.peak_gbs, args.peak_tflops)
        compare(runner, args.context, [int(b) for b in args.batches.split(",")], args.repeats, peaks)
    if 4 in sections:
        section_paged(paged, contiguous, args)


def section_chain(bench: Bench, args: argparse.Namespace) -> None:
    req = bench.new_request(args.context)
    base = bench.time(lambda: bench.verify_pass([req], [TokenTree()]))
    print("\n1) verify cost for one request, k drafted tokens (chain) vs one plain decode step")
    print(f"   plain decode step: {base * 1e3:.2f} ms")
    print("   k   ms      x decode")
    for k in range(1, 9):
        tree = bench.tree(k)
        t = bench.time(lambda: bench.verify_pass([req], [tree]))
        print(f"   {k}   {t * 1e3:6.2f}  {t / base:5.2f}")


def section_batch(bench: Bench, args: argparse.Namespace) -> None:
    print(
        f"\n2) batched verify throughput vs the same requests one by one "
        f"(k={args.batch_k} chain per request, contexts {args.context // 2}..{args.context})"
    )
    print("   batch  batched ms  one-by-one ms  throughput x")
    for b in (1, 4, 16):
        reqs = [
            bench.new_request(args.context // 2 + (i * args.context) // (2 * max(1, b - 1)) if b > 1 else args.context)
            for i in range(b)
        ]
        trees = [bench.tree(args.batch_k) for _ in range(b)]
        batched = bench.time(lambda: bench.verify_pass(reqs, trees))
        singles = bench.time(lambda: [bench.verify_pass([r], [t]) for r, t in zip(reqs, trees)])
        print(f"   {b:5d}  {batched * 1e3:10.2f}  {singles * 1e3:13.2f}  {singles / batched:12.2f}")


def batch_requests(bench: Bench, b: int, context: int) -> list[tuple]:
    """``b`` requests with contexts spread over ``context / 2 .. context`` (one request: ``context``)."""
    if b == 1:
        return [bench.new_request(context)]
    return [bench.new_request(context // 2 + (i * context) // (2 * (b - 1))) for i in range(b)]


def verify_seqs(reqs: list[tuple], trees: list[TokenTree]) -> list[SeqInput]:
    return [
        SeqInput(cache, (last, *t.tokens), (-1, *(0 if p < 0 else p + 1 for p in t.parents)), tuple(range(len(t) + 1)))
        for (cache, last), t in zip(reqs, trees)
    ]


def section_op_count(paged: LMRunner, contiguous: LMRunner, args: argparse.Namespace) -> None:
    from common.runtime.op_count import forward_ops

    batches = [int(b) for b in args.batches.split(",")]
    print(f"tensor ops of one verify pass (forward, views left out; k={args.batch_k} chain per request)")
    for name, runner in (("paged", paged), ("contiguous", contiguous)):
        bench = Bench(runner, args.context, args.repeats)
        counts = []
        for b in batches:
            reqs = batch_requests(bench, b, args.context)
            counts.append(forward_ops(runner, verify_seqs(reqs, [bench.tree(args.batch_k) for _ in reqs])))
            for cache, _ in reqs:
                cache.release()
        line = ", ".join(f"B={b} {n}" for b, n in zip(batches, counts))
        print(f"ops per pass: {line}" if name == "paged" else f"{name}: ops per pass: {line}")


def section_paged(paged: LMRunner, contiguous: LMRunner, args: argparse.Namespace) -> None:
    print(
        f"\n4) verify pass on the paged arena vs today's per-request caches "
        f"(k={args.batch_k} chain per request; paged: {paged.attention_name}, today: {contiguous.attention_name})"
    )
    print("   batch  paged ms  today ms  today / paged")
    for b in [int(x) for x in args.batches.split(",")]:
        times = []
        for runner in (paged, contiguous):
            bench = Bench(runner, args.context, args.repeats)
            bench.gen.manual_seed(b)  # the same requests and trees on both
            reqs = batch_requests(bench, b, args.context)
            trees = [bench.tree(args.batch_k) for _ in reqs]
            times.append(bench.time(lambda: bench.verify_pass(reqs, trees)))
            for cache, _ in reqs:
                cache.release()
        print(f"   {b:5d}  {times[0] * 1e3:8.2f}  {times[1] * 1e3:8.2f}  {times[1] / times[0]:13.2f}")


if __name__ == "__main__":
    main()
