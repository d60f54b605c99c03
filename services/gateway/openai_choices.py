"""``n`` choices of one OpenAI request: ``n`` independent generations of the same prompt.

Each choice is a request of its own at the router (id ``<id>-<i>``, and with a seed, seed ``+ i``,
so that seeded choices differ from one another); they run side by side, so the verifier prefills
their prompt in the same pass rather than one after another. (They share no cache: each request
keeps its own.) At temperature 0 every choice is the target's one greedy
output, as it must be. ``n == 1`` is the request itself, unchanged.

No HTTP here: :mod:`services.gateway.http_api` shapes what these return.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from services.gateway.progress import Progress, SpecStats
from services.gateway.requests import GenerationRequest

T = TypeVar("T")

SEED_SPACE = 1 << 64


def fan_out(gen: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The ``n`` requests of a validated request's choices (itself when ``n == 1``)."""
    if n == 1:
        return [gen]
    return [
        replace(
            gen,
            request_id=f"{gen.request_id}-{i}",
            seed=None if gen.seed is None else (gen.seed + i) % SEED_SPACE,
        )
        for i in range(n)
    ]


async def _close(streams: Sequence[AsyncIterator[Progress]]) -> None:
    for s in streams:
        with contextlib.suppress(Exception):
            await s.aclose()  # type: ignore[attr-defined]


async def _all_or_none(work: Sequence[Awaitable[T]], streams: Sequence[AsyncIterator[Progress]]) -> list[T]:
    """Every one of ``work`` side by side; when one fails, the others are cancelled, every
    choice's stream is closed, and the failure is raised."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(streams)
        raise


async def first_pieces(streams: Sequence[AsyncIterator[Progress]]) -> list[Progress]:
    """Every choice's first piece (a failure before any token still gets its status code). A
    failure of one choice ends all of them and raises it; so does a choice that ends without output."""
    return await _all_or_none([anext(s) for s in streams], streams)


@dataclass
class Collected:
    """One choice, whole: its text, its tokens' count and logprob entries, and its last piece."""

    last: Progress
    text: list[str] = field(default_factory=list)
    count: int = 0
    entries: list = field(default_factory=list)

    def add(self, piece: Progress) -> None:
        self.text.append(piece.text)
        self.count += len(piece.token_ids)
        self.entries.extend(piece.logprobs)
        self.last = piece


async def collect(streams: Sequence[AsyncIterator[Progress]], firsts: Sequence[Progress]) -> list[Collected]:
    """Every choice to its end, side by side; a failure of one ends all and raises it."""

    async def one(stream: AsyncIterator[Progress], first: Progress) -> Collected:
        got = Collected(first)
        got.add(first)
        async for piece in stream:
            got.add(piece)
        return got

    return await _all_or_none([one(s, f) for s, f in zip(streams, firsts)], streams)


async def merged(
    streams: Sequence[AsyncIterator[Progress]], firsts: Sequence[Progress]
) -> AsyncIterator[tuple[int, Progress]]:
    """The choices' pieces as they come, each with its choice's index, each choice's first piece
    first; ends when every choice has finished. A failure of one choice (a :class:`GatewayError`)
    is raised here and the others are closed, as they are when this iterator is closed."""
    queue: asyncio.Queue[tuple[int, Progress | None, Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Progress]) -> None:
        try:
            async for piece in stream:
                await queue.put((i, piece, None))
        except Exception as exc:  # a GatewayError, or a bug: either way the response ends with it
            await queue.put((i, None, exc))
            return
        await queue.put((i, None, None))

    for i, first in enumerate(firsts):
        yield i, first
    going = {i for i, f in enumerate(firsts) if not f.finished}
    tasks = [asyncio.ensure_future(pump(i, streams[i])) for i in sorted(going)]
    try:
        while going:
            i, piece, error = await queue.get()
            if error is not None:
                raise error
            if piece is None:
                going.discard(i)
                continue
            yield i, piece
            if piece.finished:
                going.discard(i)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(streams)


def merged_stats(stats: Sequence[SpecStats | None]) -> SpecStats | None:
    """The speculative-decoding figures of all choices together (one choice's own when ``n == 1``)."""
    known = [s for s in stats if s is not None]
    if len(stats) == 1 or not known:
        return stats[0] if stats else None
    by_drafter: dict[str, int] = {}
    for s in known:
        for d, k in s.accepted_by_drafter.items():
            by_drafter[d] = by_drafter.get(d, 0) + k
    rounds = sum(s.rounds for s in known)
    accepted = sum(s.accepted_tokens for s in known)
    return SpecStats(
        rounds=rounds,
        mean_accepted_len=accepted / rounds if rounds else 0.0,
        draft_tokens=sum(s.draft_tokens for s in known),
        accepted_tokens=accepted,
        drafters_used=tuple(sorted({d for s in known for d in s.drafters_used})),
        accepted_by_drafter=by_drafter,
        grammar_pruned_tokens=sum(s.grammar_pruned_tokens for s in known),
    )
