"""The distillation pipeline (what builds the ``smol`` zoo) at toy size, on the tiny zoo's target."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
import torch

from cosine_zoo.build import BuildOptions, build_zoo
from cosine_zoo.build_distilled import DISTILL_DOMAINS
from cosine_zoo.distill import Example, choose_draft_vocab, make_batch, resolve_layers
from cosine_zoo.instructions import instructions, render, subjects
from cosine_zoo.manifest import (
    LEXICON,
    LOOKUP_CORPUS,
    ZooError,
    read_lexicon,
    read_lookup_corpus,
    write_lexicon,
    write_lookup_corpus,
)
from cosine_zoo.profiles import tiny_distill
from cosine_zoo.stages import resolve_device


def test_distilled_zoo_has_every_drafter_and_figure(tiny_distilled_zoo, tiny_zoo):
    zoo = tiny_distilled_zoo
    assert zoo.profile == "tiny-distill" and zoo.domains == DISTILL_DOMAINS and "chat" in zoo.domains
    assert set(zoo.drafters) == {*DISTILL_DOMAINS, "generalist"}
    assert zoo.target.path == tiny_zoo.target.path.resolve()  # a named target is used in place
    for name in zoo.drafters:
        assert set(zoo.acceptance[name]) == set(zoo.domains)
        assert all(0.0 <= v <= zoo.k for v in zoo.acceptance[name].values())
    cost = zoo.manifest["evaluation"]["step_cost"]
    assert cost["target_ms"] > 0 and set(cost["drafter_ms"]) == set(zoo.drafters)
    assert zoo.manifest["draft_vocab"]["size"] == tiny_distill().draft_vocab
    assert {d: len(p) for d, p in zoo.prompts.items()} == {
        d: tiny_distill().evaluation.prompts_per_domain for d in zoo.domains
    }


def test_rebuild_skips_finished_stages_and_reproduces_figures(tiny_distilled_zoo, tiny_zoo, tmp_path):
    opts = BuildOptions(
        out=tmp_path / "zoo", profile=tiny_distill(), seed=0, progress=False, threads=1, target=tiny_zoo.target.path
    )
    first = build_zoo(opts)
    assert first.acceptance == tiny_distilled_zoo.acceptance  # same seed, same figures
    stamp = (tmp_path / "zoo" / "drafters" / "code" / "model.safetensors").stat().st_mtime_ns
    again = build_zoo(opts)
    assert (tmp_path / "zoo" / "drafters" / "code" / "model.safetensors").stat().st_mtime_ns == stamp
    assert again.acceptance == first.acceptance


def test_distilled_drafters_serve_losslessly(tiny_distilled_zoo):
    """Router core with the distilled (reduced-vocabulary) drafters: output equals the target's greedy decode."""
    from common.runtime.drafter_engine import DrafterEngine
    from common.runtime.test_greedy_equality import hf_greedy
    from common.runtime.verifier_engine import VerifierEngine
    from services.router.core import RouterCore
    from services.router.inprocess import LocalDrafterPool, LocalVerifier
    from services.router.settings import RouterSettings
    from services.router.test_core import generate_all

    zoo = tiny_distilled_zoo
    verifier = VerifierEngine.from_checkpoint(zoo.target.path, attention_backend="sdpa")
    drafters = {n: DrafterEngine.from_checkpoint(e.path, domains=e.domains) for n, e in zoo.drafters.items()}
    from common.runtime.checkpoints import load_tokenizer

    tok = load_tokenizer(zoo.tokenizer_path)
    prompts = {
        f"{d}-{i}": tok(text)["input_ids"] for d, texts in zoo.prompts.items() for i, text in enumerate(texts[:1])
    }
    expected = hf_greedy(zoo.target.path, prompts, 16)
    for config in (RouterSettings(drafters_per_request=2, tree_width=3), RouterSettings(fusion="chunk")):
        core = RouterCore(config, LocalDrafterPool(drafters), LocalVerifier(verifier))
        assert asyncio.run(generate_all(core, prompts, 16)) == expected
        assert core.counters.rounds > 0
    assert verifier.active_requests == 0 and all(e.active_requests == 0 for e in drafters.values())


def test_draft_vocab_keeps_frequent_tokens_and_specials():
    examples = [Example((5, 5, 5, 9), (9, 2)), Example((5, 7), (9,))]
    vocab = choose_draft_vocab(examples, size=3, target_vocab_size=20, always=[1])
    assert vocab.to_target.tolist()[:2] == [5, 9]  # by frequency, most frequent first
    assert 1 in vocab.to_target.tolist() and vocab.size == 3


def test_teacher_forced_examples_carry_the_targets_argmax(tiny_zoo):
    import torch

    from common.runtime.checkpoints import load_causal_lm
    from cosine_zoo.distill import teacher_forced_examples

    target = load_causal_lm(tiny_zoo.target.path)
    windows = [list(range(3, 23)), list(range(40, 60))]
    examples = teacher_forced_examples(target, windows, context=5, batch_size=2, desc="t", progress=False)
    with torch.no_grad():
        want = target(input_ids=torch.tensor([windows[1]])).logits[0, 4:19].argmax(-1).tolist()
    assert examples[1].prompt == tuple(windows[1][:5]) and examples[1].continuation == tuple(windows[1][5:])
    assert list(examples[1].targets) == want and examples[1].labels == examples[1].targets


def test_batches_supervise_only_the_continuation_inside_the_vocabulary():
    vocab = choose_draft_vocab([Example((4, 5), (6, 7))], size=4, target_vocab_size=10)
    ids, labels = make_batch([Example((4, 5), (6, 8))], vocab)  # 8 is off the map
    assert ids.shape == labels.shape == (1, 3)
    assert labels[0].tolist() == [-100, int(vocab.to_draft[6]), -100]


def test_soft_labels_are_the_target_s_top_k_while_it_writes(tiny_zoo):
    import torch

    from common.runtime.checkpoints import load_causal_lm
    from common.runtime.verifier_engine import VerifierEngine
    from cosine_zoo.distill import teacher_examples, teacher_forced_examples

    target = load_causal_lm(tiny_zoo.target.path)
    engine = VerifierEngine.from_checkpoint(tiny_zoo.target.path, attention_backend="sdpa")
    prompts = [[3, 4, 5, 6], [10, 11], [20, 21, 22]]
    by_engine = teacher_examples(
        engine, prompts, 6, eos_id=-1, pad_id=0, batch_size=2, desc="t", progress=False, top_k=5
    )
    by_model = teacher_examples(
        target, prompts, 6, eos_id=-1, pad_id=0, batch_size=3, desc="t", progress=False, top_k=5
    )
    assert [ex.continuation for ex in by_engine] == [ex.continuation for ex in by_model]
    for ex, other in zip(by_engine, by_model):
        with torch.no_grad():  # the teacher-forced distribution at each continuation token
            full = torch.log_softmax(target(input_ids=torch.tensor([ex.prompt + ex.continuation])).logits[0], -1)
        want = full[len(ex.prompt) - 1 : -1].topk(5, -1)
        for got in (ex.soft, other.soft):
            assert got.ids.shape == got.logprobs.shape == (6, 5)
            assert got.ids.tolist() == want.indices.tolist()
            assert torch.allclose(got.logprobs.float(), want.values, atol=2e-2)
        assert ex.soft.ids[:, 0].tolist() == list(ex.continuation)  # greedy: its top-1 is what it wrote
    assert engine.observe_logits is None and engine.active_requests == 0
    assert teacher_examples(engine, prompts[:1], 3, -1, 0, 1, "t", False)[0].soft is None  # asked for none
    forced = teacher_forced_examples(
        target, [list(range(3, 15))], context=4, batch_size=1, desc="t", progress=False, top_k=3
    )
    assert forced[0].soft.ids[:, 0].tolist() == list(forced[0].targets) and forced[0].soft.ids.shape == (8, 3)


def test_soft_batches_hold_the_teacher_s_distribution_inside_the_vocabulary():
    import math

    import torch

    from cosine_zoo.distill import SoftLabels, distill_loss, soft_batch

    vocab = choose_draft_vocab([Example((4, 5), (6, 7))], size=4, target_vocab_size=10)
    soft = SoftLabels(
        torch.tensor([[6, 9], [7, 6]], dtype=torch.int32),  # 9 is off the map
        torch.tensor([[math.log(0.6), math.log(0.3)], [math.log(0.5), math.log(0.25)]], dtype=torch.float16),
    )
    batch = [Example((4, 5), (6, 7), soft=soft), Example((5,), (6,))]
    ids, labels = make_batch(batch, vocab)
    idx, probs = soft_batch(batch, vocab, ids.shape[1])
    assert idx.shape == probs.shape == (2, 3, 2)
    # position 1 predicts the first continuation token: 9 is dropped, 6 keeps all the mass
    assert probs[0, 1].tolist() == pytest.approx([1.0, 0.0]) and int(idx[0, 1, 0]) == int(vocab.to_draft[6])
    assert probs[0, 2].tolist() == pytest.approx([2 / 3, 1 / 3], abs=1e-3)
    assert probs[0, 0].sum() == 0 and probs[1].sum() == 0  # off the continuation; no soft labels
    logits = torch.randn(2, 3, 4)
    hard = distill_loss(logits, labels, None, 0.5)
    assert hard == pytest.approx(float(distill_loss(logits, labels, (idx, probs), 0.0)))
    logq = torch.log_softmax(logits, -1)
    want = -(probs * logq.gather(-1, idx)).sum() / 2  # two positions carry a distribution
    assert float(distill_loss(logits, labels, (idx, probs), 1.0)) == pytest.approx(float(want), rel=1e-5)


def test_layers_and_chat_prompts():
    assert resolve_layers((0, -1), 30) == [0, 29]
    with pytest.raises(ValueError):
        resolve_layers((0, 30), 30)
    assert not set(subjects(heldout=True)) & set(subjects(heldout=False))
    train, held = instructions(40, 0, heldout=False), instructions(10, 0, heldout=True)
    assert len(train) == 40 and not set(train) & set(held)

    class Templated:
        chat_template = "x"

        def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
            assert add_generation_prompt and not tokenize
            return "<user>" + msgs[0]["content"] + "<assistant>"

    assert render(Templated(), "Hi") == "<user>Hi<assistant>"
    assert render(object(), "Hi") == "Question: Hi\nAnswer:"


def test_missing_target_is_one_clear_error(tmp_path):
    from common.runtime.checkpoints import CheckpointError

    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        build_zoo(BuildOptions(out=tmp_path / "z", profile=tiny_distill(), progress=False, target=tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="pass --target"):
        build_zoo(BuildOptions(out=tmp_path / "z", profile=tiny_distill(), progress=False))
    assert not (tmp_path / "z" / "zoo.json").exists()


def test_cli_reports_bad_target_in_one_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cosine_cli.main",
            "models",
            "build",
            "--profile",
            "tiny-distill",
            "--target",
            str(tmp_path / "nope"),
            "--out",
            str(tmp_path / "z"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = proc.stderr
    assert proc.returncode == 1 and "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "nope" in lines[0] and "no such checkpoint directory" in lines[0]


def test_manifest_records_teacher_and_vocab(tiny_distilled_zoo):
    m = json.loads((tiny_distilled_zoo.root / "zoo.json").read_text())
    assert set(m["teacher"]) == set(DISTILL_DOMAINS)
    assert all(v["generated"] == tiny_distill().teacher.prompts_per_domain for v in m["teacher"].values())
    assert m["teacher"]["code"]["teacher_forced"] > 0 and m["teacher"]["chat"]["teacher_forced"] == 0
    # the profile asks for the teacher's top-k: every training example carries it
    assert all(v["soft_labelled"] == v["generated"] + v["teacher_forced"] for v in m["teacher"].values())
    assert m["drafters"]["chat"]["domains"] == ["chat"]
    assert set(m["timings"]) >= {"target", "teacher", "drafters", "evaluation", "total"}


def test_zoo_carries_the_domain_lexicon_of_its_training_prompts(tiny_distilled_zoo, tmp_path):
    zoo = tiny_distilled_zoo
    m = json.loads((zoo.root / "zoo.json").read_text())
    # every training example's prompt is counted under its domain
    assert {d: n for d, (n, _) in zoo.lexicon.items()} == {
        d: v["generated"] + v["teacher_forced"] for d, v in m["teacher"].items()
    }
    assert all(sum(counts.values()) > 0 for _, counts in zoo.lexicon.values())
    write_lexicon(tmp_path, {"code": [(5, 5, 6)], "chat": [(7,), (7, 8)]})
    assert read_lexicon(tmp_path / LEXICON) == {"code": (1, {5: 2, 6: 1}), "chat": (2, {7: 2, 8: 1})}
    assert read_lexicon(tmp_path / "absent.json") == {}  # a zoo built before lexicons: none, no error
    (tmp_path / LEXICON).write_text("{}")
    with pytest.raises(ZooError, match="lexicon"):
        read_lexicon(tmp_path / LEXICON)


def test_zoo_carries_the_target_s_continuations_of_its_training_prompts_as_lookup_corpus(tiny_distilled_zoo, tmp_path):
    zoo = tiny_distilled_zoo
    m = json.loads((zoo.root / "zoo.json").read_text())
    # the generated examples only (a teacher-forced window is real text, not the target's): prompt then continuation
    assert {d: len(seqs) for d, seqs in zoo.lookup_corpus.items()} == {
        d: v["generated"] for d, v in m["teacher"].items()
    }
    assert all(len(seq) > 1 for seqs in zoo.lookup_corpus.values() for seq in seqs)
    write_lookup_corpus(tmp_path, {"code": [(5, 5, 6)], "chat": [[7, 8]]})
    assert read_lookup_corpus(tmp_path / LOOKUP_CORPUS) == {"code": ((5, 5, 6),), "chat": ((7, 8),)}
    assert read_lookup_corpus(tmp_path / "absent.json") == {}  # a zoo built before the corpus: none, no error
    (tmp_path / LOOKUP_CORPUS).write_text('{"format": "cosine-lookup-corpus/1", "domains": {"code": [["x"]]}}')
    with pytest.raises(ZooError, match="lookup corpus"):
        read_lookup_corpus(tmp_path / LOOKUP_CORPUS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA device")
def test_device_cuda_without_a_gpu_is_refused_before_any_stage(tmp_path):
    from cosine_zoo.cli import cmd_build, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    out = tmp_path / "z"
    args = parser.parse_args(
        [
            "models",
            "build",
            "--profile",
            "tiny-distill",
            "--target",
            str(tmp_path),
            "--out",
            str(out),
            "--device",
            "cuda",
        ]
    )
    assert args.device == "cuda"
    assert cmd_build(args) == 1
    assert not out.exists()  # refused before the target stage made the directory
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"


def test_zoo_records_the_device_it_was_built_on(tiny_distilled_zoo):
    assert tiny_distilled_zoo.manifest["environment"]["device"] == "cpu"


def test_report_shows_each_specialist_against_the_generalist_on_its_own_domain(tiny_distilled_zoo):
    import io

    from cosine_zoo.cli import print_report
    from cosine_zoo.manifest import specialist_ratios

    manifest = tiny_distilled_zoo.manifest
    matrix = manifest["evaluation"]["acceptance"]
    for d, ratio in manifest["evaluation"]["specialist_ratio"].items():
        g = matrix["generalist"][d]
        assert ratio is None if g == 0 else ratio == pytest.approx(matrix[d][d] / g, abs=1e-4)
    rows = specialist_ratios({"generalist": {"code": 0.5, "chat": 0.4}, "code": {"code": 0.8}}, ["code", "chat"])
    assert rows == [("code", 0.5, 0.8, pytest.approx(1.6))]  # chat has no specialist: no row
    assert specialist_ratios({"code": {"code": 1.0}}, ["code"]) == []
    buf = io.StringIO()
    print_report(manifest, buf)
    text = buf.getvalue()
    assert "Specialists against the generalist" in text
    assert all(f"| {d} " in text.split("Specialists against")[1] for d in manifest["domains"])
