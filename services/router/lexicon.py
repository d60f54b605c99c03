"""Domain detection without drafter passes: a token lexicon per domain, learned online from the
requests whose domain the drafters scored (no gRPC, no model here).

Scoring a new prompt with every live drafter (:func:`services.router.domain.detect_domains`) costs
one forward pass per drafter and a message round trip before the request's first draft. The
lexicon imitates that decision from the prompt's token ids alone: a multinomial naive Bayes over
token counts per domain (add-one smoothing), learned from every prompt the drafters did score.
Once each of at least two domains has ``min_examples`` prompts, a prediction whose log-likelihood
margin over the runner-up reaches ``min_margin`` nats stands in for the drafters. Every
``audit_every``-th such prompt is still scored by the drafters and compared; an agreement rate
(exponential average) below ``min_agreement`` hands detection back to the drafters until the
lexicon, still learning, agrees again. Memory is bounded by domains x vocabulary.

A lexicon seeded with *labelled* prompts (the zoo's training prompts per domain, written by
``cosine up``) is the reference itself, not an imitation: where it is confident it decides, with no
audit, and the drafters' scores, asked only for the prompts it cannot call, are not learned into it.
Drafters' scores need specialists that fit their domains better than each other; the default zoo's
do not (its specialists' mean log-probabilities rank the right domain first for a quarter of the
held-out prompts, against 97% for its seeded lexicon), and audits against them would only teach a
right lexicon wrong labels and cost every live drafter a pass per audited prompt.

The lexicon is shared through Redis (``Store.load_lexicon``): a router starts from the zoo's seed
(the token counts of its training prompts per domain, written by ``cosine up``) plus what every
router learned before it, and adds each prompt its drafters score. With a seed, the first requests
are routed without drafter passes too.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class DomainLexicon:
    min_examples: int = 4
    min_margin: float = 4.0
    audit_every: int = 8
    min_agreement: float = 0.8
    counts: dict[str, Counter[int]] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)
    examples: dict[str, int] = field(default_factory=dict)
    agreement: float = 1.0
    vocabulary: set[int] = field(default_factory=set)
    predicted: int = 0  # predictions the router used
    audited: int = 0
    labelled: set[str] = field(default_factory=set)  # domains whose counts hold labelled prompts (a seed)

    def predict(self, tokens: Sequence[int]) -> tuple[str | None, float]:
        """(most likely domain, margin in nats over the runner-up), or (None, 0) with too little data."""
        ready = [d for d, n in self.examples.items() if n >= self.min_examples]
        if len(ready) < 2 or not tokens:
            return None, 0.0
        v = len(self.vocabulary) + 1
        scores = {}
        for d in ready:
            c, denom = self.counts[d], math.log(self.totals[d] + v)
            scores[d] = sum(math.log(c.get(t, 0) + 1) for t in tokens) - len(tokens) * denom
        ranked = sorted(scores, key=lambda d: (-scores[d], d))
        return ranked[0], scores[ranked[0]] - scores[ranked[1]]

    def confident(self, tokens: Sequence[int]) -> bool:
        """Whether :meth:`decide` would likely give a domain for ``tokens`` without the drafters
        (no side effect; an audit may still ask them)."""
        return self._trusted(*self.predict(tokens))

    @property
    def reference(self) -> bool:
        """Whether the lexicon is the reference (every domain it predicts was seeded with labelled
        prompts): it is then trusted without audits and learns nothing from the drafters."""
        ready = [d for d, n in self.examples.items() if n >= self.min_examples]
        return len(ready) >= 2 and all(d in self.labelled for d in ready)

    def _trusted(self, guess: str | None, margin: float) -> bool:
        return (
            guess is not None and margin >= self.min_margin and (self.reference or self.agreement >= self.min_agreement)
        )

    def decide(self, tokens: Sequence[int]) -> tuple[str | None, str | None]:
        """(domain to use now or None to ask the drafters, the lexicon's guess to check later)."""
        guess, margin = self.predict(tokens)
        if not self._trusted(guess, margin):
            return None, guess
        if not self.reference and (self.predicted + self.audited + 1) % self.audit_every == 0:
            self.audited += 1
            return None, guess
        self.predicted += 1
        return guess, guess

    def learn(self, domain: str, tokens: Sequence[int], guess: str | None = None) -> bool:
        """Add a prompt the drafters scored as ``domain``; ``guess`` is what the lexicon said.
        Whether it was added (not into a reference lexicon: see the module doc)."""
        if not domain or self.reference:
            return False
        if guess is not None:
            self.agreement = 0.9 * self.agreement + 0.1 * (1.0 if guess == domain else 0.0)
        self.absorb(domain, 1, Counter(tokens))
        return True

    def keep_record_of(self, other: DomainLexicon) -> None:
        """Take ``other``'s agreement record and counts of use: this lexicon replaces it (a fresh
        read of the shared one), and trust is earned per router."""
        self.agreement, self.predicted, self.audited = other.agreement, other.predicted, other.audited

    def absorb(self, domain: str, examples: int, counts: Mapping[int, int], labelled: bool = False) -> None:
        """Add ``examples`` prompts of ``domain`` whose token counts are ``counts`` (a seed, or what
        other routers learned: see ``Store.load_lexicon``); ``labelled``: a seed of prompts known
        to be of ``domain``."""
        if labelled:
            self.labelled.add(domain)
        self.counts.setdefault(domain, Counter()).update(counts)
        self.totals[domain] = self.totals.get(domain, 0) + sum(counts.values())
        self.examples[domain] = self.examples.get(domain, 0) + examples
        self.vocabulary.update(counts)
