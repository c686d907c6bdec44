"""Mailbox: request/reply, Busy when full, ActorGone when the actor stops."""

from __future__ import annotations

import pytest
import trio

from aenv.kit.mailbox import ActorGone, Busy, Mailbox


async def test_ask_gets_reply() -> None:
    mb: Mailbox[int] = Mailbox("calc", capacity=2)

    async def actor() -> None:
        req = await mb.receive()
        req.reply(req.msg * 2)

    async with trio.open_nursery() as n:
        n.start_soon(actor)
        assert await mb.ask(21) == 42


async def test_full_mailbox_is_busy_at_once() -> None:
    mb: Mailbox[int] = Mailbox("slow", capacity=1)
    mb.tell(1)
    with pytest.raises(Busy) as ei:
        mb.tell(2)
    assert ei.value.retry_after > 0
    assert mb.statistics() == {"queued": 1, "capacity": 1}


async def test_failures_propagate_to_asker() -> None:
    mb: Mailbox[str] = Mailbox("x")

    async def actor() -> None:
        req = await mb.receive()
        req.fail(ValueError("bad"))

    async with trio.open_nursery() as n:
        n.start_soon(actor)
        with pytest.raises(ValueError, match="bad"):
            await mb.ask("q")


async def test_close_fails_pending_and_later_asks(autojump_clock: trio.abc.Clock) -> None:
    mb: Mailbox[str] = Mailbox("x")
    results: list[BaseException] = []

    async def asker() -> None:
        try:
            await mb.ask("q", timeout=10)
        except ActorGone as e:
            results.append(e)

    async with trio.open_nursery() as n:
        n.start_soon(asker)
        await trio.sleep(1)
        mb.close()
    assert len(results) == 1
    with pytest.raises(ActorGone):
        await mb.ask("again")


async def test_ask_timeout(autojump_clock: trio.abc.Clock) -> None:
    mb: Mailbox[str] = Mailbox("mute")
    t0 = trio.current_time()
    with pytest.raises(trio.TooSlowError):
        await mb.ask("q", timeout=5)
    assert trio.current_time() - t0 == 5
