"""Evaluation of a target and its drafters: perplexity per domain and the acceptance matrix.

Acceptance is that of greedy chain drafting with speculation length k: each round the drafter
proposes k tokens greedily from the committed prefix, the target accepts the longest prefix of
them equal to its own greedy tokens, and adds one token of its own (correction or bonus).

Because the output of greedy speculative decoding is exactly the target's greedy continuation
``c``, a round never needs the target at all once ``c`` is known:

    accepted(t) = min(k, n - t, length of the run of j >= t with argmax_drafter(prefix + c[:j]) == c[j])
    next round starts at t + accepted(t) + 1

and ``argmax_drafter(prefix + c[:j])`` for every j comes from one teacher-forced forward pass of
the drafter over ``prefix + c``. Works for any causal LM pair sharing a tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AcceptanceStats:
    rounds: int
    accepted: int

    @property
    def mean_accepted(self) -> float:
        """Mean number of drafted tokens the target accepts per round."""
        return self.accepted / self.rounds if self.rounds else 0.0


def encode_prompts(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(list(prompts))["input_ids"]]


@torch.no_grad()
def greedy_continuations(
    model: Any,
    prompts: list[list[int]],
    new_tokens: int,
    eos_id: int,
    pad_id: int,
    batch_size: int = 16,
    device: str = "cpu",
) -> list[list[int]]:
    """The target's greedy continuation of each prompt: ``new_tokens`` tokens, or up to its first EOS."""
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        ids, mask = left_pad(chunk, pad_id)
        gen = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )
        for row in gen[:, ids.shape[1] :].tolist():
            out.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return out


def engine_continuations(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    eos_id: int,
    batch_size: int = 32,
    observe: Callable[[int, torch.Tensor], None] | None = None,
) -> list[list[int]]:
    """The continuations of :func:`greedy_continuations`, decoded by the verifier engine itself
    (:class:`common.runtime.verifier_engine.VerifierEngine`): one ``verify`` call a batch, the prompts'
    prefill and then ``new_tokens`` plain steps that stop at ``eos_id``, so the argmax is the one the
    verifier serves, faster than transformers' ``generate`` on a CPU, and the same tokens.

    ``observe(prompt index, logits [1, vocab])`` sees the logits that chose each continuation
    token, in order (``VerifierEngine.observe_logits``)."""
    from common.spec.types import VerifyItem

    out: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        ids = [f"teacher-{i + j}" for j in range(len(chunk))]
        index = {rid: i + j for j, rid in enumerate(ids)}
        if observe is not None:
            engine.observe_logits = lambda rid, logits: observe(index[rid], logits)
        try:
            outcome = engine.verify(
                [
                    VerifyItem(rid, append_ids=tuple(p), plain_steps=new_tokens, stop_ids=(eos_id,))
                    for rid, p in zip(ids, chunk)
                ]
            )
            for verdict in outcome.verdicts:
                if not verdict.ok:
                    raise RuntimeError(f"teacher prompt {verdict.request_id}: {verdict.error}")
                out.append(list(verdict.new_tokens))
        finally:
            engine.observe_logits = None
            for rid in ids:
                engine.release(rid)
    return out


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[r, width - len(s) :] = 1
    return ids, mask


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[r, : len(s)] = 1
    return ids, mask


@torch.no_grad()
def draft_matches(
    drafter: Any,
    prompts: list[list[int]],
    continuations: list[list[int]],
    pad_id: int,
    batch_size: int = 16,
    device: str = "cpu",
) -> list[list[bool]]:
    """For each continuation token c[j]: does the drafter's greedy token after ``prompt + c[:j]`` equal c[j]?"""
    out: list[list[bool]] = []
    for i in range(0, len(prompts), batch_size):
        seqs = [p + c for p, c in zip(prompts[i : i + batch_size], continuations[i : i + batch_size])]
        ids, mask = right_pad(seqs, pad_id)
        pred = drafter(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.argmax(-1).cpu()
        for r, (p, c) in enumerate(zip(prompts[i : i + batch_size], continuations[i : i + batch_size])):
            # logits at position q predict token q + 1; c[j] sits at position len(p) + j
            guesses = pred[r, len(p) - 1 : len(p) - 1 + len(c)].tolist()
            out.append([g == t for g, t in zip(guesses, c)])
    return out


def simulate_rounds(matches: Sequence[bool], k: int) -> AcceptanceStats:
    """Greedy chain drafting over one continuation, given per-token drafter/target agreement."""
    n, t, rounds, accepted = len(matches), 0, 0, 0
    while t < n:
        a = 0
        while a < k and t + a < n and matches[t + a]:
            a += 1
        rounds += 1
        accepted += a
        t += a + 1  # the target adds one token: correction on rejection, bonus after a full accept
    return AcceptanceStats(rounds, accepted)


def acceptance(matches: Sequence[Sequence[bool]], k: int) -> AcceptanceStats:
    stats = [simulate_rounds(m, k) for m in matches]
    return AcceptanceStats(sum(s.rounds for s in stats), sum(s.accepted for s in stats))


@torch.no_grad()
def perplexity(model: Any, stream: torch.Tensor, seq_len: int, max_windows: int, device: str = "cpu") -> float:
    """exp(mean next-token NLL) over non-overlapping ``seq_len`` windows of a held-out token stream."""
    n_windows = min(max_windows, (len(stream) - 1) // seq_len)
    if n_windows < 1:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one window of {seq_len}")
    total, count = 0.0, 0
    for w in range(0, n_windows, 8):
        rows = [stream[j * seq_len : j * seq_len + seq_len + 1] for j in range(w, min(w + 8, n_windows))]
        batch = torch.stack(rows).to(device)
        logits = model(input_ids=batch[:, :-1]).logits.float()
        nll = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total += float(nll)
        count += batch[:, 1:].numel()
    return math.exp(total / count)
