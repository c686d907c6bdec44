"""Small pieces for the ASGI apps tests serve with Hypercorn as upstreams."""

from __future__ import annotations

from aenv.kit.asgiforward import Receive, Send


async def lifespan(receive: Receive, send: Send) -> None:
    """Answer an ASGI lifespan scope: each event completes, until shutdown."""
    while True:
        msg = await receive()
        await send({"type": msg["type"] + ".complete"})
        if msg["type"] == "lifespan.shutdown":
            return
