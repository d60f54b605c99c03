"""Penalties in the verifier: a penalised request's output is exactly the penalised target's.

The reference decodes the target alone with transformers' ``RepetitionPenaltyLogitsProcessor``
and a presence/frequency processor written here (OpenAI's formula), argmax step by step; the
engine must commit the same tokens whatever tree it verifies (trees, plain steps, their lookup
chains), and sampled tokens must follow the penalised distribution.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from common.runtime.test_verifier_engine import hf  # noqa: F401 (fixture)
from common.runtime.verifier_engine import VerifierEngine
from common.spec import penalties
from common.spec.acceptance import target_probs
from common.spec.types import SamplingParams, TokenTree, VerifyItem
from tests.support.stats import tv_check

PROMPT = (5, 9, 5, 9, 5, 9, 33, 5)  # repeats, so a repetition penalty bites at once
PENALTIES = [
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(repetition_penalty=1.3, frequency_penalty=-0.4, presence_penalty=2.0),
]


def presence_frequency(output: list[int], logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """OpenAI's penalties on one row: ``logit -= frequency * count + presence * (count > 0)``."""
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[-1]).float()
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()


def reference_logits(hf, prompt, output: list[int], params: SamplingParams) -> torch.Tensor:
    """The penalised target's logits after ``prompt + output``, by transformers and the formula above."""
    ids = torch.tensor([[*prompt, *output]])
    with torch.no_grad():
        logits = hf(ids).logits[0, -1:].float()
    if params.repetition_penalty != 1.0:
        logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, logits)
    return presence_frequency(output, logits[0], params)


def penalised_greedy(hf, prompt, n: int, params: SamplingParams) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(reference_logits(hf, prompt, out, params).argmax()))
    return out


@pytest.fixture()
def engine(llama_target: Path) -> VerifierEngine:
    return VerifierEngine.from_checkpoint(llama_target, attention_backend="sdpa")


@pytest.mark.parametrize("params", PENALTIES, ids=["repetition", "presence_frequency", "all"])
def test_a_penalty_picks_the_penalised_branch_of_a_tree(engine: VerifierEngine, hf, params: SamplingParams) -> None:
    """The tree holds the plain target's greedy chain and the penalised target's as siblings: a
    request without penalties accepts the first, a penalised one the second, each whole."""
    plain = penalised_greedy(hf, PROMPT, 6, SamplingParams())
    wanted = penalised_greedy(hf, PROMPT, 7, params)
    assert plain != wanted[:6]  # the penalty changes the target's choice (else the test proves nothing)
    tree = TokenTree.merged([plain, wanted[:6]])
    [off, on] = engine.verify(
        [
            VerifyItem("off", append_ids=PROMPT, tree=tree),
            VerifyItem("on", append_ids=PROMPT, tree=tree, sampling=params),
        ]
    ).verdicts
    assert off.new_tokens[:6] == tuple(plain)
    assert on.new_tokens == tuple(wanted)
    assert len(on.accepted_nodes) == 6


@pytest.mark.parametrize("params", PENALTIES, ids=["repetition", "presence_frequency", "all"])
def test_rounds_and_plain_steps_commit_the_penalised_targets_greedy_decode(
    engine: VerifierEngine, hf, params: SamplingParams
) -> None:
    """Several rounds: partly right trees with wrong siblings (the counts come from each node's own
    path), an empty tree with plain steps drafting from the request's own text, then more trees."""
    want = penalised_greedy(hf, PROMPT, 30, params)
    got: list[int] = []

    def round_(tree: TokenTree, **kw) -> None:
        append = PROMPT if not got else ()
        [v] = engine.verify([VerifyItem("r", append_ids=append, tree=tree, sampling=params, **kw)]).verdicts
        assert v.ok, v.error
        got.extend(v.new_tokens)

    round_(TokenTree.chain([PROMPT[0], PROMPT[1]]))  # the plain target's favourites: likely wrong
    for _ in range(3):
        right = want[len(got) : len(got) + 3]
        wrong = [(t + 1) % 512 for t in right]
        round_(TokenTree.merged([[right[0], *wrong[1:]], right[:2], wrong]))
    round_(TokenTree(), plain_steps=6, step_lookup=(0, 1, 2))
    round_(TokenTree.chain(want[len(got) : len(got) + 4]))
    round_(TokenTree(), plain_steps=4)
    assert got == want[: len(got)] and len(got) >= 20


def test_a_resumed_request_counts_its_earlier_output_as_output(engine: VerifierEngine, hf) -> None:
    """``prompt_len``: a request re-prefilled with its prompt and output goes on as it would have."""
    params = SamplingParams(presence_penalty=2.0, frequency_penalty=1.0)
    want = penalised_greedy(hf, PROMPT, 8, params)
    [v] = engine.verify(
        [VerifyItem("r", append_ids=(*PROMPT, *want[:4]), prompt_len=len(PROMPT), sampling=params, plain_steps=4)]
    ).verdicts
    assert v.new_tokens == tuple(want[4:])


def test_requests_without_penalties_compute_nothing_for_them(engine: VerifierEngine, hf, monkeypatch) -> None:
    """No penalty: the rule decides on the raw logits, and no penalty is ever computed."""

    def refuse(*args, **kwargs):
        raise AssertionError("penalties computed for a request without any")

    monkeypatch.setattr(penalties, "penalise", refuse)
    tree = TokenTree.chain(penalised_greedy(hf, PROMPT, 2, SamplingParams()))
    [v] = engine.verify([VerifyItem("a", append_ids=PROMPT, tree=tree, plain_steps=3)]).verdicts
    assert v.ok and v.new_tokens == tuple(penalised_greedy(hf, PROMPT, 5, SamplingParams()))
    [w] = engine.verify([VerifyItem("b", append_ids=PROMPT, sampling=PENALTIES[0])]).verdicts
    assert not w.ok  # and a penalised request does reach it


def exact_law(hf, output: list[int], roots: list[int], params: SamplingParams, penalties: SamplingParams) -> dict:
    """The law of (first token, second token when the first is one of ``roots``) after ``PROMPT +
    output``, under ``params``' sampling and ``penalties``' penalties."""
    p0 = target_probs(reference_logits(hf, PROMPT, output, penalties), params)
    law = {}
    for y in p0.nonzero().flatten().tolist():
        if y in roots:
            pz = target_probs(reference_logits(hf, PROMPT, [*output, y], penalties), params)
            law.update({(y, z): float(p0[y] * pz[z]) for z in pz.nonzero().flatten().tolist()})
        else:
            law[(y, None)] = float(p0[y])
    return {k: v for k, v in law.items() if v > 1e-12}


def repeat_key(outcome: tuple) -> tuple:
    """(first token, whether the second repeats it) after an accepted root; ("miss",) otherwise."""
    y, z = outcome
    return ("miss",) if z is None else (y, z == y)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params,output",
    [
        # an output that repeats two tokens: negative frequency and presence penalties make them
        # likely, the repetition penalty the prompt's tokens unlikely (the output counted as output)
        (
            SamplingParams(temperature=0.8, repetition_penalty=1.5, presence_penalty=-2.0, frequency_penalty=-2.0),
            [77, 77, 77, 77, 140, 140],
        ),
        # no output yet: a repetition penalty below 1 makes a prompt token likely as the root, and
        # whether the next token repeats it is up to the presence and frequency counts of its path
        (SamplingParams(temperature=0.8, repetition_penalty=0.3, presence_penalty=-2.0, frequency_penalty=-2.0), []),
    ],
    ids=["output", "path"],
)
def test_sampled_tokens_follow_the_penalised_targets_law(llama_target: Path, hf, params, output) -> None:
    """Thousands of requests, each prefilled with PROMPT and ``output`` (``prompt_len``: the output
    counts as output), verify a tree holding the penalised target's three likeliest roots and two
    children under the first; the law of (first token, second token when the first was an accepted
    node) must be the penalised target's own, and far from the plain target's; so must the law of
    whether the token after an accepted root repeats it (few outcomes: a sharp test of the path's
    counts)."""
    p0 = target_probs(reference_logits(hf, PROMPT, output, params), params)
    roots = torch.topk(p0, 3).indices.tolist()
    p1 = target_probs(reference_logits(hf, PROMPT, [*output, roots[0]], params), params)
    tree = TokenTree(tokens=(*roots, *torch.topk(p1, 2).indices.tolist()), parents=(-1, -1, -1, 0, 0))
    law = exact_law(hf, output, roots, params, params)
    engine = VerifierEngine.from_checkpoint(llama_target, attention_backend="sdpa", seed=77)
    counts: Counter = Counter()
    accepted = 0
    for start in range(0, 4000, 1000):
        items = [
            VerifyItem(f"q{i}", append_ids=(*PROMPT, *output), prompt_len=len(PROMPT), tree=tree, sampling=params)
            for i in range(start, start + 1000)
        ]
        for v in engine.verify(items).verdicts:
            assert v.ok, v.error
            toks = v.new_tokens
            counts[(toks[0], toks[1]) if v.accepted_nodes else (toks[0], None)] += 1
            accepted += bool(v.accepted_nodes)
            engine.release(v.request_id)
    tv, threshold = tv_check(counts, law, seed=8)
    assert tv <= threshold, (tv, threshold)
    assert accepted > 400  # the drafts were the penalised target's likeliest: many were accepted
    plain = exact_law(hf, output, roots, params, SamplingParams())
    off = 0.5 * sum(abs(law.get(k, 0.0) - plain.get(k, 0.0)) for k in set(law) | set(plain))
    assert off > 3 * threshold, (off, threshold)  # the plain target's law would have failed the check
    repeats, repeats_law = Counter(), Counter()
    for k, c in counts.items():
        repeats[repeat_key(k)] += c
    for k, p in law.items():
        repeats_law[repeat_key(k)] += p
    tv, threshold = tv_check(repeats, repeats_law, seed=9)
    assert tv <= threshold, (tv, threshold, repeats, repeats_law)
