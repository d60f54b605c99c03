"""Engine-facing contracts of the speculative core: plain frozen dataclasses and error types.

Protobuf messages stop at the servicers; the drafter and verifier engines speak only these.

Glossary (used the same way in every module):

- **committed sequence**: prompt + every token the target has produced so far for a request.
- **token tree**: the draft of one round, flattened. Node ``i`` holds ``tokens[i]``; ``parents[i]``
  is the index of its parent node or ``-1`` when it hangs directly off the last committed token.
  Parents precede children. A node's **depth** is 1 for a root, parent depth + 1 otherwise; a node
  of depth ``d`` sits at position ``committed_len - 1 + d`` of the sequence.
- **accepted path**: the chain of tree nodes (root first) the target agrees with.
- **next token**: the one token the target adds after the accepted path: the **correction** token
  when a draft was rejected, the **bonus** token when the path ran to a leaf. Every verdict
  commits ``accepted_tokens + [next_token]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property

# ---- errors ------------------------------------------------------------------------------------


class SpecError(RuntimeError):
    """Base class of the speculative core's per-request errors (the message is meant for a client)."""


class KVBudgetExceeded(SpecError):
    """Admitting these tokens would take the engine's KV cache over its configured token budget."""


class ContextTooLong(SpecError):
    """The sequence would exceed the model's maximum context."""


class UnknownRequest(SpecError):
    """The request id has no state in this engine (never seen, or released)."""


class InvalidInput(SpecError):
    """Malformed input: bad token ids, an inconsistent tree, bad sampling parameters."""


def error_kind(exc: BaseException) -> str:
    """The protocol's name for a failure (Verdict.error_kind), which the router maps to a status."""
    if isinstance(exc, KVBudgetExceeded):
        return "kv_budget"
    if isinstance(exc, ContextTooLong):
        return "context"
    if isinstance(exc, InvalidInput):
        return "invalid"
    if isinstance(exc, UnknownRequest):
        return "unknown_request"
    return "internal"


# ---- sampling ------------------------------------------------------------------------------------

CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "grammar", "choice")


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match (structured output; ``common.spec.grammar`` compiles it).

    ``kind`` and ``spec``: ``json_object`` (any JSON object; ``spec`` unused), ``json_schema`` (the
    schema as JSON text), ``regex`` (the output matches it whole), ``grammar`` (a Lark or GBNF
    grammar) or ``choice`` (a JSON list of strings: the output is one of them). The verifier masks
    the target's distribution with the grammar at every position, so the output is constrained
    decoding of the target's own."""

    kind: str
    spec: str = ""

    def validate(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            kinds = ", ".join(CONSTRAINT_KINDS)
            raise InvalidInput(f"sampling.constraint.kind: must be one of {kinds}, got {self.kind!r}")
        if self.kind != "json_object" and not self.spec:
            raise InvalidInput(f"sampling.constraint.spec: a {self.kind} constraint needs its {self.kind}")


@dataclass(frozen=True)
class SamplingParams:
    """How the target picks tokens. ``temperature == 0`` means greedy (argmax).

    ``top_k == 0`` and ``top_p`` of 0 or 1 mean "off". ``seed`` makes a request reproducible: the
    verifier seeds the request's own random generator with it on first sight.

    Penalties (``common.spec.penalties``; 0, 0 and 1 are off): ``presence_penalty`` and
    ``frequency_penalty`` in [-2, 2] (OpenAI's, on the output's tokens), ``repetition_penalty`` > 0
    (transformers' and vLLM's, on the prompt's and the output's). The verifier applies them to the
    target's logits before acceptance, so the output is the penalised target's own.

    ``constraint`` (structured output, :class:`Constraint`): the grammar's mask goes on after the
    penalties and before temperature, top-k and top-p.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalised(self) -> bool:
        """Whether any penalty is on (then the verifier penalises the target's logits)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """Raise :class:`InvalidInput` naming the field (``sampling.temperature: ...``)."""
        if not 0.0 <= self.temperature < math.inf:  # also catches NaN
            raise InvalidInput(f"sampling.temperature: must be a finite number >= 0, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidInput(f"sampling.top_p: must be within [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidInput(f"sampling.top_k: must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # also catches NaN
                raise InvalidInput(f"sampling.{name}: must be within [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise InvalidInput(
                f"sampling.repetition_penalty: must be a finite number > 0, got {self.repetition_penalty}"
            )
        if self.constraint is not None:
            self.constraint.validate()


GREEDY = SamplingParams()


# ---- token tree ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenTree:
    """A draft token tree in flattened form (see the module glossary).

    ``draft_probs``, ``source_masks`` and ``drafter_ids`` are carried for the router's bookkeeping;
    the verifier's decision never depends on them (drafts are deterministic proposals).
    """

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    draft_probs: tuple[float, ...] = ()
    source_masks: tuple[int, ...] = ()
    drafter_ids: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int] | tuple[int, ...]) -> TokenTree:
        """A linear draft: each token is the child of the previous one."""
        return cls(tokens=tuple(tokens), parents=tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def merged(cls, chains: Sequence[Sequence[int]], limit: int | None = None) -> TokenTree:
        """Linear drafts as one tree: a prefix they share is one path, and where they differ the
        rest of each is a branch of its own, as far as ``limit`` nodes in all (the first chains first)."""
        tokens: list[int] = []
        parents: list[int] = []
        for chain in chains:
            parent = -1
            for token in chain:
                node = next((i for i in range(len(tokens)) if parents[i] == parent and tokens[i] == token), None)
                if node is None:
                    if limit is not None and len(tokens) >= limit:
                        break
                    tokens.append(token)
                    parents.append(parent)
                    node = len(tokens) - 1
                parent = node
        return cls(tokens=tuple(tokens), parents=tuple(parents))

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise :class:`InvalidInput` (naming the field, ``tree.parents[3]: ...``) unless parents
        precede children, tokens are in range and the optional per-node arrays have one entry per node."""
        if len(self.tokens) != len(self.parents):
            raise InvalidInput(f"tree.parents: the tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:  # an earlier node only: no forward references, hence no cycles
                raise InvalidInput(f"tree.parents[{i}]: parent {p} must be -1 or an earlier node index (< {i})")
        if vocab_size is not None:
            for i, t in enumerate(self.tokens):
                if not 0 <= t < vocab_size:
                    raise InvalidInput(f"tree.tokens[{i}]: token id {t} outside the vocabulary [0, {vocab_size})")
        if self.draft_probs and len(self.draft_probs) != len(self.tokens):
            raise InvalidInput("tree.draft_probs: must be empty or have one entry per node")
        if self.source_masks and len(self.source_masks) != len(self.tokens):
            raise InvalidInput("tree.source_masks: must be empty or have one entry per node")

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of every node: 1 for a root (child of the last committed token)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return tuple(d)

    @cached_property
    def children(self) -> dict[int, tuple[int, ...]]:
        """Children of every node in index order; key ``-1`` holds the roots."""
        out: dict[int, list[int]] = {-1: []}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
            out.setdefault(i, [])
        return {k: tuple(v) for k, v in out.items()}

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)


# ---- verifier ------------------------------------------------------------------------------------

NO_LOGPROBS = -1  # VerifyItem.logprobs: the request asked for none


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one committed token, and the ``top`` alternatives at its
    position (``(token, logprob)``, most probable first) when they were asked for: log_softmax of
    the target's raw logits in float32, before temperature, top-k and top-p, so the figures say
    what the model thinks whatever the request's sampling."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class VerifyItem:
    """One request inside a verify batch.

    ``append_ids`` are appended to the committed sequence first (the prompt on first sight,
    usually empty afterwards); then ``tree`` is verified on top of it. An empty tree is a plain
    decode step. ``release`` frees the request and ignores the rest.

    ``plain_steps``: the verifier answers only once it has decoded that many tokens in all: the
    verdict's next token, then plain decode steps of the target (one pass each, the batch's other
    stepping requests beside it), stopping early at one of ``stop_ids`` or at the model's context.
    The plain steps of a round that drafts nothing save the round trips between their passes.

    ``step_lookup``: at each plain step the verifier drafts from the request's own text, as the
    router's lookup drafter would (``common.spec.lookup_index``): after a match of ``n`` tokens, up to
    ``step_lookup[n - 1]`` of the tokens that followed it, verified in the step's pass (a
    deterministic proposal: the tokens stay the target's own). ``step_corpus`` likewise from the
    verifier's lookup corpus (``common.spec.lookup_corpus``), in ``domain``'s text ("" or a domain it
    lacks: all of it); where the two chains differ they are siblings. Both empty: plain steps, one
    token each. ``max_tokens`` (0: no cap) caps the tokens the item commits in all, the steps' proposals
    trimmed to fit, so a step that accepts a chain never overshoots the request's length.

    ``logprobs``: ``NO_LOGPROBS`` (the default) computes nothing extra; ``0`` returns the target's
    log-probability of every new token (``Verdict.logprobs``), ``k > 0`` also its ``k`` most
    probable alternatives at each position.

    ``prompt_len``: on first sight, how many of ``append_ids`` are the prompt (the rest: output
    committed before, as a resumed request re-prefills it); 0: all of them. The presence and
    frequency penalties count the output only.
    """

    request_id: str
    append_ids: tuple[int, ...] = ()
    tree: TokenTree = field(default_factory=TokenTree)
    sampling: SamplingParams = GREEDY
    release: bool = False
    plain_steps: int = 1
    stop_ids: tuple[int, ...] = ()
    step_lookup: tuple[int, ...] = ()
    step_corpus: tuple[int, ...] = ()
    domain: str = ""
    max_tokens: int = 0
    logprobs: int = NO_LOGPROBS
    prompt_len: int = 0


@dataclass(frozen=True)
class StepLookup:
    """What one chain of a plain step's lookup draft did (``Verdict.step_lookups``): its ``source``
    (``"text"``: the request's own text, ``"corpus"``: the lookup corpus), the length of the ``match``
    that proposed it, how many of its tokens were ``tried`` (each after its parent was accepted) and
    how many ``accepted`` (the first ones: a chain's tokens after a rejected one are not tried). The
    router calibrates its lookup rates from these as from its own chains."""

    source: str
    match: int
    tried: int
    accepted: int


@dataclass(frozen=True)
class Verdict:
    """The verifier's decision for one request; the committed sequence grows by
    ``accepted_tokens + (next_token,) + plain_tokens`` (``new_tokens``; ``plain_tokens``: the plain
    steps after it, see ``VerifyItem.plain_steps``). ``committed_len`` is its length afterwards.
    ``step_passes``: the plain steps' passes the request was in (fewer than ``plain_tokens`` when
    steps accepted the verifier's own lookup drafts, ``step_drafted`` tokens proposed and
    ``step_accepted`` accepted, see ``VerifyItem.step_lookup``). ``logprobs``: one entry per new
    token, in order, when the item asked (``VerifyItem.logprobs``), else empty. On failure only
    ``request_id`` and ``error`` are meaningful (``next_token == -1``).
    """

    request_id: str
    accepted_nodes: tuple[int, ...] = ()
    accepted_tokens: tuple[int, ...] = ()
    next_token: int = -1
    node_accepted: tuple[bool, ...] = ()
    committed_len: int = 0
    error: str = ""
    error_kind: str = ""  # kv_budget | context | invalid | unknown_request | internal
    plain_tokens: tuple[int, ...] = ()
    step_passes: int = 0
    step_drafted: int = 0
    step_accepted: int = 0
    step_lookups: tuple[StepLookup, ...] = ()  # per step and chain, for the router's lookup calibration
    logprobs: tuple[TokenLogprob, ...] = ()  # aligned with new_tokens (VerifyItem.logprobs)
    grammar_pruned: int = 0  # draft nodes (steps' included) the request's constraint forbade: never verified

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def new_tokens(self) -> tuple[int, ...]:
        return (*self.accepted_tokens, self.next_token, *self.plain_tokens) if self.ok else ()


# ---- drafter -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftItem:
    """One request inside a draft step: truncate, then append, then propose.

    1. ``truncate_to >= 0`` rolls the cache back to its first ``truncate_to`` tokens (no
       recomputation of that prefix); ``-1`` keeps it.
    2. ``append_ids`` are appended (prompt on first sight, committed tokens after a verdict, or the
       fused token of the previous step).
    3. ``top_n > 0`` returns the top-n candidates for the next position; 0 = append only.
    ``release`` frees the request and ignores the rest.
    ``chain_len > 1`` asks the service to continue greedily on its own for that many positions
    (chunk drafting; see services/drafter/server.py). ``score_append`` asks for the mean
    log-probability the drafter gives ``append_ids[1:]`` (the router's domain signal).
    """

    request_id: str
    truncate_to: int = -1
    append_ids: tuple[int, ...] = ()
    top_n: int = 0
    release: bool = False
    chain_len: int = 0
    score_append: bool = False


@dataclass(frozen=True)
class DraftResult:
    """Candidates for the next position, best first, with the drafter's probabilities (softmax of
    its logits at temperature 1). ``cache_len``: tokens in the drafter's cache after the step."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    cache_len: int = 0
    error: str = ""
    positions: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...] = ()  # chain drafting: (ids, probs) per position
    append_logprob: float | None = None

    @property
    def ok(self) -> bool:
        return not self.error


# ---- model info ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """What an engine hosts (mirrors cosine.v1.ModelInfo, minus the service-level fields)."""

    model_name: str
    architecture: str
    vocab_size: int
    tokenizer_fingerprint: str
    num_parameters: int
    dtype: str
    device: str
    attention_backend: str
    max_context: int
    pass_times: tuple[tuple[int, float], ...] = ()  # verifier only: (rows, seconds) of a pass, timed at load


# ---- batch outcomes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageTimings:
    """Wall-clock cost of one batch inside an engine, in nanoseconds (cosine.v1.StageTimings)."""

    prefill_ns: int = 0  # validation, cache reservation, input assembly
    forward_ns: int = 0  # the model forward pass proper
    decode_ns: int = 0  # top-n extraction / acceptance and sampling, cache commits
    total_ns: int = 0

    @classmethod
    def sum(cls, parts: Iterable[StageTimings]) -> StageTimings:
        """Stage by stage sum (a batch served in several passes)."""
        parts = list(parts)
        return cls(*(sum(getattr(t, f.name) for t in parts) for f in fields(cls)))


@dataclass(frozen=True)
class VerifyOutcome:
    """Answer to one verify batch: one verdict per item, in order."""

    verdicts: tuple[Verdict, ...]
    batch_tokens: int  # appended tokens + tree nodes processed in the forward pass
    timings: StageTimings


@dataclass(frozen=True)
class DraftOutcome:
    """Answer to one draft step: one result per item, in order."""

    results: tuple[DraftResult, ...]
    batch_tokens: int  # tokens processed in the forward pass
    timings: StageTimings
