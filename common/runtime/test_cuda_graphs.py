"""The bucketed pass a GPU captures in CUDA graphs (``common/runtime/cuda_graphs.py``), run eagerly
on a CPU ("static" mode): the same logits as the runner's eager paged pass for decode steps, chains,
trees and mixed batches, whatever the padding; the padding rows write only the scratch block; a
pass no bucket fits runs eagerly and is counted; a grown arena's graphs are dropped; and the engines'
greedy output through it equals transformers. On CUDA the same checks run with real capture."""

from __future__ import annotations

import pytest
import torch

from common.runtime.attention import BatchLayout
from common.runtime.checkpoints import load_causal_lm
from common.runtime.cuda_graphs import BATCH_BUCKETS, MIN_ENTRIES, TOKEN_BUCKETS, Bucket, bucket_for
from common.runtime.runner import LMRunner, SeqInput
from cosine_zoo.random_checkpoints import make_checkpoint

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TREE = ((5, 6, 7, 8, 9), (-1, 0, 0, 1, 3))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("g"), "llama", seed=3, max_position_embeddings=1024)


def runners(path, device: str) -> tuple[LMRunner, LMRunner]:
    """(bucketed, eager) paged runners on ``device``: CUDA graphs captured on CUDA, static on a CPU."""
    graphed = LMRunner.from_checkpoint(path, backend="sdpa", kv_cache="paged", device=device)
    eager = LMRunner.from_checkpoint(path, backend="sdpa", kv_cache="paged", device=device, cuda_graphs=False)
    graphed.graph_mode = "capture" if device == "cuda" else "static"
    assert eager.graph_mode == "off"
    return graphed, eager


def ids(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


class Twin:
    """The same requests on two runners, each with its own arena: every pass run on both."""

    def __init__(self, a: LMRunner, b: LMRunner):
        self.runners = (a, b)
        self.pools = (a.new_pool(None), b.new_pool(None))
        self.caches: list[tuple] = []

    def add(self, prompt: tuple[int, ...]) -> int:
        pair = tuple(p.new_cache() for p in self.pools)
        self.caches.append(pair)
        self.step({len(self.caches) - 1: (prompt, None)}, commit=True)
        return len(self.caches) - 1

    def step(self, news: dict[int, tuple[tuple[int, ...], tuple[int, ...] | None]], commit: bool | tuple = False):
        outs = []
        for side, runner in enumerate(self.runners):
            seqs = []
            for i, (toks, parents) in news.items():
                c = self.caches[i][side]
                c.reserve(len(toks))
                seqs.append(SeqInput(c, toks, parents, tuple(range(len(toks)))))
            outs.append(runner.forward(seqs))
            for (i, (toks, _)), _s in zip(news.items(), seqs):
                c = self.caches[i][side]
                if commit is True:
                    c.commit(len(toks))
                elif commit:
                    c.commit(list(commit))
                else:
                    c.discard_pending()
        return outs


@pytest.mark.parametrize("device", DEVICES)
def test_bucketed_passes_give_the_eager_paged_pass_s_logits(checkpoint, device):
    graphed, eager = runners(checkpoint, device)
    twin = Twin(graphed, eager)
    # a prompt of 3 tokens fits a bucket (1 x 4); prompts of 17 and 40 tokens fit none: eager
    reqs = [twin.add(ids(n, seed=n)) for n in (3, 17, 40)]
    tol = dict(atol=2e-4, rtol=1e-4) if device == "cpu" else dict(atol=2e-2, rtol=2e-2)
    cases = [
        {r: ((7,), None) for r in reqs},  # decode steps of three requests: batch bucket 4, tokens 1
        {reqs[0]: ((1, 2, 3), None), reqs[2]: (TREE[0], TREE[1])},  # a chain beside a tree: tokens 8
        {reqs[1]: (TREE[0], TREE[1])},  # one tree alone
    ]
    for news in cases:
        got, want = twin.step(news)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, **tol)
    stats = graphed.graphs.stats()
    assert stats["eager"] == 2 and stats["captured"] == 1 + len(cases) and stats["replayed"] == 0
    twin.step(cases[0])  # the same bucket again: replayed
    assert graphed.graphs.stats()["replayed"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_committed_tree_paths_and_later_steps_agree_with_the_eager_pass(checkpoint, device):
    """A tree's accepted path committed through both runners, then decode steps on top: the bucketed
    pass wrote the same keys and values into the request's own slots (and nothing else)."""
    graphed, eager = runners(checkpoint, device)
    twin = Twin(graphed, eager)
    r = twin.add(ids(9, seed=1))
    twin.step({r: (TREE[0], TREE[1])}, commit=(0, 1, 3))
    scratch = twin.pools[0].scratch_block
    assert scratch is not None and scratch not in twin.caches[r][0].blocks
    assert twin.pools[0].reserved_tokens == twin.pools[1].reserved_tokens  # the scratch block is no request's
    for step in range(3):
        got, want = twin.step({r: ((11 + step,), None)}, commit=True)
        torch.testing.assert_close(got[0], want[0], **(dict(atol=2e-4, rtol=1e-4) if device == "cpu" else {}))
        assert int(got[0].argmax()) == int(want[0].argmax())
    L = twin.caches[r][0].length
    a, b = (pool for pool in twin.pools)
    for li in range(graphed.num_layers):
        ka = a.k[li][[twin.caches[r][0]._slot(i) for i in range(L)]]
        kb = b.k[li][[twin.caches[r][1]._slot(i) for i in range(L)]]
        torch.testing.assert_close(ka.float(), kb.float(), **(dict(atol=1e-5, rtol=1e-5) if device == "cpu" else {}))


def test_buckets_pad_up_and_refuse_what_does_not_fit():
    def layout(past, lens):
        return BatchLayout(past_lens=tuple(past), parents=tuple(tuple(range(-1, t - 1)) for t in lens))

    assert bucket_for(layout([10, 20, 30], [1, 1, 1]), 1024) == Bucket(4, 1, MIN_ENTRIES)
    assert bucket_for(layout([300], [5]), 1024) == Bucket(1, 8, 512)
    assert bucket_for(layout([1008], [16]), 1024) == Bucket(1, 16, 1024)
    assert bucket_for(layout([1010], [16]), 1024) is None  # past the context
    assert bucket_for(layout([0], [TOKEN_BUCKETS[-1] + 1]), 4096) is None  # a prefill: eager
    assert bucket_for(layout([0] * (BATCH_BUCKETS[-1] + 1), [1] * (BATCH_BUCKETS[-1] + 1)), 4096) is None
    assert bucket_for(layout([100], [1]), 200) == Bucket(1, 1, 200)  # a short context caps the entries


def test_a_grown_arena_drops_its_graphs_and_the_pass_stays_right(checkpoint):
    graphed, eager = runners(checkpoint, "cpu")
    twin = Twin(graphed, eager)
    r = twin.add(ids(5, seed=2))
    twin.step({r: ((3,), None)})
    assert graphed.graphs.stats()["graphs"] == 2  # the prompt's bucket and the decode step's
    arena = twin.pools[0]
    before = arena.k.data_ptr()
    big = [arena.new_cache() for _ in range(3)]
    for c in big:
        c.reserve(arena.num_blocks * arena.block_size)  # more than the arena holds: it grows
    assert arena.k.data_ptr() != before
    got, want = twin.step({r: ((3,), None)})
    torch.testing.assert_close(got[0], want[0], atol=2e-4, rtol=1e-4)
    assert graphed.graphs.stats() == {"replayed": 0, "captured": 3, "eager": 0, "graphs": 1}  # dropped, recaptured


def test_greedy_decoding_through_the_bucketed_pass_equals_transformers(checkpoint):
    from common.runtime.verifier_engine import VerifierEngine
    from common.spec.types import VerifyItem

    engine = VerifierEngine.from_checkpoint(checkpoint, kv_cache="paged", seed=0)
    engine.runner.graph_mode = "static"
    model = load_causal_lm(checkpoint)
    prompts = [ids(n, seed=10 + n) for n in (4, 9, 13)]
    outcome = engine.verify([VerifyItem(f"r{i}", append_ids=p, plain_steps=12) for i, p in enumerate(prompts)])
    for p, v in zip(prompts, outcome.verdicts):
        want = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :].tolist()
        assert list(v.new_tokens)[:12] == want
    stats = engine.runner.graphs.stats()
    assert stats["replayed"] + stats["captured"] > 0

    from common.platform.metrics import ServiceMetrics, bind_engine_metrics

    metrics = ServiceMetrics("verifier")
    bind_engine_metrics(metrics, lambda: engine, "target")
    for kind in ("replayed", "captured", "eager"):
        assert (
            metrics.registry.get_sample_value("cosine_cuda_graph_passes", {"model": "target", "kind": kind})
            == stats[kind]
        )
