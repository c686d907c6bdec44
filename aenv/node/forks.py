"""Forks: start a running sandbox's children from its live capture.

The parent's actor captures itself (`Fork`, answered with a `LiveCapture`;
the parent is held only for that) and runs on; this workflow, which the
node runs as a supervised one-shot job (`aenv.kit.supervisor.Supervisor.run`),
then starts the children, each restoring the capture's memory image over its
layer stack into a sandbox of its own, and removes the image once every
child has restored from it (or failed). Its dependencies are passed in: how
to reserve a new sandbox ID and how to launch an actor.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Awaitable, Callable

import trio

from aenv.kit.faults import crash_point
from aenv.node.sandbox import LiveCapture, SandboxActor

log = logging.getLogger("aenv.forks")


async def start_children(
    parent: SandboxActor,
    capture: LiveCapture,
    *,
    count: int,
    timeout_s: int,
    reserve: Callable[[], str],
    launch: Callable[[SandboxActor], Awaitable[SandboxActor]],
) -> list[SandboxActor | Exception]:
    """Start `count` children of `parent` from `capture`, at once; one result per
    child, in order: the running child, or why it could not start.

    `reserve()` is a new sandbox ID (or raises, the node being full) and
    `launch(actor)` starts an actor and returns it once it runs.
    """
    image = capture.image
    assert image is not None, "a fork's capture has a memory image"
    results: list[SandboxActor | Exception] = [
        RuntimeError("fork not attempted") for _ in range(count)
    ]

    async def one(i: int) -> None:
        try:
            child = SandboxActor.fork_of(parent, reserve(), image, capture.stack, timeout_s)
            results[i] = await launch(child)
        except Exception as exc:
            log.warning("fork %d of %s failed: %r", i, parent.sandbox_id, exc)
            results[i] = exc

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
