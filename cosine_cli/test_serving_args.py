"""`cosine up`'s serving flags reach the services as flags the services' own settings accept."""

from common.platform.settings import load_settings
from cosine_cli.commands import _spec_from_args
from cosine_cli.main import build_parser
from cosine_cli.serving_args import metrics_lines, service_args
from services.drafter.settings import DrafterSettings
from services.gateway.settings import GatewaySettings
from services.verifier.settings import VerifierSettings

MODELS = ["--target", "/models/t", "--drafter", "a=/models/a"]


def spec_for(*flags: str):
    args = build_parser().parse_args(["up", *MODELS, *flags])
    return _spec_from_args(args, service_args(args))


def test_serving_flags_become_the_services_settings(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages }}")
    keys = tmp_path / "keys"
    keys.write_text("k3\n")
    spec = spec_for(
        "--served-model-name",
        "my-model",
        "--chat-template",
        str(template),
        "--api-key",
        "k1",
        "--api-key",
        "k2",
        "--api-keys-file",
        str(keys),
        "--device",
        "cuda:1",
        "--dtype",
        "bfloat16",
        "--kv-cache",
        "paged",
        "--no-cuda-graphs",
    )
    gateway = load_settings(GatewaySettings, list(spec.gateway_args), {})
    assert gateway.served_model_name == "my-model" and gateway.chat_template == str(template)
    assert gateway.api_keys == ("k1", "k2") and gateway.api_keys_file == str(keys)
    verifier = load_settings(VerifierSettings, ["--target", spec.target, *spec.verifier_args], {})
    drafter = load_settings(DrafterSettings, ["--drafters", "a=/models/a", *spec.drafter_args], {})
    for s in (verifier, drafter):
        assert (s.device, s.dtype, s.kv_cache, s.cuda_graphs) == ("cuda:1", "bfloat16", "paged", False)
    assert load_settings(VerifierSettings, ["--target", spec.target], {}).cuda_graphs  # on unless turned off


def test_unset_flags_pass_nothing_and_keep_the_services_defaults():
    spec = spec_for()
    assert spec.gateway_args == spec.verifier_args == spec.drafter_args == ()


def test_a_template_given_inline_is_passed_as_is():
    spec = spec_for("--chat-template", "{{ messages[0]['content'] }}")
    assert spec.gateway_args == ("--chat-template", "{{ messages[0]['content'] }}")


def test_every_metrics_endpoint_is_printed():
    state = {
        "http": "http://127.0.0.1:8000",
        "metrics": {"gateway": "127.0.0.1:9100", "router": "127.0.0.1:9101", "drafter-0": "127.0.0.1:9103"},
    }
    assert metrics_lines(state) == [
        "metrics    drafter-0  http://127.0.0.1:9103/metrics",
        "metrics    gateway    http://127.0.0.1:9100/metrics",
        "metrics    router     http://127.0.0.1:9101/metrics",
        "metrics    gateway    http://127.0.0.1:8000/metrics (the API port)",
    ]
