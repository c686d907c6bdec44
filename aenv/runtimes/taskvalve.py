"""Ends a sandbox's largest process group before its host tasks run out.

gVisor's ptrace platform (runsc 20240729) makes every guest address space a
host process (a stub) and keeps, in each, a host thread for every sentry
thread that ever switched into it, and one for every sentry thread that ever
made a system call in it; stubs go back to a pool when their address space
ends and are never killed, and their threads are never freed. So a sandbox
holds about `stubs x 2 x sentry threads` host tasks, and both grow with how
many guest processes run at once: a fork bomb held at the process limit
(128) reaches ~130 stubs and ~240 sentry threads within seconds, and then
fills in that product (up to ~60,000) at dozens of tasks a second until the
sandbox's `pids.max` is reached and the sentry dies, unable to make a thread.
Nothing but the sentry's exit frees them (systrap, whose threads are bounded,
does not have this).

The node cannot stop the growth, but it can stop what drives it before the
sandbox dies: `watch_tasks` reads the cgroup's task count; once it reaches
`MARK_SHARE` of the limit it signals envd (`aenv.envd.taskguard`), which kills
the guest's largest process group, like an OOM killer for tasks. The next
mark is `STEP_SHARE` of the limit above the count then, since what the
sandbox already holds stays held. The sandbox, envd and its other processes
live on; each signal is reported through `on_event`.

Every running sandbox has a valve, most of them idle, so a read costs what
it must and no more: the next one is due when the count could have reached
the mark growing at `MAX_GROWTH` tasks a second (at most `MAX_POLL_S` on),
and every `POLL_S` once it is that close. Growing no faster than that, the
count is seen at the mark within `POLL_S` of reaching it, as if it were read
every `POLL_S`; an idle sandbox far below it is read every few seconds.

`step` and `next_read` are the decisions, without IO.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger("aenv.taskvalve")

# Signal envd at this share of the sandbox's host task limit ...
MARK_SHARE = 0.5
# ... and again each time the count grows by this share of it after that.
STEP_SHARE = 1 / 16
# Read the count every POLL_S near the mark, and never less often than
# MAX_POLL_S; far below it, when it could reach the mark growing at
# MAX_GROWTH tasks a second. The fastest growth measured, a fork bomb held at
# the process limit, was ~360 a second over its first 5 s and at most ~1,000
# over any 0.5 s (docs/performance.md); the limit is twice the first mark, so
# a count growing up to about twice MAX_GROWTH is still seen before the limit.
POLL_S = 0.5
MAX_POLL_S = 5.0
MAX_GROWTH = 2000
# What envd (pid 1) takes as "end your largest process group": the one
# `aenv.envd.taskguard` waits for (runtimes may not import envd; a test keeps
# the two in step).
ENVD_SIGNAL = signal.SIGUSR2


def first_mark(limit: int) -> int:
    return max(1, int(limit * MARK_SHARE))


def mark_after(current: int, limit: int) -> int:
    """The next mark once the count is `current`: a step of the limit above it."""
    return current + max(1, int(limit * STEP_SHARE))


def step(current: int, limit: int, mark: int) -> tuple[bool, int]:
    """(signal envd now, the next mark) at `current` host tasks of `limit`."""
    if current < mark:
        return False, mark
    return True, mark_after(current, limit)


def next_read(current: int, mark: int) -> float:
    """Seconds until the count, `current` now, is read again: when it could
    reach `mark` growing at `MAX_GROWTH`, within [`POLL_S`, `MAX_POLL_S`]."""
    return min(MAX_POLL_S, max(POLL_S, (mark - current) / MAX_GROWTH))


async def watch_tasks(
    read_current: Callable[[], int | None],
    limit: int,
    signal_guest: Callable[[], Awaitable[None]],
    on_event: Callable[[str], None],
) -> None:
    """Until cancelled (or the count cannot be read: the sandbox is gone): signal
    envd each time the host task count passes a mark (`step`), reading it when
    `next_read` says. `read_current` is called on the event loop, so it must
    not block: a read of a cgroup's `pids.current` (a kernel counter, no disk)
    costs less than handing it to a worker thread would."""
    await trio.lowlevel.checkpoint()
    current = read_current()
    # (what a sandbox taken over or restored holds already is no reason to act)
    mark = max(first_mark(limit), mark_after(current or 0, limit))
    while current is not None:
        fire, mark = step(current, limit, mark)
        if fire:
            on_event(
                f"host tasks near the sandbox's limit ({current} of {limit}): "
                "its largest process group is ended"
            )
            try:
                await signal_guest()
            except Exception as exc:  # e.g. runsc refused: the next mark tries again
                log.warning("signalling envd failed: %s", exc)
        await trio.sleep(next_read(current, mark))
        current = read_current()
