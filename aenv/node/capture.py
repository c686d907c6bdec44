"""A sandbox's memory images and file layers: the work of pausing, hibernating,
copying behind, snapshotting and forking, with its dependencies passed in.

The sandbox actor (`aenv.node.sandbox`) decides when and applies the
lifecycle; these functions do the work on what they are given: the runtime
sandbox (`RunningSandbox`), the node's `LayerStore`, the running period's
upper directory and the layer stack it stands on, and where the image goes.
An image is written beside its path and renamed once whole
(`checkpoint_image`): a failure leaves no partial image, a crash leaves none
under an image's name. Layer stacks are kept shallow (`LayerStore.limit_depth`).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from aenv.kit.faults import crash_point
from aenv.kit.files import fsync_tree
from aenv.runtimes.base import RunningSandbox
from aenv.storage.layers import Captured, LayerStack, LayerStore

log = logging.getLogger("aenv.capture")


class Phases:
    """Where a step's time went, for its log line: `mark(name)` ends a phase."""

    def __init__(self) -> None:
        self._t0 = self._last = time.perf_counter()
        self._spans: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self._spans.append((name, now - self._last))
        self._last = now

    async def timed(self, name: str, step: Awaitable[object]) -> None:
        """Await `step`, noting its duration (steps run at once are noted so)."""
        t0 = time.perf_counter()
        await step
        self._spans.append((name, time.perf_counter() - t0))

    def skip(self) -> None:
        """The time since the last mark was noted by `timed` steps: no phase of its own."""
        self._last = time.perf_counter()

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {1000 * s:.0f}" for name, s in self._spans)
        return f"{1000 * (self._last - self._t0):.0f} ms ({parts})"


async def checkpoint_image(
    running: RunningSandbox, image: Path, *, leave_running: bool = True, frozen: bool = False
) -> None:
    """Checkpoint `running` into `image` (of a frozen sandbox, which stays
    frozen, with `frozen`): staged beside it, renamed once whole."""
    tmp = image.with_suffix(".tmp")
    await trio.to_thread.run_sync(shutil.rmtree, tmp, True)
    tmp.mkdir(parents=True)
    try:
        if frozen:
            await running.checkpoint_frozen(tmp)
        else:
            await running.checkpoint(tmp, leave_running=leave_running)
    except BaseException:  # a partial image is no use to anyone: it goes
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(shutil.rmtree, tmp, True)
        raise
    tmp.rename(image)


async def freeze_upper(
    layers: LayerStore, upper: Path, *, below: LayerStack, fault: str
) -> LayerStack:
    """The stack of a sandbox whose root was unmounted: its `upper` frozen into
    a layer over `below` (`fault`: the crash point right after the freeze)."""
    layer = await layers.freeze(upper, below=below)
    crash_point(fault)
    return await layers.limit_depth(layers.chain(layer))


async def capture_files(
    layers: LayerStore,
    upper: Path,
    *,
    below: LayerStack,
    since: Captured | None,
    sync: bool = True,
) -> Captured:
    """What the mounted `upper` changed since the previous capture (`since`;
    None: all of it, over `below`), as a new layer; nothing may write to it.
    Without `sync` the layer is not flushed yet (`LayerStore.sync`)."""
    captured = await layers.capture(upper, below=below, since=since, sync=sync)
    stack = await layers.limit_depth(captured.stack)
    return dataclasses.replace(captured, stack=stack)


async def write_behind(
    running: RunningSandbox,
    layers: LayerStore,
    upper: Path,
    *,
    below: LayerStack,
    since: Captured | None,
    image: Path,
) -> Captured:
    """A copy on disk of a frozen sandbox, which stays frozen: its memory in
    `image` and what its files changed, flushed. Raises, leaving no image,
    if it could not be written."""
    try:
        await checkpoint_image(running, image, frozen=True)
        captured = await capture_files(layers, upper, below=below, since=since)
        await trio.to_thread.run_sync(fsync_tree, image)
    except BaseException:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(shutil.rmtree, image, True)
        raise
    return captured


async def capture_live(
    running: RunningSandbox,
    layers: LayerStore,
    upper: Path,
    *,
    below: LayerStack,
    since: Captured | None,
    image: Path | None,
    fault: str,
    then: Callable[[Captured], None],
    durable: bool = False,
    phases: Phases | None = None,
) -> Captured:
    """Capture a running sandbox without stopping it: held (its processes
    stopped, its runtime answering), its memory checkpointed into `image`
    (None: files only) leaving it running, what its files changed copied into
    a layer, and it is let go; then the layer is flushed (after the hold, which
    it would lengthen most under other I/O). `then(captured)` runs while it is
    still held (forks start restoring meanwhile), or with `durable` once the
    layer is flushed (a snapshot's record names it). `fault`: the crash point
    once captured."""
    mark = phases.mark if phases is not None else (lambda _: None)
    async with running.held():
        mark("hold")
        if image is not None:
            await checkpoint_image(running, image, leave_running=True)
            mark("checkpoint")
        captured = await capture_files(layers, upper, below=below, since=since, sync=False)
        mark("files")
        crash_point(fault)
        if not durable:
            then(captured)
    mark("let go")
    try:
        await layers.sync()
    except OSError:
        if durable:
            raise
        # whoever records the layer later flushes it again (and fails there)
        log.warning("flushing a captured layer failed", exc_info=True)
    mark("sync")
    if durable:
        then(captured)
    return captured
