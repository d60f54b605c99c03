"""guidellm, a load generator CoSine did not write, against a local cluster, speculation on and off.

One cluster (Redis, the verifier, the drafters) serves two control planes, as ``cosine bench``'s
service systems do: the default router (``cosine``) and one with ``--no-speculate`` (the same
services decoding plainly: ``services_plain``). guidellm drives each through the OpenAI HTTP API
(``/v1/completions``, streamed, greedy unless ``--temperature``) with the zoo's held-out prompts,
round-robin over the domains as every ``cosine bench`` workload takes them, at a fixed concurrency
and a fixed number of output tokens a request; the arms alternate (``--rounds`` times each), and
the table prints throughput (output tokens over the run's duration), median TTFT and median ITL
per arm, with cosine's throughput as a ratio to plain decoding's from the same round.

guidellm is not a dependency: install it in its own environment (it pulls datasets, pandas and a
torch; pin the CPU torch where a CUDA one would be fetched) and point ``--guidellm`` at it::

    python -m venv /opt/guidellm && /opt/guidellm/bin/pip install torch==2.13.0 guidellm==0.8.1
    python -m benchmarks.guidellm_compare --zoo .cosine/zoo-smol --guidellm /opt/guidellm/bin/guidellm

The same workload shape in ``cosine bench``: ``--systems services_plain,cosine --workloads
closed_c4 --max-new-tokens 32 --requests 24``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ARMS = (("cosine", ()), ("services_plain", ("--no-speculate",)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.guidellm_compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", default=".cosine/zoo-smol", help="model zoo directory (default .cosine/zoo-smol)")
    ap.add_argument("--guidellm", default="guidellm", help="the guidellm executable (default: guidellm on PATH)")
    ap.add_argument("--streams", type=int, default=4, help="concurrent requests (guidellm's concurrent profile)")
    ap.add_argument("--requests", type=int, default=24, help="requests per arm and round")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens a request")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    ap.add_argument("--rounds", type=int, default=2, help="times each arm runs, alternating")
    ap.add_argument("--cores", type=int, default=0, help="cores the services may use (default: all)")
    ap.add_argument("--out", default="bench-out/guidellm", help="directory of guidellm's reports and the summary")
    return ap.parse_args(argv)


def write_data(zoo: Any, count: int, max_tokens: int, path: Path) -> None:
    """The zoo's held-out prompts as guidellm's JSON lines: ``prompt`` and ``output_tokens_count``."""
    from cosine_cli.workload import mixed_workload

    with path.open("w") as f:
        for _, prompt in mixed_workload(zoo.prompts, count):
            f.write(json.dumps({"prompt": prompt, "output_tokens_count": max_tokens}) + "\n")


def guidellm_run(exe: str, url: str, model: str, tokenizer: str, data: Path, args: argparse.Namespace, out: Path):
    backend = {
        "kind": "openai_http",
        "target": url,
        "model": model,
        "request_format": "/v1/completions",
        "max_tokens": args.max_tokens,
        "extras": {"body": {"temperature": args.temperature}},  # unset, the API's default would be 1
    }
    cmd = [
        exe,
        "run",
        "--backend",
        json.dumps(backend),
        "--profile",
        f"kind=concurrent,streams={args.streams}",
        "--constraint",
        f"kind=max_requests,count={args.requests}",
        "--data",
        f"kind=json_file,path={data}",
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    with out.with_suffix(".log").open("w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    return figures(json.loads(out.read_text()))


def figures(report: dict[str, Any]) -> dict[str, float]:
    """Throughput (output tokens over the benchmark's duration), median TTFT and ITL (ms), and the
    requests that completed, from guidellm's JSON report."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    ok = lambda name: m[name]["successful"]  # noqa: E731
    return {
        "output_tok_s": ok("output_token_count")["total_sum"] / bench["duration"],
        "ttft_ms": ok("time_to_first_token_ms")["median"],
        "itl_ms": ok("inter_token_latency_ms")["median"],
        "completed": ok("request_latency")["count"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exe = shutil.which(args.guidellm) or args.guidellm
    if not Path(exe).exists():
        print(f"guidellm_compare: error: no guidellm at {args.guidellm!r} (see --help to install it)", file=sys.stderr)
        return 2
    from cosine_cli.cluster import ClusterSpec, LocalCluster
    from cosine_cli.profiles import seed_zoo
    from cosine_zoo.manifest import load_zoo

    zoo = load_zoo(args.zoo)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "prompts.jsonl"
    write_data(zoo, args.requests, args.max_tokens, data)
    cluster = LocalCluster(
        ClusterSpec(
            target=str(zoo.target.path),
            drafters={n: str(d.path) for n, d in zoo.drafters.items()},
            drafter_domains={n: list(d.domains) for n, d in zoo.drafters.items()},
            cores=args.cores,
            log_dir=str(out / "logs"),
            prefix="guidellm",
        )
    )
    rows: list[dict[str, Any]] = []
    try:
        cluster.start()
        asyncio.run(seed_zoo(cluster.redis_url, "guidellm", zoo))  # once, as `cosine up` does
        urls = {"cosine": cluster.http_url}
        for name, router_args in ARMS[1:]:
            urls[name] = cluster.add_control_plane(router_args, name.replace("_", "-")).http_url
        model = Path(zoo.target.path).name
        for r in range(args.rounds):
            order = ARMS if r % 2 == 0 else ARMS[::-1]
            got = {}
            for name, _ in order:
                print(f"round {r + 1}: {name}", file=sys.stderr, flush=True)
                got[name] = guidellm_run(
                    exe, urls[name], model, str(zoo.target.path), data, args, out / f"{name}-{r + 1}.json"
                )
            rows.append(got)
    finally:
        cluster.stop()
    summary = {"args": vars(args), "rounds": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(table(rows))
    return 0


def table(rows: list[dict[str, dict[str, float]]]) -> str:
    lines = [
        "| round | system | output tok/s | median TTFT ms | median ITL ms | completed | tok/s vs plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, got in enumerate(rows, 1):
        plain = got["services_plain"]["output_tok_s"]
        for name, f in got.items():
            lines.append(
                f"| {i} | {name} | {f['output_tok_s']:.1f} | {f['ttft_ms']:.0f} | {f['itl_ms']:.1f} | "
                f"{f['completed']} | {f['output_tok_s'] / plain:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
