"""Settings of the gateway service (flags or COSINE_* variables; see `python -m services.gateway --help`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.platform.service import ServiceSettings
from common.platform.settings import port_check, positive, setting


@dataclass(frozen=True)
class GatewaySettings(ServiceSettings):
    host: str = setting("0.0.0.0", help="address to listen on (the gateway is the public face)")
    port: int = setting(50051, help="port to listen on (0 picks a free port)", check=port_check)
    metrics_port: int = setting(
        9100,
        help="port of the Prometheus /metrics endpoint (0: any free port, -1: off)",
        check=lambda v: None if -1 <= v <= 65535 else "must be -1 (off), 0 (any free port) or a port",
    )
    http_port: int = setting(
        8000,
        help="port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models; 0: any free "
        "port, -1: off)",
        check=lambda v: None if -1 <= v <= 65535 else "must be -1 (off), 0 (any free port) or a port",
    )
    served_model_name: str = setting(
        "", help="model name the HTTP API answers to (default: the target checkpoint's directory name)"
    )
    chat_template: str = setting(
        "",
        help="Jinja chat template for /v1/chat/completions, a file or the template itself; it overrides the "
        "tokenizer's own (default: the tokenizer's; without one, chat completions are refused)",
        metavar="FILE|TEMPLATE",
    )
    max_inflight: int = setting(
        2048, help="most requests in flight at once; more are refused (RESOURCE_EXHAUSTED / HTTP 429)", check=positive
    )
    router_address: str = setting("", help="host:port of the router (default: discovered through Redis membership)")
    api_keys: tuple[str, ...] = setting(
        (),
        help="API keys clients must send as 'authorization: Bearer <key>' (comma-separated in COSINE_API_KEYS; none: "
        "no authentication)",
        metavar="KEY",
    )
    api_keys_file: str = setting(
        "", help="file of API keys, one per line (# comments; e.g. a mounted Kubernetes Secret)", metavar="PATH"
    )
    tokenizer: str = setting(
        "",
        help="the target's tokenizer: a checkpoint directory (default: asked from the verifier's model path)",
        metavar="PATH",
    )
    default_max_new_tokens: int = setting(128, help="max_new_tokens when a request leaves it at 0", check=positive)
    max_new_tokens_limit: int = setting(2048, help="largest max_new_tokens a request may ask for", check=positive)
    max_prompt_tokens: int = setting(4096, help="longest prompt accepted, in target tokens", check=positive)
    max_stop_strings: int = setting(16, help="most stop strings one request may give", check=positive)
    max_logprobs: int = setting(
        20,
        help="most alternatives a request may ask the log-probabilities of at each position (OpenAI's top_logprobs "
        "in chat, logprobs in completions)",
        check=lambda v: None if v >= 0 else "must be 0 or greater",
    )
    max_n: int = setting(
        8,
        help="most choices (n) one OpenAI-API request may ask for; each is a generation of its own",
        check=positive,
    )
    router_resumes: int = setting(
        3,
        help="times one request is resumed on a router after its router was lost (0: never)",
        check=lambda v: None if v >= 0 else "must be 0 or greater",
    )
    router_resume_timeout_s: float = setting(
        30.0, help="how long a resume waits for a router to answer again", check=positive
    )
    request_state_interval_s: float = setting(
        0.25,
        help="how often a running request's tokens are written to its Redis state, in seconds (0: after every chunk); "
        "a finished request's state is deleted, not written",
        check=lambda v: None if v >= 0 else "must be 0 or greater",
    )
    request_timeout_s: float = setting(
        600.0, help="longest a request may run when the client sets no deadline", check=positive
    )

    def validate(self) -> str | None:
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            return "--default-max-new-tokens must not exceed --max-new-tokens-limit"
        return None
