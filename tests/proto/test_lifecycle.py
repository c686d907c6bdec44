"""The sandbox lifecycle machine: transitions, TTL, and a Hypothesis rule-based walk."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from aenv.proto import lifecycle as lc


def test_ready_arms_deadline() -> None:
    m = lc.Lifecycle()
    assert m.step(lc.Ready(now=10.0, timeout_s=5)) == [lc.ArmDeadline(15.0)]
    assert m.state is lc.State.RUNNING


def test_stale_expire_is_ignored_and_real_one_stops() -> None:
    m = lc.Lifecycle()
    m.step(lc.Ready(0.0, 5))
    m.step(lc.SetTimeout(4.0, 10))
    assert m.step(lc.Expire(5.0)) == []
    assert m.state is lc.State.RUNNING
    assert m.step(lc.Expire(14.0)) == [lc.StopRuntime(lc.StopReason.TIMEOUT)]
    assert m.state is lc.State.STOPPING
    m.step(lc.Stopped())
    assert m.state is lc.State.STOPPED


def test_invalid_transitions_raise() -> None:
    m = lc.Lifecycle()
    with pytest.raises(lc.InvalidTransition):
        m.step(lc.SetTimeout(0.0, 1))
    m.step(lc.Kill())
    with pytest.raises(lc.InvalidTransition):
        m.step(lc.Kill())


def test_crash_while_creating_is_create_failed() -> None:
    m = lc.Lifecycle()
    m.step(lc.Crashed("boom"))
    assert m.state is lc.State.FAILED and m.reason is lc.StopReason.CREATE_FAILED


def test_a_resume_starts_a_new_timeout() -> None:
    m = lc.Lifecycle()
    m.step(lc.Ready(0.0, 100))
    assert m.step(lc.Pause(30.0)) == [lc.Checkpoint()]
    assert m.state is lc.State.PAUSING and m.deadline is None
    m.step(lc.Paused(30.1))
    assert m.step(lc.Resume(1000.0)) == [lc.Restore()]
    # the whole timeout again, not the 70 s left at the pause
    assert m.step(lc.Resumed(1000.2)) == [lc.ArmDeadline(1100.2)]
    assert m.state is lc.State.RUNNING


def test_auto_resume_after_a_timeout_pause_does_not_pause_again_at_once() -> None:
    # create(timeout=5, on_timeout=pause, auto_resume): traffic wakes it later
    m = lc.Lifecycle(auto_pause=True)
    m.step(lc.Ready(0.0, 5))
    m.step(lc.Expire(5.0))
    m.step(lc.Paused(5.1))
    assert m.remaining == 0.0
    m.step(lc.Resume(10.0))  # by traffic: no timeout given
    assert m.step(lc.Resumed(10.1)) == [lc.ArmDeadline(15.1)]
    assert m.step(lc.Expire(10.2)) == []  # the request that woke it is served
    assert m.state is lc.State.RUNNING
    # a later set_timeout is what the next resume re-arms
    m.step(lc.SetTimeout(11.0, 60))
    m.step(lc.Expire(71.0))
    m.step(lc.Paused(71.0))
    m.step(lc.Resume(80.0))
    assert m.step(lc.Resumed(80.0)) == [lc.ArmDeadline(140.0)]


def test_resume_with_timeout_rearms_it() -> None:
    m = lc.Lifecycle()
    m.step(lc.Ready(0.0, 10))
    m.step(lc.Pause(5.0))
    m.step(lc.Paused(5.0))
    m.step(lc.Resume(50.0, timeout_s=300))
    assert m.step(lc.Resumed(51.0)) == [lc.ArmDeadline(351.0)]


def test_auto_pause_on_timeout_and_kill_when_not() -> None:
    m = lc.Lifecycle(auto_pause=True)
    m.step(lc.Ready(0.0, 10))
    assert m.step(lc.Expire(10.0)) == [lc.Checkpoint()]
    assert m.paused_by_timeout
    m2 = lc.Lifecycle(auto_pause=False)
    m2.step(lc.Ready(0.0, 10))
    assert m2.step(lc.Expire(10.0)) == [lc.StopRuntime(lc.StopReason.TIMEOUT)]


def test_failed_pause_keeps_running_failed_resume_stays_paused() -> None:
    m = lc.Lifecycle()
    m.step(lc.Ready(0.0, 60))
    m.step(lc.Pause(20.0))
    assert m.step(lc.PauseFailed(21.0, "disk full")) == [lc.ArmDeadline(61.0)]
    assert m.state is lc.State.RUNNING and m.error == "disk full"
    m.step(lc.Pause(30.0))
    m.step(lc.Paused(30.0))
    m.step(lc.Resume(40.0))
    m.step(lc.ResumeFailed("image corrupt"))
    assert m.state is lc.State.PAUSED
    # the runtime process ending during a pause is expected, not an exit
    assert m.step(lc.Exited(0)) == []
    assert m.step(lc.Kill()) == [lc.StopRuntime(lc.StopReason.KILLED)]


class LifecycleWalk(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = lc.Lifecycle()
        self.now = 0.0

    @rule(dt=st.floats(0, 100))
    def tick(self, dt: float) -> None:
        self.now += dt
        ev = lc.Expire(self.now)
        if self.m.can(ev):
            self.m.step(ev)

    @rule(
        ev=st.sampled_from(["ready", "timeout", "kill", "exit", "crash", "stopped"]),
        t=st.floats(0, 1000),
    )
    def event(self, ev: str, t: float) -> None:
        e: lc.Event = {
            "ready": lc.Ready(self.now, t),
            "timeout": lc.SetTimeout(self.now, t),
            "kill": lc.Kill(),
            "exit": lc.Exited(1),
            "crash": lc.Crashed("x"),
            "stopped": lc.Stopped(),
            "pause": lc.Pause(self.now),
            "paused": lc.Paused(self.now),
            "pause_failed": lc.PauseFailed(self.now, "x"),
            "resume": lc.Resume(self.now, t),
            "resumed": lc.Resumed(self.now),
            "resume_failed": lc.ResumeFailed("x"),
        }[ev]
        if self.m.can(e):
            before = self.m.state
            effects = self.m.step(e)
            if self.m.state is lc.State.STOPPING and before is not lc.State.STOPPING:
                assert any(isinstance(x, lc.StopRuntime) for x in effects)
        else:
            with pytest.raises(lc.InvalidTransition):
                self.m.step(e)

    @invariant()
    def deadline_only_when_running(self) -> None:
        if self.m.state is lc.State.RUNNING:
            assert self.m.deadline is not None
        else:
            assert self.m.deadline is None

    @invariant()
    def banked_time_only_while_paused(self) -> None:
        if self.m.state in (lc.State.PAUSING, lc.State.PAUSED, lc.State.RESUMING):
            assert self.m.remaining is not None and self.m.remaining >= 0
        elif self.m.state is lc.State.RUNNING:
            assert self.m.remaining is None

    @invariant()
    def terminal_states_stay(self) -> None:
        if self.m.state in (lc.State.STOPPED,):
            assert self.m.reason is not None


TestLifecycleWalk = LifecycleWalk.TestCase


def test_recovered_sandbox_starts_paused_with_the_time_it_had_left() -> None:
    m = lc.Lifecycle()
    m.step(lc.Recovered(42.0))
    assert m.state is lc.State.PAUSED and m.deadline is None
    m.step(lc.Resume(1000.0, None))
    m.step(lc.Resumed(1001.0))
    assert m.state is lc.State.RUNNING and m.deadline == 1043.0
    # with the timeout it had, a resume starts that timeout anew
    m = lc.Lifecycle()
    m.step(lc.Recovered(42.0, timeout_s=300.0))
    m.step(lc.Resume(1000.0, None))
    m.step(lc.Resumed(1001.0))
    assert m.deadline == 1301.0
    running = lc.Lifecycle()
    running.step(lc.Ready(0.0, 10))
    with pytest.raises(lc.InvalidTransition):
        running.step(lc.Recovered(5.0))


def test_a_sandbox_taken_back_after_a_restart_keeps_its_deadline() -> None:
    m = lc.Lifecycle()
    assert m.step(lc.Adopted(500.0, 42.0, timeout_s=300.0)) == [lc.ArmDeadline(542.0)]
    assert m.state is lc.State.RUNNING
    assert m.step(lc.Expire(541.0)) == []
    assert m.step(lc.Expire(542.0)) == [lc.StopRuntime(lc.StopReason.TIMEOUT)]
    # its deadline passed while the node was down: it expires at once
    late = lc.Lifecycle(auto_pause=True)
    assert late.step(lc.Adopted(500.0, -10.0, timeout_s=60.0)) == [lc.ArmDeadline(500.0)]
    assert late.step(lc.Expire(500.0)) == [lc.Checkpoint()]
    late.step(lc.Paused(500.5))
    late.step(lc.Resume(600.0))
    assert late.step(lc.Resumed(600.0)) == [lc.ArmDeadline(660.0)]
