"""An in-process node on the scripted host, under trio's MockClock.

`open_test_node(config, fake)` does what `aenv.node.node.open_node` does, on
a `FakeHost` (no images): the real `Node` and sandbox actors, journal in
SQLite, layers on disk. Time is trio's `MockClock`, advanced by
`AutoJump`: like pytest-trio's `autojump_clock`, but it jumps only while
no worker thread runs (SQLite writes, layer copies and fsyncs run in threads;
trio's own autojump would jump over them, firing timers that real time would
not reach), so times asserted with `trio.current_time()` are exact.

A crash is `crash(node, fake)`: the host keeps whatever the node process held
(its sandboxes run on, slots and roots stay) and the node's disk is kept as
it was at that moment (what the dying process's tasks remove on their way
out is put back by `DiskAtCrash.restore`), so the next `open_test_node` takes
back exactly what a restarted node would find.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio
import trio.testing

from aenv.config import Config
from aenv.node.node import Node, adoptable_slots, open_node_on, reap_leftovers
from aenv.node.sandbox import SandboxActor
from aenv.proto.requests import NewSandbox
from aenv.storage.metadata import MetadataStore
from aenv.storage.templates import TemplateStore
from tests.fakes.host import FakeHost, NoImages

T = TypeVar("T")

TEMPLATE = "base"


class Threads:
    """Worker threads in flight (`trio.to_thread.run_sync` calls not yet answered)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.idle = trio.Event()
        self.idle.set()

    def counting(self, run_sync: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        """`run_sync`, counted (monkeypatched over `trio.to_thread.run_sync`)."""

        async def counted(*args: Any, **kwargs: Any) -> T:
            if self.in_flight == 0:
                self.idle = trio.Event()
            self.in_flight += 1
            try:
                return await run_sync(*args, **kwargs)
            finally:
                self.in_flight -= 1
                if self.in_flight == 0:
                    self.idle.set()

        return counted


class AutoJump:
    """Advances a MockClock to the next deadline whenever every task waits and
    no worker thread runs; `until(predicate)` wakes a waiter as soon as its
    predicate holds once everything waits, before the clock moves on."""

    def __init__(self, clock: trio.testing.MockClock) -> None:
        self.clock = clock
        self.threads = Threads()
        self._waiters: list[tuple[Callable[[], bool], trio.Event]] = []

    async def run(self) -> None:
        while True:
            await trio.testing.wait_all_tasks_blocked()
            if self.threads.in_flight:
                await self.threads.idle.wait()
                continue
            ready = [w for w in self._waiters if w[0]()]
            if ready:
                for waiter in ready:
                    self._waiters.remove(waiter)
                    waiter[1].set()
                continue
            jump = trio.lowlevel.current_statistics().seconds_to_next_deadline
            if 0 < jump < math.inf:
                self.clock.jump(jump)
            elif jump == math.inf:  # nothing can happen any more: the test's timeout ends it
                await trio.testing.wait_all_tasks_blocked(cushion=0.01)

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Wait, without moving the clock by itself, until `predicate()` holds."""
        if predicate():
            await trio.lowlevel.checkpoint()
            return
        event = trio.Event()
        self._waiters.append((predicate, event))
        await event.wait()


def node_config(tmp_path: Path, **changes: Any) -> Config:
    """A node home in `tmp_path` with one template, `base` (a file in its root)."""
    home = tmp_path / "home"
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "os-release").write_text("fake\n")
    TemplateStore(home / "templates").add(template_id=TEMPLATE, rootfs_dir=rootfs)
    settings: dict[str, Any] = {
        "store_url": "none",
        "warm_templates": False,
        "pool_size": 0,
        "hibernate_memory_low_pct": 0,
        "hibernate_after_s": 60.0,
        "write_behind_s": 30.0,
        "node_tag": "t",
    }
    return Config(home=home, **{**settings, **changes})


@asynccontextmanager
async def open_test_node(config: Config, fake: FakeHost) -> AsyncIterator[Node]:
    """What `open_node` does, on `fake` (no images)."""
    for d in (config.home, config.sandboxes_dir, config.run_dir):
        d.mkdir(parents=True, exist_ok=True)
    live = await reap_leftovers(config, runtime=fake.runtime, roots=fake.roots)
    fake.network.restart(adoptable_slots(live))
    node: Node | None = None
    try:
        async with open_node_on(fake.host(), config, images=NoImages(), api_key="k") as node:
            yield node
    finally:
        if node is not None:
            node.meta.store.close()


def new(timeout_s: int = 60, **kw: Any) -> NewSandbox:
    return NewSandbox(template=TEMPLATE, timeout_s=timeout_s, **kw)


async def create(node: Node, timeout_s: int = 60, **kw: Any) -> SandboxActor:
    return await node.create(new(timeout_s, **kw))


@dataclass
class DiskAtCrash:
    """A node's disk as it was when its process died."""

    config: Config
    records: list[dict[str, Any]]
    sandboxes: Path

    def restore(self) -> None:
        """Put the disk back as it was at the crash (after the dead node's tasks ended)."""
        store = MetadataStore(self.config.home / "aenv.db")
        try:
            for doc in store.list_sandboxes():
                store.delete_sandbox(str(doc["sandboxID"]))
            for doc in self.records:
                store.put_sandbox(str(doc["sandboxID"]), str(doc["state"]), doc, 0.0)
        finally:
            store.close()
        shutil.rmtree(self.config.sandboxes_dir)
        shutil.copytree(self.sandboxes, self.config.sandboxes_dir, symlinks=True)


def crash(node: Node, fake: FakeHost) -> DiskAtCrash:
    """The node process dies now (see the module docstring); leave its block next."""
    copy = node.config.home.parent / f"crash-{trio.current_time():.3f}"
    shutil.copytree(node.config.sandboxes_dir, copy, symlinks=True)
    fake.crash()
    return DiskAtCrash(node.config, node.meta.store.list_sandboxes(), copy)
