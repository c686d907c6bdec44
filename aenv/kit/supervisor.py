"""Supervised tasks: restart within a budget, give up loudly, stop on a ladder.

A `Supervisor` owns a nursery and runs named children in it. Each child has a
`RestartPolicy` (when it is restarted: permanent, transient or temporary as in
Erlang/OTP; how often: at most `max_restarts` within `window_s` seconds of
trio's clock, with capped, jittered exponential backoff) and a `Strategy` for
failures (an `Exception` out of the child): restart it, mark it failed and
carry on, or escalate to the supervisor's owner. When the restart budget is
spent the supervisor gives up loudly: it logs, cancels its children and
raises `SupervisionError` to its owner (or, with `give_up=Strategy.FAIL`,
marks the child failed). `trio.Cancelled`, `KeyboardInterrupt` and other
`BaseException`s are never caught.

Stopping is a ladder: `ChildHandle.stop(reason)` sets the child's
`StopToken` (ask nicely), waits up to the child's grace period, then cancels
it; its `finally` blocks run either way (cleanup that must finish belongs
under `trio.move_on_after(seconds, shield=True)`). Leaving
`open_supervisor()` stops the remaining children the same way; cancelling
the owner cancels them at once.

Children are async functions taking the `StopToken`; started with
`await supervisor.start(...)`, they also take `task_status` and report
readiness with `task_status.started(value)`, exactly like `nursery.start`: a
failure before that propagates to the starter and is not restarted.

A one-shot job whose caller wants its outcome (a fork, a snapshot) runs
with `await supervisor.run(name, afn)`: a supervised child like any other
(restarted only if its policy says so, stopped with the supervisor, its
failure logged and never escalated) whose return value or final failure
the caller gets; the caller giving up leaves the job running.
"""

from __future__ import annotations

import enum
import logging
import math
import random
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import trio

__all__ = [
    "ONE_SHOT",
    "ChildHandle",
    "ChildState",
    "ChildStopped",
    "Restart",
    "RestartPolicy",
    "StopToken",
    "Strategy",
    "SupervisionError",
    "Supervisor",
    "SupervisorStatistics",
    "open_supervisor",
    "run_supervisor",
]

log = logging.getLogger("aenv.supervisor")

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Restart(enum.Enum):
    """Which exits of a child are followed by a restart (Erlang/OTP's restart types)."""

    PERMANENT = "permanent"  # any exit: a failure or a normal return
    TRANSIENT = "transient"  # failures only; a normal return ends the child
    TEMPORARY = "temporary"  # never


class Strategy(enum.Enum):
    """What a child's failure does."""

    RESTART = "restart"  # restart it within the policy's budget
    FAIL = "fail"  # log it, mark the child failed, keep its siblings running
    ESCALATE = "escalate"  # stop the supervisor and re-raise the error to its owner


class ChildState(enum.Enum):
    STARTING = "starting"  # running, has not reported readiness yet
    RUNNING = "running"
    BACKOFF = "backoff"  # waiting to be restarted
    STOPPING = "stopping"  # asked to stop, within its grace period
    STOPPED = "stopped"  # stopped on request (nicely or cancelled after the grace period)
    EXITED = "exited"  # returned and not restarted
    FAILED = "failed"  # failed and not restarted
    CANCELLED = "cancelled"  # cancelled with its supervisor or starter

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {ChildState.STOPPED, ChildState.EXITED, ChildState.FAILED, ChildState.CANCELLED}
)


class SupervisionError(Exception):
    """A supervised child used up its restart budget; the supervisor gave up."""

    def __init__(self, message: str, *, supervisor: str, child: str) -> None:
        super().__init__(message)
        self.supervisor = supervisor
        self.child = child


class ChildStopped(Exception):
    """A job run with `Supervisor.run` was stopped (or cancelled) before it finished."""


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    """When and how often a child is restarted.

    At most `max_restarts` restarts within any `window_s` seconds; the one after
    that is refused and the supervisor gives up. The wait before a restart, when
    `n` restarts already happened within the window, is d = min(backoff_max_s,
    backoff_base_s * 2**n) shortened by a random fraction of up to `jitter` of d,
    so failures spread out in time restart quickly and the backoff resets with
    the budget.
    """

    restart: Restart = Restart.TRANSIENT
    max_restarts: int = 3
    window_s: float = 60.0
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if not self.window_s > 0:
            raise ValueError("window_s must be > 0")
        if not 0 <= self.backoff_base_s <= self.backoff_max_s:
            raise ValueError("need 0 <= backoff_base_s <= backoff_max_s")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter must be within [0, 1]")

    def backoff(self, n: int, rng: random.Random) -> float:
        d = min(self.backoff_max_s, self.backoff_base_s * 2.0 ** min(n, 64))
        return d - rng.uniform(0, self.jitter * d)


ONE_SHOT = RestartPolicy(restart=Restart.TEMPORARY)


class StopToken:
    """Handed to a child: how it is asked to stop nicely. Watch `requested` or
    `await wait()`, finish the current piece of work and return."""

    def __init__(self) -> None:
        self._event = trio.Event()
        self.reason: str | None = None

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()

    def _request(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()


class ReadyChildFn(Protocol[T_co]):
    """A child started with `Supervisor.start`: it reports readiness itself."""

    def __call__(
        self, stop: StopToken, *, task_status: trio.TaskStatus[T_co]
    ) -> Awaitable[object]: ...


ChildFn = Callable[[StopToken], Awaitable[object]]


class ChildHandle(Generic[T]):
    """One supervised child, kept by whoever started it; stays valid after it ends.

    `value` is what its latest incarnation passed to `task_status.started`
    (None for children started with `start_soon`)."""

    def __init__(
        self,
        supervisor: Supervisor,
        name: str,
        afn: Callable[..., Awaitable[object]],
        *,
        ready: bool,
        policy: RestartPolicy,
        strategy: Strategy,
        give_up: Strategy,
        grace_s: float,
    ) -> None:
        self.supervisor = supervisor
        self.name = name
        self.policy = policy
        self.strategy = strategy
        self.give_up = give_up
        self.grace_s = grace_s
        self.state = ChildState.STARTING if ready else ChildState.RUNNING
        self.value: T | None = None
        self.result: object = None  # what the child returned, once it exited normally
        self.ended_at: float | None = None  # when it ended (trio's clock)
        self.restarts = 0
        self.failures = 0
        self.error: Exception | None = None  # the latest failure
        self.token = StopToken()
        self._afn = afn
        self._ready = ready
        self._scope = trio.CancelScope()
        self._done = trio.Event()
        self._stop_requested_at = math.inf
        self._stop_grace_s = math.inf  # the grace period of the stop request, once made

    def __repr__(self) -> str:
        return f"<child {self.supervisor.name}/{self.name} {self.state.value}>"

    @property
    def stop_reason(self) -> str | None:
        return self.token.reason

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def busy_or_resting(self, rest_s: float) -> bool:
        """Whether a new child for the same work should wait: this one still runs
        (or backs off between restarts), or it was given up on less than `rest_s`
        seconds ago."""
        if not self.done:
            return True
        if self.state is not ChildState.FAILED or self.ended_at is None:
            return False
        return trio.current_time() - self.ended_at < rest_s

    def request_stop(self, reason: str, *, grace_s: float | None = None) -> None:
        """Ask the child to stop (no more restarts) and cancel it if it is still
        running `grace_s` seconds from now (default: its own grace period). A
        second request can only shorten the grace period; the first reason stays."""
        if self.done:
            return
        if not self.token.requested:
            log.info("%s/%s: stop requested (%s)", self.supervisor.name, self.name, reason)
            self.token._request(reason)
            self._stop_requested_at = trio.current_time()
        if self.state in (ChildState.STARTING, ChildState.RUNNING):
            self.state = ChildState.STOPPING
        grace = self.grace_s if grace_s is None else grace_s
        self._stop_grace_s = min(self._stop_grace_s, grace)
        self._scope.deadline = min(self._scope.deadline, trio.current_time() + grace)

    async def stop(self, reason: str, *, grace_s: float | None = None) -> None:
        """`request_stop`, then wait until the child has ended (its `finally` ran)."""
        self.request_stop(reason, grace_s=grace_s)
        await self.wait()

    async def wait(self) -> None:
        await self._done.wait()


class _Readiness(trio.TaskStatus[Any]):
    """The `task_status` of one incarnation of a ready-reporting child: records
    the value on the handle and, for the first incarnation, passes readiness on
    to the `nursery.start` that runs the child's supervising task."""

    def __init__(self, child: ChildHandle[Any], starter: trio.TaskStatus[None] | None) -> None:
        self.reported = False
        self._child = child
        self._starter = starter

    def started(self, value: Any = None) -> None:
        if self.reported:
            raise RuntimeError("called 'started' twice on the same task status")
        self.reported = True
        self._child.value = value
        if self._child.state is ChildState.STARTING:
            self._child.state = ChildState.RUNNING
        if self._starter is not None:
            self._starter.started()


@dataclass(frozen=True)
class SupervisorStatistics:
    running: int  # children supervised now (starting, running, backing off, stopping)
    restarts: int  # restarts done, all children together
    failures: int  # exceptions caught from children
    failed: int  # children that ended FAILED (given up on, FAIL, escalated, not ready)


class Supervisor:
    """Runs children in a nursery it owns; get one from `open_supervisor` or
    `run_supervisor`. Names are unique among the children it supervises now."""

    def __init__(
        self, name: str, nursery: trio.Nursery, *, grace_s: float, rng: random.Random
    ) -> None:
        self.name = name
        self.grace_s = grace_s
        self._nursery = nursery
        self._rng = rng
        self._live: dict[str, ChildHandle[Any]] = {}
        self._closing = trio.Event()
        self._escalation: BaseException | None = None
        self._restarts = 0
        self._failures = 0
        self._failed = 0

    def __repr__(self) -> str:
        return f"<supervisor {self.name} children={len(self._live)}>"

    def start_soon(
        self,
        name: str,
        afn: ChildFn,
        *,
        policy: RestartPolicy | None = None,
        strategy: Strategy = Strategy.RESTART,
        give_up: Strategy = Strategy.ESCALATE,
        grace_s: float | None = None,
    ) -> ChildHandle[None]:
        """Start `afn(stop_token)` as child `name` and return its handle at once."""
        child: ChildHandle[None] = self._add(name, afn, False, policy, strategy, give_up, grace_s)
        self._nursery.start_soon(self._supervise, child, name=f"{self.name}/{name}")
        return child

    async def start(
        self,
        name: str,
        afn: ReadyChildFn[T],
        *,
        policy: RestartPolicy | None = None,
        strategy: Strategy = Strategy.RESTART,
        give_up: Strategy = Strategy.ESCALATE,
        grace_s: float | None = None,
    ) -> ChildHandle[T]:
        """Start `afn(stop_token, task_status=...)` as child `name` and return its
        handle once it has called `task_status.started(value)` (`handle.value`).
        An error before that is raised here and the child is not restarted."""
        child: ChildHandle[T] = self._add(name, afn, True, policy, strategy, give_up, grace_s)
        await self._nursery.start(self._supervise, child, name=f"{self.name}/{name}")
        return child

    async def run(
        self,
        name: str,
        afn: Callable[[StopToken], Awaitable[T]],
        *,
        policy: RestartPolicy | None = None,
        grace_s: float | None = None,
    ) -> T:
        """Run the one-shot job `afn(stop_token)` as child `name` and return what it
        returns; its failure (once `policy`, by default no restart, allows no more)
        is logged, marks the child failed and is raised here, never escalated; a
        stop raises `ChildStopped`. The job belongs to the supervisor: cancelling
        this call leaves it running."""
        child = self.start_soon(
            name,
            afn,
            policy=policy or ONE_SHOT,
            strategy=Strategy.RESTART,
            give_up=Strategy.FAIL,
            grace_s=grace_s,
        )
        await child.wait()
        if child.state is ChildState.EXITED:
            return child.result  # type: ignore[return-value]
        if child.state is ChildState.FAILED and child.error is not None:
            raise child.error
        raise ChildStopped(f"{self.name}/{name} was stopped ({child.stop_reason or 'cancelled'})")

    def get(self, name: str) -> ChildHandle[Any] | None:
        """The supervised child called `name`, if one is supervised now."""
        return self._live.get(name)

    async def aclose(
        self, reason: str = "supervisor closing", *, grace_s: float | None = None
    ) -> None:
        """Refuse new children, stop every child on the ladder (all at once, each
        with its own grace period unless `grace_s` is given) and wait for them."""
        self._closing.set()
        for child in list(self._live.values()):
            child.request_stop(reason, grace_s=grace_s)
        for child in list(self._live.values()):
            await child.wait()
        await trio.lowlevel.checkpoint()

    def statistics(self) -> SupervisorStatistics:
        return SupervisorStatistics(
            running=len(self._live),
            restarts=self._restarts,
            failures=self._failures,
            failed=self._failed,
        )

    def _add(
        self,
        name: str,
        afn: Callable[..., Awaitable[object]],
        ready: bool,
        policy: RestartPolicy | None,
        strategy: Strategy,
        give_up: Strategy,
        grace_s: float | None,
    ) -> ChildHandle[Any]:
        if give_up is Strategy.RESTART:
            raise ValueError("give_up must be Strategy.FAIL or Strategy.ESCALATE")
        if self._closing.is_set() or self._escalation is not None:
            raise RuntimeError(f"supervisor {self.name} is closing")
        if name in self._live:
            raise ValueError(f"supervisor {self.name} already runs a child called {name!r}")
        child: ChildHandle[Any] = ChildHandle(
            self,
            name,
            afn,
            ready=ready,
            policy=policy or RestartPolicy(),
            strategy=strategy,
            give_up=give_up,
            grace_s=self.grace_s if grace_s is None else grace_s,
        )
        self._live[name] = child
        return child

    async def _supervise(
        self,
        child: ChildHandle[Any],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            with child._scope:
                await self._incarnations(child, task_status)
            if child._scope.cancelled_caught:
                child.state = ChildState.STOPPED
                log.log(
                    # a child stopped without grace is cancelled by design
                    logging.WARNING if child._stop_grace_s > 0 else logging.DEBUG,
                    "%s/%s: still running %gs after the stop request (%s), cancelled",
                    self.name,
                    child.name,
                    trio.current_time() - child._stop_requested_at,
                    child.stop_reason,
                )
        finally:
            if not child.state.finished:
                child.state = ChildState.CANCELLED
            if child.state is ChildState.FAILED:
                self._failed += 1
            if self._live.get(child.name) is child:
                del self._live[child.name]
            child.ended_at = trio.current_time()
            child._done.set()

    async def _incarnations(self, child: ChildHandle[Any], starter: trio.TaskStatus[None]) -> None:
        policy = child.policy
        recent: deque[float] = deque()  # restart times within the window
        awaiting_ready = child._ready
        while True:
            if child.token.requested:
                child.state = ChildState.STOPPED
                return
            failure: Exception | None = None
            readiness = _Readiness(child, starter if awaiting_ready else None)
            try:
                if child._ready:
                    result = await child._afn(child.token, task_status=readiness)
                else:
                    result = await child._afn(child.token)
            except Exception as exc:
                failure = exc
            else:
                child.result = result
            if awaiting_ready and not readiness.reported:
                # as nursery.start: the starter gets the error (or trio's
                # "exited without calling started" RuntimeError), no restart
                if failure is not None:
                    self._count_failure(child, failure)
                    child.state = ChildState.FAILED
                    raise failure
                child.state = ChildState.STOPPED if child.token.requested else ChildState.EXITED
                return
            awaiting_ready = False

            if child.token.requested:
                if failure is None:
                    child.state = ChildState.STOPPED
                else:
                    self._count_failure(child, failure)
                    child.state = ChildState.FAILED
                    log.warning(
                        "%s/%s failed while stopping (%s)",
                        self.name,
                        child.name,
                        child.stop_reason,
                        exc_info=failure,
                    )
                return
            if failure is None:
                if policy.restart is not Restart.PERMANENT:
                    child.state = ChildState.EXITED
                    log.debug("%s/%s exited", self.name, child.name)
                    return
                what = "exited"
            else:
                self._count_failure(child, failure)
                if child.strategy is Strategy.ESCALATE:
                    child.state = ChildState.FAILED
                    failure.add_note(
                        f"escalated by child {child.name!r} of supervisor {self.name!r}"
                    )
                    log.error("%s/%s failed, escalating", self.name, child.name, exc_info=failure)
                    self._escalate(failure)
                    return
                if child.strategy is Strategy.FAIL or policy.restart is Restart.TEMPORARY:
                    child.state = ChildState.FAILED
                    log.error("%s/%s failed", self.name, child.name, exc_info=failure)
                    return
                what = f"failed: {failure!r}"

            now = trio.current_time()
            while recent and now - recent[0] >= policy.window_s:
                recent.popleft()
            if len(recent) >= policy.max_restarts:
                self._give_up(child, what, len(recent), failure)
                return
            delay = policy.backoff(len(recent), self._rng)
            recent.append(now)
            child.state = ChildState.BACKOFF
            log.warning(
                "%s/%s %s; restarting in %.3gs (restart %d of at most %d within %gs)",
                self.name,
                child.name,
                what,
                delay,
                len(recent),
                policy.max_restarts,
                policy.window_s,
                exc_info=failure,
            )
            with trio.move_on_after(delay):
                await child.token.wait()
            if child.token.requested:
                continue
            child.restarts += 1
            self._restarts += 1
            child.state = ChildState.STARTING if child._ready else ChildState.RUNNING

    def _count_failure(self, child: ChildHandle[Any], failure: Exception) -> None:
        child.failures += 1
        child.error = failure
        self._failures += 1

    def _give_up(
        self, child: ChildHandle[Any], what: str, restarts: int, failure: Exception | None
    ) -> None:
        child.state = ChildState.FAILED
        message = (
            f"supervisor {self.name}: child {child.name!r} {what} after {restarts} restarts "
            f"within {child.policy.window_s:g}s; giving up"
        )
        log.error(message, exc_info=failure)
        if child.give_up is Strategy.ESCALATE:
            error = SupervisionError(message, supervisor=self.name, child=child.name)
            error.__cause__ = failure
            self._escalate(error)

    def _escalate(self, error: BaseException) -> None:
        if self._escalation is None:
            self._escalation = error
        self._nursery.cancel_scope.cancel(reason=f"supervisor {self.name} escalated")


@asynccontextmanager
async def open_supervisor(
    name: str = "supervisor",
    *,
    grace_s: float = 5.0,
    rng: random.Random | None = None,
) -> AsyncIterator[Supervisor]:
    """A supervisor for the duration of the block. Leaving the block normally
    stops the remaining children on the ladder (reason "owner left"); an
    exception or cancellation cancels them. An escalation cancels the block
    and is raised from it, unwrapped: `SupervisionError` when a restart budget
    was spent, the child's own exception for `Strategy.ESCALATE`. `grace_s` is
    the children's default grace period; `rng` drives the backoff jitter."""
    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(name, nursery, grace_s=grace_s, rng=rng or random.Random())
        try:
            yield supervisor
            await supervisor.aclose("owner left")
        finally:
            supervisor._closing.set()
    if supervisor._escalation is not None:
        raise supervisor._escalation


async def run_supervisor(
    name: str = "supervisor",
    *,
    grace_s: float = 5.0,
    rng: random.Random | None = None,
    task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`supervisor = await nursery.start(run_supervisor, "name")`: runs until
    `supervisor.aclose()` has stopped its children; escalations are raised
    into the nursery. Options as for `open_supervisor`."""
    async with open_supervisor(name, grace_s=grace_s, rng=rng) as supervisor:
        task_status.started(supervisor)
        await supervisor._closing.wait()
