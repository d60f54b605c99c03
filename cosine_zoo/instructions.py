"""The ``chat`` domain: instructions a user would send, rendered through the target's chat template.

Instructions come from seeded templates over subject lists (Python topics from the language
reference, standard-library modules, everyday subjects). Subjects are split between training and
held-out, so a held-out prompt never asks about a subject the drafters were trained on.

A tokenizer with a chat template renders each instruction as a single user turn with the
generation prompt (what an OpenAI-style chat request becomes); one without a template gets a
plain ``Question: ... / Answer:`` frame.
"""

from __future__ import annotations

import random
from typing import Any

TEMPLATES = (
    "Explain {s} in simple terms.",
    "What is {s}? Answer in two sentences.",
    "Give me three tips about {s}.",
    "Write a short paragraph about {s}.",
    "Why does {s} matter? Be brief.",
    "Describe {s} to a beginner.",
    "List the main facts about {s}.",
    "Write a haiku about {s}.",
)

EVERYDAY = (
    "the water cycle",
    "photosynthesis",
    "healthy sleep",
    "learning a new language",
    "saving money",
    "time management",
    "the solar system",
    "recycling",
    "public speaking",
    "baking bread",
    "climate change",
    "the human heart",
    "volcanoes",
    "electric cars",
    "the history of the internet",
    "meditation",
    "gardening",
    "remote work",
    "the moon",
    "honey bees",
    "rain forests",
    "chess openings",
    "writing a resume",
    "the immune system",
    "solar panels",
    "coffee",
    "the stock market",
    "earthquakes",
    "running a marathon",
    "first aid",
    "the printing press",
    "black holes",
    "octopuses",
    "tea ceremonies",
    "composting",
    "jazz music",
    "the Roman empire",
    "friendship",
    "mountain hiking",
    "ocean tides",
)

STDLIB_MODULES = (
    "json",
    "csv",
    "os.path",
    "itertools",
    "functools",
    "collections",
    "datetime",
    "re",
    "pathlib",
    "subprocess",
    "threading",
    "asyncio",
    "logging",
    "argparse",
    "unittest",
    "sqlite3",
    "random",
    "math",
    "statistics",
    "dataclasses",
    "typing",
    "contextlib",
    "heapq",
    "bisect",
    "shutil",
    "tempfile",
    "zipfile",
)

PY_CONCEPTS = (
    "list comprehensions",
    "generators",
    "decorators",
    "context managers",
    "exceptions",
    "closures",
    "recursion",
    "dictionaries",
    "tuples",
    "classes and objects",
    "inheritance",
    "lambda functions",
    "string formatting",
    "slicing",
    "iterators",
    "the global interpreter lock",
    "type hints",
    "modules and packages",
    "virtual environments",
    "unit tests",
    "variables",
    "loops",
    "sorting",
    "hash tables",
)


def subjects(heldout: bool, heldout_every: int = 5) -> list[str]:
    """Every ``heldout_every``-th subject of each list is held out; the rest train."""
    out = []
    for group, fmt in ((EVERYDAY, "{}"), (STDLIB_MODULES, "the Python {} module"), (PY_CONCEPTS, "{} in Python")):
        for i, s in enumerate(group):
            if (i % heldout_every == heldout_every - 1) == heldout:
                out.append(fmt.format(s))
    return out


def instructions(n: int, seed: int, heldout: bool) -> list[str]:
    """``n`` distinct-as-possible instructions (seeded), over training or held-out subjects."""
    rng = random.Random(f"{seed}:chat:{'heldout' if heldout else 'train'}")
    pool = [t.format(s=s) for s in subjects(heldout) for t in TEMPLATES]
    rng.shuffle(pool)
    return [pool[i % len(pool)] for i in range(n)]


def render(tokenizer: Any, instruction: str) -> str:
    """The prompt text the target sees for one user turn, generation prompt included."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": instruction}], tokenize=False, add_generation_prompt=True
        )
    return f"Question: {instruction}\nAnswer:"
