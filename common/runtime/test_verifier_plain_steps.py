"""Plain steps (``VerifyItem.plain_steps``): the verifier decodes further tokens before answering,
and they are exactly the tokens one round per token would have committed."""

from __future__ import annotations

from pathlib import Path

from common.runtime.step_lookups import StepChain, chain_outcomes, held_depth
from common.runtime.test_verifier_engine import PROMPT, engine, greedy_continuation, hf  # noqa: F401 (fixtures)
from common.runtime.verifier_engine import VerifierEngine
from common.spec.lookup_corpus import DomainCorpora
from common.spec.lookup_index import CORPUS, TEXT
from common.spec.types import SamplingParams, StepLookup, TokenTree, VerifyItem


def test_steps_after_a_tree_verdict_continue_the_targets_greedy_decode(engine: VerifierEngine, hf) -> None:
    right = greedy_continuation(hf, PROMPT, 12)
    tree = TokenTree(tokens=(right[0], right[1], (right[2] + 1) % 512), parents=(-1, 0, 1))  # third node wrong
    [v] = engine.verify([VerifyItem("a", append_ids=PROMPT, tree=tree, plain_steps=5)]).verdicts
    assert v.accepted_tokens == tuple(right[:2]) and v.next_token == right[2]
    assert v.plain_tokens == tuple(right[3:7])
    assert v.new_tokens == tuple(right[:7]) and v.committed_len == len(PROMPT) + 7
    assert engine.cache_len("a") == v.committed_len - 1  # the cache invariant holds after the steps
    # the next round goes on from there
    [w] = engine.verify([VerifyItem("a", tree=TokenTree.chain(right[7:9]))]).verdicts
    assert w.accepted_tokens == tuple(right[7:9]) and w.next_token == right[9]


def test_requests_of_a_batch_step_as_far_as_each_asks(engine: VerifierEngine, hf) -> None:
    prompts = {"one": PROMPT, "three": (7, 7, 1), "six": (100, 200, 300, 400)}
    steps = {"one": 1, "three": 3, "six": 6}
    out = engine.verify([VerifyItem(r, append_ids=p, plain_steps=steps[r]) for r, p in prompts.items()])
    for v in out.verdicts:
        assert v.ok and v.new_tokens == tuple(greedy_continuation(hf, prompts[v.request_id], steps[v.request_id]))
    assert (
        out.batch_tokens == sum(map(len, prompts.values())) + 2 + 5
    )  # the prompts' pass, then 2 + 1 + 1 + 1 + 1 step rows


def test_a_seeded_sampled_request_steps_to_the_tokens_of_one_round_per_token(engine: VerifierEngine) -> None:
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    [stepped] = engine.verify([VerifyItem("stepped", append_ids=PROMPT, sampling=sampling, plain_steps=8)]).verdicts
    tokens = list(engine.verify([VerifyItem("rounds", append_ids=PROMPT, sampling=sampling)]).verdicts[0].new_tokens)
    for _ in range(7):
        tokens += engine.verify([VerifyItem("rounds", sampling=sampling)]).verdicts[0].new_tokens
    assert stepped.new_tokens == tuple(tokens)
    assert len(set(tokens)) > 1  # a sampled run, not one token over and over


def test_steps_stop_at_a_stop_id_and_at_the_context(engine: VerifierEngine, hf) -> None:
    right = greedy_continuation(hf, PROMPT, 6)
    stop = right[2]
    [v] = engine.verify([VerifyItem("a", append_ids=PROMPT, plain_steps=6, stop_ids=(stop,))]).verdicts
    assert v.new_tokens == tuple(right[: right.index(stop) + 1])
    max_context = engine.model_info().max_context
    [c] = engine.verify([VerifyItem("c", append_ids=(1,) * (max_context - 3), plain_steps=10)]).verdicts
    assert c.ok and c.committed_len == max_context and len(c.new_tokens) == 3


def test_a_full_kv_budget_ends_the_steps_not_the_verdict(llama_target: Path) -> None:
    engine = VerifierEngine.from_checkpoint(llama_target, attention_backend="sdpa", kv_token_budget=48)
    [v] = engine.verify([VerifyItem("a", append_ids=tuple(range(40)), plain_steps=20)]).verdicts
    assert v.ok and 1 < len(v.new_tokens) < 20
    assert engine.cache_len("a") == v.committed_len - 1 and engine.kv_reserved_tokens <= 48


def test_plain_steps_below_one_are_refused(engine: VerifierEngine) -> None:
    [v] = engine.verify([VerifyItem("a", append_ids=PROMPT, plain_steps=0)]).verdicts
    assert v.error.startswith("plain_steps: ") and v.error_kind == "invalid"


# the test target's greedy text from PROMPT repeats itself here and there ("13, 4" comes back six
# times in its first 60 tokens), so a long run of steps finds chains in its own text to accept
LONG = 40
LOOKUP = (2, 2, 2, 2)


def test_steps_that_draft_from_the_request_s_text_commit_the_target_s_greedy_tokens_in_fewer_passes(
    engine: VerifierEngine, hf
) -> None:
    [v] = engine.verify([VerifyItem("a", append_ids=PROMPT, plain_steps=LONG, step_lookup=LOOKUP)]).verdicts
    assert v.ok and v.new_tokens == tuple(greedy_continuation(hf, PROMPT, len(v.new_tokens)))
    assert v.step_accepted > 0 and v.step_drafted > v.step_accepted  # some chains right, some wrong
    assert v.step_passes == LONG - 1 and len(v.plain_tokens) == v.step_passes + v.step_accepted
    assert engine.cache_len("a") == v.committed_len - 1  # the cache invariant holds after the chains
    # the same request without the verifier's lookup: one token a step, the same tokens
    [plain] = engine.verify([VerifyItem("b", append_ids=PROMPT, plain_steps=1 + len(v.plain_tokens))]).verdicts
    assert plain.new_tokens == v.new_tokens and plain.step_drafted == 0 and plain.step_passes == len(v.plain_tokens)


def test_a_step_drafts_only_after_a_match_its_depths_pay_for(engine: VerifierEngine, hf) -> None:
    [v] = engine.verify([VerifyItem("a", append_ids=PROMPT, plain_steps=LONG, step_lookup=(0, 0, 0, 0))]).verdicts
    assert v.step_drafted == 0 and len(v.plain_tokens) == LONG - 1
    [w] = engine.verify([VerifyItem("w", append_ids=PROMPT, plain_steps=LONG, step_lookup=(1,))]).verdicts
    assert 0 < w.step_drafted <= w.step_passes  # one token after a one-token match, none after nothing
    assert w.new_tokens == tuple(greedy_continuation(hf, PROMPT, len(w.new_tokens)))


def test_step_drafts_never_carry_a_request_past_max_tokens_or_its_stop_ids(engine: VerifierEngine, hf) -> None:
    right = greedy_continuation(hf, PROMPT, LONG + 10)
    [v] = engine.verify(
        [VerifyItem("a", append_ids=PROMPT, plain_steps=LONG, step_lookup=LOOKUP, max_tokens=LONG - 9)]
    ).verdicts
    assert v.new_tokens == tuple(right[: LONG - 9]) and v.step_accepted > 0
    stop = right[LONG - 10]
    [s] = engine.verify(
        [VerifyItem("s", append_ids=PROMPT, plain_steps=LONG, step_lookup=LOOKUP, stop_ids=(stop,))]
    ).verdicts
    assert s.new_tokens == tuple(right[: right.index(stop) + 1])


def test_merged_chains_share_their_common_prefix_and_branch_where_they_differ() -> None:
    tree = TokenTree.merged([[5, 6, 7], [5, 6, 9, 1], [], [8]])
    assert tree.tokens == (5, 6, 7, 9, 1, 8) and tree.parents == (-1, 0, 1, 1, 3, -1)
    assert TokenTree.merged([[4, 4]]) == TokenTree.chain([4, 4]) and len(TokenTree.merged([])) == 0
    assert TokenTree.merged([[5, 6, 7], [5, 6, 9, 1], [8]], limit=4) == TokenTree((5, 6, 7, 9), (-1, 0, 1, 1))


def test_steps_draft_from_the_verifier_s_lookup_corpus_in_the_request_s_domain(engine: VerifierEngine, hf) -> None:
    right = greedy_continuation(hf, PROMPT, LONG + 5)
    wrong = [right[0], *((t + 1) % 512 for t in right[1:])]  # another domain's text after the same start
    engine.corpus = DomainCorpora.build({"mine": [[*PROMPT, *right]], "other": [[*PROMPT, *wrong]]})
    corpus = (0, 4, 4, 4, 4, 4, 4, 4)
    [v] = engine.verify([VerifyItem("a", append_ids=PROMPT, plain_steps=8, step_corpus=corpus, domain="mine")]).verdicts
    assert v.new_tokens == tuple(right[: len(v.new_tokens)])
    assert v.step_passes == 7 and v.step_accepted == v.step_drafted == 7 * 4  # every chain right: 5 tokens a step
    # what the router's lookup calibration learns: every corpus chain tried and accepted whole
    assert len(v.step_lookups) == 7 and all(
        s.source == CORPUS and s.tried == s.accepted == 4 and s.match >= 2 for s in v.step_lookups
    )
    [w] = engine.verify(
        [VerifyItem("w", append_ids=PROMPT, plain_steps=8, step_corpus=corpus, domain="other")]
    ).verdicts
    assert (
        w.new_tokens == tuple(right[:8]) and w.step_accepted == 0 < w.step_drafted
    )  # the other domain's chains all wrong
    assert w.step_lookups and all(
        s.tried == 1 and s.accepted == 0 for s in w.step_lookups
    )  # each first token tried, rejected
    # the text's own chains and the corpus's together: siblings where they differ, the output the target's
    [x] = engine.verify(
        [VerifyItem("x", append_ids=PROMPT, plain_steps=LONG, step_lookup=LOOKUP, step_corpus=corpus, domain="other")]
    ).verdicts
    assert x.new_tokens == tuple(right[: len(x.new_tokens)]) and x.step_accepted > 0
    assert x.step_drafted <= 4 * x.step_passes  # a step's tree no larger than its deeper chain
    assert engine.cache_len("x") == x.committed_len - 1
    # each chain reports the tokens it had accepted; the steps' accepted tokens are the deeper chain's each step
    assert {s.source for s in x.step_lookups} == {CORPUS, TEXT}
    assert sum(s.accepted for s in x.step_lookups) >= x.step_accepted > 0


def test_a_step_s_chains_report_how_far_each_was_tried_and_accepted() -> None:
    tree = TokenTree.merged([[5, 6, 7], [5, 6, 9, 1]], limit=4)  # the second chain held as far as 5, 6, 9
    chains = tuple(
        StepChain(src, 3, chain[: held_depth(tree, chain)])
        for src, chain in ((CORPUS, [5, 6, 7]), (TEXT, [5, 6, 9, 1]))
    )
    assert [c.tokens for c in chains] == [[5, 6, 7], [5, 6, 9]]
    assert chain_outcomes(chains, [5, 6, 9]) == (StepLookup(CORPUS, 3, 3, 2), StepLookup(TEXT, 3, 3, 3))
    assert chain_outcomes(chains, [5]) == (
        StepLookup(CORPUS, 3, 2, 1),
        StepLookup(TEXT, 3, 2, 1),
    )  # both second tokens tried, wrong
    assert chain_outcomes(chains, []) == (StepLookup(CORPUS, 3, 1, 0), StepLookup(TEXT, 3, 1, 0))
    assert chain_outcomes((StepChain(TEXT, 2, []),), [4]) == ()
