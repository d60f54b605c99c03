"""Strategies and oracles for the internal streams: the verifier's VerifyBatch and the drafter's
DraftStep, as scripts of several messages on one stream.

Items mix well-formed requests (a small pool of ids, so later messages continue earlier ones)
with malformed ones: parent indices out of range or pointing forward (cycles), token ids outside
the vocabulary, mismatched array lengths, NaN draft probabilities, duplicate and unknown request
ids, absurd sizes (trees of thousands of nodes, prompts past the context, huge top_n/chain_len).

The oracles are small models of the engines' contracts: for each item, whether it must succeed
or which kinds of refusal are right, and what a success must look like.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hypothesis import strategies as st

from cosine.v1 import common_pb2, drafter_pb2, verifier_pb2

from .harness import check_message_names_field
from .stack import DRAFTER_MAX_CHAIN_LEN, DRAFTER_MAX_TOP_N, DRAFTERS, MAX_CONTEXT, VERIFIER_MAX_TREE_NODES, VOCAB_SIZE
from .strategies import DOUBLE, INT32, TEMPERATURE, TEXT, TOKEN, TOP_P, UINT32, UINT64, mutated

IDS = st.one_of(st.sampled_from(["a", "b", "c"]), st.sampled_from(["", "ü", "a" * 300]), TEXT)
PROMPT = st.lists(TOKEN, min_size=1, max_size=12).map(tuple)
APPEND = st.one_of(
    st.just(()),
    PROMPT,
    st.lists(INT32, min_size=1, max_size=4).map(tuple),
    st.integers(MAX_CONTEXT - 2, MAX_CONTEXT + 2).map(lambda n: (7,) * n),
)


# ---- verifier --------------------------------------------------------------------------------

VERIFY_FIELDS = frozenset(
    {
        "request_id",
        "append_ids",
        "tree",
        "tree.tokens",
        "tree.parents",
        "tree.draft_probs",
        "tree.source_masks",
        "sampling.temperature",
        "sampling.top_p",
        "sampling.top_k",
    }
)


@st.composite
def trees(draw) -> common_pb2.TokenTree:
    n = draw(st.integers(0, 8))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(TOKEN, min_size=n, max_size=n))
    probs = draw(st.one_of(st.just([]), st.lists(st.floats(width=32), min_size=n, max_size=n)))
    masks = draw(st.one_of(st.just([]), st.lists(UINT64, min_size=n, max_size=n)))
    broken = draw(
        st.sampled_from(
            ["none"] * 4 + ["forward", "self", "below", "lengths", "token", "probs", "masks", "huge", "deep"]
        )
    )
    if broken == "forward" and n:
        i = draw(st.integers(0, n - 1))
        parents[i] = draw(st.integers(i + 1, 2**31 - 1))  # a forward reference closes a cycle
    elif broken == "self" and n:
        i = draw(st.integers(0, n - 1))
        parents[i] = i
    elif broken == "below" and n:
        parents[draw(st.integers(0, n - 1))] = draw(st.integers(-(2**31), -2))
    elif broken == "lengths":
        parents = parents + [-1] if draw(st.booleans()) or not n else parents[:-1]
    elif broken == "token" and n:
        tokens[draw(st.integers(0, n - 1))] = draw(
            st.one_of(st.integers(-(2**31), -1), st.integers(VOCAB_SIZE, 2**31 - 1))
        )
    elif broken == "probs":
        probs = probs + [0.5]
    elif broken == "masks":
        masks = masks + [1]
    elif broken == "huge":  # a wide tree past the node limit
        n = draw(st.integers(VERIFIER_MAX_TREE_NODES + 1, 4 * VERIFIER_MAX_TREE_NODES))
        parents, tokens, probs, masks = [-1] * n, [1] * n, [], []
    elif broken == "deep":  # a chain as deep as the context
        n = draw(st.integers(MAX_CONTEXT - 8, MAX_CONTEXT + 8))
        parents, tokens, probs, masks = list(range(-1, n - 1)), [1] * n, [], []
    return common_pb2.TokenTree(
        tokens=tokens,
        parents=parents,
        draft_probs=probs,
        source_masks=masks,
        drafter_ids=draw(st.lists(st.text(max_size=4), max_size=2)),
    )


SAMPLING = st.one_of(
    st.just(common_pb2.SamplingParams()),
    st.builds(common_pb2.SamplingParams, temperature=TEMPERATURE, top_p=TOP_P, top_k=UINT32),
    st.builds(common_pb2.SamplingParams, temperature=DOUBLE, top_p=DOUBLE, top_k=UINT32),
)
VERIFY_ITEM = st.builds(
    verifier_pb2.VerifyItem,
    request_id=IDS,
    append_ids=APPEND,
    tree=trees(),
    sampling=SAMPLING,
    release=st.sampled_from([False] * 5 + [True]),
)
VERIFY_SCRIPT = st.lists(st.lists(VERIFY_ITEM, max_size=5), min_size=1, max_size=4).map(
    lambda batches: [verifier_pb2.VerifyBatch(batch_id=i + 1, items=items) for i, items in enumerate(batches)]
)
_SMALL_VERIFY_ITEM = st.builds(
    verifier_pb2.VerifyItem,
    request_id=IDS,
    append_ids=PROMPT,
    tree=st.builds(
        common_pb2.TokenTree, tokens=st.lists(TOKEN, max_size=4), parents=st.lists(st.integers(-1, 3), max_size=4)
    ),
    sampling=SAMPLING,
    release=st.booleans(),
)
RAW_VERIFY = st.lists(
    mutated(
        st.builds(verifier_pb2.VerifyBatch, batch_id=UINT64, items=st.lists(_SMALL_VERIFY_ITEM, max_size=3)).map(
            lambda b: b.SerializeToString()
        )
    ),
    min_size=1,
    max_size=3,
)


def _tree_problem(tree: common_pb2.TokenTree) -> bool:
    n = len(tree.tokens)
    return (
        n > VERIFIER_MAX_TREE_NODES
        or len(tree.parents) != n
        or any(not -1 <= p < i for i, p in enumerate(tree.parents))
        or any(not 0 <= t < VOCAB_SIZE for t in tree.tokens)
        or (tree.draft_probs and len(tree.draft_probs) != n)
        or (tree.source_masks and len(tree.source_masks) != n)
    )


def _depth(tree: common_pb2.TokenTree) -> int:
    d: list[int] = []
    for p in tree.parents:
        d.append(1 if p < 0 else d[p] + 1)
    return max(d, default=0)


def _sampling_problem(s: common_pb2.SamplingParams) -> bool:
    top_p = s.top_p if s.top_p != 0 else 1.0  # 0 (unset) means off
    return not (0.0 <= s.temperature < math.inf) or not (0.0 <= top_p <= 1.0)


@dataclass
class VerifierModel:
    """Committed length per request id on one stream."""

    committed: dict[str, int] = field(default_factory=dict)

    def check_batch(self, batch: verifier_pb2.VerifyBatch, reply: verifier_pb2.VerifyResult) -> None:
        assert reply.batch_id == batch.batch_id
        assert [v.request_id for v in reply.verdicts] == [i.request_id for i in batch.items], (
            "one verdict per item, in order"
        )
        seen: set[str] = set()
        for item, verdict in zip(batch.items, reply.verdicts):
            self.check_item(item, verdict, item.request_id in seen)
            seen.add(item.request_id)

    def expected_refusal(self, item: verifier_pb2.VerifyItem, repeated: bool) -> str | None:
        if repeated:
            return "invalid"
        if item.release:
            return None
        if (
            _sampling_problem(item.sampling)
            or _tree_problem(item.tree)
            or any(not 0 <= t < VOCAB_SIZE for t in item.append_ids)
        ):
            return "invalid"
        if item.request_id not in self.committed and not item.append_ids:
            return "unknown_request"
        if self.committed.get(item.request_id, 0) + len(item.append_ids) + _depth(item.tree) + 1 > MAX_CONTEXT:
            return "context"
        return None

    def check_item(self, item: verifier_pb2.VerifyItem, verdict: verifier_pb2.Verdict, repeated: bool) -> None:
        expected = self.expected_refusal(item, repeated)
        if expected is not None:
            assert verdict.error and verdict.error_kind == expected, f"expected a refusal of kind {expected}: {verdict}"
            check_message_names_field(verdict.error, VERIFY_FIELDS)
            return
        assert not verdict.error, f"a valid item was refused: {verdict.error_kind}: {verdict.error}"
        if item.release:
            self.committed.pop(item.request_id, None)
            return
        tree, nodes = item.tree, list(verdict.accepted_nodes)
        for k, node in enumerate(nodes):  # a path from a root, each node a child of the one before
            assert 0 <= node < len(tree.tokens) and tree.parents[node] == (nodes[k - 1] if k else -1), verdict
        assert list(verdict.accepted_tokens) == [tree.tokens[a] for a in nodes]
        assert list(verdict.node_accepted) == [i in nodes for i in range(len(tree.tokens))]
        assert 0 <= verdict.next_token < VOCAB_SIZE
        before = self.committed.get(item.request_id, 0)
        assert verdict.committed_len == before + len(item.append_ids) + len(nodes) + 1, (before, item, verdict)
        self.committed[item.request_id] = verdict.committed_len


# ---- drafter ---------------------------------------------------------------------------------

DRAFT_FIELDS = frozenset({"request_id", "truncate_to", "append_ids", "top_n", "chain_len"})

DRAFT_ITEM = st.builds(
    drafter_pb2.DraftItem,
    request_id=IDS,
    truncate_to=st.one_of(st.just(-1), st.integers(-3, 30), INT32),
    append_ids=APPEND,
    top_n=st.one_of(st.integers(0, 3), st.just(DRAFTER_MAX_TOP_N + 1), UINT32),
    release=st.sampled_from([False] * 5 + [True]),
    chain_len=st.one_of(st.integers(0, 4), st.just(DRAFTER_MAX_CHAIN_LEN + 1), UINT32),
    score_append=st.booleans(),
)
DRAFTER_ID = st.one_of(st.sampled_from(DRAFTERS), st.sampled_from(["", "nope"]))


@st.composite
def draft_steps(draw, step_id: int) -> drafter_pb2.DraftStep:
    if draw(st.booleans()):
        return drafter_pb2.DraftStep(
            step_id=step_id, drafter_id=draw(DRAFTER_ID), items=draw(st.lists(DRAFT_ITEM, max_size=4))
        )
    groups = draw(
        st.lists(
            st.builds(drafter_pb2.DraftGroup, drafter_id=DRAFTER_ID, items=st.lists(DRAFT_ITEM, max_size=3)),
            min_size=1,
            max_size=3,
        )
    )
    return drafter_pb2.DraftStep(step_id=step_id, groups=groups)


DRAFT_SCRIPT = st.integers(1, 4).flatmap(lambda n: st.tuples(*(draft_steps(i + 1) for i in range(n)))).map(list)
RAW_DRAFT = st.lists(mutated(draft_steps(1).map(lambda s: s.SerializeToString())), min_size=1, max_size=3)


def step_groups(step: drafter_pb2.DraftStep) -> list[tuple[str, list[drafter_pb2.DraftItem]]]:
    return [(g.drafter_id, list(g.items)) for g in step.groups] or [(step.drafter_id, list(step.items))]


@dataclass
class DrafterModel:
    """Tokens held per (drafter, request id) on one stream."""

    tokens: dict[tuple[str, str], int] = field(default_factory=dict)

    @staticmethod
    def known_drafters(step: drafter_pb2.DraftStep) -> bool:
        return all(d in DRAFTERS for d, _ in step_groups(step))

    def expected_refusal(self, drafter: str, item: drafter_pb2.DraftItem, repeated: bool) -> bool:
        if repeated:
            return True
        if item.release:
            return False
        if (
            item.top_n > DRAFTER_MAX_TOP_N
            or item.chain_len > DRAFTER_MAX_CHAIN_LEN
            or item.truncate_to < -1
            or any(not 0 <= t < VOCAB_SIZE for t in item.append_ids)
        ):
            return True
        held = self.tokens.get((drafter, item.request_id))
        if held is None and (not item.append_ids or item.truncate_to > 0):
            return True
        keep = (held or 0) if item.truncate_to < 0 else item.truncate_to
        return (
            keep > (held or 0)
            or keep + len(item.append_ids) > MAX_CONTEXT
            or (keep == 0 and not item.append_ids and item.top_n > 0)
        )

    def check_step(self, step: drafter_pb2.DraftStep, reply: drafter_pb2.DraftStepResult) -> None:
        assert reply.step_id == step.step_id
        groups = step_groups(step)
        answers = [list(g.results) for g in reply.groups] if step.groups else [list(reply.results)]
        assert len(answers) == len(groups)
        for (drafter, items), results in zip(groups, answers):
            assert [r.request_id for r in results] == [i.request_id for i in items], "one result per item, in order"
            seen: set[str] = set()
            for item, result in zip(items, results):
                refused = self.expected_refusal(drafter, item, item.request_id in seen)
                seen.add(item.request_id)
                key = (drafter, item.request_id)
                if refused:
                    assert result.error, f"expected a refusal: {item} -> {result}"
                    check_message_names_field(result.error, DRAFT_FIELDS)
                    continue
                assert not result.error, f"a valid item was refused: {result.error} ({item})"
                if item.release:
                    self.tokens.pop(key, None)
                    continue
                keep = self.tokens.get(key, 0) if item.truncate_to < 0 else item.truncate_to
                fed = keep + len(item.append_ids)
                assert fed <= result.cache_len <= fed + max(0, item.chain_len - 1), (item, result)
                if item.top_n:
                    assert 1 <= len(result.positions) <= max(1, item.chain_len)
                    assert all(
                        len(p.token_ids) == len(p.probs) == min(item.top_n, VOCAB_SIZE) for p in result.positions
                    )
                    assert all(0 <= t < VOCAB_SIZE for p in result.positions for t in p.token_ids)
                else:
                    assert not result.positions
                self.tokens[key] = result.cache_len
