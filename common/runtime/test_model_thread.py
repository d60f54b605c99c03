import asyncio
import threading

import pytest

from common.runtime.model_thread import ModelThread


def test_every_call_runs_on_the_same_thread_which_is_not_the_callers():
    mt = ModelThread("test-model")
    try:
        assert mt.ident is None

        async def main() -> list[int]:
            return [await mt.run(threading.get_ident) for _ in range(3)]

        seen = asyncio.run(main())
        assert len(set(seen)) == 1 and seen[0] == mt.ident
        assert mt.ident != threading.get_ident()
        assert asyncio.run(mt.run(lambda a, b=0: a + b, 2, b=3)) == 5
    finally:
        mt.shutdown()


def test_an_error_on_the_model_thread_reaches_the_caller():
    mt = ModelThread("test-model")

    def boom() -> None:
        raise ValueError("bad batch")

    try:
        with pytest.raises(ValueError, match="bad batch"):
            asyncio.run(mt.run(boom))
        assert asyncio.run(mt.run(lambda: 7)) == 7  # the thread survives
    finally:
        mt.shutdown()
