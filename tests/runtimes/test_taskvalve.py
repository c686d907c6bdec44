"""The task valve: when it signals envd, and its loop over a changing task count."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from aenv.config import Config
from aenv.envd import taskguard
from aenv.runtimes import taskvalve
from aenv.runtimes.taskvalve import first_mark, step


def test_step_signals_at_the_mark_then_a_step_above() -> None:
    limit = 8192
    mark = first_mark(limit)
    assert mark == 4096
    assert step(4095, limit, mark) == (False, 4096)
    fire, after = step(4100, limit, mark)
    assert fire and after == 4100 + 512
    # what is held stays held: the count only has to grow another step
    assert step(4400, limit, after) == (False, after)
    assert step(after, limit, after)[0]


def test_the_signal_is_the_one_envd_waits_for() -> None:
    assert taskvalve.ENVD_SIGNAL == taskguard.SIGNAL


async def test_watch_signals_each_time_a_mark_is_passed(autojump_clock: trio.abc.Clock) -> None:
    counts = iter([40, 1000, 4200, 4300, 4700, 4800, 5300, None])
    signals: list[int] = []
    events: list[str] = []
    now: list[int] = [0]

    def read() -> int | None:
        now[0] = next(counts) or 0
        return now[0] or None

    async def signal_guest() -> None:
        signals.append(now[0])

    await taskvalve.watch_tasks(read, 8192, signal_guest, events.append)
    assert signals == [4200, 4800]  # 4200 + 512 = 4712 > 4700
    assert "4200 of 8192" in events[0]


async def test_watch_leaves_what_a_taken_over_sandbox_holds(autojump_clock: trio.abc.Clock) -> None:
    counts = iter([6000, 6100, 6400, 6600, None])
    signals: list[int] = []

    async def signal_guest() -> None:
        signals.append(1)

    await taskvalve.watch_tasks(lambda: next(counts), 8192, signal_guest, lambda _: None)
    assert signals == [1]  # at 6600, one step above the 6000 it started with


async def test_a_failed_signal_is_tried_at_the_next_mark(autojump_clock: trio.abc.Clock) -> None:
    counts = iter([40, 4200, 4800, None])
    tries: list[int] = []

    async def signal_guest() -> None:
        tries.append(1)
        raise RuntimeError("runsc refused")

    await taskvalve.watch_tasks(lambda: next(counts), 8192, signal_guest, lambda _: None)
    assert len(tries) == 2


def test_the_host_task_limit_is_read_from_the_environment(tmp_path: Path) -> None:
    home = {"AENV_HOME": str(tmp_path)}
    assert Config.from_env(home).host_tasks_limit is None  # the runtime's default
    assert Config.from_env({**home, "AENV_SANDBOX_HOST_TASKS": "4096"}).host_tasks_limit == 4096
    with pytest.raises(ValueError, match="AENV_SANDBOX_HOST_TASKS must be at least 256"):
        Config.from_env({**home, "AENV_SANDBOX_HOST_TASKS": "100"})
