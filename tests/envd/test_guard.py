"""envd's OOM killer and process limit (`aenv.envd.guard`), without a sandbox.

The decisions are pure; `watch_memory` runs with fake /proc readings and a
fake kill under trio's autojump clock. (The real thing, in gVisor, is
tests/e2e/test_pressure.py.)
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from aenv.envd.guard import (
    POLL_MAX_S,
    POLL_MIN_S,
    Proc,
    free_bytes,
    limit_processes,
    name_of,
    orphans,
    poll_interval,
    read_procs,
    read_zombies,
    reap_orphans,
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


async def test_victim_is_ready_before_memory_runs_out(autojump_clock: trio.abc.Clock) -> None:
    # under a fork bomb a scan of every process is slow: once memory runs low
    # the victim is chosen in advance, and the kill needs no scan
    used = {"anon": 100}
    procs = {1: Proc(1, "?", 40 * MiB), 12: Proc(12, "?", 300 * MiB)}
    procs.update({pid: Proc(pid, "?", MiB) for pid in range(100, 356)})  # the bomb
    scans: list[float] = []
    killed: list[int] = []
    lines: list[str] = []

    def scan() -> list[Proc]:
        scans.append(trio.current_time())
        return list(procs.values())

    def kill(pid: int) -> None:
        killed.append(pid)
        del procs[pid]
        used["anon"] = 230

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: watch_memory(
                meminfo=lambda: meminfo(512, used["anon"]),
                procs=scan,
                kill=kill,
                alive=lambda pid: pid in procs,
                report=lines.append,
                name=lambda pid: {12: "python3"}.get(pid, "bash"),
            )
        )
        await trio.sleep(5)
        assert scans == []  # plenty free: no scan at all
        used["anon"] = 420  # less than a quarter free: the victim is chosen
        await trio.sleep(1)
        assert scans and killed == []
        before = len(scans)
        used["anon"] = 530
        await trio.sleep(0.1)
        assert killed == [12]
        assert len(scans) == before  # the kill used the choice made in advance
        nursery.cancel_scope.cancel()
    [kill_event] = parse_kills("\n".join(lines))
    assert (kill_event.pid, kill_event.name) == (12, "python3")


def test_read_procs_gives_resident_sets_and_name_of_names() -> None:
    me = [p for p in read_procs() if p.pid == os.getpid()]
    assert me and me[0].rss_bytes > MiB
    assert name_of(os.getpid()) == Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    assert name_of(1 << 30) == "?"


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


def test_orphans_are_zombies_seen_twice_that_envd_did_not_start() -> None:
    assert orphans({5, 6, 7}, {5, 7, 9}, managed={7}) == {5}
    assert orphans({5}, set(), managed=()) == set()  # seen once: maybe about to be registered


def test_exited_children_envd_did_not_start_are_collected() -> None:
    me = os.getpid()
    ours = subprocess.Popen(["true"])  # started by "envd": its own task waits for it
    stray = subprocess.Popen(["true"])  # what an orphan is to pid 1
    later: list[subprocess.Popen[bytes]] = []  # exits while it watches

    def settled() -> bool:
        zombies = read_zombies(me)
        return ours.pid in zombies and not ({stray.pid, *(p.pid for p in later)} & zombies)

    async def reaping() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reap_orphans, lambda: {ours.pid})
            await trio.sleep(0.3)
            later.append(await trio.to_thread.run_sync(subprocess.Popen, ["true"]))
            for _ in range(200):
                await trio.sleep(0.05)
                if settled():
                    break
            nursery.cancel_scope.cancel()

    trio.run(reaping)
    # the stray one is gone, the one envd started is left for its waiter
    assert ours.pid in read_zombies(me)
    assert not os.path.exists(f"/proc/{stray.pid}")
    assert not os.path.exists(f"/proc/{later[0].pid}")
    assert ours.wait() == 0


def test_a_burst_of_orphans_is_collected_at_once() -> None:
    # a fork bomb's orphans come by the hundred: each is collected on sight
    # (no look twice while envd starts nothing)
    me = os.getpid()
    strays = [subprocess.Popen(["true"]) for _ in range(100)]
    took = -1.0

    async def reaping() -> None:
        nonlocal took
        async with trio.open_nursery() as nursery:
            t0 = trio.current_time()
            nursery.start_soon(reap_orphans, set)
            for _ in range(200):
                await trio.sleep(0.01)
                if not {p.pid for p in strays} & read_zombies(me):
                    took = trio.current_time() - t0
                    break
            nursery.cancel_scope.cancel()

    trio.run(reaping)
    assert 0 <= took < 1.0


def test_while_envd_starts_a_process_a_new_zombie_waits_a_look() -> None:
    me = os.getpid()
    fresh = subprocess.Popen(["true"])  # as if envd were about to register it
    for _ in range(500):
        if fresh.pid in read_zombies(me):
            break
        time.sleep(0.01)

    async def reaping() -> set[int]:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reap_orphans, set, lambda: 1)
            await trio.sleep(0.05)
            seen = read_zombies(me)
            nursery.cancel_scope.cancel()
        return seen

    assert fresh.pid in trio.run(reaping)  # not collected at first sight
    fresh.wait()
