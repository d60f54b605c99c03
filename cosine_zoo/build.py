"""Build a zoo: corpus -> tokenizer -> target -> drafters -> evaluation -> ``zoo.json``.

Each stage leaves a ``stage.json`` next to its output with a key derived from the profile and
the seed; a rebuild skips every stage whose output is complete and whose key matches, so an
interrupted build resumes where it stopped. ``force`` starts from scratch.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.logs import get_logger
from common.runtime.checkpoints import (
    CheckpointError,
    check_checkpoint_dir,
    load_causal_lm,
    load_tokenizer,
    tokenizer_fingerprint,
)
from cosine_zoo import evaluate
from cosine_zoo.build_distilled import run_distilled_build
from cosine_zoo.corpus import Corpus, build_corpus, make_prompts, take_chars
from cosine_zoo.manifest import (
    FORMAT,
    MANIFEST,
    PROMPTS,
    Zoo,
    evaluation_record,
    load_zoo,
    write_manifest,
    write_prompts,
)
from cosine_zoo.profiles import DistillProfile, Profile
from cosine_zoo.stages import GENERALIST, BuildOptions, read_stage, resolve_device, seed_for, stage_key, write_stage
from cosine_zoo.tokenizer import check_conventions, encode_documents, save_tokenizer, train_tokenizer
from cosine_zoo.train import ModelSpec, TrainResult, TrainSpec, count_params, make_llama, train_lm

log = get_logger("cosine_zoo.build")


@dataclass(frozen=True)
class ModelJob:
    """One model to train: where it goes, on which domains, from which teacher."""

    name: str
    rel_path: str
    domains: tuple[str, ...]
    spec: ModelSpec
    train: TrainSpec


def build_zoo(opts: BuildOptions) -> Zoo:
    """Build (or finish building) the zoo described by ``opts``; torch's global settings are restored after."""
    with torch_settings(opts.threads):
        if isinstance(opts.profile, DistillProfile):
            if opts.force and opts.out.exists():
                clear_zoo(opts.out)
            return run_distilled_build(opts, opts.profile)
        return run_build(opts)


def run_build(opts: BuildOptions) -> Zoo:
    started = time.perf_counter()
    device = resolve_device(opts.profile.device)
    out = opts.out
    if opts.force and out.exists():
        clear_zoo(out)
    out.mkdir(parents=True, exist_ok=True)
    log.info(
        "building zoo",
        out=str(out),
        profile=opts.profile.name,
        seed=opts.seed,
        device=device,
        threads=torch.get_num_threads(),
    )
    timings: dict[str, float] = {}

    corpus = build_corpus(opts.profile.corpus, opts.seed)
    tokenizer = tokenizer_stage(out / "tokenizer", corpus, opts)
    train_streams = {d: torch.tensor(encode_documents(tokenizer, t.train)) for d, t in corpus.domains.items()}
    heldout_streams = {d: torch.tensor(encode_documents(tokenizer, t.heldout)) for d, t in corpus.domains.items()}

    target_job = ModelJob("target", "target", tuple(corpus.names), opts.profile.target, opts.profile.target_train)
    target, target_info = model_stage(target_job, out, tokenizer, train_streams, opts, device, teacher=None)
    timings["target"] = target_info["seconds"]

    drafters: dict[str, Any] = {}
    drafter_info: dict[str, dict[str, Any]] = {}
    for job in drafter_jobs(corpus, opts.profile):
        model, info = model_stage(job, out, tokenizer, train_streams, opts, device, teacher=target)
        drafters[job.name], drafter_info[job.name] = model, info
        timings[job.name] = info["seconds"]

    prompts = make_prompts(corpus, opts.profile.evaluation.prompts_per_domain)
    write_prompts(out, prompts)
    eval_start = time.perf_counter()
    evaluation = evaluate_zoo(target, drafters, tokenizer, prompts, heldout_streams, opts.profile, device)
    timings["evaluation"] = time.perf_counter() - eval_start
    timings["total"] = time.perf_counter() - started

    manifest = {
        "format": FORMAT,
        "profile": opts.profile.name,
        "seed": opts.seed,
        "domains": list(corpus.names),
        "tokenizer": {
            "path": "tokenizer",
            "fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": len(tokenizer),
            "bos_prepended": True,
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token,
        },
        "corpus": {
            d: {"train_docs": len(t.train), "heldout_docs": len(t.heldout), "train_tokens": len(train_streams[d])}
            for d, t in corpus.domains.items()
        },
        "target": manifest_entry(target_job, target_info),
        "drafters": {
            job.name: manifest_entry(job, drafter_info[job.name]) for job in drafter_jobs(corpus, opts.profile)
        },
        "prompts": {"path": PROMPTS, "per_domain": opts.profile.evaluation.prompts_per_domain},
        "evaluation": evaluation,
        "profile_spec": opts.profile.as_dict(),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "timings": {k: round(v, 2) for k, v in timings.items()},
    }
    write_manifest(out, manifest)
    log.info("zoo built", out=str(out), seconds=round(timings["total"], 1))
    return load_zoo(out)


@contextlib.contextmanager
def torch_settings(threads: int | None) -> Iterator[None]:
    """Thread count, deterministic algorithms and flush-to-zero for a build; restored on exit."""
    from transformers.utils import logging as hf_logging

    saved_threads = torch.get_num_threads()
    saved_det = torch.are_deterministic_algorithms_enabled()
    saved_bars = hf_logging.is_progress_bar_enabled()
    if threads:
        torch.set_num_threads(threads)
    keep_freed_memory()
    torch.use_deterministic_algorithms(True, warn_only=True)
    # tiny models produce denormal activations, which are ~100x slower on CPUs
    torch.set_flush_denormal(True)
    hf_logging.disable_progress_bar()  # ours show loss and tokens/s; theirs only say "loading weights"
    try:
        yield
    finally:
        torch.set_num_threads(saved_threads)
        torch.use_deterministic_algorithms(saved_det)
        torch.set_flush_denormal(False)
        if saved_bars:
            hf_logging.enable_progress_bar()


def keep_freed_memory() -> None:
    """Stop glibc from unmapping every freed activation buffer (up to 32 MiB).

    CPU training allocates and frees the same large buffers every step; by default glibc returns
    them to the OS and faults them back in, which costs several times the arithmetic on a small
    VM. No-op where glibc is absent.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 * 1024 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def clear_zoo(out: Path) -> None:
    """Remove what a build writes (and nothing else) from ``out``."""
    for name in ("tokenizer", "target", "drafters", "teacher"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in (MANIFEST, PROMPTS):
        (out / name).unlink(missing_ok=True)


def drafter_jobs(corpus: Corpus, profile: Profile) -> list[ModelJob]:
    jobs = [ModelJob(d, f"drafters/{d}", (d,), profile.drafter, profile.drafter_train) for d in corpus.names]
    jobs.append(
        ModelJob(GENERALIST, f"drafters/{GENERALIST}", tuple(corpus.names), profile.drafter, profile.drafter_train)
    )
    return jobs


def tokenizer_stage(path: Path, corpus: Corpus, opts: BuildOptions) -> Any:
    key = stage_key(opts, "tokenizer")
    if read_stage(path, key) is not None:
        try:
            tokenizer = load_tokenizer(path)
            log.info("tokenizer up to date, skipped", path=str(path))
            return tokenizer
        except CheckpointError as exc:
            log.warning("rebuilding tokenizer", reason=str(exc))
    # every domain contributes the same number of characters to the merges
    budget = min(t.train_chars for t in corpus.domains.values())
    texts = [doc for t in corpus.domains.values() for doc in take_chars(list(t.train), budget)]
    tokenizer = train_tokenizer(texts, opts.profile.vocab_size, max_length=opts.profile.target.max_positions)
    check_conventions(tokenizer)
    shutil.rmtree(path, ignore_errors=True)
    save_tokenizer(tokenizer, path)
    write_stage(path, key, {"vocab_size": len(tokenizer)})
    tokenizer = load_tokenizer(path)  # what every consumer will see
    check_conventions(tokenizer)
    return tokenizer


def model_stage(
    job: ModelJob,
    out: Path,
    tokenizer: Any,
    streams: dict[str, torch.Tensor],
    opts: BuildOptions,
    device: str,
    teacher: Any | None,
) -> tuple[Any, dict[str, Any]]:
    """Train (or load, when already built with this key) one model; returns it with its figures."""
    path = out / job.rel_path
    key = stage_key(opts, job.name)
    record = read_stage(path, key)
    if record is not None:
        try:
            check_checkpoint_dir(path, need_weights=True, need_tokenizer=True)
            model = load_causal_lm(path, device=device)
            log.info("model up to date, skipped", model=job.name, path=str(path))
            return model, record["info"]
        except CheckpointError as exc:
            log.warning("retraining model", model=job.name, reason=str(exc))
    model = make_llama(job.spec, tokenizer, seed=seed_for(opts.seed, job.name))
    result = train_lm(
        model,
        [streams[d] for d in job.domains],
        job.train,
        seed=seed_for(opts.seed, job.name + "/data"),
        teacher=teacher,
        desc=job.name,
        progress=opts.progress,
        device=device,
    )
    info = training_info(model, result)
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    write_stage(path, key, {"info": info})
    return model, info


def training_info(model: Any, result: TrainResult) -> dict[str, Any]:
    return {
        "params": count_params(model),
        "steps": result.steps,
        "tokens": result.tokens,
        "final_loss": round(result.final_loss, 5),
        "seconds": round(result.seconds, 2),
        "tokens_per_s": round(result.tokens_per_s),
    }


def manifest_entry(job: ModelJob, info: dict[str, Any]) -> dict[str, Any]:
    training = {k: v for k, v in info.items() if k not in ("params", "seconds", "tokens_per_s")}
    return {
        "path": job.rel_path,
        "params": info["params"],
        "domains": list(job.domains),
        "architecture": "LlamaForCausalLM",
        "shape": {
            "hidden": job.spec.hidden,
            "layers": job.spec.layers,
            "heads": job.spec.heads,
            "intermediate": job.spec.intermediate,
            "max_positions": job.spec.max_positions,
        },
        "training": training,
        "distill_alpha": job.train.distill_alpha if job.name != "target" else None,
    }


def evaluate_zoo(
    target: Any,
    drafters: dict[str, Any],
    tokenizer: Any,
    prompts: dict[str, list[str]],
    heldout: dict[str, torch.Tensor],
    profile: Profile,
    device: str,
) -> dict[str, Any]:
    """Target perplexity per domain and the drafter x domain acceptance matrix (greedy, chain of k)."""
    spec = profile.evaluation
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    perplexity = {
        d: round(evaluate.perplexity(target, s, spec.ppl_seq_len, spec.ppl_windows, device), 4)
        for d, s in heldout.items()
    }
    matrix: dict[str, dict[str, float]] = {name: {} for name in drafters}
    rounds: dict[str, dict[str, int]] = {name: {} for name in drafters}
    for domain, texts in prompts.items():
        ids = evaluate.encode_prompts(tokenizer, texts)
        conts = evaluate.greedy_continuations(target, ids, spec.new_tokens, eos, pad, device=device)
        for name, drafter in drafters.items():
            stats = evaluate.acceptance(evaluate.draft_matches(drafter, ids, conts, pad, device=device), spec.k)
            matrix[name][domain] = round(stats.mean_accepted, 4)
            rounds[name][domain] = stats.rounds
    log.info("evaluated", perplexity=perplexity, acceptance=matrix)
    return evaluation_record(spec, perplexity, matrix, rounds)
