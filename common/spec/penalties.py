"""Repetition, presence and frequency penalties: the target's logits as a penalised request sees them.

A penalty changes the target's distribution, so to stay lossless (the output is the *penalised*
target's own) the verifier applies it to the target's logits before the acceptance rule, row by
row of a token tree, each row with the counts of its own context: the committed sequence plus the
accepted draft tokens above it on its path (``common.spec.acceptance`` layout: row 0 is after the
last committed token, row ``1 + i`` after node ``i``). Drafters are not told: they propose as
before, and only what is accepted changes.

Semantics, as the servers clients know:

- ``repetition_penalty`` (transformers' ``RepetitionPenaltyLogitsProcessor``, vLLM): the logit of
  every token seen in the prompt or the output is divided by it when positive and multiplied by it
  when negative; ``1`` is off.
- ``presence_penalty`` and ``frequency_penalty`` (OpenAI): ``logit -= frequency * count +
  presence * (count > 0)`` with ``count`` the token's occurrences in the output only.

The repetition penalty is applied first, then presence and frequency (vLLM's order). Requests
without penalties never reach this module, so they pay nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.spec.types import SamplingParams, TokenTree


def penalised(params: SamplingParams) -> bool:
    """Whether ``params`` asks for any penalty (then the rows must go through :func:`penalise`)."""
    return params.penalised


def path_tokens(tree: TokenTree) -> list[list[int]]:
    """Per logit row, the draft tokens on its path (root first): ``[]`` for row 0, the ancestors of
    node ``i`` and ``i`` itself for row ``1 + i``."""
    paths: list[list[int]] = [[]]
    for i, p in enumerate(tree.parents):
        paths.append([*paths[p + 1], tree.tokens[i]])
    return paths


def penalise(
    logits: torch.Tensor, tree: TokenTree, prompt: Sequence[int], output: Sequence[int], params: SamplingParams
) -> torch.Tensor:
    """``logits: [len(tree) + 1, vocab]`` penalised row by row (a new float32 tensor; the input is
    untouched, so log-probabilities stay the model's raw ones). ``prompt`` and ``output`` are the
    request's committed tokens, split where its output begins."""
    rows, vocab = logits.shape
    device = logits.device
    x = logits.float().clone()
    paths = path_tokens(tree)
    row_index = torch.tensor([r for r, path in enumerate(paths) for _ in path], dtype=torch.long, device=device)
    tok_index = torch.tensor([t for path in paths for t in path], dtype=torch.long, device=device)
    counts = torch.zeros(vocab, dtype=torch.float32, device=device)
    if output:
        counts += torch.bincount(torch.tensor(list(output), dtype=torch.long, device=device), minlength=vocab).float()
    counts = counts.unsqueeze(0).repeat(rows, 1)  # [rows, vocab]: output so far + each row's path
    if len(tok_index):
        counts.index_put_((row_index, tok_index), torch.ones(len(tok_index), device=device), accumulate=True)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt:
            seen[:, torch.tensor(list(prompt), dtype=torch.long, device=device)] = True
        r = float(params.repetition_penalty)
        x = torch.where(seen, torch.where(x < 0, x * r, x / r), x)
    if params.frequency_penalty or params.presence_penalty:
        x = x - float(params.frequency_penalty) * counts - float(params.presence_penalty) * (counts > 0).float()
    return x


def acceptance_logits(
    logits: torch.Tensor, tree: TokenTree, committed: Sequence[int], prompt_len: int, params: SamplingParams
) -> torch.Tensor:
    """What the acceptance rule decides on: ``logits`` itself without penalties (no cost), else
    the rows :func:`penalise` gives, the committed sequence split at ``prompt_len``."""
    if not penalised(params):
        return logits
    return penalise(logits, tree, committed[:prompt_len], committed[prompt_len:], params)
