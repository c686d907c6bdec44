"""The task valve: when it signals envd, when it reads the task count, and its
loop over a changing count (trio's MockClock: times are exact)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import trio

from aenv.config import Config
from aenv.envd import taskguard
from aenv.runtimes import taskvalve
from aenv.runtimes.taskvalve import MAX_GROWTH, MAX_POLL_S, POLL_S, first_mark, next_read, step


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


def test_reads_come_when_the_count_could_reach_the_mark() -> None:
    assert next_read(40, 4096) == (4096 - 40) / MAX_GROWTH  # ~2 s at 2,000 a second
    assert next_read(3900, 4096) == POLL_S  # near the mark: the fast period
    assert next_read(4200, 4096) == POLL_S  # past it (a failed signal)
    assert next_read(40, 1_000_000) == MAX_POLL_S


class Growing:
    """A sandbox's host task count: `start`, then `rate` more a second from `at`
    on; records when it is read and what each signal saw."""

    def __init__(self, start: int, rate: float = 0, at: float = 0) -> None:
        self.start, self.rate, self.at = start, rate, at
        self.reads: list[float] = []
        self.signals: list[tuple[float, int]] = []

    def count(self) -> int:
        return self.start + int(self.rate * max(0.0, trio.current_time() - self.at))

    def read(self) -> int:
        self.reads.append(trio.current_time())
        return self.count()

    async def signal_guest(self) -> None:
        self.signals.append((trio.current_time(), self.count()))

    async def watch(self, limit: int, seconds: float) -> None:
        with trio.move_on_after(seconds):
            await taskvalve.watch_tasks(self.read, limit, self.signal_guest, lambda _: None)


async def test_an_idle_sandbox_far_below_the_mark_is_read_rarely(
    autojump_clock: trio.abc.Clock,
) -> None:
    idle = Growing(40)
    await idle.watch(8192, 60)
    # every (4096 - 40) / 2,000 s: 30 reads a minute, not 120 at POLL_S
    assert len(idle.reads) == 30
    assert all(b - a == pytest.approx(2.028) for a, b in itertools.pairwise(idle.reads))
    assert idle.signals == []


async def test_a_climbing_count_is_read_at_the_fast_period_before_the_mark(
    autojump_clock: trio.abc.Clock,
) -> None:
    # idle for 20 s, then a bomb at 300 tasks a second: it reaches 4,096 at 33.52 s
    bomb = Growing(40, rate=300, at=20)
    await bomb.watch(8192, 34.5)
    reached = 20 + (4096 - 40) / 300
    (when, seen), *_ = bomb.signals
    assert reached <= when <= reached + POLL_S  # as soon as a read every POLL_S would
    assert 4096 <= seen <= 4096 + 300 * POLL_S
    before = [r for r in bomb.reads if r < when]
    gaps = [b - a for a, b in itertools.pairwise(before)]
    assert gaps[-1] == pytest.approx(POLL_S) and gaps[-2] == pytest.approx(POLL_S)
    assert max(gaps) == pytest.approx(2.028)  # while it was idle


async def test_growth_at_the_assumed_rate_is_seen_at_the_mark(
    autojump_clock: trio.abc.Clock,
) -> None:
    bomb = Growing(40, rate=MAX_GROWTH)
    await bomb.watch(8192, 10)
    assert bomb.signals[0] == (pytest.approx(2.028), 4096)


async def test_growth_at_nearly_twice_the_assumed_rate_is_seen_before_the_limit(
    autojump_clock: trio.abc.Clock,
) -> None:
    bomb = Growing(40, rate=1.9 * MAX_GROWTH)
    await bomb.watch(8192, 10)
    assert bomb.signals[0][1] < 8192


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
