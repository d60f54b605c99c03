"""Structured output through the OpenAI-compatible HTTP API with the real ``openai`` client (and
the SDK over gRPC) against a local cluster (separate processes, real Redis, the tiny zoo from
disk, the verifier in float32, the reference's dtype).

At temperature 0 a constrained response is token for token the constrained greedy decode of the
target alone (transformers under llguidance's matcher, step by step), unary and streamed,
completions and chat: a JSON schema's response parses and validates, a regex's matches, a choice
is one of the choices. A schema the grammar engine cannot compile is a 400 naming the field and
the engine's reason; a grammar that cannot end within ``max_tokens`` ends with ``length``."""

from __future__ import annotations

import json
import re

import openai
import pytest

from common.spec.types import Constraint
from cosine_cli.status_metrics import scrape, total
from cosine_client import Client, InvalidArgument
from tests.support.grammar_reference import Reference
from tests.support.openai_cluster import KEY

pytestmark = pytest.mark.slow
MAX_NEW = 40
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}
PROMPT = "name: Ada Lovelace; born: 1815; city: London\nname:"
REGEX = "[a-z]{1,12}\\."
CHOICES = ["the line", "a string", "lines"]


def expected(target_lm, chat_tok, prompt_ids, constraint: Constraint) -> str:
    """The constrained target alone, greedy, as text (its end of sequence not included)."""
    ids = Reference(target_lm, chat_tok, constraint).greedy(prompt_ids, MAX_NEW)
    assert ids[-1] == chat_tok.eos_token_id  # the grammar ended it within MAX_NEW (else: a length test)
    return chat_tok.decode(ids[:-1])


def valid(answer: dict) -> bool:
    return set(answer) == {"answer", "n"} and answer["answer"] in ("yes", "no") and 0 <= answer["n"] <= 99


def test_a_json_schema_response_is_the_constrained_targets_greedy_decode(float32_client, target_lm, chat_tok):
    want = expected(target_lm, chat_tok, chat_tok(PROMPT).input_ids, Constraint("json_schema", json.dumps(SCHEMA)))
    assert valid(json.loads(want))
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    reply = float32_client.completions.create(
        model="tiny-target", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, extra_body={"response_format": fmt}
    )
    choice = reply.choices[0]
    assert choice.text == want and choice.finish_reason == "stop"
    assert valid(json.loads(choice.text))
    streamed = float32_client.completions.create(
        model="tiny-target",
        prompt=PROMPT,
        max_tokens=MAX_NEW,
        temperature=0,
        stream=True,
        extra_body={"response_format": fmt},
    )
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces if p.choices) == want
    assert [p.choices[0].finish_reason for p in pieces if p.choices and p.choices[0].finish_reason] == ["stop"]


def test_chat_with_a_json_object_response_format(float32_client, target_lm, chat_tok):
    messages = [{"role": "user", "content": "Give me a record as JSON."}]
    text = chat_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = chat_tok(text, add_special_tokens=False).input_ids
    ref = Reference(target_lm, chat_tok, Constraint("json_object")).greedy(prompt_ids, MAX_NEW)
    reply = float32_client.chat.completions.create(
        model="tiny-target",
        messages=messages,
        max_tokens=MAX_NEW,
        temperature=0,
        response_format={"type": "json_object"},
    )
    content = reply.choices[0].message.content
    body = ref[:-1] if ref[-1] == chat_tok.eos_token_id else ref
    assert content == chat_tok.decode(body)
    assert content.startswith("{")
    if ref[-1] == chat_tok.eos_token_id:  # ended inside the budget: a whole JSON object
        assert reply.choices[0].finish_reason == "stop" and isinstance(json.loads(content), dict)
    else:
        assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "field,value,constraint",
    [
        ("structured_outputs", {"regex": REGEX}, Constraint("regex", REGEX)),
        ("structured_outputs", {"choice": CHOICES}, Constraint("choice", json.dumps(CHOICES))),
        ("guided_regex", REGEX, Constraint("regex", REGEX)),
    ],
    ids=["regex", "choice", "guided_regex"],
)
def test_regex_and_choice_extensions(float32_client, target_lm, chat_tok, field, value, constraint):
    want = expected(target_lm, chat_tok, chat_tok(PROMPT).input_ids, constraint)
    reply = float32_client.completions.create(
        model="tiny-target", prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, extra_body={field: value}
    )
    text = reply.choices[0].text
    assert text == want
    if constraint.kind == "regex":
        assert re.fullmatch(REGEX, text)
    else:
        assert text in CHOICES


def test_a_grammar_that_cannot_end_within_max_tokens_ends_at_the_length(float32_client):
    reply = float32_client.completions.create(
        model="tiny-target",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "(ab){40}"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 6
    assert re.fullmatch("(ab)*a?", choice.text)


def test_constraints_that_do_not_compile_are_a_400_naming_the_field(float32_client):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}
    cases = [
        ({"response_format": bad_schema}, "response_format", "frobnicate"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"response_format": {"type": "xml"}}, "response_format", "type must be"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one constraint"),
    ]
    for body, field, reason in cases:
        with pytest.raises(openai.BadRequestError) as err:
            float32_client.completions.create(model="tiny-target", prompt=PROMPT, max_tokens=4, extra_body=body)
        error = err.value.body
        assert error["param"] == field and reason in error["message"], (body, error)


def test_the_sdk_over_grpc_and_the_api_ports_metrics(float32_cluster, target_lm, chat_tok):
    """The SDK's ``json_schema`` gives the same output; the API port's /metrics counts the tokens
    the request's grammar pruned, as its own figures report them."""
    want = expected(target_lm, chat_tok, chat_tok(PROMPT).input_ids, Constraint("json_schema", json.dumps(SCHEMA)))
    api = float32_cluster.http_url.removeprefix("http://")
    name = "cosine_spec_decode_grammar_pruned_tokens_total"
    before = total(scrape(api), name)
    with Client(float32_cluster.gateway_address, timeout=180, api_key=KEY) as c:
        gen = c.generate(prompt=PROMPT, max_new_tokens=MAX_NEW, temperature=0, json_schema=SCHEMA)
        assert gen.text == want and gen.finish_reason == "eos"
        assert total(scrape(api), name) - before == gen.stats.grammar_pruned_tokens
        with pytest.raises(InvalidArgument) as err:
            c.generate(prompt=PROMPT, max_new_tokens=4, regex="a(b")
        assert "constraint" in str(err.value) and "unclosed group" in str(err.value)
