"""The start-up and shutdown path every CoSine service shares.

``python -m services.<name>`` calls :func:`run_service` with the service's settings class and a
factory for its app. The path is: parse settings (flags + ``COSINE_*``) -> configure logging ->
reach Redis -> build the app (load models, connect peers) -> serve gRPC with health and
reflection -> register in Redis with a heartbeat -> wait for SIGTERM/SIGINT -> NOT_SERVING and
deregister (peers stop sending work) -> the app's own drain, if it has one -> stop with a grace
period. Any expected failure on that path (bad settings,
unreachable Redis, a port in use, a bad checkpoint) ends the process with one line on stderr and
a non-zero exit status; no traceback.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from common.logs import LEVELS, configure_logging, get_logger
from common.platform.grpc_server import (
    ErrorStatusInterceptor,
    PortInUse,
    ServerHandle,
    create_server,
    join_host_port,
    wait_for_shutdown_signal,
)
from common.platform.metrics import ServiceMetrics
from common.platform.settings import (
    SettingsError,
    load_settings,
    port_check,
    positive,
    redis_url_check,
    setting,
    settings_as_dict,
)
from common.platform.store import Member, Store, StoreUnavailable
from common.platform.tls import TlsConfig, TlsError

EXIT_SETTINGS = 2
EXIT_STARTUP = 1


class StartupError(RuntimeError):
    """An expected start-up failure (bad checkpoint, unreachable peer...). Message is one line."""


@dataclass(frozen=True)
class ServiceSettings:
    """Settings every service has. Services extend this with their own fields."""

    host: str = setting("127.0.0.1", help="address to listen on (0.0.0.0 or :: to listen on every interface)")
    port: int = setting(0, help="port to listen on (0 picks a free port)", check=port_check)
    advertise_address: str = setting(
        "", help="host:port other services use to reach this one (default: host:port as bound)"
    )
    redis_url: str = setting(
        "redis://127.0.0.1:6379/0", help="Redis URL for profiles, request state and membership", check=redis_url_check
    )
    redis_prefix: str = setting("cosine", help="prefix of every Redis key this cluster uses")
    member_id: str = setting("", help="identity in the membership registry (default: hostname-pid)")
    heartbeat_s: float = setting(2.0, help="membership heartbeat period in seconds", check=positive)
    member_ttl_s: float = setting(6.0, help="membership entry lifetime without heartbeat, seconds", check=positive)
    metrics_port: int = setting(
        -1,
        help="port of the Prometheus /metrics endpoint (0: any free port, -1: off)",
        check=lambda v: None if -1 <= v <= 65535 else "must be -1 (off), 0 (any free port) or a port",
    )
    shutdown_grace_s: float = setting(3.0, help="seconds in-flight RPCs get to finish on SIGTERM", check=positive)
    log_level: str = setting("info", help="log level", choices=LEVELS)
    log_format: str = setting(
        "auto", help="log format: json, console, or auto (console on a terminal)", choices=("auto", "json", "console")
    )
    # TLS (common/platform/tls.py): give every service the same three files and every hop is mutual TLS.
    tls_cert: str = setting(
        "",
        help="PEM certificate (chain) to serve TLS with; also presented to peers that ask for a client certificate "
        "(none: plaintext)",
        metavar="PATH",
    )
    tls_key: str = setting("", help="PEM private key of --tls-cert", metavar="PATH")
    tls_ca: str = setting(
        "",
        help="PEM CA bundle: peers this service calls are dialled over TLS and checked against it; with "
        "--tls-client-auth it also checks clients",
        metavar="PATH",
    )
    tls_client_auth: bool = setting(False, help="mutual TLS: refuse clients without a certificate signed by --tls-ca")
    tls_server_name: str = setting(
        "",
        help="name peers' certificates must carry, instead of the host dialled (peers are dialled by IP in Kubernetes)",
        metavar="NAME",
    )


class ServiceApp(Protocol):
    role: str
    service_names: tuple[str, ...]

    def register(self, server: grpc.aio.Server) -> None: ...

    async def start(self, handle: ServerHandle, address: str) -> None: ...

    async def stop(self) -> None: ...

    def member_info(self) -> dict[str, Any]: ...


AppFactory = Callable[[Any, Store], Awaitable[ServiceApp]]


def default_member_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def fail(prog: str, message: str, code: int) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def run_service(
    settings_cls: type,
    factory: AppFactory,
    *,
    prog: str,
    description: str,
    argv: Sequence[str] | None = None,
) -> None:
    """Entry point of ``python -m services.<name>``; returns only by SystemExit."""
    try:
        settings = load_settings(settings_cls, argv, prog=prog, description=description)
        TlsConfig.from_settings(settings).check()  # a bad certificate path ends here, in one line
    except (SettingsError, TlsError) as exc:
        fail(prog, str(exc), EXIT_SETTINGS)
    configure_logging(settings.log_level, settings.log_format, service=prog.rsplit(".", 1)[-1])
    try:
        asyncio.run(serve(settings, factory, prog))
    except (StoreUnavailable, StartupError, PortInUse, TlsError) as exc:
        fail(prog, str(exc), EXIT_STARTUP)
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        raise SystemExit(130) from None
    raise SystemExit(0)


async def serve(
    settings: Any, factory: AppFactory, prog: str, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    """Serve until SIGTERM/SIGINT (or until ``stop`` is set, for in-process tests)."""
    log = get_logger(prog)
    log.info("starting", settings=settings_as_dict(settings))
    tls = TlsConfig.from_settings(settings)
    tls.check()  # before any model loads: a wrong certificate path fails fast
    store = Store.from_url(settings.redis_url, prefix=settings.redis_prefix)
    try:
        try:
            await store.ping()
        except StoreUnavailable as exc:
            raise StoreUnavailable(f"cannot reach Redis at {settings_as_dict(settings)['redis_url']}: {exc}") from None
        app = await factory(settings, store)
        metrics = ServiceMetrics(app.role)
        if hasattr(app, "bind_metrics"):
            app.bind_metrics(metrics)
        try:
            address = join_host_port(settings.host, settings.port)
            handle = await create_server(
                address,
                app.register,
                app.service_names,
                interceptors=[
                    metrics.interceptor(),
                    *getattr(app, "interceptors", ()),
                    ErrorStatusInterceptor({StoreUnavailable: grpc.StatusCode.UNAVAILABLE}),
                ],
                tls=tls,
            )
            try:
                metrics_port = metrics.serve(settings.host, settings.metrics_port)
            except OSError as exc:
                await handle.stop(0)
                raise PortInUse(str(exc)) from None
            advertised = settings.advertise_address or join_host_port(_reachable_host(settings.host), handle.port)
            await app.start(handle, advertised)
            info = app.member_info()
            if metrics_port is not None:
                info["metrics_port"] = metrics_port
            member = Member(app.role, settings.member_id or default_member_id(), advertised, info, time.time())
            try:
                await store.register(member, settings.member_ttl_s)
            except StoreUnavailable as exc:  # Redis restarting: the heartbeat registers us when it is back
                log.warning("not registered yet; the heartbeat will retry", error=str(exc))
            heartbeat = asyncio.create_task(_heartbeat(store, member, settings.heartbeat_s, settings.member_ttl_s, log))
            log.info(
                "serving",
                address=advertised,
                port=handle.port,
                role=app.role,
                member_id=member.member_id,
                metrics_port=metrics_port,
                tls=tls.describe(),
            )
            if ready is not None:
                ready.port = handle.port  # type: ignore[attr-defined]
                ready.set()
            try:
                if stop is None:
                    signame = await wait_for_shutdown_signal()
                else:
                    await stop.wait()
                    signame = "stop-event"
                log.info("shutting down", signal=signame, grace_s=settings.shutdown_grace_s)
            finally:
                # peers stop sending work at once: health NOT_SERVING, membership entry gone
                heartbeat.cancel()
                await handle.set_serving(False)
                try:
                    await store.deregister(member.role, member.member_id)
                except Exception as exc:  # Redis gone during shutdown: the TTL will clean up
                    log.warning("deregister failed", error=str(exc))
                drain = getattr(app, "drain", None)
                if drain is not None:  # an app that can finish its in-flight work first (the drafter)
                    await drain()
                await handle.stop(settings.shutdown_grace_s)
        finally:
            await app.stop()
            metrics.close()
        log.info("stopped")
    finally:
        await store.close()


def _reachable_host(host: str) -> str:
    """A wildcard listen address is not something peers can dial: advertise the host name."""
    return socket.gethostname() if host in ("0.0.0.0", "", "::", "[::]") else host


async def _heartbeat(store: Store, member: Member, period_s: float, ttl_s: float, log: Any) -> None:
    failures = 0
    while True:
        await asyncio.sleep(period_s)
        try:
            await store.register(member, ttl_s)
            if failures:
                log.info("heartbeat restored", after_failures=failures)
            failures = 0
        except Exception as exc:
            failures += 1
            if failures in (1, 10) or failures % 100 == 0:
                log.warning("heartbeat failed", error=str(exc), failures=failures)
