"""The host memory relief valve: its decision, and the valve on a real cgroup v1.

A process in a memory cgroup that allocates past the limit is killed by the
kernel; with the valve open it gets the reserve, finishes, and the limit is
restored once its memory is gone. A process that keeps its memory past the
valve's time is left to the kernel's OOM killer, as before the valve.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from aenv.runtimes import memvalve
from aenv.runtimes.memvalve import Action, Reading, step

MIB = 1 << 20
V1 = Path("/sys/fs/cgroup/memory")


def test_step_closes_once_back_under_the_limit() -> None:
    assert step(Reading(99 * MIB, False, 1.0), 100 * MIB) is Action.CLOSE
    assert step(Reading(99 * MIB, True, 99.0), 100 * MIB) is Action.CLOSE


def test_step_waits_then_gives_up() -> None:
    assert step(Reading(120 * MIB, False, 1.0), 100 * MIB, 15.0) is Action.WAIT
    assert step(Reading(120 * MIB, False, 15.0), 100 * MIB, 15.0) is Action.GIVE_UP
    # the reserve is used up too: no point waiting
    assert step(Reading(120 * MIB, True, 1.0), 100 * MIB, 15.0) is Action.GIVE_UP


@pytest.fixture
def cgroup() -> Iterator[memvalve.Cgroup]:
    if os.geteuid() != 0 or not (V1 / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    path = V1 / f"aenv-valve-test-{secrets.token_hex(4)}"
    path.mkdir()
    try:
        (path / "memory.limit_in_bytes").write_text(str(64 * MIB))
        yield memvalve.Cgroup(path)
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        for _ in range(50):
            try:
                path.rmdir()
                break
            except OSError:
                trio.run(trio.sleep, 0.1)


def _hog(cgroup: memvalve.Cgroup, mib: int, hold_s: float) -> list[str]:
    """A Python process in `cgroup` that touches `mib` MiB and holds it `hold_s` s."""
    procs = cgroup.path / "cgroup.procs"
    code = f"import time; x = bytearray({mib} << 20); time.sleep({hold_s}); print('done')"
    return [
        "sh", "-c", f'echo $$ > {procs} && exec "$0" -c "$1"', sys.executable, code,
    ]  # fmt: skip


async def _run_with_valve(
    cgroup: memvalve.Cgroup, argv: list[str], events: list[str], valve: bool
) -> subprocess.CompletedProcess[bytes]:
    async with trio.open_nursery() as nursery:
        if valve:
            nursery.start_soon(
                lambda: memvalve.open_valve(cgroup, events.append, reserve=64 * MIB, open_max_s=2.0)
            )
            await trio.sleep(0.2)
        proc = await trio.run_process(argv, capture_stdout=True, check=False)
        await trio.sleep(0.5)  # (the valve closes at its next look)
        nursery.cancel_scope.cancel()
    return proc


def test_without_the_valve_the_kernel_kills(cgroup: memvalve.Cgroup) -> None:
    events: list[str] = []
    proc = trio.run(_run_with_valve, cgroup, _hog(cgroup, 96, 0.5), events, False)
    assert proc.returncode == -9


def test_the_valve_lets_a_passing_peak_through(cgroup: memvalve.Cgroup) -> None:
    events: list[str] = []
    proc = trio.run(_run_with_valve, cgroup, _hog(cgroup, 96, 0.5), events, True)
    assert proc.returncode == 0, events
    assert proc.stdout.strip() == b"done"
    assert "host memory limit reached (64 MiB)" in events[0]
    assert "back under its limit" in events[-1]
    assert cgroup.limit() == 64 * MIB  # closed again
    # and the kernel's OOM killer is on again once nobody watches
    assert "oom_kill_disable 0" in (cgroup.path / "memory.oom_control").read_text()


def test_the_valve_gives_up_on_memory_that_stays(cgroup: memvalve.Cgroup) -> None:
    events: list[str] = []
    proc = trio.run(_run_with_valve, cgroup, _hog(cgroup, 96, 3), events, True)
    assert proc.returncode == 0  # it stayed within the reserve ...
    assert any("the host's OOM killer decides" in e for e in events)  # ... past the valve's time
    assert "back under its limit" in events[-1]
    assert cgroup.limit() == 64 * MIB


def test_past_the_reserve_the_kernel_kills(cgroup: memvalve.Cgroup) -> None:
    events: list[str] = []
    proc = trio.run(_run_with_valve, cgroup, _hog(cgroup, 160, 0.5), events, True)
    assert proc.returncode == -9
    assert any("the host's OOM killer decides" in e for e in events)
    assert cgroup.limit() == 64 * MIB
