"""Which replica of a drafter serves a request.

Several processes may host the same drafter id (replicas). A request's drafter cache lives on one
replica, so the choice must be stable per request: rendezvous (highest random weight) hashing of
(request id, replica address) spreads requests evenly over replicas and, when a replica leaves,
moves only the requests that were on it. A replica that joins takes over about 1/n of the
requests; those lose their cache on the old replica and are re-synced from the committed
sequence (the router keeps the committed tokens, so this costs one prefill, never a token).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def _weight(request_id: str, address: str) -> int:
    digest = hashlib.blake2b(f"{request_id}\x00{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pick_replica(request_id: str, addresses: Sequence[str]) -> str | None:
    """The replica address for ``request_id`` among ``addresses`` (None when there is none)."""
    if not addresses:
        return None
    return max(sorted(addresses), key=lambda a: _weight(request_id, a))
