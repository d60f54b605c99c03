"""Fuzzing the OpenAI-compatible HTTP front of the gateway (JSON bodies posted to
/v1/completions and /v1/chat/completions, and bytes that are not JSON at all) against the fuzzed
cluster. A valid body is served whole (unary or as server-sent events ending in [DONE]); anything
else is served or refused with a 400 whose ``param`` names a field of the request (404 only for a
model that is not served). Never a 5xx, never a hang, and no state left anywhere after a case."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .harness import fuzz_targets
from .stack import GATEWAY_LIMITS, FuzzStack

COMPLETION_FIELDS = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "user",
    "echo",
    "best_of",
    "suffix",
    "response_format",
    "structured_outputs",
}
CHAT_FIELDS = (COMPLETION_FIELDS - {"prompt", "echo", "best_of", "suffix"}) | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
}
LIMIT = GATEWAY_LIMITS["max_new_tokens_limit"]


@dataclass
class Reply:
    status: int
    body: bytes


@pytest.fixture(scope="module")
def http(stack: FuzzStack) -> str:
    return f"http://127.0.0.1:{stack.apps['gateway'].http.port}"


@pytest.fixture(scope="module")
def model(stack: FuzzStack) -> str:
    return stack.apps["gateway"].model_name or "target"


def post(base: str, path: str, body: bytes) -> Reply:
    req = urllib.request.Request(base + path, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return Reply(resp.status, resp.read())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.read())


def check(reply: Reply, fields: set[str], body: Any, model: str, stack: FuzzStack) -> None:
    assert reply.status in (200, 400, 404), (reply.status, reply.body[:300])
    if reply.status == 404:
        assert isinstance(body, dict) and body.get("model") != model, reply.body[:300]
        assert json.loads(reply.body)["error"]["param"] == "model"
    elif reply.status == 400:
        error = json.loads(reply.body)["error"]
        assert error["message"], error
        param = error["param"]
        assert param is None or param.split(".")[0] in fields, error  # None: the body as a whole
    else:
        stream = isinstance(body, dict) and body.get("stream") is True
        if stream:
            events = [line[6:] for line in reply.body.decode().splitlines() if line.startswith("data: ")]
            assert events and events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(e) for e in events[:-1]]
            assert not any("error" in c for c in chunks), chunks
            assert [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]], chunks
        else:
            out = json.loads(reply.body)
            assert out["usage"]["completion_tokens"] <= LIMIT * len(out["choices"])  # n choices
            assert [c["index"] for c in out["choices"]] == list(range(len(out["choices"])))
            assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]
    stack.assert_clean()


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def bodies(fields: set[str], model: str, valid: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    """Mostly sensible values for known fields, sometimes anything, sometimes unknown keys."""
    value = {k: st.one_of(v, _json) if k in valid else _json for k, v in {f: valid.get(f) for f in fields}.items()}
    known = st.fixed_dictionaries({}, optional=value)
    extra = st.dictionaries(st.text(max_size=8).filter(lambda k: k not in fields), _json, max_size=2)
    return st.tuples(known, extra, st.sampled_from([model, model, model, "other-model"])).map(
        lambda t: {**t[1], **t[0], "model": t[2]}
    )


def _valid(model: str) -> dict[str, st.SearchStrategy]:
    return {
        "prompt": st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=12),
        "max_tokens": st.integers(1, LIMIT),
        "max_completion_tokens": st.integers(1, LIMIT),
        "temperature": st.sampled_from([0, 0.5, 1.0]),
        "top_p": st.floats(0.01, 1.0),
        "seed": st.integers(0, 2**32),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
        "stream": st.booleans(),
        "response_format": st.sampled_from(
            [
                {"type": "text"},
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
                {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}},
            ]
        ),
        "structured_outputs": st.sampled_from(
            [{"regex": "[a-z]{1,3}"}, {"choice": ["yes", "no"]}, {"regex": "(ab"}, {"grammar": 'start: "x"'}]
        ),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=10)}
            ),
            min_size=1,
            max_size=2,
        ),
    }


@fuzz_targets("http/completions")
@given(data=st.data())
def test_completions_bodies(stack, http, model, fuzz_report, data):
    fuzz_report.case("http/completions")
    body = data.draw(bodies(COMPLETION_FIELDS, model, _valid(model)), label="body")
    reply = post(http, "/v1/completions", json.dumps(body).encode())
    check(reply, COMPLETION_FIELDS, body, model, stack)


@fuzz_targets("http/chat")
@given(data=st.data())
def test_chat_bodies(stack, http, model, fuzz_report, data):
    fuzz_report.case("http/chat")
    body = data.draw(bodies(CHAT_FIELDS, model, _valid(model)), label="body")
    reply = post(http, "/v1/chat/completions", json.dumps(body).encode())
    check(reply, CHAT_FIELDS, body, model, stack)


@fuzz_targets("http/raw-bytes")
@given(raw=st.binary(max_size=64), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_any_bytes(stack, http, model, fuzz_report, raw, path):
    fuzz_report.case("http/raw-bytes")
    reply = post(http, path, raw)
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    fields = COMPLETION_FIELDS if path.endswith("/completions") and "chat" not in path else CHAT_FIELDS
    if body is None:
        assert reply.status == 400, (reply.status, reply.body[:200])
    check(reply, fields, body, model, stack)
