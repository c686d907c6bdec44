"""Keeping the store's ownership records in step with the sandboxes this node holds.

The node creates, forks, restores, pauses and stops sandboxes on its own
(timeouts, auto-pause, a restart taking them back); `Owners` does not hook
into each of those. It reconciles instead, every `RECONCILE_S` and whenever
asked (`poke`): a sandbox the node holds with no claim is claimed
(create-if-absent; after a node restart its existing claim is taken up again
at the same epoch), a claim whose sandbox is gone is released, and a claim
whose state changed (running or paused) is updated.

A sandbox the node holds that another node has claimed is not this node's to
serve: it moved while this node could not renew its lease (it was fenced).
It is stopped here and the conflict logged. While the node may not serve
(its lease lapsed: the store is unreachable), the router answers 503 for its
sandboxes and nothing is reconciled.

Between its creation and its first claim (one reconcile, normally within
milliseconds, longer when the store is slow), a sandbox is this node's all
the same: its ID is new, so no other node can hold a claim on it. Only the
sandboxes the node held when its epoch began (taken back at a restart, or
kept through a fence) may belong to another node by now; `doubtful` says
which sandboxes are in that position, so that the router asks the store
about those and serves the others at once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from collections.abc import Set as AbstractSet

import trio

from aenv.cluster.leases import Claimed, NotOwner, NotServing, Ownership, OwnershipError
from aenv.storage.objstore import StoreError

log = logging.getLogger("aenv.cluster.owners")

RECONCILE_S = 2.0


class Owners:
    def __init__(
        self,
        ownership: Ownership,
        *,
        local: Callable[[], Mapping[str, str]],
        stop: Callable[[str, str], None],
        keep: Callable[[], AbstractSet[str]] = frozenset,
        after: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """`local()`: {sandbox ID: state hint ("running", "paused", ...)} of what
        this node holds; `stop(sandbox_id, why)` stops one that is not this node's
        any more; `keep()`: claims held for sandboxes not here yet (being moved
        here), never released; `after()` runs after each reconcile."""
        self.ownership = ownership
        self._local = local
        self._stop = stop
        self._keep = keep
        self._after = after
        self._poke = trio.Event()
        self._poke.set()  # the first reconcile at once (a restart's copies are settled)
        self.conflicts = 0
        # the epoch whose first reconcile ran, and what was here at it with no claim
        # this node holds: sandboxes from before the epoch, not yet settled
        self._epoch: int | None = None
        self._doubtful: set[str] = set()

    def doubtful(self, sid: str) -> bool:
        """Whether `sid`, held here without a claim, may be another node's: it was
        here when this node's epoch began (a restart, a fence) and has not been
        claimed since. A sandbox made in this epoch never is (its first claim is a
        reconcile away); before the epoch's first reconcile, every one is."""
        epoch = self.ownership.epoch
        return epoch is None or epoch != self._epoch or sid in self._doubtful

    def poke(self) -> None:
        """Reconcile soon (a sandbox was created or stopped)."""
        self._poke.set()

    async def run(self) -> None:
        while True:
            with trio.move_on_after(RECONCILE_S):
                await self._poke.wait()
            self._poke = trio.Event()
            try:
                await self.reconcile()
            except (StoreError, OwnershipError) as e:
                log.warning("reconciling sandbox ownership failed: %s", e)
            except Exception:
                log.exception("reconciling sandbox ownership failed")

    async def reconcile(self) -> None:
        own = self.ownership
        if not own.may_serve():
            return
        local = dict(self._local())
        held = {g.sid: g for g in own.held()}
        if own.epoch != self._epoch:  # a new epoch: what is here may be another's now
            self._epoch = own.epoch
            self._doubtful = set(local) - held.keys()
        self._doubtful &= local.keys()
        for sid, state in local.items():
            g = held.get(sid)
            if g is None:
                await self._claim(sid, state)
            elif g.state != state:
                try:
                    await own.update(sid, state=state)
                except NotOwner:
                    self._moved(sid, "its record was moved to another node")
        for sid in held.keys() - local.keys() - self._keep():
            await own.release(sid)
        if self._after is not None:
            await self._after()

    async def _claim(self, sid: str, state: str) -> None:
        own = self.ownership
        try:
            await own.claim(sid, state=state)
            self._doubtful.discard(sid)
        except NotServing:
            return
        except Claimed as e:
            if e.claim.node == own.node:
                # ours from before a restart (or a fence): take it up again
                try:
                    await own.take_over(sid, state=state)
                    self._doubtful.discard(sid)
                    return
                except Claimed as moved:
                    self._moved(sid, f"node {moved.claim.node} holds it now")
                    return
                except OwnershipError as other:
                    log.warning("sandbox %s: could not take up its claim: %s", sid, other)
                    return
            self._moved(sid, f"node {e.claim.node} holds it")

    def _moved(self, sid: str, why: str) -> None:
        self.conflicts += 1
        log.error("sandbox %s runs here but is not this node's (%s): stopping it", sid, why)
        self._stop(sid, why)
