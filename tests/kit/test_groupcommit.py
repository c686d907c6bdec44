"""GroupCommit: items submitted while a batch runs go together in the next one;
a failed batch is split so each caller hears its own outcome; a cancelled
caller's item is applied by nobody, or by the next caller."""

from __future__ import annotations

from collections.abc import Sequence

import trio
import trio.testing

from aenv.kit.groupcommit import GroupCommit


class Resource:
    """Applies batches after a second each; refuses any batch holding a "bad" item."""

    def __init__(self) -> None:
        self.applied: list[list[str]] = []
        self.attempts: list[list[str]] = []

    async def apply(self, items: Sequence[str]) -> None:
        self.attempts.append(list(items))
        await trio.sleep(1)
        if "bad" in items:
            raise ValueError(f"refused {list(items)}")
        self.applied.append(list(items))


async def test_a_burst_is_one_batch_after_the_first(autojump_clock: trio.abc.Clock) -> None:
    res = Resource()
    commit = GroupCommit[str](trio.Lock(), res.apply)
    async with trio.open_nursery() as n:
        for i in range(20):
            n.start_soon(commit.submit, f"slot{i}")
            await trio.sleep(0.01)  # all arrive while the first is being applied
    assert res.applied == [["slot0"], [f"slot{i}" for i in range(1, 20)]]
    assert commit.batches == 2


async def test_a_failed_batch_tells_each_caller_its_own_outcome(
    autojump_clock: trio.abc.Clock,
) -> None:
    res = Resource()
    commit = GroupCommit[str](trio.Lock(), res.apply)
    outcomes: dict[str, str] = {}

    async def one(item: str) -> None:
        try:
            await commit.submit(item)
            outcomes[item] = "ok"
        except ValueError as exc:
            outcomes[item] = str(exc)

    async with trio.open_nursery() as n:
        for item in ("first", "a", "bad", "b"):
            n.start_soon(one, item)
            await trio.sleep(0.01)
    assert outcomes == {"first": "ok", "a": "ok", "bad": "refused ['bad']", "b": "ok"}
    assert res.applied == [["first"], ["a"], ["b"]]


async def test_the_lock_is_shared_with_other_users(autojump_clock: trio.abc.Clock) -> None:
    """An item waits while someone else holds the resource's lock, and is applied after."""
    res = Resource()
    lock = trio.Lock()
    commit = GroupCommit[str](lock, res.apply)
    async with trio.open_nursery() as n:
        await lock.acquire()
        n.start_soon(commit.submit, "x")
        n.start_soon(commit.submit, "y")
        await trio.sleep(5)
        assert res.attempts == []
        lock.release()
    assert [sorted(b) for b in res.applied] == [["x", "y"]]


async def test_a_cancelled_caller_is_left_out_or_applied_by_the_next(
    autojump_clock: trio.abc.Clock,
) -> None:
    res = Resource()
    commit = GroupCommit[str](trio.Lock(), res.apply)
    async with trio.open_nursery() as n:
        n.start_soon(commit.submit, "first")
        await trio.sleep(0.01)
        with trio.move_on_after(0.1):  # gone before its turn: nobody applies it
            await commit.submit("gone")
        n.start_soon(commit.submit, "kept")
    assert res.applied == [["first"], ["kept"]]


async def test_a_leader_cancelled_mid_batch_hands_the_items_back(
    autojump_clock: trio.abc.Clock,
) -> None:
    res = Resource()
    commit = GroupCommit[str](trio.Lock(), res.apply)
    scopes: dict[str, trio.CancelScope] = {}

    async def one(item: str) -> None:
        with trio.CancelScope() as scopes[item]:
            await commit.submit(item)

    async with trio.open_nursery() as n:
        n.start_soon(one, "first")
        await trio.sleep(0.01)
        n.start_soon(one, "p")
        await trio.sleep(0.01)
        n.start_soon(one, "q")
        await trio.sleep(1.2)  # "p" applies ["p", "q"] now
        scopes["p"].cancel()
    # "q" applied its own item again, alone; "p"'s was left out
    assert res.attempts == [["first"], ["p", "q"], ["q"]]
    assert res.applied == [["first"], ["q"]]
