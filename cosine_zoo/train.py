"""Training of the zoo's Llama-architecture models: plain next-token training for the target,
next-token plus distillation from the target for the drafters.

Deterministic for a given seed and thread count: weights are initialised after
``torch.manual_seed``, batches are drawn from a seeded ``torch.Generator`` in a fixed order, and
nothing depends on wall-clock time except the reported throughput.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from common.logs import get_logger

log = get_logger("cosine_zoo.train")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one Llama model. ``max_positions`` bounds prompt + generated tokens."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int = 1024


@dataclass(frozen=True)
class TrainSpec:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int = 20
    weight_decay: float = 0.01
    # drafters only: loss = alpha * KL(target || drafter) + (1 - alpha) * cross-entropy
    distill_alpha: float = 0.0
    distill_temperature: float = 1.0


@dataclass(frozen=True)
class TrainResult:
    steps: int
    tokens: int
    final_loss: float  # mean training loss over the last 10% of steps
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def make_llama(spec: ModelSpec, tokenizer: Any, seed: int) -> Any:
    """A freshly initialised LlamaForCausalLM whose vocabulary and special ids follow ``tokenizer``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def count_params(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def sample_batch(streams: Sequence[torch.Tensor], batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch_size, seq_len + 1]`` windows; row i comes from stream ``i % len(streams)``.

    Every domain gets the same share of every batch, whatever its size.
    """
    rows = []
    for i in range(batch_size):
        stream = streams[i % len(streams)]
        if len(stream) <= seq_len + 1:
            raise ValueError(f"a training stream has {len(stream)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        start = int(torch.randint(0, len(stream) - seq_len - 1, (1,), generator=gen))
        rows.append(stream[start : start + seq_len + 1])
    return torch.stack(rows)


def lr_at(step: int, spec: TrainSpec) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) per token, both ``[batch, seq, vocab]``, scaled by T^2."""
    t = temperature
    s = F.log_softmax(student_logits / t, dim=-1)
    p = F.log_softmax(teacher_logits / t, dim=-1)
    return F.kl_div(s.flatten(0, 1), p.flatten(0, 1), log_target=True, reduction="batchmean") * t * t


def train_lm(
    model: Any,
    streams: Sequence[torch.Tensor],
    spec: TrainSpec,
    seed: int,
    teacher: Any | None = None,
    desc: str = "train",
    progress: bool = True,
    device: str = "cpu",
) -> TrainResult:
    """Train ``model`` in place on windows of ``streams``; distil from ``teacher`` when given."""
    from tqdm import tqdm

    model.to(device).train()
    if teacher is not None:
        teacher.to(device).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    tokens = 0
    start = time.perf_counter()
    bar = tqdm(range(spec.steps), desc=desc, disable=not progress, leave=False, dynamic_ncols=True)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec)
        batch = sample_batch(streams, spec.batch_size, spec.seq_len, gen).to(device)
        loss = training_loss(model, batch, spec, teacher)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        flush_denormals(opt)
        losses.append(loss.item())
        tokens += batch.shape[0] * (batch.shape[1] - 1)
        if step % 5 == 0 or step == spec.steps - 1:
            elapsed = time.perf_counter() - start
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / max(elapsed, 1e-9):.0f}")
    bar.close()
    model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    result = TrainResult(
        steps=spec.steps, tokens=tokens, final_loss=sum(tail) / len(tail), seconds=time.perf_counter() - start
    )
    log.info(
        "trained",
        model=desc,
        steps=result.steps,
        tokens=result.tokens,
        final_loss=round(result.final_loss, 4),
        seconds=round(result.seconds, 1),
        tokens_per_s=round(result.tokens_per_s),
    )
    return result


@torch.no_grad()
def flush_denormals(opt: torch.optim.Optimizer, floor: float = 1e-30) -> None:
    """Zero optimizer state below ``floor``.

    Adam's moments of rarely seen embedding rows decay geometrically into the denormal range,
    and arithmetic on denormals is ~100x slower on CPUs (flush-to-zero is set per thread, so
    torch's worker threads do not get it). Values that small never change an update.
    """
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            value = state.get(key)
            if value is not None:
                value.masked_fill_(value.abs() < floor, 0.0)


def training_loss(model: Any, batch: torch.Tensor, spec: TrainSpec, teacher: Any | None) -> torch.Tensor:
    """Cross-entropy on ``batch[:, 1:]`` given ``batch[:, :-1]``, mixed with distillation."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=inputs).logits.float()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    if teacher is None or spec.distill_alpha <= 0:
        return ce
    with torch.no_grad():
        teacher_logits = teacher(input_ids=inputs).logits.float()
    kl = distill_loss(logits, teacher_logits, spec.distill_temperature)
    return spec.distill_alpha * kl + (1 - spec.distill_alpha) * ce
