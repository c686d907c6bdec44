"""Sandboxes paused in memory: copy on disk, hibernation, memory pressure, in-process.

Rules: the real node and sandbox actors on a `FakeHost` (tests/fakes/), on
trio's MockClock, with the fake runsc's `Timings` (checkpoint 0.25 s, stop
0.125 s, restore 0.25 s, freeze and thaw instant); the node's settings are
`node_config`'s (write-behind after 30 s, hibernation after 60 s) unless a
test says otherwise. The host's available memory is `FakeMemory`: what the
test sets free, less what the runtime's sandboxes hold.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from aenv.config import Config
from aenv.kit.supervisor import SupervisorStatistics
from aenv.node.node import Node
from aenv.node.sandbox import Pause, Resume, SandboxActor
from aenv.proto import lifecycle as lc
from tests.fakes.host import GIB, FakeHost
from tests.fakes.node import AutoJump, create, node_config, open_test_node
from tests.fakes.runtime import Guest, Timings

T = Timings()

pytestmark = pytest.mark.timeout(60)


def ops_since(fake: FakeHost, sandbox_id: str, at: float) -> list[tuple[str, float]]:
    return [(c.op, c.at) for c in fake.runtime.calls if c.sandbox_id == sandbox_id and c.at >= at]


async def paused_in_memory(node: Node, fake: FakeHost) -> SandboxActor:
    actor = await create(node, timeout_s=600)
    fake.runtime.get(actor.sandbox_id).write("root/notes", "written before the pause")
    await actor.mailbox.ask(Pause("full"))
    assert actor.frozen_pause
    return actor


async def test_paused_in_memory_it_gets_a_copy_on_disk_and_hibernates_from_it(
    clock: trio.testing.MockClock, autojump: AutoJump, node: Node, fake: FakeHost
) -> None:
    actor = await paused_in_memory(node, fake)
    paused = trio.current_time()
    record = node.meta.store.get_sandbox(actor.sandbox_id)
    assert record is not None and record["state"] == "frozen" and "durableImage" not in record
    await trio.sleep_until(paused + 31)
    # 30 s after the pause: its memory image, taken while it stays frozen
    assert ops_since(fake, actor.sandbox_id, paused) == [
        ("freeze", paused),
        ("checkpoint_frozen", paused + 30),
    ]
    assert fake.runtime.get(actor.sandbox_id).state is Guest.PAUSED  # still stopped
    frozen = node.meta.store.get_sandbox(actor.sandbox_id)
    assert frozen is not None and frozen["state"] == "frozen"
    copy = actor.workdir / frozen["durableImage"]
    assert copy.is_dir() and frozen["durableLayers"]
    assert actor.paused_in_memory
    # 60 s after the pause: written to disk, reusing that copy (no second checkpoint)
    await autojump.until(lambda: actor.on_disk)
    assert trio.current_time() == paused + 60 + T.stop_s
    assert ops_since(fake, actor.sandbox_id, paused + 31) == [
        ("thaw", paused + 60),
        ("stop", paused + 60),
    ]
    record = node.meta.store.get_sandbox(actor.sandbox_id)
    assert record is not None and record["state"] == "paused"
    assert record["image"] == copy.name and record["layers"] == frozen["durableLayers"]
    assert not actor.paused_in_memory and actor.unfrozen.is_set()
    assert await actor.mailbox.ask(Resume(None)) is True
    restored = fake.runtime.get(actor.sandbox_id)
    assert restored.restored_from == copy
    assert fake.roots.read(restored.spec.rootfs, "root/notes") == "written before the pause"


async def test_without_write_behind_hibernation_checkpoints(
    clock: trio.testing.MockClock,
    autojump: AutoJump,
    tmp_path: Path,
    fake: FakeHost,
) -> None:
    async with open_test_node(node_config(tmp_path, write_behind_s=0.0), fake) as node:
        actor = await paused_in_memory(node, fake)
        paused = trio.current_time()
        await autojump.until(lambda: actor.on_disk)
        assert trio.current_time() == paused + 60 + T.checkpoint_s + T.stop_s
        assert ops_since(fake, actor.sandbox_id, paused) == [
            ("freeze", paused),
            ("thaw", paused + 60),
            ("checkpoint", paused + 60),
            ("stop", paused + 60 + T.checkpoint_s),
        ]


async def test_a_resume_drops_the_copy_on_disk(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    actor = await paused_in_memory(node, fake)
    await trio.sleep(45)
    record = node.meta.store.get_sandbox(actor.sandbox_id)
    assert record is not None
    copy = actor.workdir / record["durableImage"]
    assert copy.is_dir()
    assert await actor.mailbox.ask(Resume(None)) is True  # a thaw
    assert not copy.exists()
    record = node.meta.store.get_sandbox(actor.sandbox_id)
    assert record is not None and record["state"] == "running" and "durableImage" not in record


async def test_a_failed_hibernation_keeps_it_paused_in_memory(
    clock: trio.testing.MockClock,
    autojump: AutoJump,
    tmp_path: Path,
    fake: FakeHost,
) -> None:
    async with open_test_node(node_config(tmp_path, write_behind_s=0.0), fake) as node:
        actor = await paused_in_memory(node, fake)
        paused = trio.current_time()
        banked = actor.lifecycle.remaining
        fake.runtime.faults.fail_next("checkpoint")
        await trio.sleep_until(paused + 61)
        assert actor.state is lc.State.PAUSED and actor.frozen_pause
        assert actor.lifecycle.remaining == banked  # the failed attempt cost no time
        assert fake.runtime.get(actor.sandbox_id).state is Guest.FROZEN
        record = node.meta.store.get_sandbox(actor.sandbox_id)
        assert record is not None and record["state"] == "frozen"
        assert list(actor.workdir.glob("image*")) == []
        # tried again a hibernation period later
        retry = paused + 60 + T.checkpoint_s
        await autojump.until(lambda: actor.on_disk)
        assert trio.current_time() == retry + 60 + T.checkpoint_s + T.stop_s


async def test_memory_pressure_hibernates_the_longest_paused_until_enough_is_free(
    clock: trio.testing.MockClock,
    autojump: AutoJump,
    tmp_path: Path,
    fake: FakeHost,
) -> None:
    config = node_config(tmp_path, hibernate_memory_low_pct=10.0)
    async with open_test_node(config, fake) as node:
        first = await paused_in_memory(node, fake)
        second = await paused_in_memory(node, fake)
        for actor in (first, second):
            fake.runtime.get(actor.sandbox_id).memory_bytes = 2 * GIB
        await trio.sleep_until(5.5)
        assert first.frozen_pause and second.frozen_pause
        # 3 GiB of 32 available (below 10 %): 1.8 GiB short of the 15 % high mark
        fake.memory.free = 7 * GIB
        await autojump.until(lambda: first.on_disk)
        # the watcher looks once a second (from the node's start, at 0)
        assert trio.current_time() == 6 + T.checkpoint_s + T.stop_s
        assert ops_since(fake, first.sandbox_id, 6) == [
            ("thaw", 6),
            ("checkpoint", 6),
            ("stop", 6 + T.checkpoint_s),
        ]
        await trio.sleep(30)  # 5 GiB available now: the other one stays in memory
        assert second.frozen_pause and second.paused_in_memory
        assert fake.runtime.get(second.sandbox_id).state is Guest.PAUSED  # its copy on disk
        assert fake.memory.reads[:7] == [1, 2, 3, 4, 5, 6, 7 + T.checkpoint_s + T.stop_s]


async def test_the_memory_watcher_is_restarted_after_failures(
    clock: trio.testing.MockClock,
    autojump: AutoJump,
    tmp_path: Path,
    fake: FakeHost,
) -> None:
    config = node_config(tmp_path, hibernate_memory_low_pct=10.0)
    fake.memory.failures = 2
    async with open_test_node(config, fake) as node:
        actor = await paused_in_memory(node, fake)
        fake.runtime.get(actor.sandbox_id).memory_bytes = 2 * GIB
        fake.memory.free = 4 * GIB
        await autojump.until(lambda: actor.on_disk)
        # fails at 1 (restarted 1 s later), at 3 (restarted 2 s later); then works
        assert fake.memory.reads[:3] == [1, 3, 6]
        assert trio.current_time() == 6 + T.checkpoint_s + T.stop_s
        assert node.services is not None
        assert node.services.statistics() == SupervisorStatistics(
            running=1, restarts=2, failures=2, failed=0
        )


async def test_a_memory_watcher_that_keeps_failing_is_given_up_and_the_node_runs_on(
    clock: trio.testing.MockClock,
    autojump: AutoJump,
    tmp_path: Path,
    fake: FakeHost,
) -> None:
    config: Config = node_config(tmp_path, hibernate_memory_low_pct=10.0)
    fake.memory.failures = 1000
    async with open_test_node(config, fake) as node:
        assert node.services is not None
        await autojump.until(
            lambda: node.services is not None and node.services.statistics().failed == 1
        )
        # restarted after 1, 2, 4, 8 and 16 s; the sixth failure (at 37) is the last
        assert fake.memory.reads == [1, 3, 6, 11, 20, 37]
        assert trio.current_time() == 37
        assert node.services.statistics() == SupervisorStatistics(
            running=0, restarts=5, failures=6, failed=1
        )
        actor = await create(node)
        assert actor.state is lc.State.RUNNING
