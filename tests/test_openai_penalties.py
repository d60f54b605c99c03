"""Penalties and n choices in the OpenAI-compatible HTTP API with the real ``openai`` client (and
the SDK over gRPC) against a local cluster (separate processes, real Redis, the tiny zoo from
disk; the verifier in float32, the dtype the reference is computed in).

Penalties: at temperature 0 the output is token for token the penalised target's own greedy
decode (transformers' ``RepetitionPenaltyLogitsProcessor`` and OpenAI's presence/frequency formula,
argmax step by step), not the plain target's, unary and streamed, completions and chat. n: sampled
choices come back as n valid, different choices with their own index, streamed too; at
temperature 0 all n are the greedy output; usage counts the prompt once."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from cosine_client import Client, InvalidArgument
from tests.support.openai_cluster import KEY

pytestmark = pytest.mark.slow
MAX_NEW = 24
PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3)


def penalised_greedy(target_lm, prompt_ids, n, presence=0.0, frequency=0.0, repetition=1.0) -> list[int]:
    """The penalised target alone: argmax of its penalised logits, step by step."""
    out: list[int] = []
    for _ in range(n):
        ids = torch.tensor([[*prompt_ids, *out]])
        with torch.no_grad():
            logits = target_lm(ids).logits[0, -1:].float()
        if repetition != 1.0:
            logits = RepetitionPenaltyLogitsProcessor(repetition)(ids, logits)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[-1]).float()
        logits = logits[0] - frequency * counts - presence * (counts > 0).float()
        out.append(int(logits.argmax()))
    return out


def as_generated(ids, ref, eos) -> bool:
    """``ids`` (what the float32_cluster returned) is ``ref`` up to where it ended: its length, or an eos."""
    if list(ids) != ref[: len(ids)]:
        return False
    return len(ids) == len(ref) or (ids and ids[-1] in eos) or ref[len(ids)] in eos


def chat_ids(chat_tok, messages) -> list[int]:
    text = chat_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return chat_tok(text, add_special_tokens=False).input_ids


def test_penalties_make_the_output_the_penalised_targets_own(
    float32_cluster, float32_client, zoo_prompts, chat_tok, target_lm
):
    eos = set(chat_tok.all_special_ids)
    prompt = zoo_prompts[0]
    prompt_ids = chat_tok(prompt).input_ids
    plain = penalised_greedy(target_lm, prompt_ids, MAX_NEW)
    ref = penalised_greedy(
        target_lm,
        prompt_ids,
        MAX_NEW,
        PENALTIES["presence_penalty"],
        PENALTIES["frequency_penalty"],
        PENALTIES["repetition_penalty"],
    )
    assert ref != plain  # the penalties change the target's greedy output here (else this proves nothing)
    with Client(float32_cluster.gateway_address, timeout=180, api_key=KEY) as c:
        gen = c.generate(prompt=prompt, max_new_tokens=MAX_NEW, temperature=0, **PENALTIES)
        assert as_generated(gen.token_ids, ref, eos), (list(gen.token_ids), ref)
        streamed = [
            t
            for ch in c.stream(prompt=prompt, max_new_tokens=MAX_NEW, temperature=0, **PENALTIES)
            for t in ch.token_ids
        ]
        assert streamed == list(gen.token_ids)
        with pytest.raises(InvalidArgument) as err:
            c.generate(prompt=prompt, max_new_tokens=4, repetition_penalty=0.0)
        assert "repetition_penalty" in str(err.value)
    text = chat_tok.decode(list(gen.token_ids), skip_special_tokens=True)
    extra = {"repetition_penalty": PENALTIES["repetition_penalty"]}
    openai_penalties = dict(
        presence_penalty=PENALTIES["presence_penalty"], frequency_penalty=PENALTIES["frequency_penalty"]
    )
    reply = float32_client.completions.create(
        model="tiny-target", prompt=prompt, max_tokens=MAX_NEW, temperature=0, extra_body=extra, **openai_penalties
    )
    assert reply.choices[0].text == text and reply.usage.completion_tokens == len(gen.token_ids)
    unpenalised = float32_client.completions.create(
        model="tiny-target", prompt=prompt, max_tokens=MAX_NEW, temperature=0
    )
    assert unpenalised.choices[0].text != text
    chunks = float32_client.completions.create(
        model="tiny-target",
        prompt=prompt,
        max_tokens=MAX_NEW,
        temperature=0,
        extra_body=extra,
        stream=True,
        **openai_penalties,
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text

    messages = [{"role": "user", "content": "Say something again and again."}]
    ids = chat_ids(chat_tok, messages)
    chat_ref = penalised_greedy(target_lm, ids, MAX_NEW, presence=1.5, frequency=1.0)
    reply = float32_client.chat.completions.create(
        model="tiny-target",
        messages=messages,
        max_tokens=MAX_NEW,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=1.0,
    )
    n = reply.usage.completion_tokens
    assert as_generated(chat_ref[:n], chat_ref, eos)
    assert reply.choices[0].message.content == chat_tok.decode(chat_ref[:n], skip_special_tokens=True)
    streamed = float32_client.chat.completions.create(
        model="tiny-target",
        messages=messages,
        max_tokens=MAX_NEW,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        stream=True,
    )
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == reply.choices[0].message.content
    )


def test_n_sampled_choices_each_their_own(float32_client, zoo_prompts):
    """Each choice is a whole generation of its own (its tokens counted by its logprobs), the
    choices differ, and usage counts the prompt once and every choice's tokens."""
    prompt = zoo_prompts[1]
    kw = dict(model="tiny-target", prompt=prompt, max_tokens=MAX_NEW, temperature=0.8, seed=11, logprobs=0)
    single = float32_client.completions.create(**{**kw, "seed": None})
    reply = float32_client.completions.create(n=3, **kw)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.text for c in reply.choices]
    counts = [len(c.logprobs.tokens) for c in reply.choices]
    assert all(texts) and all(c.finish_reason in ("length", "stop") for c in reply.choices)
    assert all(1 <= k <= MAX_NEW for k in counts)
    assert len(set(texts)) > 1  # 24 sampled tokens: equal choices would be a bug, not luck
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    assert reply.usage.completion_tokens == sum(counts)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    chunks = list(float32_client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    streamed, tokens, finished = ["", "", ""], [0, 0, 0], set()
    for ch in chunks:
        for c in ch.choices:
            streamed[c.index] += c.text
            tokens[c.index] += len(c.logprobs.tokens) if c.logprobs else 0
            if c.finish_reason:
                finished.add(c.index)
    assert all(streamed) and len(set(streamed)) > 1 and finished == {0, 1, 2}
    assert chunks[-1].usage.completion_tokens == sum(tokens)
    assert chunks[-1].usage.prompt_tokens == single.usage.prompt_tokens

    unseeded = float32_client.completions.create(n=4, **{**kw, "seed": None})
    assert len({c.text for c in unseeded.choices}) > 1 and [c.index for c in unseeded.choices] == [0, 1, 2, 3]


def test_n_chat_choices_and_greedy_ones(float32_client):
    """At temperature 0 every choice is the one greedy output; sampled, streamed choices differ."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    kw = dict(model="tiny-target", messages=messages, max_tokens=MAX_NEW)
    greedy = float32_client.chat.completions.create(n=3, temperature=0, **kw)
    one = float32_client.chat.completions.create(temperature=0, **kw)
    assert [c.message.content for c in greedy.choices] == [one.choices[0].message.content] * 3
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens

    chunks = list(float32_client.chat.completions.create(n=2, temperature=0.8, seed=5, stream=True, **kw))
    streamed, roles, finished = ["", ""], set(), set()
    for ch in chunks:
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
            if c.finish_reason:
                finished.add(c.index)
    assert roles == {0, 1} and finished == {0, 1} and all(streamed) and streamed[0] != streamed[1]


def test_bad_n_and_penalties_are_400_naming_the_field(float32_client, zoo_prompts):
    cases = [
        (dict(n=0), "n"),
        (dict(n=9), "n"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(extra_body={"repetition_penalty": -1}), "repetition_penalty"),
        (dict(n=2, best_of=3), "best_of"),
    ]
    for kw, field in cases:
        with pytest.raises(openai.BadRequestError) as err:
            float32_client.completions.create(model="tiny-target", prompt=zoo_prompts[0], max_tokens=2, **kw)
        assert err.value.status_code == 400 and err.value.param == field, (kw, err.value.body)
    with pytest.raises(openai.BadRequestError) as err:
        float32_client.chat.completions.create(model="tiny-target", messages=[{"role": "user", "content": "hi"}], n=9)
    assert err.value.param == "n" and "8" in err.value.message
