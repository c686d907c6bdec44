"""A pool of restored sandboxes per hot template: create becomes an assignment.

For a template that is a snapshot (`aenv.node.warm`) and was asked for twice
within `hot_for_s` seconds, the pool keeps sandboxes restored from that
snapshot, hidden, with envd up, their processes frozen (no CPU). How many is
`aenv.proto.poolsize`'s decision: the template's recent demand (the biggest
burst of creates lately, decaying; the create rate), at least
`AENV_POOL_SIZE` while hot, at most `AENV_POOL_MAX`, all templates' members
together within what the node's memory and sandbox limit allow. A create of
that template with the template's default size takes one (`take`,
synchronous, so no sandbox is ever handed out twice) and the sandbox adopts
the caller's request (ID stays, tokens, env, metadata, network policy and
timeout become the caller's), then the pool refills in the background.
Members beyond what demand asks for now, and all of a template that went
cold, are killed.

Refilling must not slow the creates it serves: at most
`AENV_POOL_REFILL_CONCURRENCY` restores run at once across all templates,
and each waits (up to `QUIET_MAX_S`) until no create is in flight (`serving`).

Each template's filler is a child of the node's `services` supervisor:
one that fails (a restore that does not work) is restarted with backoff
(`FILLER_RESTARTS`), then given up on, logged, and not started again for
that template for `GIVE_UP_FOR_S`; creates boot or restore meanwhile.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import trio

from aenv.kit.supervisor import (
    ChildHandle,
    RestartPolicy,
    StopToken,
    Strategy,
    Supervisor,
)
from aenv.node.launcher import Launcher
from aenv.node.pressure import MARGIN_PCT
from aenv.node.sandbox import SandboxActor
from aenv.node.snapshots import Snapshots, snapshot_name
from aenv.proto import lifecycle as lc
from aenv.proto.poolsize import PoolLimits, PoolPolicy, memory_budget
from aenv.storage.templates import Template

log = logging.getLogger("aenv.pool")

MEMBER_TIMEOUT_S = 24 * 3600
# a filler that fails is restarted after about 5, 10 and 20 s; a fourth failure
# within 10 minutes gives it up for GIVE_UP_FOR_S
FILLER_RESTARTS = RestartPolicy(max_restarts=3, window_s=600.0, backoff_base_s=5.0)
GIVE_UP_FOR_S = 600.0
# A refill waits at most this long for the creates in flight to finish.
QUIET_MAX_S = 1.0
# How often a filler looks at its target without a take (demand decays).
RECHECK_S = 10.0
# What one frozen member is assumed to hold of host memory (an idle restored
# sandbox measured ~35 MiB) for the memory bound.
MEMBER_BYTES = 48 << 20


class Pool:
    def __init__(
        self,
        snapshots: Snapshots,
        launcher: Launcher,
        services: Supervisor,
        *,
        limits: PoolLimits,
        refill_concurrency: int = 2,
        room: Callable[[], int] = lambda: 1 << 30,
        meminfo: Callable[[], tuple[int, int]] | None = None,
        memory_low_pct: float = 10.0,
    ) -> None:
        self._snapshots = snapshots
        self._launcher = launcher
        self._services = services
        self.policy = PoolPolicy(limits)
        self.enabled = limits.min_size > 0 and limits.max_size > 0
        self._concurrency = max(1, refill_concurrency)
        self._limiter = trio.CapacityLimiter(self._concurrency)
        self._room = room  # how many more sandboxes the node may hold
        self._meminfo = meminfo
        self._memory_low_pct = memory_low_pct
        self._ready: dict[str, collections.deque[SandboxActor]] = {}
        self._pending: dict[str, int] = {}  # restores under way, per template
        self._fillers: dict[str, ChildHandle[None]] = {}  # the latest of each template
        self._wake: dict[str, trio.Event] = {}
        self._in_flight = 0
        self._idle = trio.Event()
        self._idle.set()

    def take(self, template: Template) -> SandboxActor | None:
        """A ready sandbox of `template`, now the caller's; None if there is none.

        Also counts the create as demand, so the pool (re)fills for it.
        """
        if not self.enabled:
            return None
        key = snapshot_name(template)
        self.policy.created(key, trio.current_time())
        queue = self._ready.setdefault(key, collections.deque())
        found = None
        while queue:
            actor = queue.popleft()
            if actor.pooled and actor.state is lc.State.RUNNING:
                found = actor
                break
        if found is None:
            self.replenish(template)
        return found

    def replenish(self, template: Template) -> None:
        """Refill the template's queue (after a take: once the taken one is handed over,
        so its adoption does not compete with a restore for the CPU)."""
        if not self.enabled:
            return
        self._poke(snapshot_name(template))
        self._refill(template)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """A create is in flight for the block: refills wait for it (`QUIET_MAX_S`)."""
        if self._in_flight == 0:
            self._idle = trio.Event()
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    def statistics(self) -> dict[str, int]:
        """Ready members per template."""
        return {key: len(q) for key, q in self._ready.items()}

    def targets(self) -> dict[str, int]:
        """What each template's queue is being filled to now."""
        return self.policy.targets(trio.current_time(), self._budget())

    def _budget(self) -> int:
        """How many members all templates together may hold now."""
        held = sum(len(q) for q in self._ready.values()) + sum(self._pending.values())
        budget = held + max(0, self._room())
        if self._meminfo is not None:
            try:
                available, total = self._meminfo()
            except (OSError, KeyError, ValueError):  # no MemAvailable: the other bounds only
                return budget
            budget = min(
                budget,
                memory_budget(
                    available=available,
                    total=total,
                    low_pct=self._memory_low_pct,
                    margin_pct=MARGIN_PCT,
                    member_bytes=MEMBER_BYTES,
                    held=held,
                ),
            )
        return budget

    def _target(self, key: str) -> int:
        return self.targets().get(key, 0)

    def _poke(self, key: str) -> None:
        if (wake := self._wake.get(key)) is not None:
            wake.set()

    def _refill(self, template: Template) -> None:
        key = snapshot_name(template)
        filler = self._fillers.get(key)
        if filler is not None and filler.busy_or_resting(GIVE_UP_FOR_S):
            return  # filling (or backing off), or given up on lately
        self._fillers[key] = self._services.start_soon(
            f"pool {key}",
            functools.partial(self._fill, template),
            policy=FILLER_RESTARTS,
            give_up=Strategy.FAIL,
            grace_s=0.0,
        )

    async def _quiet(self) -> None:
        """Yield to the creates in flight (a restore competes with them for the CPU)."""
        with trio.move_on_after(QUIET_MAX_S):
            while self._in_flight:
                await self._idle.wait()

    async def _fill(self, template: Template, _stop: StopToken) -> None:
        """Keep the template's queue at its target while it is hot; empty it once
        it is cold. A failure is raised to the supervisor (which restarts the filler)."""
        key = snapshot_name(template)
        queue = self._ready.setdefault(key, collections.deque())
        try:
            async with trio.open_nursery() as nursery:
                while self.policy.hot(key, trio.current_time()):
                    wake = self._wake[key] = trio.Event()
                    target = self._target(key)
                    while len(queue) > target:  # demand fell: release the newest
                        nursery.start_soon(queue.pop().stop)
                    pending = self._pending.get(key, 0)
                    if len(queue) + pending < target and pending < self._concurrency:
                        doc = await self._snapshots.resolve(key)
                        if doc is None:
                            return  # the template is no snapshot (any more)
                        self._pending[key] = pending + 1
                        nursery.start_soon(self._restore_one, doc, template, key, queue)
                        continue
                    with trio.move_on_after(RECHECK_S):
                        await wake.wait()  # a take, a restore done, or time to look again
        finally:
            self._pending.pop(key, None)
            if not self.policy.hot(key, trio.current_time()):
                with trio.CancelScope(shield=True):
                    while queue:
                        await queue.popleft().stop()

    async def _restore_one(
        self,
        doc: dict[str, Any],
        template: Template,
        key: str,
        queue: collections.deque[SandboxActor],
    ) -> None:
        try:
            await self._quiet()
            async with self._limiter:
                await self._quiet()  # (creates may have arrived while it waited its turn)
                t0 = trio.current_time()
                actor = await self._launcher.restore_hidden(
                    doc, template, timeout_s=MEMBER_TIMEOUT_S, pooled=True
                )
                try:
                    await actor.freeze_pooled()
                except BaseException:
                    await actor.stop()
                    raise
                self.policy.refilled(trio.current_time() - t0)
            queue.append(actor)
        finally:
            self._pending[key] = max(0, self._pending.get(key, 0) - 1)
            self._poke(key)
