"""Verifier engine: verdict semantics, the cache invariant after rollback, errors and the budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.runtime.checkpoints import load_causal_lm
from common.runtime.runner import SeqInput
from common.runtime.verifier_engine import VerifierEngine
from common.spec.types import SamplingParams, TokenTree, VerifyItem

PROMPT = (3, 14, 15, 92, 65)


@pytest.fixture(scope="module")
def hf(llama_target: Path):
    return load_causal_lm(llama_target)


@pytest.fixture()
def engine(llama_target: Path) -> VerifierEngine:
    return VerifierEngine.from_checkpoint(llama_target, attention_backend="sdpa")


def greedy_next(hf, ids) -> int:
    with torch.no_grad():
        return int(hf(torch.tensor([list(ids)])).logits[0, -1].argmax())


def greedy_continuation(hf, ids, n: int) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        seq.append(greedy_next(hf, seq))
    return seq[len(ids) :]


def test_first_verdict_on_an_empty_tree_is_a_decode_step(engine: VerifierEngine, hf) -> None:
    [v] = engine.verify([VerifyItem("a", append_ids=PROMPT)]).verdicts
    assert v.ok and v.accepted_nodes == () and v.node_accepted == ()
    assert v.next_token == greedy_next(hf, PROMPT)
    assert v.committed_len == len(PROMPT) + 1
    assert engine.cache_len("a") == len(PROMPT)  # everything but the last committed token
    assert engine.committed("a") == PROMPT + (v.next_token,)


def test_verdict_fields_for_a_partially_right_tree(engine: VerifierEngine, hf) -> None:
    right = greedy_continuation(hf, PROMPT, 4)
    wrong = (right[1] + 1) % 512
    # node 0 right; node 1 (under 0) wrong; node 2 (under 0) right; node 3 (under 2) right; node 4 root wrong
    tree = TokenTree(tokens=(right[0], wrong, right[1], right[2], (right[0] + 7) % 512), parents=(-1, 0, 0, 2, -1))
    out = engine.verify([VerifyItem("a", append_ids=PROMPT, tree=tree)])
    [v] = out.verdicts
    assert v.accepted_nodes == (0, 2, 3)
    assert v.accepted_tokens == tuple(right[:3])
    assert v.next_token == right[3]  # bonus: node 3 is a leaf
    assert v.node_accepted == (True, False, True, True, False)
    assert v.committed_len == len(PROMPT) + 4
    assert engine.cache_len("a") == len(PROMPT) + 3
    assert out.batch_tokens == len(PROMPT) + len(tree)


def test_rollback_keeps_exactly_the_accepted_path(engine: VerifierEngine, hf) -> None:
    """After verdicts that drop rejected siblings, the cache equals a fresh prefill of the committed
    sequence minus its last token, entry for entry (an off-by-one in the kept slots breaks this)."""
    right = greedy_continuation(hf, PROMPT, 8)
    trees = [
        TokenTree(tokens=(9, right[0], 8, right[1], 7), parents=(-1, -1, 1, 1, 3)),  # 2 accepted, siblings dropped
        TokenTree(tokens=(1, 2, 3), parents=(-1, -1, -1)),  # nothing accepted
        TokenTree(),
    ]
    engine.verify([VerifyItem("a", append_ids=PROMPT, tree=trees[0])])
    for t in trees[1:]:
        engine.verify([VerifyItem("a", tree=t)])
    committed = engine.committed("a")
    assert list(committed[len(PROMPT) :]) == right[: len(committed) - len(PROMPT)]
    state = engine._requests["a"]
    fresh = engine.pool.new_cache()
    fresh.reserve(len(committed) - 1)
    engine.runner.forward([SeqInput(fresh, committed[:-1])])
    fresh.commit(len(committed) - 1)
    n = len(committed) - 1
    assert state.cache.length == n
    torch.testing.assert_close(state.cache.k[:, :, :n], fresh.k[:, :, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.cache.v[:, :, :n], fresh.v[:, :, :n], rtol=1e-5, atol=1e-5)


def test_append_ids_after_first_sight_extend_the_committed_sequence(engine: VerifierEngine, hf) -> None:
    [v1] = engine.verify([VerifyItem("a", append_ids=PROMPT)]).verdicts
    [v2] = engine.verify([VerifyItem("a", append_ids=(7, 8))]).verdicts
    seq = PROMPT + (v1.next_token, 7, 8)
    assert v2.next_token == greedy_next(hf, seq)
    assert v2.committed_len == len(seq) + 1


def test_bad_items_fail_alone(engine: VerifierEngine) -> None:
    engine.verify([VerifyItem("dup", append_ids=PROMPT)])
    items = [
        VerifyItem("unknown"),
        VerifyItem("badtree", append_ids=PROMPT, tree=TokenTree(tokens=(1, 2), parents=(-1, 1))),
        VerifyItem("badtok", append_ids=(1, 512)),
        VerifyItem("badsampling", append_ids=PROMPT, sampling=SamplingParams(temperature=1.0, top_p=1.5)),
        VerifyItem("good", append_ids=PROMPT, tree=TokenTree.chain([1, 2])),
        VerifyItem("dup"),
        VerifyItem("dup"),
        VerifyItem("long", append_ids=tuple([1] * 1000), tree=TokenTree.chain([1] * 30)),
    ]
    verdicts = {i: v for i, v in enumerate(engine.verify(items).verdicts)}
    assert "unknown request 'unknown'" in verdicts[0].error
    assert "parent 1 must be -1 or an earlier node" in verdicts[1].error
    assert "outside the vocabulary" in verdicts[2].error
    assert "top_p" in verdicts[3].error
    assert verdicts[4].ok and verdicts[5].ok
    assert "appears twice" in verdicts[6].error
    assert "maximum context of 1024" in verdicts[7].error
    # failed first-sight requests leave nothing behind
    assert set(engine._requests) == {"dup", "good"}


def test_kv_budget_refuses_a_request_and_frees_on_release(llama_target: Path) -> None:
    engine = VerifierEngine.from_checkpoint(llama_target, attention_backend="sdpa", kv_token_budget=64)
    [a] = engine.verify([VerifyItem("a", append_ids=tuple(range(40)))]).verdicts
    assert a.ok
    [b] = engine.verify([VerifyItem("b", append_ids=tuple(range(30)))]).verdicts
    assert "KV cache budget exceeded" in b.error
    assert engine.active_requests == 1
    # the running request can still grow within the budget
    [a2] = engine.verify([VerifyItem("a", tree=TokenTree.chain([1, 2, 3]))]).verdicts
    assert a2.ok
    assert engine.kv_reserved_tokens <= 64
    engine.verify([VerifyItem("a", release=True)])
    assert engine.kv_reserved_tokens == 0 and engine.active_requests == 0
    [b] = engine.verify([VerifyItem("b", append_ids=tuple(range(30)))]).verdicts
    assert b.ok


def test_release(engine: VerifierEngine) -> None:
    engine.verify([VerifyItem("a", append_ids=PROMPT)])
    assert engine.release("a") and not engine.release("a")
    [v] = engine.verify([VerifyItem("a", tree=TokenTree.chain([1]))]).verdicts
    assert "unknown request" in v.error


def test_model_info(engine: VerifierEngine, llama_target: Path) -> None:
    info = engine.model_info()
    assert info.architecture == "LlamaForCausalLM"
    assert info.model_name == str(llama_target)
    assert info.vocab_size == 512 and info.max_context == 1024
    assert info.dtype == "float32" and info.device == "cpu" and info.attention_backend == "sdpa"
    assert len(info.tokenizer_fingerprint) == 16 and info.num_parameters > 0


def test_the_pass_is_timed_by_rows_and_reported_with_the_model(engine: VerifierEngine) -> None:
    from common.runtime.pass_times import measure_pass_times

    assert engine.model_info().pass_times == ()  # not timed unless asked (the service asks at start)
    times = measure_pass_times(engine.runner, rows=(1, 3, 2, 40), context=8, tries=1)
    assert [r for r, _ in times] == [1, 2, 3, 40] and all(s > 0 for _, s in times)
    engine.time_passes()
    assert [r for r, _ in engine.model_info().pass_times][:3] == [1, 2, 3]
    # the timing left no trace: a request's first verdict is as on a fresh engine
    out = engine.verify([VerifyItem("a", append_ids=PROMPT, tree=TokenTree())])
    assert out.verdicts[0].ok and engine.committed("a") == (*PROMPT, out.verdicts[0].next_token)


def test_timings_are_reported(engine: VerifierEngine) -> None:
    out = engine.verify([VerifyItem("a", append_ids=PROMPT, tree=TokenTree.chain([1, 2]))])
    t = out.timings
    assert t.forward_ns > 0 and t.total_ns >= t.prefill_ns + t.forward_ns + t.decode_ns


def test_refusals_name_the_field_and_absurd_trees_are_refused(llama_target: Path) -> None:
    """Every refusal starts with the field at fault; a tree larger than max_tree_nodes is refused
    before any work (its attention mask grows with the square of its nodes), and a refused
    first-sight request leaves no KV cache behind."""
    engine = VerifierEngine.from_checkpoint(llama_target, attention_backend="sdpa", max_tree_nodes=16)
    wide = TokenTree(tokens=(1,) * 17, parents=(-1,) * 17)
    items = [
        VerifyItem("wide", append_ids=PROMPT, tree=wide),
        VerifyItem("cycle", append_ids=PROMPT, tree=TokenTree(tokens=(1, 2), parents=(1, 0))),
        VerifyItem("lengths", append_ids=PROMPT, tree=TokenTree(tokens=(1, 2), parents=(-1,))),
        VerifyItem("token", append_ids=PROMPT, tree=TokenTree(tokens=(1, 600), parents=(-1, 0))),
        VerifyItem("probs", append_ids=PROMPT, tree=TokenTree(tokens=(1,), parents=(-1,), draft_probs=(0.5, 0.5))),
        VerifyItem("temp", append_ids=PROMPT, sampling=SamplingParams(temperature=float("inf"))),
        VerifyItem("unknown"),
        VerifyItem("context", append_ids=(1,) * 1024),
        VerifyItem("deep", append_ids=(1,) * 1016, tree=TokenTree.chain([1] * 16)),
    ]
    fields = [
        "tree",
        "tree.parents[0]",
        "tree.parents",
        "tree.tokens[1]",
        "tree.draft_probs",
        "sampling.temperature",
        "request_id",
        "append_ids",
        "tree",
    ]
    verdicts = engine.verify(items).verdicts
    for field, v in zip(fields, verdicts):
        assert v.error.startswith(f"{field}: "), v.error
    assert [v.error_kind for v in verdicts][-3:] == ["unknown_request", "context", "context"]
    assert engine.active_requests == 0 and engine.kv_reserved_tokens == 0
