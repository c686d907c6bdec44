"""Paces the refill of things made ahead: one at a time, after the burst.

The node keeps network slots and disks made ahead (`aenv.runtimes.netns`,
`aenv.storage.sparedisks`) so a start takes one instead of making it. Both
refill the same way: wait until fewer are kept than the demand's target,
then until the demand says a refill may start (nothing taken for a moment:
a refill must not compete with the burst it refills after), then make one,
and look again. `Refill` is that loop; what is made, how it is counted and
what a failure leaves behind stay with its caller. The demand is a small
protocol (`aenv.proto.spares.Bursts` is one), time is trio's clock.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import trio


class Demand(Protocol):
    """How many to keep and when a refill may start, from the takes seen."""

    def took(self, now: float) -> None:
        """One was taken (or made on demand, none being ready) at `now`."""
        ...

    @property
    def target(self) -> int:
        """How many to keep ready."""
        ...

    @property
    def refill_at(self) -> float:
        """When a refill may start (trio's clock)."""
        ...


def _always() -> bool:
    return True


class Refill:
    """Keeps `demand.target` things made, one at a time (see the module)."""

    def __init__(self, demand: Demand) -> None:
        self.demand = demand
        self._wanted = trio.Event()

    def took(self) -> None:
        """One was taken (or made on demand): count it, and look again."""
        self.demand.took(trio.current_time())
        self._wanted.set()

    def wake(self) -> None:
        """Fewer may be kept than before (one was lost): look again."""
        self._wanted.set()

    async def keep(
        self,
        *,
        kept: Callable[[], int],
        make: Callable[[], Awaitable[bool]],
        failed: Callable[[Exception], None],
        retry_s: float,
        going: Callable[[], bool] = _always,
        tidy: Callable[[], Awaitable[None]] | None = None,
        errors: tuple[type[Exception], ...] = (Exception,),
    ) -> None:
        """Refill until cancelled or `going()` is false (checked before each step).

        `kept()` counts what is ready now. `make()` makes one and adds it to
        what `kept` counts (True), or finds that none can be made now (False);
        it cleans up after itself if it raises. A make that raises one of
        `errors` is reported to `failed`, and like one that made nothing is
        tried again `retry_s` later; any other error ends the refill. `tidy`
        runs before each look at the count (to drop what was lost meanwhile).
        """
        while going():
            if tidy is not None:
                await tidy()
            if kept() >= self.demand.target:
                self._wanted = trio.Event()
                await self._wanted.wait()
                continue
            if trio.current_time() < self.demand.refill_at:
                await trio.sleep_until(self.demand.refill_at)
                continue
            try:
                made = await make()
            except errors as exc:
                failed(exc)
                made = False
            if not made:
                await trio.sleep(retry_s)
