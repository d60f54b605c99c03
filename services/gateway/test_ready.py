"""The gateway's set-up on first use: a request that finds it ready finds all of it ready."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from services.gateway.server import GatewayApp
from services.gateway.settings import GatewaySettings


class Members:
    """A store that knows one verifier (serving ``target``) and one router."""

    def __init__(self, target: str) -> None:
        self.target = target

    async def members(self, kind: str):
        if kind == "verifier":
            return [SimpleNamespace(info={"target": self.target, "vocab_size": 320, "max_context": 1024})]
        return [SimpleNamespace(address="127.0.0.1:9")]


def test_concurrent_first_requests_never_see_a_half_ready_gateway(tiny_zoo):
    """Requests arriving together on a fresh gateway: the moment its limits are set (what a request
    takes for ready), the model name, the end-of-sequence ids and the grammar engine are set too,
    whichever request's set-up finished (an unset model name was a 404 for the clients)."""
    app = GatewayApp(GatewaySettings(), store=Members(str(tiny_zoo.target.path)))
    seen = []

    async def watch() -> None:
        while app.limits is None:
            await asyncio.sleep(0)
        seen.append((app.model_name, app.eos_ids, app.grammars is not None))

    async def main() -> None:
        await asyncio.gather(app.ensure_ready(), app.ensure_ready(), watch())

    asyncio.run(main())
    assert seen == [("target", (2,), True)]
