"""The gateway's OpenAI-compatible HTTP API with the real ``openai`` client against a local
cluster (separate processes, real Redis, the tiny zoo from disk): completions and chat, unary and
streamed, token-identical to the gRPC path at temperature 0, and each error status a client can
meet (400 naming the field, 401, 404, 429, 503)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import openai
import pytest

from common.platform.settings import load_settings
from cosine_cli.cluster import ClusterSpec, LocalCluster
from cosine_cli.profiles import seed_profiles
from cosine_cli.status_metrics import scrape, total
from cosine_client import Client
from services.gateway.server import build_app
from services.gateway.settings import GatewaySettings
from tests.support.openai_cluster import KEY
from tests.support.testing import start_service

pytestmark = pytest.mark.slow
MAX_NEW = 16


@pytest.fixture(scope="module")
def cluster(tiny_zoo, chat_tokenizer, tmp_path_factory):
    spec = ClusterSpec(
        target=str(tiny_zoo.target.path),
        drafters={n: str(d.path) for n, d in tiny_zoo.drafters.items()},
        log_dir=str(tmp_path_factory.mktemp("openai-cluster") / "logs"),
        cores=2,
        gateway_args=(
            "--tokenizer",
            str(chat_tokenizer),
            "--api-keys",
            KEY,
            "--max-inflight",
            "1",
            "--served-model-name",
            "tiny-target",
        ),
    )
    c = LocalCluster(spec)
    c.start(progress=False)
    asyncio.run(seed_profiles(c.redis_url, c.spec.prefix, tiny_zoo.acceptance, 20.0))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def prompts(tiny_zoo):
    return [tiny_zoo.prompts[d][0] for d in sorted(tiny_zoo.prompts)][:3]


def grpc_text(cluster, prompt: str, **kw) -> str:
    with Client(cluster.gateway_address, timeout=120, api_key=KEY) as c:
        return c.generate(prompt, max_new_tokens=MAX_NEW, **kw).text


def test_metrics_on_the_api_port_count_the_request(cluster, client, prompts):
    """/metrics on the HTTP port (open without a key) is the gateway's registry: after one request its
    request and speculative-decoding counters moved by exactly that request's figures."""
    api = cluster.http_url.removeprefix("http://")
    before = scrape(api)
    reply = client.completions.create(model="tiny-target", prompt=prompts[1], max_tokens=MAX_NEW, temperature=0)
    after = scrape(api)
    spec = reply.model_extra["speculative_decoding"]

    def moved(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert moved("cosine_requests_total") == 1
    assert moved("cosine_generation_tokens_total") == reply.usage.completion_tokens
    assert moved("cosine_spec_decode_rounds_total") == spec["rounds"] >= 1
    assert moved("cosine_spec_decode_draft_tokens_total") == spec["draft_tokens"]
    assert moved("cosine_spec_decode_accepted_tokens_total") == spec["accepted_tokens"]
    for drafter, n in spec["accepted_by_drafter"].items():
        assert moved("cosine_spec_decode_accepted_tokens_by_drafter_total", drafter=drafter) == n
    # the same registry as the gateway's metrics port
    assert set(scrape(cluster.state()["metrics"]["gateway"])) == set(after)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny-target"]


def test_completion_equals_grpc_at_temperature_zero(cluster, client, prompts):
    for prompt in prompts:
        reply = client.completions.create(model="tiny-target", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        choice = reply.choices[0]
        assert choice.text == grpc_text(cluster, prompt)
        assert choice.finish_reason in ("length", "stop")
        assert reply.usage.completion_tokens <= MAX_NEW and reply.usage.prompt_tokens > 0
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
        spec = reply.model_extra["speculative_decoding"]
        assert spec["rounds"] >= 1 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
        # a drafter is credited for accepted tokens that were its own first choice
        assert set(spec["accepted_by_drafter"]) <= set(spec["drafters_used"])
        assert all(0 < n <= spec["accepted_tokens"] for n in spec["accepted_by_drafter"].values())


def test_streamed_completion_equals_unary(client, prompts):
    prompt = prompts[0]
    unary = client.completions.create(model="tiny-target", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny-target",
            prompt=prompt,
            max_tokens=MAX_NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == unary.choices[0].text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == unary.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == unary.usage.completion_tokens


def test_stop_string_is_cut_and_reported(client, prompts):
    texts = [
        client.completions.create(model="tiny-target", prompt=p, max_tokens=MAX_NEW, temperature=0).choices[0].text
        for p in prompts
    ]
    prompt, full = max(zip(prompts, texts), key=lambda pt: len(set(pt[1])))
    stop = full[len(full) // 2 :][:2]
    assert stop, texts
    cut = client.completions.create(model="tiny-target", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_max_tokens_and_sampling_parameters(client, prompts):
    short = client.completions.create(model="tiny-target", prompt=prompts[0], max_tokens=3, temperature=0)
    assert short.usage.completion_tokens <= 3
    greedy = (
        client.completions.create(model="tiny-target", prompt=prompts[2], max_tokens=MAX_NEW, temperature=0)
        .choices[0]
        .text
    )
    # temperature 1 with a nucleus of the single most likely token is greedy decoding: top_p reaches the target
    nucleus = (
        client.completions.create(
            model="tiny-target", prompt=prompts[2], max_tokens=MAX_NEW, temperature=1.0, top_p=1e-6, seed=3
        )
        .choices[0]
        .text
    )
    assert nucleus == greedy
    sampled = client.completions.create(
        model="tiny-target", prompt=prompts[2], max_tokens=MAX_NEW, temperature=1.5, seed=11
    )
    assert sampled.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-target", prompt=prompts[2], max_tokens=2, seed=-1)
    assert err.value.param == "seed"


def test_chat_uses_the_template_and_streams(cluster, client, chat_tokenizer):
    from common.runtime.checkpoints import load_tokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    reply = client.chat.completions.create(model="tiny-target", messages=messages, max_tokens=MAX_NEW, temperature=0)
    message = reply.choices[0].message
    assert message.role == "assistant" and reply.object == "chat.completion"
    tok = load_tokenizer(str(chat_tokenizer))
    ids = tok(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    ).input_ids
    assert reply.usage.prompt_tokens == len(ids)
    with Client(cluster.gateway_address, timeout=120, api_key=KEY) as c:
        assert message.content == c.generate(prompt_ids=ids, max_new_tokens=MAX_NEW).text
    chunks = list(
        client.chat.completions.create(
            model="tiny-target", messages=messages, max_tokens=MAX_NEW, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content


def test_bad_fields_are_400_naming_the_field(client, prompts):
    cases = [
        (dict(prompt=prompts[0], temperature=-1), "temperature"),
        (dict(prompt=prompts[0], max_tokens=100_000), "max_tokens"),
        (dict(prompt=prompts[0], n=0), "n"),
        (dict(prompt=prompts[0], n=9), "n"),  # past the gateway's --max-n (8)
        (dict(prompt=prompts[0], n=2, best_of=3), "best_of"),
        (dict(prompt=prompts[0], presence_penalty=2.5), "presence_penalty"),
        (dict(prompt=prompts[0], frequency_penalty=-3), "frequency_penalty"),
        (dict(prompt=prompts[0], extra_body={"repetition_penalty": 0}), "repetition_penalty"),
        (dict(prompt=[], max_tokens=4), "prompt"),
        (dict(prompt=[10**9], max_tokens=4), "prompt"),
        (dict(prompt=prompts[0], top_p=2), "top_p"),
    ]
    for kw, field in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny-target", **kw)
        assert err.value.status_code == 400 and err.value.param == field, (kw, err.value.body)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-target", messages=[])
    assert err.value.param == "messages"


def test_wrong_key_is_401_and_unknown_model_404(cluster, client, prompts):
    for key in ("wrong", ""):
        bad = openai.OpenAI(
            base_url=cluster.http_url + "/v1",
            api_key=key or "x",
            max_retries=0,
            default_headers={} if key else {"Authorization": ""},
        )
        with pytest.raises(openai.AuthenticationError) as err:
            bad.completions.create(model="tiny-target", prompt=prompts[0], max_tokens=2)
        assert err.value.status_code == 401 and "tiny" not in json.dumps(err.value.body)
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt=prompts[0], max_tokens=2)
    assert err.value.param == "model"
    with urllib.request.urlopen(cluster.http_url + "/health", timeout=10) as reply:  # probes need no key
        assert reply.status == 200


def test_queue_full_is_429(cluster, client, prompts):
    """The cluster's gateway admits one request at a time: while a long stream runs, another gets 429."""
    stream = client.completions.create(
        model="tiny-target", prompt=prompts[0], max_tokens=400, temperature=0, stream=True
    )
    try:
        next(iter(stream))  # admitted and generating
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model="tiny-target", prompt=prompts[1], max_tokens=2)
        assert err.value.status_code == 429
    finally:
        stream.close()


def test_not_ready_is_503(redis_url, redis_prefix):
    """A gateway with no verifier or router registered answers 503 until the cluster is up."""
    settings = load_settings(
        GatewaySettings,
        [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--http-port",
            "0",
            "--redis-url",
            redis_url,
            "--redis-prefix",
            redis_prefix,
        ],
        {},
    )
    apps = []

    async def factory(s, store):
        apps.append(await build_app(s, store))
        return apps[-1]

    server, _ = start_service(settings, factory, prog="gateway")
    try:
        port = apps[0].http.port
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model="any", prompt="hello", max_tokens=2)
        assert err.value.status_code == 503 and "no verifier" in err.value.message
    finally:
        server.stop()


def test_http_port_in_use_is_one_line(redis_url):
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.gateway",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--metrics-port",
                "-1",
                "--http-port",
                str(port),
                "--redis-url",
                redis_url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line and not line.startswith("{")]
    assert len(errors) == 1 and f"cannot serve HTTP on port {port}" in errors[0], proc.stderr


# A template of our own for the tiny zoo's target, whose tokenizer has none: its marks show in the prompt.
FLAG_TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>>{% endif %}"
)


def in_process_gateway(cluster, tokenizer: str, *extra: str):
    """A second gateway (in this process, no API keys) on the cluster's router, with its own flags."""
    argv = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--http-port", "0"]
    argv += ["--redis-url", cluster.redis_url, "--redis-prefix", cluster.spec.prefix]
    argv += ["--router-address", cluster.router_address, "--tokenizer", tokenizer, *extra]
    apps = []

    async def factory(s, store):
        apps.append(await build_app(s, store))
        return apps[-1]

    server, _ = start_service(load_settings(GatewaySettings, argv, {}), factory, prog="gateway")
    url = f"http://127.0.0.1:{apps[0].http.port}/v1"
    return server, openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)


def test_chat_template_flag_serves_a_tokenizer_without_one(cluster, tiny_zoo, tmp_path):
    from common.runtime.checkpoints import load_tokenizer

    target = str(tiny_zoo.target.path)
    tok = load_tokenizer(target)
    assert not tok.chat_template
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    server, plain = in_process_gateway(cluster, target)
    try:  # without the flag: refused, and the message says what would help
        with pytest.raises(openai.BadRequestError) as err:
            plain.chat.completions.create(model="target", messages=messages, max_tokens=4)
        assert err.value.param == "messages" and "--chat-template" in err.value.message
    finally:
        server.stop()

    path = tmp_path / "chat.jinja"
    path.write_text(FLAG_TEMPLATE)
    server, client = in_process_gateway(cluster, target, "--chat-template", str(path))
    try:
        # the default model name is the target's directory name
        assert [m.id for m in client.models.list().data] == ["target"]
        reply = client.chat.completions.create(model="target", messages=messages, max_tokens=MAX_NEW, temperature=0)
    finally:
        server.stop()
    rendered = "<<user>> What is 2 + 3?\n<<assistant>>"
    ids = tok(rendered, add_special_tokens=False).input_ids
    assert reply.usage.prompt_tokens == len(ids)
    with Client(cluster.gateway_address, timeout=120, api_key=KEY) as c:
        assert reply.choices[0].message.content == c.generate(prompt_ids=ids, max_new_tokens=MAX_NEW).text


def test_unreadable_chat_template_is_one_line_naming_the_flag(redis_url, tmp_path):
    import subprocess
    import sys

    missing = tmp_path / "no-such-template.jinja"
    argv = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--http-port", "-1"]
    proc = subprocess.run(
        [sys.executable, "-m", "services.gateway", *argv, "--redis-url", redis_url, "--chat-template", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line and not line.startswith("{")]
    assert len(errors) == 1 and f"--chat-template: {missing}: no such file" in errors[0], proc.stderr
