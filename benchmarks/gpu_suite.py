"""The GPU suite: every figure of the verifier and the services on one accelerator, in one command.

On a CUDA machine (no network needed: the models are made on the spot, :mod:`benchmarks.synthetic_family`),
it writes one JSON report and prints one table per section, then the goals met and missed:

1. **verify**: the runner's verify pass (decode, chain of 5, tree of 10) at batch 1, 8, 32 and 64 on
   the ~1 B target in bfloat16, 512 cached tokens a request, against a transformers forward with a
   ``DynamicCache`` on the same shapes (:mod:`benchmarks.verify_vs_hf`), with the memory/compute
   bound, and the tensor operations of one pass at each batch size (:mod:`common.runtime.op_count`);
2. **equality**: float32 greedy decoding through the verifier engine against transformers
   ``generate``, prompt by prompt; and speculative decoding (the router core with the family's
   drafters, in process) against the same engine's own plain greedy decoding, in bfloat16, prompt
   by prompt, with the first token where any differs;
3. **e2e**: the real services on this one machine (Redis, verifier and drafters on the accelerator,
   router and gateway on its CPU cores; ``cosine bench``'s ``suite`` scenario): ``cosine``,
   ``autoregressive`` and ``vanilla_sd`` at 1 and 16 clients, every greedy output checked.

``--device cpu --smoke`` runs the same suite on tiny shapes in about a minute (a test does).

    python -m benchmarks.gpu_suite                      # CUDA, the 1 B family
    python -m benchmarks.gpu_suite --device cpu --smoke
    python -m benchmarks.gpu_suite --sections verify,equality

What it needs beyond torch (with CUDA), triton and a C compiler is listed in
``benchmarks/gpu_suite_requirements.txt``, so it can be installed on a machine without network.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SECTIONS = ("verify", "equality", "e2e")
SCHEMA = "cosine-gpu-suite/1"


@dataclass(frozen=True)
class Size:
    family: str  # benchmarks.synthetic_family.FAMILIES
    dtype: str  # the verify section's and the speculative equality's
    context: int
    batches: tuple[int, ...]
    repeats: int
    prompts: int  # equality: prompts compared
    new_tokens: int  # equality: tokens decoded per prompt
    concurrency: int  # equality: speculative requests in flight
    e2e_requests: int | None  # None: the suite scenario's
    e2e_new_tokens: int | None


SIZES = {
    "full": Size("1b", "bfloat16", 512, (1, 8, 32, 64), 20, 16, 48, 8, None, None),
    "smoke": Size("smoke", "float32", 32, (1, 8), 3, 6, 12, 4, 8, 10),
}

# (figure, goal, how it is read from the report); a goal whose figure is missing is "not measured"
GOALS = (
    ("verify chain5 batch 32, HF / ours", 2.0, ("verify", 32, "chain5")),
    ("verify tree10 batch 32, HF / ours", 2.0, ("verify", 32, "tree10")),
    ("verify chain5 batch 8, HF / ours", 1.5, ("verify", 8, "chain5")),
    ("verify tree10 batch 8, HF / ours", 1.5, ("verify", 8, "tree10")),
    ("verify chain5 batch 1, HF / ours", 3.0, ("verify", 1, "chain5")),
    ("verify tree10 batch 1, HF / ours", 3.0, ("verify", 1, "tree10")),
    ("bound / ours, chain5 batch 32 (>= 1/3)", 1 / 3, ("bound", 32, "chain5")),
    ("float32 greedy == generate, share of prompts", 1.0, ("equality", "float32")),
    ("speculative == plain, same engine, share of prompts", 0.95, ("equality", "speculative")),
    ("e2e cosine / autoregressive tokens/s, 1 client", 1.5, ("e2e", "closed_c1")),
    ("e2e cosine / autoregressive tokens/s, 16 clients", 1.0, ("e2e", "closed_c16")),
)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- 1. the verify pass ---------------------------------------------------------------------------


def section_verify(target: Path, size: Size, device: str, attention: str = "auto") -> dict[str, Any]:
    import torch

    from benchmarks.verify_vs_hf import TREE10, Shapes, compare, device_peaks, timed
    from common.runtime.op_count import forward_ops
    from common.runtime.runner import LMRunner

    runner = LMRunner.from_checkpoint(target, dtype=size.dtype, device=device, backend=attention)
    peaks = device_peaks(torch.device(device), None, None)
    rows = compare(runner, size.context, size.batches, size.repeats, peaks)
    graphs = runner.graphs.stats() if runner.graphs is not None else None
    mode, runner.graph_mode = runner.graph_mode, "off"  # the eager pass: its ops, and its time beside the graphs'
    ops = {}
    for row in rows:
        b = row["batch"]
        s = Shapes(runner, b, size.context)
        ops[b] = forward_ops(runner, s.seqs(TREE10))
        s.discard()
        if mode != "off":
            row["eager_chain5"] = timed(lambda: s.ours((-1, 0, 1, 2, 3)), size.repeats, torch.device(device))
        s = None
    runner.graph_mode = mode
    counts = ", ".join(f"B={b} {n}" for b, n in ops.items())
    print(f"   ops per pass (tree of 10, {runner.kv_cache} cache, eager): {counts}")
    if mode != "off":
        ratios = ", ".join(f"B={r['batch']} {r['eager_chain5'] / r['ours_chain5']:.2f}" for r in rows)
        print(f"   CUDA graphs: {graphs}; chain of 5 eager / from graphs: {ratios}")
    return {
        "attention": runner.attention_name,
        "kv_cache": runner.kv_cache,
        "cuda_graphs": graphs,
        "dtype": size.dtype,
        "context": size.context,
        "peaks": asdict(peaks) if peaks else None,
        "rows": rows,
        "ops_per_pass": {str(b): n for b, n in ops.items()},
    }


# ---- 2. equality ------------------------------------------------------------------------------------


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first position where ``a`` and ``b`` differ (-1: equal)."""
    from benchmarks.greedy_check import first_divergence

    return first_divergence(a, b)


def plain_decode(engine: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """The engine's greedy continuation of each prompt: one call, its prefill then ``new_tokens``
    plain steps (the family has no end-of-sequence token)."""
    from common.spec.types import VerifyItem

    ids = [f"eq-{i}" for i in range(len(prompts))]
    try:
        outcome = engine.verify(
            [VerifyItem(rid, append_ids=tuple(p), plain_steps=new_tokens) for rid, p in zip(ids, prompts)]
        )
        bad = [v for v in outcome.verdicts if not v.ok]
        if bad:
            raise RuntimeError(f"plain decoding failed: {bad[0].error}")
        return [list(v.new_tokens)[:new_tokens] for v in outcome.verdicts]
    finally:
        for rid in ids:
            engine.release(rid)


def section_equality(zoo: Any, prompts: list[list[int]], size: Size, device: str) -> dict[str, Any]:
    import torch

    from benchmarks.inprocess import Setup, cosine_run
    from common.runtime.checkpoints import load_causal_lm
    from common.runtime.verifier_engine import VerifierEngine
    from cosine_zoo.evaluate import greedy_continuations

    prompts = prompts[: size.prompts]
    # float32: the engine's greedy decoding against transformers' generate, one prompt at a time there
    engine = VerifierEngine.from_checkpoint(zoo.target.path, device=device, dtype="float32", seed=0)
    ours = plain_decode(engine, prompts, size.new_tokens)
    engine = None
    model = load_causal_lm(zoo.target.path, dtype="float32", device=device)
    theirs = [greedy_continuations(model, [p], size.new_tokens, None, 0, 1, device)[0] for p in prompts]
    model = None
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    fp32 = [first_difference(a, b) for a, b in zip(ours, theirs)]
    print(f"\nfloat32 greedy, engine vs transformers generate: {fp32.count(-1)}/{len(fp32)} prompts equal")
    for i, pos in enumerate(fp32):
        if pos >= 0:
            print(f"   prompt {i}: first difference at token {pos}: ours {ours[i][pos]}, generate {theirs[i][pos]}")

    # speculative against the same engine's plain greedy, in the suite's dtype
    setup = Setup.load(zoo, device, size.dtype, None)
    named = {f"r{i}": p for i, p in enumerate(prompts)}
    plain = dict(zip(named, plain_decode(setup.verifier, prompts, size.new_tokens)))
    run = asyncio.run(cosine_run(setup.core(), named, size.new_tokens, None, size.concurrency))
    spec = {rid: first_difference(run.outputs.get(rid, []), plain[rid]) for rid in named}
    equal = sum(pos == -1 for pos in spec.values())
    print(
        f"speculative ({size.dtype}) vs the same engine's plain greedy: {equal}/{len(spec)} prompts equal; "
        f"{run.stats['accepted_per_pass']:.2f} drafted tokens accepted a pass"
    )
    differ = {rid: pos for rid, pos in spec.items() if pos >= 0}
    for rid, pos in differ.items():
        print(f"   {rid}: first difference at token {pos}")
    return {
        "float32": {"equal": fp32.count(-1), "prompts": len(fp32), "first_difference": fp32},
        "speculative": {
            "dtype": size.dtype,
            "equal": equal,
            "prompts": len(spec),
            "first_difference": differ,
            "accepted_per_pass": run.stats["accepted_per_pass"],
        },
    }


# ---- 3. end to end ----------------------------------------------------------------------------------


def section_e2e(zoo_root: Path, out_dir: Path, size: Size, device: str) -> dict[str, Any]:
    from benchmarks.bench import BenchOptions, run_bench
    from benchmarks.greedy_check import BenchError

    opts = BenchOptions(
        zoo=str(zoo_root),
        out=str(out_dir / "e2e.json"),
        scenario="suite",
        systems=("autoregressive", "vanilla_sd", "cosine"),
        requests=size.e2e_requests,
        max_new_tokens=size.e2e_new_tokens,
        dtype=size.dtype,
        device=device,
        plots=False,
        progress=False,
        log_dir=str(out_dir / "logs"),
    )
    try:
        report = run_bench(opts)
    except BenchError as exc:  # a greedy mismatch included: reported, the rest of the suite still counts
        print(f"\nend to end: failed: {exc}")
        return {"error": str(exc)}
    systems = report["systems"]
    print("\nend to end, real services (tokens/s; ratio against autoregressive)")
    print("   workload      autoregressive  vanilla_sd      cosine  cosine/AR  vanilla/AR")
    rows = {}
    for wl in ("closed_c1", "closed_c16"):
        tps = {
            s: systems.get(s, {}).get(wl, {}).get("tokens_per_s") for s in ("autoregressive", "vanilla_sd", "cosine")
        }
        base = tps["autoregressive"] or 0.0
        ratio = {s: (v / base if v and base else None) for s, v in tps.items()}
        rows[wl] = {"tokens_per_s": tps, "vs_autoregressive": ratio}
        print(
            f"   {wl:12s}  {base:14.1f}  {tps['vanilla_sd'] or 0:10.1f}  {tps['cosine'] or 0:10.1f}  "
            f"{ratio['cosine'] or 0:9.2f}  {ratio['vanilla_sd'] or 0:10.2f}"
        )
    return {"workloads": rows, "greedy_checked": report["scenario"]["greedy_check"]["checked_requests"]}


# ---- goals and the report -------------------------------------------------------------------------


def goal_figures(sections: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal with the figure this run measured for it (None: not measured)."""
    out = []
    rows = {r["batch"]: r for r in sections.get("verify", {}).get("rows", [])}
    for name, goal, (kind, *key) in GOALS:
        value = None
        if kind == "verify" and key[0] in rows:
            r = rows[key[0]]
            value = r["hf_chain5"] / r["ours_chain5"] if key[1] == "chain5" else r["hf_chain10"] / r["ours_tree10"]
        elif kind == "bound" and key[0] in rows and "bound_chain5" in rows[key[0]]:
            value = rows[key[0]]["bound_chain5"] / rows[key[0]]["ours_chain5"]
        elif kind == "equality" and "equality" in sections:
            eq = sections["equality"][key[0]]
            value = eq["equal"] / eq["prompts"]
        elif kind == "e2e" and "workloads" in sections.get("e2e", {}):
            value = sections["e2e"]["workloads"][key[0]]["vs_autoregressive"]["cosine"]
        out.append({"figure": name, "goal": goal, "value": value, "met": None if value is None else value >= goal})
    return out


def machine(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return info


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_suite",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", default="cuda", help="torch device of the models (default cuda)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: the whole suite in about a minute")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--out", type=Path, default=Path("gpu-suite/report.json"), help="the JSON report")
    ap.add_argument(
        "--attention",
        default="auto",
        help="the verify section's attention backend (the verifier's --attention: auto, flashinfer, flex, sdpa, ...)",
    )
    ap.add_argument("--family", type=Path, help="an already built family directory to reuse (default: build one)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"error: unknown section(s) {', '.join(unknown)} (choose from {', '.join(SECTIONS)})", file=sys.stderr)
        return 2
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"error: --device {args.device}: torch sees no CUDA device here (try --device cpu --smoke)", file=sys.stderr
        )
        return 1
    from benchmarks.synthetic_family import build_family, family_prompts
    from common.logs import configure_logging
    from cosine_zoo.manifest import load_zoo

    configure_logging("warning")
    size = SIZES["smoke" if args.smoke else "full"]
    t0 = time.perf_counter()
    out_dir = args.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix="cosine-gpu-suite-") if args.family is None else None
    root = args.family or Path(tmp.name) / "family"
    if args.family is None or not (root / "zoo.json").is_file():
        say(f"suite      building the {size.family} family under {root} ...")
        build_family(root, size.family, seed=0, progress=lambda m: say(f"family     {m}"))
    zoo = load_zoo(root)
    from benchmarks.synthetic_family import FAMILIES

    prompts = [p for rows in family_prompts(FAMILIES[size.family], 0).values() for p in rows]
    report: dict[str, Any] = {"schema": SCHEMA, "machine": machine(args.device), "size": asdict(size), "sections": {}}
    timings: dict[str, float] = {}
    try:
        for name in sections:
            s0 = time.perf_counter()
            say(f"suite      {name} ...")
            if name == "verify":
                report["sections"]["verify"] = section_verify(zoo.target.path, size, args.device, args.attention)
            elif name == "equality":
                report["sections"]["equality"] = section_equality(zoo, prompts, size, args.device)
            else:
                report["sections"]["e2e"] = section_e2e(root, out_dir, size, args.device)
            timings[name] = time.perf_counter() - s0
    finally:
        report["timings_s"] = {**timings, "total": time.perf_counter() - t0}
        report["goals"] = goal_figures(report["sections"])
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        if tmp is not None:
            tmp.cleanup()
    print("\ngoals")
    for g in report["goals"]:
        value = "not measured" if g["value"] is None else f"{g['value']:.2f}"
        mark = "" if g["met"] is None else ("  met" if g["met"] else "  MISSED")
        print(f"   {g['figure']:52s} goal {g['goal']:.2f}  {value}{mark}")
    print(f"\nwall {report['timings_s']['total']:.0f}s; report {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
