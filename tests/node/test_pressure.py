"""Hibernation under memory pressure: the decision and the watcher loop, no sandboxes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import trio
import trio.testing

from aenv.node.pressure import Frozen, choose, read_meminfo, watch

GIB = 1 << 30


def test_nothing_is_hibernated_while_memory_is_above_the_low_mark() -> None:
    frozen = [Frozen("a", 1.0, GIB)]
    assert choose(available=3 * GIB, total=24 * GIB, low_pct=10, frozen=frozen) == []
    assert choose(available=1 * GIB, total=24 * GIB, low_pct=10, frozen=[]) == []


def test_longest_paused_first_until_the_high_mark_is_covered() -> None:
    frozen = [
        Frozen("newest", 30.0, GIB),
        Frozen("oldest", 10.0, GIB),
        Frozen("middle", 20.0, GIB),
    ]
    # low 10 % of 20 GiB = 2 GiB, high 15 % = 3 GiB; 1.5 GiB available: 1.5 GiB short
    got = choose(available=3 * GIB // 2, total=20 * GIB, low_pct=10, frozen=frozen)
    assert got == ["oldest", "middle"]
    # far below: everything
    got = choose(available=0, total=20 * GIB, low_pct=10, frozen=frozen)
    assert got == ["oldest", "middle", "newest"]


def test_meminfo_is_read_in_bytes(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemFree: 1 kB\nMemAvailable:    1000 kB\n")
    assert read_meminfo(f) == (1000 * 1024, 24000000 * 1024)
    available, total = read_meminfo()
    assert 0 < available <= total


async def test_the_watcher_hibernates_only_under_pressure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    memory = {"available": 10 * GIB}
    asked: list[list[str]] = []

    async def frozen() -> Sequence[Frozen]:
        return [Frozen("a", 1.0, 2 * GIB), Frozen("b", 2.0, 2 * GIB)]

    async def hibernate(ids: Sequence[str]) -> None:
        asked.append(list(ids))
        memory["available"] += 2 * GIB * len(ids)

    def meminfo() -> tuple[int, int]:
        return memory["available"], 20 * GIB

    async with trio.open_nursery() as n:
        n.start_soon(lambda: watch(10, frozen, hibernate, meminfo=meminfo))
        await trio.sleep(10)
        assert asked == []  # 50 % available: nothing to do
        memory["available"] = GIB  # 5 %: 2 GiB short of the 15 % high mark
        await trio.sleep(1.5)
        assert asked == [["a"]]
        await trio.sleep(10)
        assert asked == [["a"]]  # back above the low mark: nothing more
        n.cancel_scope.cancel()
