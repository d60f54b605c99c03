"""Prometheus metrics of a service: one registry per process, an HTTP exporter, gRPC server metrics.

Every service serves ``/metrics`` on ``--metrics-port`` (0: any free port, -1: off). The
families each service exports are declared next to the code that produces them (gateway
latencies in ``services/gateway/server.py``, speculative-decoding counters in
``services/router/metrics.py``, KV use in the engines' servicers) on the process's
:class:`ServiceMetrics` registry; this module owns the registry, the exporter and the gRPC
interceptor that every service shares:

- ``grpc_server_handled_total{grpc_method, grpc_code}``: RPCs completed, by status code;
- ``grpc_server_handling_seconds{grpc_method}``: time from call to completion (for a stream: its
  whole life).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from common.logs import get_logger
from common.platform.grpc_server import rewrap_handler
from common.platform.malformed import handler_replies, handler_reply

log = get_logger(__name__)

# seconds: sub-millisecond RPCs (health, Info) up to minute-long generation streams
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServiceMetrics:
    """The metric registry of one service process, and the factories its families are made with."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        self.port: int | None = None
        self._server: Any = None
        self.rpc_handled = self.counter(
            "grpc_server_handled_total", "RPCs completed, by method and status code", ["grpc_method", "grpc_code"]
        )
        self.rpc_seconds = self.histogram(
            "grpc_server_handling_seconds", "RPC handling time (a stream: its life)", ["grpc_method"], LATENCY_BUCKETS
        )

    # ---- families ----------------------------------------------------------------------------

    def counter(self, name: str, doc: str, labels: list[str] | None = None) -> Counter:
        return Counter(name, doc, labels or [], registry=self.registry)

    def gauge(self, name: str, doc: str, labels: list[str] | None = None) -> Gauge:
        return Gauge(name, doc, labels or [], registry=self.registry)

    def histogram(
        self, name: str, doc: str, labels: list[str] | None = None, buckets: tuple[float, ...] = LATENCY_BUCKETS
    ) -> Histogram:
        return Histogram(name, doc, labels or [], buckets=buckets, registry=self.registry)

    # ---- exporter ----------------------------------------------------------------------------

    def serve(self, host: str, port: int) -> int | None:
        """Start the ``/metrics`` HTTP exporter (a daemon thread). Returns the bound port, or None when off."""
        if port < 0:
            return None
        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        self._server = server
        self.port = server.server_port
        log.info("metrics_serving", address=f"{host}:{self.port}", path="/metrics")
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return _MetricsInterceptor(self)


class _MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler so that its completion is counted by status code and timed."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        m = self.metrics

        @contextlib.contextmanager
        def observed(context: Any) -> Iterator[None]:
            """Count and time one RPC, by the status it ended with."""
            started = time.perf_counter()
            failed: BaseException | None = None
            try:
                yield
            except BaseException as exc:
                failed = exc
                raise
            finally:
                code = context.code() if hasattr(context, "code") else None
                if failed is not None and code in (None, grpc.StatusCode.OK):
                    # cancelled by the client (CancelledError, GeneratorExit) or an error the servicer did not map
                    code = grpc.StatusCode.UNKNOWN if isinstance(failed, Exception) else grpc.StatusCode.CANCELLED
                m.rpc_handled.labels(method, (code or grpc.StatusCode.OK).name).inc()
                m.rpc_seconds.labels(method).observe(time.perf_counter() - started)

        def unary(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def wrapped(request_or_iterator: Any, context: Any) -> Any:
                with observed(context):
                    return await handler_reply(fn, request_or_iterator, context)

            return wrapped

        def streaming(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def wrapped(request_or_iterator: Any, context: Any) -> AsyncIterator[Any]:
                with observed(context):
                    async for item in handler_replies(fn, request_or_iterator, context):
                        yield item

            return wrapped

        return rewrap_handler(handler, unary, streaming)


def bind_engine_metrics(metrics: ServiceMetrics, engine: Callable[[], Any], model: str = "") -> None:
    """KV cache use and live requests of one engine (a verifier's target or one hosted drafter):
    ``cosine_kv_cache_tokens{model, kind="reserved"|"budget"}``, ``cosine_kv_cache_usage_ratio{model}``
    (0 without a budget), ``cosine_engine_requests{model}`` and ``cosine_cuda_graph_passes{model,
    kind="replayed"|"captured"|"eager"}`` (0 without CUDA graphs), read when scraped."""
    fams = getattr(metrics, "_engine_families", None)
    if fams is None:
        fams = (
            metrics.gauge(
                "cosine_kv_cache_tokens", "KV cache tokens reserved by live requests, and the budget", ["model", "kind"]
            ),
            metrics.gauge("cosine_kv_cache_usage_ratio", "reserved / budget (0 when unbounded)", ["model"]),
            metrics.gauge("cosine_engine_requests", "requests holding a KV cache", ["model"]),
            metrics.gauge(
                "cosine_cuda_graph_passes",
                "forward passes by how they ran: replayed from a CUDA graph, captured, eager (no bucket fits)",
                ["model", "kind"],
            ),
        )
        metrics._engine_families = fams  # type: ignore[attr-defined]
    tokens, ratio, requests, graph_passes = fams
    name = model or metrics.service

    def reserved() -> float:
        e = engine()
        return float(e.kv_reserved_tokens) if e is not None else 0.0

    def budget() -> float:
        e = engine()
        return float(e.pool.token_budget or 0) if e is not None else 0.0

    tokens.labels(name, "reserved").set_function(reserved)
    tokens.labels(name, "budget").set_function(budget)
    ratio.labels(name).set_function(lambda: reserved() / budget() if budget() else 0.0)
    requests.labels(name).set_function(lambda: float(engine().active_requests) if engine() is not None else 0.0)

    def graph_count(kind: str) -> Callable[[], float]:
        def read() -> float:
            e = engine()
            graphs = getattr(getattr(e, "runner", None), "graphs", None)
            return float(graphs.stats()[kind]) if graphs is not None else 0.0

        return read

    for kind in ("replayed", "captured", "eager"):
        graph_passes.labels(name, kind).set_function(graph_count(kind))
