"""The sandbox lifecycle as a sans-IO, table-driven state machine.

`Lifecycle.step(event)` validates the event against the transition table,
updates the state and returns the effects the actor must carry out (arm the
TTL deadline, stop the runtime). Time is an argument (`now`, trio's clock in
the actor), never read here, so the machine is tested without any IO.

States: creating -> running -> stopping -> stopped, with failed reachable
from any live state; running -> pausing -> paused -> resuming -> running for
pause/resume. Time spent paused does not count against the TTL: pausing
banks the time left, resuming re-arms it (or the timeout the caller gives).
A resume starts a new timeout, as E2B's does: the one the caller gives, else
the length of the latest timeout set (at create or by a set-timeout), never
the few seconds (or nothing) a timeout-driven pause banked, so a sandbox
woken by traffic serves it instead of pausing again at once.
A failed pause leaves the sandbox running; a failed resume leaves it paused.
A paused sandbox may first be frozen (still in memory) and later written to
disk: hibernating takes it paused -> pausing -> paused again, its banked TTL
untouched. A paused sandbox recorded before a node restart starts its new life paused
(creating -> paused), with the time it had left; a running one taken back with its
runtime goes creating -> running, its deadline where it was.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class State(enum.Enum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
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
    NETWORK_LOST = "its network was removed from the host"


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


@dataclass(frozen=True)
class Pause:
    now: float


@dataclass(frozen=True)
class Paused:
    now: float


@dataclass(frozen=True)
class PauseFailed:
    now: float
    error: str


@dataclass(frozen=True)
class Resume:
    now: float
    timeout_s: float | None = None


@dataclass(frozen=True)
class Resumed:
    now: float


@dataclass(frozen=True)
class Hibernate:
    """A frozen (paused, still in memory) sandbox is now written to disk."""


@dataclass(frozen=True)
class Recovered:
    """A paused sandbox taken up again after a node restart, with the TTL it had left
    and the length of its latest timeout (None: unknown, a resume re-arms `remaining`)."""

    remaining: float
    timeout_s: float | None = None


@dataclass(frozen=True)
class Adopted:
    """A running sandbox taken back after a node restart: its TTL goes on from
    the time it had left (an expired one expires at once), and a later resume
    re-arms `timeout_s` (None: unknown, then `remaining`)."""

    now: float
    remaining: float
    timeout_s: float | None = None


@dataclass(frozen=True)
class ResumeFailed:
    error: str


Event = (
    Ready
    | Recovered
    | Adopted
    | Hibernate
    | SetTimeout
    | Expire
    | Kill
    | Exited
    | Crashed
    | Stopped
    | Pause
    | Paused
    | PauseFailed
    | Resume
    | Resumed
    | ResumeFailed
)

# -- effects ------------------------------------------------------------------


@dataclass(frozen=True)
class ArmDeadline:
    at: float


@dataclass(frozen=True)
class StopRuntime:
    reason: StopReason


@dataclass(frozen=True)
class Checkpoint:
    """Capture memory and filesystem, then release the runtime."""


@dataclass(frozen=True)
class Restore:
    """Bring the sandbox back from its checkpoint."""


Effect = ArmDeadline | StopRuntime | Checkpoint | Restore

_LIVE = frozenset({State.CREATING, State.RUNNING, State.PAUSING, State.PAUSED, State.RESUMING})
_ALLOWED: dict[type[object], frozenset[State]] = {
    Ready: frozenset({State.CREATING}),
    Recovered: frozenset({State.CREATING}),
    Adopted: frozenset({State.CREATING}),
    Hibernate: frozenset({State.PAUSED}),
    SetTimeout: frozenset({State.RUNNING}),
    Expire: frozenset({State.RUNNING}),
    Kill: _LIVE,
    # a checkpoint that releases the runtime ends its process: not an exit
    Exited: _LIVE | {State.STOPPING},
    Crashed: _LIVE | {State.STOPPING},
    Stopped: frozenset({State.STOPPING, State.FAILED}),
    Pause: frozenset({State.RUNNING}),
    Paused: frozenset({State.PAUSING}),
    PauseFailed: frozenset({State.PAUSING}),
    Resume: frozenset({State.PAUSED}),
    Resumed: frozenset({State.RESUMING}),
    ResumeFailed: frozenset({State.RESUMING}),
}


@dataclass
class Lifecycle:
    state: State = State.CREATING
    deadline: float | None = None
    reason: StopReason | None = None
    error: str | None = None
    # On TTL expiry: pause (True) or kill (False).
    auto_pause: bool = False
    # TTL left when the sandbox was paused (kept across a restart).
    remaining: float | None = None
    # Length of the latest timeout set: what a resume without one re-arms.
    timeout_s: float | None = None
    paused_by_timeout: bool = False

    def can(self, event: Event) -> bool:
        return self.state in _ALLOWED[type(event)]

    def step(self, event: Event) -> list[Effect]:
        if not self.can(event):
            raise InvalidTransition(self.state, event)
        match event:
            case Ready(now, timeout_s) | SetTimeout(now, timeout_s):
                self.state = State.RUNNING
                self.timeout_s = timeout_s
                self.deadline = now + timeout_s
                return [ArmDeadline(self.deadline)]
            case Hibernate():
                # the TTL banked at the pause stays banked
                self.state = State.PAUSING
                return [Checkpoint()]
            case Adopted(now, remaining, timeout_s):
                self.state = State.RUNNING
                self.deadline = now + max(0.0, remaining)
                self.timeout_s = timeout_s if timeout_s is not None else max(0.0, remaining)
                return [ArmDeadline(self.deadline)]
            case Recovered(remaining, timeout_s):
                self.state = State.PAUSED
                self.remaining = max(0.0, remaining)
                self.timeout_s = timeout_s
                return []
            case Expire(now):
                if self.deadline is None or now < self.deadline:
                    return []  # a stale wake-up: the deadline moved
                if self.auto_pause:
                    self.paused_by_timeout = True
                    return self._pause(now)
                return self._stop(StopReason.TIMEOUT)
            case Pause(now):
                self.paused_by_timeout = False
                return self._pause(now)
            case Paused():
                self.state = State.PAUSED
                return []
            case PauseFailed(now, error):
                self.error = error
                self.state = State.RUNNING
                self.deadline = now + (self.remaining or 0.0)
                self.remaining = None
                return [ArmDeadline(self.deadline)]
            case Resume(_, timeout_s):
                self.state = State.RESUMING
                if timeout_s is not None:
                    self.timeout_s = timeout_s
                if self.timeout_s is not None:
                    self.remaining = self.timeout_s
                return [Restore()]
            case Resumed(now):
                self.state = State.RUNNING
                self.deadline = now + (self.remaining or 0.0)
                self.remaining = None
                self.error = None
                return [ArmDeadline(self.deadline)]
            case ResumeFailed(error):
                self.error = error
                self.state = State.PAUSED
                return []
            case Kill(reason):
                return self._stop(reason)
            case Exited(status):
                if self.state in (State.STOPPING, State.PAUSING, State.PAUSED, State.RESUMING):
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
                self.deadline = None
                return [] if was is State.STOPPING else [StopRuntime(self.reason)]
            case Stopped():
                if self.state is State.STOPPING:
                    self.state = State.STOPPED
                return []
        raise AssertionError(event)  # pragma: no cover

    def _pause(self, now: float) -> list[Effect]:
        assert self.deadline is not None
        self.remaining = max(0.0, self.deadline - now)
        self.deadline = None
        self.state = State.PAUSING
        return [Checkpoint()]

    def _stop(self, reason: StopReason) -> list[Effect]:
        self.state = State.STOPPING
        self.reason = reason
        self.deadline = None
        return [StopRuntime(reason)]
