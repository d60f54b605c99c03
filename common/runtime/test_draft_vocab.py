"""Reduced draft vocabularies: the map, its declaration in a checkpoint, and the runner speaking target ids."""

from __future__ import annotations

import json

import pytest
import torch

from common.runtime.checkpoints import CheckpointError, read_config
from common.runtime.draft_vocab import CONFIG_KEY, DraftVocab, load_draft_vocab
from common.runtime.runner import LMRunner, SeqInput


def test_map_round_trip_and_fallback():
    vocab = DraftVocab.from_target_ids([7, 3, 11], target_vocab_size=16)
    assert vocab.size == 3
    assert vocab.to_target.tolist() == [7, 3, 11]
    assert vocab.to_draft[torch.tensor([7, 3, 11])].tolist() == [0, 1, 2]
    assert vocab.to_draft[torch.tensor([5, 0, 15])].tolist() == [0, 0, 0]  # unknown -> the first entry
    full = vocab.full_logits(torch.tensor([[1.0, 2.0, 3.0]]))
    assert full.shape == (1, 16)
    assert full[0, 11] == 3.0 and full[0, 3] == 2.0 and torch.isinf(full[0, 5]) and full[0, 5] < 0
    assert int(full.argmax()) == 11


@pytest.mark.parametrize("ids", [[], [1, 1], [3, 16], [-1]])
def test_bad_maps_are_refused(ids):
    with pytest.raises(ValueError):
        DraftVocab.from_target_ids(ids, target_vocab_size=16)


def test_distilled_drafter_declares_its_vocabulary(tiny_distilled_zoo):
    path = tiny_distilled_zoo.drafters["code"].path
    config = read_config(path)
    decl = config[CONFIG_KEY]
    vocab = load_draft_vocab(path, config)
    assert vocab is not None and decl["size"] == vocab.size == config["vocab_size"]
    assert decl["target_vocab_size"] == read_config(tiny_distilled_zoo.target.path)["vocab_size"]
    assert vocab.size < decl["target_vocab_size"]


def test_declared_map_that_disagrees_is_one_error(tiny_distilled_zoo, tmp_path):
    import shutil

    src = tiny_distilled_zoo.drafters["code"].path
    bad = tmp_path / "drafter"
    shutil.copytree(src, bad)
    (bad / "draft_vocab.json").write_text(json.dumps({"target_ids": [0, 1, 2]}))
    with pytest.raises(CheckpointError, match="draft_vocab.json"):
        LMRunner.from_checkpoint(bad)
    (bad / "draft_vocab.json").write_text("not json")
    with pytest.raises(CheckpointError, match="unreadable draft vocabulary"):
        LMRunner.from_checkpoint(bad)


def test_runner_takes_and_returns_target_ids(tiny_distilled_zoo):
    """The runner maps ids in and logits out: its argmax equals the HF model's argmax mapped back."""
    from common.runtime.checkpoints import load_causal_lm

    path = tiny_distilled_zoo.drafters["generalist"].path
    runner = LMRunner.from_checkpoint(path, backend="sdpa")
    vocab = runner.draft_vocab
    target_vocab = read_config(tiny_distilled_zoo.target.path)["vocab_size"]
    assert vocab is not None and runner.vocab_size == target_vocab
    prompt = [int(t) for t in vocab.to_target[:9].tolist()] + [target_vocab - 1]  # last one may be off the map
    cache = runner.new_pool(None).new_cache()
    cache.reserve(len(prompt))
    (logits,) = runner.forward([SeqInput(cache, tuple(prompt), logit_rows=tuple(range(len(prompt))))])
    assert logits.shape == (len(prompt), target_vocab)
    off_map = torch.ones(target_vocab, dtype=torch.bool)
    off_map[vocab.to_target] = False
    assert torch.isinf(logits[:, off_map]).all()
    hf = load_causal_lm(path)
    with torch.no_grad():
        ref = hf(input_ids=vocab.to_draft[torch.tensor([prompt])]).logits[0]
    assert vocab.to_target[ref.argmax(-1)].tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(logits[:, vocab.to_target], ref, rtol=1e-4, atol=1e-4)


def test_reduced_vocabulary_drafter_assists_transformers_generate(tiny_distilled_zoo):
    """transformers' assisted generation needs one vocabulary on both sides: wrapped, the drafter
    assists, and the output is the target's own greedy decode."""
    from common.runtime.checkpoints import load_causal_lm
    from common.runtime.draft_vocab import in_target_space

    target = load_causal_lm(tiny_distilled_zoo.target.path)
    path = tiny_distilled_zoo.drafters["generalist"].path
    assistant = in_target_space(load_causal_lm(path), load_draft_vocab(path, read_config(path)))
    ids = torch.tensor([[5, 17, 42, 9, 33]])
    kw = dict(
        attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
    )
    plain = target.generate(ids, **kw)
    assisted = target.generate(ids, assistant_model=assistant, **kw)
    assert torch.equal(plain, assisted)
    logits = assistant(input_ids=ids).logits
    assert logits.shape[-1] == read_config(tiny_distilled_zoo.target.path)["vocab_size"]
