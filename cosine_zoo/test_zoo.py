"""The tiny zoo end to end: loadable by path like any checkpoint, reproducible, validated."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from common.runtime.checkpoints import CheckpointError, load_causal_lm, load_tokenizer, tokenizer_fingerprint
from cosine_zoo.build import BuildOptions, build_zoo
from cosine_zoo.manifest import ZooError, load_zoo
from cosine_zoo.profiles import tiny
from cosine_zoo.tokenizer import train_tokenizer


def test_zoo_has_every_model_and_figure(tiny_zoo):
    assert tiny_zoo.profile == "tiny"
    assert tiny_zoo.domains == ("code", "prose", "arithmetic", "records")
    assert set(tiny_zoo.drafters) == {*tiny_zoo.domains, "generalist"}
    for name, entry in tiny_zoo.drafters.items():
        assert entry.params < tiny_zoo.target.params
        assert entry.domains == ((name,) if name != "generalist" else tiny_zoo.domains)
        assert set(tiny_zoo.acceptance[name]) == set(tiny_zoo.domains)
        assert all(0.0 <= v <= tiny_zoo.k for v in tiny_zoo.acceptance[name].values())
    assert set(tiny_zoo.target_perplexity) == set(tiny_zoo.domains)
    assert all(len(p) >= 4 and all(isinstance(t, str) and t for t in p) for p in tiny_zoo.prompts.values())


def test_checkpoints_load_like_any_transformers_model(tiny_zoo):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_zoo.target.path))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_zoo.drafters["code"].path))
    assert model.config.model_type == "llama"
    assert model.config.max_position_embeddings >= 512
    assert model.dtype == torch.float32
    assert (tiny_zoo.target.path / "model.safetensors").is_file()
    ids = tok("def f(x):\n    return x\n", return_tensors="pt").input_ids
    assert ids.shape[1] > 1 and model(input_ids=ids).logits.shape[-1] == len(tok)


@pytest.mark.parametrize("text", ["", "x", "def f(x):\n\treturn {'a': 1}  # ünïcødé ✓\n", "  leading spaces\r\n"])
def test_tokenizer_roundtrips_bytes_and_starts_with_bos(tiny_zoo, text):
    tok = load_tokenizer(tiny_zoo.tokenizer_path)
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.pad_token_id is not None and len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3


def test_rebuild_with_same_seed_gives_same_figures(tiny_zoo, tmp_path):
    again = build_zoo(BuildOptions(out=tmp_path / "zoo", profile=tiny(), seed=0, progress=False, threads=1))
    assert again.figures() == tiny_zoo.figures()


def test_rebuild_skips_done_stages(tiny_zoo, tmp_path):
    root = tmp_path / "zoo"
    shutil.copytree(tiny_zoo.root, root)
    weights = root / "target" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    again = build_zoo(BuildOptions(out=root, profile=tiny(), seed=0, progress=False, threads=1))
    assert weights.stat().st_mtime_ns == before
    assert again.figures() == tiny_zoo.figures()


@pytest.fixture()
def zoo_copy(tiny_zoo, tmp_path) -> Path:
    root = tmp_path / "zoo"
    shutil.copytree(tiny_zoo.root, root)
    return root


def test_missing_weights_name_the_path(zoo_copy):
    (zoo_copy / "drafters" / "prose" / "model.safetensors").unlink()
    with pytest.raises(ZooError, match=r"drafters/prose.*no weights"):
        load_zoo(zoo_copy)


def test_missing_manifest_names_the_path(zoo_copy):
    (zoo_copy / "zoo.json").unlink()
    with pytest.raises(ZooError, match=r"zoo\.json: missing"):
        load_zoo(zoo_copy)


def test_garbled_manifest_names_the_path(zoo_copy):
    (zoo_copy / "zoo.json").write_text('{"format": "cosine-zoo/1", "profile": ')
    with pytest.raises(ZooError, match=r"zoo\.json: unreadable"):
        load_zoo(zoo_copy)
    (zoo_copy / "zoo.json").write_text(json.dumps({"format": "cosine-zoo/1", "profile": "tiny"}))
    with pytest.raises(ZooError, match=r"zoo\.json: malformed manifest"):
        load_zoo(zoo_copy)


def test_mismatched_tokenizer_names_the_drafter(zoo_copy):
    other = train_tokenizer(["completely different text " * 50, "0123456789 " * 50], vocab_size=300)
    other.save_pretrained(str(zoo_copy / "drafters" / "records"))
    with pytest.raises(ZooError, match=r"drafters/records: tokenizer fingerprint .* does not match"):
        load_zoo(zoo_copy)


def test_missing_directory_and_truncated_weights(zoo_copy):
    with pytest.raises(ZooError, match="no such zoo directory"):
        load_zoo(zoo_copy / "nope")
    weights = zoo_copy / "target" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"target: cannot load model"):
        load_causal_lm(zoo_copy / "target")


def test_drafters_share_the_target_tokenizer(tiny_zoo):
    fp = tokenizer_fingerprint(load_tokenizer(tiny_zoo.target.path))
    assert fp == tiny_zoo.tokenizer_fingerprint
    assert all(tokenizer_fingerprint(load_tokenizer(e.path)) == fp for e in tiny_zoo.drafters.values())
