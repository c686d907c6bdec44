"""The host facilities a sandbox actor uses, as Protocols, and the real envd control.

Besides its runtime (`aenv.runtimes.base.Runtime`), a sandbox needs a network
slot (`NetworkSlots`; the real one is `aenv.runtimes.netns.HostNetwork`), a
writable root over its layer stack (`WritableRoots`; the real one is
`aenv.storage.overlay.OverlayRoots`, overlay mounts), envd's control calls
(`EnvdControl`; `HttpEnvd` here, HTTP to the sandbox's address and the
host's TCP table) and the host's memory figures (for `aenv.node.pressure`).
`Host` bundles them: `open_node` passes the real ones, the in-process node
tests pass scripted ones (`tests/fakes/`) that follow the same observable
behaviour without root.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import trio

from aenv.kit import tcpstate
from aenv.node.pressure import read_meminfo
from aenv.proto.netpolicy import EgressPolicy
from aenv.runtimes.base import ENVD_PORT, Runtime
from aenv.runtimes.netns import NetSlot

# control calls to envd leave no idle connection behind (a checkpoint would hold it)
_CLOSE = {"Connection": "close"}


class EnvdUnavailable(Exception):
    """envd did not answer, or refused `/init`."""


class NetworkSlots(Protocol):
    """Per-sandbox network namespaces with egress rules."""

    @property
    def repairing(self) -> bool:
        """Whether the host network is being repaired (a failed setup may be retried)."""
        ...

    def open_slot(self, policy: EgressPolicy) -> AbstractAsyncContextManager[NetSlot]:
        """A fresh slot with `policy`; leaving the block deletes it."""
        ...

    def adopt_slot(self, index: int) -> AbstractAsyncContextManager[NetSlot]:
        """Own slot `index`, kept from an earlier node process, as `open_slot` owns a new one."""
        ...

    async def set_policy(self, slot: NetSlot, policy: EgressPolicy) -> None:
        """Replace an open slot's egress rules."""
        ...

    async def release_unadopted(self) -> None:
        """Delete the kept slots nobody adopted."""
        ...


class WritableRoots(Protocol):
    """A sandbox's writable root: its layers with one upper directory on top."""

    def open_root(
        self, lowers: Sequence[Path], workdir: Path, *, disk_bytes: int = 0, carried_bytes: int = 0
    ) -> AbstractAsyncContextManager[Path]:
        """A root over `lowers` (topmost first) with a fresh upper in `workdir`;
        yields its path. Leaving the block removes `workdir`. With `disk_bytes`,
        the upper holds at most that much, `carried_bytes` of it used already
        (what the sandbox wrote into `lowers`); 0: as much as the host has."""
        ...

    def adopt_root(self, workdir: Path) -> AbstractAsyncContextManager[Path]:
        """Own the root an earlier node process made in `workdir`, as `open_root` does."""
        ...

    async def unmount(self, workdir: Path) -> Path:
        """Detach the root of an open block now; returns its upper directory,
        which nothing writes to any more (to be frozen into a layer)."""
        ...

    async def reap(self, root: Path, keep: Collection[Path] = ()) -> list[Path]:
        """Detach every root at or below `root` but those in `keep` (what an
        earlier node process left); returns what it detached."""
        ...


class EnvdControl(Protocol):
    """The node's control calls to envd in a sandbox at `address`."""

    async def wait_ready(self, client: httpx.AsyncClient, address: str) -> None:
        """Return once envd answers its health check (the caller bounds the wait)."""
        ...

    async def init(
        self,
        client: httpx.AsyncClient,
        address: str,
        body: Mapping[str, Any],
        *,
        token: str | None,
    ) -> None:
        """Hand envd its environment and access token (`token`: the one it holds
        now, to re-initialise it). Raises `EnvdUnavailable` if envd refuses."""
        ...

    async def wait_closed(self, address: str, *, within_s: float) -> bool:
        """Wait until envd has acknowledged the end of every connection from the
        node (True), or `within_s` passed (False)."""
        ...


@dataclass(frozen=True, kw_only=True)
class Host:
    """What the node's sandboxes run on."""

    runtime: Runtime
    network: NetworkSlots
    roots: WritableRoots
    envd: EnvdControl
    # (MemAvailable, MemTotal) in bytes, blocking
    meminfo: Callable[[], tuple[int, int]] = read_meminfo


class HttpEnvd:
    """envd's control calls over HTTP; implements `EnvdControl`."""

    def __init__(self, *, port: int = ENVD_PORT) -> None:
        self.port = port

    async def wait_ready(self, client: httpx.AsyncClient, address: str) -> None:
        while True:
            try:
                url = f"http://{address}:{self.port}/health"
                r = await client.get(url, headers=_CLOSE, timeout=2.0)
                if r.status_code in (200, 204):
                    return
            except httpx.TransportError:
                pass
            await trio.sleep(0.02)

    async def init(
        self,
        client: httpx.AsyncClient,
        address: str,
        body: Mapping[str, Any],
        *,
        token: str | None,
    ) -> None:
        headers = {**_CLOSE, **({"X-Access-Token": token} if token is not None else {})}
        url = f"http://{address}:{self.port}/init"
        r = await client.post(url, json=dict(body), headers=headers, timeout=10.0)
        if r.status_code >= 300:
            raise EnvdUnavailable(f"envd /init answered {r.status_code}: {r.text[:200]}")

    async def wait_closed(self, address: str, *, within_s: float) -> bool:
        return await tcpstate.wait_closed(address, within_s=within_s)
