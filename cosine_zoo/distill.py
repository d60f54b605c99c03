"""Drafters distilled from a pretrained target: teacher data, draft vocabulary, initialisation, training.

What makes a drafter agree with its target is training on the target's own behaviour. Here the
target writes the training data itself: for every training prompt it produces its greedy
continuation, and a drafter learns to predict exactly those tokens given the real context
(sequence-level distillation; the continuation tokens are the target's argmax, so the loss is
cross-entropy against the teacher's top-1). That is precisely what greedy speculative decoding
rewards: a drafted token is accepted when it equals the target's argmax.

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
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from common.draft_vocab import DraftVocab
from common.logs import get_logger

log = get_logger("cosine_zoo.distill")


@dataclass(frozen=True)
class DistillTrain:
    steps: int
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 10


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

    @property
    def labels(self) -> tuple[int, ...]:
        return self.continuation if self.targets is None else self.targets


@dataclass(frozen=True)
class DistillResult:
    steps: int
    tokens: int  # supervised (continuation) tokens seen
    final_loss: float
    seconds: float


@torch.no_grad()
def teacher_examples(target: Any, prompts: Sequence[Sequence[int]], new_tokens: int, eos_id: int, pad_id: int,
                     batch_size: int, desc: str, progress: bool, device: str = "cpu") -> list[Example]:
    """The target's greedy continuation of every prompt: ``target`` is the verifier engine
    (:func:`~cosine_zoo.evaluate.engine_continuations`) or a transformers model (batched
    ``generate``, left padding)."""
    from cosine_zoo.evaluate import engine_continuations, greedy_continuations
    from services.verifier.engine import VerifierEngine

    out: list[Example] = []
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress, leave=False)
    for i in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[i : i + batch_size]]
        if isinstance(target, VerifierEngine):
            conts = engine_continuations(target, chunk, new_tokens, eos_id, batch_size=batch_size)
        else:
            conts = greedy_continuations(target, chunk, new_tokens, eos_id, pad_id, batch_size=batch_size, device=device)
        out += [Example(tuple(p), tuple(c)) for p, c in zip(chunk, conts)]
        bar.update(len(chunk))
    bar.close()
    return out


@torch.no_grad()
def teacher_forced_examples(target: Any, windows: Sequence[Sequence[int]], context: int, batch_size: int,
                            desc: str, progress: bool, device: str = "cpu") -> list[Example]:
    """Real-text windows labelled with the target's argmax at every position after the first ``context``
    tokens: five times cheaper per labelled token than generation, and the labels are still the target's."""
    out: list[Example] = []
    bar = tqdm(total=len(windows), desc=desc, unit="window", disable=not progress, leave=False)
    for i in range(0, len(windows), batch_size):
        chunk = [list(w) for w in windows[i : i + batch_size]]
        width = min(len(w) for w in chunk)
        ids = torch.tensor([w[:width] for w in chunk], dtype=torch.long, device=device)
        pred = target(input_ids=ids).logits[:, context - 1 : width - 1].argmax(-1).cpu().tolist()
        for w, labels in zip(chunk, pred):
            out.append(Example(tuple(w[:context]), tuple(w[context:width]), tuple(labels)))
        bar.update(len(chunk))
    bar.close()
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


def choose_draft_vocab(examples: Sequence[Example], size: int, target_vocab_size: int,
                       always: Sequence[int] = ()) -> DraftVocab:
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
        vocab_size=vocab.size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=len(picked), num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=getattr(tc, "head_dim", None),
        max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
        rope_parameters=getattr(tc, "rope_parameters", None), hidden_act=tc.hidden_act,
        tie_word_embeddings=True, bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id,
        pad_token_id=tc.pad_token_id, attention_bias=getattr(tc, "attention_bias", False),
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


def train_drafter(drafter: Any, examples: Sequence[Example], vocab: DraftVocab, spec: DistillTrain, seed: int,
                  desc: str, progress: bool, device: str = "cpu") -> DistillResult:
    """Cross-entropy on the teacher's continuations; frozen embedding; cosine-decayed AdamW."""
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
        ids, labels = make_batch([examples[i] for i in pick], vocab)
        logits = drafter(input_ids=ids.to(device)).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.to(device).flatten(), ignore_index=-100)
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
def draft_matches(drafter: Any, vocab: DraftVocab | None, examples: Sequence[Example], batch_size: int = 16,
                  device: str = "cpu") -> list[list[bool]]:
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
