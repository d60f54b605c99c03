"""Settings of the verifier service (flags or COSINE_* variables; see `python -m services.verifier --help`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.platform.service import ServiceSettings
from common.platform.settings import non_negative, port_check, positive, setting
from services.kv_cache_flag import CUDA_GRAPHS_HELP, KV_CACHE_HELP, KV_CACHES


@dataclass(frozen=True)
class VerifierSettings(ServiceSettings):
    port: int = setting(50053, help="port to listen on (0 picks a free port)", check=port_check)
    metrics_port: int = setting(
        9102,
        help="port of the Prometheus /metrics endpoint (0: any free port, -1: off)",
        check=lambda v: None if -1 <= v <= 65535 else "must be -1 (off), 0 (any free port) or a port",
    )
    target: str = setting(
        "", help="target model: path to a transformers checkpoint directory (Llama / Qwen2 family)", metavar="PATH"
    )
    device: str = setting("cpu", help="torch device for the target model (cpu, cuda, cuda:1 ...)")
    dtype: str = setting(
        "auto",
        help="the target's weights and activations: auto is bfloat16 on a CPU whose bfloat16 products are "
        "row-invariant "
        "(AMX; every output stays the bfloat16 target's own, and a pass of many rows costs little more than a decode "
        "step), float32 anywhere else; float32 gives the checkpoint's float32 outputs",
        choices=("auto", "float32", "float16", "bfloat16"),
    )
    attention: str = setting(
        "auto",
        help="attention backend: flash_attn (CUDA, when installed), cpu_kernel (the project's own, on a CPU with "
        "AVX-512 "
        "or AVX2: a pass's sequences in one call a layer, float32 attention; in float32 prompts go to sdpa), sdpa, "
        "eager, invariant (bfloat16 on a CPU with AMX, row-invariant, eager); auto picks cpu_kernel on a CPU where it "
        "builds (float32, or the row-invariant bfloat16), else invariant for that bfloat16, flash_attn on CUDA when "
        "importable, else sdpa; flex (torch's flex attention reading the paged arena in place through a block mask) "
        "and flashinfer (FlashInfer's paged prefill kernel over the arena with the tree as its mask: CUDA and the "
        "flashinfer-python package) are never picked by auto",
        choices=("auto", "flash_attn", "cpu_kernel", "sdpa", "eager", "invariant", "flex", "flashinfer"),
    )
    kv_cache: str = setting("auto", help=KV_CACHE_HELP, choices=KV_CACHES)
    cuda_graphs: bool = setting(True, help=CUDA_GRAPHS_HELP)
    torch_threads: int = setting(
        0, help="torch intra-op threads for this process (0: derived from the machine's cores)", check=non_negative
    )
    kv_budget_tokens: int = setting(
        262144,
        help="most tokens kept in KV caches across all requests; a request that would exceed it is refused",
        check=positive,
    )
    max_tree_nodes: int = setting(
        1024, help="most nodes one request's token tree may have (a larger tree is refused as invalid)", check=positive
    )
    max_batch_tokens: int = setting(
        4096, help="most tokens (tree nodes + appended tokens) one verify forward pass takes", check=positive
    )
    time_passes: bool = setting(
        True,
        help="time a verify pass of 1-96 rows when the target is loaded (a few seconds on a CPU) and "
        "report the curve to the router, which prices drafted rows by its shape from the first round",
    )
