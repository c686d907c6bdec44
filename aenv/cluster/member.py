"""This node as a member of a cluster: everything the cluster adds to a node, opened together.

`open_cluster_member(config, node)` starts the links (`Transport`, on the
API port through the app's `/cluster/v1/link` WebSocket and, with
`AENV_CLUSTER_LISTEN`, on a port of their own), the membership (joining the
configured peers), the cluster view and the cluster's `SandboxService`, and
yields them as a `ClusterMember` for the server to put in front of the node.
Leaving the block leaves the cluster (gossiped, so peers stop routing here at
once rather than after a failure detection) and closes the links.

Calls to peers at `https://` URLs (the API client, the links' `wss://`)
verify the peer's certificate with `peer_ssl`; the links' own port serves
TLS with `serve_ssl` when the node does.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import trio

from aenv.cluster.cluster import Cluster, Member, measure_load
from aenv.cluster.leases import Ownership, open_ownership
from aenv.cluster.membership import Membership
from aenv.cluster.moves import DrainReport, Moves
from aenv.cluster.owners import Owners
from aenv.cluster.service import ClusterSandboxService
from aenv.cluster.transport import Transport
from aenv.config import Config
from aenv.kit.asgiforward import ForwardingClient
from aenv.node.node import Node
from aenv.node.service import SandboxService
from aenv.proto.clusterroute import HOP_HEADER
from aenv.proto.clusterwire import ClusterKey
from aenv.storage.objstore import ObjectStore

log = logging.getLogger("aenv.cluster")


@dataclass
class ClusterMember:
    config: Config
    transport: Transport
    membership: Membership
    cluster: Cluster
    http: ForwardingClient  # to other nodes' APIs
    moves: Moves | None = None  # with an object store: sandboxes move between nodes

    async def drain(self) -> DrainReport:
        """Move every sandbox of this node to the others, then leave the cluster."""
        moves = self.moves
        if moves is None:
            raise RuntimeError("this node has no object store: its sandboxes cannot move")
        if moves.drain_report is not None and moves.draining:
            return moves.drain_report

        async def leave() -> None:
            if self.cluster.ownership is not None:
                await self.cluster.ownership.leave()
            await self.membership.leave()

        return await moves.drain(leave=leave)

    def service(self, local: SandboxService) -> ClusterSandboxService:
        return ClusterSandboxService(local, self.cluster, http=self.http, api_key=self.api_key)

    @property
    def api_key(self) -> str:
        return self.cluster.node.api_key

    def _peers(self) -> list[Member]:
        return [
            m
            for m in self.cluster.members()
            if m.id != self.cluster.node_id and m.state in ("alive", "suspect")
        ]

    async def ask_peers(
        self, method: str, path: str, *, timeout_s: float = 3.0
    ) -> dict[str, httpx.Response]:
        """`method path` on every live peer, concurrently, with the hop header (each
        answers for itself only): {node id: response}. A peer that does not answer in
        time is left out and logged."""
        answers: dict[str, httpx.Response] = {}

        async def one(m: Member) -> None:
            try:
                answers[m.id] = await self.http.request(
                    method,
                    m.url + path,
                    headers={"X-API-Key": self.api_key, HOP_HEADER: self.cluster.node_id},
                    timeout=timeout_s,
                )
            except httpx.HTTPError as e:
                log.warning("node %s did not answer %s %s: %s", m.id, method, path, e)

        async with trio.open_nursery() as nursery:
            for m in self._peers():
                nursery.start_soon(one, m)
        return answers

    async def gather(self, path: str) -> list[Any]:
        """The JSON lists every live peer answers to `GET path`, concatenated."""
        out: list[Any] = []
        for node, r in (await self.ask_peers("GET", path)).items():
            try:
                r.raise_for_status()
                body = r.json()
            except (httpx.HTTPError, ValueError) as e:
                log.warning("node %s answered GET %s badly: %s", node, path, e)
                continue
            if isinstance(body, list):
                out.extend(body)
        return out


async def _own(
    store: ObjectStore,
    node_id: str,
    url: str,
    *,
    task_status: trio.TaskStatus[Ownership] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with open_ownership(store, node=node_id, url=url, resume=True) as ownership:
        task_status.started(ownership)
        await trio.sleep_forever()


@asynccontextmanager
async def open_cluster_member(
    config: Config,
    node: Node,
    *,
    peer_ssl: ssl.SSLContext | None = None,
    serve_ssl: ssl.SSLContext | None = None,
) -> AsyncIterator[ClusterMember]:
    assert config.cluster_secret, "open_cluster_member needs a cluster secret"
    if peer_ssl is None:
        peer_ssl = ssl.create_default_context()
    key = ClusterKey.from_secret(config.cluster_secret)
    node_id = config.effective_node_id
    url = config.effective_advertise_url
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with (
        ForwardingClient(limits=limits, timeout=30.0, verify=peer_ssl) as http,
        trio.open_nursery() as nursery,
    ):
        transport = Transport(key, node_id, url, nursery, peer_ssl=peer_ssl)
        if config.cluster_listen:
            host, _, port = config.cluster_listen.rpartition(":")
            await nursery.start(
                partial(transport.serve, host or "0.0.0.0", int(port), ssl_context=serve_ssl)
            )
        holder: list[Cluster] = []
        membership = Membership(
            transport,
            node_id=node_id,
            url=url,
            tag=config.effective_node_tag,
            seeds=config.cluster_peers,
            measure=lambda: measure_load(node, draining=holder[0].draining if holder else False),
            remember=config.home / "cluster" / "members.json",
        )
        cluster = Cluster(node, membership.members, here=lambda: membership.load)
        holder.append(cluster)
        await nursery.start(partial(membership.run))
        store = node.durable.store
        moves: Moves | None = None
        if store is not None:
            # this process holds the node's home (its host claim): a lease left
            # by an earlier process of this node is this node's to keep
            ownership = await nursery.start(_own, store, node_id, url)
            cluster.ownership = ownership
            owners_box: list[Owners] = []
            moves = Moves(node, ownership, cluster, http=http, poke=lambda: owners_box[0].poke())
            owners = Owners(
                ownership,
                local=moves.local_states,
                stop=lambda sid, why: node.start_background(
                    partial(node.kill, sid), f"stopping sandbox {sid}: {why}"
                ),
                keep=moves.keep,
                after=moves.after_reconcile,
            )
            owners_box.append(owners)
            cluster.owners = owners
            cluster.moves = moves
            nursery.start_soon(owners.run)
            nursery.start_soon(moves.watch)
        log.info(
            "node %s (%s) in the cluster; peers to join: %s",
            node_id,
            url,
            ", ".join(config.cluster_peers) or "none (a new cluster)",
        )
        try:
            yield ClusterMember(config, transport, membership, cluster, http, moves)
        finally:
            with trio.CancelScope(shield=True):
                await membership.leave()
            transport.close()
            nursery.cancel_scope.cancel()
