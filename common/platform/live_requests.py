"""Which requests one server stream holds state for, so that the stream's end frees them.

The verifier's ``Verify`` and the drafter's ``Draft`` streams create per-request KV caches; when
the router behind a stream goes away, the caches it left must be released. The set of live ids is
kept from the answers, not from the raw items: a release that was refused (a request repeated in
one batch, say) frees nothing, so its request stays live and must still be released at the end.

Ids enter before the work runs, so a stream cancelled while a pass is still running on the model
thread (the pass finishes and creates its states regardless) still frees what that pass created.
After the answers, each id of the batch settles: its last successful item decides (a release
leaves it dead, anything else live); an id with only refused items keeps its state from before
the batch, since a refusal changes no request. The set stays bounded by the live requests.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class LiveRequests:
    def __init__(self) -> None:
        self.ids: set[Hashable] = set()

    def begin(self, items: Iterable[tuple[Hashable, bool]]) -> dict[Hashable, bool]:
        """Before a batch of ``(key, release)`` items runs: every non-release key counts as live
        until the answers say otherwise. Returns each key's liveness before the batch."""
        before: dict[Hashable, bool] = {}
        for key, release in items:
            before.setdefault(key, key in self.ids)
            if not release:
                self.ids.add(key)
        return before

    def settle(self, before: dict[Hashable, bool], answers: Iterable[tuple[Hashable, bool, bool]]) -> None:
        """After the batch: ``(key, release, ok)`` per item in order."""
        live = dict(before)
        for key, release, ok in answers:
            if ok:
                live[key] = not release
        for key, alive in live.items():
            if alive:
                self.ids.add(key)
            else:
                self.ids.discard(key)

    def __bool__(self) -> bool:
        return bool(self.ids)
