"""Log-probabilities in the OpenAI-compatible HTTP API with the real ``openai`` client against a
local cluster (separate processes, real Redis, the tiny zoo from disk; the verifier in float32):
completions and chat, unary and streamed, give the target's own log-probabilities of the greedy
tokens (transformers' log_softmax of the target within 1e-4), sorted alternatives of the asked
count led by the chosen token, and a 400 naming the field past the limit."""

from __future__ import annotations

import openai
import pytest
import torch

from cosine_client import Client
from tests.support.openai_cluster import KEY
from tests.test_openai_api import MAX_NEW

pytestmark = pytest.mark.slow
TOP = 3


def target_logprobs(target_lm, prompt_ids, new_ids):
    """transformers' log_softmax of the target at the positions that chose ``new_ids``: [n, vocab]."""
    seq = [*prompt_ids, *new_ids]
    with torch.no_grad():
        logits = target_lm(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1 : len(seq) - 1]


def grpc_generation(float32_cluster, **kw):
    with Client(float32_cluster.gateway_address, timeout=120, api_key=KEY) as c:
        return c.generate(max_new_tokens=MAX_NEW, logprobs=TOP, **kw)


def test_completion_logprobs_are_the_targets_own(float32_cluster, float32_client, zoo_prompts, chat_tok, target_lm):
    prompt = zoo_prompts[1]
    gen = grpc_generation(float32_cluster, prompt=prompt)
    ids = list(gen.token_ids)
    ref = target_logprobs(target_lm, chat_tok(prompt).input_ids, ids)
    # the SDK's figures: one per token, the target's, its top alternatives sorted and led by the chosen token
    assert [e.token for e in gen.logprobs] == ids
    for e, row in zip(gen.logprobs, ref, strict=True):
        assert e.logprob == pytest.approx(float(row[e.token]), abs=1e-4)
        assert [t for t, _ in e.top] == row.topk(TOP).indices.tolist() and e.top[0][0] == e.token

    reply = float32_client.completions.create(
        model="tiny-target", prompt=prompt, max_tokens=MAX_NEW, temperature=0, logprobs=TOP
    )
    choice = reply.choices[0]
    lp = choice.logprobs
    assert lp.tokens == [chat_tok.decode([i]) for i in ids] and reply.usage.completion_tokens == len(ids)
    shown = [t for t, i in zip(lp.tokens, ids) if i not in chat_tok.all_special_ids]
    assert "".join(shown) == choice.text
    assert lp.text_offset == [sum(len(t) for t in shown[:k]) for k in range(len(ids))]
    for i, (token_id, row) in enumerate(zip(ids, ref)):
        assert lp.token_logprobs[i] == pytest.approx(float(row[token_id]), abs=1e-4)
        top = lp.top_logprobs[i]
        values = list(top.values())
        assert values == sorted(values, reverse=True)
        want = {}
        for t in row.topk(TOP).indices.tolist():
            want.setdefault(chat_tok.decode([t]), float(row[t]))
        assert list(top) == list(want) and values == pytest.approx(list(want.values()), abs=1e-4)
        assert top[lp.tokens[i]] == lp.token_logprobs[i]  # greedy: the chosen token is among them

    chunks = list(
        float32_client.completions.create(
            model="tiny-target", prompt=prompt, max_tokens=MAX_NEW, temperature=0, logprobs=TOP, stream=True
        )
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    # the same tokens' figures, from passes of other shapes (the streamed request's own rounds):
    # float32 rounding may differ in the last bits, so equal within the reference's bound
    assert [x for s in streamed for x in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert [x for s in streamed for x in s.text_offset] == lp.text_offset
    streamed_top = [x for s in streamed for x in s.top_logprobs]
    assert [list(t) for t in streamed_top] == [list(t) for t in lp.top_logprobs]
    for got, want in zip(streamed_top, lp.top_logprobs, strict=True):
        assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)
    # a chunk carries the logprobs of the tokens it carries: one with text has those of its tokens
    assert all(c.choices[0].logprobs.tokens for c in chunks if c.choices and c.choices[0].text)


def test_chat_logprobs_are_the_targets_own(float32_cluster, float32_client, chat_tok, target_lm):
    messages = [{"role": "user", "content": "Name three colours."}]
    prompt_ids = chat_tok(
        chat_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    ).input_ids
    ids = list(grpc_generation(float32_cluster, prompt_ids=prompt_ids).token_ids)
    ref = target_logprobs(target_lm, prompt_ids, ids)
    reply = float32_client.chat.completions.create(
        model="tiny-target", messages=messages, max_tokens=MAX_NEW, temperature=0, logprobs=True, top_logprobs=TOP
    )
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [chat_tok.decode([i]) for i in ids]
    for c, token_id, row in zip(content, ids, ref, strict=True):
        assert c.logprob == pytest.approx(float(row[token_id]), abs=1e-4)
        assert c.bytes == list(c.token.encode("utf-8"))
        assert len(c.top_logprobs) == TOP
        assert [a.token for a in c.top_logprobs] == [chat_tok.decode([t]) for t in row.topk(TOP).indices.tolist()]
        values = [a.logprob for a in c.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] == c.logprob  # greedy: the chosen one leads

    chunks = list(
        float32_client.chat.completions.create(
            model="tiny-target",
            messages=messages,
            max_tokens=MAX_NEW,
            temperature=0,
            logprobs=True,
            top_logprobs=TOP,
            stream=True,
        )
    )
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert len(streamed) == len(content)
    for s, c in zip(streamed, content):  # as the completions' stream: the figures within the bound
        assert (s.token, s.bytes) == (c.token, c.bytes)
        assert [a.token for a in s.top_logprobs] == [a.token for a in c.top_logprobs]
        assert [s.logprob, *(a.logprob for a in s.top_logprobs)] == pytest.approx(
            [c.logprob, *(a.logprob for a in c.top_logprobs)], abs=1e-4
        )
    # logprobs alone: the chosen tokens' figures, no alternatives; not asked: none at all
    alone = float32_client.chat.completions.create(
        model="tiny-target", messages=messages, max_tokens=4, temperature=0, logprobs=True
    )
    assert alone.choices[0].logprobs.content and all(c.top_logprobs == [] for c in alone.choices[0].logprobs.content)
    plain = float32_client.chat.completions.create(model="tiny-target", messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_logprobs_past_the_limit_are_400_naming_the_field(float32_client, zoo_prompts):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as err:
        float32_client.completions.create(model="tiny-target", prompt=zoo_prompts[0], max_tokens=2, logprobs=21)
    assert err.value.status_code == 400 and err.value.param == "logprobs" and "20" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        float32_client.chat.completions.create(
            model="tiny-target", messages=messages, max_tokens=2, logprobs=True, top_logprobs=21
        )
    assert err.value.param == "top_logprobs" and "20" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        float32_client.chat.completions.create(model="tiny-target", messages=messages, max_tokens=2, top_logprobs=2)
    assert err.value.param == "top_logprobs" and "logprobs" in err.value.message
    assert (
        float32_client.completions.create(model="tiny-target", prompt=zoo_prompts[0], max_tokens=2).choices[0].logprobs
        is None
    )
