"""Acceptance rules on synthetic logits: the greedy walk, and the exact output distribution of
speculative sampling over a tree (joint distribution of the first two committed tokens)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from common.spec.acceptance import (
    NUCLEUS_TRIES,
    Decision,
    GreedyRule,
    SamplingRule,
    default_rule_factory,
    nucleus,
    sample_index,
    target_probs,
)
from common.spec.types import SamplingParams, TokenTree
from tests.support.stats import tv_check


def one_hot_logits(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    lg = torch.zeros(len(argmaxes), vocab)
    for i, a in enumerate(argmaxes):
        lg[i, a] = 5.0
    return lg


# roots 3 (node 0) and 4 (node 1); node 2 (token 5) under node 0; nodes 3 (6), 4 (7) under node 2
TREE = TokenTree(tokens=(3, 4, 5, 6, 7), parents=(-1, -1, 0, 2, 2))


def test_greedy_follows_argmax_to_a_leaf_and_adds_the_bonus() -> None:
    # rows: 0 for the roots, 1 + i below node i
    d = GreedyRule().decide(TREE, one_hot_logits([3, 5, 0, 7, 0, 1]), None)
    assert d == Decision((0, 2, 4), 1)
    assert GreedyRule().decide(TREE, one_hot_logits([4, 0, 6, 0, 0, 0]), None) == Decision((1,), 6)


def test_greedy_stops_at_the_first_mismatch_with_a_correction() -> None:
    assert GreedyRule().decide(TREE, one_hot_logits([3, 5, 0, 0, 0, 0]), None) == Decision((0, 2), 0)
    assert GreedyRule().decide(TREE, one_hot_logits([3, 2, 0, 0, 0, 0]), None) == Decision((0,), 2)
    assert GreedyRule().decide(TREE, one_hot_logits([1, 0, 5, 0, 0, 0]), None) == Decision((), 1)


def test_greedy_on_an_empty_tree_is_a_decode_step() -> None:
    assert GreedyRule().decide(TokenTree(), one_hot_logits([6]), None) == Decision((), 6)


def test_greedy_takes_the_first_of_duplicate_siblings() -> None:
    tree = TokenTree(tokens=(2, 2, 1), parents=(-1, -1, 1))
    assert GreedyRule().decide(tree, one_hot_logits([2, 7, 1, 0]), None) == Decision((0,), 7)


def test_rule_factory() -> None:
    assert isinstance(default_rule_factory(SamplingParams()), GreedyRule)
    assert isinstance(default_rule_factory(SamplingParams(temperature=0.5)), SamplingRule)


def test_target_probs_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05]))
    p = target_probs(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(p, torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05], dtype=torch.float64))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([0, 4 / 7, 3 / 7, 0, 0], dtype=torch.float64))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))  # 0.4 + 0.3 < 0.75: keep 0.2 too
    torch.testing.assert_close(p, torch.tensor([0, 4 / 9, 3 / 9, 2 / 9, 0], dtype=torch.float64))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.1))  # at least one token
    torch.testing.assert_close(p, torch.tensor([0, 1.0, 0, 0, 0], dtype=torch.float64))
    hot = target_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(hot, torch.softmax(logits.double() / 0.5, -1))


def sorted_nucleus(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by its definition: sort the whole vocabulary, keep the prefix whose mass before each
    token is below ``top_p`` (at least one), renormalise."""
    top, order = torch.sort(p, descending=True)
    keep = max(1, int(((torch.cumsum(top, -1) - top) < top_p).sum()))
    out = torch.zeros_like(p)
    out[order[:keep]] = top[:keep]
    return out / out.sum()


@pytest.mark.parametrize("sharpness", [0.5, 2.0, 6.0, 20.0])
def test_nucleus_is_the_sorted_prefix_whether_found_among_the_top_tokens_or_by_a_full_sort(sharpness) -> None:
    """Real-sized vocabulary; from flat to peaked distributions, so the nucleus is found among the
    first ``NUCLEUS_TRIES[0]`` tokens, the next try, or only by sorting everything."""
    g = torch.Generator().manual_seed(int(sharpness * 10))
    sizes = set()
    for top_p in (0.3, 0.9, 0.95, 0.999):
        for _ in range(3):
            p = torch.softmax(torch.randn(49152, generator=g, dtype=torch.float64) * sharpness, -1)
            got, want = nucleus(p, top_p), sorted_nucleus(p, top_p)
            assert torch.equal(got > 0, want > 0)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
            sizes.add(int((got > 0).sum()))
    if sharpness == 0.5:  # a flat distribution: nuclei beyond every try, found by the full sort
        assert max(sizes) > NUCLEUS_TRIES[-1]
    if sharpness == 20.0:  # a peaked one: within the first try
        assert max(sizes) < NUCLEUS_TRIES[0]


def test_sample_index_draws_each_index_with_its_weight_and_never_a_zero_one() -> None:
    weights = torch.tensor([0.0, 0.1, 0.0, 0.45, 0.05, 0.4, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    counts = Counter(sample_index(weights, g) for _ in range(6000))
    assert not {0, 2, 6} & set(counts)
    exact = {i: float(w) for i, w in enumerate(weights) if w > 0}
    tv, threshold = tv_check(counts, exact, seed=6)
    assert tv <= threshold, (tv, threshold)
    # unnormalised weights, and a single index with weight: always that one
    assert Counter(sample_index(weights * 7, g) for _ in range(200)).keys() <= exact.keys()
    only = torch.zeros(49152, dtype=torch.float64)
    only[-1] = 1e-300
    assert {sample_index(only, g) for _ in range(50)} == {49151}


def exact_outcomes(tree: TokenTree, logits: torch.Tensor, params: SamplingParams) -> dict:
    """Exact law of (first committed token, second committed token when the first was a draft node).

    The first token ~ p_root. When it equals a root's token it was that root's acceptance (a
    rejected root's token is zeroed in the residual), so the second token ~ p_node.
    """
    p0 = target_probs(logits[0], params)
    first_node = {}
    for c in tree.children[-1]:
        first_node.setdefault(tree.tokens[c], c)  # duplicates: the first copy is the one accepted
    out = {}
    for y in range(p0.shape[0]):
        if p0[y] == 0:
            continue
        if y in first_node:
            pz = target_probs(logits[1 + first_node[y]], params)
            for z in range(pz.shape[0]):
                if pz[z] > 0:
                    out[(y, z)] = float(p0[y] * pz[z])
        else:
            out[(y, None)] = float(p0[y])
    return out


def sample_outcomes(rule, tree: TokenTree, logits: torch.Tensor, n: int, seed: int) -> Counter:
    g = torch.Generator().manual_seed(seed)
    counts: Counter = Counter()
    for _ in range(n):
        d = rule.decide(tree, logits, g)
        toks = [tree.tokens[a] for a in d.accepted_nodes] + [d.next_token]
        counts[(toks[0], toks[1]) if d.accepted_nodes else (toks[0], None)] += 1
    return counts


V = 6
# roots: 2 (node 0), 0 (node 1), 2 again (node 2, duplicate), 5 (node 3); node 0 -> {1 (4), 3 (5)}; node 3 -> {5 (6)}
SAMPLING_TREE = TokenTree(tokens=(2, 0, 2, 5, 1, 3, 5), parents=(-1, -1, -1, -1, 0, 0, 3))


def synthetic_logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(SAMPLING_TREE) + 1, V, generator=g) * 1.5


def adversarial_tree(logits: torch.Tensor) -> TokenTree:
    """Roots ordered from least to most likely under the target, plus a duplicate."""
    order = torch.argsort(logits[0]).tolist()
    roots = order[:3] + [order[0]]
    return TokenTree(tokens=(*roots, order[-1], order[-2]), parents=(-1, -1, -1, -1, 0, 1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
    ],
    ids=["t1", "t0.7", "t0.7-k3", "t1-p0.8"],
)
@pytest.mark.parametrize("adversarial", [False, True], ids=["good", "adversarial"])
def test_sampling_rule_is_lossless(params: SamplingParams, adversarial: bool) -> None:
    logits = synthetic_logits(1)
    tree = adversarial_tree(logits) if adversarial else SAMPLING_TREE
    exact = exact_outcomes(tree, logits, params)
    counts = sample_outcomes(SamplingRule(params), tree, logits, n=6000, seed=2)
    tv, threshold = tv_check(counts, exact, seed=3)
    assert tv <= threshold, (tv, threshold)


class AlwaysAcceptFirstChild:
    """A lossy rule (accepts whatever the draft says): the same check must reject it."""

    def decide(self, tree, logits, generator):
        roots = tree.children[-1]
        if not roots:
            return SamplingRule(SamplingParams(temperature=1.0)).decide(tree, logits, generator)
        node = roots[0]
        sub = TokenTree(tokens=(), parents=())
        d = SamplingRule(SamplingParams(temperature=1.0)).decide(sub, logits[1 + node : 2 + node], generator)
        return Decision((node,), d.next_token)


def test_the_check_has_power_against_a_lossy_rule() -> None:
    logits = synthetic_logits(1)
    params = SamplingParams(temperature=1.0)
    counts = sample_outcomes(AlwaysAcceptFirstChild(), SAMPLING_TREE, logits, n=6000, seed=2)
    tv, threshold = tv_check(counts, exact_outcomes(SAMPLING_TREE, logits, params), seed=3)
    assert tv > threshold


def test_sampling_is_reproducible_with_a_seeded_generator() -> None:
    logits = synthetic_logits(4)
    rule = SamplingRule(SamplingParams(temperature=1.0))
    a = [rule.decide(SAMPLING_TREE, logits, g) for g in [torch.Generator().manual_seed(7)] for _ in range(50)]
    b = [rule.decide(SAMPLING_TREE, logits, g) for g in [torch.Generator().manual_seed(7)] for _ in range(50)]
    assert a == b


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300])
def test_a_tiny_temperature_samples_the_argmax_instead_of_failing_on_nan(temperature) -> None:
    """Found by tests/fuzz: logits / 5e-324 overflowed to inf, softmax gave NaN and multinomial
    raised, which broke the verifier's whole stream."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.9], [0.5, 0.1, 0.2, 0.3]])
    p = target_probs(logits[0], SamplingParams(temperature=temperature))
    assert torch.equal(p, torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64))
    rule = SamplingRule(SamplingParams(temperature=temperature))
    assert rule.decide(TokenTree.chain([1]), logits, torch.Generator().manual_seed(0)) == Decision((0,), 0)
    assert rule.decide(TokenTree.chain([2]), logits, torch.Generator().manual_seed(0)) == Decision((), 1)
