"""Refill: waits for the target, waits for quiet, makes one at a time, stops, retries.

Rules: every test runs on trio's MockClock (`autojump_clock`), which starts at
0, so the times things are made are asserted exactly. The demand is the
node's own (`aenv.proto.spares.Bursts`, takes less than 1 s apart are one
burst). A `Shelf` stands for a caller: a list of what is ready, a `make` that
takes `make_s` and records when it finished, and takes that go through the
pacer as the node's do.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import trio
import trio.testing

from aenv.kit.refill import Refill
from aenv.proto.spares import Bursts


class Shelf:
    """What a caller keeps: made things (their numbers), and the times each was made."""

    def __init__(self, *, most: int, least: int = 1, make_s: float = 0.0) -> None:
        self.refill = Refill(Bursts(most=most, gap_s=1.0, least=least))
        self.ready: list[int] = []
        self.made_at: list[float] = []
        self.make_s = make_s
        self.making = 0
        self.most_making = 0
        self.failures: list[Exception] = []
        self.fail_next = 0

    async def make(self) -> bool:
        self.making += 1
        self.most_making = max(self.most_making, self.making)
        try:
            await trio.sleep(self.make_s)
            if self.fail_next:
                self.fail_next -= 1
                raise OSError("no space left")
        finally:
            self.making -= 1
        self.made_at.append(trio.current_time())
        self.ready.append(len(self.made_at))
        return True

    def take(self) -> int | None:
        self.refill.took()
        return self.ready.pop(0) if self.ready else None

    async def keep(
        self,
        *,
        going: Callable[[], bool] = lambda: True,
        tidy: Callable[[], Awaitable[None]] | None = None,
        errors: tuple[type[Exception], ...] = (OSError,),
    ) -> None:
        await self.refill.keep(
            kept=lambda: len(self.ready),
            make=self.make,
            failed=self.failures.append,
            retry_s=5.0,
            going=going,
            tidy=tidy,
            errors=errors,
        )

    async def keep_while(
        self,
        script: Callable[[], Awaitable[None]],
        *,
        tidy: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Run `script` while the refill keeps this shelf; the refill stops after it."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(self.keep, tidy=tidy))
            await script()
            nursery.cancel_scope.cancel()


async def test_it_keeps_the_least_and_then_waits_for_takes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shelf = Shelf(most=4, least=2)
    with trio.move_on_after(100):
        await shelf.keep()
    # two at once, nothing taken yet: then nothing more however long it waits
    assert shelf.made_at == [0.0, 0.0]


async def test_a_burst_sets_the_target_and_the_refill_waits_for_quiet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shelf = Shelf(most=4, least=1, make_s=0.25)

    async def script() -> None:
        await trio.sleep(10)
        assert shelf.made_at == [0.25]
        # a burst of three takes 0.25 s apart (one burst), the first finds one ready
        taken = []
        for _ in range(3):
            taken.append(shelf.take())
            await trio.sleep(0.25)
        assert taken == [1, None, None]
        # nothing was made during the burst; 1 s after its last take (10.5), three,
        # one at a time
        await trio.sleep(10)
        assert shelf.made_at == [0.25, 11.75, 12.0, 12.25]
        assert shelf.most_making == 1
        # takes 0.75 s apart keep the refill waiting while they come, though fewer
        # are kept than the target meanwhile; the burst of four raises the target
        for _ in range(4):
            shelf.take()
            await trio.sleep(0.75)
        await trio.sleep(10)
        assert shelf.made_at[4:] == [24.25, 24.5, 24.75, 25.0]
        assert len(shelf.ready) == 4
        # a burst larger than `most` keeps `most`
        for _ in range(6):
            shelf.take()
        await trio.sleep(10)
        assert len(shelf.ready) == 4

    await shelf.keep_while(script)


async def test_a_take_during_a_make_is_counted_and_refilled_after_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shelf = Shelf(most=2, least=2, make_s=2.0)

    async def script() -> None:
        await trio.sleep(3)  # the first made at 2, the second under way
        assert shelf.take() == 1
        await trio.sleep(10)

    await shelf.keep_while(script)
    # the second done at 4, the next waits for quiet (the take at 3, so 4): made 4 to 6
    assert shelf.made_at == [2.0, 4.0, 6.0]
    assert shelf.most_making == 1


async def test_it_stops_when_cancelled_mid_make_or_when_no_longer_going(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shelf = Shelf(most=3, least=3, make_s=1.0)
    with trio.move_on_after(1.5):
        await shelf.keep()
    assert shelf.made_at == [1.0]
    assert shelf.making == 0  # the second make was cancelled, not left running
    assert trio.current_time() == 1.5

    # `going` is looked at before each step: once it is false, the refill returns
    going = True
    shelf = Shelf(most=3, least=3, make_s=1.0)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: shelf.keep(going=lambda: going))
        await trio.sleep(1.5)
        going = False
    # the make under way finished; no other was started
    assert len(shelf.ready) == 2
    assert trio.current_time() == start + 2.0


async def test_a_failing_make_is_reported_and_tried_again_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shelf = Shelf(most=2, least=2, make_s=0.5)
    shelf.fail_next = 2
    with trio.move_on_after(100):
        await shelf.keep()
    # failed at 0.5 and at 6, each followed by a 5 s wait (`retry_s`)
    assert [str(e) for e in shelf.failures] == ["no space left"] * 2
    assert shelf.made_at == [11.5, 12.0]


async def test_an_error_it_was_not_told_to_expect_ends_the_refill(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shelf = Shelf(most=2, least=2)
    shelf.fail_next = 1
    with pytest.raises(OSError, match="no space left"):
        await shelf.keep(errors=(ValueError,))
    assert shelf.failures == []


async def test_a_make_that_finds_it_cannot_make_one_now_waits_and_tries_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shelf = Shelf(most=1, least=1)
    tries: list[float] = []

    async def make() -> bool:
        tries.append(trio.current_time())
        return len(tries) > 2 and await shelf.make()

    with trio.move_on_after(30):
        await shelf.refill.keep(
            kept=lambda: len(shelf.ready), make=make, failed=shelf.failures.append, retry_s=5.0
        )
    assert tries == [0.0, 5.0, 10.0]
    assert shelf.made_at == [10.0] and shelf.failures == []


async def test_tidy_runs_before_each_look_and_wake_looks_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A caller whose spare is lost (not taken) drops it in `tidy` and wakes the
    pacer; the loss is no take, so the refill does not wait for quiet."""
    shelf = Shelf(most=2, least=2)
    lost: list[int] = []
    tidied: list[float] = []

    async def tidy() -> None:
        tidied.append(trio.current_time())
        for item in lost:
            shelf.ready.remove(item)
        lost.clear()

    async def script() -> None:
        await trio.sleep(5)
        assert shelf.made_at == [0.0, 0.0]
        lost.append(shelf.ready[0])
        shelf.refill.wake()
        await trio.sleep(5)

    await shelf.keep_while(script, tidy=tidy)
    assert shelf.made_at == [0.0, 0.0, 5.0]
    assert tidied == [0.0, 0.0, 0.0, 5.0, 5.0]
