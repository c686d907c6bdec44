"""envd ends the largest process group when the node says the sandbox's host tasks run out.

Under gVisor's ptrace platform every guest address space is a host process
(a stub) and the sentry keeps, in each, a host thread for every one of its
own threads that ever ran it; none is ever freed while the sandbox runs. A
fork bomb held at the process limit (`aenv.envd.guard`) therefore grows the
sandbox's host tasks by dozens a second, without end, until the host's task
limit of the sandbox (`pids.max`) is reached and the sentry, unable to make
a thread, dies with every process in it. The guest cannot see this; the node
can (`aenv.runtimes.taskvalve`), and when the sandbox nears its host limit it
sends envd, pid 1, `SIGNAL`. envd then plays the part of an OOM killer for
tasks: it kills (SIGKILL) the process group with the most processes (at
least `MIN_GROUP`), never
its own (nor a group led by envd or its spawner, `spare`), and writes one
line to its console saying which. Commands envd starts are each a session
and a group of their own, and a shell's background jobs stay in it, so a
bomb started as one command is one group, however its processes were
orphaned. The sandbox, envd and the other commands live on.

`largest_group` is the decision, without IO.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

import trio

from aenv.envd.guard import proc_stats

SIGNAL = signal.SIGUSR2
# Only a group at least this large is ended: once a bomb is gone the runtime's
# tasks still grow a little with ordinary use (what it holds is never freed),
# and that is no reason to end a user's small commands one after another.
MIN_GROUP = 8
# A group that forks while it is being killed may leave a new member: kill again
# (at most this often) until none is left.
KILL_ROUNDS = 5


def largest_group(
    members: Iterable[tuple[int, int, str]], spare: Collection[int], least: int = MIN_GROUP
) -> tuple[int, int, str] | None:
    """(pgid, processes, most common name) of the group with the most
    processes, from (pid, pgid, name) of every process; never a group in `spare`
    nor group 0 (the kernel's), nor one of fewer than `least`."""
    counts: Counter[int] = Counter()
    names: dict[int, Counter[str]] = {}
    for _pid, pgid, name in members:
        if pgid <= 0 or pgid in spare:
            continue
        counts[pgid] += 1
        names.setdefault(pgid, Counter())[name] += 1
    if not counts:
        return None
    pgid, n = max(counts.items(), key=lambda item: (item[1], item[0]))
    return (pgid, n, names[pgid].most_common(1)[0][0]) if n >= least else None


def read_members(proc: Path = Path("/proc")) -> list[tuple[int, int, str]]:
    """(pid, pgid, name) of every process, zombies included (they hold their
    slot until collected; blocking, stat is one short line)."""
    found: list[tuple[int, int, str]] = []
    for pid, stat in proc_stats(proc):
        head, _, rest = stat.rpartition(")")
        fields = rest.split()
        if len(fields) < 3 or not fields[2].lstrip("-").isdigit():
            continue
        found.append((pid, int(fields[2]), head.partition("(")[2][:64]))
    return found


def _console(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def end_largest_group_on_signal(
    spare: Callable[[], Iterable[int]] = tuple,
    *,
    members: Callable[[], list[tuple[int, int, str]]] = read_members,
    killpg: Callable[[int], None] = lambda pgid: os.killpg(pgid, signal.SIGKILL),
    report: Callable[[str], None] = _console,
    least: int = MIN_GROUP,
) -> None:
    """Forever: at each `SIGNAL`, kill the largest process group but envd's
    own and those of the pids `spare()` names (their groups)."""
    with trio.open_signal_receiver(SIGNAL) as signals:
        async for _ in signals:
            keep = {os.getpgrp(), *(_pgid(pid) for pid in (1, os.getpid(), *spare()))}
            try:
                chosen = largest_group(await trio.to_thread.run_sync(members), keep, least)
            except OSError as exc:  # (/proc unreadable: envd lives on, the node asks again)
                report(f"aenv: host tasks near the sandbox's limit; reading /proc: {exc}")
                continue
            if chosen is None:
                report(
                    f"aenv: host tasks near the sandbox's limit; no process group of "
                    f"{MIN_GROUP} or more to end"
                )
                continue
            pgid, count, name = chosen
            for _ in range(KILL_ROUNDS):
                try:
                    killpg(pgid)
                except ProcessLookupError:
                    break
                await trio.sleep(0.05)
            report(
                f"aenv: host tasks near the sandbox's limit; killed process group {pgid} "
                f"({count} processes, {name})"
            )


def _pgid(pid: int) -> int:
    with contextlib.suppress(OSError):
        return os.getpgid(pid)
    return 0
