"""The node's supervisors: what fails is restarted or given up on, the node serves on.

Rules: the real node, its supervisors and sandbox actors on a `FakeHost`
(tests/fakes/), on trio's MockClock, with the fake runsc's `Timings` (start
0.5 s, restore 0.25 s, checkpoint 0.25 s, stop 0.125 s). Failures are the
fake runsc's injected ones, except the upload's, which is an unexpected
error out of the object store code (patched in for one call). Uploads go to
a `file://` store in the test's temp dir. Restart policies with jitter are
asserted by counts, not times.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import aenv.node.durable
import aenv.storage.snapstore.upload as upload_module
from aenv.kit.supervisor import ChildState, StopToken
from aenv.node.durable import JOB_RESTARTS
from aenv.node.node import SERVICES_STOP_S, Node
from aenv.node.pool import FILLER_RESTARTS
from aenv.node.sandbox import Pause, Resume, SandboxNotRunning, SetTimeout
from aenv.node.snapshots import snapshot_name
from aenv.proto import lifecycle as lc
from tests.fakes.host import FakeHost
from tests.fakes.node import TEMPLATE, AutoJump, create, node_config, open_test_node
from tests.fakes.runtime import Timings

T = Timings()

pytestmark = pytest.mark.timeout(60)


async def test_a_failing_pool_filler_is_restarted_then_given_up_and_the_node_serves_on(
    clock: trio.testing.MockClock, autojump: AutoJump, tmp_path: Path, fake: FakeHost
) -> None:
    config = node_config(tmp_path, pool_size=1, pool_refill_concurrency=1)  # a restore at a time
    async with open_test_node(config, fake) as node:
        template = await node.resolve_template(TEMPLATE)
        source = await create(node, timeout_s=600)
        key = snapshot_name(template)  # the snapshot the pool restores from
        await node.snapshot(source, key, memory=True, wait_s=60)
        fake.runtime.faults.fail_next("restore", times=100)
        assert node.pool.take(template) is None  # asked for once: not hot yet
        assert node.pool.take(template) is None  # twice: hot, the filler starts
        attempts = FILLER_RESTARTS.max_restarts + 1
        await autojump.until(lambda: len(fake.runtime.ops("restore")) == attempts)
        await autojump.until(lambda: node.services.get(f"pool {key}") is None)
        stats = node.services.statistics()
        assert (stats.restarts, stats.failures, stats.failed) == (attempts - 1, attempts, 1)
        # given up: another take does not start it again for a while
        assert node.pool.take(template) is None
        await trio.sleep(60)
        assert len(fake.runtime.ops("restore")) == attempts
        assert node.services.get(f"pool {key}") is None
        # the node serves on: the source runs, a new sandbox boots
        await source.mailbox.ask(SetTimeout(600))
        other = await create(node)
        assert other.state is lc.State.RUNNING
        assert {a.sandbox_id for a in node.list()} == {source.sandbox_id, other.sandbox_id}


async def test_a_sandbox_that_crashes_is_torn_down_and_the_others_serve_on(
    clock: trio.testing.MockClock, node: Node, fake: FakeHost
) -> None:
    doomed = await create(node, timeout_s=600)
    other = await create(node, timeout_s=600)
    assert node.sandboxes.statistics().running == 2
    await doomed.mailbox.ask(Pause("full"))  # frozen in memory
    fake.runtime.faults.fail_next("thaw")
    with pytest.raises(SandboxNotRunning, match="is failed"):
        await doomed.mailbox.ask(Resume(60))  # its runtime breaks as it thaws
    await doomed.stopped.wait()
    assert doomed.state is lc.State.FAILED  # and so it is reported
    assert [a.sandbox_id for a in node.list()] == [other.sandbox_id]
    assert not doomed.workdir.exists()
    assert doomed.sandbox_id not in fake.runtime.sandboxes
    assert node.meta.store.get_sandbox(doomed.sandbox_id) is None
    assert node.sandboxes.get(doomed.sandbox_id) is None
    assert node.sandboxes.statistics().running == 1
    # the other one pauses and resumes as ever; new ones start
    await other.mailbox.ask(Pause("full"))
    assert await other.mailbox.ask(Resume(60)) is True
    third = await create(node)
    assert third.state is lc.State.RUNNING and other.state is lc.State.RUNNING


async def test_an_upload_that_fails_is_restarted_and_the_snapshot_becomes_durable(
    clock: trio.testing.MockClock,
    autojump: AutoJump,
    tmp_path: Path,
    fake: FakeHost,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    real = aenv.node.durable.upload_snapshot
    calls: list[float] = []

    async def fails_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(trio.current_time())
        if len(calls) == 1:
            raise RuntimeError("the upload broke")
        return await real(*args, **kwargs)

    monkeypatch.setattr(aenv.node.durable, "upload_snapshot", fails_once)
    config = node_config(tmp_path, store_url=f"file://{tmp_path / 'store'}")
    async with open_test_node(config, fake) as node:
        source = await create(node)
        with caplog.at_level(logging.WARNING, logger="aenv.supervisor"):
            doc = await node.snapshot(source, "mine", memory=True, wait_s=60)
            assert doc["storage"] == "uploading"
            durable = await node.durable.wait_durable(doc["snapshotID"])
        assert durable["storage"] == "durable" and durable["storageError"] is None
        assert len(calls) == 2 and 0 < calls[1] - calls[0] <= 1.0  # backoff (jittered)
        assert f"upload {doc['snapshotID']} failed" in caplog.text
        assert node.services.statistics().restarts == 1
        assert node.services.statistics().failed == 0
        assert any((tmp_path / "store").rglob("*"))


async def test_a_store_gc_that_keeps_failing_is_given_up_and_the_node_serves_on(
    clock: trio.testing.MockClock,
    autojump: AutoJump,
    tmp_path: Path,
    fake: FakeHost,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs: list[float] = []

    async def broken(*args: Any, **kwargs: Any) -> Any:
        runs.append(trio.current_time())
        raise RuntimeError("the collector broke")

    monkeypatch.setattr(aenv.node.durable, "collect_garbage", broken)
    config = node_config(tmp_path, store_url=f"file://{tmp_path / 'store'}")
    async with open_test_node(config, fake) as node:
        source = await create(node, timeout_s=600)
        doc = await node.snapshot(source, "mine", memory=True, wait_s=60)
        await node.durable.wait_durable(doc["snapshotID"])
        await node.snapshots.delete(doc["snapshotID"])  # deleted from the store: a GC runs
        attempts = JOB_RESTARTS.max_restarts + 1
        await autojump.until(lambda: len(runs) == attempts)
        await autojump.until(lambda: node.services.get("store gc") is None)
        assert node.services.statistics().failed == 1
        await trio.sleep(300)
        assert len(runs) == attempts  # given up
        other = await create(node)
        assert other.state is lc.State.RUNNING and source.state is lc.State.RUNNING


async def test_stopping_the_node_stops_every_child_within_its_grace(
    clock: trio.testing.MockClock, autojump: AutoJump, tmp_path: Path, fake: FakeHost
) -> None:
    ended: dict[str, float] = {}

    def recording(name: str) -> Any:
        async def child(stop: StopToken) -> None:
            try:
                await trio.sleep_forever()  # never looks at `stop`
            finally:
                ended[name] = trio.current_time()

        return child

    config = node_config(tmp_path, hibernate_memory_low_pct=10.0)
    async with open_test_node(config, fake) as node:
        actors = [await create(node, timeout_s=600) for _ in range(2)]
        await actors[1].mailbox.ask(Pause("full"))
        slow = node.services.start_soon("slow", recording("slow"), grace_s=3.0)
        stuck = node.services.start_soon("stuck", recording("stuck"), grace_s=1000.0)
        background = recording("background")
        node.start_background(lambda: background(StopToken()), "background")
        watcher = node.services.get("memory-pressure")
        assert watcher is not None and watcher.state is ChildState.RUNNING
        await trio.sleep(1)
        t0 = trio.current_time()
    assert ended == {"background": t0, "slow": t0 + 3, "stuck": t0 + SERVICES_STOP_S}
    assert slow.state is stuck.state is ChildState.STOPPED
    assert watcher.state is ChildState.STOPPED and watcher.ended_at == t0  # it heeded the stop
    # then the sandboxes: cancelled at once, each torn down by its own `finally`
    assert trio.current_time() == t0 + SERVICES_STOP_S + T.stop_s
    assert node.services.statistics().running == node.sandboxes.statistics().running == 0
    assert actors[0].stopped.is_set() and actors[1].stopped.is_set()
    assert fake.leftovers() == []


async def test_a_snapshot_deleted_while_its_upload_builds_packs_ends_the_upload_quietly(
    clock: trio.testing.MockClock,
    autojump: AutoJump,
    tmp_path: Path,
    fake: FakeHost,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The delete removes the memory image the upload is reading before it stops
    the upload: the upload ends without a failure (a restart, once a crash of
    the node) and nothing is stored."""
    real = upload_module.build_pack
    gate = threading.Event()
    ids: list[str] = []
    built: list[bool] = []

    def deleted_first(*args: Any, **kwargs: Any) -> Any:
        built.append(True)
        gate.wait(30)
        # a delete's first steps (its record, then its files), before it stops the upload
        trio.from_thread.run(node.meta.run, node.meta.store.delete_snapshot, ids[0])
        shutil.rmtree(node.snapshots.root / ids[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(upload_module, "build_pack", deleted_first)
    config = node_config(tmp_path, store_url=f"file://{tmp_path / 'store'}")
    async with open_test_node(config, fake) as node:
        source = await create(node, timeout_s=600)
        doc = await node.snapshot(source, "mine", memory=True, wait_s=60)
        ids.append(doc["snapshotID"])
        gate.set()
        await autojump.until(lambda: node.services.get(f"upload {ids[0]}") is None)
        stats = node.services.statistics()
        assert built  # the delete came while packs were built
        assert stats.failed == 0 and stats.restarts == 0
        assert node.meta.store.get_snapshot(ids[0]) is None
        assert not [p for p in (tmp_path / "store").rglob("manifests/*")]
        # the node serves on
        await node.snapshot(source, "again", memory=True, wait_s=60)
