"""Ownership against real stores: a shared directory and moto's S3 server.

Rules: every node is an `Ownership` in this process (one test also starts a
second OS process); stores are real (a `file://` directory under the test's
temp dir, moto on loopback from tests/s3.py, isolated by key prefix). Tests
on the directory store run on a `MockClock` that jumps only after 100 ms of
real idleness, so store calls in worker threads finish before time moves;
tests that involve a real server run on real time with a 1.2 s lease. A
partition from the store is a TCP forwarder in front of moto that the test
cuts and heals; a crash is leaving the `open_ownership` block without
`leave()`. A watcher task checks the one invariant throughout: no two nodes
hold a grant for the same sandbox at the same time.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import textwrap
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from subprocess import PIPE

import pytest
import trio
from trio.testing import MockClock

from aenv.cluster.leases import (
    Claimed,
    NoClaim,
    NotMovable,
    NotOwner,
    NotServing,
    OwnerAlive,
    Ownership,
    OwnershipError,
    open_ownership,
)
from aenv.proto.ownership import ClaimStatus, HolderStatus, LeaseState, LeaseTiming
from aenv.storage.objstore import ObjectStore, RetryPolicy, open_object_store

# Fixtures are imported by name, so test parameters shadow them (F811).
# ruff: noqa: F811
from tests.s3 import MotoS3, s3_faulty, s3_server  # noqa: F401

SLOW = LeaseTiming(ttl=9.0, drift=0.01, stop_grace=1.0)  # on the mock clock
FAST = LeaseTiming(ttl=1.2, drift=0.01, stop_grace=0.2)  # on real time
QUICK_RETRY = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05, transport_retries=0)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clock() -> MockClock:
    return MockClock(autojump_threshold=0.1)


def dir_store(tmp_path: Path) -> ObjectStore:
    return open_object_store((tmp_path / "store").as_uri(), retry=QUICK_RETRY)


def s3_store(server: MotoS3, prefix: str, *, endpoint: str | None = None) -> ObjectStore:
    config = server.config()
    if endpoint is not None:
        config["endpoint"] = endpoint
    return open_object_store(
        server.url(prefix),
        config=config,
        client_options={"allow_http": True, "timeout": "2s", "connect_timeout": "1s"},
        retry=QUICK_RETRY,
    )


async def never_two_owners(nodes: Sequence[Ownership], sids: Sequence[str]) -> None:
    """Forever: fail if two nodes may serve one sandbox at the same moment."""
    while True:
        for sid in sids:
            holders = [o.node for o in nodes if o.grant(sid) is not None]
            assert len(holders) <= 1, f"{sid} served by {holders}"
        await trio.sleep(0.005)


# -- the basics, on the directory store and the mock clock -------------------------------


async def test_renewals_keep_every_claim_at_one_request_per_renewal(
    tmp_path: Path, clock: MockClock
) -> None:
    store = dir_store(tmp_path)
    changes: list[tuple[HolderStatus, int | None]] = []
    async with open_ownership(
        store, node="n1", url="http://n1", timing=SLOW, on_change=lambda *c: changes.append(c)
    ) as own:
        assert own.status is HolderStatus.SERVING and own.epoch == 1
        sids = [f"s{i}" for i in range(50)]
        for sid in sids:
            grant = await own.claim(sid, state="running")
            assert (grant.node_epoch, grant.epoch) == (1, 1)
        before = store.statistics().requests
        t0 = trio.current_time()
        await trio.sleep(60.0)
        # 60 s of renewals every 3 s: 20 compare-and-swaps, whatever the number of claims
        # (a few more if a slow disk made one time out; never one per claim).
        assert 19 <= store.statistics().requests - before < len(sids)
        assert own.lease is not None and own.lease.renewals >= 19
        assert len(own.held()) == 50
        grant = own.grant("s7")
        assert grant is not None and grant.until >= t0 + 60 + SLOW.serve_for - SLOW.renew_every
        assert own.grant("unknown") is None
        view = await own.lookup("s7")
        assert view is not None and view.status is ClaimStatus.HELD
        assert view.claim.node == "n1" and view.owner_url == "http://n1"
    assert changes == [(HolderStatus.SERVING, 1)]


async def test_claim_update_release(tmp_path: Path, clock: MockClock) -> None:
    store = dir_store(tmp_path)
    async with (
        open_ownership(store, node="a", timing=SLOW) as a,
        open_ownership(store, node="b", timing=SLOW) as b,
    ):
        await a.claim("s1", state="running", meta={"template": "base"})
        with pytest.raises(Claimed) as err:
            await b.claim("s1")
        assert err.value.claim.node == "a"
        grant = await a.update("s1", state="paused")
        assert grant.state == "paused" and grant.epoch == 1
        with pytest.raises(NotOwner):
            await b.update("s1", state="running")
        with pytest.raises(OwnerAlive):
            await b.take_over("s1")
        views = await b.list_claims()
        assert [(v.claim.sid, v.claim.state, v.claim.meta) for v in views] == [
            ("s1", "paused", {"template": "base"})
        ]
        await a.release("s1")
        assert a.grant("s1") is None
        assert await b.lookup("s1") is None
        with pytest.raises(NoClaim):
            await b.take_over("s1")
        await b.claim("s1")  # the id is free again
        assert sorted(await b.leases()) == ["a", "b"]


async def test_racing_nodes_in_one_process_each_sandbox_has_one_winner(
    tmp_path: Path, clock: MockClock
) -> None:
    store = dir_store(tmp_path)
    sids = [f"s{i}" for i in range(20)]
    won: dict[str, list[str]] = {sid: [] for sid in sids}
    async with (
        open_ownership(store, node="a", timing=SLOW) as a,
        open_ownership(store, node="b", timing=SLOW) as b,
        open_ownership(store, node="c", timing=SLOW) as c,
    ):

        async def race(own: Ownership, sid: str) -> None:
            try:
                await own.claim(sid)
                won[sid].append(own.node)
            except Claimed:
                pass

        async with trio.open_nursery() as nursery:
            for sid in sids:
                for own in (a, b, c):
                    nursery.start_soon(race, own, sid)
        assert all(len(w) == 1 for w in won.values()), won
        for sid, (winner,) in won.items():
            view = await a.lookup(sid)
            assert view is not None and view.claim.node == winner
            assert [o.node for o in (a, b, c) if o.grant(sid)] == [winner]


async def test_a_dead_nodes_claims_move_only_after_the_window(
    tmp_path: Path, clock: MockClock
) -> None:
    store = dir_store(tmp_path)
    async with open_ownership(store, node="b", timing=SLOW) as b:
        async with open_ownership(store, node="a", url="http://a", timing=SLOW) as a:
            await a.claim("s1", state="paused")
            await a.claim("s2", state="running")
            # While a renews, fencing it fails: it is alive.
            t0 = trio.current_time()
            assert await b.fence("a") is False
            assert trio.current_time() - t0 <= 2 * SLOW.renew_every + 1
        # a crashed (left the block without leave()): its lease stops being renewed.
        with pytest.raises(OwnerAlive):
            await b.take_over("s1")
        # A renewal a had in flight may still land and look like life: ask again, as a
        # caller does while membership says the node is dead.
        for _ in range(3):
            t0 = trio.current_time()
            if await b.fence("a"):
                break
        else:
            pytest.fail("a dead node could not be fenced")
        assert trio.current_time() - t0 >= SLOW.ttl * (1 + SLOW.drift)
        leases = await b.leases()
        assert leases["a"].state is LeaseState.FENCED and leases["a"].fenced_by == "b"
        grant = await b.take_over("s1")
        assert (grant.epoch, grant.node_epoch, grant.state) == (2, 1, "paused")
        view = await b.lookup("s2")
        assert view is not None and view.status is ClaimStatus.ORPHANED
        assert await b.fence("a") is True  # already fenced: at once
        # a comes back (a new process): a new epoch, holding nothing; s2 it may take back.
        async with open_ownership(store, node="a", timing=SLOW) as a:
            assert a.epoch == 2 and a.held() == []
            assert a.grant("s1") is None
            with pytest.raises(Claimed):
                await a.take_over("s1")  # b's now: held by a live node
            grant = await a.take_over("s2")
            assert (grant.epoch, grant.node_epoch) == (2, 2)


async def test_only_a_paused_durable_claim_moves_and_a_drain_hands_claims_over(
    tmp_path: Path, clock: MockClock
) -> None:
    store = dir_store(tmp_path)
    async with open_ownership(store, node="b", timing=SLOW) as b:
        async with open_ownership(store, node="a", timing=SLOW) as a:
            await a.claim("run", state="running")
            await a.claim("parked", state="paused-durable")
            await a.claim("drained", state="running")
            # a drain: the claim goes to b, live, at b's epoch; a no longer holds it
            moved = await a.hand_over("drained", to="b", state="paused-durable")
            assert (moved.node, moved.node_epoch, moved.epoch) == ("b", b.epoch, 2)
            assert a.grant("drained") is None
            with pytest.raises(NotOwner):
                await a.update("drained", state="running")
            grant = await b.take_over("drained", only_from="paused-durable")
            assert (grant.epoch, grant.state) == (2, "paused-durable")
            with pytest.raises(OwnershipError):  # nobody's lease is "c"
                await a.hand_over("run", to="c", state="paused-durable")
        assert await b.fence("a") or await b.fence("a")
        # a running sandbox's memory was only on a: its claim never moves
        with pytest.raises(NotMovable):
            await b.take_over("run", only_from="paused-durable")
        grant = await b.take_over("parked", only_from="paused-durable")
        assert (grant.node_epoch, grant.epoch) == (b.epoch, 2)


async def test_a_restarted_node_keeps_its_epoch(tmp_path: Path, clock: MockClock) -> None:
    store = dir_store(tmp_path)
    async with open_ownership(store, node="a", timing=SLOW) as a:
        await a.claim("s1")
    # Without `resume` it waits until the earlier process' lease has lapsed.
    t0 = trio.current_time()
    async with open_ownership(store, node="a", timing=SLOW) as a:
        assert trio.current_time() - t0 >= SLOW.ttl * (1 + SLOW.drift)
        assert a.epoch == 1 and a.grant("s1") is None  # not known to this process yet
        grant = await a.take_over("s1")  # its own claim, same epoch: granted as it is
        assert (grant.epoch, grant.node_epoch) == (1, 1)
    t0 = trio.current_time()
    async with open_ownership(store, node="a", timing=SLOW, resume=True) as a:
        assert trio.current_time() - t0 < 1 and a.epoch == 1
        await a.leave()
        assert a.status is HolderStatus.LEFT and not a.may_serve()
        with pytest.raises(NotServing):
            await a.claim("s2")
    async with open_ownership(store, node="b", timing=SLOW) as b:
        t0 = trio.current_time()
        grant = await b.take_over("s1")  # a left: no fencing, no waiting
        assert trio.current_time() - t0 < 1 and grant.epoch == 2


async def test_two_processes_race_for_the_same_sandboxes(tmp_path: Path) -> None:
    store_url = (tmp_path / "store").as_uri()
    sids = [f"s{i}" for i in range(40)]
    child = textwrap.dedent(
        f"""
        import json, sys, trio
        from aenv.cluster.leases import Claimed, open_ownership
        from aenv.proto.ownership import LeaseTiming
        from aenv.storage.objstore import open_object_store

        async def main():
            store = open_object_store({store_url!r})
            timing = LeaseTiming(ttl=9.0, drift=0.01, stop_grace=1.0)
            won = []
            async with open_ownership(store, node="p2", timing=timing) as own:
                print("ready", flush=True)
                await trio.to_thread.run_sync(sys.stdin.readline)

                async def one(sid):
                    try:
                        await own.claim(sid)
                        won.append(sid)
                    except Claimed:
                        pass

                async with trio.open_nursery() as nursery:
                    for sid in {sids!r}:
                        nursery.start_soon(one, sid)
                await own.leave()
            print(json.dumps(won), flush=True)

        trio.run(main)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", child], cwd=ROOT, env=env, stdin=PIPE, stdout=PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None
    lines = TextReceiveStream(proc.stdout)
    try:
        store = open_object_store(store_url)
        mine: list[str] = []
        async with open_ownership(store, node="p1", timing=SLOW) as own:
            with trio.fail_after(30):
                assert await lines.line() == "ready"
            await proc.stdin.send_all(b"go\n")

            async def one(sid: str) -> None:
                try:
                    await own.claim(sid)
                    mine.append(sid)
                except Claimed:
                    pass

            async with trio.open_nursery() as nursery:
                for sid in reversed(sids):
                    nursery.start_soon(one, sid)
            with trio.fail_after(30):
                theirs = json.loads(await lines.line())
                assert await proc.wait() == 0
            assert sorted(mine + theirs) == sorted(sids)  # each exactly once
            for view in await own.list_claims():
                assert view.claim.node == ("p1" if view.claim.sid in mine else "p2")
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


class TextReceiveStream:
    """Lines of a child's stdout."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buf = b""

    async def line(self) -> str:
        while b"\n" not in self._buf:
            data = await self._stream.receive_some(4096)
            if not data:
                raise EOFError("child closed its stdout")
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode().strip()


# -- real S3: races, partitions and a fenced node coming back ------------------------------


class Forwarder:
    """A TCP forwarder on loopback to `target_port` that can be cut (every
    connection closed, new ones closed at once) and healed."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.cut = False
        self._pairs: set[trio.CancelScope] = set()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._pair, listeners)

    def sever(self) -> None:
        self.cut = True
        for scope in list(self._pairs):
            scope.cancel()

    def heal(self) -> None:
        self.cut = False

    async def _pair(self, client: trio.SocketStream) -> None:
        async with client:
            if self.cut:
                return
            with trio.CancelScope() as scope:
                self._pairs.add(scope)
                try:
                    upstream = await trio.open_tcp_stream("127.0.0.1", self.target_port)
                    async with upstream, trio.open_nursery() as nursery:
                        nursery.start_soon(_pump, client, upstream)
                        nursery.start_soon(_pump, upstream, client)
                except OSError:
                    pass
                finally:
                    self._pairs.discard(scope)


async def _pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
    try:
        while data := await src.receive_some(65536):
            await dst.send_all(data)
        await dst.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass


@pytest.fixture
async def forwarder(s3_server: MotoS3) -> AsyncIterator[Forwarder]:
    fwd = Forwarder(s3_server.port)
    async with trio.open_nursery() as nursery:
        await nursery.start(fwd.serve)
        yield fwd
        nursery.cancel_scope.cancel()


async def test_racing_nodes_on_s3_each_sandbox_has_one_winner(s3_server: MotoS3) -> None:
    prefix = f"own/{secrets.token_hex(6)}"
    sids = [f"s{i}" for i in range(10)]
    won: dict[str, list[str]] = {sid: [] for sid in sids}
    async with (
        open_ownership(s3_store(s3_server, prefix), node="a", timing=FAST) as a,
        open_ownership(s3_store(s3_server, prefix), node="b", timing=FAST) as b,
        open_ownership(s3_store(s3_server, prefix), node="c", timing=FAST) as c,
    ):

        async def race(own: Ownership, sid: str) -> None:
            try:
                await own.claim(sid)
                won[sid].append(own.node)
            except Claimed:
                pass

        async with trio.open_nursery() as nursery:
            for sid in sids:
                for own in (a, b, c):
                    nursery.start_soon(race, own, sid)
        assert all(len(w) == 1 for w in won.values()), won
        views = {v.claim.sid: v.claim.node for v in await a.list_claims()}
        assert views == {sid: w[0] for sid, w in won.items()}


async def test_a_node_cut_from_the_store_stops_serving_within_its_lease(
    s3_faulty: MotoS3,
) -> None:
    prefix = f"own/{secrets.token_hex(6)}"
    async with open_ownership(s3_store(s3_faulty, prefix), node="a", timing=FAST) as a:
        await a.claim("s1")
        until = a.serve_until()
        assert until is not None
        await trio.to_thread.run_sync(s3_faulty.stop)
        with trio.fail_after(FAST.ttl):
            await a.wait_status(HolderStatus.SUSPENDED)
        # It stopped no later than its deadline from before the cut (renewals failed).
        assert trio.current_time() <= until + FAST.renew_every + 0.2
        assert a.grant("s1") is None and not a.may_serve()
        with pytest.raises(NotServing):
            await a.claim("s2")
        # Nobody fenced it: when the store is back, so is the node, in the same epoch.
        await trio.to_thread.run_sync(s3_faulty.start)
        with trio.fail_after(5):
            await a.wait_status(HolderStatus.SERVING)
        assert a.epoch == 1 and a.grant("s1") is not None


async def test_a_partitioned_owner_stops_before_takeover_and_cannot_renew_after(
    s3_server: MotoS3, forwarder: Forwarder
) -> None:
    prefix = f"own/{secrets.token_hex(6)}"
    via_forwarder = f"http://127.0.0.1:{forwarder.port}"
    suspended_at: list[float] = []

    def on_a(status: HolderStatus, epoch: int | None) -> None:
        if status is HolderStatus.SUSPENDED:
            suspended_at.append(trio.current_time())

    async with (
        open_ownership(
            s3_store(s3_server, prefix, endpoint=via_forwarder),
            node="a",
            timing=FAST,
            on_change=on_a,
        ) as a,
        open_ownership(s3_store(s3_server, prefix), node="b", timing=FAST) as b,
        trio.open_nursery() as watch,
    ):
        watch.start_soon(never_two_owners, [a, b], ["s1"])
        await a.claim("s1", state="running")
        forwarder.sever()
        t0 = trio.current_time()
        assert await b.fence("a") is True
        fenced_at = trio.current_time()
        assert fenced_at - t0 >= FAST.ttl * (1 + FAST.drift)
        # a had stopped serving before b was allowed to fence it.
        assert suspended_at and suspended_at[0] < fenced_at
        grant = await b.take_over("s1")
        assert grant.epoch == 2 and b.grant("s1") is not None
        # The partition heals: a's next renewal is refused; it drops its claims and
        # comes back in a new epoch, holding nothing.
        forwarder.heal()
        with trio.fail_after(5):
            await a.wait_status(HolderStatus.SERVING)
        assert a.epoch == 2 and a.grant("s1") is None
        with pytest.raises(NotOwner):
            await a.update("s1", state="paused")
        view = await a.lookup("s1")
        assert view is not None and view.claim.node == "b" and view.claim.epoch == 2
        watch.cancel_scope.cancel()
