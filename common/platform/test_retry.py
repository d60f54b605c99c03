"""The project's one retry policy: its pauses, and attempts that raise the last failure as it is."""

from __future__ import annotations

import asyncio

import pytest
from tenacity import retry_if_exception_type, stop_after_attempt

from common.platform.retry import RetryPolicy


def test_pauses_double_up_to_the_cap_and_are_never_shorter_than_that():
    policy = RetryPolicy(initial_s=0.1, max_s=2.0, jitter=0.2)
    for failures, plain in ((0, 0.05), (1, 0.1), (2, 0.2), (5, 1.6), (6, 2.0), (30, 2.0)):
        pauses = [policy.delay(failures) for _ in range(50)]
        assert all(plain <= p < plain * 1.2 + 1e-12 for p in pauses), (failures, pauses)
    assert len({policy.delay(3) for _ in range(20)}) > 1  # jittered
    assert RetryPolicy(0.5, 30.0, jitter=0.0).delay(3) == 2.0


def test_attempts_retry_what_they_are_told_to_and_raise_the_last_failure_itself():
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    async def body(fail: list[Exception]) -> int:
        tries = 0
        policy = RetryPolicy(initial_s=0.01, max_s=0.04)
        async for attempt in policy.retrying(
            retry=retry_if_exception_type(ConnectionError), stop=stop_after_attempt(3), sleep=sleep
        ):
            with attempt:
                tries += 1
                if fail:
                    raise fail.pop(0)
        return tries

    assert asyncio.run(body([ConnectionError(), ConnectionError()])) == 3 and len(slept) == 2
    with pytest.raises(ConnectionError):
        asyncio.run(body([ConnectionError()] * 3))
    with pytest.raises(ValueError):  # not retried
        asyncio.run(body([ValueError()]))
    tries = 0
    for attempt in RetryPolicy(0.01, 0.01).retrying_sync(retry=retry_if_exception_type(OSError), sleep=lambda s: None):
        with attempt:
            tries += 1
            if tries < 4:
                raise OSError("again")
    assert tries == 4
