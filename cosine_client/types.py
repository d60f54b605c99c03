"""Results of the SDK as plain dataclasses (protobuf stays inside the client)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = {0: "unspecified", 1: "length", 2: "eos", 3: "stop", 4: "cancelled"}


@dataclass(frozen=True)
class SpecStats:
    rounds: int = 0
    mean_accepted_len: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafters_used: tuple[str, ...] = ()
    accepted_by_drafter: dict[str, int] = field(default_factory=dict)
    grammar_pruned_tokens: int = 0  # draft tokens its constraint forbade (pruned, never verified)

    @classmethod
    def from_pb(cls, pb: Any) -> SpecStats:
        return cls(
            pb.rounds,
            pb.mean_accepted_len,
            pb.draft_tokens,
            pb.accepted_tokens,
            tuple(pb.drafters_used),
            dict(pb.accepted_by_drafter),
            pb.grammar_pruned_tokens,
        )


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one generated token (log_softmax of its raw logits,
    before temperature, top-k and top-p), and its most probable alternatives at that position
    as ``(token id, logprob)``, best first, when asked (``logprobs=k``)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_pb(cls, pb: Any) -> TokenLogprob:
        return cls(pb.token, pb.logprob, tuple(zip(pb.top_tokens, pb.top_logprobs)))

    def to_dict(self) -> dict[str, Any]:
        return {"token": self.token, "logprob": self.logprob, "top": [list(t) for t in self.top]}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Generation:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    stats: SpecStats
    usage: Usage
    elapsed_s: float = 0.0
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when asked for (logprobs=k)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "elapsed_s": self.elapsed_s,
            "usage": {"prompt_tokens": self.usage.prompt_tokens, "completion_tokens": self.usage.completion_tokens},
            "stats": {
                "rounds": self.stats.rounds,
                "mean_accepted_len": self.stats.mean_accepted_len,
                "draft_tokens": self.stats.draft_tokens,
                "accepted_tokens": self.stats.accepted_tokens,
                "drafters_used": list(self.stats.drafters_used),
                "accepted_by_drafter": dict(self.stats.accepted_by_drafter),
                "grammar_pruned_tokens": self.stats.grammar_pruned_tokens,
            },
            **({"logprobs": [e.to_dict() for e in self.logprobs]} if self.logprobs else {}),
        }


@dataclass(frozen=True)
class Chunk:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str = ""
    stats: SpecStats | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when asked for (logprobs=k)
