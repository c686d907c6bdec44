"""Hibernate paused sandboxes when the host runs short of memory.

A full pause freezes a sandbox and keeps its memory, so that resuming takes
milliseconds; it is written to disk (hibernated) after an idle time. When
the host's available memory (`MemAvailable`) falls below a low mark, the
watcher does not wait for that: it hibernates frozen sandboxes, the longest
paused first, until what they hold covers the shortfall up to a high mark
(the low mark plus a margin, so one pass frees enough for a while).

`choose` is the decision, without IO; `watch` is the loop around it: read
`/proc/meminfo`, ask each frozen sandbox its memory, ask the chosen ones to
hibernate, wait for them, look again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

log = logging.getLogger("aenv.pressure")

# The high mark is the low mark plus this share of total memory.
MARGIN_PCT = 5.0
POLL_S = 1.0


@dataclass(frozen=True)
class Frozen:
    """A sandbox paused in memory, as the watcher sees it."""

    sandbox_id: str
    paused_at: float
    memory_bytes: int


def choose(available: int, total: int, low_pct: float, frozen: Sequence[Frozen]) -> list[str]:
    """Which frozen sandboxes to hibernate now (longest paused first); none
    while available memory is at or above `low_pct` percent of `total`."""
    if not short(available, total, low_pct) or not frozen:
        return []
    need = total * (low_pct + MARGIN_PCT) / 100 - available
    chosen: list[str] = []
    for f in sorted(frozen, key=lambda f: (f.paused_at, f.sandbox_id)):
        if need <= 0:
            break
        chosen.append(f.sandbox_id)
        need -= max(f.memory_bytes, 1)
    return chosen


def short(available: int, total: int, low_pct: float) -> bool:
    """Whether available memory is below the low mark."""
    return available < total * low_pct / 100


def read_meminfo(path: Path = Path("/proc/meminfo")) -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes."""
    fields: dict[str, int] = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields["MemAvailable"], fields["MemTotal"]


async def watch(
    low_pct: float,
    frozen: Callable[[], Awaitable[Sequence[Frozen]]],
    hibernate: Callable[[Sequence[str]], Awaitable[None]],
    *,
    meminfo: Callable[[], tuple[int, int]] = read_meminfo,
    poll_s: float = POLL_S,
) -> None:
    """Forever: when memory is short, hibernate what `choose` picks and wait for it."""
    while True:
        await trio.sleep(poll_s)
        available, total = meminfo()
        if not short(available, total, low_pct):
            continue  # (asking every frozen sandbox its memory is not free)
        chosen = choose(available, total, low_pct, await frozen())
        if chosen:
            log.warning(
                "memory available %d MiB (below %g%%): hibernating %d paused sandboxes",
                available >> 20,
                low_pct,
                len(chosen),
            )
            await hibernate(chosen)
