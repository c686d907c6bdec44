"""How many things made ahead to keep, from the bursts that took them (sans-IO).

The node makes network slots and disks ahead (`aenv.runtimes.netns`,
`aenv.storage.sparedisks`) so a start takes one instead of making it. Each
costs a little memory and kernel state, and making them costs CPU, so a node
keeps as many as the largest burst it has seen needed (a fork of 20 needs
20 at once), at least `least` and at most `most`, and refills only once
nothing was taken for `gap_s` (a refill must not compete with the burst it
refills after). Takes less than `gap_s` apart are one burst.
"""

from __future__ import annotations

import math


class Bursts:
    """The spares to keep, from the takes seen (`took`); times in seconds."""

    def __init__(self, *, most: int, gap_s: float, least: int = 1) -> None:
        self.most = max(0, most)
        self.least = min(max(0, least), self.most)
        self.gap_s = gap_s
        self._last = -math.inf
        self._burst = 0
        self._peak = 0

    def took(self, now: float) -> None:
        """One was taken (or made on demand, none being ready) at `now`."""
        self._burst = self._burst + 1 if now - self._last < self.gap_s else 1
        self._last = now
        self._peak = max(self._peak, self._burst)

    @property
    def target(self) -> int:
        """How many to keep ready."""
        return min(self.most, max(self.least, self._peak))

    @property
    def refill_at(self) -> float:
        """When a refill may start: `gap_s` after the last take."""
        return self._last + self.gap_s
