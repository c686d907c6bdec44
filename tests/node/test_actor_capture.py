"""Forks and snapshots of a running sandbox, in-process on the scripted host.

Rules: the real node and sandbox actors on a `FakeHost` (tests/fakes/), on
trio's MockClock, with the fake runsc's `Timings` (checkpoint 0.25 s,
restore 0.25 s). A live capture holds the sandbox (runsc pause), checkpoints
it leaving it running and copies what its files changed; the source runs on
with its ID, deadline and processes.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from aenv.node.node import Node
from aenv.node.sandbox import PauseError, SandboxActor
from aenv.proto import lifecycle as lc
from tests.fakes.host import FakeHost
from tests.fakes.node import create, new
from tests.fakes.runtime import Guest, Timings

T = Timings()

pytestmark = pytest.mark.timeout(60)


async def test_a_fork_starts_children_from_a_capture_and_the_parent_runs_on(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    parent = await create(node, timeout_s=600, env_vars={"A": "1"})
    deadline = parent.lifecycle.deadline
    fake.runtime.get(parent.sandbox_id).write("root/notes", "before the fork")
    t = trio.current_time()
    children = await node.fork(parent, 2, 60, wait_s=60)
    assert trio.current_time() == t + T.checkpoint_s + T.restore_s
    assert all(isinstance(c, SandboxActor) for c in children)
    ops = [(c.op, c.at) for c in fake.runtime.calls if c.sandbox_id == parent.sandbox_id]
    assert ops[1:] == [("hold", t), ("checkpoint", t)]
    assert fake.runtime.get(parent.sandbox_id).state is Guest.RUNNING
    assert parent.state is lc.State.RUNNING and parent.lifecycle.deadline == deadline
    inits = {i.address: i for i in fake.envd.inits}
    for child in children:
        sandbox = fake.runtime.get(child.sandbox_id)
        assert sandbox.restored_from is not None and not sandbox.restored_from.exists()
        assert fake.roots.read(sandbox.spec.rootfs, "root/notes") == "before the fork"
        assert child.lifecycle.deadline == t + T.checkpoint_s + T.restore_s + 60
        # envd is handed a token of its own, asked with the parent's
        init = inits[child.sandbox_ip or ""]
        assert init.token == parent.envd_access_token
        assert init.body["accessToken"] == child.envd_access_token != parent.envd_access_token
        assert init.body["envVars"] == {"A": "1"}
    # the parent's later writes are its own
    fake.runtime.get(parent.sandbox_id).write("root/notes", "after")
    child = fake.runtime.get(children[0].sandbox_id)
    assert fake.roots.read(child.spec.rootfs, "root/notes") == "before the fork"


async def test_a_snapshot_seeds_new_sandboxes(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    source = await create(node, timeout_s=600)
    fake.runtime.get(source.sandbox_id).write("root/notes", "snapshotted")
    doc = await node.snapshot(source, "mine", memory=True, wait_s=60)
    assert doc["name"] == "mine" and doc["image"] is not None and doc["memory"]
    assert await node.find_snapshot("mine") == doc
    assert list(source.workdir.glob("image*")) == []  # handed over to the snapshot
    seeded = await node.create_from_snapshot(doc, new(60))
    sandbox = fake.runtime.get(seeded.sandbox_id)
    assert sandbox.restored_from is not None
    assert fake.roots.read(sandbox.spec.rootfs, "root/notes") == "snapshotted"
    assert source.state is lc.State.RUNNING


async def test_a_failed_capture_leaves_the_sandbox_running_and_no_image(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    actor = await create(node, timeout_s=600)
    fake.runtime.faults.fail_next("checkpoint")
    with pytest.raises(PauseError, match="capturing the sandbox failed"):
        await node.fork(actor, 1, 60, wait_s=60)
    assert actor.state is lc.State.RUNNING
    assert fake.runtime.get(actor.sandbox_id).state is Guest.RUNNING  # let go
    assert list(actor.workdir.glob("image*")) == []
    assert [a.sandbox_id for a in node.list()] == [actor.sandbox_id]
    assert len(fake.network.slots) == 1  # only its own
