"""Pause, resume and kill racing each other, failures, and ends, in-process.

Rules: the real node and sandbox actors on a `FakeHost` (tests/fakes/), on
trio's MockClock, with the fake runsc's `Timings` (start 0.5 s, restore
0.25 s, checkpoint 0.25 s, stop 0.125 s): every time asserted is exact. A
sandbox handles one request at a time: a request that arrives while it
pauses, resumes or starts is handled once that is done. Each test ends with
nothing left on the host that a stopped sandbox held.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from aenv.node.host import EnvdUnavailable
from aenv.node.node import Node, SandboxNotFound
from aenv.node.sandbox import (
    Kill,
    Pause,
    PauseError,
    Resume,
    ResumeError,
    SandboxActor,
    SandboxNotRunning,
)
from aenv.proto import lifecycle as lc
from tests.fakes.host import FakeHost
from tests.fakes.node import create
from tests.fakes.runtime import FakeRunscError, Guest, Timings

T = Timings()

pytestmark = pytest.mark.timeout(60)


async def ask_at(at: float, actor: SandboxActor, msg: Any, out: dict[str, Any]) -> None:
    """Ask `actor` at time `at`; record the answer (or error) and when it came."""
    await trio.sleep_until(at)
    try:
        out["answer"] = await actor.mailbox.ask(msg)
    except Exception as exc:
        out["error"] = exc
    out["at"] = trio.current_time()


async def paused_on_disk(node: Node, fake: FakeHost) -> SandboxActor:
    """A sandbox paused with its memory on disk (its freeze failed: checkpointed)."""
    actor = await create(node, timeout_s=600)
    fake.runtime.faults.fail_next("freeze")
    await actor.mailbox.ask(Pause("full"))
    assert actor.state is lc.State.PAUSED and not actor.frozen_pause
    return actor


async def test_a_kill_while_pausing_waits_for_the_pause_then_kills(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    actor = await create(node, timeout_s=600)
    t = trio.current_time()
    fake.runtime.faults.fail_next("freeze")  # so the pause checkpoints (takes time)
    pause: dict[str, Any] = {}
    async with trio.open_nursery() as n:
        n.start_soon(ask_at, t, actor, Pause("full"), pause)
        await trio.sleep(0.1)  # mid-checkpoint
        assert actor.state is lc.State.PAUSING
        await node.kill(actor.sandbox_id)
        killed = trio.current_time()
    assert pause == {"answer": None, "at": t + T.checkpoint_s + T.stop_s}
    assert killed == pause["at"]  # nothing more to stop: it was paused
    assert actor.state is lc.State.STOPPED
    assert actor.lifecycle.reason is lc.StopReason.KILLED
    assert fake.leftovers() == []
    assert not actor.workdir.exists()  # its memory image went with it
    assert node.meta.store.get_sandbox(actor.sandbox_id) is None


async def test_a_resume_while_pausing_resumes_once_paused(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    actor = await create(node, timeout_s=600)
    t = trio.current_time()
    fake.runtime.faults.fail_next("freeze")
    pause: dict[str, Any] = {}
    resume: dict[str, Any] = {}
    async with trio.open_nursery() as n:
        n.start_soon(ask_at, t, actor, Pause("full"), pause)
        n.start_soon(ask_at, t + 0.1, actor, Resume(None), resume)
    paused = t + T.checkpoint_s + T.stop_s
    assert pause == {"answer": None, "at": paused}
    assert resume == {"answer": True, "at": paused + T.restore_s}
    assert actor.state is lc.State.RUNNING
    ops = [c.op for c in fake.runtime.calls]
    assert ops == ["start", "freeze", "checkpoint", "stop", "restore"]


async def test_a_resume_of_a_sandbox_paused_in_memory_is_a_thaw(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    actor = await create(node, timeout_s=600)
    t = trio.current_time()
    await actor.mailbox.ask(Pause("full"))
    assert trio.current_time() == t  # frozen: answered at once
    assert actor.frozen_pause and actor.paused_in_memory
    sandbox = fake.runtime.get(actor.sandbox_id)
    assert sandbox.state is Guest.FROZEN
    await trio.sleep(10)
    assert await actor.mailbox.ask(Resume(None)) is True
    assert trio.current_time() == t + 10
    assert sandbox.state is Guest.RUNNING
    assert [c.op for c in fake.runtime.calls] == ["start", "freeze", "thaw"]
    assert actor.lifecycle.deadline == t + 10 + 600


async def test_a_kill_while_resuming_waits_for_the_resume_then_kills(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    actor = await paused_on_disk(node, fake)
    t = trio.current_time()
    resume: dict[str, Any] = {}
    async with trio.open_nursery() as n:
        n.start_soon(ask_at, t, actor, Resume(None), resume)
        await trio.sleep(0.1)
        assert actor.state is lc.State.RESUMING
        await node.kill(actor.sandbox_id)
        killed = trio.current_time()
    assert resume == {"answer": True, "at": t + T.restore_s}
    assert killed == t + T.restore_s + T.stop_s
    assert actor.lifecycle.reason is lc.StopReason.KILLED
    assert fake.leftovers() == []
    assert not actor.workdir.exists()


async def test_of_two_pauses_at_once_the_second_finds_it_paused(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    actor = await create(node, timeout_s=600)
    t = trio.current_time()
    first: dict[str, Any] = {}
    second: dict[str, Any] = {}
    async with trio.open_nursery() as n:
        n.start_soon(ask_at, t, actor, Pause("filesystem"), first)
        n.start_soon(ask_at, t, actor, Pause("filesystem"), second)
    done, refused = (first, second) if "answer" in first else (second, first)
    assert done == {"answer": None, "at": t + T.stop_s}
    error = refused["error"]
    assert isinstance(error, SandboxNotRunning) and error.state is lc.State.PAUSED
    assert refused["at"] == t + T.stop_s
    assert actor.state is lc.State.PAUSED
    assert [c.op for c in fake.runtime.calls] == ["start", "stop"]  # paused once


async def test_a_failed_pause_leaves_it_running_with_its_deadline(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    actor = await create(node, timeout_s=60)
    ready = trio.current_time()
    await trio.sleep(10)
    fake.runtime.faults.fail_next("freeze")
    fake.runtime.faults.fail_next("checkpoint")
    with pytest.raises(PauseError, match="injected"):
        await actor.mailbox.ask(Pause("full"))
    assert trio.current_time() == ready + 10 + T.checkpoint_s
    assert actor.state is lc.State.RUNNING
    assert actor.lifecycle.deadline == ready + 60  # the time left is kept
    assert fake.runtime.get(actor.sandbox_id).state is Guest.RUNNING
    record = node.meta.store.get_sandbox(actor.sandbox_id)
    assert record is not None and record["state"] == "running"
    assert list(actor.workdir.glob("image*")) == []  # no partial image left
    await actor.mailbox.ask(Pause("full"))  # and it can be paused later
    assert actor.state is lc.State.PAUSED


async def test_a_failed_resume_leaves_it_paused_and_a_later_one_works(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    actor = await paused_on_disk(node, fake)
    t = trio.current_time()
    fake.runtime.faults.fail_next("restore")
    with pytest.raises(ResumeError, match="injected"):
        await actor.mailbox.ask(Resume(None))
    assert trio.current_time() == t + T.restore_s + T.stop_s
    assert actor.state is lc.State.PAUSED
    assert fake.leftovers() == []  # the attempt's runtime, slot and root are gone
    record = node.meta.store.get_sandbox(actor.sandbox_id)
    assert record is not None and record["state"] == "paused"
    assert await actor.mailbox.ask(Resume(None)) is True
    assert actor.state is lc.State.RUNNING


async def test_a_cancelled_create_leaves_nothing(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    t = trio.current_time()
    with trio.move_on_after(0.25) as scope:
        await create(node)
    assert scope.cancelled_caught
    assert trio.current_time() == t + 0.25 + T.stop_s
    assert [c.op for c in fake.runtime.calls] == ["start", "stop"]
    assert fake.leftovers() == []
    assert node.list() == []
    assert list(node.config.sandboxes_dir.iterdir()) == []
    assert node.meta.store.list_sandboxes() == []


async def test_a_kill_during_create_is_done_once_it_is_ready(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    t = trio.current_time()
    created: list[SandboxActor] = []

    async def creator() -> None:
        created.append(await create(node))

    async with trio.open_nursery() as n:
        n.start_soon(creator)
        await trio.sleep(0.25)
        (creating,) = node.list()
        assert creating.state is lc.State.CREATING
        await node.kill(creating.sandbox_id)
        assert trio.current_time() == t + T.start_s + T.stop_s
    assert created == [creating]
    assert creating.lifecycle.reason is lc.StopReason.KILLED
    assert fake.leftovers() == []
    assert node.list() == []


async def test_a_failed_start_fails_the_create_and_leaves_nothing(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    fake.runtime.faults.fail_next("start", FakeRunscError("runsc run: no space left"))
    with pytest.raises(FakeRunscError, match="no space left"):
        await create(node)
    assert fake.leftovers() == []
    assert node.list() == []
    assert list(node.config.sandboxes_dir.iterdir()) == []


async def test_an_envd_that_never_answers_fails_the_create_after_a_minute(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    t = trio.current_time()
    fake.envd.answering = False
    with pytest.raises(EnvdUnavailable, match="did not start within 60s"):
        await create(node)
    assert trio.current_time() == t + T.start_s + 60 + T.stop_s
    assert fake.leftovers() == []


async def test_a_sandbox_whose_runtime_dies_stops_with_the_exit_status(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    actor = await create(node, timeout_s=600)
    await trio.sleep_until(5)
    fake.runtime.get(actor.sandbox_id).guest_exit(137)  # say, the OOM killer
    await actor.stopped.wait()
    assert trio.current_time() == 5 + T.stop_s
    assert actor.state is lc.State.STOPPED
    assert actor.lifecycle.reason is lc.StopReason.EXITED
    assert actor.lifecycle.error == "sandbox exited with status 137"
    assert "sandbox process exited with status 137" in [e.message for e in actor.logs()]
    assert node.m_stopped.get(reason="exited") == 1
    assert fake.leftovers() == []
    assert node.meta.store.get_sandbox(actor.sandbox_id) is None
    with pytest.raises(SandboxNotFound):
        node.get(actor.sandbox_id)
    with pytest.raises(Exception, match="stopped"):
        await actor.mailbox.ask(Kill())


async def test_a_runtime_that_fails_at_its_host_memory_limit_died_of_it(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    at_limit = await create(node, timeout_s=600)
    other = await create(node, timeout_s=600)
    await trio.sleep(1)
    fake.runtime.get(at_limit.sandbox_id).memory_limit_reached()
    await trio.sleep(5)
    # the runtime fails (its own allocations refused) before the kernel kills it
    fake.runtime.get(at_limit.sandbox_id).guest_exit(2)
    fake.runtime.get(other.sandbox_id).guest_exit(2)  # a crash, nothing to do with memory
    await at_limit.stopped.wait()
    await other.stopped.wait()
    died = {d.sandbox_id: d for d in node.died_recently()}
    assert died[at_limit.sandbox_id].host_oom
    assert "status 2 (at its host memory limit: out of memory)" in died[at_limit.sandbox_id].cause
    assert not died[other.sandbox_id].host_oom
    assert "out of memory" not in died[other.sandbox_id].cause
