from common.spec.fusion import DraftTree
from common.spec.token_fusion import FusionOutcome, FusionRequest, FusionSource, StepPricing
from common.spec.types import DraftItem, DraftResult, SamplingParams, StepLookup, TokenTree, Verdict, VerifyItem
from cosine.v1 import drafter_pb2, verifier_pb2
from services.convert import (
    draft_items_from_pb,
    draft_result_from_pb,
    draft_result_to_pb,
    draft_step_to_pb,
    fuse_round_from_pb,
    fuse_round_to_pb,
    fusion_outcomes_from_pb,
    fusion_outcomes_to_pb,
    verdict_from_pb,
    verdict_to_pb,
    verify_batch_to_pb,
    verify_items_from_pb,
)


def roundtrip(msg, cls):
    return cls.FromString(msg.SerializeToString())


def test_draft_items_and_results_survive_the_wire():
    items = [
        DraftItem("a", truncate_to=3, append_ids=(1, 2), top_n=4, chain_len=5, score_append=True),
        DraftItem("b", release=True),
    ]
    assert draft_items_from_pb(roundtrip(draft_step_to_pb(7, "code", items), drafter_pb2.DraftStep)) == items
    single = DraftResult("a", (5, 6), (0.5, 0.25), cache_len=9, append_logprob=-1.5)
    back = draft_result_from_pb(roundtrip(draft_result_to_pb(single), drafter_pb2.Candidates))
    assert (back.token_ids, back.probs, back.cache_len, back.append_logprob) == ((5, 6), (0.5, 0.25), 9, -1.5)
    chain = DraftResult("a", (5,), (0.5,), positions=(((5,), (0.5,)), ((7, 8), (0.75, 0.125))))
    back = draft_result_from_pb(roundtrip(draft_result_to_pb(chain), drafter_pb2.Candidates))
    assert back.positions == chain.positions and back.token_ids == (5,)
    failed = draft_result_from_pb(roundtrip(draft_result_to_pb(DraftResult("x", error="boom")), drafter_pb2.Candidates))
    assert not failed.ok and failed.token_ids == ()


def test_verify_items_and_verdicts_survive_the_wire():
    items = [
        VerifyItem(
            "a",
            (1, 2, 3),
            TokenTree((4, 5, 6), (-1, 0, -1), (0.5, 0.25, 0.125), (1, 3, 2), ("x", "y")),
            SamplingParams(0.7, 0.9, 5, 42),
        ),
        VerifyItem("b", tree=TokenTree.chain([9]), sampling=SamplingParams()),
        VerifyItem("c", release=True),
        VerifyItem("d", plain_steps=4, stop_ids=(2, 0)),
        VerifyItem(
            "e",
            plain_steps=4,
            step_lookup=(0, 2, 4, 4),
            step_corpus=(0, 1, 3, 4, 4, 4, 4, 4),
            domain="code",
            max_tokens=11,
        ),
    ]
    assert verify_items_from_pb(roundtrip(verify_batch_to_pb(1, items), verifier_pb2.VerifyBatch)) == items
    v = Verdict("a", (0, 1), (4, 5), 7, (True, True, False), 6, "", "")
    assert verdict_from_pb(roundtrip(verdict_to_pb(v), verifier_pb2.Verdict)) == v
    stepped = Verdict(
        "d",
        next_token=7,
        committed_len=9,
        plain_tokens=(8, 2, 5),
        step_passes=2,
        step_drafted=3,
        step_accepted=1,
        step_lookups=(StepLookup("corpus", 6, 2, 1), StepLookup("text", 2, 1, 0)),
    )
    assert verdict_from_pb(roundtrip(verdict_to_pb(stepped), verifier_pb2.Verdict)) == stepped
    assert stepped.new_tokens == (7, 8, 2, 5)
    bad = Verdict("b", error="too long", error_kind="context")
    assert verdict_from_pb(roundtrip(verdict_to_pb(bad), verifier_pb2.Verdict)) == bad


def test_grouped_draft_steps_survive_the_wire():
    from services.convert import draft_group_results_from_pb, draft_groups_to_pb

    groups = {
        "code": [DraftItem("a", append_ids=(1,), top_n=2)],
        "prose": [DraftItem("a", top_n=1), DraftItem("b", release=True)],
    }
    step = roundtrip(draft_groups_to_pb(3, groups), drafter_pb2.DraftStep)
    assert {g.drafter_id: draft_items_from_pb(g) for g in step.groups} == groups
    reply = drafter_pb2.DraftStepResult(step_id=3)
    reply.groups.add(drafter_id="code", results=[draft_result_to_pb(DraftResult("a", (4, 5), (0.5, 0.25)))])
    reply.groups.add(
        drafter_id="prose",
        results=[draft_result_to_pb(DraftResult("a", error="x")), draft_result_to_pb(DraftResult("b"))],
    )
    back = draft_group_results_from_pb(roundtrip(reply, drafter_pb2.DraftStepResult))
    assert back["code"][0].token_ids == (4, 5) and not back["prose"][0].ok and back["prose"][1].request_id == "b"


def test_only_an_unset_top_p_means_off():
    """Found by tests/fuzz: a NaN or negative top_p was read as 1.0 (off) instead of being refused."""
    import math

    from cosine.v1 import common_pb2
    from services.convert import sampling_from_pb

    assert sampling_from_pb(common_pb2.SamplingParams()).top_p == 1.0
    assert math.isnan(sampling_from_pb(common_pb2.SamplingParams(top_p=float("nan"))).top_p)
    assert sampling_from_pb(common_pb2.SamplingParams(top_p=-0.5)).top_p == -0.5


def test_a_fused_round_and_its_trees_cross_the_wire_unchanged():
    pricing = StepPricing(priced=True, threshold=0.25, calibration=(0.5, 0.75), step_tokens=0.5, row_tokens=0.125)
    requests = [
        FusionRequest(
            "r1",
            3,
            (
                FusionSource("a", 0.5, DraftItem("r1", truncate_to=4, append_ids=(7, 8)), 6),
                FusionSource("b", 0.25, DraftItem("r1", append_ids=(1, 2, 7, 8)), 4),
            ),
        ),
        FusionRequest("r2", 0, ()),
    ]
    step = drafter_pb2.DraftStep.FromString(fuse_round_to_pb(9, 3, pricing, requests).SerializeToString())
    assert step.step_id == 9 and step.HasField("fuse")
    assert fuse_round_from_pb(step.fuse) == (3, pricing, requests)

    tree = DraftTree(drafter_ids=["a", "b"])
    root = tree.add(-1, 5, 0.75, frozenset({"a", "b"}), frozenset({"a"}))
    tree.add(root, 6, 0.5, frozenset({"c"}), frozenset({"b", "c"}))  # "c" joins the tree's drafters
    outcomes = {
        "r1": FusionOutcome(tree, fused=[5, 6], cache_len={"a": 7}, failed={"b": "cache lost"}),
        "r2": FusionOutcome(DraftTree(drafter_ids=[])),
    }
    reply = drafter_pb2.FuseRoundResult.FromString(fusion_outcomes_to_pb(outcomes, [0.5, 0.25]).SerializeToString())
    assert fusion_outcomes_from_pb(reply) == (outcomes, [0.5, 0.25])


def test_the_routers_chunks_reach_the_gateway_as_its_own_types_and_go_out_unchanged():
    from cosine.v1 import common_pb2, router_pb2
    from services.convert import finish_reason_to_pb, spec_stats_to_pb, submit_to_pb, token_chunk_from_pb
    from services.gateway.progress import FinishReason, SpecStats

    pb = router_pb2.TokenChunk(
        request_id="r", token_ids=[4, 5], finished=True, finish_reason=common_pb2.FINISH_REASON_EOS
    )
    pb.stats.CopyFrom(
        common_pb2.SpecStats(
            rounds=3,
            mean_accepted_len=1.5,
            draft_tokens=8,
            accepted_tokens=4,
            drafters_used=["a", "b"],
            accepted_by_drafter={"a": 3, "b": 1},
        )
    )
    chunk = token_chunk_from_pb(roundtrip(pb, router_pb2.TokenChunk))
    assert chunk.token_ids == (4, 5) and chunk.finished and chunk.finish_reason is FinishReason.EOS
    assert chunk.stats == SpecStats(3, 1.5, 8, 4, ("a", "b"), {"a": 3, "b": 1})
    assert spec_stats_to_pb(chunk.stats) == pb.stats
    assert [finish_reason_to_pb(r) for r in FinishReason] == [0, 1, 2, 3, 4]
    assert token_chunk_from_pb(router_pb2.TokenChunk(finish_reason=99)).finish_reason is FinishReason.UNSPECIFIED
    submit = submit_to_pb("r", [1, 2], 5, SamplingParams(0.5, 0.9, 7, seed=3), (2,), "code")
    assert (list(submit.prompt_ids), submit.max_new_tokens, list(submit.stop_token_ids)) == ([1, 2], 5, [2])
    assert submit.domain_hint == "code"
    assert submit.sampling.seed == 3 and submit.sampling.top_k == 7
    assert not submit_to_pb("r", [1], 5, SamplingParams(), (), "").sampling.HasField("seed")


def test_logprobs_asked_and_returned_survive_the_wire():
    """Unset, 0 (the chosen token only) and k stay apart on the wire; the figures (float32) come
    back exactly, the alternatives in their order; and a submission's ask reaches the router."""
    from common.spec.types import NO_LOGPROBS, TokenLogprob
    from cosine.v1 import router_pb2
    from services.convert import submit_logprobs_from_pb, submit_to_pb, token_chunk_from_pb, token_chunk_to_pb

    items = [VerifyItem("a"), VerifyItem("b", logprobs=0), VerifyItem("c", logprobs=5)]
    back = verify_items_from_pb(roundtrip(verify_batch_to_pb(1, items), verifier_pb2.VerifyBatch))
    assert [i.logprobs for i in back] == [NO_LOGPROBS, 0, 5]
    entries = (TokenLogprob(7, -0.5), TokenLogprob(9, -1.25, ((9, -1.25), (3, -2.0))))
    verdict = Verdict("a", next_token=7, plain_tokens=(9,), committed_len=4, logprobs=entries)
    assert verdict_from_pb(roundtrip(verdict_to_pb(verdict), verifier_pb2.Verdict)).logprobs == entries
    chunk = token_chunk_from_pb(roundtrip(token_chunk_to_pb("a", (7, 9), entries, False), router_pb2.TokenChunk))
    assert chunk.token_ids == (7, 9) and chunk.logprobs == entries
    for asked in (NO_LOGPROBS, 0, 3):
        submit = submit_to_pb("a", [1], 4, SamplingParams(), [], "", asked)
        assert submit_logprobs_from_pb(roundtrip(submit, router_pb2.SubmitRequest)) == asked


def test_penalties_and_the_prompts_length_survive_the_wire():
    """Penalties reach the verifier as they were asked; an unset repetition penalty is off (1) but
    a 0 that was set is passed on, so validation refuses it (INVALID_ARGUMENT naming the field)."""
    import pytest

    from common.spec.types import InvalidInput
    from cosine.v1 import common_pb2, router_pb2
    from services.convert import sampling_from_pb, submit_to_pb

    penalised = SamplingParams(temperature=0.5, presence_penalty=-1.5, frequency_penalty=0.25, repetition_penalty=1.3)
    items = [VerifyItem("a", append_ids=(1, 2, 3), sampling=penalised, prompt_len=2), VerifyItem("b")]
    back = verify_items_from_pb(roundtrip(verify_batch_to_pb(1, items), verifier_pb2.VerifyBatch))
    assert back == items
    assert sampling_from_pb(common_pb2.SamplingParams()).repetition_penalty == 1.0
    zero = sampling_from_pb(common_pb2.SamplingParams(repetition_penalty=0.0))
    with pytest.raises(InvalidInput, match=r"^sampling\.repetition_penalty: "):
        zero.validate()
    submit = roundtrip(submit_to_pb("r", [1, 2, 3], 4, penalised, [], "", prompt_len=2), router_pb2.SubmitRequest)
    assert sampling_from_pb(submit.sampling) == penalised and submit.prompt_len == 2


def test_a_constraint_and_the_grammars_pruned_nodes_survive_the_wire():
    """A constraint reaches the router and the verifier as it was asked (none stays none), and the
    verdict's count of nodes the grammar pruned comes back."""
    from common.spec.types import Constraint, Verdict
    from cosine.v1 import router_pb2
    from services.convert import sampling_from_pb, submit_to_pb, verdict_from_pb, verdict_to_pb

    constrained = SamplingParams(constraint=Constraint("json_schema", '{"type": "object"}'))
    items = [VerifyItem("a", append_ids=(1, 2), sampling=constrained), VerifyItem("b", append_ids=(3,))]
    back = verify_items_from_pb(roundtrip(verify_batch_to_pb(1, items), verifier_pb2.VerifyBatch))
    assert back == items and back[1].sampling.constraint is None
    submit = roundtrip(submit_to_pb("r", [1, 2], 4, constrained, [], ""), router_pb2.SubmitRequest)
    assert sampling_from_pb(submit.sampling) == constrained
    v = Verdict("a", next_token=3, grammar_pruned=5)
    assert verdict_from_pb(roundtrip(verdict_to_pb(v), verifier_pb2.Verdict)).grammar_pruned == 5
