"""Restarts under load with real processes: the local cluster's supervisor restarts a killed
verifier at the same address, and the router re-prefills every in-flight request on it; no
request fails and greedy output equals the target's."""

from __future__ import annotations

import time

import pytest

from cosine_cli.cluster import LocalCluster
from cosine_cli.status_metrics import scrape
from cosine_cli.supervisor import Backoff
from tests.test_cluster import generate_while_killing, reference, spec_for, workload  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow


# with chunks: drafts verified by chunks of 2, every node verified (no cost control, no yield guard), so
# that the verifier dies in the middle of chunked drafts, with next chunks being drafted beside its passes
CHUNKED = ("--verify-chunks", "2", "--no-cost-control", "--initial-k", "6", "--no-adaptive-k")


@pytest.mark.parametrize("router_args", [(), CHUNKED], ids=["whole", "chunks"])
def test_killed_verifier_is_restarted_and_requests_resume(tiny_zoo, tmp_path, workload, reference, router_args):  # noqa: F811
    lines: list[str] = []
    c = LocalCluster(spec_for(tiny_zoo, tmp_path, router_args=router_args))
    c.start(progress=False)
    sup = c.supervise(backoff=Backoff(initial_s=0.2), say=lines.append)
    try:
        work = workload * 4  # enough requests that some are still in flight when the verifier dies

        results = generate_while_killing(c, work, "verifier", timeout_s=180)
        for (_, prompt), res in zip(work, results):
            assert list(res.token_ids) == reference[prompt]
        deadline = time.monotonic() + 30  # the supervisor polls; on a fast machine the work may end first
        while sup.restarts.get("verifier") is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sup.restarts.get("verifier") == 1
        assert any("verifier restarted" in line for line in lines)
        if router_args:  # the drafts went by chunks: later chunks were verified next or pruned unverified
            rows = {
                lab["outcome"]: v for lab, v in scrape(c.state()["metrics"]["router"])["cosine_router_draft_rows_total"]
            }
            assert rows.get("verified", 0) > 0 and rows.get("pruned", 0) > 0, rows
    finally:
        c.stop()


def test_killed_router_is_replaced_and_the_gateway_resumes_every_stream(tiny_zoo, tmp_path, workload, reference):  # noqa: F811
    """SIGKILL of the router under load: the supervisor restarts it at the same address and the
    gateway resumes each cut stream on it from the tokens already relayed; nothing is lost, repeated
    or changed."""
    lines: list[str] = []
    c = LocalCluster(spec_for(tiny_zoo, tmp_path))
    c.start(progress=False)
    sup = c.supervise(backoff=Backoff(initial_s=0.2), say=lines.append)
    try:
        work = workload * 4
        results = generate_while_killing(c, work, "router", timeout_s=180)
        for (_, prompt), res in zip(work, results):
            assert list(res.token_ids) == reference[prompt]
        deadline = time.monotonic() + 30
        while sup.restarts.get("router") is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sup.restarts.get("router") == 1
        log = (tmp_path / "logs" / "gateway.log").read_text()
        assert "router lost; resuming the request" in log  # the kill cut streams that were then resumed
    finally:
        c.stop()


def test_killed_gateway_streams_resume_through_the_sdk(tiny_zoo, tmp_path, workload, reference):  # noqa: F811
    """SIGKILL of the gateway under streaming load: the supervisor restarts it at the same address
    and each SDK stream resumes after the tokens it already has; the concatenated tokens and text
    are exactly an undisturbed run's."""
    from common.runtime.checkpoints import load_tokenizer

    c = LocalCluster(spec_for(tiny_zoo, tmp_path))
    c.start(progress=False)
    sup = c.supervise(backoff=Backoff(initial_s=0.2))
    tok = load_tokenizer(str(tiny_zoo.target.path))
    work = workload * 4

    try:
        results = generate_while_killing(c, work, "gateway", timeout_s=180)
        assert any(r.cut for r in results)  # the kill cut streams, which the SDK then resumed
        for (_, prompt), res in zip(work, results):
            assert res.token_ids == reference[prompt]
            assert res.text == tok.decode(reference[prompt], skip_special_tokens=True)
        assert sup.restarts.get("gateway") == 1
    finally:
        c.stop()
