"""request_context: bound fields reach every line inside the block, and a stream closed from
another task (as gRPC closes a server stream whose client left after its last message) unwinds
without an error."""

from __future__ import annotations

import asyncio
import io
import json

import structlog

from common.logs import configure_logging, get_logger, request_context


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith("{")]


def test_request_id_on_lines_inside_only():
    out = io.StringIO()
    configure_logging("info", "json", out, service="t")
    log = get_logger("t")
    with request_context("r-1", domain="code"):
        log.info("inside")
    log.info("outside")
    inside, outside = _lines(out)
    assert (inside["request_id"], inside["domain"]) == ("r-1", "code")
    assert "request_id" not in outside and "domain" not in outside


def test_stream_closed_from_another_task_unwinds_cleanly():
    out = io.StringIO()
    configure_logging("info", "json", out, service="t")
    log = get_logger("t")
    errors: list[BaseException] = []

    async def stream():
        with request_context("r-2"):
            try:
                yield 1
                yield 2
            finally:
                log.info("stream closed", request_id="r-2")  # the closing task's context never had it bound

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(
            lambda _loop, ctx: errors.append(ctx.get("exception") or RuntimeError(ctx["message"]))
        )
        gen = stream()
        assert await asyncio.create_task(gen.__anext__()) == 1  # the generator runs in one task's context
        await asyncio.create_task(gen.aclose())  # and is closed in another's
        log.info("after")

    asyncio.run(main())
    assert errors == []
    closed, after = _lines(out)
    assert closed["event"] == "stream closed" and closed["request_id"] == "r-2"
    assert "request_id" not in after
    assert structlog.contextvars.get_contextvars() == {}
