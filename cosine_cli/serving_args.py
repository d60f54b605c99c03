"""The flags of `cosine up` that go through to the services: what the API serves (model name,
chat template, API keys) to the gateway, where, in what dtype and on which KV cache the models
run to the verifier and the drafters. A flag left unset passes nothing, so every service keeps its own default.

Also the lines `cosine up` prints for every ``/metrics`` endpoint of the cluster it started."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.kv_cache_flag import CUDA_GRAPHS_HELP, KV_CACHE_HELP, KV_CACHES

DTYPES = ("auto", "float32", "float16", "bfloat16")


def add_serving_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--served-model-name",
        default="",
        metavar="NAME",
        help="model id the OpenAI API lists and answers to (default: the target directory's name)",
    )
    p.add_argument(
        "--chat-template",
        default="",
        metavar="FILE|TEMPLATE",
        help="Jinja chat template for /v1/chat/completions, a file or the template itself (default: the "
        "target tokenizer's own)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="API key clients must send (repeatable; default: no authentication)",
    )
    p.add_argument("--api-keys-file", default="", metavar="PATH", help="file of API keys, one per line")
    p.add_argument(
        "--device", default="", help="torch device of the target and the drafters (cpu, cuda, cuda:1 ...; default: cpu)"
    )
    p.add_argument(
        "--dtype",
        default="",
        choices=DTYPES,
        help="dtype of the target and the drafters (default: the services' own, auto for the target and "
        "float32 for the drafters)",
    )
    p.add_argument(
        "--kv-cache",
        default="",
        choices=KV_CACHES,
        help=f"of the target and the drafters (default: the services' own, auto). {KV_CACHE_HELP}",
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"of the target and the drafters (default: the services' own, on). {CUDA_GRAPHS_HELP}",
    )


@dataclass(frozen=True)
class ServiceArgs:
    verifier: tuple[str, ...] = ()
    drafter: tuple[str, ...] = ()
    gateway: tuple[str, ...] = ()


def service_args(args: argparse.Namespace) -> ServiceArgs:
    """The services' own flags for the serving flags set on the command line. Paths become
    absolute: the services may run from another directory."""
    gateway: list[str] = []
    if args.served_model_name:
        gateway += ["--served-model-name", args.served_model_name]
    if args.chat_template:
        template = Path(args.chat_template).expanduser()
        gateway += ["--chat-template", str(template.resolve()) if template.is_file() else args.chat_template]
    for key in args.api_key:
        gateway += ["--api-keys", key]
    if args.api_keys_file:
        gateway += ["--api-keys-file", str(Path(args.api_keys_file).expanduser().resolve())]
    models: list[str] = []
    if args.device:
        models += ["--device", args.device]
    if args.dtype:
        models += ["--dtype", args.dtype]
    if args.kv_cache:
        models += ["--kv-cache", args.kv_cache]
    if args.cuda_graphs is not None:
        models += ["--cuda-graphs" if args.cuda_graphs else "--no-cuda-graphs"]
    return ServiceArgs(verifier=tuple(models), drafter=tuple(models), gateway=tuple(gateway))


def metrics_lines(state: Mapping[str, Any]) -> list[str]:
    """One line per Prometheus endpoint of a running cluster (``state`` as LocalCluster.state()
    gives it): each process's metrics port, and the gateway's HTTP API port, which serves the
    gateway's families too."""
    lines = [f"metrics    {name:<10} http://{address}/metrics" for name, address in sorted(state["metrics"].items())]
    if state.get("http"):
        lines.append(f"metrics    {'gateway':<10} {state['http']}/metrics (the API port)")
    return lines
