"""A whole CoSine cluster in this process for the fuzzers: real Redis, the four services over
loopback gRPC (each on its own event loop thread), the tiny model zoo from disk. The apps are
kept so that a fuzz case can check, after its call, that nothing was left behind: no request
state in Redis, no request in the router's pool, no KV cache in the verifier or any drafter."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from common.platform.settings import load_settings
from tests.support.testing import InProcessService

# Limits of the fuzzed cluster: small, so that valid requests finish in a few rounds and the
# limits themselves are easy to cross. The verifier splits batches above 64 tokens.
GATEWAY_LIMITS = dict(default_max_new_tokens=4, max_new_tokens_limit=8, max_prompt_tokens=64, max_stop_strings=4)
VERIFIER_MAX_BATCH_TOKENS = 64
VERIFIER_MAX_TREE_NODES = 256
DRAFTER_MAX_TOP_N = 8
DRAFTER_MAX_CHAIN_LEN = 16
DRAFTERS = ("code", "prose")
# the verifier's and drafters' KV cache: auto (per-request caches on a CPU), or paged to fuzz the
# arena's runtime where auto would not pick it (FUZZ_KV_CACHE=paged make fuzz)
KV_CACHE = os.environ.get("FUZZ_KV_CACHE", "auto")
# the tiny zoo's target (checked at start): the strategies are built with these at import time
VOCAB_SIZE = 320
MAX_CONTEXT = 1024


def _capture(build_app: Callable[..., Any], into: list[Any]) -> Callable[..., Any]:
    async def factory(settings: Any, store: Any) -> Any:
        app = await build_app(settings, store)
        into.append(app)
        return app

    return factory


def _flags(**kw: Any) -> list[str]:
    out: list[str] = []
    for name, value in kw.items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            out += [f"--{name.replace('_', '-')}", str(v)]
    return out


@dataclass
class FuzzStack:
    redis_url: str
    prefix: str
    services: dict[str, InProcessService] = field(default_factory=dict)
    apps: dict[str, Any] = field(default_factory=dict)
    vocab_size: int = 0
    max_context: int = 0

    @classmethod
    def start(cls, zoo: Any, redis_url: str, prefix: str) -> FuzzStack:
        from services.drafter.server import build_app as drafter_app
        from services.drafter.settings import DrafterSettings
        from services.gateway.server import build_app as gateway_app
        from services.gateway.settings import GatewaySettings
        from services.router.server import build_app as router_app
        from services.router.settings import RouterSettings
        from services.verifier.server import build_app as verifier_app
        from services.verifier.settings import VerifierSettings

        stack = cls(redis_url, prefix)
        common = dict(
            host="127.0.0.1", port=0, metrics_port=-1, redis_url=redis_url, redis_prefix=prefix, log_level="warning"
        )
        try:
            stack._run(
                "verifier",
                verifier_app,
                VerifierSettings,
                common,
                target=zoo.target.path,
                torch_threads=1,
                kv_cache=KV_CACHE,
                max_batch_tokens=VERIFIER_MAX_BATCH_TOKENS,
                max_tree_nodes=VERIFIER_MAX_TREE_NODES,
            )
            stack._run(
                "drafter",
                drafter_app,
                DrafterSettings,
                common,
                torch_threads=1,
                kv_cache=KV_CACHE,
                max_top_n=DRAFTER_MAX_TOP_N,
                max_chain_len=DRAFTER_MAX_CHAIN_LEN,
                drafters=[f"{d}={zoo.drafters[d].path}" for d in DRAFTERS],
            )
            stack._run(
                "router",
                router_app,
                RouterSettings,
                common,
                verifier_address=stack.address("verifier"),
                discovery_interval_s=0.2,
            )
            stack._run(
                "gateway",
                gateway_app,
                GatewaySettings,
                common,
                router_address=stack.address("router"),
                tokenizer=zoo.target.path,
                http_port=0,
                **GATEWAY_LIMITS,
            )
            stack._wait_router_ready()
        except BaseException:
            stack.stop()
            raise
        info = stack.apps["verifier"].engine.model_info()
        stack.vocab_size, stack.max_context = info.vocab_size, info.max_context
        if (stack.vocab_size, stack.max_context) != (VOCAB_SIZE, MAX_CONTEXT):
            stack.stop()
            raise RuntimeError(
                f"the tiny zoo's target changed: vocab {stack.vocab_size}, context {stack.max_context}; "
                "update VOCAB_SIZE and MAX_CONTEXT in tests/fuzz/stack.py"
            )
        return stack

    def _run(self, name: str, build_app: Any, settings_cls: Any, common: dict[str, Any], **kw: Any) -> None:
        known = {f.name for f in dataclasses.fields(settings_cls)}
        settings = load_settings(settings_cls, _flags(**common, **{k: v for k, v in kw.items() if k in known}), {})
        captured: list[Any] = []
        self.services[name] = InProcessService(settings, _capture(build_app, captured), prog=f"fuzz-{name}").start()
        self.apps[name] = captured[0]

    def _wait_router_ready(self, timeout_s: float = 60.0) -> None:
        router = self.apps["router"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if router.verifier_ready and set(router.pool.live()) >= set(DRAFTERS):
                return
            time.sleep(0.05)
        raise RuntimeError("the router did not connect to the verifier and drafters")

    def address(self, name: str) -> str:
        return self.services[name].address

    def stop(self) -> None:
        for name in ("gateway", "router", "drafter", "verifier"):
            service = self.services.pop(name, None)
            if service is not None:
                service.stop()

    # ---- leaks -----------------------------------------------------------------------------

    def leaks(self) -> list[str]:
        """Everything a finished or refused request left behind (empty when nothing)."""
        out: list[str] = []
        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        try:
            keys = sorted(client.scan_iter(match=f"{self.prefix}:request:*", count=500))
        finally:
            client.close()
        if keys:
            out.append(f"redis request keys: {keys[:4]}")
        core = self.apps["router"].core
        if core is not None and core.requests:
            out.append(f"router requests: {sorted(core.requests)[:4]}")
        engines = {
            "verifier": self.apps["verifier"].engine,
            **{f"drafter {d}": e for d, e in self.apps["drafter"].engines.items()},
        }
        for name, engine in engines.items():
            if engine.active_requests or engine.kv_reserved_tokens:
                out.append(
                    f"{name}: {engine.active_requests} requests, {engine.kv_reserved_tokens} KV tokens reserved "
                    f"({sorted(engine._requests)[:4]})"
                )
        return out

    def assert_clean(self, timeout_s: float = 15.0) -> None:
        """Wait (bounded) for releases in flight to land, then fail naming whatever is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = self.leaks()
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert not left, f"state left behind: {left}"
