"""The sandbox lifecycle as a sans-IO, table-driven state machine.

`Lifecycle.step(event)` validates the event against the transition table,
updates the state and returns the effects the actor must carry out (arm the
TTL deadline, stop the runtime). Time is an argument (`now`, trio's clock in
the actor), never read here, so the machine is tested without any IO.

States: creating -> running -> stopping -> stopped, with failed reachable
from creating and running. `paused` is reserved for the snapshot work.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class State(enum.Enum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class StopReason(enum.Enum):
    KILLED = "killed by request"
    TIMEOUT = "timeout reached"
    EXITED = "sandbox exited"
    NODE_SHUTDOWN = "node shutting down"
    CREATE_FAILED = "create failed"
    CRASHED = "runtime failed"


class InvalidTransition(Exception):
    def __init__(self, state: State, event: object) -> None:
        super().__init__(f"cannot {type(event).__name__} a sandbox that is {state.value}")
        self.state = state


# -- events -------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    now: float
    timeout_s: float


@dataclass(frozen=True)
class SetTimeout:
    now: float
    timeout_s: float


@dataclass(frozen=True)
class Expire:
    now: float


@dataclass(frozen=True)
class Kill:
    reason: StopReason = StopReason.KILLED


@dataclass(frozen=True)
class Exited:
    status: int


@dataclass(frozen=True)
class Crashed:
    error: str


@dataclass(frozen=True)
class Stopped:
    pass


Event = Ready | SetTimeout | Expire | Kill | Exited | Crashed | Stopped

# -- effects ------------------------------------------------------------------


@dataclass(frozen=True)
class ArmDeadline:
    at: float


@dataclass(frozen=True)
class StopRuntime:
    reason: StopReason


Effect = ArmDeadline | StopRuntime

_ALLOWED: dict[type[object], frozenset[State]] = {
    Ready: frozenset({State.CREATING}),
    SetTimeout: frozenset({State.RUNNING}),
    Expire: frozenset({State.RUNNING}),
    Kill: frozenset({State.CREATING, State.RUNNING}),
    Exited: frozenset({State.CREATING, State.RUNNING, State.STOPPING}),
    Crashed: frozenset({State.CREATING, State.RUNNING, State.STOPPING}),
    Stopped: frozenset({State.STOPPING, State.FAILED}),
}


@dataclass
class Lifecycle:
    state: State = State.CREATING
    deadline: float | None = None
    reason: StopReason | None = None
    error: str | None = None

    def can(self, event: Event) -> bool:
        return self.state in _ALLOWED[type(event)]

    def step(self, event: Event) -> list[Effect]:
        if not self.can(event):
            raise InvalidTransition(self.state, event)
        match event:
            case Ready(now, timeout_s) | SetTimeout(now, timeout_s):
                self.state = State.RUNNING
                self.deadline = now + timeout_s
                return [ArmDeadline(self.deadline)]
            case Expire(now):
                if self.deadline is None or now < self.deadline:
                    return []  # a stale wake-up: the deadline moved
                return self._stop(StopReason.TIMEOUT)
            case Kill(reason):
                return self._stop(reason)
            case Exited(status):
                if self.state is State.STOPPING:
                    return []
                self.error = f"sandbox exited with status {status}"
                return self._stop(StopReason.EXITED)
            case Crashed(error):
                self.error = error
                was = self.state
                self.state = State.FAILED
                self.reason = self.reason or (
                    StopReason.CREATE_FAILED if was is State.CREATING else StopReason.CRASHED
                )
                return [] if was is State.STOPPING else [StopRuntime(self.reason)]
            case Stopped():
                if self.state is State.STOPPING:
                    self.state = State.STOPPED
                return []
        raise AssertionError(event)  # pragma: no cover

    def _stop(self, reason: StopReason) -> list[Effect]:
        self.state = State.STOPPING
        self.reason = reason
        self.deadline = None
        return [StopRuntime(reason)]
