"""Mutual TLS on every hop, with real processes: the local cluster (real redis-server, verifier,
drafter, router and gateway as separate processes on loopback) started with one certificate, key
and CA for all of them and client authentication on. The gateway reaches the router, and the
router the verifier and the drafter, only over mTLS; the SDK and the CLI reach the gateway over
TLS with a client certificate; anything without one is refused."""

from __future__ import annotations

import asyncio
import json
import ssl

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.platform.tls import TlsConfig
from common.runtime.checkpoints import load_causal_lm, load_tokenizer
from cosine.v1 import router_pb2, router_pb2_grpc
from cosine_cli.cluster import ClusterSpec, LocalCluster
from cosine_cli.main import main
from cosine_cli.profiles import seed_profiles
from cosine_client import AsyncClient, Client, TlsSetupError, Unavailable

pytestmark = pytest.mark.slow
MAX_NEW = 16


@pytest.fixture(scope="module")
def mtls(dev_certs) -> TlsConfig:
    return TlsConfig(cert=str(dev_certs.cert), key=str(dev_certs.key), ca=str(dev_certs.ca), client_auth=True)


@pytest.fixture(scope="module")
def cluster(tiny_zoo, mtls, tmp_path_factory):
    spec = ClusterSpec(
        target=str(tiny_zoo.target.path),
        drafters={n: str(d.path) for n, d in tiny_zoo.drafters.items()},
        log_dir=str(tmp_path_factory.mktemp("tls-cluster") / "logs"),
        cores=2,
        tls=mtls,
    )
    c = LocalCluster(spec)
    c.start(progress=False)  # returns once the router, over mTLS, sees the verifier and every drafter
    asyncio.run(seed_profiles(c.redis_url, spec.prefix, tiny_zoo.acceptance, 20.0))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def prompts(tiny_zoo):
    return [tiny_zoo.prompts[d][0] for d in sorted(tiny_zoo.prompts)][:3]


@pytest.fixture(scope="module")
def reference(tiny_zoo, prompts):
    import torch

    tok = load_tokenizer(tiny_zoo.target.path)
    model = load_causal_lm(tiny_zoo.target.path)
    out = {}
    for prompt in prompts:
        ids = torch.tensor([tok(prompt).input_ids])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        out[prompt] = gen[0, ids.shape[1] :].tolist()
    return out


def client_kwargs(certs):
    return dict(tls_ca=str(certs.ca), tls_cert=str(certs.client_cert), tls_key=str(certs.client_key))


def test_sdk_over_mtls_gets_the_targets_greedy_output(cluster, dev_certs, prompts, reference):
    async def run():
        async with AsyncClient(cluster.gateway_address, timeout=120, **client_kwargs(dev_certs)) as client:
            return await asyncio.gather(*(client.generate(p, max_new_tokens=MAX_NEW) for p in prompts))

    for prompt, result in zip(prompts, asyncio.run(run())):
        assert list(result.token_ids) == reference[prompt], prompt
        assert result.stats.rounds >= 1
    with Client(cluster.gateway_address, timeout=120, **client_kwargs(dev_certs)) as client:
        chunks = list(client.stream(prompts[0], max_new_tokens=MAX_NEW))
    assert [t for c in chunks for t in c.token_ids] == reference[prompts[0]]


def test_the_router_reaches_verifier_and_drafters_only_over_mtls(cluster, mtls, tiny_zoo):
    async def status():
        from common.platform.tls import open_channel

        async with open_channel(cluster.router_address, mtls) as channel:
            return await router_pb2_grpc.RouterStub(channel).Status(router_pb2.StatusRequest(), timeout=10)

    st = asyncio.run(status())
    assert st.verifier_healthy
    assert {d.drafter_id for d in st.drafters if d.healthy} == set(tiny_zoo.drafters)
    # every service port refuses a plaintext peer, and a TLS peer without a client certificate
    for proc in cluster.procs:
        for tls in (None, TlsConfig(ca=mtls.ca)):
            from common.platform.tls import open_blocking_channel

            with open_blocking_channel(proc.address, tls) as channel:
                with pytest.raises(grpc.RpcError) as info:
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (proc.name, tls)


def test_sdk_is_refused_without_a_client_certificate_or_with_another_cas(cluster, dev_certs, other_certs, prompts):
    refused = [
        dict(tls=False),  # plaintext
        dict(tls_ca=str(dev_certs.ca)),  # TLS, no client certificate
        dict(tls_ca=str(dev_certs.ca), tls_cert=str(other_certs.client_cert), tls_key=str(other_certs.client_key)),
        dict(
            tls_ca=str(other_certs.ca), tls_cert=str(dev_certs.client_cert), tls_key=str(dev_certs.client_key)
        ),  # distrusts the gateway
    ]
    for kwargs in refused:
        with Client(cluster.gateway_address, timeout=10, **kwargs) as client:
            with pytest.raises(Unavailable):
                client.generate(prompts[0], max_new_tokens=2)
    with pytest.raises(TlsSetupError, match="tls_ca '/nonexistent/ca.pem': no such file"):
        Client(cluster.gateway_address, tls_ca="/nonexistent/ca.pem")


def test_sdk_reads_tls_from_the_environment(cluster, dev_certs, prompts, reference, monkeypatch):
    monkeypatch.setenv("COSINE_TLS_CA", str(dev_certs.ca))
    monkeypatch.setenv("COSINE_TLS_CERT", str(dev_certs.client_cert))
    monkeypatch.setenv("COSINE_TLS_KEY", str(dev_certs.client_key))
    with Client(cluster.gateway_address, timeout=120) as client:
        assert list(client.generate(prompts[0], max_new_tokens=MAX_NEW).token_ids) == reference[prompts[0]]


def test_cli_generate_and_status_take_tls_flags(cluster, dev_certs, prompts, reference, capsys):
    flags = [
        "--tls-ca",
        str(dev_certs.ca),
        "--tls-cert",
        str(dev_certs.client_cert),
        "--tls-key",
        str(dev_certs.client_key),
    ]
    assert (
        main(
            [
                "generate",
                "--address",
                cluster.gateway_address,
                "--max-new-tokens",
                str(MAX_NEW),
                "--json",
                *flags,
                prompts[0],
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["token_ids"] == reference[prompts[0]]
    assert main(["status", "--router", cluster.router_address, "--json", *flags]) == 0
    assert json.loads(capsys.readouterr().out)["verifier"]["healthy"] is True
    assert (
        main(
            [
                "generate",
                "--address",
                cluster.gateway_address,
                "--timeout",
                "10",
                "--tls-ca",
                str(dev_certs.ca),
                prompts[0],
            ]
        )
        == 1
    )
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert main(["status", "--router", cluster.router_address, "--no-tls"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def public_gateway(cluster, tiny_zoo, *tls_flags):
    """One more gateway, in process, in front of the cluster's router (same Redis)."""
    from common.platform.settings import load_settings
    from services.gateway.server import build_app
    from services.gateway.settings import GatewaySettings
    from tests.support.testing import InProcessService

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
            "-1",
            "--redis-url",
            cluster.redis_url,
            "--redis-prefix",
            cluster.spec.prefix,
            "--router-address",
            cluster.router_address,
            "--tokenizer",
            str(tiny_zoo.target.path),
            *tls_flags,
        ],
        {},
    )

    async def factory(s, store):
        app = await build_app(s, store)
        server.apps.append(app)
        return app

    server = InProcessService(settings, factory, prog="gateway")
    server.apps = []
    server.start()
    return server


def test_a_public_tls_gateway_without_client_auth_in_front_of_the_mtls_router(
    cluster, tiny_zoo, dev_certs, prompts, reference
):
    """Clients need only the CA; the gateway itself shows its certificate to the mTLS router."""
    import openai

    server = public_gateway(
        cluster,
        tiny_zoo,
        "--tls-cert",
        str(dev_certs.cert),
        "--tls-key",
        str(dev_certs.key),
        "--tls-ca",
        str(dev_certs.ca),
        "--http-port",
        "0",
        "--served-model-name",
        "tiny",
    )
    try:
        with Client(server.address, timeout=120, tls_ca=str(dev_certs.ca)) as client:
            grpc_text = client.generate(prompts[0], max_new_tokens=MAX_NEW)
            assert list(grpc_text.token_ids) == reference[prompts[0]]
        with Client(server.address, timeout=10, tls=False) as client:
            with pytest.raises(Unavailable):
                client.generate(prompts[0], max_new_tokens=2)
        # the OpenAI-compatible HTTP port serves HTTPS with the same certificate
        port = server.apps[0].http.port
        https = openai.OpenAI(
            base_url=f"https://localhost:{port}/v1",
            api_key="none",
            max_retries=0,
            timeout=120,
            http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(dev_certs.ca))),
        )
        reply = https.completions.create(model="tiny", prompt=prompts[0], max_tokens=MAX_NEW, temperature=0)
        assert reply.choices[0].text == grpc_text.text
        plain = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="none", max_retries=0, timeout=10)
        with pytest.raises(openai.APIConnectionError):
            plain.models.list()
    finally:
        server.stop()


def test_a_gateway_that_dials_plaintext_is_refused_by_the_mtls_router(cluster, tiny_zoo, prompts):
    # no --tls-ca: it dials the router in plaintext (and gives up at once instead of waiting for a router to resume on)
    server = public_gateway(cluster, tiny_zoo, "--router-resumes", "0")
    try:
        with Client(server.address, timeout=20, tls=False) as client:
            with pytest.raises(Unavailable) as info:
                client.generate(prompts[0], max_new_tokens=2)
        assert "failed to connect" in info.value.message  # refused at the router's door, not a later failure
    finally:
        server.stop()
