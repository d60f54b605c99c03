"""Build profiles: how big the zoo's corpus and models are and how long they train.

- ``tiny``: seconds on a laptop core; for tests (the models are real but barely trained).
- ``default``: at most 8 minutes on a 2-core CPU; for the demo and CPU benchmarks.
- ``gpu``: larger models trained on a CUDA device (falls back to the CPU, slowly, without one).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cosine_zoo.corpus import CorpusSpec
from cosine_zoo.train import ModelSpec, TrainSpec


@dataclass(frozen=True)
class EvalSpec:
    prompts_per_domain: int
    new_tokens: int
    k: int = 4
    ppl_seq_len: int = 128
    ppl_windows: int = 32


@dataclass(frozen=True)
class Profile:
    name: str
    corpus: CorpusSpec
    vocab_size: int
    target: ModelSpec
    target_train: TrainSpec
    drafter: ModelSpec
    drafter_train: TrainSpec
    evaluation: EvalSpec
    device: str = "cpu"  # "cpu", "cuda" or "auto" (cuda when available)

    def as_dict(self) -> dict:
        return asdict(self)


def tiny() -> Profile:
    return Profile(
        name="tiny",
        corpus=CorpusSpec(chars_per_domain=30_000, heldout_fraction=0.2),
        vocab_size=320,
        target=ModelSpec(hidden=64, layers=2, heads=2, intermediate=128, max_positions=1024),
        target_train=TrainSpec(steps=30, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=5),
        drafter=ModelSpec(hidden=32, layers=1, heads=2, intermediate=64, max_positions=1024),
        drafter_train=TrainSpec(steps=20, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=5, distill_alpha=0.5),
        evaluation=EvalSpec(prompts_per_domain=4, new_tokens=16, ppl_seq_len=64, ppl_windows=4),
    )


def default() -> Profile:
    return Profile(
        name="default",
        corpus=CorpusSpec(chars_per_domain=1_200_000),
        vocab_size=2048,
        target=ModelSpec(hidden=192, layers=4, heads=4, intermediate=512),
        # batches of 16 x 128 keep every activation buffer under glibc's 32 MiB mmap threshold
        target_train=TrainSpec(steps=400, batch_size=16, seq_len=128, lr=2e-3, warmup_steps=20),
        drafter=ModelSpec(hidden=96, layers=2, heads=2, intermediate=256),
        drafter_train=TrainSpec(steps=150, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=10, distill_alpha=0.7),
        evaluation=EvalSpec(prompts_per_domain=32, new_tokens=64),
    )


def gpu() -> Profile:
    return Profile(
        name="gpu",
        corpus=CorpusSpec(chars_per_domain=4_000_000),
        vocab_size=4096,
        target=ModelSpec(hidden=512, layers=8, heads=8, intermediate=1376, max_positions=2048),
        target_train=TrainSpec(steps=3000, batch_size=64, seq_len=256, lr=1e-3, warmup_steps=100),
        drafter=ModelSpec(hidden=192, layers=2, heads=4, intermediate=512, max_positions=2048),
        drafter_train=TrainSpec(steps=1500, batch_size=64, seq_len=256, lr=2e-3, warmup_steps=50, distill_alpha=0.7),
        evaluation=EvalSpec(prompts_per_domain=64, new_tokens=128, ppl_seq_len=256),
        device="auto",
    )


PROFILES = {"tiny": tiny, "default": default, "gpu": gpu}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]()
    except KeyError:
        raise ValueError(f"unknown profile {name!r} (choose from {', '.join(PROFILES)})") from None
