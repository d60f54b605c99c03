"""Penalised logits row by row: each row of a tree is penalised with the counts of its own path."""

from __future__ import annotations

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from common.spec.acceptance import GreedyRule
from common.spec.penalties import acceptance_logits, path_tokens, penalise, penalised
from common.spec.types import SamplingParams, TokenTree

PARAMS = SamplingParams(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.9)


def reference_row(row: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    ids = torch.tensor([[*prompt, *output]])
    x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, row[None].clone())[0]
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=row.shape[-1]).float()
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()


def test_every_row_has_its_own_paths_counts() -> None:
    tree = TokenTree(tokens=(3, 4, 3, 5, 3), parents=(-1, 0, 0, 2, -1))
    assert path_tokens(tree) == [[], [3], [3, 4], [3, 3], [3, 3, 5], [3]]
    logits = torch.randn(len(tree) + 1, 12, generator=torch.Generator().manual_seed(0)) * 3
    prompt, output = [1, 2, 7], [7, 4, 4]
    got = penalise(logits, tree, prompt, output, PARAMS)
    for r, path in enumerate(path_tokens(tree)):
        torch.testing.assert_close(got[r], reference_row(logits[r], prompt, [*output, *path], PARAMS))


def test_a_penalty_changes_the_greedy_branch() -> None:
    """Two roots: the raw argmax is token 3 (already in the output), the penalised one token 5."""
    logits = torch.zeros(3, 8)
    logits[0, 3], logits[0, 5] = 2.0, 1.5
    tree = TokenTree(tokens=(3, 5), parents=(-1, -1))
    params = SamplingParams(presence_penalty=1.0)
    assert GreedyRule().decide(tree, logits).accepted_nodes == (0,)
    ruled = acceptance_logits(logits, tree, [1, 2, 3], 2, params)
    assert GreedyRule().decide(tree, ruled).accepted_nodes == (1,)
    # counted from the output only: the same token in the prompt is not penalised by presence
    assert GreedyRule().decide(tree, acceptance_logits(logits, tree, [1, 3, 2], 2, params)).accepted_nodes == (0,)


def test_no_penalty_is_the_raw_tensor() -> None:
    logits = torch.randn(2, 8)
    assert not penalised(SamplingParams(temperature=0.5))
    assert acceptance_logits(logits, TokenTree.chain([1]), [1, 2], 1, SamplingParams()) is logits
