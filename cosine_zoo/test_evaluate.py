"""The acceptance shortcut (one teacher-forced drafter pass) equals real greedy speculative decoding."""

from __future__ import annotations

import pytest
import torch

from common.runtime.checkpoints import load_causal_lm, load_tokenizer
from cosine_zoo import evaluate


@pytest.mark.parametrize(
    ("matches", "k", "rounds", "accepted"),
    [
        ([], 4, 0, 0),
        ([False] * 3, 4, 3, 0),
        ([True] * 10, 4, 2, 8),  # 4 + bonus, 4 + bonus
        ([True] * 4 + [False] + [True] * 2, 4, 2, 6),  # 4 + bonus(=the mismatch slot), then 2 to the end
        ([True, False, True, True, True, True, True], 4, 2, 5),
    ],
)
def test_simulate_rounds(matches, k, rounds, accepted):
    stats = evaluate.simulate_rounds(matches, k)
    assert (stats.rounds, stats.accepted) == (rounds, accepted)


@torch.no_grad()
def reference_speculative(target, drafter, prompt: list[int], new_tokens: int, k: int, eos: int) -> tuple[int, int]:
    """Plain greedy chain drafting: draft k tokens, verify with one target pass, keep the matching prefix."""
    out: list[int] = []
    rounds = accepted = 0
    while len(out) < new_tokens and (not out or out[-1] != eos):
        seq = prompt + out
        draft: list[int] = []
        for _ in range(k):
            draft.append(int(drafter(input_ids=torch.tensor([seq + draft])).logits[0, -1].argmax()))
        preds = target(input_ids=torch.tensor([seq + draft])).logits[0, len(seq) - 1 :].argmax(-1).tolist()
        a = 0
        while a < k and draft[a] == preds[a]:
            a += 1
        emitted = draft[:a] + [preds[a]]
        remaining = new_tokens - len(out)
        if eos in emitted:
            emitted = emitted[: emitted.index(eos) + 1]
        emitted = emitted[:remaining]
        rounds += 1
        accepted += min(a, len(emitted))
        out += emitted
    return rounds, accepted


def test_shortcut_equals_reference_speculative_decoding(tiny_zoo):
    tok = load_tokenizer(tiny_zoo.tokenizer_path)
    target = load_causal_lm(tiny_zoo.target.path)
    prompts = evaluate.encode_prompts(tok, [p for texts in tiny_zoo.prompts.values() for p in texts[:2]])
    conts = [evaluate.greedy_continuations(target, [p], 12, tok.eos_token_id, tok.pad_token_id)[0] for p in prompts]
    for name in ("code", "generalist"):
        drafter = load_causal_lm(tiny_zoo.drafters[name].path)
        matches = evaluate.draft_matches(drafter, prompts, conts, tok.pad_token_id)
        for prompt, m in zip(prompts, matches):
            stats = evaluate.simulate_rounds(m, 4)
            assert (stats.rounds, stats.accepted) == reference_speculative(
                target, drafter, prompt, 12, 4, tok.eos_token_id
            )


def test_perplexity_is_finite_and_above_one(tiny_zoo):
    tok = load_tokenizer(tiny_zoo.tokenizer_path)
    target = load_causal_lm(tiny_zoo.target.path)
    stream = torch.tensor(tok("\n".join(tiny_zoo.prompts["code"])).input_ids)
    ppl = evaluate.perplexity(target, stream, seq_len=16, max_windows=4)
    assert 1.0 < ppl < len(tok)


def test_engine_continuations_equal_generate_and_stop_at_eos(tiny_zoo):
    """The teacher's continuations from the verifier engine are transformers' greedy ones, batch by
    batch (prompts of different lengths, a batch smaller than the prompts), and each stops at its EOS."""
    from common.runtime.verifier_engine import VerifierEngine

    tok = load_tokenizer(tiny_zoo.tokenizer_path)
    target = load_causal_lm(tiny_zoo.target.path)
    engine = VerifierEngine.from_checkpoint(tiny_zoo.target.path, seed=0)
    prompts = evaluate.encode_prompts(tok, [p for texts in tiny_zoo.prompts.values() for p in texts[:2]])
    assert len({len(p) for p in prompts}) > 1
    want = evaluate.greedy_continuations(target, prompts, 12, tok.eos_token_id, tok.pad_token_id, batch_size=3)
    assert evaluate.engine_continuations(engine, prompts, 12, tok.eos_token_id, batch_size=3) == want
    # an EOS that some rows write at once and others never: those leave their batch after the first
    # pass, and the rest go on to the end unchanged
    eos = want[0][0]
    cut = [c[: c.index(eos) + 1] if eos in c else c for c in want]
    assert {len(c) for c in cut} == {1, 12}
    assert evaluate.engine_continuations(engine, prompts, 12, eos, batch_size=3) == cut
    assert engine.active_requests == 0  # every prompt released
