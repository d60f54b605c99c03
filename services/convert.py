"""Protobuf <-> domain dataclasses, in one place. Servicers and gRPC clients call these; nothing
past them sees a protobuf message. (Sampling parameters: :mod:`services.convert_sampling`, whose
functions are imported here too.)"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from common.spec.fusion import DraftTree
from common.spec.token_fusion import FusionOutcome, FusionRequest, FusionSource, StepPricing
from common.spec.types import (
    NO_LOGPROBS,
    DraftItem,
    DraftResult,
    ModelInfo,
    SamplingParams,
    StepLookup,
    TokenLogprob,
    TokenTree,
    Verdict,
    VerifyItem,
)
from cosine.v1 import common_pb2, drafter_pb2, router_pb2, verifier_pb2
from services.convert_sampling import sampling_from_pb, sampling_to_pb
from services.gateway.progress import FinishReason, RouterChunk, SpecStats


def tree_to_pb(t: TokenTree) -> common_pb2.TokenTree:
    return common_pb2.TokenTree(
        tokens=t.tokens,
        parents=t.parents,
        draft_probs=t.draft_probs,
        source_masks=t.source_masks,
        drafter_ids=t.drafter_ids,
    )


def tree_from_pb(pb: common_pb2.TokenTree) -> TokenTree:
    return TokenTree(
        tuple(pb.tokens), tuple(pb.parents), tuple(pb.draft_probs), tuple(pb.source_masks), tuple(pb.drafter_ids)
    )


def logprobs_to_pb(entries: Sequence[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            token=e.token,
            logprob=e.logprob,
            top_tokens=[t for t, _ in e.top],
            top_logprobs=[lp for _, lp in e.top],
        )
        for e in entries
    ]


def logprobs_from_pb(entries: Sequence[common_pb2.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(e.token, e.logprob, tuple(zip(e.top_tokens, e.top_logprobs, strict=True))) for e in entries
    )


def model_info_to_pb(info: ModelInfo, model_id: str, domains: Sequence[str] = ()) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_id=model_id,
        model_name=info.model_name,
        architecture=info.architecture,
        vocab_size=info.vocab_size,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        num_parameters=info.num_parameters,
        dtype=info.dtype,
        device=info.device,
        attention_backend=info.attention_backend,
        domains=list(domains),
        max_context=info.max_context,
        pass_rows=[r for r, _ in info.pass_times],
        pass_seconds=[s for _, s in info.pass_times],
    )


# ---- drafter -----------------------------------------------------------------------------------


def draft_items_to_pb(items: Sequence[DraftItem]) -> list[drafter_pb2.DraftItem]:
    return [
        drafter_pb2.DraftItem(
            request_id=i.request_id,
            truncate_to=i.truncate_to,
            append_ids=i.append_ids,
            top_n=i.top_n,
            release=i.release,
            chain_len=i.chain_len,
            score_append=i.score_append,
        )
        for i in items
    ]


def draft_step_to_pb(step_id: int, drafter_id: str, items: Sequence[DraftItem]) -> drafter_pb2.DraftStep:
    return drafter_pb2.DraftStep(step_id=step_id, drafter_id=drafter_id, items=draft_items_to_pb(items))


def draft_groups_to_pb(step_id: int, groups: Mapping[str, Sequence[DraftItem]]) -> drafter_pb2.DraftStep:
    """One message for several drafters hosted by the same process."""
    return drafter_pb2.DraftStep(
        step_id=step_id,
        groups=[drafter_pb2.DraftGroup(drafter_id=d, items=draft_items_to_pb(items)) for d, items in groups.items()],
    )


def draft_group_results_from_pb(reply: drafter_pb2.DraftStepResult) -> dict[str, list[DraftResult]]:
    if not reply.groups:
        return {reply.drafter_id: [draft_result_from_pb(c) for c in reply.results]}
    return {g.drafter_id: [draft_result_from_pb(c) for c in g.results] for g in reply.groups}


def draft_items_from_pb(step: drafter_pb2.DraftStep | drafter_pb2.DraftGroup) -> list[DraftItem]:
    return [
        DraftItem(
            request_id=i.request_id,
            truncate_to=i.truncate_to,
            append_ids=tuple(i.append_ids),
            top_n=i.top_n,
            release=i.release,
            chain_len=i.chain_len,
            score_append=i.score_append,
        )
        for i in step.items
    ]


def draft_result_to_pb(r: DraftResult) -> drafter_pb2.Candidates:
    pb = drafter_pb2.Candidates(request_id=r.request_id, cache_len=r.cache_len, error=r.error)
    for ids, probs in r.positions or ((r.token_ids, r.probs),):
        if ids:
            pb.positions.add(token_ids=ids, probs=probs)
    if r.append_logprob is not None:
        pb.append_logprob = r.append_logprob
    return pb


def draft_result_from_pb(pb: drafter_pb2.Candidates) -> DraftResult:
    positions = tuple((tuple(p.token_ids), tuple(p.probs)) for p in pb.positions)
    first = positions[0] if positions else ((), ())
    return DraftResult(
        request_id=pb.request_id,
        token_ids=first[0],
        probs=first[1],
        cache_len=pb.cache_len,
        error=pb.error,
        positions=positions,
        append_logprob=pb.append_logprob if pb.append_logprob != 0 else None,
    )


# ---- verifier ----------------------------------------------------------------------------------


def verify_batch_to_pb(batch_id: int, items: Sequence[VerifyItem]) -> verifier_pb2.VerifyBatch:
    return verifier_pb2.VerifyBatch(
        batch_id=batch_id,
        items=[
            verifier_pb2.VerifyItem(
                request_id=i.request_id,
                append_ids=i.append_ids,
                tree=tree_to_pb(i.tree),
                sampling=sampling_to_pb(i.sampling),
                release=i.release,
                plain_steps=i.plain_steps,
                stop_ids=i.stop_ids,
                step_lookup=i.step_lookup,
                step_corpus=i.step_corpus,
                domain=i.domain,
                max_tokens=i.max_tokens,
                logprobs=None if i.logprobs == NO_LOGPROBS else i.logprobs,
                prompt_len=i.prompt_len,
            )
            for i in items
        ],
    )


def verify_items_from_pb(batch: verifier_pb2.VerifyBatch) -> list[VerifyItem]:
    return [
        VerifyItem(
            request_id=i.request_id,
            append_ids=tuple(i.append_ids),
            tree=tree_from_pb(i.tree),
            sampling=sampling_from_pb(i.sampling),
            release=i.release,
            plain_steps=max(1, i.plain_steps),
            stop_ids=tuple(i.stop_ids),
            step_lookup=tuple(i.step_lookup),
            step_corpus=tuple(i.step_corpus),
            domain=i.domain,
            max_tokens=i.max_tokens,
            logprobs=i.logprobs if i.HasField("logprobs") else NO_LOGPROBS,
            prompt_len=i.prompt_len,
        )
        for i in batch.items
    ]


def verdict_to_pb(v: Verdict) -> verifier_pb2.Verdict:
    return verifier_pb2.Verdict(
        request_id=v.request_id,
        accepted_nodes=v.accepted_nodes,
        accepted_tokens=v.accepted_tokens,
        next_token=v.next_token,
        node_accepted=v.node_accepted,
        committed_len=v.committed_len,
        error=v.error,
        error_kind=v.error_kind,
        plain_tokens=v.plain_tokens,
        step_passes=v.step_passes,
        step_drafted=v.step_drafted,
        step_accepted=v.step_accepted,
        step_lookups=[
            verifier_pb2.StepLookup(source=s.source, match=s.match, tried=s.tried, accepted=s.accepted)
            for s in v.step_lookups
        ],
        logprobs=logprobs_to_pb(v.logprobs),
        grammar_pruned=v.grammar_pruned,
    )


def verdict_from_pb(pb: verifier_pb2.Verdict) -> Verdict:
    return Verdict(
        request_id=pb.request_id,
        accepted_nodes=tuple(pb.accepted_nodes),
        accepted_tokens=tuple(pb.accepted_tokens),
        next_token=pb.next_token,
        node_accepted=tuple(pb.node_accepted),
        committed_len=pb.committed_len,
        error=pb.error,
        error_kind=pb.error_kind,
        plain_tokens=tuple(pb.plain_tokens),
        step_passes=pb.step_passes,
        step_drafted=pb.step_drafted,
        step_accepted=pb.step_accepted,
        step_lookups=tuple(StepLookup(s.source, s.match, s.tried, s.accepted) for s in pb.step_lookups),
        logprobs=logprobs_from_pb(pb.logprobs),
        grammar_pruned=pb.grammar_pruned,
    )


def fuse_round_to_pb(
    step_id: int, width: int, pricing: StepPricing, requests: Sequence[FusionRequest]
) -> drafter_pb2.DraftStep:
    """A whole round of token fusion for one drafter process (see common/spec/token_fusion.py)."""
    fuse = drafter_pb2.FuseRound(
        width=width,
        pricing=drafter_pb2.FusePricing(
            priced=pricing.priced,
            threshold=pricing.threshold,
            calibration=pricing.calibration,
            step_tokens=pricing.step_tokens,
            row_tokens=pricing.row_tokens,
        ),
    )
    for r in requests:
        fuse.requests.add(
            request_id=r.request_id,
            steps=r.steps,
            sources=[
                drafter_pb2.FuseSource(
                    drafter_id=s.drafter_id,
                    weight=s.weight,
                    truncate_to=s.first.truncate_to,
                    append_ids=s.first.append_ids,
                    cache_len=s.cache_len,
                )
                for s in r.sources
            ],
        )
    return drafter_pb2.DraftStep(step_id=step_id, fuse=fuse)


def fuse_round_from_pb(fuse: drafter_pb2.FuseRound) -> tuple[int, StepPricing, list[FusionRequest]]:
    p = fuse.pricing
    pricing = StepPricing(
        priced=p.priced,
        threshold=p.threshold,
        calibration=tuple(p.calibration),
        step_tokens=p.step_tokens,
        row_tokens=p.row_tokens,
    )
    requests = [
        FusionRequest(
            request_id=r.request_id,
            steps=r.steps,
            sources=tuple(
                FusionSource(
                    drafter_id=s.drafter_id,
                    weight=s.weight,
                    cache_len=s.cache_len,
                    first=DraftItem(request_id=r.request_id, truncate_to=s.truncate_to, append_ids=tuple(s.append_ids)),
                )
                for s in r.sources
            ),
        )
        for r in fuse.requests
    ]
    return fuse.width, pricing, requests


def fusion_outcomes_to_pb(
    outcomes: Mapping[str, FusionOutcome], step_seconds: Sequence[float]
) -> drafter_pb2.FuseRoundResult:
    pb = drafter_pb2.FuseRoundResult(step_seconds=step_seconds)
    for rid, out in outcomes.items():
        t = out.tree
        top1_masks = [t.mask_of(top) for top in t.top1]  # before drafter_ids is read: it may grow
        tree = pb.trees.add(
            request_id=rid,
            tokens=t.tokens,
            parents=t.parents,
            probs=t.probs,
            drafter_ids=t.drafter_ids,
            source_masks=t.source_masks,
            top1_masks=top1_masks,
            fused=out.fused,
        )
        for d, n in out.cache_len.items():
            tree.sources.add(drafter_id=d, cache_len=n)
        for d, why in out.failed.items():
            tree.sources.add(drafter_id=d, error=why or "failed")
    return pb


def fusion_outcomes_from_pb(pb: drafter_pb2.FuseRoundResult) -> tuple[dict[str, FusionOutcome], list[float]]:
    outcomes = {}
    for t in pb.trees:
        ids = list(t.drafter_ids)
        tree = DraftTree(
            drafter_ids=ids,
            tokens=list(t.tokens),
            parents=list(t.parents),
            probs=list(t.probs),
            source_masks=list(t.source_masks),
            top1=[frozenset(d for i, d in enumerate(ids) if m >> i & 1) for m in t.top1_masks],
        )
        outcomes[t.request_id] = FusionOutcome(
            tree=tree,
            fused=list(t.fused),
            cache_len={s.drafter_id: s.cache_len for s in t.sources if not s.error},
            failed={s.drafter_id: s.error for s in t.sources if s.error},
        )
    return outcomes, list(pb.step_seconds)


# ---- gateway <-> router ------------------------------------------------------------------------

FINISH_FROM_PB = {
    common_pb2.FINISH_REASON_UNSPECIFIED: FinishReason.UNSPECIFIED,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_EOS: FinishReason.EOS,
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_CANCELLED: FinishReason.CANCELLED,
}
FINISH_TO_PB = {reason: number for number, reason in FINISH_FROM_PB.items()}


def finish_reason_from_pb(number: int) -> FinishReason:
    """A number this gateway does not know (a newer router's) reads as unspecified."""
    return FINISH_FROM_PB.get(number, FinishReason.UNSPECIFIED)


def finish_reason_to_pb(reason: FinishReason) -> common_pb2.FinishReason:
    return FINISH_TO_PB[reason]


def spec_stats_from_pb(pb: common_pb2.SpecStats) -> SpecStats:
    return SpecStats(
        rounds=pb.rounds,
        mean_accepted_len=pb.mean_accepted_len,
        draft_tokens=pb.draft_tokens,
        accepted_tokens=pb.accepted_tokens,
        drafters_used=tuple(pb.drafters_used),
        accepted_by_drafter=dict(pb.accepted_by_drafter),
        grammar_pruned_tokens=pb.grammar_pruned_tokens,
    )


def spec_stats_to_pb(s: SpecStats) -> common_pb2.SpecStats:
    return common_pb2.SpecStats(
        rounds=s.rounds,
        mean_accepted_len=s.mean_accepted_len,
        draft_tokens=s.draft_tokens,
        accepted_tokens=s.accepted_tokens,
        drafters_used=s.drafters_used,
        accepted_by_drafter=s.accepted_by_drafter,
        grammar_pruned_tokens=s.grammar_pruned_tokens,
    )


def submit_to_pb(
    request_id: str,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_token_ids: Sequence[int],
    domain_hint: str,
    logprobs: int = NO_LOGPROBS,
    prompt_len: int = 0,
) -> router_pb2.SubmitRequest:
    """``prompt_len``: how many of ``prompt_ids`` are the prompt proper (0: all; a resumed stream
    sends what it already has after them)."""
    return router_pb2.SubmitRequest(
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling_to_pb(sampling),
        stop_token_ids=stop_token_ids,
        domain_hint=domain_hint,
        logprobs=None if logprobs == NO_LOGPROBS else logprobs,
        prompt_len=prompt_len,
    )


def submit_logprobs_from_pb(pb: router_pb2.SubmitRequest) -> int:
    """What a submission asked for (``VerifyItem.logprobs``): unset is ``NO_LOGPROBS``."""
    return pb.logprobs if pb.HasField("logprobs") else NO_LOGPROBS


def token_chunk_to_pb(
    request_id: str, tokens: Sequence[int], logprobs: Sequence[TokenLogprob], finished: bool
) -> router_pb2.TokenChunk:
    return router_pb2.TokenChunk(
        request_id=request_id, token_ids=tokens, finished=finished, logprobs=logprobs_to_pb(logprobs)
    )


def token_chunk_from_pb(pb: router_pb2.TokenChunk) -> RouterChunk:
    return RouterChunk(
        token_ids=tuple(pb.token_ids),
        finished=pb.finished,
        finish_reason=finish_reason_from_pb(pb.finish_reason),
        stats=spec_stats_from_pb(pb.stats),
        logprobs=logprobs_from_pb(pb.logprobs),
    )
