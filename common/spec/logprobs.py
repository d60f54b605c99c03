"""The target's log-probabilities of the tokens a verdict commits (``VerifyItem.logprobs``).

The verifier already holds the target's logits for every position it commits a token at; the
figures are read from those rows, so asking for them costs one log_softmax per committed token and
nothing for requests that do not ask. They are the model's own: log_softmax of the raw logits in
float32, before temperature, top-k and top-p (what the acceptance rule samples from may differ).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.spec.types import NO_LOGPROBS, TokenLogprob


def path_rows(accepted_nodes: Sequence[int]) -> list[int]:
    """The logit rows (``common.spec.acceptance`` layout) the tokens ``accepted + [next]`` were
    chosen at: row 0 for the first (the roots' position), row ``1 + a`` after accepted node ``a``."""
    return [0, *(1 + a for a in accepted_nodes)]


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """``tokens[i]``'s log-probability at ``logits[rows[i]]`` (``logits: [n + 1, vocab]``), with the
    ``top`` most probable alternatives there when ``top > 0``; empty when ``top == NO_LOGPROBS``."""
    if top <= NO_LOGPROBS or not tokens:
        return []
    index = torch.tensor(list(rows), device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [len(tokens), vocab]
    chosen = logp.gather(1, torch.tensor([[t] for t in tokens], device=logits.device)).squeeze(1).tolist()
    if top == 0:
        return [TokenLogprob(int(t), float(c)) for t, c in zip(tokens, chosen)]
    values, ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
    return [
        TokenLogprob(int(t), float(c), tuple(zip(map(int, i), map(float, v))))
        for t, c, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())
    ]
