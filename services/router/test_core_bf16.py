"""The router core end to end in bfloat16 on a CPU with AMX (the verifier's ``dtype auto`` there):
greedy output through routing, fusion, lookup, trees, several requests a pass and pipelined rounds
equals the bfloat16 target decoding each prompt alone, one token at a time."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common.runtime.invariant_bf16 import bf16_available
from common.runtime.sim import plain_generate
from common.runtime.test_greedy_equality import make_prompts
from common.runtime.verifier_engine import VerifierEngine
from services.router.conftest import MAX_NEW
from services.router.core import RouterCore
from services.router.inprocess import LocalDrafterPool, LocalVerifier
from services.router.settings import RouterSettings
from services.router.test_core import generate_all

pytestmark = pytest.mark.skipif(
    not bf16_available(), reason="this CPU's bfloat16 products are not row-invariant (no AMX)"
)


@pytest.fixture(scope="module", params=["auto", "invariant"])
def bf16_verifier(llama_target: Path, request: pytest.FixtureRequest) -> VerifierEngine:
    """The bfloat16 target with the project's attention kernel (``auto``) and the eager row-invariant one."""
    verifier = VerifierEngine.from_checkpoint(llama_target, dtype="auto", attention_backend=request.param)
    assert verifier.runner.backend.name == ("cpu_kernel" if request.param == "auto" else "invariant")
    return verifier


@pytest.mark.parametrize(
    "config",
    [
        RouterSettings(drafters_per_request=2, fusion="token", tree_width=3, rounds_in_flight=2, max_batch_requests=4),
        RouterSettings(drafters_per_request=2, fusion="chunk", rounds_in_flight=2, cost_control=False),
        RouterSettings(all_drafters=True, routing=False, adaptive_k=False, initial_k=6, max_k=8, tree_width=4),
    ],
    ids=["token-fusion", "chunk-fusion-no-cost-control", "all-drafters-wide"],
)
def test_bfloat16_speculation_equals_the_bfloat16_target_alone(config, bf16_verifier, engines) -> None:
    _, drafters = engines  # float32 drafters: what they propose never changes a verdict's token
    prompts = make_prompts(6, bf16_verifier.runner.vocab_size, seed=23)
    expected, _ = plain_generate(bf16_verifier, prompts, MAX_NEW, concurrency=1)  # each prompt decoded by itself
    core = RouterCore(config, LocalDrafterPool(drafters), LocalVerifier(bf16_verifier))
    got = asyncio.run(generate_all(core, prompts, MAX_NEW))
    assert got == expected
    assert core.counters.accepted_tokens > 0 and core.counters.rounds < 6 * MAX_NEW
    assert bf16_verifier.active_requests == 0
