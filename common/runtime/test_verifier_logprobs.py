"""Log-probabilities in the verdict (``VerifyItem.logprobs``): for every committed token (accepted
draft nodes, the correction or bonus token, the plain steps' tokens) they equal transformers'
log_softmax of the target over the same sequence, in float32, whatever the request samples with."""

from __future__ import annotations

import pytest
import torch

from common.runtime.test_verifier_engine import PROMPT, engine, greedy_continuation, hf  # noqa: F401 (fixtures)
from common.runtime.verifier_engine import VerifierEngine
from common.spec.types import SamplingParams, TokenTree, Verdict, VerifyItem

TOL = 1e-4


def reference(hf, prompt, new_tokens) -> torch.Tensor:
    """log_softmax of the target's logits at the positions that chose ``new_tokens``: ``[n, vocab]``."""
    seq = [*prompt, *new_tokens]
    with torch.no_grad():
        logits = hf(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(seq) - 1]


def check(v: Verdict, hf, prompt, top: int) -> None:
    """Every new token has an entry, with the target's figures; the top ``top`` alternatives sorted."""
    assert v.ok, v.error
    new = v.new_tokens
    assert [e.token for e in v.logprobs] == list(new)
    ref = reference(hf, prompt, new)
    for i, (e, row) in enumerate(zip(v.logprobs, ref)):
        assert e.logprob == pytest.approx(float(row[e.token]), abs=TOL), i
        assert len(e.top) == top
        if top:
            values = [lp for _, lp in e.top]
            assert values == sorted(values, reverse=True)
            want = torch.topk(row, top).values.tolist()
            assert values == pytest.approx(want, abs=TOL)
            for t, lp in e.top:
                assert lp == pytest.approx(float(row[t]), abs=TOL)


def test_accepted_path_bonus_and_plain_steps_carry_the_targets_logprobs(engine: VerifierEngine, hf) -> None:
    right = greedy_continuation(hf, PROMPT, 4)
    wrong = (right[1] + 1) % 512
    # accepted path 0 -> 2 -> 3 (a leaf: the next token is the bonus), then three plain steps
    tree = TokenTree(tokens=(right[0], wrong, right[1], right[2], (right[0] + 7) % 512), parents=(-1, 0, 0, 2, -1))
    [v] = engine.verify([VerifyItem("a", append_ids=PROMPT, tree=tree, plain_steps=4, logprobs=5)]).verdicts
    assert v.accepted_nodes == (0, 2, 3) and len(v.plain_tokens) == 3
    check(v, hf, PROMPT, 5)
    # greedy: the chosen token is the most probable one at every position
    assert all(e.top[0][0] == e.token for e in v.logprobs)


def test_a_correction_token_and_a_later_round_from_the_cache(engine: VerifierEngine, hf) -> None:
    right = greedy_continuation(hf, PROMPT, 6)
    tree = TokenTree.chain([right[0], (right[1] + 3) % 512, right[2]])  # the second node is wrong
    [v] = engine.verify([VerifyItem("a", append_ids=PROMPT, tree=tree, logprobs=0)]).verdicts
    assert v.accepted_tokens == (right[0],) and v.next_token == right[1]  # the correction
    check(v, hf, PROMPT, 0)
    committed = PROMPT + v.new_tokens
    [w] = engine.verify([VerifyItem("a", tree=TokenTree.chain(right[2:4]), logprobs=2, plain_steps=2)]).verdicts
    check(w, hf, committed, 2)


def test_steps_that_accept_their_own_lookup_drafts(engine: VerifierEngine, hf) -> None:
    """A prompt that repeats itself: the plain steps draft from its text, and the tokens they accept
    inside a step's pass get the figures of their own rows."""
    loop = greedy_continuation(hf, PROMPT, 10)
    prompt = (*PROMPT, *loop, *PROMPT)
    item = VerifyItem("a", append_ids=prompt, plain_steps=8, step_lookup=(4, 4, 4), logprobs=3)
    [v] = engine.verify([item]).verdicts
    check(v, hf, prompt, 3)


def test_sampled_tokens_get_the_raw_targets_logprobs(engine: VerifierEngine, hf) -> None:
    """Temperature and top-p shape what is drawn, not the figures: they are the model's own."""
    sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=5)
    [v] = engine.verify([VerifyItem("s", append_ids=PROMPT, sampling=sampling, plain_steps=6, logprobs=4)]).verdicts
    check(v, hf, PROMPT, 4)


def test_without_asking_nothing_is_computed_and_out_of_range_is_refused(engine: VerifierEngine) -> None:
    [v] = engine.verify([VerifyItem("a", append_ids=PROMPT, plain_steps=3)]).verdicts
    assert v.ok and v.logprobs == ()
    vocab = engine.runner.vocab_size
    [bad] = engine.verify([VerifyItem("b", append_ids=PROMPT, logprobs=vocab + 1)]).verdicts
    assert bad.error_kind == "invalid" and bad.error.startswith("logprobs:")
