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
sandbox dies: `watch_tasks` reads the cgroup's task count every `POLL_S`;
once it reaches `MARK_SHARE` of the limit it signals envd (`aenv.envd.taskguard`),
which kills the guest's largest process group, like an OOM killer for tasks.
The next mark is `STEP_SHARE` of the limit above the count then, since what
the sandbox already holds stays held. The sandbox, envd and its other
processes live on; each signal is reported through `on_event`.

`step` is the decision, without IO.
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
POLL_S = 0.5
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


async def watch_tasks(
    read_current: Callable[[], int | None],
    limit: int,
    signal_guest: Callable[[], Awaitable[None]],
    on_event: Callable[[str], None],
) -> None:
    """Until cancelled (or the count cannot be read: the sandbox is gone): signal
    envd each time the host task count passes a mark (`step`)."""
    # (what a sandbox taken over or restored holds already is no reason to act)
    first = await trio.to_thread.run_sync(read_current)
    mark = max(first_mark(limit), mark_after(first or 0, limit))
    while True:
        current = await trio.to_thread.run_sync(read_current)
        if current is None:
            return
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
        await trio.sleep(POLL_S)
