"""Drafter work off the verifier's path: drafting ahead and routing ahead.

Both are parts of :class:`services.router.core.RouterCore`'s rounds (see its module docstring):

- *drafting ahead*: when only some requests of a round draft and the rest are worth verifying on
  their own (``SpeculationControl.drafting_ahead_pays``), the drafting ones leave the round, draft
  while the others' pass runs, and join a later pass with their trees (``Request.ahead``), so the
  pass does not wait for the drafters of a few of its requests;
- *routing ahead*: a new request whose domain takes the drafters' scores is scored, and its prompt
  read by its drafters, while its first passes (the target's prefill among them) decode plainly
  (unless it is alone in its round: then nothing else would be verified, and it is scored inline);
  so are the tokens a request committed while it decoded plainly, once more of them than its
  drafters catch up inline (``core.CATCH_UP_TOKENS``) wait for its drafters.

Such work runs as tasks beside the rounds (:meth:`OffPathDrafting._off_path`), cancelled at stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from common.logs import get_logger
from common.spec.fusion import DraftTree
from services.router.control import SpeculationControl
from services.router.drafting import Drafting
from services.router.gate import DraftGate
from services.router.pool import RequestPool
from services.router.requests import AheadDraft, Request

log = get_logger("router")


class OffPathDrafting(RequestPool):
    """The off-path part of :class:`services.router.core.RouterCore`, which sets these attributes
    and drafts a round's trees."""

    control: SpeculationControl
    drafting: Drafting
    gate: DraftGate
    _off_path_tasks: set[asyncio.Task[None]]
    _off_path_started: int  # off-path drafter calls started so far (a pass they overlap runs slower)

    async def _draft(
        self, batch: list[Request], ks: dict[str, int]
    ) -> tuple[dict[str, DraftTree], dict[str, list[str]]]:
        """A round's drafting, inline or ahead: the drafting requests routed, then drafted by chunk or by token "
        "fusion."""
        live = list(self.drafters.live()) if self.config.speculate else []
        # only the requests that draft this round need a domain and a routing vector; the others are
        # routed on the first round they draft in (no drafter scores a prompt that is never drafted for)
        await self.routing.route([r for r in batch if ks[r.request_id] > 0], live)
        if self.config.fusion == "chunk":
            return await self.drafting.chunks(batch, ks)
        return await self.drafting.tokens(batch, ks)

    def _drafts_ahead(self, batch: list[Request], drafting: list[Request], ks: dict[str, int]) -> bool:
        """Whether this round's drafting requests draft off the verifier's path: with cost control,
        while one round carries the pool (pipelined rounds already overlap drafting), when it pays
        on the measured pass and draft times (``SpeculationControl.drafting_ahead_pays``)."""
        return (
            self.config.draft_ahead
            and self.config.cost_control
            and 0 < len(drafting) < len(batch)
            and self._rounds_allowed() == 1
            and self.control.drafting_ahead_pays(len(batch), len(drafting), max(ks[r.request_id] for r in drafting))
        )

    async def _draft_ahead(self, group: list[Request], ks: dict[str, int]) -> None:
        """Draft for ``group`` while the rest of its round is verified; each request keeps its tree
        (``Request.ahead``) for its next round, in which the verifier sees the same committed
        sequence the drafters saw (no round verifies it in between: it stays out of the pool)."""
        t0 = self.clock()
        probes = sum(r.probing for r in group)
        try:
            trees, selected = await self._draft(group, ks)
            for r in group:
                r.ahead = AheadDraft(trees[r.request_id], tuple(selected.get(r.request_id, ())), len(r.sequence))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a drafter failure costs these requests their draft, not their round
            log.warning(
                "drafting ahead failed; the requests decode plainly next round",
                error=str(exc),
                requests=[r.request_id for r in group],
            )
        finally:
            elapsed = self.clock() - t0
            self.counters.draft_ahead_s += elapsed
            self.gate.charge_probes(elapsed, probes, len(group))
            log.debug("drafted ahead", requests=len(group), probes=probes, draft_ms=round(1e3 * elapsed, 1))
            for r in group:
                r.drafting_ahead = False
                self._hand_back(r)
            self._wakeup.set()

    async def _route_ahead(self, group: list[Request]) -> None:
        """Route new requests (their domain, from the drafters' scores of their prompts where the
        lexicon cannot tell) and bring their drafters to their prompts, while their rounds decode
        plainly."""
        self.counters.routed_ahead += len(group)
        t0 = self.clock()
        probes = sum(r.probing for r in group)
        try:
            live = list(self.drafters.live())
            await self.routing.route(group, live)
            await self.drafting.prefill(group, live)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # they stay unrouted and try again when they next draft
            log.warning("routing new requests failed", error=str(exc), requests=[r.request_id for r in group])
        finally:
            elapsed = self.clock() - t0
            self.gate.charge_probes(elapsed, probes, len(group))
            log.debug(
                "routed ahead",
                requests=len(group),
                probes=probes,
                prompt_tokens=sum(len(r.sequence) for r in group),
                route_ms=round(1e3 * elapsed, 1),
            )
            for r in group:
                r.routing_ahead = False
                if r.done:  # finished while being scored: the drafters hold its prompt for nothing
                    self._release_drafters(r)
            self._wakeup.set()

    def _off_path(self, coro: Awaitable[None]) -> None:
        """Start drafter work off the verifier's path (see the module docstring)."""
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._off_path_started += 1
        self._off_path_tasks.add(task)
        task.add_done_callback(self._off_path_tasks.discard)
