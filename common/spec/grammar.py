"""Structured output: a request's :class:`Constraint` as a grammar that masks the target's distribution.

The grammar engine is llguidance (maintained, CPU-only, a structured-output backend of vLLM and
llama.cpp): it compiles JSON schemas, regexes and Lark or GBNF grammars against the target's
tokenizer and gives, for a parser state, the set of tokens that keep the output inside the grammar.
What is ours is how that set meets a token tree.

Lossless under speculation: the constrained target's distribution at a position is the target's
(penalised) logits with every forbidden token at ``-inf``. The verifier needs it at every logit row
of a tree, each row in the grammar state after its own path (``common.spec.acceptance`` layout:
row 0 after the committed sequence, row ``1 + i`` after node ``i``). :meth:`GrammarState.constrain`
walks the tree depth first, advancing the matcher by a node's token and rolling it back after the
node's subtree. A node whose token its parent's row forbids has probability 0 under either
acceptance rule, so it can never be accepted: it and its subtree are **pruned before the pass**
(never verified; ``Verdict.grammar_pruned`` counts them). The rule then decides on the masked rows
as on any others, so greedy output is the constrained greedy decode of the target alone, token for
token, and sampled output follows the constrained distribution. Drafters are not told.

Once the grammar is complete its only allowed token is the tokenizer's end of sequence, so the
request ends there; a grammar that cannot end within ``max_tokens`` ends at the length, as any
request does. A matcher follows a request's committed output lazily (:meth:`GrammarState.sync`),
so a verdict, a plain step or a resumed request's re-prefill all leave it right by the next use.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.spec.types import Constraint, InvalidInput, TokenTree

CACHE_SIZE = 64  # compiled grammars kept per engine (requests with one schema share its compilation)
# JSON as OpenAI's models write it on one line ({"a": 1, "b": [2, 3]}): with any whitespace allowed
# between tokens (the JSON grammar's own default) a model can run on in blanks to max_tokens; a
# schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint``; raises :class:`InvalidInput` naming what is wrong
    (the grammar's own validity is checked against a tokenizer by :meth:`Grammars.compile`)."""
    import llguidance
    from llguidance import LLMatcher

    constraint.validate()
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_OPTIONS)
        if kind == "json_schema":
            try:
                schema = json.loads(spec)
            except ValueError as exc:
                raise InvalidInput(f"constraint: the JSON schema is not JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise InvalidInput("constraint: the JSON schema must be a JSON object")
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            try:
                choices = json.loads(spec)
            except ValueError as exc:
                raise InvalidInput(f"constraint: the choices are not a JSON list: {exc}") from None
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise InvalidInput("constraint: the choices must be a non-empty JSON list of non-empty strings")
            return llguidance.grammar_from("choice", json.dumps(choices))
        return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise InvalidInput(f"constraint: {exc}") from None


@dataclass(frozen=True)
class Constrained:
    """A token tree as a constrained request's pass sees it (:meth:`GrammarState.constrain`).

    ``tree``: the nodes the grammar allows (and their parents), in their original order; ``kept``:
    each kept node's index in the original tree, or None when nothing was pruned (then ``tree`` is
    the original); ``allowed``: ``[len(tree) + 1, vocab]`` bool, the grammar's mask of every logit
    row of ``tree``; ``pruned``: how many nodes were cut."""

    tree: TokenTree
    kept: tuple[int, ...] | None
    allowed: torch.Tensor
    pruned: int

    def original(self, nodes: Sequence[int]) -> tuple[int, ...]:
        """Indices of ``tree``'s ``nodes`` in the original tree."""
        return tuple(nodes) if self.kept is None else tuple(self.kept[n] for n in nodes)


def masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits: [rows, vocab]`` with every token ``allowed`` forbids at ``-inf`` (a new tensor)."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


class GrammarState:
    """One request's grammar matcher, following its committed output (:meth:`sync`)."""

    def __init__(self, template: Any, vocab_size: int) -> None:
        self._template = template  # the compiled grammar's fresh matcher (shared; never advanced)
        self._matcher = template.deep_copy()
        self._vocab = vocab_size
        self.consumed: list[int] = []  # the output tokens the matcher has advanced through

    def sync(self, output: Sequence[int]) -> None:
        """Bring the matcher to the state after ``output`` (the request's committed output): roll
        back past where it differs from what was consumed, then consume the rest. Raises
        :class:`InvalidInput` (nothing of ``output`` past the common prefix consumed) when the grammar forbids a
        token of ``output``: an output the grammar did not produce, e.g. a resume of another's."""
        same = 0
        for a, b in zip(self.consumed, output):
            if a != b:
                break
            same += 1
        if same < len(self.consumed):
            self._rewind(same)
        rest = list(output[same:])
        if not rest:
            return
        ok = self._matcher.validate_tokens(rest)
        if ok < len(rest):
            raise InvalidInput(
                f"constraint: output token {rest[ok]} at position {same + ok} is outside the grammar "
                "(the output so far does not match the request's constraint)"
            )
        if not self._matcher.consume_tokens(rest):
            raise InvalidInput(f"constraint: the grammar engine failed: {self._matcher.get_error()}")
        self.consumed.extend(rest)

    def _rewind(self, keep: int) -> None:
        if not self._matcher.is_error() and self._matcher.rollback(len(self.consumed) - keep):
            del self.consumed[keep:]
            return
        self._matcher = self._template.deep_copy()  # history too short to roll back: replay
        kept = self.consumed[:keep]
        self.consumed = []
        if kept and not self._matcher.consume_tokens(kept):
            raise InvalidInput(f"constraint: the grammar engine failed: {self._matcher.get_error()}")
        self.consumed = kept

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces after the consumed output (its forced text in
        the tokenizer's canonical tokens; a model may spell it otherwise, so they are a proposal)."""
        return list(self._matcher.compute_ff_tokens())[:limit] if limit > 0 else []

    def allowed(self) -> torch.Tensor:
        """``[vocab]`` bool: the tokens the grammar allows next."""
        return torch.from_numpy(self._allowed_bits())

    def _allowed_bits(self) -> np.ndarray:
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = bits[: self._vocab].astype(np.bool_)
        if out.shape[0] < self._vocab:  # ids past the tokenizer's (padding rows of the embedding)
            out = np.concatenate([out, np.zeros(self._vocab - out.shape[0], dtype=np.bool_)])
        return out

    def constrain(self, tree: TokenTree) -> Constrained:
        """``tree`` cut to what the grammar allows after the consumed output, with every row's mask
        (see the module docstring). The matcher ends where it began."""
        masks: dict[int, np.ndarray] = {}  # numpy, stacked once at the end (torch.stack of bool rows is slow)
        kept: list[int] = []
        children = tree.children

        def visit(node: int) -> None:
            mask = masks[node] = self._allowed_bits()
            for c in children.get(node, ()):
                if not bool(mask[tree.tokens[c]]) or not self._matcher.consume_token(tree.tokens[c]):
                    continue  # c and its subtree are pruned
                kept.append(c)
                visit(c)
                self._matcher.rollback(1)

        visit(-1)
        if len(kept) == len(tree):
            allowed = torch.from_numpy(np.stack([masks[-1], *(masks[i] for i in range(len(tree)))]))
            return Constrained(tree, None, allowed, 0)
        kept.sort()
        index = {old: new for new, old in enumerate(kept)}
        pruned = TokenTree(
            tokens=tuple(tree.tokens[i] for i in kept),
            parents=tuple(-1 if tree.parents[i] < 0 else index[tree.parents[i]] for i in kept),
        )
        allowed = torch.from_numpy(np.stack([masks[-1], *(masks[i] for i in kept)]))
        return Constrained(pruned, tuple(kept), allowed, len(tree) - len(kept))


class Grammars:
    """Compiles constraints against one tokenizer (built on first use) and keeps the last
    :data:`CACHE_SIZE` compiled grammars. Thread-safe."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int) -> None:
        self._load = load_tokenizer  # -> a transformers fast tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: Any = None
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_checkpoint(cls, path: str | Path, vocab_size: int) -> Grammars:
        """Grammars over the tokenizer saved beside a checkpoint (loaded on the first constrained request)."""

        def load() -> Any:
            from transformers import AutoTokenizer

            try:
                return AutoTokenizer.from_pretrained(str(path))
            except (OSError, ValueError) as exc:
                raise InvalidInput(f"constraint: no tokenizer beside the target's checkpoint: {exc}") from None

        return cls(load, vocab_size)

    def _lltokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self._load(), n_vocab=self.vocab_size)
        return self._tokenizer

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token (a piece of a multi-byte character as the bytes it holds;
        a special token as its text), from the grammar engine's view of the tokenizer."""
        with self._lock:
            return bytes(self._lltokenizer().decode_bytes([token]))

    def warm(self) -> None:
        """Build the grammar engine's tokenizer now (once), rather than on the first request needing it."""
        with self._lock:
            self._lltokenizer()

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar's fresh matcher (cached); raises :class:`InvalidInput` with the
        grammar engine's reason when it cannot be compiled."""
        from llguidance import LLMatcher

        with self._lock:
            template = self._compiled.get(constraint)
            if template is not None:
                self._compiled.move_to_end(constraint)
                return template
            template = LLMatcher(self._lltokenizer(), grammar_text(constraint), log_level=0)
            if template.is_error():  # the matcher never raises: a grammar that does not compile is its error state
                raise InvalidInput(f"constraint: {template.get_error() or 'the grammar does not compile'}")
            self._compiled[constraint] = template
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return template

    def state(self, constraint: Constraint) -> GrammarState:
        """A new request's matcher at the start of its output."""
        return GrammarState(self.compile(constraint), self.vocab_size)
