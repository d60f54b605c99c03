"""`cosine up | generate | status | demo` (`cosine profile` is :mod:`cosine_cli.profiles`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from cosine_cli.local_state import DEFAULT_ZOO, STATE_FILE, load_zoo_or_exit, read_state
from cosine_cli.profiles import seed_zoo
from cosine_cli.serving_args import ServiceArgs, add_serving_args, metrics_lines, service_args
from cosine_cli.tls import add_client_tls_args, client_tls, cluster_tls


def register(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser(
        "up",
        help="start a local cluster (Redis, verifier, drafters, router, gateway) and keep it running",
        description="Start a local CoSine cluster as processes and wait until every service is healthy. "
        "Ctrl-C stops everything cleanly.",
    )
    _cluster_args(up)
    add_serving_args(up)
    up.set_defaults(func=cmd_up)

    gen = sub.add_parser("generate", help="generate from a prompt through the gateway (streams to the terminal)")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--address", help="gateway host:port (default: the cluster started by `cosine up`)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--domain-hint", default="")
    gen.add_argument(
        "--json", action="store_true", help="print token ids, text and statistics as JSON instead of streaming"
    )
    gen.add_argument("--timeout", type=float, default=300.0)
    gen.add_argument(
        "--api-key", default=None, help="API key for a gateway that requires one (default: $COSINE_API_KEY)"
    )
    add_client_tls_args(gen)
    gen.set_defaults(func=cmd_generate)

    st = sub.add_parser("status", help="live drafters, queue depth and acceptance per drafter (from the router)")
    st.add_argument("--router", help="router host:port (default: the cluster started by `cosine up`)")
    st.add_argument(
        "--metrics",
        action="append",
        default=[],
        metavar="NAME=HOST:PORT",
        help="a /metrics endpoint to read key figures from (repeatable; default: every process of the `cosine up` "
        "cluster)",
    )
    st.add_argument("--json", action="store_true")
    add_client_tls_args(st)
    st.set_defaults(func=cmd_status)

    demo = sub.add_parser(
        "demo", help="build the default zoo if absent, start the cluster, serve a mixed-domain workload, report, stop"
    )
    _cluster_args(demo)
    demo.add_argument("--profile", default="smol", help="zoo profile to build when the zoo is absent (default: smol)")
    demo.add_argument("--requests", type=int, default=48, help="requests in the workload")
    demo.add_argument("--concurrency", type=int, default=8)
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip the second pass that serves the same requests with drafting off (the target alone)",
    )
    demo.set_defaults(func=cmd_demo)


def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zoo", default=DEFAULT_ZOO, help="model zoo directory (target + drafters + zoo.json)")
    p.add_argument("--target", help="target checkpoint directory (instead of a zoo)")
    p.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="drafter checkpoint (repeatable; instead of a zoo)",
    )
    p.add_argument("--redis-url", default="", help="use this Redis instead of starting a private one")
    p.add_argument("--host", default="127.0.0.1", help="address every service listens on")
    p.add_argument("--gateway-port", type=int, default=50051, help="gateway port (0: any free port)")
    p.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="port of the gateway's OpenAI-compatible HTTP API (0: any free port)",
    )
    p.add_argument(
        "--drafter-processes", type=int, default=1, help="drafter processes; the drafter models are spread over them"
    )
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra router flag, e.g. --router-arg=--fusion=chunk",
    )
    p.add_argument("--log-dir", default=".cosine/logs")
    p.add_argument(
        "--tls-dir",
        default="",
        metavar="DIR",
        help="serve every hop over TLS with the certificates in DIR (ca.pem, service.pem, service-key.pem; "
        "written there by `cosine certs` when absent)",
    )
    p.add_argument(
        "--mtls", action="store_true", help="with --tls-dir: every service also requires client certificates"
    )


def _spec_from_args(args: argparse.Namespace, serving: ServiceArgs = ServiceArgs()):
    """The cluster the flags describe; ``serving``: the services' flags from `cosine up`'s serving flags."""
    from cosine_cli.cluster import ClusterSpec

    domains: dict[str, list[str]] = {}
    if args.target:
        if not args.drafter:
            raise SystemExit("cosine: error: --target needs at least one --drafter NAME=PATH")
        drafters = {}
        for spec in args.drafter:
            name, sep, path = spec.partition("=")
            if not sep:
                raise SystemExit(f"cosine: error: --drafter {spec!r} must be NAME=PATH")
            drafters[name] = path
        target = args.target
    else:
        zoo = load_zoo_or_exit(args.zoo)
        target = str(zoo.target.path)
        drafters = {name: str(d.path) for name, d in zoo.drafters.items()}
        domains = {name: list(d.domains) for name, d in zoo.drafters.items()}
    return ClusterSpec(
        target=target,
        drafters=drafters,
        drafter_domains=domains,
        redis_url=args.redis_url,
        host=args.host,
        gateway_port=args.gateway_port,
        http_port=args.http_port,
        drafter_processes=args.drafter_processes,
        router_args=tuple(args.router_arg),
        verifier_args=serving.verifier,
        drafter_args=serving.drafter,
        gateway_args=serving.gateway,
        log_dir=args.log_dir,
        tls=cluster_tls(args),
    )


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


def cmd_up(args: argparse.Namespace) -> int:
    from cosine_cli.cluster import ClusterError, LocalCluster

    spec = _spec_from_args(args, service_args(args))
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        if not args.target:
            zoo = load_zoo_or_exit(args.zoo)
            n = asyncio.run(seed_zoo(cluster.redis_url, spec.prefix, zoo))
            print(
                f"profiles   {n} drafter profile(s) seeded from {args.zoo}/zoo.json"
                + (
                    f"; domain lexicon from {sum(n for n, _ in zoo.lexicon.values())} training prompts"
                    if zoo.lexicon
                    else ""
                )
                + (
                    f"; lookup corpus of {sum(map(len, zoo.lookup_corpus.values()))} sequences"
                    if zoo.lookup_corpus
                    else ""
                ),
                file=sys.stderr,
            )
        STATE_FILE.parent.mkdir(parents=True, exist_ok=True)
        STATE_FILE.write_text(json.dumps(cluster.state()))
        cluster.supervise()  # a process that dies is restarted (with backoff, one line each)
        print(cluster.gateway_address, flush=True)
        model = args.served_model_name or Path(spec.target).name
        print(f"openai     {cluster.http_url}/v1 (model {model})", file=sys.stderr, flush=True)
        for line in metrics_lines(cluster.state()):
            print(line, file=sys.stderr, flush=True)
        print("Ctrl-C stops the cluster.", file=sys.stderr, flush=True)
        _wait_for_signal()
    except ClusterError as exc:
        print(f"cosine up: error: {exc}", file=sys.stderr)
        return 1
    finally:
        print("stopping   the cluster", file=sys.stderr, flush=True)
        cluster.stop()
        STATE_FILE.unlink(missing_ok=True)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from cosine_client import Client, CosineError, TlsSetupError

    address = args.address or read_state().get("gateway")
    if not address:
        print("cosine generate: error: no --address and no running `cosine up` cluster", file=sys.stderr)
        return 2
    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        domain_hint=args.domain_hint,
    )
    try:
        with Client(
            address,
            timeout=args.timeout,
            api_key=args.api_key,
            **client_tls(args, read_state() if not args.address else None),
        ) as client:
            if args.json:
                print(json.dumps(client.generate(args.prompt, **kwargs).to_dict(), indent=2))
                return 0
            last = None
            for chunk in client.stream(args.prompt, **kwargs):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
            sys.stdout.write("\n")
            if last is not None and last.stats is not None:
                s = last.stats
                print(
                    f"[{last.finish_reason}; {s.rounds} rounds, {s.mean_accepted_len:.2f} accepted/round, "
                    f"drafters {', '.join(s.drafters_used) or '-'}]",
                    file=sys.stderr,
                )
    except (CosineError, TlsSetupError) as exc:
        print(f"cosine generate: error: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    from cosine.v1 import router_pb2, router_pb2_grpc
    from cosine_client import TlsOptions, TlsSetupError

    address = args.router or read_state().get("router")
    if not address:
        print("cosine status: error: no --router and no running `cosine up` cluster", file=sys.stderr)
        return 2
    try:
        with TlsOptions.resolve(**client_tls(args, read_state() if not args.router else None)).channel(
            address, ()
        ) as channel:
            status = router_pb2_grpc.RouterStub(channel).Status(router_pb2.StatusRequest(), timeout=5)
    except TlsSetupError as exc:
        print(f"cosine status: error: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"cosine status: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    data = {
        "verifier": {"address": status.verifier_address, "healthy": status.verifier_healthy},
        "queue_depth": status.queue_depth,
        "active_requests": status.active_requests,
        "rounds_in_flight": status.rounds_in_flight,
        "drafters": [
            {
                "id": d.drafter_id,
                "address": d.address,
                "healthy": d.healthy,
                "rounds": d.rounds,
                "acceptance": d.acceptance,
            }
            for d in status.drafters
        ],
        "counters": dict(status.counters),
    }
    figures, unreachable = _metric_figures(args.metrics)
    if figures is not None:
        data["metrics"] = figures
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(
        f"verifier {status.verifier_address} {'healthy' if status.verifier_healthy else 'NOT CONNECTED'}; "
        f"queue {status.queue_depth}, active {status.active_requests}, rounds in flight {status.rounds_in_flight}"
    )
    print(f"{'drafter':<16}{'address':<24}{'healthy':<9}{'rounds':>8}{'accepted/round':>16}")
    for d in data["drafters"]:
        print(
            f"{d['id']:<16}{d['address']:<24}{'yes' if d['healthy'] else 'NO':<9}"
            f"{d['rounds']:>8}{d['acceptance']:>16.2f}"
        )
    if figures is not None:
        from cosine_cli.status_metrics import format_figures

        print("\n".join(format_figures(figures)))
    for name, error in unreachable.items():
        print(f"metrics   {name}: not readable ({error})", file=sys.stderr)
    return 0


def _metric_figures(given: list[str]) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """Key figures from the /metrics endpoints given as NAME=HOST:PORT, else the local cluster's."""
    from cosine_cli.status_metrics import key_figures, scrape_all

    addresses = dict(item.partition("=")[::2] for item in given) if given else read_state().get("metrics", {})
    if not addresses:
        return None, {}
    per, errors = scrape_all(addresses)
    return (key_figures(per) if per else None), errors


def ensure_zoo(path: str, profile: str) -> None:
    if (Path(path) / "zoo.json").is_file():
        return
    print(f"building   the {profile} model zoo into {path} (first run only)", file=sys.stderr, flush=True)
    subprocess.run(
        [sys.executable, "-m", "cosine_cli.main", "models", "build", "--profile", profile, "--out", path], check=True
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from cosine_cli.cluster import ClusterError, LocalCluster
    from cosine_cli.workload import mixed_workload, print_speedup, print_summary, run_workload

    if not args.target:
        ensure_zoo(args.zoo, args.profile)
    spec = _spec_from_args(args)
    zoo = load_zoo_or_exit(args.zoo)
    cluster = LocalCluster(spec)
    results = []
    try:
        cluster.start()
        asyncio.run(seed_zoo(cluster.redis_url, spec.prefix, zoo))
        work = mixed_workload(zoo.prompts, args.requests)
        results = asyncio.run(
            run_workload(
                cluster.gateway_address,
                work,
                args.concurrency,
                args.max_new_tokens,
                progress=True,
                client_options=cluster.client_tls(),
            )
        )
        summary = print_summary(results, cluster.router_address)
        if args.baseline and not any(r.error for r in results):
            # the same requests through the same verifier and gateway, with drafting switched off
            address = cluster.restart_router([*spec.router_args, "--no-speculate"])
            plain = asyncio.run(
                run_workload(
                    address,
                    work,
                    args.concurrency,
                    args.max_new_tokens,
                    progress=True,
                    desc="target alone",
                    client_options=cluster.client_tls(),
                )
            )
            print_speedup(summary, plain, results)
            results = results + plain
    except ClusterError as exc:
        print(f"cosine demo: error: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    return 1 if any(r.error for r in results) else 0
