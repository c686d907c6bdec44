"""One owner per sandbox: the node's lease and its sandbox claims in the object store.

`open_ownership(store, node=...)` joins: it writes the node's lease
(`cluster/nodes/{node}`) and keeps renewing it with a compare-and-swap every
`ttl / 3`, in a task of its own, for as long as the block runs. The
`Ownership` it yields answers, without IO, whether this node may serve a
sandbox and with which fencing epoch (`grant`), and does the store work of
ownership: `claim` a new sandbox (create-if-absent), `update` its hint or
`release` it (compare-and-swap, so a node that lost a sandbox cannot touch
its record), `fence` a node that stopped renewing (after watching its lease
unchanged for the fence window), `take_over` a sandbox whose node's epoch
has ended, `lookup` and `list_claims` for cluster-wide answers, and `leave`.
The rules, and why two nodes never serve one sandbox, are in
`aenv.proto.ownership` and docs/cluster.md ("Ownership").

When renewals fail until the serving deadline the status turns SUSPENDED
(serving must stop; it comes back if a later renewal succeeds, which means
nobody fenced the lease); a refused renewal means another node fenced this
epoch: the status turns FENCED, every claim of the epoch is dropped, and the
node joins again with a new epoch, holding nothing. `on_change(status,
epoch)` is called on every change (from the renewing task: it must not
block); `wait_status` waits for one. Times are trio's clock, so tests run
all of it on a `MockClock`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import trio

from aenv.proto.ownership import (
    NODES_PREFIX,
    SANDBOXES_PREFIX,
    TOMBSTONE,
    ClaimStatus,
    HolderStatus,
    Join,
    LeaseHolder,
    LeaseState,
    LeaseTiming,
    NodeLease,
    Observer,
    RecordError,
    SandboxClaim,
    check_name,
    claim_key,
    claim_status,
    fenced_lease,
    lease_key,
    moved_claim,
    new_claim,
)
from aenv.storage.objstore import ObjectStore, StoreError, Version, Versioned

log = logging.getLogger("aenv.cluster.leases")

StatusCallback = Callable[[HolderStatus, "int | None"], None]


# -- errors ---------------------------------------------------------------------------


class OwnershipError(Exception):
    """Base of ownership refusals."""


class NotServing(OwnershipError):
    """This node's lease is not live (joining, suspended, fenced or left)."""


class Claimed(OwnershipError):
    """Another claim is in the way; `claim` is the record found."""

    def __init__(self, message: str, claim: SandboxClaim) -> None:
        super().__init__(message)
        self.claim = claim


class OwnerAlive(Claimed):
    """The sandbox's node still holds a live lease: fence it first."""


class NotOwner(OwnershipError):
    """This node does not hold the sandbox (any more)."""


class NotMovable(OwnershipError):
    """The claim is not in the state a move requires (a running sandbox never moves)."""

    def __init__(self, message: str, claim: SandboxClaim) -> None:
        super().__init__(message)
        self.claim = claim


class NoClaim(OwnershipError, KeyError):
    """No record for the sandbox, or it was released."""


# -- values ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """This node may serve `sid` until `until` (trio's clock), as owner at the
    sandbox's fencing epoch `epoch`, under its own lease epoch `node_epoch`."""

    sid: str
    node_epoch: int
    epoch: int
    until: float
    state: str


@dataclass(frozen=True)
class ClaimView:
    """A claim as read, what it means, and its node's lease (None if missing)."""

    claim: SandboxClaim
    status: ClaimStatus
    lease: NodeLease | None

    @property
    def owner_url(self) -> str:
        return self.lease.url if self.lease is not None else ""


def _writer() -> str:
    return secrets.token_hex(8)


# -- the actor ------------------------------------------------------------------------


class Ownership:
    """The node's side of ownership; made by `open_ownership`."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        node: str,
        url: str = "",
        timing: LeaseTiming,
        on_change: StatusCallback | None = None,
    ) -> None:
        self.node = check_name(node, "node id")
        self.timing = timing
        self._store = store
        self._key = lease_key(node)
        self._holder = LeaseHolder(node, timing, url=url)
        self._version: Version | None = None  # of the lease we last wrote
        self._mine: dict[str, tuple[SandboxClaim, Version]] = {}
        # one write at a time per claim this node holds: each starts from the version
        # the previous one left (concurrent writers would refuse each other)
        self._writing: dict[str, trio.Lock] = {}
        self._on_change = on_change
        self._reported: tuple[HolderStatus, int | None] | None = None
        self._changed = trio.Event()
        self._status_lot = trio.lowlevel.ParkingLot()

    def __repr__(self) -> str:
        return f"Ownership({self.node}, {self.status.value}, epoch={self.epoch})"

    # -- answers without IO --

    @property
    def status(self) -> HolderStatus:
        return self._holder.status(trio.current_time())

    @property
    def epoch(self) -> int | None:
        """The live epoch of this node's lease (None while joining, fenced or left)."""
        return self._holder.epoch

    @property
    def lease(self) -> NodeLease | None:
        return self._holder.lease

    def may_serve(self) -> bool:
        return self._holder.may_serve(trio.current_time())

    def serve_until(self) -> float | None:
        """When this node must stop serving unless a renewal succeeds first."""
        return self._holder.serve_until()

    def grant(self, sid: str) -> Grant | None:
        """Whether this node may serve `sid` now: its grant, or None."""
        until = self._holder.serve_until()
        mine = self._mine.get(sid)
        if mine is None or until is None or not self.may_serve():
            return None
        claim = mine[0]
        if claim.node_epoch != self._holder.epoch:
            return None
        return Grant(sid, claim.node_epoch, claim.epoch, until, claim.state)

    def held(self) -> list[Grant]:
        """Every sandbox this node may serve now."""
        return [g for sid in sorted(self._mine) if (g := self.grant(sid)) is not None]

    async def wait_status(self, *statuses: HolderStatus) -> HolderStatus:
        """Wait until the status is one of `statuses`; returns it."""
        while (now := self.status) not in statuses:
            until = self._holder.serve_until()
            if until is not None and now is HolderStatus.SERVING:
                with trio.move_on_at(until):
                    await self._status_lot.park()
            else:
                await self._status_lot.park()
        return now

    # -- claims --

    async def claim(
        self, sid: str, *, state: str = "", meta: dict[str, str] | None = None
    ) -> Grant:
        """Claim a new sandbox for this node (create-if-absent). `Claimed` if a record
        exists, `NotServing` if this node may not serve now."""
        key = claim_key(sid)
        epoch = self._serving_epoch()
        claim = new_claim(sid, self.node, epoch, _writer(), state=state, meta=meta or {})
        version = await self._store.create(key, claim.encode())
        if version is None:
            found = await self._store.get_versioned(key)
            if found is None:
                raise StoreError(f"claim of {sid!r} refused, but no record is there")
            current = SandboxClaim.decode(found.data)
            if current.writer != claim.writer:
                raise Claimed(f"sandbox {sid!r} is claimed by node {current.node!r}", current)
            version = found.version  # our create landed; its answer was lost
        return self._keep(claim, version)

    async def update(
        self, sid: str, *, state: str | None = None, meta: dict[str, str] | None = None
    ) -> Grant:
        """Change the hint of a sandbox this node holds (a fenced write: it fails with
        `NotOwner` if the sandbox moved)."""
        async with self._write_lock(sid):
            return await self._update(sid, state=state, meta=meta)

    def _write_lock(self, sid: str) -> trio.Lock:
        return self._writing.setdefault(sid, trio.Lock())

    async def _update(self, sid: str, *, state: str | None, meta: dict[str, str] | None) -> Grant:
        claim, version = self._held(sid)
        changed = replace(
            claim,
            writer=_writer(),
            state=claim.state if state is None else state,
            meta=claim.meta if meta is None else dict(meta),
        )
        return self._keep(changed, await self._swap_claim(sid, changed, version))

    async def release(self, sid: str) -> None:
        """Give up a sandbox this node holds (it was deleted): the record becomes a
        tombstone, by compare-and-swap, then goes. A sandbox not held is left alone."""
        async with self._write_lock(sid):
            await self._release(sid)
        self._writing.pop(sid, None)

    async def _release(self, sid: str) -> None:
        mine = self._mine.get(sid)
        if mine is None:
            return
        claim, version = mine
        gone = replace(claim, writer=_writer(), state=TOMBSTONE)
        try:
            await self._swap_claim(sid, gone, version)
        except NotOwner:
            return
        finally:
            self._mine.pop(sid, None)
        # Nobody writes a tombstone, so removing it unconditionally is safe.
        await self._store.delete(claim_key(sid))

    async def take_over(
        self, sid: str, *, state: str | None = None, only_from: str | None = None
    ) -> Grant:
        """Move a sandbox whose node's epoch has ended to this node; its fencing epoch
        grows by one. A sandbox already held is granted as it is. `OwnerAlive` if its
        node's lease is live at the claim's epoch (`fence` that node first), `Claimed`
        if another node moved it first, `NoClaim` if there is none. With `only_from`,
        the claim must be in that state (`NotMovable` otherwise): the state read is
        the one the compare-and-swap replaces."""
        key = claim_key(sid)
        epoch = self._serving_epoch()
        found = await self._store.get_versioned(key)
        if found is None:
            raise NoClaim(sid)
        claim = SandboxClaim.decode(found.data)
        if only_from is not None and claim.state != only_from and not claim.released:
            raise NotMovable(
                f"sandbox {sid!r} is {claim.state or 'in no state'} on node {claim.node!r}, "
                f"not {only_from}",
                claim,
            )
        if claim.node == self.node and claim.node_epoch == epoch and not claim.released:
            return self._keep(claim, found.version)
        view = await self._view(claim)
        if view.status is ClaimStatus.RELEASED:
            raise NoClaim(sid)
        if view.status is ClaimStatus.HELD:
            raise OwnerAlive(f"sandbox {sid!r} is held by live node {claim.node!r}", claim)
        moved = moved_claim(claim, self.node, epoch, _writer())
        if state is not None:
            moved = replace(moved, state=state)
        version = await self._store.compare_and_swap(key, moved.encode(), expect=found.version)
        if version is None:
            again = await self._store.get_versioned(key)
            current = SandboxClaim.decode(again.data) if again else None
            if again is None or current is None or current.writer != moved.writer:
                if current is None:
                    raise NoClaim(sid)
                raise Claimed(f"sandbox {sid!r} was moved to {current.node!r} first", current)
            version = again.version
        log.info("took over sandbox %s from %s (epoch %d)", sid, claim.node, moved.epoch)
        return self._keep(moved, version)

    async def hand_over(self, sid: str, *, to: str, state: str) -> SandboxClaim:
        """Give a sandbox this node holds to live node `to` (a drain): the claim names
        `to` at its lease's current epoch, with the fencing epoch one higher, by
        compare-and-swap on the version this node holds. From then on `to` holds it
        (its `take_over` grants it as it is) and this node does not. `NotOwner` if the
        sandbox moved meanwhile, `OwnershipError` if `to` has no live lease."""
        async with self._write_lock(sid):
            return await self._hand_over(sid, to=to, state=state)

    async def _hand_over(self, sid: str, *, to: str, state: str) -> SandboxClaim:
        self._held(sid)
        self._serving_epoch()
        lease = _lease_or_none(await self._store.get_versioned(lease_key(to)))
        if lease is None or lease.state is not LeaseState.LIVE:
            raise OwnershipError(f"node {to!r} has no live lease: it cannot take {sid!r}")
        claim, version = self._held(sid)  # (an update may have landed meanwhile)
        moved = replace(moved_claim(claim, to, lease.epoch, _writer()), state=state)
        await self._swap_claim(sid, moved, version)
        self._mine.pop(sid, None)
        log.info("handed sandbox %s over to %s (epoch %d)", sid, to, moved.epoch)
        return moved

    async def fence(self, node: str, *, min_epoch: int = 0) -> bool:
        """End `node`'s current epoch so that its claims can move: watch its lease
        and, once unchanged for the fence window, swap in a FENCED lease. True when
        its lease is no longer live (fenced here or elsewhere, or left); False as soon
        as it renews (it is alive). `min_epoch`: the highest node epoch of the claims
        to move, for a lease that is missing. Takes at least the window."""
        if node == self.node:
            raise ValueError("a node does not fence itself")
        key = lease_key(node)
        observer = Observer(self.timing)
        first: Version | bool | None = False  # no read yet
        while True:
            found = await self._store.get_versioned(key)
            now = trio.current_time()
            lease = _lease_or_none(found)
            version = found.version if found else None
            if lease is not None and lease.state is not LeaseState.LIVE:
                return True
            if first is False:
                first = version
            elif version != first:
                return False
            observer.saw(node, version, lease, now)
            if observer.may_fence(node, version, now):
                fence = fenced_lease(
                    lease, node, min_epoch, self.node, _writer(), ttl=self.timing.ttl
                )
                if found is None:
                    done = await self._store.create(key, fence.encode())
                else:
                    done = await self._store.compare_and_swap(
                        key, fence.encode(), expect=found.version
                    )
                if done is not None:
                    log.warning("fenced node %s at epoch %d", node, fence.epoch)
                    return True
                continue  # changed under us: the next read says how
            at = observer.fence_at(node)
            assert at is not None
            await trio.sleep_until(min(at, now + self.timing.renew_every))

    # -- lookups --

    async def lookup(self, sid: str) -> ClaimView | None:
        """The sandbox's claim and its node's lease, or None if there is no claim."""
        found = await self._store.get_versioned(claim_key(sid))
        if found is None:
            return None
        return await self._view(SandboxClaim.decode(found.data))

    async def leases(self) -> dict[str, NodeLease]:
        """Every node's lease as stored, by node id."""
        out: dict[str, NodeLease] = {}
        for info in await self._store.list(NODES_PREFIX):
            found = await self._store.get_versioned(info.key)
            lease = _lease_or_none(found)
            if lease is not None:
                out[lease.node] = lease
        return out

    async def list_claims(self, *, node: str | None = None) -> list[ClaimView]:
        """Every claim in the store (of `node` only, if given), with what it means.
        One request per claim: for cluster-wide listings, not for hot paths."""
        leases = await self.leases()
        views: list[ClaimView] = []
        for info in await self._store.list(SANDBOXES_PREFIX):
            found = await self._store.get_versioned(info.key)
            if found is None:
                continue
            try:
                claim = SandboxClaim.decode(found.data)
            except RecordError as exc:
                log.warning("skipping unreadable claim %s: %s", info.key, exc)
                continue
            if node is None or claim.node == node:
                lease = leases.get(claim.node)
                views.append(ClaimView(claim, claim_status(claim, lease), lease))
        return views

    # -- leaving --

    async def leave(self) -> None:
        """End this node's epoch on purpose: call it once the node has stopped (or
        moved) every sandbox it holds. Serving stops at once; the lease says LEFT, so
        other nodes may take what is left of its claims without waiting."""
        if self._holder.lease is None or self._holder.left:
            return
        expect = self._version
        left = replace(self._holder.leaving(), writer=_writer())
        self._mine.clear()
        self._notify()
        try:
            for _ in range(3):
                if expect is None or self._holder.fenced:
                    return
                if await self._store.compare_and_swap(self._key, left.encode(), expect=expect):
                    return
                # A renewal still in flight may have landed first: leave from there.
                found = await self._store.get_versioned(self._key)
                if found is None or not self._holder.ours(_lease_or_none(found)):
                    return
                expect = found.version
        except StoreError as exc:
            log.warning("could not record leaving: %s (the lease will lapse)", exc)

    # -- internals: claims --

    def _serving_epoch(self) -> int:
        epoch = self._holder.epoch
        if epoch is None or not self.may_serve():
            raise NotServing(f"node {self.node} is {self.status.value}: it may not serve now")
        return epoch

    def _held(self, sid: str) -> tuple[SandboxClaim, Version]:
        mine = self._mine.get(sid)
        if mine is None or mine[0].node_epoch != self._holder.epoch:
            raise NotOwner(f"node {self.node} does not hold sandbox {sid!r}")
        return mine

    def _keep(self, claim: SandboxClaim, version: Version) -> Grant:
        self._mine[claim.sid] = (claim, version)
        until = self._holder.serve_until() or trio.current_time()
        return Grant(claim.sid, claim.node_epoch, claim.epoch, until, claim.state)

    async def _swap_claim(self, sid: str, claim: SandboxClaim, expect: Version) -> Version:
        key = claim_key(sid)
        version = await self._store.compare_and_swap(key, claim.encode(), expect=expect)
        if version is not None:
            return version
        found = await self._store.get_versioned(key)
        if found is not None and SandboxClaim.decode(found.data).writer == claim.writer:
            return found.version  # ours landed; its answer was lost
        self._mine.pop(sid, None)
        raise NotOwner(f"sandbox {sid!r} moved away from node {self.node}")

    async def _view(self, claim: SandboxClaim) -> ClaimView:
        lease = _lease_or_none(await self._store.get_versioned(lease_key(claim.node)))
        return ClaimView(claim, claim_status(claim, lease), lease)

    # -- internals: the lease --

    async def _join(self, *, resume: bool) -> None:
        """Write the lease (a new epoch, or the same one after an earlier process)."""
        observer = Observer(self.timing)
        self._mine.clear()
        while True:
            try:
                found = await self._store.get_versioned(self._key)
                current = _lease_or_none(found)
                plan, lease = self._holder.join_plan(
                    current, _writer(), resume=resume, wall=time.time()
                )
                now = trio.current_time()
                if plan is Join.WAIT:
                    assert found is not None
                    observer.saw(self.node, found.version, current, now)
                    if not observer.may_fence(self.node, found.version, now):
                        at = observer.fence_at(self.node)
                        assert at is not None
                        log.info("node %s: waiting for its earlier lease to lapse", self.node)
                        await trio.sleep_until(min(at, now + self.timing.renew_every))
                        continue
                self._holder.sending(lease, now)
                if plan is Join.CREATE:
                    version = await self._store.create(self._key, lease.encode())
                else:
                    assert found is not None
                    version = await self._store.compare_and_swap(
                        self._key, lease.encode(), expect=found.version
                    )
                if version is None:
                    back = await self._store.get_versioned(self._key)
                    if back is None or _lease_or_none(back) != lease:
                        continue  # someone else wrote: plan again
                    version = back.version
                self._version = version
                self._holder.written(lease)
                log.info("node %s joined at epoch %d", self.node, lease.epoch)
                self._notify()
                return
            except StoreError as exc:
                log.warning("node %s cannot join yet: %s", self.node, exc)
                await trio.sleep(self.timing.retry_every)

    async def _renew_forever(self) -> None:
        while not self._holder.left:
            await trio.sleep_until(self._holder.next_renewal_at(trio.current_time()))
            if self._holder.left:
                return
            await self._renew()
            if self._holder.fenced and not self._holder.left:
                log.error("node %s was fenced: every claim of its epoch is dropped", self.node)
                self._mine.clear()
                self._notify()
                await self._join(resume=False)

    async def _renew(self) -> None:
        holder = self._holder
        expect = self._version
        assert expect is not None
        lease = holder.next_renewal(_writer(), time.time())
        holder.sending(lease, trio.current_time())
        try:
            with trio.move_on_after(self.timing.renew_every) as scope:
                version = await self._store.compare_and_swap(
                    self._key, lease.encode(), expect=expect
                )
                if version is None:
                    back = await self._store.get_versioned(self._key)
            if scope.cancelled_caught:
                raise StoreError("renewal timed out")
        except StoreError as exc:
            holder.failed()
            log.warning("node %s: lease renewal failed: %s", self.node, exc)
            self._notify()
            return
        if version is not None:
            self._version = version
            holder.written(lease)
        elif holder.refused(_lease_or_none(back)):
            assert back is not None
            self._version = back.version
        self._notify()

    async def _watch_deadline(self) -> None:
        """Report SERVING -> SUSPENDED when the deadline passes without a renewal."""
        while True:
            until = self._holder.serve_until()
            if until is None or trio.current_time() >= until:
                await self._changed.wait()
            else:
                with trio.move_on_at(until):
                    await self._changed.wait()
            self._changed = trio.Event()
            self._report()

    def _notify(self) -> None:
        """Something changed: wake the deadline watcher and report."""
        self._changed.set()
        self._report()

    def _report(self) -> None:
        now = (self.status, self.epoch)
        if now != self._reported:
            self._reported = now
            log.info("node %s lease: %s (epoch %s)", self.node, now[0].value, now[1])
            self._status_lot.unpark_all()
            if self._on_change is not None:
                self._on_change(*now)


def _lease_or_none(found: Versioned | None) -> NodeLease | None:
    if found is None:
        return None
    try:
        return NodeLease.decode(found.data)
    except RecordError as exc:
        log.warning("unreadable node lease: %s", exc)
        return None


@asynccontextmanager
async def open_ownership(
    store: ObjectStore,
    *,
    node: str,
    url: str = "",
    timing: LeaseTiming | None = None,
    resume: bool = False,
    on_change: StatusCallback | None = None,
) -> AsyncIterator[Ownership]:
    """Join with node id `node` and keep the lease renewed for the block.

    Returns once the lease is live. If the lease is live already (an earlier
    process of this node), joining keeps its epoch, so the node's claims stay
    valid, but first waits until that lease has gone unrenewed for the fence
    window, unless `resume` says the caller knows that process is dead (it
    holds the node's home directory lock, for instance). Leaving the block
    without `leave()` stops renewing: to the cluster that is a crash, and
    other nodes may fence the lease once the window has passed.
    """
    own = Ownership(store, node=node, url=url, timing=timing or LeaseTiming(), on_change=on_change)
    await own._join(resume=resume)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(own._renew_forever)
        nursery.start_soon(own._watch_deadline)
        try:
            yield own
        finally:
            nursery.cancel_scope.cancel()
