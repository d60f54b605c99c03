"""What the gateway relays of a generation, whichever front serves it (no protobuf here): the
pieces of text with their tokens, why a generation ended, and its speculative-decoding figures.
:mod:`services.convert` turns the router's messages into these and these into the gateway's."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.spec.types import TokenLogprob


class FinishReason(enum.Enum):
    """Why a generation ended. The value is the name the gateway's logs and metrics use."""

    UNSPECIFIED = "unspecified"
    LENGTH = "length"  # max_new_tokens reached
    EOS = "eos"  # the target produced its end-of-sequence token
    STOP = "stop"  # a stop string or stop token matched
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class SpecStats:
    """One request's speculation figures, as the router reports them with its last chunk."""

    rounds: int = 0
    mean_accepted_len: float = 0.0  # accepted draft tokens per round (the extra target token excluded)
    draft_tokens: int = 0  # nodes proposed over all rounds
    accepted_tokens: int = 0  # draft tokens accepted over all rounds
    drafters_used: tuple[str, ...] = ()
    accepted_by_drafter: dict[str, int] = field(default_factory=dict)
    grammar_pruned_tokens: int = 0  # draft tokens its constraint forbade (pruned before verification)


@dataclass(frozen=True)
class RouterChunk:
    """One message of the router's token stream: newly committed tokens, and on the last one
    why the request ended and its figures."""

    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason = FinishReason.UNSPECIFIED
    stats: SpecStats = field(default_factory=SpecStats)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asked


@dataclass
class Progress:
    """One piece of a generation as the gateway relays it; ``logprobs`` has one entry per token
    of ``token_ids`` when the request asked for them (``GenerationRequest.logprobs``)."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason = FinishReason.UNSPECIFIED
    stats: SpecStats | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
