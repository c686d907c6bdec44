"""A relief valve on a sandbox's host memory limit, so that the host's OOM
killer is the last line of defence, not the first (cgroup v1 hosts).

envd kills the largest guest process once the guest's memory is used up,
but under load it acts late: a fork bomb leaves it a sliver of the guest's
CPU, a hog keeps allocating meanwhile (gVisor keeps no limit of its own at
the guest's size), and a disk writer's dirty page cache cannot be reclaimed
until it is written back. Measured with all three at once in a 512 MiB
sandbox: the sentry's memory file reached 824 MiB and the host killed the
whole sandbox after ~100 s, though envd went on killing every hog.

So the host's OOM killer is switched off for the sandbox's memory cgroup
(`memory.oom_control`): at its limit, an allocation waits instead of the
sandbox dying, and the kernel signals an eventfd. The valve then raises the
limit by `RESERVE_BYTES` (so the sentry, and envd in it, can run and kill),
waits until what the sandbox holds (page cache left out) is back under the
limit, and closes again. If it is not back within `OPEN_MAX_S`, or the reserve
is used up too, the kernel's OOM killer is switched on again (at the raised
limit) and a sandbox that reaches it dies as before, with its reason; the
valve still closes once the sandbox is back under its limit. So a sandbox
holds at most its limit plus the reserve, and only after envd had its chance.

`step` is the decision, without IO; `open_valve` the IO around it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

log = logging.getLogger("aenv.memvalve")

# How much above its limit a sandbox may go while envd acts ...
RESERVE_BYTES = 128 << 20
# ... for at most this long, looking this often.
OPEN_MAX_S = 15.0
POLL_S = 0.2
# how each opening's event begins (the node notes when a sandbox was at its limit)
LIMIT_REACHED = "host memory limit reached"


class Action(enum.Enum):
    WAIT = "wait"  # nothing to do yet
    CLOSE = "close"  # back under the limit: restore it
    GIVE_UP = "give up"  # the kernel's OOM killer decides


@dataclass(frozen=True)
class Reading:
    """The sandbox's memory cgroup at one look while the valve is open."""

    held_bytes: int  # usage without page cache
    under_oom: bool  # allocations are waiting (the reserve is used up too)
    open_s: float  # how long the valve has been open


def step(r: Reading, limit: int, open_max_s: float = OPEN_MAX_S) -> Action:
    """What to do with an open valve, for a sandbox whose limit is `limit` bytes."""
    if r.held_bytes < limit:
        return Action.CLOSE
    if r.under_oom or r.open_s >= open_max_s:
        return Action.GIVE_UP
    return Action.WAIT


class Cgroup:
    """A v1 memory cgroup's files (blocking)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _read(self, name: str) -> dict[str, int]:
        found: dict[str, int] = {}
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                found[key] = int(value)
        return found

    def limit(self) -> int:
        return int((self.path / "memory.limit_in_bytes").read_text())

    def set_limit(self, limit: int) -> None:
        (self.path / "memory.limit_in_bytes").write_text(str(limit))

    def set_oom_killer(self, on: bool) -> None:
        (self.path / "memory.oom_control").write_text("0" if on else "1")

    def under_oom(self) -> bool:
        return self._read("memory.oom_control").get("under_oom", 0) == 1

    def held_bytes(self) -> int:
        """Usage without the page cache (which the kernel reclaims or writes back)."""
        stat = self._read("memory.stat")
        usage = int((self.path / "memory.usage_in_bytes").read_text())
        cache = stat.get("total_inactive_file", 0) + stat.get("total_active_file", 0)
        return max(usage - cache, 0)

    def oom_eventfd(self) -> int:
        """An eventfd the kernel signals each time the cgroup runs out of memory."""
        efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        try:
            fd = os.open(self.path / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
            try:
                (self.path / "cgroup.event_control").write_text(f"{efd} {fd}")
            finally:
                os.close(fd)
        except BaseException:
            os.close(efd)
            raise
        return efd


async def open_valve(
    cgroup: Cgroup,
    on_event: Callable[[str], None],
    *,
    reserve: int = RESERVE_BYTES,
    poll_s: float = POLL_S,
    open_max_s: float = OPEN_MAX_S,
) -> None:
    """Forever (until cancelled): guard `cgroup` as the module docstring says.
    `on_event` is told of each opening and its outcome. Returns at once where
    the host cannot do it (no v1 memory cgroup, no eventfd)."""
    try:
        efd = await trio.to_thread.run_sync(cgroup.oom_eventfd)
        await trio.to_thread.run_sync(cgroup.set_oom_killer, False)
    except (OSError, AttributeError) as exc:
        log.info("no memory relief valve for %s: %s", cgroup.path.name, exc)
        return
    try:
        while True:
            await trio.lowlevel.wait_readable(efd)
            with contextlib.suppress(BlockingIOError):
                os.read(efd, 8)
            if await trio.to_thread.run_sync(cgroup.under_oom):
                await _relieve(cgroup, on_event, reserve, poll_s, open_max_s)
    finally:
        os.close(efd)
        # unwatched (a pause, a node that stops and leaves it running), a
        # sandbox at its limit must not wait for ever: the kernel decides again
        with contextlib.suppress(OSError):
            cgroup.set_oom_killer(True)


async def _relieve(
    cgroup: Cgroup,
    on_event: Callable[[str], None],
    reserve: int,
    poll_s: float,
    open_max_s: float,
) -> None:
    """One opening, until the sandbox is back under its limit and the valve closed."""
    limit = await trio.to_thread.run_sync(cgroup.limit)
    await trio.to_thread.run_sync(cgroup.set_limit, limit + reserve)
    on_event(
        f"{LIMIT_REACHED} ({limit >> 20} MiB): "
        f"{reserve >> 20} MiB more while the sandbox's OOM killer acts"
    )
    opened = trio.current_time()
    killer = False  # the kernel's OOM killer is on again (at the raised limit)
    while True:
        await trio.sleep(poll_s)
        held, under = await trio.to_thread.run_sync(
            lambda: (cgroup.held_bytes(), cgroup.under_oom())
        )
        took = trio.current_time() - opened
        action = step(Reading(held, under, took), limit, open_max_s)
        if action is Action.CLOSE:
            try:  # (EBUSY: it grew again; the next look closes it)
                await trio.to_thread.run_sync(cgroup.set_limit, limit)
            except OSError:
                continue
            if killer:
                await trio.to_thread.run_sync(cgroup.set_oom_killer, False)
            on_event(f"host memory back under its limit after {took:.1f} s")
            return
        if action is Action.GIVE_UP and not killer:
            killer = True
            on_event(
                f"host memory still {held >> 20} MiB after {took:.1f} s: "
                "the host's OOM killer decides"
            )
            await trio.to_thread.run_sync(cgroup.set_oom_killer, True)
