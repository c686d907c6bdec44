"""How many restored sandboxes the pool keeps per template: sized from demand, bounded by memory.

A create served from the pool costs an adoption (tens of ms); one that
finds the pool empty costs a `runsc restore` (150+ ms alone, seconds when
20 run at once on two cores). A burst is served from the pool only if the
pool already holds it, so the pool learns each template's demand and keeps
that many ready:

- **peak**: the most creates of the template within any `window_s`
  (a burst of 20 concurrent creates, or 20 in quick succession), held for
  `hold_s` (bursts that recur, an episode loop, find it still there), then
  decaying with half-life `half_life_s`, so the pool shrinks back;
- **rate**: an exponentially weighted rate of creates (per second, time
  constant `half_life_s`) times how long a refill restore takes: the creates
  that arrive while one member is being restored;
- at least `min_size` while the template is hot (asked for twice within
  `hot_for_s`), at most `max_size`; nothing once it went cold.

Across templates the sizes share a budget (`allot`): the members the node's
sandbox limit and its memory allow (`memory_budget`, which keeps the pool
from pushing available memory below the mark where paused sandboxes are
hibernated). Pure: times are arguments, no IO; `aenv.node.pool` applies it.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PoolLimits:
    min_size: int = 2
    max_size: int = 32
    hot_for_s: float = 600.0
    window_s: float = 5.0
    hold_s: float = 60.0  # (the node: half the half-life, AENV_POOL_HALF_LIFE)
    half_life_s: float = 120.0


@dataclass
class _Demand:
    times: collections.deque[float] = field(default_factory=collections.deque)
    peak: float = 0.0
    peak_at: float = 0.0
    rate: float = 0.0  # creates per second
    rate_at: float | None = None
    uses: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=2))


class PoolPolicy:
    """Per-template demand, and the pool size it asks for."""

    def __init__(self, limits: PoolLimits) -> None:
        self.limits = limits
        self._demand: dict[str, _Demand] = {}
        self.refill_s = 0.5  # how long one refill restore takes (`refilled`)

    def created(self, key: str, now: float) -> None:
        """A create of template `key` arrived (served from the pool or not)."""
        d = self._demand.setdefault(key, _Demand())
        d.uses.append(now)
        d.times.append(now)
        self._trim(d, now)
        peak = self._decayed_peak(d, now)
        if len(d.times) >= peak:
            d.peak, d.peak_at = float(len(d.times)), now
        # the rate: decay, then add this create's impulse (1/tau per create)
        tau = self.limits.half_life_s / math.log(2)
        if d.rate_at is not None:
            d.rate *= math.exp(-(now - d.rate_at) / tau)
        d.rate += 1.0 / tau
        d.rate_at = now

    def refilled(self, seconds: float) -> None:
        """A refill restore took `seconds` (a moving average of it sizes the rate term)."""
        self.refill_s = 0.8 * self.refill_s + 0.2 * max(0.0, seconds)

    def hot(self, key: str, now: float) -> bool:
        """Asked for twice within `hot_for_s` (one-off templates get no pool), the
        last time within `hot_for_s`."""
        d = self._demand.get(key)
        if d is None or len(d.uses) < 2:
            return False
        return now - d.uses[0] < self.limits.hot_for_s

    def want(self, key: str, now: float) -> int:
        """The pool size template `key`'s demand asks for (before the budget)."""
        if not self.hot(key, now):
            return 0
        d = self._demand[key]
        rate = d.rate * math.exp(
            -(now - (d.rate_at or now)) * math.log(2) / self.limits.half_life_s
        )
        size = max(
            self.limits.min_size,
            math.ceil(self._decayed_peak(d, now) - 1e-9),
            math.ceil(rate * self.refill_s - 1e-9),
        )
        return max(0, min(self.limits.max_size, size))

    def targets(self, now: float, budget: int) -> dict[str, int]:
        """Every known template's pool size, their sum within `budget`."""
        return allot({key: self.want(key, now) for key in self._demand}, budget)

    def forget_cold(self, now: float) -> list[str]:
        """Drop (and name) the templates that went cold."""
        cold = [key for key in self._demand if not self.hot(key, now)]
        for key in cold:
            del self._demand[key]
        return cold

    def _trim(self, d: _Demand, now: float) -> None:
        while d.times and now - d.times[0] >= self.limits.window_s:
            d.times.popleft()

    def _decayed_peak(self, d: _Demand, now: float) -> float:
        since = max(0.0, now - d.peak_at - self.limits.hold_s)
        return d.peak * math.pow(0.5, since / self.limits.half_life_s)


def allot(wants: Mapping[str, int], budget: int) -> dict[str, int]:
    """Split `budget` members among templates: all they want if it fits, else
    one at a time to whichever holds the fewest of what it wants (so a small
    template is not starved by a big one), ties by name."""
    budget = max(0, budget)
    if sum(wants.values()) <= budget:
        return dict(wants)
    got = dict.fromkeys(wants, 0)
    for _ in range(budget):
        open_ = [k for k in wants if got[k] < wants[k]]
        if not open_:
            break
        key = min(open_, key=lambda k: (got[k], k))
        got[key] += 1
    return got


def memory_budget(
    *, available: int, total: int, low_pct: float, margin_pct: float, member_bytes: int, held: int
) -> int:
    """How many pool members the host's memory allows: those `held` now plus as
    many more of `member_bytes` as fit above the hibernation mark (`low_pct` of
    `total`, plus `margin_pct` so the pool never triggers it)."""
    reserve = total * (low_pct + margin_pct) / 100
    spare = max(0.0, available - reserve)
    return held + int(spare // max(1, member_bytes))
