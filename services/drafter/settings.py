"""Settings of the drafter service (flags or COSINE_* variables; see `python -m services.drafter --help`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.platform.service import ServiceSettings
from common.platform.settings import non_negative, port_check, positive, setting
from services.kv_cache_flag import CUDA_GRAPHS_HELP, KV_CACHE_HELP, KV_CACHES


def drafter_spec_check(value: str) -> str | None:
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        return "must look like NAME=PATH (a drafter id and a checkpoint directory)"
    return None


@dataclass(frozen=True)
class DrafterSettings(ServiceSettings):
    port: int = setting(50054, help="port to listen on (0 picks a free port)", check=port_check)
    metrics_port: int = setting(
        9103,
        help="port of the Prometheus /metrics endpoint (0: any free port, -1: off)",
        check=lambda v: None if -1 <= v <= 65535 else "must be -1 (off), 0 (any free port) or a port",
    )
    drafters: tuple[str, ...] = setting(
        (),
        help="drafter model to host, as NAME=PATH to a transformers checkpoint; repeat to host several "
        "(each is its own drafter identity to the router)",
        check=drafter_spec_check,
        metavar="NAME=PATH",
    )
    device: str = setting("cpu", help="torch device for the drafter models (cpu, cuda, cuda:1 ...)")
    dtype: str = setting(
        "float32",
        help="weight dtype (auto: as the verifier's auto; a drafter's rounding never changes an output)",
        choices=("auto", "float32", "float16", "bfloat16"),
    )
    kv_cache: str = setting("auto", help=KV_CACHE_HELP, choices=KV_CACHES)
    cuda_graphs: bool = setting(True, help=CUDA_GRAPHS_HELP)
    torch_threads: int = setting(
        0, help="torch intra-op threads for this process (0: derived from the machine's cores)", check=non_negative
    )
    kv_budget_tokens: int = setting(
        262144, help="most tokens kept in KV caches across all requests, per drafter model", check=positive
    )
    max_top_n: int = setting(8, help="largest number of candidates a step may ask for", check=positive)
    max_chain_len: int = setting(
        64, help="most positions one item may draft on its own (chunk drafting)", check=positive
    )
    drain_timeout_s: float = setting(
        15.0,
        help="on SIGTERM: most seconds to wait for in-flight draft steps and for the "
        "routers to move their requests away before exiting",
        check=positive,
    )
    drain_idle_s: float = setting(
        1.5,
        help="on SIGTERM: the drain ends once no draft step has arrived for this long "
        "(or every router has closed its stream)",
        check=positive,
    )

    def parsed_drafters(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for spec in self.drafters:
            name, _, path = spec.partition("=")
            out[name.strip()] = path.strip()
        return out

    def validate(self) -> str | None:
        names = [spec.partition("=")[0].strip() for spec in self.drafters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        return f"--drafters: drafter name(s) given twice: {', '.join(dupes)}" if dupes else None
