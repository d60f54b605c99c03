"""Per-request bookkeeping shared by the drafter and verifier engines: a runner, its KV pool and
the request states keyed by id (each state has ``request_id`` and ``cache``)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from common.logs import get_logger
from common.runtime.runner import LMRunner
from common.spec.types import ModelInfo, UnknownRequest

S = TypeVar("S")
log = get_logger("engine")


class RequestEngine(Generic[S]):
    def __init__(self, runner: LMRunner, kv_token_budget: int | None, kind: str) -> None:
        self.runner = runner
        self.pool = runner.new_pool(kv_token_budget)
        self._requests: dict[str, S] = {}
        log.info(
            f"{kind}_engine_ready",
            model=runner.name,
            attention_backend=runner.attention_name,
            kv_cache=runner.kv_cache,
            kv_token_budget=kv_token_budget,
            max_context=runner.max_context,
        )

    def model_info(self) -> ModelInfo:
        return self.runner.model_info()

    def cache_len(self, request_id: str) -> int:
        return self._state(request_id).cache.length  # type: ignore[attr-defined]

    def holds(self, request_id: str) -> bool:
        """Whether this engine keeps a cache for ``request_id``."""
        return request_id in self._requests

    @property
    def active_requests(self) -> int:
        return len(self._requests)

    @property
    def kv_reserved_tokens(self) -> int:
        return self.pool.reserved_tokens

    def release(self, request_id: str) -> bool:
        """Free a request's cache and state; False when it was not known."""
        state: Any = self._requests.pop(request_id, None)
        if state is None:
            return False
        state.cache.release()
        return True

    def _state(self, request_id: str) -> S:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequest(f"unknown request {request_id!r} (never seen or released)") from None

    def _drop(self, state: Any) -> None:
        if self._requests.get(state.request_id) is state:
            del self._requests[state.request_id]
        state.cache.release()
