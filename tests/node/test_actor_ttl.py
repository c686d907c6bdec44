"""A sandbox's timeout, in-process on the scripted host (tests/fakes/node.py).

Rules: the real node and sandbox actors on a `FakeHost`, on trio's MockClock;
runsc's steps take the fake's `Timings` (start 0.5 s, restore 0.25 s,
checkpoint 0.25 s, stop 0.125 s), so every time asserted is exact. A
sandbox's timeout starts when it is ready and runs only while it runs.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from aenv.node.node import Node, SandboxNotFound
from aenv.node.sandbox import ExtendTimeout, Pause, Resume, SetTimeout
from aenv.proto import lifecycle as lc
from tests.fakes.host import FakeHost
from tests.fakes.node import AutoJump, create
from tests.fakes.runtime import Timings

T = Timings()

pytestmark = pytest.mark.timeout(60)


async def test_a_sandbox_is_killed_when_its_timeout_expires(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    t0 = trio.current_time()
    actor = await create(node, timeout_s=60)
    ready = t0 + T.start_s
    assert trio.current_time() == ready
    assert actor.lifecycle.deadline == ready + 60
    await trio.sleep_until(ready + 59.9)
    assert actor.state is lc.State.RUNNING
    await actor.stopped.wait()
    assert trio.current_time() == ready + 60 + T.stop_s
    assert [(c.op, c.at) for c in fake.runtime.calls] == [
        ("start", t0),
        ("stop", ready + 60),
    ]
    assert actor.state is lc.State.STOPPED
    assert actor.lifecycle.reason is lc.StopReason.TIMEOUT
    assert fake.leftovers() == []
    assert not actor.workdir.exists()
    assert node.meta.store.get_sandbox(actor.sandbox_id) is None
    with pytest.raises(SandboxNotFound):
        node.get(actor.sandbox_id)


async def test_an_auto_pause_sandbox_is_paused_to_disk_when_its_timeout_expires(
    clock: trio.testing.MockClock, autojump: AutoJump, node: Node, fake: FakeHost
) -> None:
    actor = await create(node, timeout_s=60, auto_pause=True)
    ready = trio.current_time()
    await autojump.until(lambda: actor.state is lc.State.PAUSED)
    # checkpointed (memory), stopped, its upper frozen into a layer
    assert trio.current_time() == ready + 60 + T.checkpoint_s + T.stop_s
    assert [(c.op, c.at) for c in fake.runtime.calls[1:]] == [
        ("checkpoint", ready + 60),
        ("stop", ready + 60 + T.checkpoint_s),
    ]
    assert actor.lifecycle.paused_by_timeout
    await trio.sleep(1)
    assert fake.leftovers() == []  # a paused sandbox holds no runtime, slot or root
    record = node.meta.store.get_sandbox(actor.sandbox_id)
    assert record is not None and record["state"] == "paused"
    assert record["image"] is not None and record["remaining"] == 0.0
    # paused, its timeout does not run; resuming re-arms the latest one
    await trio.sleep(3600)
    assert actor.state is lc.State.PAUSED
    assert await actor.mailbox.ask(Resume(None)) is True
    resumed = trio.current_time()
    assert fake.runtime.calls[-1].op == "restore"
    assert actor.lifecycle.deadline == resumed + 60


async def test_set_timeout_moves_the_deadline_and_refresh_never_shortens_it(
    clock: trio.testing.MockClock, node: Node
) -> None:
    actor = await create(node, timeout_s=60)
    await trio.sleep_until(10)
    await actor.mailbox.ask(SetTimeout(30))
    assert actor.lifecycle.deadline == 40
    await actor.mailbox.ask(ExtendTimeout(5))  # would end sooner: ignored
    assert actor.lifecycle.deadline == 40
    await trio.sleep_until(20)
    await actor.mailbox.ask(ExtendTimeout(100))
    assert actor.lifecycle.deadline == 120
    await trio.sleep_until(100)
    await actor.mailbox.ask(SetTimeout(5))  # set-timeout may shorten
    await actor.stopped.wait()
    assert trio.current_time() == 105 + T.stop_s
    assert actor.lifecycle.reason is lc.StopReason.TIMEOUT


async def test_time_paused_does_not_count_and_a_resume_starts_a_new_timeout(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    actor = await create(node, timeout_s=60)
    ready = trio.current_time()
    await trio.sleep_until(ready + 10)
    await actor.mailbox.ask(Pause("filesystem"))  # stops it: no memory image
    assert trio.current_time() == ready + 10 + T.stop_s
    assert actor.lifecycle.remaining == 50
    await trio.sleep(3600)
    assert actor.state is lc.State.PAUSED
    assert await actor.mailbox.ask(Resume(30)) is True
    resumed = trio.current_time()
    assert resumed == ready + 10 + T.stop_s + 3600 + T.start_s  # booted afresh
    assert actor.lifecycle.deadline == resumed + 30
    assert await actor.mailbox.ask(Resume(None)) is False  # already running
    await actor.stopped.wait()
    assert trio.current_time() == resumed + 30 + T.stop_s
