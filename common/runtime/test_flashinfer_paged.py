"""``--attention flashinfer``: the metadata FlashInfer's paged prefill kernel is given (CSR page
lists, last-page lengths, the tree as a flat custom mask), checked on any machine by computing from
it what the kernel is documented to compute and holding that against the gathered-view pass
(prompts, trees, mixed batches, committed tree paths); the kernel itself where CUDA and the package
are present; asked for where it cannot run, one line with the way out."""

from __future__ import annotations

import pytest
import torch

from common.runtime import flashinfer_paged, paged_runner
from common.runtime.flashinfer_paged import flashinfer_available, plan_flashinfer, reference_attend
from common.runtime.kv_arena import KVArena, select_kv_cache
from common.runtime.paged_attention import plan_paged
from common.runtime.runner import LMRunner
from common.runtime.test_flex_paged import mixed_passes
from cosine_zoo.random_checkpoints import make_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("flashinfer"), "llama", seed=7)


def test_the_csr_metadata_lists_each_sequence_s_blocks_its_last_page_and_its_own_mask():
    from common.runtime.attention import BatchLayout

    shape = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "dtype": torch.float32, "device": "cpu"}
    arena = KVArena(**shape, token_budget=None, block_size=4)
    caches = [arena.new_cache() for _ in range(2)]
    caches[0].reserve(9)  # 6 committed entries (the layout says so), then a tree of 3: 0 and its children 1, 2
    caches[1].reserve(1)  # a fresh sequence's one token
    layout = BatchLayout(past_lens=(6, 0), parents=((-1, 0, 0), (-1,)))
    plan = plan_flashinfer(plan_paged(layout, caches, arena, torch.float32), arena, 2, 4, 0.5)
    assert plan.qo_indptr.tolist() == [0, 3, 4]
    assert plan.kv_indptr.tolist() == [0, 3, 4]  # 9 entries: 3 blocks; 1 entry: 1 block
    assert plan.kv_indices.tolist() == caches[0].blocks[:3] + caches[1].blocks[:1]
    assert plan.last_page_len.tolist() == [1, 1]
    first = plan.custom_mask[: 3 * 9].view(3, 9).tolist()
    committed = [True] * 6
    assert first == [committed + [True, False, False], committed + [True, True, False], committed + [True, False, True]]
    assert plan.custom_mask[27:].tolist() == [True] and plan.custom_mask.numel() == 28


def test_what_the_kernel_computes_from_its_metadata_is_the_gathered_view_s_pass(checkpoint, monkeypatch):
    """The whole forward through the flashinfer path, its kernel replaced by the reference over the
    same metadata: the logits equal the sdpa gathered view's for every pass of the mix."""
    sdpa = LMRunner.from_checkpoint(checkpoint, backend="sdpa", kv_cache="paged")
    ours = LMRunner.from_checkpoint(checkpoint, backend="sdpa", kv_cache="paged")
    ours.paged_attention = "flashinfer"
    planned = []
    monkeypatch.setattr("common.runtime.runner.new_flashinfer_wrapper", lambda device: None)
    monkeypatch.setattr(
        paged_runner,
        "flashinfer_attend",
        lambda q, arena, li, plan: planned.append(plan) or reference_attend(q, arena, li, plan, ours.scale),
    )
    for a, b in zip(mixed_passes(ours), mixed_passes(sdpa)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert len(planned) == 3 * ours.num_layers  # every layer of the three passes went through it
    assert any(p.custom_mask.numel() > 0 and not bool(p.custom_mask.all()) for p in planned)  # a tree was masked


def test_flashinfer_where_it_cannot_run_is_refused_in_one_line_with_the_way_out(checkpoint):
    assert select_kv_cache("auto", "cuda", "flashinfer")[0] == "paged"
    with pytest.raises(ValueError, match="flashinfer reads the paged arena; use --kv-cache paged or auto"):
        select_kv_cache("contiguous", "cuda", "flashinfer")
    with pytest.raises(ValueError, match="runs on CUDA only") as exc:
        LMRunner.from_checkpoint(checkpoint, backend="flashinfer")
    assert "\n" not in str(exc.value) and "--attention auto" in str(exc.value)
    if not torch.cuda.is_available():
        return
    if not flashinfer_available("cuda"):
        with pytest.raises(ValueError, match=flashinfer_paged.PACKAGE):
            LMRunner.from_checkpoint(checkpoint, backend="flashinfer", device="cuda", dtype="bfloat16")


@pytest.mark.skipif(not flashinfer_available("cuda"), reason="needs flashinfer on a CUDA device")
def test_the_kernel_gives_the_gathered_view_s_logits_on_cuda(checkpoint):
    ours = LMRunner.from_checkpoint(checkpoint, backend="flashinfer", device="cuda", dtype="bfloat16")
    sdpa = LMRunner.from_checkpoint(checkpoint, backend="sdpa", kv_cache="paged", device="cuda", dtype="bfloat16")
    assert ours.attention_name == "paged_flashinfer"
    for a, b in zip(mixed_passes(ours), mixed_passes(sdpa)):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)
