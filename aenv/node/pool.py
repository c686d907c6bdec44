"""A pool of restored sandboxes per hot template: create becomes an assignment.

For a template that is a snapshot (`aenv.node.warm`) and was asked for twice
within `HOT_FOR_S` seconds, the pool keeps up to `size` sandboxes restored
from that snapshot, hidden, with envd up, their processes frozen (no CPU;
their memory is the pool's bound: `size` sandboxes per hot template). A
create of that template with the template's default size takes one
(`take`, synchronous, so no sandbox is ever handed out twice) and the
sandbox adopts the caller's request (ID stays, tokens, env, metadata,
network policy and timeout become the caller's), then the pool refills in
the background. Members of a template that goes cold are killed.

Each template's filler is a child of the node's `services` supervisor:
one that fails (a restore that does not work) is restarted with backoff
(`FILLER_RESTARTS`), then given up on, logged, and not started again for
that template for `GIVE_UP_FOR_S`; creates boot or restore meanwhile.
"""

from __future__ import annotations

import collections
import functools
import logging
import time

import trio

from aenv.kit.supervisor import (
    ChildHandle,
    RestartPolicy,
    StopToken,
    Strategy,
    Supervisor,
)
from aenv.node.launcher import Launcher
from aenv.node.sandbox import SandboxActor
from aenv.node.snapshots import Snapshots, snapshot_name
from aenv.proto import lifecycle as lc
from aenv.storage.templates import Template

log = logging.getLogger("aenv.pool")

HOT_FOR_S = 600.0
MEMBER_TIMEOUT_S = 24 * 3600
# a filler that fails is restarted after about 5, 10 and 20 s; a fourth failure
# within 10 minutes gives it up for GIVE_UP_FOR_S
FILLER_RESTARTS = RestartPolicy(max_restarts=3, window_s=600.0, backoff_base_s=5.0)
GIVE_UP_FOR_S = 600.0


class Pool:
    def __init__(
        self, snapshots: Snapshots, launcher: Launcher, services: Supervisor, *, size: int
    ) -> None:
        self._snapshots = snapshots
        self._launcher = launcher
        self.size = max(0, size)
        self._services = services
        self._ready: dict[str, collections.deque[SandboxActor]] = {}
        self._fillers: dict[str, ChildHandle[None]] = {}  # the latest of each template
        # when each template was last asked for (the last two times)
        self._used_at: dict[str, collections.deque[float]] = {}
        self._wake: dict[str, trio.Event] = {}

    def take(self, template: Template) -> SandboxActor | None:
        """A ready sandbox of `template`, now the caller's; None if there is none.

        Also marks the template hot, so the pool (re)fills for it.
        """
        if self.size == 0:
            return None
        key = snapshot_name(template)
        self._used_at.setdefault(key, collections.deque(maxlen=2)).append(time.monotonic())
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
        if (wake := self._wake.get(snapshot_name(template))) is not None:
            wake.set()
        self._refill(template)

    def statistics(self) -> dict[str, int]:
        return {key: len(q) for key, q in self._ready.items()}

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

    def _hot(self, key: str) -> bool:
        """Asked for twice within HOT_FOR_S: one-off templates get no pool."""
        uses = self._used_at.get(key)
        if uses is None or len(uses) < 2:
            return False
        return time.monotonic() - uses[0] < HOT_FOR_S

    async def _fill(self, template: Template, _stop: StopToken) -> None:
        """Keep the template's queue full while it is hot; empty it once it is cold.
        A failure is raised to the supervisor (which restarts the filler)."""
        key = snapshot_name(template)
        queue = self._ready.setdefault(key, collections.deque())
        try:
            while self._hot(key):
                while len(queue) < self.size and self._hot(key):
                    doc = await self._snapshots.resolve(key)
                    if doc is None:
                        return
                    actor = await self._launcher.restore_hidden(
                        doc, template, timeout_s=MEMBER_TIMEOUT_S, pooled=True
                    )
                    try:
                        await actor.freeze_pooled()
                    except BaseException:
                        await actor.stop()
                        raise
                    queue.append(actor)
                wake = self._wake[key] = trio.Event()
                with trio.move_on_after(HOT_FOR_S):
                    await wake.wait()  # a take, or time to check whether it went cold
        finally:
            if not self._hot(key):
                while queue:
                    await queue.popleft().stop()
