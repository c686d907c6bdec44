"""Backoff and Retries: the waits between attempts, the cap, jitter, server waits, budgets.

Rules: time is trio's MockClock (`autojump_clock`), never a real sleep; random
waits come from a seeded `random.Random`, so every wait is asserted exactly.
`random.Random(7)` draws 0.32383276483316237, 0.15084917392450192,
0.6509344730398537, 0.07243628666754276 first.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from itertools import islice

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from aenv.kit.retry import Backoff, Retries


async def call_with_retries(op: Callable[[], Awaitable[str]], retries: Retries) -> str:
    """The loop every caller writes: try, count the failure, sleep the wait, try again."""
    while True:
        try:
            return await op()
        except OSError:
            delay = retries.failed()
            if delay is None:
                raise
            await trio.sleep(delay)


def flaky(failures: int, starts: list[float]) -> Callable[[], Awaitable[str]]:
    async def op() -> str:
        starts.append(trio.current_time())
        if len(starts) <= failures:
            raise OSError(f"failure {len(starts)}")
        return "done"

    return op


def test_waits_double_from_the_base_up_to_the_cap() -> None:
    waits = Backoff(base_s=0.5, max_s=10.0).delays()
    assert list(islice(waits, 7)) == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_any_number_of_failures_waits_at_most_the_cap() -> None:
    backoff = Backoff(base_s=0.5, max_s=10.0)
    assert backoff.ceiling(1023) == 10.0
    assert backoff.ceiling(100_000) == 10.0  # 2.0**100000 overflows: still the cap


def test_jitter_draws_that_fraction_of_each_wait_at_random() -> None:
    half = Backoff(base_s=1.0, max_s=4.0, jitter=0.5)  # in [d/2, d]
    assert list(islice(half.delays(random.Random(7)), 4)) == [
        0.6619163824165812,  # 0.5 + 0.5 * 0.3238...
        1.150849173924502,  # 1 + 1 * 0.1508...
        3.3018689460797077,  # 2 + 2 * 0.6509...
        2.1448725733350855,  # capped at d = 4: 2 + 2 * 0.0724...
    ]
    full = Backoff(base_s=0.2, max_s=5.0, jitter=1.0)  # in [0, d]
    assert list(islice(full.delays(random.Random(7)), 3)) == [
        0.06476655296663247,  # 0.2 * 0.3238...
        0.060339669569800775,  # 0.4 * 0.1508...
        0.520747578431883,  # 0.8 * 0.6509...
    ]


def test_without_jitter_nothing_is_drawn() -> None:
    rng = random.Random(7)
    state = rng.getstate()
    assert Backoff(base_s=1.0, max_s=4.0).draw(2, rng) == 4.0
    assert rng.getstate() == state


def test_a_server_wait_is_honoured_up_to_the_cap() -> None:
    backoff = Backoff(base_s=0.5, max_s=8.0, jitter=0.5)
    assert backoff.delay(0, 0.0, server_s=3.0) == 3.0
    assert backoff.delay(0, 0.0, server_s=30.0) == 8.0
    assert backoff.delay(0, 0.0, server_s=0.1) == 0.25  # the backoff is longer
    assert backoff.delay(0, 0.0, server_s=None) == 0.25


async def test_an_operation_succeeds_after_waiting_out_its_failures(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: list[float] = []
    retries = Retries(Backoff(base_s=1.0, max_s=4.0, jitter=0.5), attempts=4, rng=random.Random(7))
    assert await call_with_retries(flaky(2, starts), retries) == "done"
    assert starts == pytest.approx(
        [0.0, 0.6619163824165812, 0.6619163824165812 + 1.150849173924502]
    )
    assert retries.failures == 2


async def test_the_last_failure_of_the_budget_is_raised_without_a_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: list[float] = []
    retries = Retries(Backoff(base_s=1.0, max_s=4.0), attempts=4)
    with pytest.raises(OSError, match="failure 4"):
        await call_with_retries(flaky(10, starts), retries)
    assert starts == [0.0, 1.0, 3.0, 7.0]  # waits 1, 2, 4; none after the 4th attempt
    assert trio.current_time() == 7.0
    assert retries.failures == 4


def test_progress_restarts_the_budget_and_the_backoff() -> None:
    retries = Retries(Backoff(base_s=1.0, max_s=4.0), attempts=3)
    assert [retries.failed(), retries.failed()] == [1.0, 2.0]
    retries.progressed()
    assert [retries.failed(), retries.failed(), retries.failed()] == [1.0, 2.0, None]


def test_a_server_wait_counts_as_a_failure_too() -> None:
    retries = Retries(Backoff(base_s=0.5, max_s=8.0), attempts=2)
    assert retries.failed(server_s=5.0) == 5.0
    assert retries.failed(server_s=5.0) is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: Backoff(base_s=-1.0, max_s=1.0),
        lambda: Backoff(base_s=1.0, max_s=-1.0),
        lambda: Backoff(base_s=1.0, max_s=1.0, jitter=1.5),
        lambda: Retries(Backoff(base_s=1.0, max_s=1.0), attempts=0),
    ],
)
def test_a_policy_that_makes_no_sense_is_refused(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


@given(
    st.integers(0, 2000),
    st.floats(0, 1, exclude_max=True),
    st.floats(0, 1),
    st.floats(0, 5),
    st.floats(0, 60),
)
def test_a_wait_is_within_its_band_and_never_shrinks_as_failures_grow(
    n: int, rand: float, jitter: float, base_s: float, max_s: float
) -> None:
    backoff = Backoff(base_s=base_s, max_s=max_s, jitter=jitter)
    d = backoff.ceiling(n)
    wait = backoff.delay(n, rand)
    assert d * (1 - jitter) * (1 - 1e-12) <= wait <= d * (1 + 1e-12)
    assert d <= max_s
    assert backoff.delay(n + 1, rand) >= wait
