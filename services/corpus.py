"""The lookup corpus as Redis holds it, kept loaded by the router and the verifier.

:func:`corpus_from_store` reads the seeded corpus when its version changed and indexes it off the
event loop; :func:`keep_corpus_loaded` polls a loader and hands every new corpus to its user. The
corpus itself (indexing, matching, proposals) is :mod:`common.spec.lookup_corpus`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from common.logs import get_logger
from common.platform.store import Store, StoreUnavailable
from common.spec.lookup_corpus import DomainCorpora

log = get_logger(__name__)

# load(known_version): the corpora and their version when the seeded version differs, else None
CorpusLoader = Callable[[int], Awaitable[tuple[int, DomainCorpora | None] | None]]


async def corpus_from_store(store: Store, known_version: int) -> tuple[int, DomainCorpora | None] | None:
    """The lookup corpus seeded into Redis and its version, when the version differs from
    ``known_version`` (its corpora None when the seed is empty); None when unchanged or while
    Redis is out. Built off the event loop: a corpus of 100k tokens takes a while to index."""
    try:
        version = await store.corpus_version()
        if version == known_version:
            return None
        loaded = await store.load_corpus()
    except StoreUnavailable as exc:
        log.warning("lookup corpus unreadable; lookup drafts from the requests' own text meanwhile", error=str(exc))
        return None
    corpora = await asyncio.to_thread(DomainCorpora.build, loaded) if loaded else None
    log.info(
        "lookup corpus loaded",
        version=version,
        tokens=len(corpora.everything) if corpora else 0,
        sequences={d: c.sequences for d, c in sorted(corpora.by_domain.items())} if corpora else {},
    )
    return version, corpora


async def keep_corpus_loaded(
    load: CorpusLoader, use: Callable[[DomainCorpora | None], None], closed: Callable[[], bool], every_s: float = 2.0
) -> None:
    """Load the lookup corpus, and again whenever it is seeded anew, handing each to ``use``, until ``closed()``."""
    version = 0
    while not closed():
        got = await load(version)
        if got is not None:
            version, corpora = got
            use(corpora)
        await asyncio.sleep(every_s)
