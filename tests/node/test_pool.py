"""The pool on a node: it grows with a burst of creates, shrinks as demand
falls, stays within memory, and its refills wait for the creates in flight.

Rules: the real node and its pool on a `FakeHost` (tests/fakes/), on trio's
MockClock with the fake runsc's `Timings` (restore 0.25 s); the template's
snapshot is made by hand (as `aenv.node.warm` would) and creates take from
the pool through `Pool.take`, as `Node.create` does. Sizes follow
`aenv.proto.poolsize` with the default limits (window 5 s, peak held 60 s,
half-life 120 s, hot for 600 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from aenv.node.node import Node
from aenv.node.pool import QUIET_MAX_S
from aenv.node.sandbox import Pause, Resume
from aenv.node.snapshots import snapshot_name
from aenv.proto import lifecycle as lc
from aenv.storage.templates import Template
from tests.fakes.host import FakeHost
from tests.fakes.node import TEMPLATE, AutoJump, create, new, node_config, open_test_node

pytestmark = pytest.mark.timeout(60)
MIB = 1 << 20


async def _hot_template(node: Node) -> Template:
    """The template, made a snapshot the pool restores from."""
    template = await node.resolve_template(TEMPLATE)
    source = await create(node, timeout_s=3600)
    await node.snapshot(source, snapshot_name(template), memory=True, wait_s=60)
    await source.stop()
    return template


def _ready(node: Node, template: Template) -> int:
    return node.pool.statistics().get(snapshot_name(template), 0)


async def test_a_burst_grows_the_pool_to_its_size_and_it_shrinks_back_once_demand_falls(
    clock: trio.testing.MockClock, autojump: AutoJump, tmp_path: Path, fake: FakeHost
) -> None:
    async with open_test_node(node_config(tmp_path, pool_size=2, pool_max=32), fake) as node:
        template = await _hot_template(node)
        taken = [node.pool.take(template) for _ in range(20)]  # a burst of 20 creates
        assert taken == [None] * 20  # the pool had nothing yet
        await autojump.until(lambda: _ready(node, template) == 20)
        # a second burst (after the first's window) is served from the pool, each member once
        await trio.sleep(10)
        members = [node.pool.take(template) for _ in range(20)]
        assert all(m is not None for m in members)
        assert len({m.sandbox_id for m in members if m is not None}) == 20
        for m in members:
            assert m is not None
            await m.stop()
        await autojump.until(lambda: _ready(node, template) == 20)
        # no more creates: held 60 s, then halves every 120 s, down to the floor
        # while hot, then nothing once cold (600 s after the last create)
        await trio.sleep(185)
        await autojump.until(lambda: _ready(node, template) <= 10)
        await trio.sleep(300)
        await autojump.until(lambda: _ready(node, template) == 2)
        await trio.sleep(200)
        await autojump.until(lambda: _ready(node, template) == 0)
        await autojump.until(lambda: node.statistics()["sandboxes"] == 0)  # members stopped


async def test_the_pool_grows_only_as_far_as_memory_allows(
    clock: trio.testing.MockClock, autojump: AutoJump, tmp_path: Path, fake: FakeHost
) -> None:
    # 10 % low mark + 5 % margin of 32 GiB = 4.8 GiB; 5 GiB free leaves room for ~4 members
    fake.memory.free = 5 << 30
    async with open_test_node(node_config(tmp_path, pool_size=1), fake) as node:
        template = await _hot_template(node)
        for _ in range(20):
            node.pool.take(template)
        await autojump.until(lambda: node.pool.statistics().get(snapshot_name(template)) == 3)
        await trio.sleep(30)
        assert _ready(node, template) == 3  # (each member holds 64 MiB here)


async def test_refills_wait_for_the_creates_in_flight(
    clock: trio.testing.MockClock, autojump: AutoJump, tmp_path: Path, fake: FakeHost
) -> None:
    async with open_test_node(node_config(tmp_path, pool_size=2), fake) as node:
        template = await _hot_template(node)
        before = len(fake.runtime.ops("restore"))
        start = trio.current_time()
        with node.pool.serving():  # a create holds on for a while
            node.pool.take(template)
            node.pool.take(template)
            await trio.sleep(QUIET_MAX_S / 2)
            assert len(fake.runtime.ops("restore")) == before
        await autojump.until(lambda: _ready(node, template) == 2)
        first = fake.runtime.ops("restore")[before].at
        assert start + QUIET_MAX_S / 2 <= first < start + QUIET_MAX_S


async def test_a_member_adopts_the_create_whole_and_one_that_fails_is_stopped(
    clock: trio.testing.MockClock, autojump: AutoJump, tmp_path: Path, fake: FakeHost
) -> None:
    async with open_test_node(node_config(tmp_path, pool_size=2), fake) as node:
        template = await _hot_template(node)
        node.pool.take(template)
        node.pool.take(template)
        await autojump.until(lambda: _ready(node, template) == 2)
        member = node.pool.take(template)
        assert member is not None and member.hidden
        pool_token = member.envd_access_token
        got = await member.adopt(new(600, metadata={"who": "me"}, env_vars={"WHO": "me"}))
        assert got is member and not member.hidden and not member.pooled
        assert member.metadata == {"who": "me"} and member.env_vars["WHO"] == "me"
        assert member.envd_access_token != pool_token
        init = fake.envd.inits[-1]  # envd got the new token, asked with the pool's
        assert init.body["accessToken"] == member.envd_access_token
        assert init.body["envVars"]["WHO"] == "me" and init.token == pool_token
        record = node.meta.store.get_sandbox(member.sandbox_id)
        assert record is not None and record["state"] == "running"
        assert [a.sandbox_id for a in node.list()] == [member.sandbox_id]
        # a create that asks for no environment of its own: envd has it already, and
        # the member's token (never shown outside the node) becomes the sandbox's
        await autojump.until(lambda: _ready(node, template) >= 1)
        plain = node.pool.take(template)
        assert plain is not None
        inits, plain_token = len(fake.envd.inits), plain.envd_access_token
        assert await plain.adopt(new(600)) is plain and not plain.pooled
        assert len(fake.envd.inits) == inits and plain.envd_access_token == plain_token
        record = node.meta.store.get_sandbox(plain.sandbox_id)
        assert record is not None and record["state"] == "running"
        await plain.stop()
        # envd refuses the next member's /init: that create restores instead, and
        # the member is stopped, its record gone
        await autojump.until(lambda: _ready(node, template) >= 1)
        other = node.pool.take(template)
        assert other is not None
        fake.envd.faults.fail_next("init")
        with pytest.raises(Exception, match="init"):
            await other.adopt(new(600, env_vars={"WHO": "them"}))
        await other.stop()
        assert node.meta.store.get_sandbox(other.sandbox_id) is None
        assert [a.sandbox_id for a in node.list()] == [member.sandbox_id]


async def test_members_wait_frozen_for_their_thaw_and_an_adopted_one_pauses_to_disk(
    clock: trio.testing.MockClock, autojump: AutoJump, tmp_path: Path, fake: FakeHost
) -> None:
    """A member is frozen with `may_checkpoint=False` (the runtime may use a freezer
    a checkpoint must not follow: the fake fails any checkpoint or hold before its
    thaw) and thawed first when adopted; the adopted sandbox then pauses as any other,
    gets its copy on disk while paused, hibernates from it and resumes from disk."""
    async with open_test_node(node_config(tmp_path, pool_size=1), fake) as node:
        template = await _hot_template(node)
        node.pool.take(template)
        node.pool.take(template)  # (hot: asked for twice)
        await autojump.until(lambda: _ready(node, template) == 1)
        member = node.pool.take(template)
        assert member is not None
        assert fake.runtime.get(member.sandbox_id).until_thaw
        ops = [c.op for c in fake.runtime.calls if c.sandbox_id == member.sandbox_id]
        assert ops == ["restore", "freeze-until-thaw"]
        await member.adopt(new(600))
        assert not fake.runtime.get(member.sandbox_id).until_thaw
        await member.mailbox.ask(Pause("full"))
        assert member.frozen_pause
        await autojump.until(lambda: member.on_disk)
        ops = [c.op for c in fake.runtime.calls if c.sandbox_id == member.sandbox_id]
        assert ops[2:] == ["thaw", "freeze", "checkpoint_frozen", "thaw", "stop"]
        assert await member.mailbox.ask(Resume(None)) is True
        assert member.state is lc.State.RUNNING
        await member.stop()
