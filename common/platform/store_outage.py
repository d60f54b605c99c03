"""Redis outages as the Store reports them: one exception, :class:`StoreUnavailable`."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import RedisError

OUTAGE_ERRORS = (RedisError, OSError)


class StoreUnavailable(RuntimeError):
    """Redis could not be reached or answered with an error. A servicer maps it to UNAVAILABLE
    (``common.platform.grpc_server.StoreOutageInterceptor`` does it for any it lets through)."""


T = TypeVar("T")


def outage(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Turn redis and socket errors of a Store method into :class:`StoreUnavailable`."""

    @functools.wraps(fn)
    async def wrapped(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except OUTAGE_ERRORS as exc:
            raise StoreUnavailable(f"Redis unavailable: {exc or type(exc).__name__}") from exc

    return wrapped


# What a Redis outage raises through the Store. Every Store method now raises StoreUnavailable
# alone (append_tokens and delete_request raise nothing for an outage); catching this tuple
# stays correct.
STORE_ERRORS: tuple[type[BaseException], ...] = (StoreUnavailable, RedisError, OSError)
