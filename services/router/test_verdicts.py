"""Verdict application on hand-built trees and verdicts: what is committed and streamed, who is
credited, when a request finishes, fails or is marked for a re-prefill."""

from __future__ import annotations

from common.spec.fusion import DraftTree
from common.spec.lookup_index import CORPUS, TEXT
from common.spec.types import GREEDY, StepLookup, Verdict
from services.router.control import SpeculationControl
from services.router.gate import DraftGate
from services.router.lookup import LookupCalibration
from services.router.requests import FINISH_EOS, FINISH_LENGTH, Counters, Request
from services.router.settings import RouterSettings
from services.router.verdicts import GOING_ON, VerdictApplication

STOP = 2


def make(max_new: int = 16) -> tuple[VerdictApplication, Request]:
    config = RouterSettings()
    control = SpeculationControl(enabled=True)
    apply = VerdictApplication(control, DraftGate(config, control), LookupCalibration(), Counters())
    req = Request("r", (5, 6, 7), max_new, GREEDY, frozenset({STOP}), domain="code")
    return apply, req


def chain(tokens: list[int], proposer: str = "a") -> DraftTree:
    """A chain both drafters proposed, ``proposer``'s top choice at every node."""
    tree = DraftTree(drafter_ids=[])
    parent = -1
    for t in tokens:
        parent = tree.add(parent, t, 0.8, frozenset({"a", "b"}), frozenset({proposer}))
    return tree


def streamed(req: Request) -> list[int]:
    out: list[int] = []
    while not req.events.empty():
        out += req.events.get_nowait().tokens
    return out


def test_accepted_path_and_next_token_are_committed_and_the_proposer_credited():
    apply, req = make()
    tree = chain([10, 11, 12])
    updates: list = []
    verdict = Verdict("r", accepted_nodes=(0, 1), accepted_tokens=(10, 11), next_token=13, committed_len=6)
    assert apply.apply(req, tree, ["a", "b"], verdict, updates, 1000) == GOING_ON
    assert req.generated == [10, 11, 13] and streamed(req) == [10, 11, 13]
    assert req.verifier_synced and req.stats.rounds == 1
    assert req.stats.accepted_by_drafter == {"a": 2}  # b proposed the nodes but never as its best
    assert req.stats.drafters_used == {"a", "b"}
    assert apply.counters.by_drafter == {"a": [1.0, 2.0], "b": [1.0, 0.0]}
    assert (apply.counters.draft_tokens, apply.counters.accepted_tokens, apply.counters.tokens_committed) == (3, 2, 3)
    assert updates == [("a", "code", 2.0, 3.0), ("b", "code", 0.0, 3.0)]


def test_a_stop_token_ends_the_request_and_nothing_after_it_is_committed():
    apply, req = make()
    verdict = Verdict("r", accepted_nodes=(0, 1), accepted_tokens=(10, STOP), next_token=13, committed_len=6)
    outcome = apply.apply(req, chain([10, STOP, 12]), ["a"], verdict, [], 1000)
    assert outcome.ends and outcome.finish_reason == FINISH_EOS and outcome.error is None
    assert req.generated == [10, STOP] and streamed(req) == [10, STOP]


def test_the_length_limit_cuts_the_verdict():
    apply, req = make(max_new=2)
    verdict = Verdict("r", accepted_nodes=(0, 1), accepted_tokens=(10, 11), next_token=13, committed_len=6)
    outcome = apply.apply(req, chain([10, 11]), ["a"], verdict, [], 1000)
    assert outcome.finish_reason == FINISH_LENGTH
    assert req.generated == [10, 11] and apply.counters.tokens_committed == 2


def test_a_request_the_verifier_lost_is_re_prefilled_not_failed():
    apply, req = make()
    req.verifier_synced = True
    lost = Verdict("r", error="no such request", error_kind="unknown_request")
    assert apply.apply(req, chain([10]), ["a"], lost, [], 1000) == GOING_ON
    assert not req.verifier_synced and req.resumes == 1 and streamed(req) == []
    # not synced yet: the verifier never had it, so losing it again is the request's failure
    outcome = apply.apply(req, chain([10]), ["a"], lost, [], 1000)
    assert outcome.error is not None and outcome.error.kind == "unknown_request"
    assert req.stats.rounds == 0 and req.generated == []


def test_other_verifier_errors_fail_the_request_with_their_kind():
    apply, req = make()
    outcome = apply.apply(req, chain([10]), ["a"], Verdict("r", error="context full", error_kind="context"), [], 1000)
    assert outcome.ends and outcome.error.kind == "context" and "context full" in str(outcome.error)


def test_the_steps_lookup_drafts_calibrate_the_lookup_rates_as_the_router_s_own_chains_do():
    apply, req = make()
    calibration = apply.lookup_calibration
    before = {
        (n, d, src): calibration(True, n, d, src)
        for n, d, src in ((6, 0, CORPUS), (6, 1, CORPUS), (6, 2, CORPUS), (2, 0, TEXT))
    }
    steps = (StepLookup(CORPUS, 6, 2, 1), StepLookup(TEXT, 2, 1, 0), StepLookup(CORPUS, 6, 2, 1))
    verdict = Verdict(
        "r",
        next_token=13,
        committed_len=6,
        plain_tokens=(14, 15),
        step_passes=2,
        step_drafted=5,
        step_accepted=2,
        step_lookups=steps,
    )
    apply.apply(req, DraftTree(drafter_ids=[]), [], verdict, [], 1000)
    assert calibration(True, 6, 0, CORPUS) > before[6, 0, CORPUS]  # the corpus chains' first tokens: accepted twice
    assert calibration(True, 6, 1, CORPUS) < before[6, 1, CORPUS]  # their second tokens: tried twice, rejected twice
    assert calibration(True, 6, 2, CORPUS) == before[6, 2, CORPUS]  # never tried
    assert calibration(True, 2, 0, TEXT) < before[2, 0, TEXT]
    assert calibration(False, 6, 0, CORPUS) == LookupCalibration.prior(
        6, 0, CORPUS
    )  # a greedy request's steps: greedy rates only
