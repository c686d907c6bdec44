"""The journal of sandboxes and what a restarted node takes back, in-process.

Rules: the real node and sandbox actors on a `FakeHost` (tests/fakes/), on
trio's MockClock. A crash (`tests.fakes.node.crash`) leaves the host as the
dead node process held it (runtime sandboxes running or frozen, network
slots, roots) and the node's disk (journal, sandbox directories) as it was
at that moment; the next node on the same home and host takes back what the
journal names: running and frozen sandboxes with their runtime (adopted,
not restarted), paused ones from their image, and reports the rest lost.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from aenv.config import Config
from aenv.node.node import Node, SandboxNotFound
from aenv.node.sandbox import Pause, Resume, SetTimeout
from aenv.proto import lifecycle as lc
from aenv.storage.metadata import SandboxWrite
from tests.fakes.host import FakeHost
from tests.fakes.node import AutoJump, crash, create, open_test_node
from tests.fakes.runtime import Guest, Timings, drop_image

T = Timings()

pytestmark = pytest.mark.timeout(60)


def record(node: Node, sandbox_id: str) -> dict[str, object]:
    doc = node.meta.store.get_sandbox(sandbox_id)
    assert doc is not None
    return doc


async def test_every_state_change_is_journaled_and_a_kill_removes_the_record(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    actor = await create(node, timeout_s=600, metadata={"owner": "me"})
    sid = actor.sandbox_id
    doc = record(node, sid)
    assert (doc["state"], doc["period"], doc["slot"], doc["layers"]) == ("running", 1, 0, [])
    assert doc["metadata"] == {"owner": "me"} and doc["envdToken"] == actor.envd_access_token
    fake.runtime.get(sid).write("root/notes", "one")
    await actor.mailbox.ask(Pause("full"))
    assert record(node, sid)["state"] == "frozen"
    await trio.sleep(31)  # its copy on disk
    assert record(node, sid)["durableImage"] is not None
    await actor.mailbox.ask(Resume(None))
    doc = record(node, sid)
    assert doc["state"] == "running" and "durableImage" not in doc
    await actor.mailbox.ask(Pause("filesystem"))
    doc = record(node, sid)
    assert (doc["state"], doc["image"], doc["pauseMode"]) == ("paused", None, "filesystem")
    assert len(doc["layers"]) == 1  # what it wrote, frozen
    await actor.mailbox.ask(Resume(None))
    doc = record(node, sid)
    assert (doc["state"], doc["period"]) == ("running", 2)
    await node.kill(sid)
    assert node.meta.store.get_sandbox(sid) is None


async def test_after_a_crash_running_frozen_and_paused_sandboxes_are_taken_back(
    clock: trio.testing.MockClock, autojump: AutoJump, config: Config, fake: FakeHost
) -> None:
    async with open_test_node(config, fake) as node:
        running = await create(node, timeout_s=600)
        frozen = await create(node, timeout_s=600)
        await frozen.mailbox.ask(Pause("full"))
        paused = await create(node, timeout_s=600)
        fake.runtime.get(paused.sandbox_id).write("root/notes", "kept")
        await paused.mailbox.ask(Pause("filesystem"))
        await trio.sleep(10)
        disk = crash(node, fake)
    disk.restore()
    held = {i: fake.runtime.get(i) for i in (running.sandbox_id, frozen.sandbox_id)}
    starts = len(fake.runtime.ops("start"))
    async with open_test_node(config, fake) as node:
        assert {a.sandbox_id for a in node.list()} == {
            running.sandbox_id,
            frozen.sandbox_id,
            paused.sandbox_id,
        }
        # running: the same runtime sandbox, adopted, not restarted or re-initialised
        r = node.get(running.sandbox_id)
        assert r.state is lc.State.RUNNING and r is not running
        assert fake.runtime.get(r.sandbox_id) is held[r.sandbox_id]
        assert r.envd_access_token == running.envd_access_token
        assert r.lifecycle.deadline is not None
        # frozen: taken back frozen, still paused in memory; a resume is a thaw
        f = node.get(frozen.sandbox_id)
        assert f.state is lc.State.PAUSED and f.frozen_pause
        assert fake.runtime.get(f.sandbox_id).state is Guest.FROZEN
        assert await f.mailbox.ask(Resume(None)) is True
        assert fake.runtime.get(f.sandbox_id) is held[f.sandbox_id]
        assert len(fake.runtime.ops("start")) == starts  # nothing started anew
        # paused: back paused, from its files; resuming boots it over them
        p = node.get(paused.sandbox_id)
        assert p.state is lc.State.PAUSED and p.on_disk
        assert await p.mailbox.ask(Resume(None)) is True
        restarted = fake.runtime.get(p.sandbox_id)
        assert fake.roots.read(restarted.spec.rootfs, "root/notes") == "kept"
        assert [c.op for c in fake.runtime.calls if c.sandbox_id == p.sandbox_id][-1] == "start"
        assert node.m_taken_back.get(state="running") == 1
        assert node.m_taken_back.get(state="frozen") == 1
        assert node.m_taken_back.get(state="paused") == 1
        for actor in node.list():
            await node.kill(actor.sandbox_id)
    assert fake.leftovers() == []


async def test_a_sandbox_that_died_while_the_node_was_down_is_reported_lost(
    clock: trio.testing.MockClock, autojump: AutoJump, config: Config, fake: FakeHost
) -> None:
    async with open_test_node(config, fake) as node:
        actor = await create(node, timeout_s=600)
        disk = crash(node, fake)
    disk.restore()
    fake.runtime.get(actor.sandbox_id).guest_exit(137)
    async with open_test_node(config, fake) as node:
        with pytest.raises(SandboxNotFound, match="stopped while the node was down"):
            node.get(actor.sandbox_id)
        assert record(node, actor.sandbox_id)["state"] == "lost"
        assert node.m_lost.get() == 1
        assert not (config.sandboxes_dir / actor.sandbox_id).exists()
        assert fake.leftovers() == []  # its runtime, slot and root are gone
        assert node.statistics() == {"sandboxes": 0, "running": 0, "lost": 1}


async def test_a_paused_sandbox_whose_image_is_gone_is_reported_lost(
    clock: trio.testing.MockClock, autojump: AutoJump, config: Config, fake: FakeHost
) -> None:
    async with open_test_node(config, fake) as node:
        actor = await create(node, timeout_s=600)
        fake.runtime.faults.fail_next("freeze")  # paused with its memory on disk
        await actor.mailbox.ask(Pause("full"))
        image = actor.workdir / str(record(node, actor.sandbox_id)["image"])
    drop_image(image)
    async with open_test_node(config, fake) as node:
        with pytest.raises(SandboxNotFound, match="could not be recovered"):
            node.get(actor.sandbox_id)
        assert fake.leftovers() == []


async def test_a_frozen_sandbox_whose_runtime_died_comes_back_paused_from_its_copy(
    clock: trio.testing.MockClock, autojump: AutoJump, config: Config, fake: FakeHost
) -> None:
    async with open_test_node(config, fake) as node:
        actor = await create(node, timeout_s=600)
        fake.runtime.get(actor.sandbox_id).write("root/notes", "in the copy")
        await actor.mailbox.ask(Pause("full"))
        await trio.sleep(31)  # the write-behind copy
        copy = str(record(node, actor.sandbox_id)["durableImage"])
        disk = crash(node, fake)
    disk.restore()
    fake.runtime.get(actor.sandbox_id).guest_exit(137)  # say, the host rebooted
    async with open_test_node(config, fake) as node:
        back = node.get(actor.sandbox_id)
        assert back.state is lc.State.PAUSED and back.on_disk and not back.frozen_pause
        doc = record(node, actor.sandbox_id)
        assert (doc["state"], doc["image"]) == ("paused", copy)
        t = trio.current_time()
        assert await back.mailbox.ask(Resume(None)) is True
        assert trio.current_time() == t + T.restore_s
        restored = fake.runtime.get(actor.sandbox_id)
        assert restored.restored_from == back.workdir / copy
        assert fake.roots.read(restored.spec.rootfs, "root/notes") == "in the copy"


async def test_only_records_a_host_crash_could_not_make_matter_skip_the_sync(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    """A running sandbox's records (and the removal of one) are committed without
    waiting for the disk: after a host crash nothing of it runs to take back. Every
    record of a paused or frozen sandbox, and the running one that replaces it
    (else a resumed sandbox could come back paused from an image it left), syncs."""
    synced: list[tuple[str | None, bool]] = []
    write_many = node.meta.store.write_sandboxes

    def noted(records: list[SandboxWrite], *, sync: bool = True) -> None:
        synced.extend((state, sync) for _, state, _, _ in records)
        write_many(records, sync=sync)

    node.meta.store.write_sandboxes = noted  # type: ignore[method-assign]
    actor = await create(node, timeout_s=600)
    await actor.mailbox.ask(SetTimeout(900))
    await actor.mailbox.ask(Pause("full"))
    await actor.mailbox.ask(Resume(None))
    await actor.mailbox.ask(Pause("filesystem"))
    await actor.mailbox.ask(Resume(None))
    await node.kill(actor.sandbox_id)
    assert synced == [
        ("running", False),  # created
        ("running", False),  # its timeout set
        ("frozen", True),
        ("running", True),  # resumed from memory
        ("paused", True),
        ("running", True),  # resumed from disk
        (None, False),  # killed while running
    ]
