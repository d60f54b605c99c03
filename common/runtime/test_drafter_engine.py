"""Drafter engine: candidates equal the model's own distribution; batched steps, rollback without
recomputation, per-item errors and the KV budget."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common.runtime.checkpoints import load_causal_lm
from common.runtime.drafter_engine import DrafterEngine
from common.spec.types import DraftItem, KVBudgetExceeded, UnknownRequest


@pytest.fixture(scope="module")
def hf(llama_near: Path):
    return load_causal_lm(llama_near)


@pytest.fixture()
def engine(llama_near: Path) -> DrafterEngine:
    return DrafterEngine.from_checkpoint(llama_near, attention_backend="sdpa")


def hf_top(hf, ids, n: int) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        p = torch.softmax(hf(torch.tensor([list(ids)])).logits[0, -1].float(), -1)
    vals, idx = torch.topk(p, n)
    return idx.tolist(), vals.tolist()


def assert_candidates(result, hf, ids, n: int = 3) -> None:
    ids_want, probs_want = hf_top(hf, ids, n)
    assert result.ok, result.error
    assert list(result.token_ids) == ids_want
    assert list(result.probs) == pytest.approx(probs_want, abs=1e-5)


def test_batched_step_mixes_prompt_lengths_and_appends(engine: DrafterEngine, hf) -> None:
    prompts = {"a": [5], "b": [1, 2, 3, 4, 5, 6, 7, 8, 9], "c": [100, 200, 300]}
    out = engine.run_step([DraftItem(r, append_ids=tuple(p), top_n=3) for r, p in prompts.items()])
    assert out.batch_tokens == 13
    for r in out.results:
        assert_candidates(r, hf, prompts[r.request_id])
        assert r.cache_len == len(prompts[r.request_id])
    # next step: each appends its best candidate (the fused token); one also appends two more
    extra = {"a": (), "b": (17, 18), "c": ()}
    items = [DraftItem(r.request_id, append_ids=(r.token_ids[0], *extra[r.request_id]), top_n=3) for r in out.results]
    for r, item in zip(out.results, items):
        prompts[r.request_id] += list(item.append_ids)
    out = engine.run_step(items)
    assert out.batch_tokens == 5
    for r in out.results:
        assert_candidates(r, hf, prompts[r.request_id])


def test_rollback_does_not_recompute_the_prefix(engine: DrafterEngine, hf) -> None:
    seq = [9, 8, 7, 6, 5, 4, 3, 2]
    engine.run_step([DraftItem("a", append_ids=tuple(seq), top_n=2)])
    # a verdict committed seq[:5] + [42]: roll back to 5 and append the correction
    out = engine.run_step([DraftItem("a", truncate_to=5, append_ids=(42,), top_n=3)])
    assert out.batch_tokens == 1
    assert out.results[0].cache_len == 6
    assert engine.tokens("a") == (9, 8, 7, 6, 5, 42)
    assert_candidates(out.results[0], hf, [9, 8, 7, 6, 5, 42])


def test_rollback_without_append_reruns_only_the_last_token(engine: DrafterEngine, hf) -> None:
    engine.run_step([DraftItem("a", append_ids=(1, 2, 3, 4, 5, 6), top_n=1)])
    out = engine.run_step([DraftItem("a", truncate_to=4, top_n=3)])
    assert out.batch_tokens == 1 and out.results[0].cache_len == 4
    assert_candidates(out.results[0], hf, [1, 2, 3, 4])


def test_candidates_without_append_reuse_the_last_distribution(engine: DrafterEngine, hf) -> None:
    engine.run_step([DraftItem("a", append_ids=(1, 2, 3))])  # append only
    out = engine.run_step([DraftItem("a", top_n=4), DraftItem("b", append_ids=(4,), top_n=0)])
    assert out.batch_tokens == 1  # only b's token ran
    assert_candidates(out.results[0], hf, [1, 2, 3], 4)
    assert out.results[1].token_ids == () and out.results[1].cache_len == 1
    # a no-op truncation keeps the stored distribution
    out = engine.run_step([DraftItem("a", truncate_to=3, top_n=2)])
    assert out.batch_tokens == 0
    assert_candidates(out.results[0], hf, [1, 2, 3], 2)


def test_issue_level_operations(engine: DrafterEngine, hf) -> None:
    assert engine.prefill("a", [4, 5, 6]) == 3
    assert engine.prefill("b", [7]) == 1
    results = engine.step(["a", "b"], top_n=2)
    assert_candidates(results[0], hf, [4, 5, 6], 2)
    assert_candidates(results[1], hf, [7], 2)
    assert engine.append("a", [results[0].token_ids[0], 11]) == 5
    assert engine.rollback("a", 3) == 3
    assert_candidates(engine.step(["a"], 2)[0], hf, [4, 5, 6], 2)
    assert engine.release("a") and not engine.release("a")
    with pytest.raises(UnknownRequest):
        engine.step(["a"], 2)


def test_bad_items_fail_alone(engine: DrafterEngine) -> None:
    engine.run_step([DraftItem("x", append_ids=(1, 2))])
    out = engine.run_step(
        [
            DraftItem("unknown", top_n=2),
            DraftItem("x", truncate_to=5, top_n=2),
            DraftItem("y", append_ids=(600,), top_n=1),
            DraftItem("z", append_ids=(1,), top_n=2),
            DraftItem("z", top_n=2),
            DraftItem("long", append_ids=tuple([1] * 1025)),
        ]
    ).results
    assert "unknown request" in out[0].error
    assert "cache holds 2" in out[1].error
    assert "outside the vocabulary" in out[2].error
    assert out[3].ok and len(out[3].token_ids) == 2
    assert "appears twice" in out[4].error
    assert "maximum context" in out[5].error
    assert engine.tokens("x") == (1, 2)  # a failed item changes nothing
    assert set(engine._requests) == {"x", "z"}


def test_release_item_and_budget(llama_near: Path) -> None:
    engine = DrafterEngine.from_checkpoint(llama_near, attention_backend="sdpa", kv_token_budget=32)
    assert engine.run_step([DraftItem("a", append_ids=tuple(range(20)))]).results[0].ok
    r = engine.run_step([DraftItem("b", append_ids=tuple(range(20)))]).results[0]
    assert "KV cache budget exceeded" in r.error
    with pytest.raises(KVBudgetExceeded):
        engine.prefill("b", list(range(20)))
    engine.run_step([DraftItem("a", release=True)])
    assert engine.kv_reserved_tokens == 0
    assert engine.prefill("b", list(range(20))) == 20


def test_model_info(engine: DrafterEngine) -> None:
    info = engine.model_info()
    assert info.architecture == "LlamaForCausalLM" and info.vocab_size == 512
    assert info.attention_backend == "sdpa" and len(info.tokenizer_fingerprint) == 16


def test_limits_and_refusals_name_the_field(llama_near: Path) -> None:
    """top_n and chain_len above the service's limits and a truncate_to below -1 are refused
    (they used to be served: a chain as long as the context, or -5 read as "keep"); every refusal
    starts with the field at fault, and a refused first-sight request leaves no cache."""
    engine = DrafterEngine.from_checkpoint(llama_near, attention_backend="sdpa", max_top_n=4, max_chain_len=8)
    engine.run_step([DraftItem("x", append_ids=(1, 2))])
    out = (
        engine.run_step(
            [
                DraftItem("a", append_ids=(1,), top_n=5),
                DraftItem("b", append_ids=(1,), top_n=1, chain_len=9),
                DraftItem("x", truncate_to=-5, top_n=1),
                DraftItem("c", append_ids=(1, -1)),
                DraftItem("d", top_n=1),
                DraftItem("e", truncate_to=2, append_ids=(1,)),
                DraftItem("f", append_ids=(1,) * 1025),
            ]
        ).results
        + engine.run_step([DraftItem("x", truncate_to=0, top_n=1)]).results
    )
    fields = ["top_n", "chain_len", "truncate_to", "append_ids", "request_id", "truncate_to", "append_ids", "top_n"]
    for field, r in zip(fields, out):
        assert r.error.startswith(f"{field}: "), r.error
    assert engine.tokens("x") == (1, 2) and set(engine._requests) == {"x"}
    assert engine.run_step([DraftItem("a", append_ids=(1,), top_n=4)]).results[0].ok


def test_a_prompt_token_outside_the_draft_vocabulary_scores_as_a_uniform_guess(tiny_distilled_zoo) -> None:
    """A reduced-vocabulary drafter cannot propose a token off its map; scoring a prompt that holds
    one stays finite (that token counts -log V), so drafters sharing the map still compare on the
    tokens they can propose, and the rest of the score is the model's own mean log-probability."""
    from common.runtime.checkpoints import read_config

    path = tiny_distilled_zoo.drafters["generalist"].path
    engine = DrafterEngine.from_checkpoint(path, attention_backend="sdpa")
    vocab = engine.runner.draft_vocab
    target_vocab = read_config(tiny_distilled_zoo.target.path)["vocab_size"]
    mapped = set(vocab.to_target.tolist())
    off = next(t for t in range(target_vocab - 1, -1, -1) if t not in mapped)
    on = [int(t) for t in vocab.to_target[:8].tolist()]
    prompt = [*on[:4], off, *on[4:]]
    (res,) = engine.run_step([DraftItem("a", append_ids=tuple(prompt), score_append=True)]).results
    assert res.ok and res.append_logprob is not None and math.isfinite(res.append_logprob)
    hf = load_causal_lm(path)
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=vocab.to_draft[torch.tensor([prompt])]).logits[0].float(), -1)
    terms = [
        float(logp[i, vocab.to_draft[t]]) if t in mapped else -math.log(target_vocab) for i, t in enumerate(prompt[1:])
    ]
    assert res.append_logprob == pytest.approx(sum(terms) / len(terms), abs=1e-4)
