"""A request/response client over one long-lived bidirectional gRPC stream.

The drafter's ``Draft`` and the verifier's ``Verify`` answer every message with exactly one reply,
in order. :class:`StreamClient` turns such a stream into ``await client.call(msg) -> reply`` that
many coroutines can share: replies are matched to calls by order. When the stream breaks, every
pending and later call fails with :class:`StreamBroken` until :meth:`reset` opens a new stream.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc


class StreamBroken(ConnectionError):
    pass


class StreamClient:
    def __init__(self, open_stream: Callable[[AsyncIterator[Any]], Any], name: str):
        self._open = open_stream
        self.name = name
        self._queue: asyncio.Queue[Any] | None = None
        self._pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._reader: asyncio.Task[None] | None = None
        self._call: Any = None
        self.broken: str = ""

    def _ensure_open(self) -> None:
        if self._call is not None:
            return
        self._queue = asyncio.Queue()
        queue = self._queue

        async def outgoing() -> AsyncIterator[Any]:
            while True:
                msg = await queue.get()
                if msg is None:
                    return
                yield msg

        self._call = self._open(outgoing())
        self._reader = asyncio.create_task(self._read(self._call), name=f"{self.name}-reader")

    async def _read(self, call: Any) -> None:
        try:
            async for reply in call:
                if self._pending:
                    fut = self._pending.popleft()
                    if not fut.done():
                        fut.set_result(reply)
            reason = "stream closed by the server"
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            reason = "stream closed"
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        self.broken = reason
        while self._pending:
            fut = self._pending.popleft()
            if not fut.done():
                fut.set_exception(StreamBroken(f"{self.name}: {reason}"))

    async def call(self, msg: Any, timeout_s: float | None = None) -> Any:
        if self.broken:
            raise StreamBroken(f"{self.name}: {self.broken}")
        self._ensure_open()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append(fut)
        assert self._queue is not None
        self._queue.put_nowait(msg)
        if timeout_s is None:
            return await fut
        return await asyncio.wait_for(fut, timeout_s)

    def send_nowait(self, msg: Any) -> asyncio.Future[Any] | None:
        """Queue a message whose reply nobody waits for (e.g. a release)."""
        if self.broken:
            return None
        self._ensure_open()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)
        self._pending.append(fut)
        assert self._queue is not None
        self._queue.put_nowait(msg)
        return fut

    @property
    def pending(self) -> int:
        """Calls sent and not answered yet."""
        return sum(1 for fut in self._pending if not fut.done())

    async def close(self) -> None:
        if self._queue is not None:
            self._queue.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), 2)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._reader.cancel()
        self._fail_all("closed")
        self._call = None

    def reset(self) -> None:
        """Forget a broken stream; the next call opens a new one."""
        if self._call is not None:
            self._call.cancel()
        self._call = None
        self._reader = None
        self.broken = ""
