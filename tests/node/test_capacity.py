"""How many sandboxes a node takes: `max_sandboxes` counts those in memory, and
a host short of memory with nothing left to hibernate takes no more.

Rules: the real node, its actors and `LocalSandboxService` on a `FakeHost`
(tests/fakes/), on trio's MockClock; hibernation after 60 s of pause. A
refusal is `Busy` (503 with Retry-After at the API) and changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from aenv.config import Config
from aenv.kit.mailbox import Busy
from aenv.node.node import Node
from aenv.node.sandbox import Pause, SandboxActor
from aenv.node.service import Busy as ServiceBusy
from aenv.node.service import LocalSandboxService
from tests.fakes.host import GIB, FakeHost
from tests.fakes.node import AutoJump, create, node_config, open_test_node

pytestmark = pytest.mark.timeout(60)


async def hibernated(node: Node, autojump: AutoJump) -> SandboxActor:
    actor = await create(node, timeout_s=3600)
    await actor.mailbox.ask(Pause("full"))
    await autojump.until(lambda: actor.on_disk)
    return actor


async def test_hibernated_sandboxes_leave_room_under_the_limit(
    clock: trio.testing.MockClock, autojump: AutoJump, tmp_path: Path, fake: FakeHost
) -> None:
    async with open_test_node(node_config(tmp_path, max_sandboxes=2), fake) as node:
        service = LocalSandboxService(node)
        first = await hibernated(node, autojump)
        second = await hibernated(node, autojump)
        running = [await create(node), await create(node)]  # the two on disk do not count
        assert node.in_memory() == 2 and len(node.list()) == 4
        with pytest.raises(Busy, match="sandbox limit reached: 2 in memory"):
            await create(node)
        # resuming one from disk would take memory again: refused, still paused on disk
        with pytest.raises(ServiceBusy, match="sandbox limit reached"):
            await service.resume(first.sandbox_id, 60)
        with pytest.raises(ServiceBusy):
            await service.connect(second.sandbox_id, 60)
        assert first.on_disk and second.on_disk
        assert first.state.value == "paused" and second.state.value == "paused"
        # a sandbox stops: room for the resume
        await service.kill(running[0].sandbox_id)
        await service.resume(first.sandbox_id, 60)
        assert first.state.value == "running"
        assert node.in_memory() == 2


async def test_a_sandbox_paused_in_memory_resumes_at_the_limit(
    clock: trio.testing.MockClock, autojump: AutoJump, tmp_path: Path, fake: FakeHost
) -> None:
    async with open_test_node(node_config(tmp_path, max_sandboxes=1), fake) as node:
        actor = await create(node, timeout_s=600)
        await actor.mailbox.ask(Pause("full"))
        assert actor.frozen_pause and not actor.on_disk
        with pytest.raises(Busy):
            await create(node)
        await LocalSandboxService(node).resume(actor.sandbox_id, 60)  # it holds its memory
        assert actor.state.value == "running"


async def test_a_host_short_of_memory_takes_no_new_sandbox(
    clock: trio.testing.MockClock, autojump: AutoJump, tmp_path: Path, fake: FakeHost
) -> None:
    config = node_config(tmp_path, hibernate_memory_low_pct=10.0)
    async with open_test_node(config, fake) as node:
        # refused below half the 10 % mark: 1.6 GiB of 32; above it until a
        # sandbox takes its 64 MiB (between the two marks creates go on)
        fake.memory.free = int(1.6 * GIB) + 32 * 2**20
        one = await create(node, timeout_s=600)
        await trio.sleep(1)  # the memory watcher reads once a second
        with pytest.raises(Busy, match="host memory low"):
            await create(node)
        assert len(node.list()) == 1
        # something paused in memory: the watcher hibernates it, so creates go on
        await one.mailbox.ask(Pause("full"))
        two = await create(node, timeout_s=600)
        await autojump.until(lambda: one.on_disk)
        assert two.state.value == "running"
        await trio.sleep(1)
        with pytest.raises(Busy, match="host memory low"):  # short again, nothing frozen
            await create(node)
        # a kernel that does not say: the limit alone decides
        fake.memory.failures = 1
        # (the watcher's next read, in a worker thread: a create that makes no thread
        # hop of its own before its check, as a pool hit, must not overtake it)
        await autojump.until(lambda: node.memory_seen is None)
        await create(node)


def test_the_limit_is_read_from_the_environment(tmp_path: Path) -> None:
    home = {"AENV_HOME": str(tmp_path)}
    assert Config.from_env(home).max_sandboxes == 1024
    assert Config.from_env({**home, "AENV_MAX_SANDBOXES": "600"}).max_sandboxes == 600
    with pytest.raises(ValueError, match="AENV_MAX_SANDBOXES must be at least 1"):
        Config.from_env({**home, "AENV_MAX_SANDBOXES": "0"})
