"""Membership: the SWIM core (`aenv.proto.swim`) driven over the cluster's links.

`Membership` owns one `Swim` and one `Transport`. Its task runs the core's
timers (`next_deadline` / `tick`), feeds it every message the transport
receives (with the sender's authenticated URL), sends what the core returns,
and applies its events: a member found dead or gone has its link closed; the
joins, deaths and leaves are logged. A malformed message is logged and
dropped; it never reaches the core.

It remembers the URLs of the members it last knew alive in a file, and
joins through them as well as the configured peers at its next start, so a
restarted node finds its cluster even when the peers it was given are gone
(and the first node of a cluster, which has no peers, finds the others).

Every few seconds it measures this node's load and, when it changed enough
to matter to placement, gossips it as the node's meta, with its URL's sandbox
ID tag. `members()` is a snapshot for the cluster view and the API.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from aenv.cluster.cluster import Member
from aenv.cluster.transport import Transport
from aenv.proto import swim
from aenv.proto.placement import NodeLoad

log = logging.getLogger("aenv.cluster.membership")

LOAD_EVERY_S = 3.0
MAX_TEMPLATES = 100  # names gossiped (meta is bounded)


class Membership:
    def __init__(
        self,
        transport: Transport,
        *,
        node_id: str,
        url: str,
        tag: str,
        seeds: tuple[str, ...],
        measure: Callable[[], Awaitable[NodeLoad]],
        config: swim.SwimConfig | None = None,
        rng: random.Random | None = None,
        remember: Path | None = None,
    ) -> None:
        self.transport = transport
        self.node_id = node_id
        self.url = url
        self.tag = tag
        self.remember = remember
        self.seeds = tuple(dict.fromkeys((*seeds, *self._remembered())))
        self._measure = measure
        self._last_load: dict[str, Any] | None = None
        self.load: NodeLoad | None = None  # as last measured
        self.swim = swim.Swim(node_id, url, self._meta(None), config=config, rng=rng)
        self._wake = trio.Event()
        self.malformed = 0

    def _meta(self, load: NodeLoad | None) -> dict[str, Any]:
        meta: dict[str, Any] = {"tag": self.tag}
        if load is not None:
            doc = load.to_json()
            doc["templates"] = doc["templates"][:MAX_TEMPLATES]
            meta["load"] = doc
        return meta

    def _remembered(self) -> list[str]:
        if self.remember is None:
            return []
        try:
            urls = json.loads(self.remember.read_text())
        except (OSError, ValueError):
            return []
        if not isinstance(urls, list):
            return []
        return [u for u in urls if isinstance(u, str) and swim.is_member_url(u) and u != self.url]

    def _write_remembered(self) -> None:
        if self.remember is None:
            return
        urls = sorted(
            m.url for m in self.swim.members() if m.id != self.node_id and m.state.value == "alive"
        )
        if not urls:
            return  # alone: keep what was known, to find the cluster again
        try:
            self.remember.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.remember.with_suffix(".tmp")
            tmp.write_text(json.dumps(urls))
            tmp.replace(self.remember)
        except OSError as e:
            log.warning("could not remember the cluster's members: %s", e)

    # -- what others ask ----------------------------------------------------------------

    def members(self) -> list[Member]:
        return [
            Member(m.id, m.url, m.state.value, m.incarnation, dict(m.meta))
            for m in self.swim.members()
        ]

    def statistics(self) -> dict[str, Any]:
        return {
            **self.transport.statistics(),
            "health": self.swim.health_score,
            "malformed": self.malformed,
        }

    async def publish_load(self) -> None:
        """Measure the node's load now and gossip it if it changed enough."""
        load = await self._measure()
        self.load = load
        doc = _coarse(load)
        if doc != self._last_load:
            self._last_load = doc
            self.swim.set_meta(trio.current_time(), self._meta(load))
            self._wake.set()

    # -- the task -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.publish_load()
        self._send(self.swim.join(trio.current_time(), self.seeds))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._timers)
            nursery.start_soon(self._receive)
            nursery.start_soon(self._loads)
            task_status.started()

    async def leave(self, *, within_s: float = 2.0) -> None:
        """Tell the cluster this node leaves, and give the news time to spread."""
        self._send(self.swim.leave(trio.current_time()))
        self._wake.set()
        with trio.move_on_after(within_s):
            # the core has no event for it: poll until the news went out
            while self.swim.statistics().pending_updates:  # noqa: ASYNC110
                await trio.sleep(0.1)

    async def _timers(self) -> None:
        while True:
            deadline = self.swim.next_deadline()
            if not math.isinf(deadline):
                with trio.move_on_at(deadline):
                    await self._wake.wait()
            else:
                await self._wake.wait()
            self._wake = trio.Event()
            self._send(self.swim.tick(trio.current_time()))
            self._events()

    async def _receive(self) -> None:
        async for r in self.transport.inbox:
            try:
                message = swim.decode(r.payload)
            except swim.MessageError as e:
                self.malformed += 1
                log.warning("dropped a malformed message from %s: %s", r.peer, e)
                continue
            self._send(self.swim.receive(trio.current_time(), r.peer_url, message))
            self._events()
            self._wake.set()  # the deadline may have moved

    async def _loads(self) -> None:
        while True:
            await trio.sleep(LOAD_EVERY_S)
            try:
                await self.publish_load()
            except Exception:
                log.exception("measuring this node's load failed")

    def _send(self, sends: list[swim.Send]) -> None:
        for s in sends:
            self.transport.send(s.url, swim.encode(s.message).encode())

    def _events(self) -> None:
        events = self.swim.drain_events()
        if any(e.member.id != self.node_id for e in events):
            self._write_remembered()
        for e in events:
            m = e.member
            if m.id == self.node_id:
                continue
            if e.kind is swim.EventKind.JOINED:
                log.info("node %s (%s) joined", m.id, m.url)
                if m.meta.get("tag") == self.tag:
                    log.error(
                        "node %s has this node's sandbox ID tag %r: calls for either's "
                        "sandboxes may reach the wrong node; give each node its own "
                        "AENV_NODE_TAG (or leave it unset)",
                        m.id,
                        self.tag,
                    )
            elif e.kind is swim.EventKind.SUSPECT:
                log.warning("node %s is suspected to have failed", m.id)
            elif e.kind is swim.EventKind.ALIVE:
                log.info("node %s is alive after all", m.id)
            elif e.kind is swim.EventKind.DEAD:
                log.warning("node %s (%s) is dead", m.id, m.url)
                self.transport.forget(m.url)
            elif e.kind is swim.EventKind.LEFT:
                log.info("node %s left the cluster", m.id)
                self.transport.forget(m.url)
            elif e.kind is swim.EventKind.REMOVED:
                self.transport.forget(m.url)


def _coarse(load: NodeLoad) -> dict[str, Any]:
    """What of the load is worth gossiping again when it changes."""
    return {
        "memFree": load.mem_free >> 26,  # 64 MiB steps
        "cpuLoad": round(load.cpu_load, 1),
        "sandboxes": load.sandboxes,
        "diskFree": load.disk_free >> 30,
        "templates": sorted(load.templates),
        "draining": load.draining,
    }
