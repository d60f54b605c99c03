"""Verifier engine: verifies a batch of token trees against the target model in one forward pass.

Per request the engine keeps the committed sequence (prompt + generated tokens) and a KV cache.

Cache invariant: between batches the cache holds the keys/values of every committed token
**except the last one**. The last committed token (the next token of the previous verdict, or
the prompt's last token) has not been through the model yet; its row is computed in the next pass
together with the tree, and its logits are the target's distribution for the tree's roots.

One verify pass for a request with ``C`` cached tokens, committed length ``N`` (after
``append_ids``) and an ``n``-node tree feeds ``s = N - C`` uncached committed tokens as a causal chain
followed by the tree nodes (each sees the committed prefix and its own ancestors only; a node of
depth ``d`` gets position ``N - 1 + d``)::

    new tokens   [ u_0 ... u_{s-1} | node_0 ... node_{n-1} ]
    logit rows                 s-1 | s    ...   s+n-1         -> [n + 1, vocab]

After the acceptance rule has spoken, only the uncached committed tokens and the accepted path
keep their cache entries (the rejected nodes' entries are dropped), so the invariant holds again:
cache = ``N + len(accepted)`` tokens, committed = that + 1.

Constrained requests (``SamplingParams.constraint``, structured output): before the pass the tree
is cut to the nodes the request's grammar allows and every logit row gets the grammar's mask in
the state after its own path (:mod:`common.spec.grammar`); the rule decides on the masked rows, and
the verdict names the accepted nodes by their index in the tree the router sent.

Plain steps (``VerifyItem.plain_steps``): after the verdicts, the engine decodes more tokens of a
request before it answers, a pass each, the batch's other stepping requests beside it. At each step
it may draft as the router's lookup drafter would (``step_lookup``, ``step_corpus``): what followed
the longest earlier match of the request's suffix in its own text and in the lookup corpus
(:attr:`VerifierEngine.corpus`, loaded from Redis by the server), the two chains siblings where they
differ. The step's pass verifies that small tree on top of the last committed token with the same
acceptance rule, so the tokens stay the target's own; a round trip then carries several drafted passes.

FASER's verification frontiers need nothing more from the engine: the router verifies a draft
chunk by chunk and sends a later chunk (the nodes below the token this verdict's next token
confirmed) as the next item's tree, on the cache the invariant leaves, or prunes it unverified
after a rejection (``services/router/frontiers.py``). A layer-level early exit (dropping nodes on
early-layer evidence) is not built: a node's acceptance depends on its parent's *final* logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from common.logs import get_logger
from common.runtime.batching import repeated_items
from common.runtime.engine_base import RequestEngine
from common.runtime.pass_times import measure_pass_times
from common.runtime.plain_steps import PlainSteps
from common.runtime.runner import LMRunner, SeqInput
from common.runtime.verifier_state import Planned, RequestState
from common.spec.acceptance import RuleFactory, default_rule_factory
from common.spec.grammar import Grammars, masked
from common.spec.logprobs import path_rows, token_logprobs
from common.spec.lookup_corpus import DomainCorpora
from common.spec.penalties import acceptance_logits
from common.spec.types import (
    ContextTooLong,
    InvalidInput,
    ModelInfo,
    SpecError,
    StageTimings,
    UnknownRequest,
    Verdict,
    VerifyItem,
    VerifyOutcome,
    error_kind,
)

log = get_logger(__name__)


class VerifierEngine(PlainSteps, RequestEngine[RequestState]):
    """The target model plus per-request state. Not thread-safe: call from one worker."""

    def __init__(
        self,
        runner: LMRunner,
        *,
        kv_token_budget: int | None = None,
        rule_factory: RuleFactory = default_rule_factory,
        seed: int | None = None,
        max_tree_nodes: int | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        super().__init__(runner, kv_token_budget, "verifier")
        self.rule_factory = rule_factory
        self.grammars = grammars  # compiles constrained requests' grammars (None: such requests are refused)
        self.max_tree_nodes = max_tree_nodes  # a larger tree is refused (its attention mask grows with nodes^2)
        self.pass_times: tuple[tuple[int, float], ...] = ()  # (rows, seconds) of a pass, when timed (pass_times.py)
        # sees (request id, logits [1, vocab]) of every plain position it decodes: the zoo's teacher
        # records the target's top-k next tokens while it writes its continuations (none in serving)
        self.observe_logits: Callable[[str, torch.Tensor], None] | None = None
        self.corpus: DomainCorpora | None = None  # the lookup corpus plain steps draft from (VerifyItem.step_corpus)
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",  # or auto (common.runtime.runner.resolve_dtype)
        attention_backend: str = "auto",
        kv_cache: str = "auto",  # paged, contiguous or auto (common.runtime.kv_arena.select_kv_cache)
        cuda_graphs: bool = True,  # on CUDA with the paged arena (common.runtime.cuda_graphs)
        kv_token_budget: int | None = None,
        rule_factory: RuleFactory = default_rule_factory,
        seed: int | None = None,
        max_tree_nodes: int | None = None,
    ) -> VerifierEngine:
        runner = LMRunner.from_checkpoint(
            path, dtype=dtype, device=device, backend=attention_backend, kv_cache=kv_cache, cuda_graphs=cuda_graphs
        )
        return cls(
            runner,
            kv_token_budget=kv_token_budget,
            rule_factory=rule_factory,
            seed=seed,
            max_tree_nodes=max_tree_nodes,
            grammars=Grammars.from_checkpoint(path, runner.vocab_size),
        )

    # ---- introspection -----------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        return replace(self.runner.model_info(), pass_times=self.pass_times)

    def time_passes(self) -> None:
        """Time the verify pass by rows (:func:`~common.runtime.pass_times.measure_pass_times`)."""
        self.pass_times = measure_pass_times(self.runner)

    def committed(self, request_id: str) -> tuple[int, ...]:
        """The request's committed sequence (prompt + generated)."""
        return tuple(self._state(request_id).tokens)

    # ---- verification ------------------------------------------------------------------------

    def verify(self, items: Sequence[VerifyItem]) -> VerifyOutcome:
        """Verify a batch: one forward pass for every item that passes validation.

        A failing item gets a verdict with ``error`` set and leaves its request unchanged; the others
        still run. A request may appear only once per batch.
        """
        t0 = time.perf_counter_ns()
        verdicts: list[Verdict | None] = [None] * len(items)
        planned: list[Planned] = []
        repeats = repeated_items(items)
        for i, item in enumerate(items):
            if i in repeats:
                verdicts[i] = repeats[i]
                continue
            if item.release:
                self.release(item.request_id)
                verdicts[i] = Verdict(item.request_id)
                continue
            try:
                planned.append(self._plan(i, item))
            except SpecError as exc:
                verdicts[i] = Verdict(item.request_id, error=str(exc), error_kind=error_kind(exc))

        t1 = time.perf_counter_ns()
        seqs = [self._seq_input(p) for p in planned]
        try:
            logits = self.runner.forward(seqs)
        except Exception as exc:  # e.g. a device OOM: fail this batch, keep every request consistent
            log.error("verify_forward_failed", error=repr(exc), batch=len(seqs))
            for p in planned:
                p.state.cache.discard_pending()
                if p.new:
                    self._drop(p.state)
                verdicts[p.index] = Verdict(
                    p.item.request_id, error=f"verify forward failed: {exc}", error_kind="internal"
                )
            planned, logits = [], []
        t2 = time.perf_counter_ns()

        for p, lg in zip(planned, logits):
            try:
                verdicts[p.index] = self._decide(p, lg)
            except Exception as exc:  # a bug in one request's decision must not take the batch down
                log.error("verify_decide_failed", error=repr(exc), request_id=p.item.request_id)
                p.state.cache.discard_pending()
                if p.new:
                    self._drop(p.state)
                verdicts[p.index] = Verdict(
                    p.item.request_id, error=f"verify decision failed: {exc}", error_kind="internal"
                )
                continue
            if self.observe_logits is not None and not len(p.item.tree):
                self.observe_logits(p.item.request_id, lg)
        step_ns, step_rows = self._plain_steps(planned, verdicts)
        t4 = time.perf_counter_ns()
        timings = StageTimings(
            prefill_ns=t1 - t0, forward_ns=t2 - t1 + step_ns, decode_ns=t4 - t2 - step_ns, total_ns=t4 - t0
        )
        batch_tokens = sum(len(s.token_ids) for s in seqs) + step_rows
        return VerifyOutcome(
            verdicts=tuple(v for v in verdicts if v is not None), batch_tokens=batch_tokens, timings=timings
        )

    def _plan(self, index: int, item: VerifyItem) -> Planned:
        """Validate an item and reserve cache room for it; raises :class:`SpecError` (request unchanged)."""
        vocab = self.runner.vocab_size
        item.sampling.validate()
        if item.plain_steps < 1:
            raise InvalidInput(f"plain_steps: must be at least 1, got {item.plain_steps}")
        if self.max_tree_nodes is not None and len(item.tree) > self.max_tree_nodes:
            raise InvalidInput(
                f"tree: {len(item.tree)} nodes is more than this verifier's limit of {self.max_tree_nodes}"
            )
        item.tree.validate(vocab)
        if not -1 <= item.logprobs <= vocab:
            raise InvalidInput(f"logprobs: must be -1 (none) to the vocabulary's size {vocab}, got {item.logprobs}")
        for t in item.append_ids:
            if not 0 <= t < vocab:
                raise InvalidInput(f"append_ids: token id {t} outside the vocabulary [0, {vocab})")
        state = self._requests.get(item.request_id)
        new = state is None
        if new and not item.append_ids:
            raise UnknownRequest(
                f"request_id: unknown request {item.request_id!r}: the first verify item must carry the prompt in "
                "append_ids"
            )
        committed = (0 if new else len(state.tokens)) + len(item.append_ids)
        after = committed + item.tree.depth + 1
        if after > self.runner.max_context:
            raise ContextTooLong(
                f"{'append_ids' if committed + 1 > self.runner.max_context else 'tree'}: request {item.request_id!r}: "
                f"{committed} committed tokens + tree depth {item.tree.depth} + 1 exceeds the model's maximum "
                "context of "
                f"{self.runner.max_context}"
            )
        if new:
            gen = None
            if item.sampling.seed is not None:
                gen = torch.Generator().manual_seed(int(item.sampling.seed))
            state = RequestState(
                item.request_id, [], self.pool.new_cache(), gen, prompt_len=item.prompt_len or len(item.append_ids)
            )
        uncached = state.tokens[state.cache.length :] + list(item.append_ids)
        constrained = None
        try:
            if item.sampling.constraint is not None:
                constrained = self._constrain(state, item, [*state.tokens, *item.append_ids], item.tree)
            state.cache.reserve(len(uncached) + len(item.tree if constrained is None else constrained.tree))
        except SpecError:
            if new:
                state.cache.release()
            raise
        if new:
            self._requests[item.request_id] = state
        return Planned(index, state, item, uncached, new, constrained)

    @staticmethod
    def _seq_input(p: Planned) -> SeqInput:
        s, tree = len(p.uncached), p.tree
        parents = tuple(range(-1, s - 1)) + tuple(s - 1 if q < 0 else s + q for q in tree.parents)
        return SeqInput(
            cache=p.state.cache,
            token_ids=tuple(p.uncached) + tree.tokens,
            parents=parents,
            logit_rows=tuple(range(s - 1, s + len(tree))),
        )

    def _decide(self, p: Planned, logits: torch.Tensor) -> Verdict:
        """Apply the request's acceptance rule to ``logits: [n + 1, vocab]`` and commit the result."""
        state, item, tree = p.state, p.item, p.tree
        rule = self.rule_factory(item.sampling)
        ruled = acceptance_logits(logits, tree, [*state.tokens, *item.append_ids], state.prompt_len, item.sampling)
        if p.constrained is not None:
            ruled = masked(ruled, p.constrained.allowed)
        decision = rule.decide(tree, ruled, state.generator or self._generator)
        s = len(p.uncached)
        # keep the uncached committed tokens and the accepted path; drop every other tree entry
        state.cache.commit(list(range(s)) + [s + a for a in decision.accepted_nodes])
        accepted_tokens = tuple(tree.tokens[a] for a in decision.accepted_nodes)
        state.tokens += [*item.append_ids, *accepted_tokens, decision.next_token]
        state.verdicts += 1
        accepted = decision.accepted_nodes if p.constrained is None else p.constrained.original(decision.accepted_nodes)
        flags = [False] * len(item.tree)
        for a in accepted:
            flags[a] = True
        return Verdict(
            request_id=item.request_id,
            accepted_nodes=accepted,
            accepted_tokens=accepted_tokens,
            next_token=decision.next_token,
            node_accepted=tuple(flags),
            committed_len=len(state.tokens),
            logprobs=tuple(
                token_logprobs(
                    logits, path_rows(decision.accepted_nodes), [*accepted_tokens, decision.next_token], item.logprobs
                )
            ),
            grammar_pruned=0 if p.constrained is None else p.constrained.pruned,
        )
