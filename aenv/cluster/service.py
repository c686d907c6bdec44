"""The cluster's `SandboxService`: this node's, with lists that span the cluster.

Calls about one sandbox never reach here for a sandbox another node holds:
the router (`aenv.cluster.router`) forwards those whole. What the router
cannot forward is a list, which spans every node: `list` asks each alive
member for its own sandboxes (`GET /cluster/v1/sandboxes`, with the hop
header so the member answers for itself only) concurrently, and merges them
with this node's. A member that does not answer in time is left out of the
answer and logged; the list never waits on a dead node.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Collection, Mapping

import httpx
import trio

from aenv.cluster.cluster import Cluster
from aenv.cluster.leases import OwnershipError
from aenv.cluster.moves import MoveError
from aenv.node import service as sv
from aenv.node.node import SandboxNotFound
from aenv.proto.clusterroute import HOP_HEADER
from aenv.proto.netpolicy import EgressPolicy
from aenv.proto.requests import Limits, NewSandbox
from aenv.storage.objstore import StoreError

log = logging.getLogger("aenv.cluster.service")

LIST_TIMEOUT_S = 3.0
LOCAL_LIST_PATH = "/cluster/v1/sandboxes"


class ClusterSandboxService:
    def __init__(
        self, local: sv.SandboxService, cluster: Cluster, *, http: httpx.AsyncClient, api_key: str
    ) -> None:
        self.local = local
        self.cluster = cluster
        self.http = http
        self.api_key = api_key

    @property
    def limits(self) -> Limits:
        return self.local.limits

    async def list(
        self,
        *,
        metadata: Mapping[str, str] | None = None,
        states: Collection[str] | None = None,
    ) -> tuple[sv.SandboxInfo, ...]:
        found = list(await self.local.list(metadata=metadata, states=states))
        params = {"metadata": json.dumps(dict(metadata or {}))}
        if states is not None:
            params["states"] = ",".join(sorted(states))
        peers = [
            m
            for m in self.cluster.members()
            if m.id != self.cluster.node_id and m.state in ("alive", "suspect")
        ]

        async def one(url: str, node: str) -> None:
            try:
                r = await self.http.get(
                    url + LOCAL_LIST_PATH,
                    params=params,
                    headers={"X-API-Key": self.api_key, HOP_HEADER: self.cluster.node_id},
                    timeout=LIST_TIMEOUT_S,
                )
                r.raise_for_status()
                found.extend(sv.SandboxInfo.from_doc(d) for d in r.json())
            except (httpx.HTTPError, ValueError) as e:
                log.warning("node %s left out of a sandbox list: %s", node, e)

        async with trio.open_nursery() as nursery:
            for m in peers:
                nursery.start_soon(one, m.url, m.id)
        found.sort(key=lambda a: (a.started_at, a.sandbox_id))
        return tuple(found)

    # -- the rest is this node's (the router forwards what is another's) ------------------

    async def create(self, req: NewSandbox) -> sv.SandboxInfo:
        return await self.local.create(req)

    async def get(self, sandbox_id: str) -> sv.SandboxInfo:
        return await self.local.get(sandbox_id)

    @contextlib.asynccontextmanager
    async def _unparked(self, sandbox_id: str) -> AsyncIterator[None]:
        """A paused sandbox whose claim lets it move may not move once resumed here."""
        moves = self.cluster.moves
        if moves is None:
            yield
            return
        try:
            async with moves.unpark(sandbox_id):
                yield
        except (OwnershipError, StoreError, MoveError) as e:
            raise sv.Unavailable(f"sandbox {sandbox_id} cannot be resumed now: {e}") from None

    def _paused_here(self, sandbox_id: str) -> bool:
        try:
            actor = self.cluster.node.get(sandbox_id)
        except SandboxNotFound:
            return False
        return actor.auto_resume and actor.state.value in ("paused", "pausing")

    async def connect(self, sandbox_id: str, timeout_s: int) -> sv.Connected:
        async with self._unparked(sandbox_id):
            return await self.local.connect(sandbox_id, timeout_s)

    async def resume(self, sandbox_id: str, timeout_s: int) -> sv.SandboxInfo:
        async with self._unparked(sandbox_id):
            return await self.local.resume(sandbox_id, timeout_s)

    async def pause(self, sandbox_id: str, mode: str) -> None:
        await self.local.pause(sandbox_id, mode)

    async def fork(
        self, sandbox_id: str, count: int, timeout_s: int
    ) -> tuple[sv.SandboxInfo | sv.ServiceError, ...]:
        return await self.local.fork(sandbox_id, count, timeout_s)

    async def snapshot(
        self, sandbox_id: str, *, name: str | None, memory: bool, durable: bool = False
    ) -> sv.SnapshotInfo:
        return await self.local.snapshot(sandbox_id, name=name, memory=memory, durable=durable)

    async def kill(self, sandbox_id: str) -> None:
        await self.local.kill(sandbox_id)

    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> None:
        await self.local.set_timeout(sandbox_id, timeout_s)

    async def refresh(self, sandbox_id: str, timeout_s: int) -> None:
        await self.local.refresh(sandbox_id, timeout_s)

    async def set_network(
        self, sandbox_id: str, policy: EgressPolicy, allow_internet_access: bool | None
    ) -> None:
        await self.local.set_network(sandbox_id, policy, allow_internet_access)

    async def metrics(self, sandbox_id: str) -> sv.SandboxMetrics:
        return await self.local.metrics(sandbox_id)

    async def logs(self, sandbox_id: str, *, console: bool = False) -> sv.SandboxLogs:
        return await self.local.logs(sandbox_id, console=console)

    async def endpoint(
        self, sandbox_id: str, port: int, *, auto_resume: bool = False
    ) -> sv.Endpoint:
        if not auto_resume or not self._paused_here(sandbox_id):
            return await self.local.endpoint(sandbox_id, port, auto_resume=auto_resume)
        async with self._unparked(sandbox_id):
            return await self.local.endpoint(sandbox_id, port, auto_resume=True)
