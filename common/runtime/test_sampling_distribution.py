"""Lossless sampling end to end: the verifier's committed tokens follow the target's distribution.

Thousands of requests with the same prompt go through the engine in large batches; the law of
(first committed token, second committed token when the first was an accepted draft node) must
match the exact law computed from the target's own transformers logits.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from common.runtime.checkpoints import load_causal_lm
from common.runtime.verifier_engine import VerifierEngine
from common.spec.acceptance import target_probs
from common.spec.types import SamplingParams, TokenTree, VerifyItem
from tests.support.stats import tv_check

PROMPT = [11, 42, 7, 300, 5, 19]


def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def good_tree(model, params: SamplingParams) -> TokenTree:
    """Roots: the target's three most likely tokens; under the first, its two most likely children."""
    p0 = target_probs(hf_last_logits(model, PROMPT), params)
    roots = torch.topk(p0, 3).indices.tolist()
    p1 = target_probs(hf_last_logits(model, PROMPT + [roots[0]]), params)
    kids = torch.topk(p1, 2).indices.tolist()
    return TokenTree(tokens=(*roots, *kids), parents=(-1, -1, -1, 0, 0))


def adversarial_tree(model, params: SamplingParams) -> TokenTree:
    """Unlikely roots first (one duplicated), the most likely token last, unlikely children."""
    p0 = target_probs(hf_last_logits(model, PROMPT), params)
    order = torch.argsort(p0).tolist()
    roots = [order[0], order[1], order[0], order[-2], order[-1]]
    p1 = target_probs(hf_last_logits(model, PROMPT + [order[-2]]), params)
    return TokenTree(tokens=(*roots, int(torch.argmin(p1))), parents=(-1, -1, -1, -1, -1, 3))


def exact_law(model, tree: TokenTree, params: SamplingParams) -> dict:
    p0 = target_probs(hf_last_logits(model, PROMPT), params)
    root_tokens = {tree.tokens[c] for c in tree.children[-1]}
    law = {}
    for y in p0.nonzero().flatten().tolist():
        if y in root_tokens:
            pz = target_probs(hf_last_logits(model, PROMPT + [y]), params)
            for z in pz.nonzero().flatten().tolist():
                law[(y, z)] = float(p0[y] * pz[z])
        else:
            law[(y, None)] = float(p0[y])
    return {k: v for k, v in law.items() if v > 1e-12}


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("kind", ["good", "adversarial"])
def test_verifier_next_token_law_equals_target(kind: str, temperature: float, llama_target: Path) -> None:
    params = SamplingParams(temperature=temperature)
    model = load_causal_lm(llama_target)
    tree = (good_tree if kind == "good" else adversarial_tree)(model, params)
    engine = VerifierEngine.from_checkpoint(llama_target, attention_backend="sdpa", seed=1234)
    n, chunk = 4000, 1000
    counts: Counter = Counter()
    accepted_any = 0
    for start in range(0, n, chunk):
        items = [
            VerifyItem(f"q{i}", append_ids=tuple(PROMPT), tree=tree, sampling=params)
            for i in range(start, start + chunk)
        ]
        for v in engine.verify(items).verdicts:
            assert v.ok, v.error
            toks = v.new_tokens
            counts[(toks[0], toks[1]) if v.accepted_nodes else (toks[0], None)] += 1
            accepted_any += bool(v.accepted_nodes)
            engine.release(v.request_id)
    tv, threshold = tv_check(counts, exact_law(model, tree, params), seed=5)
    assert tv <= threshold, (tv, threshold)
    if kind == "good":
        assert accepted_any > n // 10  # the drafts were good: many rounds accept a node


def test_seeded_requests_are_reproducible(llama_target: Path) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=99)

    def run() -> list[tuple[int, ...]]:
        engine = VerifierEngine.from_checkpoint(llama_target, attention_backend="sdpa")  # unseeded engine
        out = []
        tree = TokenTree.chain([1, 2, 3])
        v = engine.verify([VerifyItem("r", append_ids=tuple(PROMPT), tree=tree, sampling=params)]).verdicts[0]
        out.append(v.new_tokens)
        for _ in range(10):
            v = engine.verify([VerifyItem("r", tree=tree, sampling=params)]).verdicts[0]
            out.append(v.new_tokens)
        return out

    assert run() == run()


@pytest.mark.slow
def test_a_plain_step_s_own_lookup_chain_keeps_the_target_s_law(llama_target: Path) -> None:
    """A plain step that drafts from the request's text (``VerifyItem.step_lookup``): the prompt is
    PROMPT, a token ``m`` twice, and PROMPT again, so when the first token is ``m`` the step drafts
    what followed ``PROMPT m`` before (``m``, then PROMPT's first token). ``m`` is the token the
    target likes most there. The law of (first token, the step's first token when the step
    drafted) must be the target's own."""
    params = SamplingParams(temperature=0.7)
    model = load_causal_lm(llama_target)
    vocab = model.config.vocab_size
    with torch.no_grad():
        last = model(torch.tensor([PROMPT + [m, m] + PROMPT for m in range(vocab)])).logits[:, -1]
    m = max(range(vocab), key=lambda t: float(target_probs(last[t], params)[t]))
    prompt = PROMPT + [m, m] + PROMPT
    p0 = target_probs(hf_last_logits(model, prompt), params)
    law = {(y, None): float(p) for y, p in enumerate(p0.tolist()) if p > 1e-12 and y != m}
    p1 = target_probs(hf_last_logits(model, prompt + [m]), params)
    law.update({(m, z): float(p0[m] * p) for z, p in enumerate(p1.tolist()) if p0[m] * p > 1e-12})
    engine = VerifierEngine.from_checkpoint(llama_target, attention_backend="sdpa", seed=4321)
    n, chunk = 4000, 1000
    counts: Counter = Counter()
    drafted = accepted = 0
    for start in range(0, n, chunk):
        items = [
            VerifyItem(f"q{i}", append_ids=tuple(prompt), sampling=params, plain_steps=2, step_lookup=(0, 0, 0, 2))
            for i in range(start, start + chunk)
        ]
        for v in engine.verify(items).verdicts:
            assert v.ok, v.error
            toks = v.new_tokens
            counts[(toks[0], toks[1]) if toks[0] == m else (toks[0], None)] += 1
            drafted += v.step_drafted > 0
            accepted += v.step_accepted
            engine.release(v.request_id)
    tv, threshold = tv_check(counts, law, seed=6)
    assert tv <= threshold, (tv, threshold)
    assert drafted > n // 20 and accepted > 0, (drafted, accepted)  # the chains were drafted, and some accepted
