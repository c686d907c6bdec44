"""Forks: start a running sandbox's children from its live capture.

The parent's actor captures itself (`Fork`, answered with a `LiveCapture`;
the parent is held only for that) and runs on; this workflow, which the
node runs as a supervised one-shot job (`aenv.kit.supervisor.Supervisor.run`),
then starts the children, each restoring the capture's memory image over its
layer stack into a sandbox of its own, and removes the image once every
child has restored from it (or failed). Its dependencies are passed in: how
to reserve a new sandbox ID and how to launch an actor.

The children's network slots do not depend on the capture: `SlotPrefetch`
opens them while the parent is captured, and each child takes one over
(`SandboxActor.given_slot`); a child whose slot could not be opened ahead
opens its own, and slots nobody took are deleted.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import trio

from aenv.kit.faults import crash_point
from aenv.node.host import NetworkSlots
from aenv.node.sandbox import GivenSlot, LiveCapture, SandboxActor
from aenv.proto.netpolicy import EgressPolicy

log = logging.getLogger("aenv.forks")


class SlotPrefetch:
    """Network slots opened for a fork's `count` children ahead of their start
    (`open(i)` for each, in a nursery); `take(i)` hands slot i over (None: it
    could not be opened, the child opens its own), `aclose` deletes the rest."""

    def __init__(self, network: NetworkSlots, policy: EgressPolicy, count: int) -> None:
        self._network, self._policy = network, policy
        self._ready = [trio.Event() for _ in range(count)]
        self._slots: list[GivenSlot | None] = [None] * count
        self._closed = False

    async def open(self, i: int) -> None:
        owner = AsyncExitStack()
        try:
            slot = await owner.enter_async_context(self._network.open_slot(self._policy))
            self._slots[i] = GivenSlot(slot, owner)
        except Exception as exc:  # (a cancellation goes on) the child tries itself
            log.info("a fork child's network slot could not be opened ahead: %r", exc)
        finally:
            self._ready[i].set()
        if self._closed:  # nobody takes it any more
            await self.aclose()

    async def take(self, i: int) -> GivenSlot | None:
        await self._ready[i].wait()
        given, self._slots[i] = self._slots[i], None
        return given

    async def aclose(self) -> None:
        """Delete the slots nobody took (and those opened from now on)."""
        self._closed = True
        for i, given in enumerate(self._slots):
            self._slots[i] = None
            if given is not None:
                with trio.CancelScope(shield=True):
                    await given.owner.aclose()


async def start_children(
    parent: SandboxActor,
    capture: LiveCapture,
    *,
    count: int,
    timeout_s: int,
    reserve: Callable[[], str],
    launch: Callable[[SandboxActor], Awaitable[SandboxActor]],
    slots: SlotPrefetch | None = None,
) -> list[SandboxActor | Exception]:
    """Start `count` children of `parent` from `capture`, at once; one result per
    child, in order: the running child, or why it could not start.

    `reserve()` is a new sandbox ID (or raises, the node being full) and
    `launch(actor)` starts an actor and returns it once it runs; child i
    takes slot i of `slots`, if given.
    """
    image = capture.image
    assert image is not None, "a fork's capture has a memory image"
    results: list[SandboxActor | Exception] = [
        RuntimeError("fork not attempted") for _ in range(count)
    ]

    async def one(i: int) -> None:
        child: SandboxActor | None = None
        try:
            sandbox_id = reserve()
            given = await slots.take(i) if slots is not None else None
            child = SandboxActor.fork_of(parent, sandbox_id, image, capture.stack, timeout_s)
            child.given_slot = given
            results[i] = await launch(child)
        except Exception as exc:
            log.warning("fork %d of %s failed: %r", i, parent.sandbox_id, exc)
            results[i] = exc
        finally:
            # a child that never started its run leaves its slot to us
            if child is not None and child.given_slot is not None:
                with trio.CancelScope(shield=True):
                    await child.given_slot.owner.aclose()
                child.given_slot = None

    try:
        async with trio.open_nursery() as n:
            for i in range(count):
                n.start_soon(one, i)
        crash_point("fork.children-started")
    finally:
        # every child has restored from it (or failed): the image has done its work
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(shutil.rmtree, image, True)
    return results
