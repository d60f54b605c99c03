"""Fixtures of the OpenAI API tests (a pytest plugin, loaded by the root conftest): the tiny zoo's
tokenizer with a chat template, and one local cluster with the verifier in float32, shared by every
test module whose reference is computed in float32 (the log-probabilities' and the penalties').

float32, because on a CPU with AMX the verifier's default is bfloat16, whose figures are its own;
one cluster for the session, because starting one is the longest part of those modules. Beside it:
the ``openai`` client of its HTTP API, the target loaded in transformers (the reference), the chat
tokenizer loaded, and a prompt of each of the first three domains."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

KEY = "test-key"
# A plain chat template for the tiny zoo's tokenizer (the default zoo's target brings its own).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="session")
def chat_tokenizer(tiny_zoo: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from common.runtime.checkpoints import load_tokenizer

    out = tmp_path_factory.mktemp("chat-tokenizer")
    tok = load_tokenizer(str(tiny_zoo.target.path))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def float32_cluster(tiny_zoo: Any, chat_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The tiny zoo served by a local cluster (separate processes, real Redis) whose verifier runs
    the target in float32; the gateway takes ``KEY`` and serves the model as ``tiny-target``."""
    from cosine_cli.cluster import ClusterSpec, LocalCluster

    spec = ClusterSpec(
        target=str(tiny_zoo.target.path),
        drafters={n: str(d.path) for n, d in tiny_zoo.drafters.items()},
        log_dir=str(tmp_path_factory.mktemp("float32-cluster") / "logs"),
        cores=2,
        verifier_args=("--dtype", "float32"),
        gateway_args=("--tokenizer", str(chat_tokenizer), "--api-keys", KEY, "--served-model-name", "tiny-target"),
    )
    c = LocalCluster(spec)
    c.start(progress=False)
    yield c
    c.stop()


@pytest.fixture(scope="session")
def float32_client(float32_cluster: Any) -> Any:
    import openai

    return openai.OpenAI(base_url=float32_cluster.http_url + "/v1", api_key=KEY, max_retries=0, timeout=180)


@pytest.fixture(scope="session")
def target_lm(tiny_zoo: Any) -> Any:
    from common.runtime.checkpoints import load_causal_lm

    return load_causal_lm(str(tiny_zoo.target.path))


@pytest.fixture(scope="session")
def chat_tok(chat_tokenizer: Path) -> Any:
    from common.runtime.checkpoints import load_tokenizer

    return load_tokenizer(str(chat_tokenizer))


@pytest.fixture(scope="session")
def zoo_prompts(tiny_zoo: Any) -> list[str]:
    return [tiny_zoo.prompts[d][0] for d in sorted(tiny_zoo.prompts)][:3]
