"""Structured output in the verifier: a constrained request's output is the constrained target's.

The reference decodes the target alone (transformers) with llguidance's matcher driven directly,
step by step: the grammar's mask on the logits, argmax, advance. The engine must commit the same
tokens whatever tree it verifies (forbidden nodes pruned, allowed wrong ones rejected, plain steps
and their lookup chains), and sampled tokens must follow the masked target's distribution.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from common.runtime.checkpoints import load_causal_lm, load_tokenizer
from common.runtime.verifier_engine import VerifierEngine
from common.spec.acceptance import target_probs
from common.spec.types import Constraint, SamplingParams, TokenTree, VerifyItem
from tests.support.grammar_reference import Reference
from tests.support.stats import tv_check

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}
JSON = SamplingParams(constraint=Constraint("json_schema", json.dumps(SCHEMA)))
LIST = SamplingParams(constraint=Constraint("grammar", 'start: "[" item ("," item)~0..3 "]"\nitem: /[0-9]{1,2}/'))
WORD = Constraint("regex", "[a-z]{1,12}\\.")
PROMPT_TEXT = "name: Ada Lovelace; born: 1815; city: London\nname:"


@pytest.fixture(scope="module")
def target(tiny_zoo: Any) -> Path:
    return Path(tiny_zoo.target.path)


@pytest.fixture(scope="module")
def hf(target: Path) -> Any:
    return load_causal_lm(target)


@pytest.fixture(scope="module")
def tok(target: Path) -> Any:
    return load_tokenizer(str(target))


@pytest.fixture(scope="module")
def prompt(tok: Any) -> tuple[int, ...]:
    return tuple(tok.encode(PROMPT_TEXT))


@pytest.fixture()
def engine(target: Path) -> VerifierEngine:
    return VerifierEngine.from_checkpoint(target, attention_backend="sdpa")


def test_a_tree_is_cut_to_what_the_grammar_allows_and_commits_the_constrained_decode(
    engine: VerifierEngine, hf, tok, prompt
) -> None:
    """The tree holds the constrained target's chain, the plain target's chain (forbidden from its
    root), a branch that leaves the grammar under the chain's second node and one that stays in it
    but is not the target's pick: the forbidden nodes are pruned (never verified), the allowed
    wrong one is verified and rejected, and the verdict names nodes of the tree as it was sent."""
    ref = Reference(hf, tok, JSON.constraint)
    want = ref.greedy(prompt, 11)
    with torch.no_grad():
        plain = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt) :].tolist()
    assert not bool(ref.allowed([])[plain[0]])  # else the plain chain proves nothing
    bad = ref.forbidden(want[:2])
    k, wrong = next((k, w) for k in range(1, 10) if (w := ref.wrong(prompt, want[:k])) is not None)
    tree = TokenTree.merged([want[:10], plain, [*want[:2], bad, 5, 6], [*want[:k], wrong]])
    [v] = engine.verify([VerifyItem("r", append_ids=prompt, tree=tree, sampling=JSON)]).verdicts
    assert v.ok, v.error
    assert v.new_tokens == tuple(want)
    assert v.accepted_nodes == tuple(range(10))  # the constrained chain was merged first
    assert not v.node_accepted[-1]  # the wrong one, last merged
    assert v.grammar_pruned == len(plain) + 3
    assert len(v.node_accepted) == len(tree)


@pytest.mark.parametrize("params", [JSON, LIST], ids=["json_schema", "grammar"])
def test_rounds_and_plain_steps_commit_the_constrained_targets_greedy_decode(
    engine: VerifierEngine, hf, tok, prompt, params: SamplingParams
) -> None:
    """Several rounds of partly right trees with forbidden and wrong siblings, then plain steps
    drafting from the request's own text, to the end of the grammar (its end of sequence)."""
    ref = Reference(hf, tok, params.constraint)
    want = ref.greedy(prompt, 40)
    assert want[-1] == tok.eos_token_id  # the grammar ends the output
    got: list[int] = []

    def round_(tree: TokenTree, **kw) -> None:
        append = prompt if not got else ()
        [v] = engine.verify([VerifyItem("r", append_ids=append, tree=tree, sampling=params, **kw)]).verdicts
        assert v.ok, v.error
        got.extend(v.new_tokens)

    round_(TokenTree.chain([223, 223]))  # the plain target's favourite, forbidden at once
    for _ in range(3):
        right = want[len(got) : len(got) + 3]
        wrong = ref.wrong(prompt, [*got, right[0]])
        round_(TokenTree.merged([right[:2], [ref.forbidden(got)], [right[0], *([wrong] if wrong is not None else [])]]))
    round_(TokenTree(), plain_steps=40, step_lookup=(0, 1, 2), stop_ids=(tok.eos_token_id,))
    assert got == want


def test_a_resumed_request_goes_on_in_its_grammar_and_a_foreign_output_is_refused(
    engine: VerifierEngine, hf, tok, prompt
) -> None:
    """``prompt_len``: re-prefilled with its prompt and output, a request goes on where it was in
    its grammar; an output the grammar forbids is refused naming the constraint."""
    want = Reference(hf, tok, JSON.constraint).greedy(prompt, 12)
    [v] = engine.verify(
        [
            VerifyItem(
                "r", append_ids=(*prompt, *want[:5]), prompt_len=len(prompt), sampling=JSON, plain_steps=7, max_tokens=7
            )
        ]
    ).verdicts
    assert v.ok and v.new_tokens == tuple(want[5:12])
    [w] = engine.verify(
        [VerifyItem("f", append_ids=(*prompt, 223, 223), prompt_len=len(prompt), sampling=JSON)]
    ).verdicts
    assert not w.ok and w.error_kind == "invalid" and "constraint" in w.error
    assert "f" not in engine._requests


def test_a_grammar_that_does_not_compile_is_refused_with_the_engines_reason(engine: VerifierEngine, prompt) -> None:
    bad = SamplingParams(constraint=Constraint("json_schema", json.dumps({"type": "frobnicate"})))
    [v, w, ok] = engine.verify(
        [
            VerifyItem("a", append_ids=prompt, sampling=bad),
            VerifyItem("b", append_ids=prompt, sampling=SamplingParams(constraint=Constraint("regex", "a(b"))),
            VerifyItem("c", append_ids=prompt),
        ]
    ).verdicts
    assert v.error_kind == "invalid" and "frobnicate" in v.error
    assert w.error_kind == "invalid" and "unclosed group" in w.error
    assert ok.ok  # the batch's other requests run


def test_unconstrained_requests_never_load_the_grammar_engine(engine: VerifierEngine, prompt) -> None:
    [v] = engine.verify([VerifyItem("a", append_ids=prompt, tree=TokenTree.chain([1, 2]), plain_steps=3)]).verdicts
    assert v.ok and v.grammar_pruned == 0
    assert engine.grammars is not None and engine.grammars._tokenizer is None


@pytest.mark.slow
def test_sampled_tokens_follow_the_constrained_targets_law(target: Path, hf, tok, prompt) -> None:
    """Thousands of requests verify a tree of the constrained target's three likeliest roots (two
    children under the first) and the plain target's favourite root, which the grammar forbids:
    the law of (first token, second token when the first was accepted) must be the masked
    target's, and far from the plain target's."""
    params = SamplingParams(temperature=1.0, constraint=WORD)
    ref = Reference(hf, tok, WORD)
    p0 = target_probs(ref.logits(prompt, []), params)
    roots = torch.topk(p0, 3).indices.tolist()
    p1 = target_probs(ref.logits(prompt, [roots[0]]), params)
    favourite = int(ref.logits(prompt, [], masked=False).argmax())
    assert favourite not in roots and not bool(ref.allowed([])[favourite])
    tree = TokenTree(tokens=(*roots, favourite, *torch.topk(p1, 2).indices.tolist()), parents=(-1, -1, -1, -1, 0, 0))

    def law(masked: bool) -> dict:
        q0 = target_probs(ref.logits(prompt, [], masked), params)
        out = {}
        for y in q0.nonzero().flatten().tolist():
            if y in roots:
                q1 = target_probs(ref.logits(prompt, [y], masked), params)
                out.update({(y, z): float(q0[y] * q1[z]) for z in q1.nonzero().flatten().tolist()})
            else:
                out[(y, None)] = float(q0[y])
        return {k: v for k, v in out.items() if v > 1e-12}

    engine = VerifierEngine.from_checkpoint(target, attention_backend="sdpa", seed=78)
    counts: Counter = Counter()
    accepted = 0
    for start in range(0, 4000, 1000):
        items = [VerifyItem(f"q{i}", append_ids=prompt, tree=tree, sampling=params) for i in range(start, start + 1000)]
        for v in engine.verify(items).verdicts:
            assert v.ok, v.error
            assert v.grammar_pruned == 1
            toks = v.new_tokens
            counts[(toks[0], toks[1]) if v.accepted_nodes else (toks[0], None)] += 1
            accepted += bool(v.accepted_nodes)
            engine.release(v.request_id)
    exact = law(True)
    tv, threshold = tv_check(counts, exact, seed=10)
    assert tv <= threshold, (tv, threshold)
    assert accepted > 400
    plain = law(False)
    off = 0.5 * sum(abs(exact.get(k, 0.0) - plain.get(k, 0.0)) for k in set(exact) | set(plain))
    assert off > 3 * threshold, (off, threshold)


def test_plain_steps_propose_what_the_grammar_forces(engine: VerifierEngine, hf, tok, prompt) -> None:
    """A JSON schema forces its keys and punctuation: plain steps verify them as a proposal, so
    they take fewer passes than tokens, and the output is still the constrained greedy decode."""
    want = Reference(hf, tok, JSON.constraint).greedy(prompt, 40)
    [v] = engine.verify(
        [VerifyItem("r", append_ids=prompt, sampling=JSON, plain_steps=40, stop_ids=(tok.eos_token_id,))]
    ).verdicts
    assert v.ok and list(v.new_tokens) == want
    assert v.step_accepted >= 5 and v.step_passes < len(want) - 5
    assert v.step_lookups == ()  # the forced tokens are not a lookup chain the router calibrates


def test_a_constrained_request_on_the_paged_arena(target: Path, hf, tok, prompt) -> None:
    """The grammar cuts the tree before the cache is reserved: on the arena, pruned nodes take no
    slot and the output is the same constrained decode."""
    engine = VerifierEngine.from_checkpoint(target, attention_backend="sdpa", kv_cache="paged")
    ref = Reference(hf, tok, JSON.constraint)
    want = ref.greedy(prompt, 40)
    tree = TokenTree.merged([want[:4], [223, 223, 223], [*want[:2], ref.forbidden(want[:2])]])
    [v] = engine.verify([VerifyItem("r", append_ids=prompt, tree=tree, sampling=JSON)]).verdicts
    assert v.ok and v.grammar_pruned == 4 and list(v.new_tokens) == want[:5]
    [w] = engine.verify([VerifyItem("r", sampling=JSON, plain_steps=40, stop_ids=(tok.eos_token_id,))]).verdicts
    assert list(v.new_tokens + w.new_tokens) == want
