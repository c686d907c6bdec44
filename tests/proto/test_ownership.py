"""The ownership core with explicit times: renewals, expiry, fencing, takeover.

No IO and no trio: times are numbers on each node's own monotonic clock and
versions are whatever the test names them. The last tests model two clocks
that drift within the bound and a network that delays every message, and
check the one property everything rests on: a holder has stopped serving
before any other node may fence it.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv.proto.ownership import (
    ClaimStatus,
    HolderStatus,
    Join,
    LeaseHolder,
    LeaseState,
    LeaseTiming,
    NodeLease,
    Observer,
    RecordError,
    SandboxClaim,
    check_name,
    claim_key,
    claim_status,
    fenced_lease,
    lease_key,
    moved_claim,
    new_claim,
)

T = LeaseTiming(ttl=9.0, drift=0.01, stop_grace=1.0)


def joined(at: float = 100.0) -> LeaseHolder:
    holder = LeaseHolder("n1", T, url="http://n1")
    plan, lease = holder.join_plan(None, "w0", resume=False)
    assert plan is Join.CREATE and lease.epoch == 1 and lease.state is LeaseState.LIVE
    holder.sending(lease, at)
    holder.written(lease)
    return holder


def test_timing_rules() -> None:
    assert T.renew_every == 3.0
    assert T.serve_until(100.0) == pytest.approx(100 + 9 * 0.99 - 1)
    assert T.stopped_by(100.0) == pytest.approx(100 + 9 * 0.99)
    assert T.fence_after(100.0) == pytest.approx(100 + 9 * 1.01)
    # A holder with a longer ttl or a larger drift in its lease is waited for longer.
    assert T.fence_after(100.0, ttl=20.0, drift=0.05) == pytest.approx(100 + 20 * 1.05)
    # The request rate grows with nodes only: 1,000 nodes renew 1000 / (ttl/3) per second.
    assert LeaseTiming().requests_per_second(1000) == pytest.approx(300.0)
    with pytest.raises(ValueError, match="no serving time"):
        LeaseTiming(ttl=3.0, stop_grace=2.0)
    with pytest.raises(ValueError):
        LeaseTiming(drift=0.7)


def test_records_round_trip_and_reject_garbage() -> None:
    lease = NodeLease(node="n1", epoch=3, state=LeaseState.FENCED, writer="x", ttl=9.0)
    assert NodeLease.decode(lease.encode()) == lease
    claim = SandboxClaim(sid="s1", node="n1", node_epoch=3, epoch=7, writer="y", meta={"a": "b"})
    assert SandboxClaim.decode(claim.encode()) == claim
    for bad in (b"", b"[]", b"{}", claim.encode(), b'{"kind": "node", "v": 99}', b"\xff"):
        with pytest.raises(RecordError):
            NodeLease.decode(bad)
    with pytest.raises(RecordError):
        SandboxClaim.decode(lease.encode())
    assert lease_key("n1") == "cluster/nodes/n1" and claim_key("s1") == "cluster/sandboxes/s1"
    for name in ("", "a/b", "..", ".x", "a b", "x" * 200):
        with pytest.raises(ValueError):
            check_name(name, "node id")


def test_holder_serves_until_its_deadline_and_renewals_move_it() -> None:
    holder = joined(at=100.0)
    assert holder.epoch == 1
    assert holder.status(100.0) is HolderStatus.SERVING
    assert holder.next_renewal_at(100.5) == 103.0
    deadline = holder.serve_until()
    assert deadline == pytest.approx(107.91)
    assert holder.may_serve(107.9) and not holder.may_serve(107.91)
    assert holder.status(108.0) is HolderStatus.SUSPENDED
    # A renewal sent at 103 and applied counts from 103, not from when the answer came.
    renewal = holder.next_renewal("w1", wall=0.0)
    assert (renewal.epoch, renewal.renewals, renewal.writer) == (1, 1, "w1")
    holder.sending(renewal, 103.0)
    holder.written(renewal)
    assert holder.serve_until() == pytest.approx(110.91)
    assert holder.may_serve(110.0)


def test_unreachable_store_stops_the_holder_then_a_late_success_resumes_it() -> None:
    holder = joined(at=100.0)
    holder.sending(holder.next_renewal("w1", 0.0), 103.0)
    holder.failed()
    assert holder.next_renewal_at(103.5) == pytest.approx(103.5 + T.retry_every)
    assert holder.status(108.0) is HolderStatus.SUSPENDED
    # Nobody fenced it: the next swap goes through and it serves again.
    renewal = holder.next_renewal("w2", 0.0)
    holder.sending(renewal, 109.0)
    holder.written(renewal)
    assert holder.status(109.5) is HolderStatus.SERVING
    assert holder.next_renewal_at(109.5) == 112.0


def test_an_answer_lost_but_applied_is_recognised_by_its_writer() -> None:
    holder = joined(at=100.0)
    first = holder.next_renewal("w1", 0.0)
    holder.sending(first, 103.0)
    holder.failed()  # timed out: did it land?
    second = holder.next_renewal("w2", 0.0)
    holder.sending(second, 104.0)
    # The swap of `second` is refused, and reading back shows `first`: it did land.
    assert holder.refused(first) is True
    assert holder.status(104.0) is HolderStatus.SERVING
    assert holder.serve_until() == pytest.approx(T.serve_until(103.0))  # from first's send
    assert not holder.pending


def test_a_fenced_holder_stops_at_once_and_rejoins_with_a_new_epoch() -> None:
    holder = joined(at=100.0)
    holder.sending(holder.next_renewal("w1", 0.0), 103.0)
    fence = fenced_lease(holder.lease, "n1", 1, by="n2", writer="f", ttl=T.ttl)
    assert holder.refused(fence) is False
    assert holder.status(103.1) is HolderStatus.FENCED and holder.epoch is None
    assert not holder.may_serve(103.1)  # long before its old deadline
    plan, lease = holder.join_plan(fence, "w3", resume=False)
    assert plan is Join.SWAP and lease.epoch == 2 and lease.state is LeaseState.LIVE


def test_a_restarted_node_keeps_its_epoch_but_waits_unless_told_the_old_process_is_dead() -> None:
    old = joined(at=100.0)
    assert old.lease is not None
    new = LeaseHolder("n1", T)
    plan, lease = new.join_plan(old.lease, "w9", resume=False)
    assert (plan, lease.epoch) == (Join.WAIT, 1)
    plan, lease = new.join_plan(old.lease, "w9", resume=True)
    assert (plan, lease.epoch) == (Join.SWAP, 1)
    left = LeaseHolder("n1", T)
    _, lease = left.join_plan(NodeLease.decode(old.leaving().encode()), "w10", resume=False)
    assert lease.epoch == 2
    assert old.status(100.0) is HolderStatus.LEFT
    with pytest.raises(RecordError):
        LeaseHolder("n2", T).join_plan(old.lease, "w", resume=True)


def test_claim_status_follows_the_lease() -> None:
    claim = new_claim("s1", "n1", 4, "w", state="running", meta={})
    assert claim.epoch == 1

    def lease(epoch: int, state: LeaseState = LeaseState.LIVE) -> NodeLease:
        return NodeLease(node="n1", epoch=epoch, state=state, writer="x", ttl=9.0)

    assert claim_status(claim, lease(4)) is ClaimStatus.HELD
    assert claim_status(claim, lease(4, LeaseState.FENCED)) is ClaimStatus.ORPHANED
    assert claim_status(claim, lease(4, LeaseState.LEFT)) is ClaimStatus.ORPHANED
    assert claim_status(claim, lease(5)) is ClaimStatus.ORPHANED
    # No lease, or one older than the claim (deleted by hand): fence it first.
    assert claim_status(claim, None) is ClaimStatus.HELD
    assert claim_status(claim, lease(3)) is ClaimStatus.HELD
    moved = moved_claim(claim, "n2", 1, "w2")
    assert (moved.node, moved.node_epoch, moved.epoch, moved.state) == ("n2", 1, 2, "running")
    gone = SandboxClaim(sid="s1", node="n1", node_epoch=4, epoch=1, writer="z", state="deleted")
    assert claim_status(gone, lease(4)) is ClaimStatus.RELEASED
    # Fencing a missing or stale lease ends at least the claim's epoch.
    assert fenced_lease(None, "n1", 4, by="n2", writer="f", ttl=9.0).epoch == 4
    assert fenced_lease(lease(3), "n1", 4, by="n2", writer="f", ttl=9.0).epoch == 4


def test_observer_waits_the_window_from_the_first_read_of_a_version() -> None:
    obs = Observer(T)
    lease = NodeLease(node="n1", epoch=1, state=LeaseState.LIVE, writer="a", ttl=9.0, drift=0.01)
    assert obs.fence_at("n1") is None and not obs.may_fence("n1", "E1", 1000.0)
    obs.saw("n1", "E1", lease, 50.0)
    obs.saw("n1", "E1", lease, 55.0)  # the same version again: the window keeps its start
    assert obs.fence_at("n1") == pytest.approx(50 + 9 * 1.01)
    assert not obs.may_fence("n1", "E1", 59.08)
    assert obs.may_fence("n1", "E1", 59.09)
    # A renewal (new version) starts the window again.
    obs.saw("n1", "E2", lease, 58.0)
    assert not obs.may_fence("n1", "E2", 60.0)
    assert not obs.may_fence("n1", "E1", 70.0)  # the old version is not the current one
    assert obs.may_fence("n1", "E2", 58 + 9.09)
    # A missing lease is a version too.
    obs.saw("n3", None, None, 10.0)
    assert obs.fence_at("n3") == pytest.approx(10 + 9 * 1.01)
    obs.forget("n3")
    assert obs.fence_at("n3") is None


def test_a_partitioned_holder_stops_before_anyone_may_fence_it() -> None:
    """Both clocks read the same here (the drift tests below vary them)."""
    holder = joined(at=0.0)
    obs = Observer(T)
    # The watcher's read of the join write arrives at 0.2; then the holder is cut off.
    assert holder.lease is not None
    obs.saw("n1", "E0", holder.lease, 0.2)
    for t in (3.0, 6.0, 9.0):
        holder.sending(holder.next_renewal(f"w{t}", 0.0), t)
        holder.failed()
    fence_at = obs.fence_at("n1")
    assert fence_at is not None
    assert not holder.may_serve(T.stopped_by(0.0) - T.stop_grace)
    assert T.stopped_by(0.0) <= fence_at


@given(
    holder_rate=st.floats(1 - T.drift, 1 + T.drift),
    watcher_rate=st.floats(1 - T.drift, 1 + T.drift),
    holder_offset=st.floats(-1e6, 1e6),
    watcher_offset=st.floats(-1e6, 1e6),
    to_store=st.floats(0, 5),
    store_to_read=st.floats(0, 20),
    read_back=st.floats(0, 5),
)
def test_drifting_clocks_and_slow_networks_never_overlap(
    holder_rate: float,
    watcher_rate: float,
    holder_offset: float,
    watcher_offset: float,
    to_store: float,
    store_to_read: float,
    read_back: float,
) -> None:
    """Real time r; each node's clock reads rate * r + offset. The holder sends its
    last successful renewal at r=10; it is applied `to_store` later; the watcher's
    first read of it is served `store_to_read` after that and arrives `read_back`
    later. In real time, the holder has stopped before the watcher may fence."""

    def holder_clock(r: float) -> float:
        return holder_rate * r + holder_offset

    def watcher_clock(r: float) -> float:
        return watcher_rate * r + watcher_offset

    holder = LeaseHolder("n1", T)
    _, lease = holder.join_plan(None, "w", resume=False)
    holder.sending(lease, holder_clock(10.0))
    holder.written(lease)
    stopped_local = T.stopped_by(holder_clock(10.0))
    stopped_real = (stopped_local - holder_offset) / holder_rate

    arrival_real = 10.0 + to_store + store_to_read + read_back
    obs = Observer(T)
    obs.saw("n1", "E", lease, watcher_clock(arrival_real))
    fence_local = obs.fence_at("n1")
    assert fence_local is not None
    fence_real = (fence_local - watcher_offset) / watcher_rate
    assert stopped_real <= fence_real + 1e-6
    # And the holder's serving deadline comes stop_grace (of its clock) before that.
    serve_until = holder.serve_until()
    assert serve_until is not None
    assert (serve_until - holder_offset) / holder_rate < stopped_real


def test_a_lease_deleted_by_hand_never_brings_back_an_old_epoch() -> None:
    holder = joined(at=0.0)
    holder.sending(holder.next_renewal("w1", 0.0), 3.0)
    assert holder.refused(None) is False  # the lease object is gone: the epoch is over
    plan, lease = holder.join_plan(None, "w2", resume=False)
    assert (plan, lease.epoch) == (Join.CREATE, 2)
