"""Each sandbox's disk size, in-process: what every root is opened with.

Rules: the real node and sandbox actors on a `FakeHost` (tests/fakes/), on
trio's MockClock; `FakeRoots.disks` records the (disk size, carried bytes)
each root was opened with (the real disks are tests/storage/test_disks.py's).
A sandbox keeps its size for its whole life, whatever the node's setting
later says, and each new root counts what the layers under it hold.
"""

from __future__ import annotations

import dataclasses

import pytest
import trio.testing

from aenv.config import Config
from aenv.node.node import Node
from aenv.node.sandbox import Pause, Resume
from tests.fakes.host import FakeHost
from tests.fakes.node import AutoJump, crash, create, open_test_node

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


def disk_of(fake: FakeHost, node: Node, sandbox_id: str) -> tuple[int, int]:
    """(disk bytes, carried bytes) of the sandbox's current root."""
    actor = node.get(sandbox_id)
    return fake.roots.disks[actor.workdir / f"disk{actor._period}"]


async def test_the_disk_size_holds_through_pause_fork_and_restart(
    clock: trio.testing.MockClock, autojump: AutoJump, config: Config, fake: FakeHost
) -> None:
    config = dataclasses.replace(config, sandbox_disk_mb=1024)
    async with open_test_node(config, fake) as node:
        actor = await create(node, timeout_s=600)
        sid = actor.sandbox_id
        assert disk_of(fake, node, sid) == (1024 * MIB, 0)
        fake.runtime.get(sid).write("root/notes", "x" * 100_000)
        await actor.mailbox.ask(Pause("filesystem"))
        await actor.mailbox.ask(Resume(None))
        size, carried = disk_of(fake, node, sid)
        assert size == 1024 * MIB and carried >= 100_000  # what it wrote counts
        children = await node.fork(actor, 1, 60, wait_s=60)
        assert disk_of(fake, node, children[0].sandbox_id)[0] == 1024 * MIB
        assert disk_of(fake, node, children[0].sandbox_id)[1] >= 100_000
        await node.kill(children[0].sandbox_id)
        await actor.mailbox.ask(Pause("filesystem"))
        await trio.sleep(1)
        disk = crash(node, fake)
    disk.restore()
    # a new setting is for new sandboxes: the paused one keeps its size
    async with open_test_node(dataclasses.replace(config, sandbox_disk_mb=2048), fake) as node:
        again = node.get(sid)
        assert again.disk_mb == 1024
        assert await again.mailbox.ask(Resume(None)) is True
        assert disk_of(fake, node, sid)[0] == 1024 * MIB
        fresh = await create(node, timeout_s=600)
        assert disk_of(fake, node, fresh.sandbox_id) == (2048 * MIB, 0)
        for a in node.list():
            await node.kill(a.sandbox_id)
    assert fake.leftovers() == []


async def test_no_disk_size_means_unbounded(
    clock: trio.testing.MockClock, autojump: AutoJump, config: Config, fake: FakeHost
) -> None:
    async with open_test_node(dataclasses.replace(config, sandbox_disk_mb=0), fake) as node:
        actor = await create(node, timeout_s=600)
        assert disk_of(fake, node, actor.sandbox_id) == (0, 0)
        await node.kill(actor.sandbox_id)
