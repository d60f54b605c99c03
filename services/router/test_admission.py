"""Submissions are checked field by field before they enter the router's pool (found by
tests/fuzz: empty request ids were served, out-of-vocabulary prompts reached the drafters and the
verifier, and refusals named no field)."""

from __future__ import annotations

import asyncio

import pytest

from common.spec.types import SamplingParams
from services.router.admission import SubmitLimits, check_submission
from services.router.core import RequestFailed, RouterCore
from services.router.inprocess import LocalDrafterPool
from services.router.settings import RouterSettings

LIMITS = SubmitLimits(vocab_size=100, max_context=32)
GOOD = dict(
    request_id="req-1.a:b_c",
    prompt=[1, 2, 3],
    max_new_tokens=4,
    sampling=SamplingParams(),
    stop_ids=[99],
    domain_hint="code",
)


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(request_id=""), "request_id"),
        (dict(request_id="a" * 129), "request_id"),
        (dict(request_id="a b"), "request_id"),
        (dict(request_id="é"), "request_id"),
        (dict(prompt=[]), "prompt_ids"),
        (dict(prompt=[1, 100]), "prompt_ids"),
        (dict(prompt=[-1]), "prompt_ids"),
        (dict(prompt=[1] * 32), "prompt_ids"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=30), "max_new_tokens"),
        (dict(max_new_tokens=2**32 - 1), "max_new_tokens"),
        (dict(sampling=SamplingParams(temperature=float("nan"))), "sampling.temperature"),
        (dict(sampling=SamplingParams(temperature=float("inf"))), "sampling.temperature"),
        (dict(sampling=SamplingParams(temperature=-1.0)), "sampling.temperature"),
        (dict(sampling=SamplingParams(top_p=float("nan"))), "sampling.top_p"),
        (dict(sampling=SamplingParams(top_p=1.5)), "sampling.top_p"),
        (dict(sampling=SamplingParams(presence_penalty=2.5)), "sampling.presence_penalty"),
        (dict(sampling=SamplingParams(presence_penalty=float("nan"))), "sampling.presence_penalty"),
        (dict(sampling=SamplingParams(frequency_penalty=-2.01)), "sampling.frequency_penalty"),
        (dict(sampling=SamplingParams(repetition_penalty=0.0)), "sampling.repetition_penalty"),
        (dict(sampling=SamplingParams(repetition_penalty=-1.0)), "sampling.repetition_penalty"),
        (dict(sampling=SamplingParams(repetition_penalty=float("inf"))), "sampling.repetition_penalty"),
        (dict(prompt_len=4), "prompt_len"),
        (dict(stop_ids=[100]), "stop_token_ids"),
        (dict(domain_hint="x" * 65), "domain_hint"),
        (dict(domain_hint="a|b"), "domain_hint"),
    ],
)
def test_each_bad_field_is_refused_by_name(change, field):
    args = {**GOOD, **change}
    with pytest.raises(RequestFailed) as info:
        check_submission(**args, limits=LIMITS)
    assert info.value.kind == "invalid"
    assert str(info.value).startswith(f"{field}: "), str(info.value)


def test_valid_submissions_pass_and_limits_are_optional():
    check_submission(**GOOD, limits=LIMITS)
    check_submission(**{**GOOD, "prompt": [1, 10_000], "stop_ids": [-5]}, limits=None)  # no verifier limits known


def test_a_refused_submission_never_enters_the_pool():
    async def body():
        core = RouterCore(RouterSettings(), LocalDrafterPool({}), verifier=None, limits=LIMITS)
        with pytest.raises(RequestFailed):
            core.submit("r", [1, 500], 4, SamplingParams())
        assert core.requests == {}
        core.submit("r", [1, 2], 4, SamplingParams())
        with pytest.raises(RequestFailed) as dup:
            core.submit("r", [1, 2], 4, SamplingParams())
        assert dup.value.kind == "already_exists" and str(dup.value).startswith("request_id: ")

    asyncio.run(body())
