"""envd's guard of the sandbox's memory and process count, as a kernel would keep them.

gVisor has no OOM killer of its own: a guest that allocates past the
sandbox's size grows the sentry until the host's memory cgroup kills the
whole sandbox. The node therefore sets the host limit a margin above the
sandbox's size (the guest still sees its size as `MemTotal`), and envd,
which is pid 1 inside, plays the kernel's part: `watch_memory` reads
`/proc/meminfo` and, once the guest's memory is used up, kills the process
with the largest resident set (never envd itself) with SIGKILL, as Linux's
OOM killer would, then waits for that victim to go before it picks another.
It looks more often the less memory is free, so an idle sandbox costs
almost nothing. Choosing a victim means reading every process's resident
set, which under a fork bomb (hundreds of processes, little CPU for envd)
takes long enough for a fast allocator to outgrow the host's headroom; so
once memory runs low (`READY_PCT`) envd keeps its choice ready, refreshed
every `READY_MAX_AGE_S`, and the kill itself needs no scan. Each kill is written to envd's console as one line starting
(`aenv.proto.oomevent`); the node reads those lines into
the sandbox's logs and metrics.

Processes: envd starts every user process with `RLIMIT_NPROC` at the
sandbox's process limit (gVisor enforces it per user, threads included), so
a fork bomb gets `EAGAIN` while envd, whose own limit stays unlimited,
keeps starting commands. (Most are forked by envd's spawner, which holds
the limit as its own so that no code runs between fork and exec:
`aenv.envd.spawner`; `limit_processes` is for the rest.)

Orphans: a process whose parent exits is handed to pid 1, envd, which must
collect it when it exits, as init does; a zombie left uncollected keeps its
slot and counts against its user's process limit, so after a fork bomb (whose
processes are nearly all orphans) the user could start nothing more.
`reap_orphans` waits for SIGCHLD and collects every zombie child of envd that
is not a process envd started itself (those are waited for by their own
task); while envd is starting a process whose pid it does not know yet,
only once it has been a zombie for a moment (`orphans`). It finds them with
waitid(2) (`zombie_child`), not by reading /proc (see its docstring).

`victim`, `free_bytes`, `poll_interval` and `orphans` are the decisions,
without IO.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import trio

from aenv.envd.spawnd import DEFAULT_PROCESS_LIMIT as DEFAULT_PROCESS_LIMIT
from aenv.proto.oomevent import OomKill, format_kill

# Kill when less than this share of the sandbox's memory is free ...
RESERVE_PCT = 1.0
# ... with the victim chosen in advance once less than this share is free, the
# choice at most this old (and its process still there) when it is used.
READY_PCT = 25.0
READY_MAX_AGE_S = 0.5
# ... and look again after at most POLL_MAX_S, at least POLL_MIN_S, sooner the
# less is free (assuming a process allocates at up to ALLOC_RATE bytes a second,
# which is what a guest manages here).
POLL_MIN_S = 0.02
POLL_MAX_S = 0.5
ALLOC_RATE = 1 << 30
# A killed victim gets this long to release its memory before another is chosen.
VICTIM_GRACE_S = 2.0
# An orphan is collected once it has been a zombie at two looks this far apart
# (never a process envd started: it may be just about to be registered).
REAP_AFTER_S = 0.2


@dataclass(frozen=True)
class Proc:
    pid: int
    name: str
    rss_bytes: int


def free_bytes(meminfo: str) -> tuple[int, int]:
    """(MemTotal, what is free of it) from /proc/meminfo's text, in bytes.

    Free is MemTotal minus anonymous and shared memory and page cache,
    which can go below zero (gVisor clamps its own MemFree at zero).
    """
    fields: dict[str, int] = {}
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * 1024
    total = fields.get("MemTotal", 0)
    if "AnonPages" in fields:
        used = fields["AnonPages"] + fields.get("Cached", 0) + fields.get("Buffers", 0)
        return total, total - used
    return total, fields.get("MemAvailable", fields.get("MemFree", total))


def poll_interval(free: int) -> float:
    """How long until the next look, given `free` bytes."""
    return min(POLL_MAX_S, max(POLL_MIN_S, free / ALLOC_RATE))


def victim(procs: Iterable[Proc], spare: Iterable[int]) -> Proc | None:
    """The process to kill: the largest resident set, never one of `spare`."""
    keep = set(spare)
    candidates = [p for p in procs if p.pid not in keep and p.rss_bytes > 0]
    return max(candidates, key=lambda p: (p.rss_bytes, p.pid), default=None)


def orphans(zombies: set[int], earlier: set[int], managed: Collection[int]) -> set[int]:
    """The zombies to collect: seen at this look and the one before, and not
    started by envd."""
    return {pid for pid in zombies & earlier if pid not in managed}


def proc_stats(proc: Path = Path("/proc")) -> Iterator[tuple[int, str]]:
    """(pid, /proc/<pid>/stat) of every process still there when read (blocking)."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            yield int(entry.name), (entry / "stat").read_text()
        except OSError:
            continue


def read_zombies(parent: int, proc: Path = Path("/proc")) -> set[int]:
    """The PIDs of `parent`'s children that are zombies (blocking; cheap)."""
    found: set[int] = set()
    for pid, stat in proc_stats(proc):
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[0] == "Z" and fields[1] == str(parent):
            found.add(pid)
    return found


def zombie_child() -> int | None:
    """The pid of one exited, uncollected child of this process, left
    uncollected (None: none now). The kernel names the oldest first."""
    try:
        info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    return info.si_pid if info is not None and info.si_pid > 0 else None


async def reap_orphans(
    managed: Callable[[], Collection[int]], spawning: Callable[[], int] = lambda: 0
) -> None:
    """As pid 1: collect exited orphans, until cancelled. `managed()`: the PIDs
    of the processes envd started (waited for elsewhere); `spawning()`: how
    many it is starting whose PIDs `managed()` does not name yet.

    It asks the kernel for a zombie child (`zombie_child`) rather than reading
    /proc: under gVisor every /proc/<pid> looked up stays in the sentry's
    memory, so scanning /proc through a fork bomb's churn grew the sandbox's
    host memory by 1-2 MiB a second. Only when the oldest zombie is one envd
    waits for itself does it read /proc for the others behind it.
    """
    me = os.getpid()
    with trio.open_signal_receiver(signal.SIGCHLD) as signals:
        earlier: set[int] = set()  # zombies left alone at the last look
        while True:
            pid = zombie_child()
            if pid is None:
                earlier = set()
                await signals.__anext__()
                continue
            own = managed()
            # (one its task collects: the others behind it, from /proc)
            zombies = read_zombies(me) if pid in own else {pid}
            if spawning():  # one may be a process just started: only those seen before
                gone = orphans(zombies, earlier, own)
            else:
                gone = {z for z in zombies if z not in own}
            for z in gone:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(z, os.WNOHANG)  # noqa: ASYNC222 (a zombie: never blocks)
            earlier = zombies - gone
            if not gone:
                with trio.move_on_after(REAP_AFTER_S):
                    await signals.__anext__()
            else:
                await trio.lowlevel.checkpoint()


def read_procs(proc: Path = Path("/proc")) -> list[Proc]:
    """Every process's resident set (blocking; /proc reads do not wait). Names
    are left out ("?"; `name_of` for the one that matters): statm is one short
    line, status a long page, and this runs over every process when memory is
    short."""
    found: list[Proc] = []
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "statm").read_text().split()
        except OSError:
            continue
        rss = int(fields[1]) * page if len(fields) > 1 and fields[1].isdigit() else 0
        found.append(Proc(int(entry.name), "?", rss))
    return found


def name_of(pid: int, proc: Path = Path("/proc")) -> str:
    """A process's command name, "?" once it is gone."""
    try:
        return (proc / str(pid) / "comm").read_text().strip() or "?"
    except OSError:
        return "?"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


async def watch_memory(
    *,
    meminfo: Callable[[], str] = lambda: Path("/proc/meminfo").read_text(),
    procs: Callable[[], list[Proc]] = read_procs,
    kill: Callable[[int], None] = lambda pid: os.kill(pid, signal.SIGKILL),
    alive: Callable[[int], bool] = _alive,
    report: Callable[[str], None] | None = None,
    name: Callable[[int], str] = name_of,
    spare: Callable[[], Iterable[int]] = tuple,
) -> None:
    """Forever: when the guest's memory is used up, kill the largest process
    (never envd, nor the processes `spare()` names)."""
    me = {1, os.getpid()}
    pending: tuple[int, float] | None = None  # the latest victim and when it was killed
    ready: tuple[Proc | None, float] | None = None  # the next victim and when it was chosen
    say = report or _console
    while True:
        try:
            total, free = free_bytes(meminfo())
        except (OSError, ValueError):
            await trio.sleep(POLL_MAX_S)
            continue
        now = time.monotonic()
        if total > 0 and free < total * RESERVE_PCT / 100:
            if pending is not None and (alive(pending[0]) and now - pending[1] < VICTIM_GRACE_S):
                await trio.sleep(POLL_MIN_S)
                continue
            chosen = ready[0] if ready is not None and now - ready[1] < READY_MAX_AGE_S else None
            if chosen is None or not alive(chosen.pid) or chosen.pid in set(spare()):
                chosen = victim(procs(), me | set(spare()))  # (else chosen already: no scan)
            ready = None
            if chosen is not None:
                label = name(chosen.pid) if chosen.name == "?" else chosen.name
                try:
                    kill(chosen.pid)
                except ProcessLookupError:
                    pass
                else:
                    pending = (chosen.pid, time.monotonic())
                    say(
                        format_kill(
                            OomKill(chosen.pid, label, chosen.rss_bytes, total, time.time())
                        )
                    )
        elif total > 0 and free < total * READY_PCT / 100:
            if ready is None or now - ready[1] >= READY_MAX_AGE_S:
                ready = (victim(procs(), me | set(spare())), time.monotonic())
        else:
            ready = None
        await trio.sleep(poll_interval(max(free, 0)))


def _console(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def limit_processes(limit: int) -> Callable[[], None]:
    """A preexec function that caps the child's processes (threads included) at `limit`."""

    def apply() -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))

    return apply
