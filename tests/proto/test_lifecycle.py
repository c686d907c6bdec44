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
        if self.m.state is not lc.State.RUNNING:
            assert self.m.deadline is None or self.m.state is lc.State.FAILED
        else:
            assert self.m.deadline is not None

    @invariant()
    def terminal_states_stay(self) -> None:
        if self.m.state in (lc.State.STOPPED,):
            assert self.m.reason is not None


TestLifecycleWalk = LifecycleWalk.TestCase
