"""The GPU suite runs whole on a CPU at its smoke size (real services, real checkpoints on disk), and
the family it makes is what it claims: drafters that are the target's first layers, damped deeper
layers, two domains apart in vocabulary."""

import json

import pytest
import torch

from benchmarks import gpu_suite
from benchmarks.synthetic_family import DOMAINS, FAMILIES, build_family, family_prompts


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("family") / "zoo", "smoke", seed=0)


def test_the_family_s_drafters_are_the_target_s_first_layers_and_its_deeper_layers_are_damped(family):
    from transformers import AutoModelForCausalLM

    from cosine_zoo.manifest import load_zoo

    spec = FAMILIES["smoke"]
    zoo = load_zoo(family)  # a zoo like any other: tokenizers match, every checkpoint loads
    assert set(zoo.drafters) == {name for name, _ in spec.drafters} and zoo.domains == DOMAINS
    target = AutoModelForCausalLM.from_pretrained(str(zoo.target.path)).state_dict()
    for name, keep in spec.drafters:
        drafter = AutoModelForCausalLM.from_pretrained(str(zoo.drafters[name].path))
        assert drafter.config.num_hidden_layers == keep
        for key, value in drafter.state_dict().items():
            assert torch.equal(value, target[key]), key
    kept = target[f"model.layers.{spec.cut - 1}.mlp.down_proj.weight"].std()
    damped = target[f"model.layers.{spec.cut}.mlp.down_proj.weight"].std()
    assert damped < 2 * spec.damp * kept  # same init, scaled by damp


def test_the_family_s_domains_draw_from_the_two_halves_of_the_vocabulary():
    spec = FAMILIES["smoke"]
    prompts = family_prompts(spec, seed=0)
    half = spec.vocab // 2
    assert all(t < half for p in prompts["low"] for t in p) and all(t >= half for p in prompts["high"] for t in p)
    lo, hi = spec.prompt_words
    assert all(lo <= len(p) <= hi for rows in prompts.values() for p in rows)
    assert prompts == family_prompts(spec, seed=0) and prompts != family_prompts(spec, seed=1)


def test_the_smoke_suite_runs_every_section_on_a_cpu_and_reports_every_goal(family, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert gpu_suite.main(["--device", "cpu", "--smoke", "--out", str(out), "--family", str(family)]) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == gpu_suite.SCHEMA and set(report["sections"]) == set(gpu_suite.SECTIONS)
    verify = report["sections"]["verify"]
    size = gpu_suite.SIZES["smoke"]
    assert [r["batch"] for r in verify["rows"]] == list(size.batches)
    assert all(r[k] > 0 for r in verify["rows"] for k in ("ours_chain5", "hf_chain5", "ours_tree10", "hf_chain10"))
    assert set(verify["ops_per_pass"]) == {str(b) for b in size.batches}
    eq = report["sections"]["equality"]
    assert eq["float32"]["equal"] == eq["float32"]["prompts"] == size.prompts  # lossless on a CPU, every prompt
    assert eq["speculative"]["equal"] == eq["speculative"]["prompts"] == size.prompts
    e2e = report["sections"]["e2e"]
    assert "error" not in e2e and e2e["greedy_checked"] > 0
    for wl in ("closed_c1", "closed_c16"):
        assert all(v > 0 for v in e2e["workloads"][wl]["tokens_per_s"].values())
    goals = {g["figure"]: g for g in report["goals"]}
    assert len(goals) == len(gpu_suite.GOALS)
    assert goals["verify chain5 batch 32, HF / ours"]["value"] is None  # no batch 32 at the smoke size
    assert goals["float32 greedy == generate, share of prompts"]["met"] is True
    printed = capsys.readouterr().out
    assert "goals" in printed and "ops per pass" in printed


def test_goals_are_read_from_the_sections_they_name():
    sections = {
        "verify": {
            "rows": [
                {
                    "batch": 32,
                    "hf_chain5": 3.0,
                    "ours_chain5": 1.0,
                    "hf_chain10": 4.0,
                    "ours_tree10": 1.0,
                    "bound_chain5": 0.5,
                }
            ]
        },
        "equality": {"float32": {"equal": 3, "prompts": 4}, "speculative": {"equal": 4, "prompts": 4}},
        "e2e": {
            "workloads": {w: {"vs_autoregressive": {"cosine": r}} for w, r in (("closed_c1", 1.2), ("closed_c16", 1.1))}
        },
    }
    goals = {g["figure"]: g for g in gpu_suite.goal_figures(sections)}
    assert goals["verify chain5 batch 32, HF / ours"]["value"] == 3.0
    assert goals["verify tree10 batch 32, HF / ours"]["value"] == 4.0
    assert (
        goals["bound / ours, chain5 batch 32 (>= 1/3)"]["value"] == 0.5
        and goals["bound / ours, chain5 batch 32 (>= 1/3)"]["met"]
    )
    fp32 = goals["float32 greedy == generate, share of prompts"]
    assert fp32["value"] == 0.75 and fp32["met"] is False
    assert goals["e2e cosine / autoregressive tokens/s, 1 client"]["met"] is False
    assert goals["e2e cosine / autoregressive tokens/s, 16 clients"]["met"] is True
    assert goals["verify chain5 batch 8, HF / ours"]["value"] is None


def test_a_missing_cuda_device_and_an_unknown_section_are_refused_in_one_line(tmp_path, capsys):
    if not torch.cuda.is_available():
        assert gpu_suite.main(["--device", "cuda", "--out", str(tmp_path / "r.json")]) == 1
        assert "no CUDA device" in capsys.readouterr().err
    assert gpu_suite.main(["--sections", "verify,nope", "--out", str(tmp_path / "r.json")]) == 2
    assert "unknown section(s) nope" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
