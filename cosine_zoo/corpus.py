"""The zoo's training corpus: four domains with clearly different statistics.

Everything comes from text every Python installation has or from seeded generators, so the
corpus is rebuilt on demand and never stored:

- ``code``: the standard library's own source files, in chunks of a few dozen lines.
- ``prose``: the English language reference shipped in ``pydoc_data.topics``.
- ``arithmetic``: column addition, subtraction and multiplication worked step by step.
- ``records``: structured records, as JSON lines and as CSV tables.

Each domain is split into train and held-out documents; held-out documents never reach training
and give the evaluation prompts (see :func:`make_prompts`).
"""

from __future__ import annotations

import json
import random
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DOMAINS = ("code", "prose", "arithmetic", "records")


@dataclass(frozen=True)
class CorpusSpec:
    """How much text each domain contributes (characters, train + held-out together)."""

    chars_per_domain: int
    heldout_fraction: float = 0.1


@dataclass(frozen=True)
class DomainText:
    name: str
    train: tuple[str, ...]
    heldout: tuple[str, ...]

    @property
    def train_chars(self) -> int:
        return sum(len(d) for d in self.train)


@dataclass(frozen=True)
class Corpus:
    domains: dict[str, DomainText]

    @property
    def names(self) -> list[str]:
        return list(self.domains)


def build_corpus(spec: CorpusSpec, seed: int) -> Corpus:
    """All domains, each cut to ``spec.chars_per_domain`` characters and split train/held-out."""
    sources: dict[str, Callable[[random.Random, int], list[str]]] = {
        "code": stdlib_code_docs,
        "prose": reference_prose_docs,
        "arithmetic": arithmetic_docs,
        "records": record_docs,
    }
    domains = {}
    for name in DOMAINS:
        rng = random.Random(f"{seed}:{name}")
        docs = sources[name](rng, spec.chars_per_domain)
        domains[name] = split_docs(name, docs, spec.heldout_fraction)
    return Corpus(domains)


def split_docs(name: str, docs: list[str], heldout_fraction: float) -> DomainText:
    """Every n-th document is held out (deterministic, spread over the whole domain)."""
    every = max(2, round(1 / heldout_fraction))
    heldout = tuple(d for i, d in enumerate(docs) if i % every == every - 1)
    train = tuple(d for i, d in enumerate(docs) if i % every != every - 1)
    if not train or not heldout:
        raise ValueError(f"domain {name!r}: too little text to split ({len(docs)} documents)")
    return DomainText(name, train, heldout)


def take_chars(docs: list[str], budget: int) -> list[str]:
    out, total = [], 0
    for doc in docs:
        if total >= budget:
            break
        out.append(doc)
        total += len(doc)
    return out


# ---- text every Python installation has ---------------------------------------------------------


def stdlib_code_docs(rng: random.Random, budget: int, lines_per_chunk: int = 40) -> list[str]:
    """Chunks of the standard library's top-level modules, cut at blank lines.

    Files are taken in a seeded order (from the sorted list) so that a small budget still spans
    many modules.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise RuntimeError(f"no standard library sources found under {root}")
    rng.shuffle(files)
    docs: list[str] = []
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for chunk in chunk_lines(text, lines_per_chunk):
            docs.append(chunk)
            total += len(chunk)
        if total >= budget:
            break
    return take_chars(docs, budget)


def chunk_lines(text: str, lines_per_chunk: int) -> list[str]:
    """Split at the first blank line after every ``lines_per_chunk`` lines."""
    chunks, current = [], []
    for line in text.splitlines():
        current.append(line)
        if len(current) >= lines_per_chunk and not line.strip():
            chunks.append("\n".join(current).strip("\n") + "\n")
            current = []
    if any(line.strip() for line in current):
        chunks.append("\n".join(current).strip("\n") + "\n")
    return [c for c in chunks if len(c) > 200]


def reference_prose_docs(rng: random.Random, budget: int, chars_per_doc: int = 800) -> list[str]:
    """The language reference topics, in paragraph-aligned pieces of about ``chars_per_doc``."""
    from pydoc_data.topics import topics

    docs: list[str] = []
    for key in sorted(topics):
        paragraphs = [p for p in topics[key].split("\n\n") if p.strip()]
        current = ""
        for para in paragraphs:
            current = f"{current}\n\n{para}" if current else para
            if len(current) >= chars_per_doc:
                docs.append(current.strip() + "\n")
                current = ""
        if len(current) > 200:
            docs.append(current.strip() + "\n")
    rng.shuffle(docs)
    return take_chars(docs, budget)


# ---- deterministic generators ------------------------------------------------------------------


def arithmetic_docs(rng: random.Random, budget: int) -> list[str]:
    docs, total = [], 0
    ops = (worked_addition, worked_subtraction, worked_multiplication)
    while total < budget:
        problems = [ops[rng.randrange(len(ops))](rng) for _ in range(rng.randint(2, 4))]
        doc = "\n".join(problems)
        docs.append(doc)
        total += len(doc)
    return docs


def digits(n: int) -> list[int]:
    return [int(c) for c in reversed(str(n))]


def worked_addition(rng: random.Random) -> str:
    a, b = rng.randint(10, 99999), rng.randint(10, 99999)
    da, db = digits(a), digits(b)
    lines = [f"Problem: {a} + {b}"]
    carry = 0
    for i in range(max(len(da), len(db))):
        x, y = (da[i] if i < len(da) else 0), (db[i] if i < len(db) else 0)
        s = x + y + carry
        lines.append(f"Step {i + 1}: {x} + {y} + {carry} = {s}, write {s % 10}, carry {s // 10}")
        carry = s // 10
    if carry:
        lines.append(f"Step {max(len(da), len(db)) + 1}: write the carry {carry}")
    lines.append(f"Answer: {a + b}\n")
    return "\n".join(lines)


def worked_subtraction(rng: random.Random) -> str:
    a, b = sorted((rng.randint(10, 99999), rng.randint(10, 99999)), reverse=True)
    da, db = digits(a), digits(b)
    lines = [f"Problem: {a} - {b}"]
    borrow = 0
    for i in range(len(da)):
        x, y = da[i], (db[i] if i < len(db) else 0)
        d = x - y - borrow
        new_borrow = 1 if d < 0 else 0
        lines.append(f"Step {i + 1}: {x} - {y} - {borrow} = {d}, write {d % 10}, borrow {new_borrow}")
        borrow = new_borrow
    lines.append(f"Answer: {a - b}\n")
    return "\n".join(lines)


def worked_multiplication(rng: random.Random) -> str:
    a, b = rng.randint(10, 9999), rng.randint(2, 9)
    lines = [f"Problem: {a} * {b}"]
    carry = 0
    da = digits(a)
    for i, x in enumerate(da):
        p = x * b + carry
        lines.append(f"Step {i + 1}: {x} * {b} + {carry} = {p}, write {p % 10}, carry {p // 10}")
        carry = p // 10
    if carry:
        lines.append(f"Step {len(da) + 1}: write the carry {carry}")
    lines.append(f"Answer: {a * b}\n")
    return "\n".join(lines)


FIRST_NAMES = (
    "Alice",
    "Bruno",
    "Chen",
    "Dana",
    "Emeka",
    "Farah",
    "Goran",
    "Hana",
    "Ivan",
    "Julia",
    "Kofi",
    "Lena",
    "Mateo",
    "Nadia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
)
LAST_NAMES = (
    "Smith",
    "Garcia",
    "Nguyen",
    "Okafor",
    "Muller",
    "Rossi",
    "Kowalski",
    "Tanaka",
    "Silva",
    "Haddad",
    "Jensen",
    "Novak",
    "Ivanova",
    "Dubois",
    "Moreau",
    "Larsen",
)
CITIES = ("Lyon", "Porto", "Osaka", "Lagos", "Quito", "Oslo", "Turin", "Graz", "Leeds", "Pune", "Perth", "Cork")
PRODUCTS = ("keyboard", "monitor", "cable", "lamp", "chair", "desk", "router", "headset", "webcam", "mouse")
STATUSES = ("paid", "pending", "shipped", "refunded", "cancelled")


def person_record(rng: random.Random, idx: int) -> dict[str, object]:
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    return {
        "id": idx,
        "name": f"{first} {last}",
        "email": f"{first.lower()}.{last.lower()}@example.com",
        "city": rng.choice(CITIES),
        "age": rng.randint(18, 90),
        "active": rng.random() < 0.7,
    }


def order_record(rng: random.Random, idx: int) -> dict[str, object]:
    qty = rng.randint(1, 9)
    price = rng.randint(199, 49999) / 100
    return {
        "order": idx,
        "product": rng.choice(PRODUCTS),
        "quantity": qty,
        "unit_price": price,
        "total": round(qty * price, 2),
        "status": rng.choice(STATUSES),
    }


def record_docs(rng: random.Random, budget: int) -> list[str]:
    """Alternating JSON-lines and CSV documents of people and orders."""
    docs, total = [], 0
    while total < budget:
        make = person_record if rng.random() < 0.5 else order_record
        start = rng.randint(1000, 99000)
        rows = [make(rng, start + i) for i in range(rng.randint(4, 8))]
        if rng.random() < 0.5:
            doc = "\n".join(json.dumps(r) for r in rows) + "\n"
        else:
            header = ",".join(rows[0])
            doc = header + "\n" + "\n".join(",".join(csv_value(v) for v in r.values()) for r in rows) + "\n"
        docs.append(doc)
        total += len(doc)
    return docs


def csv_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# ---- held-out prompts ---------------------------------------------------------------------------


def make_prompts(corpus: Corpus, per_domain: int, min_chars: int = 60, max_chars: int = 240) -> dict[str, list[str]]:
    """Prompts cut from held-out documents: whole leading lines, about ``min_chars``..``max_chars``.

    Each domain yields up to ``per_domain`` prompts, one per held-out document (the first ones).
    """
    prompts: dict[str, list[str]] = {}
    for name, domain in corpus.domains.items():
        out = [p for p in (prompt_from(doc, min_chars, max_chars) for doc in domain.heldout) if p]
        if len(out) < per_domain:
            raise ValueError(f"domain {name!r}: only {len(out)} held-out prompts, need {per_domain}")
        prompts[name] = out[:per_domain]
    return prompts


def prompt_from(doc: str, min_chars: int, max_chars: int) -> str | None:
    """The document's leading lines: at least ``min_chars`` and at most ``max_chars`` characters."""
    text = ""
    for line in doc.splitlines(keepends=True):
        if len(text) >= min_chars:
            break
        text += line
    text = text[:max_chars]
    return text if len(text) >= min_chars // 2 and len(text) < len(doc) else None
