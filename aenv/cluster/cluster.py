"""This node's view of the cluster: who is there, who holds a sandbox, where a new one goes.

`Cluster` answers the router (`aenv.cluster.router.ClusterView`) from the
membership (`aenv.cluster.membership`): each member gossips its URL, its
sandbox ID tag and its load (`aenv.proto.placement.NodeLoad`). A sandbox ID
ends in the tag of the node that created it (`aenv.proto.ids`), which is
where a call for it is sent unless this node holds it.

`measure_load` reads what this node gossips about itself: memory, CPU load,
sandboxes, free disk, the templates it holds, whether it is draining, and
the machine it runs on (its boot ID), so nodes sharing a machine are scored
with one reading of it (`placement.share_host`). Placement also counts the
creates this node sent to each node that the node's gossip does not show yet
(`placement.Pending`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import random
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from aenv.cluster.leases import ClaimView, Ownership, OwnershipError
from aenv.cluster.owners import Owners
from aenv.cluster.router import Peer
from aenv.node.node import Node, SandboxNotFound
from aenv.node.pressure import read_meminfo
from aenv.proto import placement
from aenv.proto.ids import InvalidName, owner_tag
from aenv.storage.objstore import StoreError
from aenv.storage.templates import TemplateNotFound

log = logging.getLogger("aenv.cluster")

# a call about a sandbox that asks the store who holds it waits no longer than this
LOOKUP_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Member:
    """One node as the membership knows it."""

    id: str
    url: str
    state: str  # alive | suspect | dead | left
    incarnation: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def tag(self) -> str:
        return str(self.meta.get("tag", ""))

    @property
    def load(self) -> placement.NodeLoad:
        return placement.NodeLoad.from_json(self.id, self.meta.get("load") or {})

    def as_peer(self) -> Peer:
        return Peer(self.id, self.url, self.state)

    def to_json(self) -> dict[str, Any]:
        return {
            "nodeID": self.id,
            "url": self.url,
            "state": self.state,
            "incarnation": self.incarnation,
            "tag": self.tag,
            **({"load": self.meta["load"]} if "load" in self.meta else {}),
        }


@functools.cache
def host_id() -> str:
    """This machine's boot ID: equal for the nodes that share its memory and CPU."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


LOAD_NAMES = 100  # template and snapshot names measured (as many as are gossiped)


async def measure_load(node: Node, *, draining: bool = False) -> placement.NodeLoad:
    """This node's capacity and load, to gossip: memory, CPU, sandboxes, disk, and
    the templates and snapshots it holds (reads of /proc: cheap)."""
    available, total = read_meminfo()
    st = os.statvfs(node.config.home)
    # the first names in sorted order, as many as are gossiped, read from indexes:
    # a node with 100,000 templates must not read them all every few seconds
    names = await trio.to_thread.run_sync(node.templates.names, LOAD_NAMES)
    names += await node.snapshots.names(LOAD_NAMES)
    return placement.NodeLoad(
        node=node.config.effective_node_id,
        mem_total=total,
        mem_free=available,
        cpus=os.cpu_count() or 1,
        cpu_load=os.getloadavg()[0],
        sandboxes=node.in_memory(),  # what `max_sandboxes` bounds (hibernated ones do not count)
        max_sandboxes=node.config.max_sandboxes,
        disk_free=st.f_bavail * st.f_frsize,
        templates=frozenset(sorted(set(names))[:LOAD_NAMES]),
        draining=draining,
        host=host_id(),
        volumes=frozenset(x for v in node.volumes.all() for x in (v.volume_id, v.name)),
    )


class Mover(Protocol):
    """What the cluster view needs of `aenv.cluster.moves.Moves`."""

    async def adopt(self, sid: str, *, fence: bool = True) -> object:
        """Take up paused-durable sandbox `sid` here (raises if it cannot move)."""
        ...

    def unpark(self, sid: str) -> AbstractAsyncContextManager[Any]:
        """Around a resume of `sid` here: its claim says running first."""
        ...

    async def make_room(self, sid: str) -> Member | None:
        """Before a resume of `sid` here: the node it was moved to for want of
        memory here (None: resume it here)."""
        ...

    async def arrived(self, sid: str) -> None:
        """Return once `sid` is no longer being taken up here."""
        ...


class Cluster:
    """`ClusterView` over this node and the members it knows."""

    def __init__(
        self,
        node: Node,
        members: Callable[[], Sequence[Member]],
        *,
        here: Callable[[], placement.NodeLoad | None] = lambda: None,
        rng: random.Random | None = None,
    ) -> None:
        self.node = node
        self.node_id = node.config.effective_node_id
        self.url = node.config.effective_advertise_url
        self.tag = node.config.effective_node_tag
        self._members = members
        self._here = here  # this node's load as last measured
        self.rng = rng or random.Random()
        self.draining = False
        self.ownership: Ownership | None = None  # set once the node's lease is live
        self.pending = placement.Pending()
        self.moves: Mover | None = None  # with ownership: sandboxes moving between nodes
        self.owners: Owners | None = None  # with ownership: keeps the claims in step

    def members(self) -> list[Member]:
        return sorted(self._members(), key=lambda m: m.id)

    def runs_here(self, sandbox_id: str) -> bool:
        try:
            self.node.get(sandbox_id)
        except SandboxNotFound:
            return sandbox_id in self.node.lost  # lost here: this node says why
        # Here but not claimed by this node: new (its claim is a reconcile away: it
        # is ours), or a copy taken back at a restart that another node may have
        # taken over meanwhile (stopped at the next reconcile): `owner_of` asks the
        # store about those.
        own = self.ownership
        return (
            own is None
            or not own.may_serve()
            or own.grant(sandbox_id) is not None
            or not self.doubtful(sandbox_id)
        )

    def doubtful(self, sandbox_id: str) -> bool:
        """Whether a sandbox here that this node holds no claim on may be another
        node's (see `Owners.doubtful`); never for one made in this node's epoch."""
        return self.owners is not None and self.owners.doubtful(sandbox_id)

    def volume_holder(self, volume: str) -> Peer | None:
        if self.node.volumes.find(volume) is not None:
            return None
        for m in self._members():
            if m.id != self.node_id and m.state == "alive" and volume in m.load.volumes:
                return m.as_peer()
        return None

    def not_serving(self) -> str | None:
        own = self.ownership
        if own is None or own.may_serve():
            return None
        return (
            f"node {self.node_id} cannot renew its lease in the object store "
            f"({own.status.value}): its sandboxes are not served until it can"
        )

    async def owner_of(self, sandbox_id: str) -> Peer | None:
        """The node named by the ID's tag when it is alive; else the owner the
        store's claim names (the sandbox moved, or its node is down)."""
        try:
            tag = owner_tag(sandbox_id)
        except InvalidName:
            return None
        members = {m.id: m for m in self._members()}
        by_tag = [m for m in members.values() if m.tag == tag and m.id != self.node_id]
        # a node that came back under the same tag supersedes its dead past
        by_tag.sort(key=lambda m: (m.state in ("dead", "left"), m.id))
        hinted = by_tag[0].as_peer() if by_tag else None
        if (hinted is not None and hinted.state in ("alive", "suspect")) or self.ownership is None:
            return hinted
        try:
            view = await self._lookup(sandbox_id)
        except (StoreError, OwnershipError, ValueError) as e:
            log.warning("looking up the owner of sandbox %s failed: %s", sandbox_id, e)
            if self._unclaimed_here(sandbox_id):  # a copy here: not served unless ours
                return Peer(self.node_id, "", "unknown")
            return hinted
        if view is None or view.claim.released or view.claim.node == self.node_id:
            return hinted
        m = members.get(view.claim.node)
        if m is not None:
            return m.as_peer()
        return Peer(view.claim.node, view.owner_url, "alive" if view.owner_url else "dead")

    async def _lookup(self, sandbox_id: str) -> ClaimView | None:
        """The sandbox's claim as stored; `StoreError` when the store does not answer
        within `LOOKUP_TIMEOUT_S` (a call waiting on it answers 503, never hangs)."""
        assert self.ownership is not None
        with trio.move_on_after(LOOKUP_TIMEOUT_S):
            return await self.ownership.lookup(sandbox_id)
        raise StoreError(f"the object store did not answer within {LOOKUP_TIMEOUT_S:g} s")

    def _holds(self, template: str | None) -> frozenset[str]:
        """{template} if this node holds it now (fresher than its gossiped load)."""
        if template is None:
            return frozenset()
        try:
            self.node.templates.resolve(template)
        except (TemplateNotFound, InvalidName):
            return frozenset()
        return frozenset({template})

    async def adopt(self, sandbox_id: str) -> str | None:
        """Take up here a paused sandbox whose node is dead or has left: None once it
        is here, else why not."""
        if self.moves is None:
            return "this node has no object store to restore it from"
        try:
            await self.moves.adopt(sandbox_id, fence=True)
        except Exception as e:
            log.warning("sandbox %s cannot be taken up here: %s", sandbox_id, e)
            return str(e) or repr(e)
        return None

    async def moved_to(self, sandbox_id: str) -> Peer | None:
        """For a call another node forwarded here: the node that holds the sandbox
        now if it is not this one, though this node made it (its tag is ours: it
        moved away) or holds a copy of it that is not this node's (a copy taken
        back at a restart after another node took it over). A `Peer` whose state is
        `dead` or `unknown` (the store did not answer) for such a copy: it must
        not be served here. None: serve it here (or answer that it is not here)."""
        try:
            tag = owner_tag(sandbox_id)
        except InvalidName:
            return None
        copy = self._unclaimed_here(sandbox_id)
        if not copy and (tag != self.tag or self.ownership is None or self.runs_here(sandbox_id)):
            return None
        assert self.ownership is not None
        try:
            view = await self._lookup(sandbox_id)
        except (StoreError, OwnershipError, ValueError) as e:
            log.warning("looking up the owner of sandbox %s failed: %s", sandbox_id, e)
            return Peer(self.node_id, "", "unknown") if copy else None
        if view is None or view.claim.released or view.claim.node == self.node_id:
            return None  # new (not claimed yet), or this node's claim (taken up soon)
        m = {m.id: m for m in self._members()}.get(view.claim.node)
        if m is not None and m.state in ("alive", "suspect"):
            return m.as_peer()
        return Peer(view.claim.node, view.owner_url, "dead") if copy else None

    async def arrived(self, sandbox_id: str) -> None:
        """Return once `sandbox_id` is no longer being taken up here (its claim
        taken over, its restore under way)."""
        if self.moves is not None:
            await self.moves.arrived(sandbox_id)

    async def make_room(self, sandbox_id: str) -> Peer | None:
        """Before a connect or resume of `sandbox_id` here: the node it was moved
        to because this node has no memory to resume it (None: resume it here)."""
        if self.moves is None:
            return None
        moved = await self.moves.make_room(sandbox_id)
        return None if moved is None else moved.as_peer()

    def _unclaimed_here(self, sandbox_id: str) -> bool:
        """This node has the sandbox but may not serve it before the store says
        whose it is (a doubtful copy with no claim: `runs_here` is False)."""
        try:
            self.node.get(sandbox_id)
        except SandboxNotFound:
            return False
        return not self.runs_here(sandbox_id)

    def placement(self, body: bytes) -> Sequence[Peer]:
        template, memory_mb, volumes = _template_of(body)
        here = self._here() or placement.NodeLoad(
            node=self.node_id,
            mem_total=1,
            mem_free=1,
            cpus=1,
            cpu_load=0.0,
            sandboxes=0,
            max_sandboxes=1,
            disk_free=0,
            templates=frozenset(),
        )
        here = dataclasses.replace(
            here, draining=self.draining, templates=here.templates | self._holds(template)
        )
        loads = {here.node: here}
        urls = {here.node: Peer(self.node_id, self.url, "alive")}
        for m in self._members():
            if m.id != self.node_id and m.state == "alive":
                loads[m.id] = m.load
                urls[m.id] = m.as_peer()
        now = trio.current_time()
        nodes = self.pending.apply(placement.share_host(loads.values(), here), now)
        # a snapshot (or a template) only some nodes hold goes to one of them first
        holders = [n for n in nodes if template is not None and template in n.templates]
        # and a sandbox mounting volumes to a node that holds them, before all
        with_volumes = placement.volume_holders(nodes, volumes)
        ranked = placement.rank(with_volumes, template=template, memory_mb=memory_mb, rng=self.rng)
        ranked += [
            n
            for n in placement.rank(holders, template=template, memory_mb=memory_mb, rng=self.rng)
            if n not in ranked
        ]
        ranked += [
            n
            for n in placement.rank(nodes, template=template, memory_mb=memory_mb, rng=self.rng)
            if n not in ranked
        ]
        if not ranked:  # nobody reports room: try here (the node answers why not)
            return [urls[self.node_id]]
        self.pending.placed(loads[ranked[0].node], now)
        return [urls[n.node] for n in ranked]


def _template_of(body: bytes) -> tuple[str | None, int, list[str]]:
    """A create's template, memory and the names of the volumes it mounts."""
    try:
        doc = json.loads(body or b"{}")
    except ValueError:
        return None, 512, []
    if not isinstance(doc, dict):
        return None, 512, []
    template = doc.get("templateID")
    memory = doc.get("memoryMB")
    mounts = doc.get("volumeMounts")
    volumes = [
        m["name"]
        for m in (mounts if isinstance(mounts, list) else [])
        if isinstance(m, dict) and isinstance(m.get("name"), str)
    ]
    return (
        template if isinstance(template, str) else None,
        memory if isinstance(memory, int) and memory > 0 else 512,
        volumes,
    )
