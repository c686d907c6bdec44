"""envd's OOM killer and process limit (`aenv.envd.guard`), without a sandbox.

The decisions are pure; `watch_memory` runs with fake /proc readings and a
fake kill under trio's autojump clock. (The real thing, in gVisor, is
tests/e2e/test_pressure.py.)
"""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest
import trio

from aenv.envd.guard import (
    POLL_MAX_S,
    POLL_MIN_S,
    Proc,
    free_bytes,
    limit_processes,
    poll_interval,
    victim,
    watch_memory,
)
from aenv.proto.oomevent import parse_kills

MiB = 1 << 20


def meminfo(total_mb: int, anon_mb: int, cached_mb: int = 0) -> str:
    return (
        f"MemTotal:  {total_mb * 1024} kB\nMemFree:  0 kB\n"
        f"Cached:  {cached_mb * 1024} kB\nAnonPages:  {anon_mb * 1024} kB\n"
    )


def test_free_goes_below_zero_when_the_guest_overshoots() -> None:
    assert free_bytes(meminfo(512, 100, 12)) == (512 * MiB, 400 * MiB)
    assert free_bytes(meminfo(512, 600)) == (512 * MiB, -88 * MiB)
    # without AnonPages: MemAvailable
    assert free_bytes("MemTotal: 1024 kB\nMemAvailable: 512 kB\n") == (1 << 20, 1 << 19)


def test_poll_is_faster_the_less_is_free() -> None:
    assert poll_interval(512 * MiB) == POLL_MAX_S
    assert poll_interval(0) == POLL_MIN_S
    assert POLL_MIN_S < poll_interval(100 * MiB) < POLL_MAX_S


def test_victim_is_the_largest_process_never_envd() -> None:
    procs = [Proc(1, "python3", 900 * MiB), Proc(7, "bash", 3 * MiB), Proc(9, "node", 300 * MiB)]
    assert victim(procs, spare={1}) == procs[2]
    assert victim([Proc(1, "envd", 1)], spare={1}) is None
    assert victim([Proc(5, "zombie", 0)], spare=()) is None


async def test_watch_kills_one_victim_and_waits_for_it(autojump_clock: trio.abc.Clock) -> None:
    used = {"anon": 100}
    procs = {1: Proc(1, "envd", 40 * MiB), 12: Proc(12, "python3", 0), 13: Proc(13, "sh", MiB)}
    killed: list[int] = []
    lines: list[str] = []

    def kill(pid: int) -> None:
        killed.append(pid)
        used["anon"] = 100
        del procs[pid]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: watch_memory(
                meminfo=lambda: meminfo(512, used["anon"]),
                procs=lambda: list(procs.values()),
                kill=kill,
                alive=lambda pid: pid in procs,
                report=lines.append,
            )
        )
        await trio.sleep(5)
        assert killed == []  # plenty free: nothing happens
        procs[12] = Proc(12, "python3", 520 * MiB)
        used["anon"] = 560
        await trio.sleep(1)
        assert killed == [12]
        await trio.sleep(5)
        assert killed == [12]  # memory came back: nobody else dies
        nursery.cancel_scope.cancel()
    [kill_event] = parse_kills("\n".join(lines))
    assert (kill_event.pid, kill_event.name, kill_event.rss_bytes) == (12, "python3", 520 * MiB)
    assert "python3" in kill_event.describe()


def test_limit_processes_sets_rlimit_nproc_in_the_child() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import resource; print(resource.getrlimit(resource.RLIMIT_NPROC))"],
        preexec_fn=limit_processes(77),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "(77, 77)"
    assert resource.getrlimit(resource.RLIMIT_NPROC) != (77, 77)  # the parent keeps its own


@pytest.mark.parametrize("garbage", ["aenv-oom {", "aenv-oom []", 'aenv-oom {"pid": "x"}', "x"])
def test_console_garbage_is_no_kill(garbage: str) -> None:
    assert parse_kills(garbage) == []
