"""The one thread a serving process runs its models on: loading, warm-up and every pass.

With more than one torch thread, a CPU process must make all its parallel model work from a single
thread. With PyTorch's CPU build (OpenMP threading) and two or more torch threads, once one thread
has run parallel work, parallel work from a second thread runs far slower: a decode step from another
thread than the one that loaded the model was slower than with a single torch thread, and a bare loop
of matrix products showed the same (``OMP_WAIT_POLICY`` does not cure it). A service that loads its
model with ``asyncio.to_thread`` and runs its passes on an executor of its own falls into exactly
that, and more threads then make it slower, not faster.

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
