"""Once-per-process work done as the node starts, not on its first create.

A new node's first sandbox used to pay for what a process does once: the
TLS context every sandbox's HTTP client shares (25-45 ms of CPU, on the
event loop), runsc's flag probe (`runsc flags`, 15-30 ms) and, from the
store, new connections (a TLS handshake each against a real bucket).
`prime` does the local part before the node answers /health (the parts at
once: about the longest of them); `warm_store` opens the store's
connections in the background right after, so a slow or unreachable store
never delays a start. Nothing is skipped: the same checks run, earlier.
"""

from __future__ import annotations

import logging
import time

import trio

from aenv.node.sandbox import client_tls_context
from aenv.runtimes.gvisor import GVisorRuntime
from aenv.storage.objstore import ObjectStore, StoreError

log = logging.getLogger("aenv.primer")

# keys no one writes: a HEAD that answers "not found" opens a connection
_WARM_KEY = "aenv-node-warm-up"
# connections opened at once: the restore's own concurrent store calls
WARM_CONNECTIONS = 8
WARM_TIMEOUT_S = 10.0


async def prime(runtime: GVisorRuntime) -> None:
    """Build the sandbox clients' TLS context and ask runsc which flags it knows."""
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, client_tls_context)
        nursery.start_soon(runtime.probe)
    log.debug("primed in %.3fs", time.perf_counter() - t0)


async def warm_store(store: ObjectStore) -> None:
    """Open up to `WARM_CONNECTIONS` connections to the store (HEADs of keys no one
    writes), so the first restore does not set them up. Best effort: a store that
    fails or is slow is the first restore's problem, as before."""
    t0 = time.perf_counter()
    failed: list[StoreError] = []

    async def head(key: str) -> None:
        try:
            await store.head(key)
        except StoreError as exc:
            failed.append(exc)

    with trio.move_on_after(WARM_TIMEOUT_S) as scope:
        async with trio.open_nursery() as nursery:
            for i in range(WARM_CONNECTIONS):
                nursery.start_soon(head, f"{_WARM_KEY}-{i}")
    if failed or scope.cancelled_caught:
        log.info(
            "the object store did not answer a warm-up: %s",
            failed[0] if failed else f"nothing in {WARM_TIMEOUT_S:.0f}s",
        )
    else:
        log.debug("object store connections opened in %.3fs", time.perf_counter() - t0)
