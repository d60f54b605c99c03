"""The zoo directory and its ``zoo.json`` manifest.

Layout (all paths in the manifest are relative to the zoo directory)::

    zoo.json            manifest: models, domains, training figures, evaluation
    prompts.jsonl       held-out prompts, one {"domain": ..., "text": ...} per line
    lexicon.json        token counts of the training prompts per domain: seeds the routers'
                        domain lexicon, so new requests are routed without drafter passes (optional:
                        zoos built before it have none, and their routers learn it online)
    lookup_corpus.json  the target's greedy continuations of the training prompts (token ids, prompt
                        first) per domain: seeds the routers' lookup corpus (optional: zoos built
                        before it have none, and their lookup drafts from each request's own text)
    tokenizer/          the shared tokenizer (also copied into every model directory)
    target/             the target: an ordinary transformers checkpoint (float32 safetensors)
    drafters/<name>/    one checkpoint per drafter (one per domain, plus "generalist")

:func:`load_zoo` validates all of it and raises :class:`ZooError` (a
:class:`~common.runtime.checkpoints.CheckpointError`) naming the offending path.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.runtime.checkpoints import CheckpointError, check_checkpoint_dir, load_tokenizer, tokenizer_fingerprint

MANIFEST = "zoo.json"
PROMPTS = "prompts.jsonl"
LEXICON = "lexicon.json"
LEXICON_FORMAT = "cosine-lexicon/1"
LOOKUP_CORPUS = "lookup_corpus.json"
LOOKUP_CORPUS_FORMAT = "cosine-lookup-corpus/1"
FORMAT = "cosine-zoo/1"


class ZooError(CheckpointError):
    """A zoo directory is missing, incomplete or inconsistent. The message names the path."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    params: int
    domains: tuple[str, ...]


@dataclass(frozen=True)
class Zoo:
    root: Path
    profile: str
    seed: int
    tokenizer_path: Path
    tokenizer_fingerprint: str
    target: ModelEntry
    drafters: Mapping[str, ModelEntry]
    domains: tuple[str, ...]
    k: int
    acceptance: Mapping[str, Mapping[str, float]]  # drafter -> domain -> mean accepted tokens per round
    target_perplexity: Mapping[str, float]
    prompts: Mapping[str, tuple[str, ...]]
    manifest: Mapping[str, Any]  # zoo.json as written (training figures, timings, environment)
    # domain -> (training prompts, token id -> count over them); empty when the zoo has no lexicon.json
    lexicon: Mapping[str, tuple[int, Mapping[int, int]]] = field(default_factory=dict)
    # domain -> token sequences the target wrote; empty when the zoo has no lookup_corpus.json
    lookup_corpus: Mapping[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)

    def figures(self) -> dict[str, Any]:
        """Everything in the manifest that a rebuild with the same seed must reproduce (no timings)."""
        return {key: value for key, value in self.manifest.items() if key != "timings"}

    def best_drafter(self, domain: str) -> str:
        return max(self.acceptance, key=lambda name: self.acceptance[name].get(domain, 0.0))


def write_manifest(root: Path, manifest: Mapping[str, Any]) -> None:
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    tmp.replace(root / MANIFEST)


def write_prompts(root: Path, prompts: Mapping[str, list[str]]) -> None:
    lines = [json.dumps({"domain": d, "text": t}) for d, texts in prompts.items() for t in texts]
    (root / PROMPTS).write_text("\n".join(lines) + "\n")


def write_lexicon(root: Path, prompts: Mapping[str, Iterable[Sequence[int]]]) -> None:
    """The token counts of each domain's training prompts (token ids), for the routers' lexicon."""
    domains = {}
    for domain, ids in prompts.items():
        counts: Counter[int] = Counter()
        examples = 0
        for prompt in ids:
            counts.update(int(t) for t in prompt)
            examples += 1
        domains[domain] = {"examples": examples, "counts": {str(t): c for t, c in sorted(counts.items())}}
    (root / LEXICON).write_text(json.dumps({"format": LEXICON_FORMAT, "domains": domains}) + "\n")


def read_lexicon(path: Path) -> dict[str, tuple[int, dict[int, int]]]:
    """``write_lexicon``'s file as domain -> (examples, counts); {} when the zoo has none."""
    return _read_domains(
        path,
        LEXICON_FORMAT,
        "lexicon",
        lambda v: (int(v["examples"]), {int(t): int(c) for t, c in v["counts"].items()}),
    )


def _read_domains(path: Path, fmt: str, what: str, parse: Callable[[Any], Any]) -> dict[str, Any]:
    """A per-domain JSON file of the zoo (``{"format": fmt, "domains": {domain: value}}``), each
    value through ``parse``; {} when the file is absent (zoos built before it), a ZooError naming
    ``what`` when it cannot be read."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != fmt:
            raise ValueError(f"expected format {fmt!r}")
        return {d: parse(v) for d, v in raw["domains"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ZooError(f"{path}: unreadable {what} ({type(exc).__name__}: {exc})") from exc


def write_lookup_corpus(root: Path, sequences: Mapping[str, Iterable[Sequence[int]]]) -> None:
    """The token sequences the target wrote, per domain, for the routers' lookup corpus."""
    domains = {d: [[int(t) for t in seq] for seq in seqs] for d, seqs in sequences.items()}
    (root / LOOKUP_CORPUS).write_text(json.dumps({"format": LOOKUP_CORPUS_FORMAT, "domains": domains}) + "\n")


def read_lookup_corpus(path: Path) -> dict[str, tuple[tuple[int, ...], ...]]:
    """``write_lookup_corpus``'s file as domain -> sequences; {} when the zoo has none."""
    return _read_domains(
        path, LOOKUP_CORPUS_FORMAT, "lookup corpus", lambda seqs: tuple(tuple(int(t) for t in seq) for seq in seqs)
    )


def load_zoo(path: str | Path, check_tokenizers: bool = True) -> Zoo:
    """Read and validate a zoo directory; every problem is one :class:`ZooError` naming a path."""
    root = Path(path)
    if not root.is_dir():
        raise ZooError(f"{root}: no such zoo directory (build one with `cosine models build --out {root}`)")
    manifest = read_manifest(root / MANIFEST)
    try:
        zoo = zoo_from_manifest(root, manifest)
    except (KeyError, TypeError, ValueError) as exc:
        raise ZooError(f"{root / MANIFEST}: malformed manifest ({type(exc).__name__}: {exc})") from exc
    check_models(zoo)
    if check_tokenizers:
        check_fingerprints(zoo)
    return zoo


def read_manifest(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ZooError(f"{path}: missing (an incomplete build? rerun `cosine models build`)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ZooError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ZooError(f"{path}: not a zoo manifest (expected format {FORMAT!r})")
    return manifest


def zoo_from_manifest(root: Path, m: Mapping[str, Any]) -> Zoo:
    domains = tuple(m["domains"])
    evaluation = m["evaluation"]
    drafters = {name: model_entry(root, name, entry) for name, entry in m["drafters"].items()}
    acceptance = {name: {d: float(v) for d, v in row.items()} for name, row in evaluation["acceptance"].items()}
    for name in drafters:
        missing = [d for d in domains if d not in acceptance.get(name, {})]
        if missing:
            raise ValueError(f"acceptance matrix lacks drafter {name!r} on domains {missing}")
    return Zoo(
        root=root,
        profile=str(m["profile"]),
        seed=int(m["seed"]),
        tokenizer_path=root / m["tokenizer"]["path"],
        tokenizer_fingerprint=str(m["tokenizer"]["fingerprint"]),
        target=model_entry(root, "target", m["target"]),
        drafters=drafters,
        domains=domains,
        k=int(evaluation["k"]),
        acceptance=acceptance,
        target_perplexity={d: float(v) for d, v in evaluation["target_perplexity"].items()},
        prompts=read_prompts(root / m["prompts"]["path"], domains),
        manifest=m,
        lexicon=read_lexicon(root / LEXICON),
        lookup_corpus=read_lookup_corpus(root / LOOKUP_CORPUS),
    )


def model_entry(root: Path, name: str, entry: Mapping[str, Any]) -> ModelEntry:
    return ModelEntry(
        name=name, path=root / entry["path"], params=int(entry["params"]), domains=tuple(entry["domains"])
    )


def read_prompts(path: Path, domains: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    if not path.is_file():
        raise ZooError(f"{path}: missing (held-out prompts of the zoo)")
    prompts: dict[str, list[str]] = {d: [] for d in domains}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts[row["domain"]].append(str(row["text"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ZooError(f"{path}:{lineno}: bad prompt line ({type(exc).__name__}: {exc})") from exc
    empty = [d for d, texts in prompts.items() if not texts]
    if empty:
        raise ZooError(f"{path}: no prompts for domains {empty}")
    return {d: tuple(texts) for d, texts in prompts.items()}


def check_models(zoo: Zoo) -> None:
    for entry in (zoo.target, *zoo.drafters.values()):
        try:
            check_checkpoint_dir(entry.path, need_weights=True, need_tokenizer=True)
        except CheckpointError as exc:
            raise ZooError(f"zoo {zoo.root}: {entry.name}: {exc}") from exc


def check_fingerprints(zoo: Zoo) -> None:
    """Every checkpoint's tokenizer must equal the zoo's (same ids for the same text)."""
    for entry_path, label in [(zoo.tokenizer_path, "tokenizer"), (zoo.target.path, "target")] + [
        (e.path, e.name) for e in zoo.drafters.values()
    ]:
        try:
            got = tokenizer_fingerprint(load_tokenizer(entry_path))
        except CheckpointError as exc:
            raise ZooError(f"zoo {zoo.root}: {label}: {exc}") from exc
        if got != zoo.tokenizer_fingerprint:
            raise ZooError(
                f"{entry_path}: tokenizer fingerprint {got} does not match the zoo's {zoo.tokenizer_fingerprint} "
                "(mismatched tokenizer; rebuild with `cosine models build --force`)"
            )


def specialist_ratios(
    matrix: Mapping[str, Mapping[str, float]], domains: list[str], generalist: str = "generalist"
) -> list[tuple[str, float, float, float]]:
    """``(domain, generalist, specialist, specialist / generalist)`` for every domain with a
    drafter named after it: what routing by expertise has to exploit (empty without a generalist)."""
    base = matrix.get(generalist)
    if base is None:
        return []
    out = []
    for d in domains:
        if d in matrix and d in base and d in matrix[d]:
            g, sp = base[d], matrix[d][d]
            out.append((d, g, sp, sp / g if g > 0 else float("inf")))
    return out


def evaluation_record(
    spec: Any, perplexity: dict[str, float], matrix: dict[str, dict[str, float]], rounds: dict[str, dict[str, int]]
) -> dict[str, Any]:
    """``zoo.json``'s ``evaluation``: the settings the figures were measured with (an ``EvalSpec``),
    the target's held-out perplexity, the acceptance matrix, the rounds behind each cell, and each
    specialist's acceptance on its own domain over the generalist's (``None`` where that is 0)."""
    return {
        "k": spec.k,
        "new_tokens": spec.new_tokens,
        "prompts_per_domain": spec.prompts_per_domain,
        "target_perplexity": perplexity,
        "acceptance": matrix,
        "rounds": rounds,
        "specialist_ratio": {
            d: round(r, 4) if g > 0 else None for d, g, _, r in specialist_ratios(matrix, list(perplexity))
        },
    }
