"""The verifier engine's plain steps (``VerifyItem.plain_steps``) and its constrained trees: a part
of :class:`~common.runtime.verifier_engine.VerifierEngine` (a base class of it), in a module of
its own because the engine's pass and its steps are each a page.

After the verdicts, the engine decodes more tokens of a request before it answers, one pass per
step, the batch's other stepping requests beside it; each step may verify what the lookup drafter
would propose (the request's own text, the lookup corpus) and, for a constrained request, what its
grammar forces next. The acceptance rule and generator are the request's, so the tokens are those
of one round per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from common.logs import get_logger
from common.runtime.runner import LMRunner, SeqInput
from common.runtime.step_lookups import StepChain, chain_outcomes, earned_chain, held_depth
from common.runtime.verifier_state import Planned, RequestState
from common.spec.acceptance import RuleFactory
from common.spec.grammar import Constrained, Grammars, masked
from common.spec.logprobs import path_rows, token_logprobs
from common.spec.lookup_corpus import DomainCorpora
from common.spec.lookup_index import CORPUS, TEXT, LookupIndex
from common.spec.penalties import acceptance_logits, path_tokens
from common.spec.types import InvalidInput, SpecError, TokenTree, Verdict, VerifyItem

log = get_logger("common.runtime.verifier_engine")

EMPTY_TREE = TokenTree()  # a plain decode step's tree
FORCED_MAX = 16  # tokens a grammar forces that a plain step proposes at most (each is a row of its pass)


class PlainSteps:
    """The plain steps and the grammar's cut of a tree; :class:`VerifierEngine` sets these attributes."""

    runner: LMRunner
    rule_factory: RuleFactory
    grammars: Grammars | None
    corpus: DomainCorpora | None
    observe_logits: Callable[[str, torch.Tensor], None] | None
    _generator: torch.Generator

    def _plain_steps(self, planned: Sequence[Planned], verdicts: list[Verdict | None]) -> tuple[int, int]:
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
            going: list[tuple[Planned, TokenTree]] = []
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


def leaf_paths(tree: TokenTree) -> list[list[int]]:
    """Every root-to-leaf path of ``tree`` as tokens (``TokenTree.merged`` of them is ``tree``)."""
    paths, children = path_tokens(tree), tree.children  # paths[1 + i]: node i's path
    return [paths[1 + i] for i in range(len(tree)) if not children.get(i)]


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
