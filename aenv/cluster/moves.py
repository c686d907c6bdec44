"""Moving sandboxes between the nodes of a cluster: durable paused copies, resume anywhere, drain.

A running sandbox's memory is only on its node; a paused one can live in the
object store. `Moves` keeps every sandbox this node holds paused on disk
(hibernated, or paused with its files only) durable there: an internal
snapshot of its memory image and layers whose record carries the sandbox's
own (`Node.paused_copy`), and `cluster/paused/{sid}/{epoch}.json` naming it,
written at the claim's fencing epoch. Once both are in the store, the claim's
state hint becomes `paused-durable` (`Owners` writes it: `local_states`).

Only a `paused-durable` claim ever moves (`Ownership.take_over(only_from=...)`
checks the very state its compare-and-swap replaces). Before a sandbox in
that state is resumed through this node's service (`unpark`), its claim is
set to `running` first, so a copy never resumes while the sandbox it copies
runs.

- **Resume anywhere** (`adopt`): a connect or resume for a sandbox whose node
  is dead or has left is served by the node that received it: it fences that
  node (`Ownership.fence`: at least the lease's window), takes the claim over,
  restores the copy under the same ID with its tokens, metadata, env and time
  left (`Node.adopt_paused`), journals it and serves the call. A dead or left
  node's paused-durable sandboxes are also adopted without a call (`watch`):
  each is tried first by one surviving node (rendezvous hashing of its ID over
  the live nodes), then by the next after a delay; the compare-and-swap lets
  only one win.
- **Making room** (`make_room`): a connect or resume of a sandbox paused on
  disk here, on a node whose memory cannot take it now (`placement.
  room_to_resume`), hands the sandbox to the other node with the most room
  (as a drain hands a paused one over); the call then goes on to that node,
  which resumes it.
- **Drain** (`drain`): the node gossips that it is draining (placement skips
  it), pauses each running sandbox to disk with its memory, makes it durable,
  hands its claim to another node (`Ownership.hand_over`) and asks that node
  to take it up and resume it (`POST /cluster/v1/sandboxes/{id}/adopt`);
  paused ones are handed over the same way without the resume. Then it leaves.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from aenv.cluster.cluster import Cluster, Member
from aenv.cluster.leases import (
    Claimed,
    NoClaim,
    NotMovable,
    NotOwner,
    Ownership,
    OwnershipError,
)
from aenv.kit import mailbox
from aenv.node.node import Node, SandboxConflict, SandboxNotFound
from aenv.node.pressure import read_meminfo
from aenv.node.sandbox import Hibernate, Pause, Resume, SandboxActor, SandboxNotRunning
from aenv.node.snapshots import CorruptSnapshot, is_paused_copy
from aenv.proto import lifecycle as lc
from aenv.proto import placement
from aenv.proto.clusterroute import HOP_HEADER
from aenv.proto.ownership import ClaimStatus
from aenv.storage.objstore import ObjectNotFound, StoreError

log = logging.getLogger("aenv.cluster.moves")

PAUSED_DURABLE = "paused-durable"
PAUSED_PREFIX = "cluster/paused"
# how often the dead and left members' paused sandboxes are looked for
WATCH_S = 3.0
# a dead node's sandbox is tried by its first-choice adopter at once, by the next after this
ADOPT_STAGGER_S = 20.0
ADOPT_CONCURRENCY = 4
DRAIN_CONCURRENCY = 2
PAUSE_S = 300.0
# sandboxes moved to make room remembered (a concurrent resume goes after them)
MADE_ROOM_KEPT = 1000


def paused_key(sid: str, epoch: int) -> str:
    """Where the copy of paused sandbox `sid` written at fencing epoch `epoch` is named."""
    return f"{PAUSED_PREFIX}/{sid}/{epoch}.json"


def adopters(sid: str, nodes: Sequence[str]) -> list[str]:
    """`nodes` in the order they should try to adopt `sid` (rendezvous hashing:
    every node computes the same order, and sandboxes spread over the nodes)."""
    return sorted(nodes, key=lambda n: hashlib.sha256(f"{n}\0{sid}".encode()).digest())


class MoveError(Exception):
    """A sandbox could not be moved (the message says why)."""


@dataclass(frozen=True)
class Copy:
    """A durable copy of one pause of a sandbox: the pause it copies (`paused_key`
    of the actor), its snapshot and the fencing epoch it was named at."""

    key: str
    snapshot_id: str
    epoch: int


@dataclass
class DrainReport:
    node: str
    moved: int = 0
    rehomed: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    moves: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "nodeID": self.node,
            "moved": self.moved,
            "rehomed": self.rehomed,
            "failed": self.failed,
            "seconds": round(self.seconds, 3),
            "sandboxes": self.moves,
        }


class Moves:
    def __init__(
        self,
        node: Node,
        ownership: Ownership,
        cluster: Cluster,
        *,
        http: httpx.AsyncClient,
        poke: Callable[[], None] = lambda: None,
    ) -> None:
        self.node = node
        self.ownership = ownership
        self.cluster = cluster
        self.http = http
        self.poke = poke
        assert node.durable.store is not None
        self.store = node.durable.store
        self._durable: dict[str, Copy] = {}  # the current pause's copy, by sandbox
        self._stale: dict[str, list[Copy]] = {}  # copies to delete once safe
        self._copying: set[str] = set()
        self._failed: dict[str, str] = {}  # pause key that could not be copied, by sandbox
        self._resuming: dict[str, int] = {}  # sandboxes being resumed through `unpark`
        self._adopting: set[str] = set()  # claims taken over whose sandbox is not here yet
        self._stuck: set[str] = set()  # ... and whose restore failed: kept, tried again
        self._handed: set[str] = set()  # handed to another node, still here until killed
        self._moving: set[str] = set()  # being drained: `Owners` leaves their claims alone
        self._was_running: set[str] = set()  # paused by a drain ahead of their move
        self._locks: dict[str, trio.Lock] = {}
        self._room_locks: dict[str, trio.Lock] = {}
        self._made_room: dict[str, Member] = {}  # moved away to make room, to whom
        self._watched: dict[str, int] = {}  # dead or left members looked at, by incarnation
        self._limiter = trio.CapacityLimiter(ADOPT_CONCURRENCY)
        self.draining = False
        self.drain_report: DrainReport | None = None

    # -- what `Owners` reconciles ---------------------------------------------------

    def local_states(self) -> dict[str, str]:
        """{sandbox ID: claim state} of what this node holds: `running`, `paused`,
        or `paused-durable` when the current pause's copy is in the store."""
        out: dict[str, str] = {}
        for a in self.node.list():
            sid = a.sandbox_id
            if sid in self._handed or sid in self._moving:
                continue  # (its claim is the drain's to write)
            if sid in self._resuming or a.state not in (lc.State.PAUSING, lc.State.PAUSED):
                out[sid] = "running"
            elif self._is_durable(a):
                out[sid] = PAUSED_DURABLE
            else:
                out[sid] = "paused"
        return out

    def keep(self) -> set[str]:
        """Claims this node holds for sandboxes not here yet (being adopted)."""
        return self._adopting | self._stuck | self._moving

    def _is_durable(self, a: SandboxActor) -> bool:
        copy = self._durable.get(a.sandbox_id)
        return (
            copy is not None
            and a.state is lc.State.PAUSED
            and a.on_disk
            and not a.frozen_pause
            and copy.key == a.paused_key()
        )

    async def after_reconcile(self) -> None:
        """Start copies of the paused sandboxes that lack one; delete stale copies."""
        local = {a.sandbox_id: a for a in self.node.list()}
        for sid, a in local.items():
            if (
                a.state is lc.State.PAUSED
                and a.on_disk
                and not a.frozen_pause
                and sid not in self._copying
                and sid not in self._handed
                and not self._is_durable(a)
                and self._failed.get(sid) != a.paused_key()
                and self.ownership.grant(sid) is not None
            ):
                self._copying.add(sid)
                self.node.start_background(
                    functools.partial(self._copy, sid), f"making paused sandbox {sid} durable"
                )
        for sid, copy in list(self._durable.items()):
            here = local.get(sid)
            if here is None or (here.state is not lc.State.PAUSED and sid not in self._copying):
                del self._durable[sid]
                self._stale.setdefault(sid, []).append(copy)
        for sid in list(self._stale):
            if sid in local and sid not in self._handed and local[sid].state is lc.State.PAUSING:
                continue  # paused again before its old copy went: wait for it to settle
            await self._drop_stale(sid)
        await self._sweep_local_copies(local)

    async def _drop_stale(self, sid: str) -> None:
        """Delete the stale copies of `sid`: from the store too when the claim says
        this node's sandbox no longer needs them; only here when another node has it."""
        grant = self.ownership.grant(sid)
        if grant is not None:
            if grant.state == PAUSED_DURABLE:
                return  # the claim still points at a copy: after the next reconcile
            everywhere = True
        else:
            view = await self.ownership.lookup(sid)
            if (
                view is not None
                and view.claim.node == self.ownership.node
                and not (view.claim.released)
            ):
                return  # ours in the store, not granted now (suspended): later
            everywhere = view is None or view.claim.released
        for copy in self._stale.pop(sid, []):
            await self._delete_copy(sid, copy, everywhere=everywhere)

    async def _delete_copy(self, sid: str, copy: Copy, *, everywhere: bool) -> None:
        try:
            await self.node.snapshots.delete(copy.snapshot_id, local_only=not everywhere)
            if everywhere:
                await self.store.delete(paused_key(sid, copy.epoch))
        except (StoreError, OSError) as exc:
            log.warning("deleting the paused copy of %s failed: %s", sid, exc)

    async def _sweep_local_copies(self, local: Mapping[str, SandboxActor]) -> None:
        """Local records of copies whose sandbox is gone from here and that no entry
        above tracks (an earlier process of this node made them): when another node
        holds the sandbox (it moved), only this node's record goes; when no node does
        (it was deleted), the copy goes from the store too."""
        kept = {c.snapshot_id for c in self._durable.values()}
        kept |= {c.snapshot_id for cs in self._stale.values() for c in cs}
        for doc in await self.node.snapshots.list():
            if not is_paused_copy(doc) or doc["snapshotID"] in kept:
                continue
            sid = str(doc.get("sourceSandboxID"))
            if sid in local or sid in self._copying or sid in self._adopting:
                continue
            view = await self.ownership.lookup(sid)
            if view is not None and view.claim.node == self.ownership.node:
                continue  # ours in the store but not here: being adopted, or stuck
            everywhere = view is None or view.claim.released
            await self.node.snapshots.delete(str(doc["snapshotID"]), local_only=not everywhere)

    async def _copy(self, sid: str) -> None:
        try:
            await self.make_durable(sid)
        except (SandboxNotFound, SandboxNotRunning, mailbox.ActorGone, mailbox.Busy) as exc:
            log.info("paused sandbox %s not made durable: %s", sid, exc)
        except (StoreError, OwnershipError, MoveError, CorruptSnapshot) as exc:
            log.warning("making paused sandbox %s durable failed: %s", sid, exc)
        finally:
            self._copying.discard(sid)

    async def make_durable(self, sid: str) -> Copy:
        """Put the current pause of `sid` (paused on disk) in the store and name it
        at the claim's epoch; the claim says `paused-durable` from the next reconcile."""
        actor = self.node.get(sid)
        key = actor.paused_key()
        doc = await self.node.paused_copy(sid)
        if doc.get("storage") != "durable":
            why = doc.get("storageError") or "the upload did not finish"
            self._failed[sid] = key
            raise MoveError(f"paused sandbox {sid} is not in the object store: {why}")
        grant = self.ownership.grant(sid)
        if grant is None:
            raise MoveError(f"node {self.ownership.node} does not hold sandbox {sid}")
        copy = Copy(str(doc.get("pausedKey")), str(doc["snapshotID"]), grant.epoch)
        body = {"sandboxID": sid, "snapshotID": copy.snapshot_id, "epoch": copy.epoch}
        await self.store.put(paused_key(sid, copy.epoch), json.dumps(body).encode())
        old = self._durable.get(sid)
        if old is not None and old.snapshot_id != copy.snapshot_id:
            self._stale.setdefault(sid, []).append(old)
        self._durable[sid] = copy
        log.info("paused sandbox %s is durable (snapshot %s)", sid, copy.snapshot_id)
        self.poke()
        return copy

    # -- resuming here ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def unpark(self, sid: str) -> Any:
        """Around a resume of `sid` through this node: a claim that says
        `paused-durable` says `running` first (the copy may no longer move)."""
        self._resuming[sid] = self._resuming.get(sid, 0) + 1
        try:
            grant = self.ownership.grant(sid)
            if grant is None and self._paused_here(sid) and self.cluster.doubtful(sid):
                # a copy taken back at a restart that may not be this node's (any
                # more): never resumed here; the next reconcile stops it or claims it.
                # (One made in this epoch is ours before its first claim.)
                raise MoveError(f"node {self.ownership.node} holds no claim on sandbox {sid} now")
            if grant is not None and grant.state == PAUSED_DURABLE:
                try:
                    await self.ownership.update(sid, state="running")
                except NotOwner:
                    raise MoveError(f"sandbox {sid} moved to another node") from None
                copy = self._durable.pop(sid, None)
                if copy is not None:
                    self._stale.setdefault(sid, []).append(copy)
            yield
        finally:
            self._resuming[sid] -= 1
            if not self._resuming[sid]:
                del self._resuming[sid]
                self.poke()

    def _paused_here(self, sid: str) -> bool:
        try:
            return self.node.get(sid).state is not lc.State.RUNNING
        except SandboxNotFound:
            return False

    # -- adopting -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _adoption(self, sid: str) -> Iterator[None]:
        self._adopting.add(sid)
        try:
            yield
        finally:
            self._adopting.discard(sid)

    async def arrived(self, sid: str) -> None:
        """Return once `sid` is no longer being taken up here (a call for a sandbox
        whose claim this node took over waits for its restore, not a 404)."""
        if sid in self._adopting:
            with trio.move_on_after(PAUSE_S):
                async with self._locks[sid]:
                    pass

    async def adopt(self, sid: str, *, fence: bool = True) -> SandboxActor:
        """Take up paused-durable sandbox `sid` here: its claim (fencing its node
        first if `fence` and that node's lease is live), its copy from the store.
        Returns the sandbox, paused. `MoveError` if it cannot move."""
        lock = self._locks.setdefault(sid, trio.Lock())
        async with lock:
            own = self.ownership
            with contextlib.suppress(SandboxNotFound):
                here = self.node.get(sid)
                if own.grant(sid) is not None:
                    return here
                raise MoveError(f"a copy of sandbox {sid} that is not this node's is here")
            view = await own.lookup(sid)
            if view is None or view.claim.released:
                raise MoveError(f"sandbox {sid} is not claimed by any node")
            if view.claim.state != PAUSED_DURABLE:
                raise MoveError(
                    f"sandbox {sid} is {view.claim.state or 'not paused'} on node "
                    f"{view.claim.node}: only a paused sandbox whose copy is in the "
                    "object store can move"
                )
            mine = view.claim.node == own.node
            if not mine and view.status is ClaimStatus.HELD:
                if not fence:
                    raise MoveError(f"node {view.claim.node} holds sandbox {sid}")
                log.info("fencing node %s to take sandbox %s", view.claim.node, sid)
                if not await own.fence(view.claim.node, min_epoch=view.claim.node_epoch):
                    raise MoveError(f"node {view.claim.node} is alive: it keeps sandbox {sid}")
            with self._adoption(sid):
                try:
                    grant = await own.take_over(sid, state=PAUSED_DURABLE, only_from=PAUSED_DURABLE)
                except (Claimed, NotMovable, NoClaim) as exc:
                    raise MoveError(str(exc)) from None
                try:
                    copy = await self._find_copy(sid, grant.epoch)
                    doc = await self.node.find_snapshot(copy.snapshot_id)
                    if doc is None:
                        raise MoveError(f"snapshot {copy.snapshot_id} of {sid} is gone")
                    t0 = trio.current_time()
                    actor = await self.node.adopt_paused(doc)
                except SandboxConflict:
                    raise MoveError(f"a copy of sandbox {sid} is already on this node") from None
                except Exception as exc:
                    # the claim stays this node's, its sandbox not here: kept (not
                    # released) until an adoption succeeds
                    log.error("restoring sandbox %s failed (its claim stays here): %r", sid, exc)
                    self._stuck.add(sid)
                    raise MoveError(f"sandbox {sid} could not be restored here: {exc}") from None
                new = Copy(actor.paused_key(), copy.snapshot_id, grant.epoch)
                self._durable[sid] = new
                if copy.epoch != grant.epoch:
                    body = {"sandboxID": sid, "snapshotID": new.snapshot_id, "epoch": new.epoch}
                    await self.store.put(paused_key(sid, new.epoch), json.dumps(body).encode())
                    with contextlib.suppress(StoreError):
                        await self.store.delete(paused_key(sid, copy.epoch))
                self._durable[sid] = new
                self._stuck.discard(sid)
                log.info(
                    "adopted paused sandbox %s from node %s in %.2fs",
                    sid,
                    view.claim.node,
                    trio.current_time() - t0,
                )
                self.poke()
                return actor

    async def _find_copy(self, sid: str, epoch: int) -> Copy:
        """The copy named at the highest fencing epoch up to `epoch`."""
        best: tuple[int, str] | None = None
        for info in await self.store.list(f"{PAUSED_PREFIX}/{sid}"):
            try:
                e = int(info.key.rsplit("/", 1)[1].removesuffix(".json"))
            except ValueError:
                continue
            if e <= epoch and (best is None or e > best[0]):
                best = (e, info.key)
        if best is None:
            raise MoveError(f"no copy of paused sandbox {sid} is in the object store")
        try:
            body = json.loads(await self.store.get(best[1]))
        except (ObjectNotFound, ValueError) as exc:
            raise MoveError(f"the copy of paused sandbox {sid} is unreadable: {exc}") from None
        return Copy("", str(body["snapshotID"]), best[0])

    async def watch(self) -> None:
        """Adopt the paused-durable sandboxes of members that died or left."""
        while True:
            await trio.sleep(WATCH_S)
            if self.draining or not self.ownership.may_serve():
                continue
            for m in self.cluster.members():
                if m.id == self.cluster.node_id or m.state not in ("dead", "left"):
                    self._watched.pop(m.id, None)
                    continue
                if self._watched.get(m.id) == m.incarnation:
                    continue
                self._watched[m.id] = m.incarnation
                self.node.start_background(
                    functools.partial(self._adopt_from, m),
                    f"adopting the paused sandboxes of {m.id}",
                )

    async def _adopt_from(self, gone: Member) -> None:
        try:
            views = await self.ownership.list_claims(node=gone.id)
        except (StoreError, OwnershipError) as exc:
            log.warning("listing the sandboxes of node %s failed: %s", gone.id, exc)
            self._watched.pop(gone.id, None)  # try again
            return
        paused = [v.claim.sid for v in views if v.claim.state == PAUSED_DURABLE]
        if not paused:
            return
        log.info("node %s is %s: %d paused sandboxes to adopt", gone.id, gone.state, len(paused))
        live = [
            m.id
            for m in self.cluster.members()
            if m.state == "alive" and not m.meta.get("load", {}).get("draining")
        ]
        if self.cluster.node_id not in live:
            live.append(self.cluster.node_id)

        async def one(sid: str) -> None:
            rank = adopters(sid, live).index(self.cluster.node_id)
            await trio.sleep(rank * ADOPT_STAGGER_S)
            async with self._limiter:
                try:
                    view = await self.ownership.lookup(sid)
                    if view is None or view.claim.node != gone.id:
                        return  # moved already (or deleted)
                    await self.adopt(sid, fence=True)
                except (MoveError, StoreError, OwnershipError) as exc:
                    log.info("not adopting sandbox %s: %s", sid, exc)

        async with trio.open_nursery() as nursery:
            for sid in paused:
                nursery.start_soon(one, sid)

    # -- draining -------------------------------------------------------------------------

    async def drain(self, *, leave: Callable[[], Any]) -> DrainReport:
        """Move every sandbox of this node to the others, then leave (`leave()`)."""
        report = DrainReport(self.cluster.node_id)
        self.drain_report = report
        self.draining = self.cluster.draining = True
        t0 = time.monotonic()
        actors = [a for a in self.node.list() if a.state.value in ("running", "paused", "pausing")]
        log.info("draining node %s: %d sandboxes to move", self.cluster.node_id, len(actors))
        limiter = trio.CapacityLimiter(DRAIN_CONCURRENCY)
        turn = 0

        async def one(actor: SandboxActor, target: Member) -> None:
            async with limiter:
                sid = actor.sandbox_id
                start = time.monotonic()
                try:
                    running = await self._move(actor, target)
                except Exception as exc:
                    log.error("moving sandbox %s to %s failed: %r", sid, target.id, exc)
                    report.failed[sid] = str(exc) or repr(exc)
                    return
                took = time.monotonic() - start
                if running:
                    report.moved += 1
                else:
                    report.rehomed += 1
                report.moves.append(
                    {
                        "sandboxID": sid,
                        "to": target.id,
                        "running": running,
                        "seconds": round(took, 3),
                    }
                )
                log.info(
                    "moved %s sandbox %s to %s in %.2fs",
                    "running" if running else "paused",
                    sid,
                    target.id,
                    took,
                )

        alone, groups = volume_groups(actors)
        async with trio.open_nursery() as nursery:
            for actor in alone:
                targets = self._targets()
                if not targets:
                    report.failed[actor.sandbox_id] = "no other node can take it"
                    continue
                nursery.start_soon(one, actor, targets[turn % len(targets)])
                turn += 1
            for group in groups:
                targets = self._targets()
                if not targets:
                    for actor in group:
                        report.failed[actor.sandbox_id] = "no other node can take it"
                    continue
                nursery.start_soon(self._move_group, group, targets[turn % len(targets)], one)
                turn += 1
        report.seconds = time.monotonic() - t0
        log.info(
            "drained node %s in %.1fs: %d running moved, %d paused rehomed, %d failed",
            self.cluster.node_id,
            report.seconds,
            report.moved,
            report.rehomed,
            len(report.failed),
        )
        if not report.failed:
            await leave()
        return report

    # -- making room ----------------------------------------------------------------

    async def make_room(self, sid: str) -> Member | None:
        """Before a resume of `sid` here: if it is paused on disk and this node's
        memory cannot take it, hand it to the node with the most room and return
        that node (the caller sends the resume there). None: resume it here (it
        is running, in memory, not here, or no other node has room either)."""
        lock = self._room_locks.setdefault(sid, trio.Lock())
        try:
            async with lock:
                return await self._make_room(sid)
        finally:
            if not lock.locked() and not lock.statistics().tasks_waiting:
                self._room_locks.pop(sid, None)  # (one lock per resume in flight, no more)

    async def _make_room(self, sid: str) -> Member | None:
        try:
            actor = self.node.get(sid)
        except SandboxNotFound:
            return self._made_room.get(sid)  # moved by a call just before this one
        if (
            self.draining
            or sid in self._moving
            or actor.state is not lc.State.PAUSED
            or not actor.on_disk
            or actor.frozen_pause
            or actor.volume_mounts  # its volumes are here (a drain moves them along)
        ):
            return None
        available, total = read_meminfo()
        low_pct = self.node.config.hibernate_memory_low_pct
        if placement.room_to_resume(available, total, low_pct, actor.memory_mb):
            return None
        target = self._roomiest(actor.memory_mb)
        if target is None:
            log.warning(
                "no room to resume sandbox %s here (%d MiB available) nor on another node",
                sid,
                available >> 20,
            )
            return None
        log.info(
            "no room to resume sandbox %s here (%d MiB available): moving it to %s",
            sid,
            available >> 20,
            target.id,
        )
        try:
            await self._move(actor, target)
        except Exception as exc:
            log.error("moving sandbox %s to %s to make room failed: %r", sid, target.id, exc)
            return None
        self._made_room[sid] = target
        while len(self._made_room) > MADE_ROOM_KEPT:
            del self._made_room[next(iter(self._made_room))]
        return target

    def _roomiest(self, memory_mb: int) -> Member | None:
        """The other node best placed to resume a sandbox of `memory_mb`."""
        members = {m.id: m for m in self._targets()}
        loads = [
            load
            for m in members.values()
            if (load := m.load).mem_free - memory_mb * 2**20 > 0 and load.has_room
        ]
        ranked = placement.rank(
            loads, template=None, memory_mb=memory_mb, k=len(loads), rng=self.cluster.rng
        )
        return members[ranked[0].node] if ranked else None

    async def _to_disk(self, actor: SandboxActor) -> None:
        """Pause `actor` (if it runs) and have it written to disk."""
        if actor.state is lc.State.RUNNING:
            await actor.mailbox.ask(Pause("full"), timeout=PAUSE_S)
        if actor.frozen_pause:  # paused in memory: to disk now
            await actor.mailbox.ask(Hibernate(), timeout=60)

        def on_disk() -> bool:
            return actor.state is lc.State.PAUSED and actor.on_disk and not actor.frozen_pause

        with trio.move_on_after(PAUSE_S):
            while not on_disk():  # noqa: ASYNC110 (no event says "on disk")
                await trio.sleep(0.05)
        if not on_disk():
            raise MoveError(
                f"sandbox {actor.sandbox_id} could not be paused to disk ({actor.state.value})"
            )

    async def _move_group(
        self,
        group: list[SandboxActor],
        target: Member,
        one: Callable[[SandboxActor, Member], Any],
    ) -> None:
        """Move sandboxes that share volumes to one node, with the volumes: all
        paused to disk first (nothing writes to them any more), the volumes copied to
        the store, the sandboxes moved (the first one's resume there fetches
        the volumes), then this node's copies of the volumes removed."""
        volumes = sorted({m.volume_id for a in group for m in a.volume_mounts})
        try:
            for actor in group:
                if actor.state is lc.State.RUNNING:
                    self._was_running.add(actor.sandbox_id)
                await self._to_disk(actor)  # its files all in the volume, on the host
            for volume_id in volumes:
                await self.node.volumes.persist(volume_id)
        except Exception as exc:
            log.error("moving volumes %s failed: %r", ", ".join(volumes), exc)
            for actor in group:
                if actor.sandbox_id in self._was_running:  # running again, as it was
                    self._was_running.discard(actor.sandbox_id)
                    with contextlib.suppress(Exception):
                        await actor.mailbox.ask(Resume(), timeout=PAUSE_S)
            if self.drain_report is not None:
                for actor in group:
                    self.drain_report.failed[actor.sandbox_id] = f"its volumes: {exc}"
            return
        for actor in group:
            await one(actor, target)
        for volume_id in volumes:
            try:
                await self.node.volumes.drop_local(volume_id)
            except Exception as exc:  # still mounted here (a move failed): it stays
                log.warning("volume %s stays on this node: %r", volume_id, exc)

    def _targets(self) -> list[Member]:
        return [
            m
            for m in self.cluster.members()
            if m.id != self.cluster.node_id
            and m.state == "alive"
            and not (m.meta.get("load") or {}).get("draining")
        ]

    async def _move(self, actor: SandboxActor, target: Member) -> bool:
        """Move one sandbox to `target`: True if it was running (and runs there)."""
        self._moving.add(actor.sandbox_id)
        try:
            return await self._move_one(actor, target)
        finally:
            self._moving.discard(actor.sandbox_id)

    async def _move_one(self, actor: SandboxActor, target: Member) -> bool:
        sid = actor.sandbox_id
        if self.ownership.grant(sid) is None:  # too new to be claimed yet
            try:
                await self.ownership.claim(sid, state="running")
            except Claimed as e:
                if e.claim.node != self.ownership.node:
                    raise MoveError(f"node {e.claim.node} holds sandbox {sid}") from None
                await self.ownership.take_over(sid)
        running = actor.state is lc.State.RUNNING or sid in self._was_running
        self._was_running.discard(sid)
        remaining = 0.0
        await self._to_disk(actor)
        remaining = actor.lifecycle.remaining or 0.0
        lock = self._locks.setdefault(sid, trio.Lock())
        async with lock:
            if not self._is_durable(actor):
                await self.make_durable(sid)
            self._handed.add(sid)
            try:
                # the claim as stored now (a reconcile may have written it meanwhile)
                await self.ownership.take_over(sid)
                await self.ownership.hand_over(sid, to=target.id, state=PAUSED_DURABLE)
            except BaseException:
                self._handed.discard(sid)
                raise
        copy = self._durable.pop(sid, None)
        if copy is not None:
            self._stale.setdefault(sid, []).append(copy)
        try:
            with contextlib.suppress(SandboxNotFound, mailbox.ActorGone):
                await self.node.kill(sid)
        finally:
            self._handed.discard(sid)
        params = {"resume": str(max(1, math.ceil(remaining))) if running else "0"}
        r = await self.http.post(
            f"{target.url}/cluster/v1/sandboxes/{sid}/adopt",
            params=params,
            headers={"X-API-Key": self.node.api_key, HOP_HEADER: self.cluster.node_id},
            timeout=PAUSE_S,
        )
        if r.status_code >= 300:
            raise MoveError(f"node {target.id} did not take sandbox {sid} up: {r.text[:300]}")
        return running

    async def take_up(self, sid: str, *, resume_s: int) -> SandboxActor:
        """Adopt `sid`, handed to this node (a drain), and resume it if `resume_s`."""
        actor = await self.adopt(sid, fence=False)
        if resume_s > 0:
            async with self.unpark(sid):
                await actor.mailbox.ask(Resume(resume_s), timeout=PAUSE_S)
        return actor


def volume_groups(
    actors: Sequence[SandboxActor],
) -> tuple[list[SandboxActor], list[list[SandboxActor]]]:
    """The sandboxes that mount no volume, and the others in groups that share
    volumes (two that share one with a third are in one group): each group
    moves to one node, where its volumes go too."""
    alone: list[SandboxActor] = []
    groups: list[list[SandboxActor]] = []
    by_volume: dict[str, int] = {}
    for actor in actors:
        ids = {m.volume_id for m in actor.volume_mounts}
        if not ids:
            alone.append(actor)
            continue
        hit = sorted({by_volume[v] for v in ids if v in by_volume})
        if hit:
            into = hit[0]
            for other in hit[1:]:  # this sandbox joins groups: merge them
                groups[into].extend(groups[other])
                groups[other] = []
                for v, g in by_volume.items():
                    if g == other:
                        by_volume[v] = into
        else:
            into = len(groups)
            groups.append([])
        groups[into].append(actor)
        for v in ids:
            by_volume[v] = into
    return alone, [g for g in groups if g]
