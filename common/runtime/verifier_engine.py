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
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from common.logs import get_logger
from common.runtime.batching import repeated_items
from common.runtime.engine_base import RequestEngine
from common.runtime.kv_cache import KVCache
from common.runtime.pass_times import measure_pass_times
from common.runtime.runner import LMRunner, SeqInput
from common.runtime.step_lookups import StepChain, chain_outcomes, earned_chain, held_depth
from common.spec.acceptance import RuleFactory, default_rule_factory
from common.spec.grammar import Constrained, Grammars, GrammarState, masked
from common.spec.logprobs import path_rows, token_logprobs
from common.spec.lookup_corpus import DomainCorpora
from common.spec.lookup_index import CORPUS, TEXT, LookupIndex
from common.spec.penalties import acceptance_logits
from common.spec.types import (
    ContextTooLong,
    InvalidInput,
    ModelInfo,
    SpecError,
    StageTimings,
    TokenTree,
    UnknownRequest,
    Verdict,
    VerifyItem,
    VerifyOutcome,
    error_kind,
)

log = get_logger(__name__)

EMPTY_TREE = TokenTree()  # a plain decode step's tree
FORCED_MAX = 16  # tokens a grammar forces that a plain step proposes at most (each is a row of its pass)


@dataclass
class RequestState:
    """One request's committed sequence, cache (all committed tokens but the last) and generator."""

    request_id: str
    tokens: list[int]
    cache: KVCache
    generator: torch.Generator | None = None
    verdicts: int = field(default=0)
    lookup: LookupIndex | None = None  # the n-grams its plain steps draft from (VerifyItem.step_lookup)
    prompt_len: int = 0  # where its output begins in ``tokens`` (the penalties count from there)
    grammar: GrammarState | None = None  # its constraint's matcher (SamplingParams.constraint), if any


@dataclass
class _Planned:
    index: int
    state: RequestState
    item: VerifyItem
    uncached: list[int]
    new: bool
    constrained: Constrained | None = None  # the tree as the request's grammar cut it, with its masks

    @property
    def tree(self) -> TokenTree:
        """The tree the pass verifies: the item's, less the nodes its grammar forbids."""
        return self.item.tree if self.constrained is None else self.constrained.tree


class VerifierEngine(RequestEngine[RequestState]):
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
        kv_token_budget: int | None = None,
        rule_factory: RuleFactory = default_rule_factory,
        seed: int | None = None,
        max_tree_nodes: int | None = None,
    ) -> VerifierEngine:
        runner = LMRunner.from_checkpoint(
            path, dtype=dtype, device=device, backend=attention_backend, kv_cache=kv_cache
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
        planned: list[_Planned] = []
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

    def _plain_steps(self, planned: Sequence[_Planned], verdicts: list[Verdict | None]) -> tuple[int, int]:
        """The plain decode steps after the verdicts (``VerifyItem.plain_steps``): one pass per step
        for every request still stepping; returns the passes' forward time (ns) and rows.

        Each step is the plain decode pass a router would send next, with the same acceptance rule
        and generator, so the tokens are those of one round per token. With ``step_lookup`` or
        ``step_corpus`` a step also verifies what the lookup drafter proposes (:meth:`_step_tree`),
        as the router's would have in that round. A request stops at one of its stop ids, at
        ``max_tokens``, at the model's context, or when its cache has no room left (the tokens so
        far stand); a failed pass ends every request's steps there.
        """
        forward_ns = rows = 0
        for step in range(1, max((p.item.plain_steps for p in planned), default=1)):
            going: list[tuple[_Planned, TokenTree]] = []
            for p in planned:
                verdict, state, item = verdicts[p.index], p.state, p.item
                if item.plain_steps <= step or verdict is None or not verdict.ok:
                    continue
                made = verdict.new_tokens
                room = self.runner.max_context - len(state.tokens)  # the step's pass feeds the last token
                if item.max_tokens:
                    room = min(room, item.max_tokens - len(made))
                if room < 1 or (item.stop_ids and not set(made).isdisjoint(item.stop_ids)):
                    continue
                tree, chains = self._step_tree(state, item, room - 1)
                constrained = None
                if item.sampling.constraint is not None:
                    try:
                        constrained = self._constrain(state, item, state.tokens, tree, forced_room=room - 1)
                    except SpecError:
                        continue
                    tree = constrained.tree
                    chains = tuple(replace(c, tokens=c.tokens[: held_depth(tree, c.tokens)]) for c in chains)
                try:
                    state.cache.reserve(1 + len(tree))
                except SpecError:
                    if not len(tree):
                        continue
                    try:
                        if constrained is not None:
                            constrained = self._constrain(state, item, state.tokens, EMPTY_TREE)
                        tree, chains = EMPTY_TREE, ()
                        state.cache.reserve(1)
                    except SpecError:
                        continue
                going.append((p, tree, chains, constrained))
            if not going:
                break
            t0 = time.perf_counter_ns()
            try:
                logits = self.runner.forward([_step_input(p.state, tree) for p, tree, _, _ in going])
            except Exception as exc:  # the verdicts so far stand; nothing of this pass is kept
                log.error("plain_step_failed", error=repr(exc), batch=len(going), step=step)
                for p, _, _, _ in going:
                    p.state.cache.discard_pending()
                break
            forward_ns += time.perf_counter_ns() - t0
            rows += sum(1 + len(tree) for _, tree, _, _ in going)
            for (p, tree, chains, constrained), lg in zip(going, logits):
                state = p.state
                ruled = acceptance_logits(lg, tree, state.tokens, state.prompt_len, p.item.sampling)
                if constrained is not None:
                    ruled = masked(ruled, constrained.allowed)
                decision = self.rule_factory(p.item.sampling).decide(tree, ruled, state.generator or self._generator)
                path = decision.accepted_nodes
                accepted = [tree.tokens[a] for a in path]
                if self.observe_logits is not None:
                    for row in (0, *(1 + a for a in path)):
                        self.observe_logits(p.item.request_id, lg[row : row + 1])
                state.cache.commit([0, *(1 + a for a in path)])
                state.tokens += [*accepted, decision.next_token]
                verdict = verdicts[p.index]
                assert verdict is not None
                logprobs = token_logprobs(lg, path_rows(path), [*accepted, decision.next_token], p.item.logprobs)
                verdicts[p.index] = replace(
                    verdict,
                    plain_tokens=(*verdict.plain_tokens, *accepted, decision.next_token),
                    logprobs=(*verdict.logprobs, *logprobs),
                    committed_len=len(state.tokens),
                    step_passes=verdict.step_passes + 1,
                    step_drafted=verdict.step_drafted + len(tree),
                    step_accepted=verdict.step_accepted + len(accepted),
                    step_lookups=(*verdict.step_lookups, *chain_outcomes(chains, accepted)),
                    grammar_pruned=verdict.grammar_pruned + (constrained.pruned if constrained is not None else 0),
                )
        return forward_ns, rows

    def _constrain(
        self, state: RequestState, item: VerifyItem, committed: list[int], tree: TokenTree, forced_room: int = 0
    ) -> Constrained:
        """``tree`` as the request's grammar allows it after ``committed`` (the request's committed
        sequence, its prompt included): the request's matcher, made on first use, brought to the
        committed output first (:mod:`common.spec.grammar`).

        ``forced_room > 0`` (a plain step): the tokens the grammar forces next (a JSON key and its
        punctuation, say), at most that many, join the tree as one more proposal, first: verified
        like any draft, so the output is unchanged, and nearly always accepted."""
        constraint = item.sampling.constraint
        assert constraint is not None
        if state.grammar is None:
            if self.grammars is None:
                raise InvalidInput("sampling.constraint: this verifier has no tokenizer to compile grammars with")
            state.grammar = self.grammars.state(constraint)
        state.grammar.sync(committed[state.prompt_len :])
        if forced_room > 0:
            forced = state.grammar.forced(min(forced_room, FORCED_MAX))
            forced = forced[: next((i for i, t in enumerate(forced) if t in item.stop_ids), len(forced))]
            if forced:
                tree = TokenTree.merged([forced, *leaf_paths(tree)], limit=len(forced) + len(tree))
        return state.grammar.constrain(tree)

    def _step_tree(self, state: RequestState, item: VerifyItem, room: int) -> tuple[TokenTree, tuple[StepChain, ...]]:
        """What the lookup drafter proposes for a request's plain step (``VerifyItem.step_lookup``,
        ``step_corpus``): the tokens that followed the longest earlier match of its suffix in its
        own text and in the corpus, each as many as its match length earns, at most ``room``, and
        none from a stop id on (the target's stop ends the steps as the step's own token).

        The tree holds no more nodes than the deeper chain may have: the corpus's chain first (on
        the smol zoo it is right more often), then the text's where it differs, while room is
        left. Both chains whole would double a step's rows, and on a CPU the pass-time curve has
        steps (a row past a full tile of the kernels costs a whole tile) that the router's plan
        keeps its own passes under but the steps could not see.

        Also returns each chain as far as the tree holds it, with its source and match length, for
        the verdict's ``step_lookups`` (:func:`chain_outcomes`)."""
        if room < 1:
            return EMPTY_TREE, ()
        chains: list[tuple[str, int, list[int]]] = []
        corpus = self.corpus
        if corpus is not None and item.step_corpus and max(item.step_corpus):
            chains.append(
                (
                    CORPUS,
                    *earned_chain(
                        corpus.propose(item.domain, state.tokens, min(max(item.step_corpus), room)), item.step_corpus
                    ),
                )
            )
        if item.step_lookup and max(item.step_lookup):
            if state.lookup is None or state.lookup.max_ngram != len(item.step_lookup):
                state.lookup = LookupIndex(max_ngram=len(item.step_lookup))
            chains.append(
                (
                    TEXT,
                    *earned_chain(
                        state.lookup.propose(state.tokens, min(max(item.step_lookup), room)), item.step_lookup
                    ),
                )
            )
        cut = [
            (source, match, chain[: next((i for i, t in enumerate(chain) if t in item.stop_ids), len(chain))])
            for source, match, chain in chains
        ]
        cut = [c for c in cut if c[2]]
        if not cut:
            return EMPTY_TREE, ()
        tree = TokenTree.merged([chain for _, _, chain in cut], limit=max(len(chain) for _, _, chain in cut))
        return tree, tuple(StepChain(source, match, chain[: held_depth(tree, chain)]) for source, match, chain in cut)

    def _plan(self, index: int, item: VerifyItem) -> _Planned:
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
        return _Planned(index, state, item, uncached, new, constrained)

    @staticmethod
    def _seq_input(p: _Planned) -> SeqInput:
        s, tree = len(p.uncached), p.tree
        parents = tuple(range(-1, s - 1)) + tuple(s - 1 if q < 0 else s + q for q in tree.parents)
        return SeqInput(
            cache=p.state.cache,
            token_ids=tuple(p.uncached) + tree.tokens,
            parents=parents,
            logit_rows=tuple(range(s - 1, s + len(tree))),
        )

    def _decide(self, p: _Planned, logits: torch.Tensor) -> Verdict:
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


def leaf_paths(tree: TokenTree) -> list[list[int]]:
    """Every root-to-leaf path of ``tree`` as tokens (``TokenTree.merged`` of them is ``tree``)."""
    paths: list[list[int]] = []
    for i, p in enumerate(tree.parents):
        paths.append([*(paths[p] if p >= 0 else []), tree.tokens[i]])
    children = tree.children
    return [paths[i] for i in range(len(tree)) if not children.get(i)]


def _step_input(state: RequestState, tree: TokenTree) -> SeqInput:
    """A plain step's row (the last committed token) with the step's lookup tree hanging off it."""
    if not len(tree):
        return SeqInput(cache=state.cache, token_ids=(state.tokens[-1],))
    return SeqInput(
        cache=state.cache,
        token_ids=(state.tokens[-1], *tree.tokens),
        parents=(-1, *(0 if q < 0 else 1 + q for q in tree.parents)),
        logit_rows=tuple(range(1 + len(tree))),
    )
