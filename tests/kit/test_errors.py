"""Exception groups: leaves, the preferred or only leaf, one error out of a real nursery.

Rules: the nursery tests run real trio nurseries (strict exception groups, as
trio raises them) on `autojump_clock`; no real sleeps.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from aenv.kit.errors import first_leaf, leaves, one_error, sole_leaf


class Wanted(Exception):
    pass


class AlsoWanted(Exception):
    pass


def test_leaves_flatten_nested_groups_depth_first() -> None:
    a, b, c, d = ValueError("a"), KeyError("b"), Wanted("c"), KeyboardInterrupt()
    group = BaseExceptionGroup(
        "outer", [a, BaseExceptionGroup("inner", [b, ExceptionGroup("deep", [c])]), d]
    )
    assert leaves(group) == [a, b, c, d]
    assert leaves(a) == [a]


def test_first_leaf_prefers_kinds_in_the_order_given() -> None:
    also, wanted = AlsoWanted("first in the group"), Wanted("later in the group")
    group = ExceptionGroup("g", [ValueError("x"), ExceptionGroup("h", [also]), wanted])
    assert first_leaf(group, Wanted, AlsoWanted) is wanted
    assert first_leaf(group, AlsoWanted, Wanted) is also
    assert first_leaf(group, (Wanted, AlsoWanted)) is also  # a tuple: whichever comes first
    assert first_leaf(group, KeyError) is None


def test_sole_leaf_is_the_only_leaf_or_none() -> None:
    only = ValueError("only")
    assert sole_leaf(ExceptionGroup("g", [ExceptionGroup("h", [only])])) is only
    assert sole_leaf(only) is only
    assert sole_leaf(ExceptionGroup("g", [only, KeyError("k")])) is None


async def test_one_error_lets_the_first_failure_out_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def fails_after(seconds: float, exc: Exception) -> None:
        await trio.sleep(seconds)
        raise exc

    first = Wanted("first")
    with pytest.raises(Wanted) as ei, one_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fails_after, 1, first)
            nursery.start_soon(fails_after, 5, AlsoWanted("never raised: cancelled"))
            nursery.start_soon(trio.sleep_forever)
    assert ei.value is first
    assert ei.value.__suppress_context__  # raised from None: no group in the traceback
    assert trio.current_time() == 1


async def test_one_error_passes_a_group_of_cancellations_on_unchanged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.move_on_after(3) as scope:
        with one_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
                nursery.start_soon(trio.sleep_forever)
    assert scope.cancelled_caught
    assert trio.current_time() == 3


def test_one_error_leaves_a_plain_exception_alone() -> None:
    with pytest.raises(ValueError, match="plain"), one_error():
        raise ValueError("plain")
