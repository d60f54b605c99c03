"""The one thread a serving process runs its models on: loading, warm-up and every pass.

With more than one torch thread, a CPU process must make all its parallel model work from a single
thread. Measured with PyTorch's CPU build (OpenMP threading) on 2 cores, two torch threads: once one
thread has run parallel work, parallel work from a second thread runs far slower. A decode step of
SmolLM2-135M takes 30 ms from the thread that loaded the model and 56 ms from another one, more
than the 43 ms of a single torch thread; a bare loop of matrix products, 24 ms from a fresh thread
and 42 ms from a thread after the main one ran the same loop once (``OMP_WAIT_POLICY`` does not
cure it). A service that loads its model with ``asyncio.to_thread`` and runs its passes on an
executor of its own falls into exactly that, and more threads then make it slower, not faster.

:class:`ModelThread` is a single-worker executor with the loop-side helper the services need; the
verifier and the drafter load their models on it and run every pass on it.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ModelThread:
    """Runs callables one at a time on one dedicated thread (see the module doc for why)."""

    def __init__(self, name: str) -> None:
        self.ident: int | None = None  # the worker thread's identifier, once it has started
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=self._started)

    def _started(self) -> None:
        self.ident = threading.get_ident()

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the model thread, awaited from the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
