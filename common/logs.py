"""Structured logging for every CoSine process.

JSON lines when stderr is not a terminal (containers, log shippers), coloured key=value lines
on a terminal. Context bound with :func:`request_context` (``request_id`` above all) is added to
every line logged inside it, across awaits, through ``structlog.contextvars``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str = "info", fmt: str = "auto", stream: TextIO | None = None, service: str = "") -> None:
    """Configure structlog (and the stdlib root logger it feeds) once at start-up.

    ``fmt``: ``json``, ``console`` or ``auto`` (console on a terminal, JSON otherwise).
    """
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if hasattr(stream, "isatty") and stream.isatty() else "json"
    numeric = getattr(logging, level.upper(), logging.INFO)
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if service:
        processors.insert(0, _add_service(service))
    if fmt == "json":
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors += [structlog.dev.ConsoleRenderer(colors=stream.isatty() if hasattr(stream, "isatty") else False)]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(
        level=max(numeric, logging.WARNING), stream=stream, format="%(levelname)s %(name)s: %(message)s"
    )


def _add_service(service: str):
    def processor(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("service", service)
        return event

    return processor


def get_logger(name: str | None = None, **initial: Any) -> Any:
    logger = structlog.get_logger(name) if name else structlog.get_logger()
    return logger.bind(**initial) if initial else logger


@contextlib.contextmanager
def request_context(request_id: str, **extra: Any) -> Iterator[None]:
    """Bind ``request_id`` (and ``extra``) to every log line emitted inside the block."""
    tokens = structlog.contextvars.bind_contextvars(request_id=request_id, **extra)
    try:
        yield
    finally:
        for key, token in tokens.items():
            try:
                structlog.contextvars.reset_contextvars(**{key: token})
            except ValueError:
                # an async generator closed from another task than the one that ran it (a stream
                # whose client stopped reading after its last message): the context bound in
                # went with that task, and the closing task's context is not this block's to reset
                pass
