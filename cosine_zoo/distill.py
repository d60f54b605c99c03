"""Drafters distilled from a pretrained target: teacher data, draft vocabulary, initialisation, training.

What makes a drafter agree with its target is training on the target's own behaviour. Here the
target writes the training data itself: for every training prompt it produces its greedy
continuation, and a drafter learns to predict exactly those tokens given the real context
(sequence-level distillation; the continuation tokens are the target's argmax, so the loss is
cross-entropy against the teacher's top-1). That is precisely what greedy speculative decoding
rewards: a drafted token is accepted when it equals the target's argmax.

With ``soft_top_k`` the teacher also records, at every continuation position, its ``k`` most likely
next tokens and their log-probabilities (recorded from the logits the verifier engine decodes the
continuation with, so at no extra pass), and training mixes cross-entropy against that
distribution into the loss (``soft_weight``): how near the runners-up were is what a few thousand
examples cannot otherwise teach, and a drafter that learns it generalises to held-out prompts
instead of memorising its training continuations.

A drafter is a 2-layer Llama of the target's width, initialised from the target: its embedding
(tied with its output layer) is the target's embedding rows of the draft vocabulary (the ``N``
most frequent tokens of the teacher data), its layers are copies of chosen target layers (the
first and the last by default), its final norm the target's. The embedding stays frozen; the
layers and norms train. Domain specialists start from the trained generalist and continue on
their domain only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from common.logs import get_logger
from common.runtime.draft_vocab import DraftVocab

log = get_logger("cosine_zoo.distill")


@dataclass(frozen=True)
class DistillTrain:
    steps: int
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 10
    soft_weight: float = 0.0  # share of the loss against the teacher's top-k distribution (examples with soft labels)


@dataclass(frozen=True)
class SoftLabels:
    """The target's ``k`` most likely next tokens at each labelled position: target ids ``[n, k]``
    (int32) and their log-probabilities over the whole vocabulary ``[n, k]`` (float16)."""

    ids: torch.Tensor
    logprobs: torch.Tensor


@dataclass(frozen=True)
class Example:
    """One teacher example: a context and what the drafter must predict after it.

    Generated: ``prompt`` is real text, ``continuation`` the target's greedy continuation, and
    each continuation token is its own label (it is the target's argmax there). Teacher-forced:
    ``prompt + continuation`` is real text and ``targets[j]`` is the target's argmax after
    ``prompt + continuation[:j]`` (one prefill pass labels every position).
    """

    prompt: tuple[int, ...]
    continuation: tuple[int, ...]
    targets: tuple[int, ...] | None = None
    soft: SoftLabels | None = field(default=None, compare=False)

    @property
    def labels(self) -> tuple[int, ...]:
        return self.continuation if self.targets is None else self.targets


@dataclass(frozen=True)
class DistillResult:
    steps: int
    tokens: int  # supervised (continuation) tokens seen
    final_loss: float
    seconds: float


def soft_labels(logits: torch.Tensor, top_k: int) -> SoftLabels:
    """The ``top_k`` most likely next tokens of each row of ``logits [n, vocab]`` and their log-probabilities."""
    top = torch.log_softmax(logits.float(), -1).topk(min(top_k, logits.shape[-1]), -1)
    return SoftLabels(top.indices.to(torch.int32).cpu(), top.values.to(torch.float16).cpu())


@torch.no_grad()
def teacher_examples(
    target: Any,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    eos_id: int,
    pad_id: int,
    batch_size: int,
    desc: str,
    progress: bool,
    device: str = "cpu",
    top_k: int = 0,
) -> list[Example]:
    """The target's greedy continuation of every prompt: ``target`` is the verifier engine
    (:func:`~cosine_zoo.evaluate.engine_continuations`) or a transformers model (batched
    ``generate``, left padding). With ``top_k``, each example carries the target's top-k at every
    continuation token: recorded from the logits the engine decodes with (no pass of its own), or
    from one teacher-forced pass of the transformers model (:func:`with_soft_labels`)."""
    from common.runtime.verifier_engine import VerifierEngine
    from cosine_zoo.evaluate import engine_continuations, greedy_continuations

    out: list[Example] = []
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress, leave=False)
    for i in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[i : i + batch_size]]
        if isinstance(target, VerifierEngine):
            rows: list[list[SoftLabels]] = [[] for _ in chunk]  # each token's top-k as it is decoded
            observe = (lambda j, logits: rows[j].append(soft_labels(logits[-1:], top_k))) if top_k > 0 else None
            conts = engine_continuations(target, chunk, new_tokens, eos_id, batch_size=batch_size, observe=observe)
            for p, c, r in zip(chunk, conts, rows):
                soft = None
                if top_k > 0:
                    if len(r) != len(c):
                        raise RuntimeError(f"teacher: {len(r)} logits rows for a continuation of {len(c)} tokens")
                    soft = SoftLabels(torch.cat([x.ids for x in r]), torch.cat([x.logprobs for x in r]))
                out.append(Example(tuple(p), tuple(c), soft=soft))
        else:
            conts = greedy_continuations(
                target, chunk, new_tokens, eos_id, pad_id, batch_size=batch_size, device=device
            )
            got = [Example(tuple(p), tuple(c)) for p, c in zip(chunk, conts)]
            out += with_soft_labels(target, got, top_k, batch_size, device) if top_k > 0 else got
        bar.update(len(chunk))
    bar.close()
    return out


@torch.no_grad()
def teacher_forced_examples(
    target: Any,
    windows: Sequence[Sequence[int]],
    context: int,
    batch_size: int,
    desc: str,
    progress: bool,
    device: str = "cpu",
    top_k: int = 0,
) -> list[Example]:
    """Real-text windows labelled with the target's argmax at every position after the first ``context``
    tokens: five times cheaper per labelled token than generation, and the labels are still the target's
    (with ``top_k``, its top-k there too)."""
    out: list[Example] = []
    bar = tqdm(total=len(windows), desc=desc, unit="window", disable=not progress, leave=False)
    for i in range(0, len(windows), batch_size):
        chunk = [list(w) for w in windows[i : i + batch_size]]
        width = min(len(w) for w in chunk)
        ids = torch.tensor([w[:width] for w in chunk], dtype=torch.long, device=device)
        logits = target(input_ids=ids).logits[:, context - 1 : width - 1]
        pred = logits.argmax(-1).cpu().tolist()
        for r, (w, labels) in enumerate(zip(chunk, pred)):
            soft = soft_labels(logits[r], top_k) if top_k > 0 else None
            out.append(Example(tuple(w[:context]), tuple(w[context:width]), tuple(labels), soft=soft))
        bar.update(len(chunk))
    bar.close()
    return out


@torch.no_grad()
def with_soft_labels(
    model: Any, examples: Sequence[Example], top_k: int, batch_size: int, device: str = "cpu"
) -> list[Example]:
    """Every example with a transformers model's top-``top_k`` at each continuation token, from one
    teacher-forced pass a batch (right padding)."""
    from cosine_zoo.evaluate import right_pad

    out: list[Example] = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        ids, mask = right_pad([ex.prompt + ex.continuation for ex in chunk], 0)
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        for r, ex in enumerate(chunk):
            start = len(ex.prompt) - 1
            out.append(replace(ex, soft=soft_labels(logits[r, start : start + len(ex.continuation)], top_k)))
    return out


def text_windows(tokenizer: Any, docs: Sequence[str], count: int, length: int) -> list[list[int]]:
    """Up to ``count`` windows of ``length`` tokens cut from the documents in order (documents
    joined by a newline)."""
    stream: list[int] = []
    sep = tokenizer("\n", add_special_tokens=False)["input_ids"]
    for doc in docs:
        if len(stream) >= count * length:
            break
        stream += tokenizer(doc, add_special_tokens=False)["input_ids"] + sep
    return [stream[i : i + length] for i in range(0, len(stream) - length + 1, length)][:count]


def choose_draft_vocab(
    examples: Sequence[Example], size: int, target_vocab_size: int, always: Sequence[int] = ()
) -> DraftVocab:
    """The ``size`` most frequent target tokens of the teacher data (ties by id), ``always`` included.

    Target id of draft id 0 is the fallback for unknown inputs, so the most frequent token goes first.
    """
    counts: Counter[int] = Counter()
    for ex in examples:
        counts.update(ex.prompt)
        counts.update(ex.continuation)
        if ex.targets is not None:
            counts.update(ex.targets)
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    must = [t for t in dict.fromkeys(always) if 0 <= t < target_vocab_size]
    chosen = list(dict.fromkeys(ranked[: max(0, size - len(must))] + must))
    for t in range(target_vocab_size):  # pad with the lowest unused ids when the data is small
        if len(chosen) >= min(size, target_vocab_size):
            break
        if t not in counts and t not in must:
            chosen.append(t)
    return DraftVocab.from_target_ids(chosen[:size], target_vocab_size)


def resolve_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    """Target layer indices (negative counts from the end), validated."""
    out = [li if li >= 0 else num_layers + li for li in layers]
    if not out or not all(0 <= li < num_layers for li in out):
        raise ValueError(f"drafter layers {list(layers)} do not fit a target of {num_layers} layers")
    return out


def init_drafter(target: Any, vocab: DraftVocab, layers: Sequence[int], seed: int) -> Any:
    """A Llama drafter of the target's width, initialised from the target (see the module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    picked = resolve_layers(layers, tc.num_hidden_layers)
    cfg = LlamaConfig(
        vocab_size=vocab.size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=len(picked),
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", None),
        max_position_embeddings=tc.max_position_embeddings,
        rms_norm_eps=tc.rms_norm_eps,
        rope_parameters=getattr(tc, "rope_parameters", None),
        hidden_act=tc.hidden_act,
        tie_word_embeddings=True,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        pad_token_id=tc.pad_token_id,
        attention_bias=getattr(tc, "attention_bias", False),
    )
    torch.manual_seed(seed)
    drafter = LlamaForCausalLM(cfg)
    with torch.no_grad():
        drafter.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight[vocab.to_target])
        for i, li in enumerate(picked):
            drafter.model.layers[i].load_state_dict(target.model.layers[li].state_dict())
        drafter.model.norm.load_state_dict(target.model.norm.state_dict())
    drafter.config.cosine_init_layers = picked
    return drafter


def make_batch(batch: Sequence[Example], vocab: DraftVocab) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded draft-space inputs ``[B, W]`` and labels ``[B, W]`` (-100 off the continuation).

    Logits at position ``q`` predict token ``q + 1``; continuation token ``j`` sits at ``len(prompt) + j``.
    A continuation token outside the draft vocabulary cannot be proposed and is not supervised.
    """
    seqs = [ex.prompt + ex.continuation for ex in batch]
    width = max(len(s) for s in seqs) - 1
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for r, (ex, seq) in enumerate(zip(batch, seqs)):
        full = torch.tensor(seq, dtype=torch.long)
        ids[r, : len(seq) - 1] = vocab.to_draft[full[:-1]]
        cont = torch.tensor(ex.labels, dtype=torch.long)
        lab = vocab.to_draft[cont]
        lab[vocab.to_target[lab] != cont] = -100
        labels[r, len(ex.prompt) - 1 : len(seq) - 1] = lab
    return ids, labels


def soft_batch(batch: Sequence[Example], vocab: DraftVocab, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k distributions at :func:`make_batch`'s positions, in draft space: draft
    ids ``[B, W, k]`` and probabilities ``[B, W, k]``, renormalised over the tokens the draft
    vocabulary holds (zero elsewhere, and wherever an example has no soft labels)."""
    k = max((ex.soft.ids.shape[1] for ex in batch if ex.soft is not None), default=1)
    idx = torch.zeros((len(batch), width, k), dtype=torch.long)
    probs = torch.zeros((len(batch), width, k))
    for r, ex in enumerate(batch):
        if ex.soft is None:
            continue
        ids = ex.soft.ids.long()
        draft = vocab.to_draft[ids]
        p = ex.soft.logprobs.float().exp() * (vocab.to_target[draft] == ids)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
        start = len(ex.prompt) - 1
        n, kk = ids.shape
        idx[r, start : start + n, :kk] = draft
        probs[r, start : start + n, :kk] = p
    return idx, probs


def distill_loss(
    logits: torch.Tensor, labels: torch.Tensor, soft: tuple[torch.Tensor, torch.Tensor] | None, soft_weight: float
) -> torch.Tensor:
    """Cross-entropy on the teacher's tokens, mixed with cross-entropy against its top-k
    distribution (``soft_weight`` of the loss) where the batch carries one."""

    def hard() -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    if soft is None or soft_weight <= 0:
        return hard()
    idx, probs = soft
    logq = torch.log_softmax(logits.float(), -1).gather(-1, idx)
    positions = (probs.sum(-1) > 0).sum().clamp_min(1)
    against_top_k = -(probs * logq).sum() / positions
    return against_top_k if soft_weight >= 1 else (1 - soft_weight) * hard() + soft_weight * against_top_k


def train_drafter(
    drafter: Any,
    examples: Sequence[Example],
    vocab: DraftVocab,
    spec: DistillTrain,
    seed: int,
    desc: str,
    progress: bool,
    device: str = "cpu",
) -> DistillResult:
    """Cross-entropy on the teacher's continuations (mixed with its top-k distribution where the
    examples carry one, ``spec.soft_weight``); frozen embedding; cosine-decayed AdamW."""
    if not examples:
        raise ValueError(f"{desc}: no teacher examples to train on")
    drafter.to(device).train()
    drafter.model.embed_tokens.weight.requires_grad_(False)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    tokens = 0
    start = time.perf_counter()
    bar = tqdm(range(spec.steps), desc=desc, unit="step", disable=not progress, leave=False)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec)
        pick = torch.randint(len(examples), (spec.batch_size,), generator=gen).tolist()
        batch = [examples[i] for i in pick]
        ids, labels = make_batch(batch, vocab)
        soft = None
        if spec.soft_weight > 0 and any(ex.soft is not None for ex in batch):
            soft = tuple(t.to(device) for t in soft_batch(batch, vocab, ids.shape[1]))
        logits = drafter(input_ids=ids.to(device)).logits
        loss = distill_loss(logits, labels.to(device), soft, spec.soft_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        tokens += int((labels != -100).sum())
        if progress and step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    drafter.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    return DistillResult(spec.steps, tokens, sum(tail) / len(tail), time.perf_counter() - start)


def lr_at(step: int, spec: DistillTrain) -> float:
    import math

    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def draft_matches(
    drafter: Any, vocab: DraftVocab | None, examples: Sequence[Example], batch_size: int = 16, device: str = "cpu"
) -> list[list[bool]]:
    """Per continuation token: does the drafter's greedy token after ``prompt + continuation[:j]`` equal it?

    Teacher-forced, one pass per batch (see :mod:`cosine_zoo.evaluate`); in target ids.
    """
    out: list[list[bool]] = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        seqs = [torch.tensor(ex.prompt + ex.continuation, dtype=torch.long) for ex in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = s if vocab is None else vocab.to_draft[s]
            mask[r, : len(s)] = 1
        pred = drafter(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.argmax(-1).cpu()
        if vocab is not None:
            pred = vocab.to_target[pred]
        for r, ex in enumerate(chunk):
            p, c = len(ex.prompt), ex.continuation
            out.append([int(g) == t for g, t in zip(pred[r, p - 1 : p - 1 + len(c)].tolist(), c)])
    return out
