"""Retrying with capped, jittered exponential backoff.

`Backoff` is the policy, a frozen value: the wait before retry `n` (0-based)
is at most d = min(max_s, base_s * 2**n), and its fraction `jitter` is random,
so the wait is drawn from [d * (1 - jitter), d]: 0 waits exactly d, 0.5
somewhere in its upper half, 1 anywhere in [0, d]. A wait a server asked
for (HTTP `Retry-After`) is honoured up to `max_s`.

Two ways to follow it. `Retries` is one operation's budget: `failed()`
counts a failure and returns the wait before the next attempt, or None once
`attempts` are spent; `progressed()` starts the count again (a download
that got bytes). `Backoff.delays()` is the endless sequence of waits, for
work retried for as long as the process lives. Both are pure: the caller
logs the wait and sleeps it with `trio.sleep`, so tests run them on trio's
`MockClock`; random draws come from the `random.Random` given (the `random`
module's if none), one per wait, none when `jitter` is 0.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Backoff", "Retries"]


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """Capped exponential backoff with a random fraction `jitter` of each wait."""

    base_s: float
    max_s: float
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not (self.base_s >= 0 and self.max_s >= 0):
            raise ValueError(f"backoff times must be >= 0: {self}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be within [0, 1]: {self}")

    def ceiling(self, n: int) -> float:
        """The longest wait before retry `n` (0-based): min(max_s, base_s * 2**n)."""
        try:
            grown = self.base_s * 2.0**n
        except OverflowError:
            grown = math.inf if self.base_s > 0 else 0.0
        return min(self.max_s, grown)

    def delay(self, n: int, rand: float = 0.0, *, server_s: float | None = None) -> float:
        """The wait before retry `n`; `rand` in [0, 1) places it in the jitter band (0:
        its bottom). `server_s`, a wait the server asked for, lengthens it up to max_s."""
        d = self.ceiling(n)
        wait = d * (1 - self.jitter) + d * self.jitter * rand
        if server_s is not None:
            wait = max(wait, min(server_s, self.max_s))
        return wait

    def draw(
        self, n: int, rng: random.Random | None = None, *, server_s: float | None = None
    ) -> float:
        """`delay` with `rand` drawn from `rng` (not drawn when jitter is 0)."""
        if self.jitter == 0:
            return self.delay(n, 0.0, server_s=server_s)
        rand = random.random() if rng is None else rng.random()
        return self.delay(n, rand, server_s=server_s)

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The waits before retries 0, 1, 2, ... without end."""
        n = 0
        while True:
            yield self.draw(n, rng)
            n += 1


class Retries:
    """One operation's retries: at most `attempts` tries, waits from `backoff`."""

    def __init__(
        self, backoff: Backoff, *, attempts: int, rng: random.Random | None = None
    ) -> None:
        if attempts < 1:
            raise ValueError("attempts must be >= 1")
        self.backoff = backoff
        self.attempts = attempts
        self.failures = 0  # since the start or the last progress
        self._rng = rng

    def __repr__(self) -> str:
        return f"Retries({self.failures}/{self.attempts} failed, {self.backoff})"

    def failed(self, *, server_s: float | None = None) -> float | None:
        """Count a failure: the wait before the next attempt, or None if that was the last
        one allowed. `server_s` is a wait the server asked for (see `Backoff.delay`)."""
        self.failures += 1
        if self.failures >= self.attempts:
            return None
        return self.backoff.draw(self.failures - 1, self._rng, server_s=server_s)

    def progressed(self) -> None:
        """The operation got somewhere: the budget and the backoff start again."""
        self.failures = 0
