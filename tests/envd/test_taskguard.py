"""envd's task guard: which process group it ends, and ending one for real at the signal."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import trio

from aenv.envd import taskguard
from aenv.envd.taskguard import largest_group, read_members


def test_largest_group_is_chosen_never_a_spared_one() -> None:
    members = [(1, 1, "envd"), (2, 1, "envd"), (3, 1, "envd")]
    members += [(10 + i, 10, "bash") for i in range(5)]
    members += [(20 + i, 20, "python3") for i in range(2)] + [(22, 20, "sh")]
    assert largest_group(members, spare={1}, least=2) == (10, 5, "bash")
    assert largest_group(members, spare={1, 10}, least=2) == (20, 3, "python3")
    # a small group is left alone: what drives the runtime's growth is a large one
    assert largest_group(members, spare={1, 10}, least=4) is None
    assert largest_group([(5, 0, "kthread")], spare=set()) is None
    assert largest_group([], spare=set()) is None


def test_members_are_read_from_proc() -> None:
    me = {pid: (pgid, name) for pid, pgid, name in read_members()}
    assert me[os.getpid()][0] == os.getpgrp()


async def test_the_signal_ends_the_largest_group_and_says_so() -> None:
    # a group of three (a shell and two children), and one of one
    bomb = subprocess.Popen(  # noqa: ASYNC220 (started once, before any task)
        ["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True
    )
    lone = subprocess.Popen(["sleep", "60"], start_new_session=True)  # noqa: ASYNC220
    ours = {bomb.pid, lone.pid, os.getpgrp()}
    reports: list[str] = []
    try:
        # only these groups are visible to it: the test must not end anything else
        def members() -> list[tuple[int, int, str]]:
            return [m for m in read_members() if m[1] in ours]

        def started() -> None:
            deadline = time.monotonic() + 10
            while sum(m[1] == bomb.pid for m in members()) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)

        await trio.to_thread.run_sync(started)
        said = trio.Event()

        def report(line: str) -> None:
            reports.append(line)
            said.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: taskguard.end_largest_group_on_signal(
                    members=members, report=report, least=2
                )
            )
            await trio.sleep(0.1)
            os.kill(os.getpid(), taskguard.SIGNAL)
            with trio.fail_after(10):
                await said.wait()
            nursery.cancel_scope.cancel()
        assert bomb.wait(timeout=10) == -9
        assert lone.poll() is None  # the smaller group lives on
        assert f"killed process group {bomb.pid} (3 processes, " in reports[0]
        # (its sleeps are zombies until the host's init collects them)
        assert all(_dead(pid) for pid, pgid, _ in read_members() if pgid == bomb.pid)
    finally:
        for p in (bomb, lone):
            if p.poll() is None:
                p.kill()
                p.wait()


def _dead(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")
