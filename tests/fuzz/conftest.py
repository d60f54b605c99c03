"""Fuzzing profiles, the fuzzed cluster and the per-target case count.

Two sizes (hypothesis settings profiles):

- ``ci`` (the default, part of ``make test``): 50 cases per target (750 in all, well under a
  minute on 2 cores), derandomized so the suite is repeatable;
- ``fuzz`` (``make fuzz``, i.e. ``pytest tests/fuzz --hypothesis-profile=fuzz``): 1,000 random
  cases per target, over 15,000 in all (15 targets).

The cases run per target and each target's result are printed at the end of the session.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, settings

from common.platform.grpc_server import CHANNEL_OPTIONS

from .harness import FuzzReport
from .stack import FuzzStack

_common = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    print_blob=True,
)
settings.register_profile("ci", max_examples=50, derandomize=True, database=None, **_common)
settings.register_profile("fuzz", max_examples=1000, **_common)

REPORT_KEY = pytest.StashKey[FuzzReport]()


def pytest_configure(config: pytest.Config) -> None:
    profile = config.getoption("hypothesis_profile", None)
    config.stash[REPORT_KEY] = FuzzReport(profile=profile or "ci")
    if not profile:
        settings.load_profile("ci")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    report = config.stash.get(REPORT_KEY, None)
    if report is None or not report.cases:
        return
    terminalreporter.section(f"fuzzing: cases per target (profile {report.profile})")
    for line in report.lines():
        terminalreporter.write_line(line)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    except BaseException:
        for target in getattr(item.function, "fuzz_targets", ()):
            item.config.stash[REPORT_KEY].failed.add(target)
        raise


@pytest.fixture(scope="session")
def fuzz_report(request: pytest.FixtureRequest) -> FuzzReport:
    return request.config.stash[REPORT_KEY]


@pytest.fixture(scope="session")
def stack(tiny_zoo, redis_server) -> Iterator[FuzzStack]:
    s = FuzzStack.start(tiny_zoo, redis_server.url, "fuzz")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def channels(stack: FuzzStack) -> Iterator[dict[str, grpc.Channel]]:
    out = {name: grpc.insecure_channel(stack.address(name), options=CHANNEL_OPTIONS) for name in stack.services}
    try:
        yield out
    finally:
        for channel in out.values():
            channel.close()
