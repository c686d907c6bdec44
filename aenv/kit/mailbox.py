"""Bounded actor mailboxes with request/reply.

An actor owns a `Mailbox` and loops over `receive()`. Everyone else holds the
mailbox and calls `ask(msg)`, which puts a `Request` carrying a one-shot reply
channel and waits for the answer under a deadline. A full mailbox raises
`Busy` at once (the API maps it to 429 with Retry-After) instead of queueing
without bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import trio
from outcome import Error, Outcome, Value

M = TypeVar("M")


class Busy(Exception):
    """The actor cannot take more work now; retry after `retry_after` seconds."""

    def __init__(self, what: str, retry_after: float = 1.0) -> None:
        super().__init__(f"{what} is busy, retry in {retry_after:g}s")
        self.retry_after = retry_after


class ActorGone(Exception):
    """The actor stopped before it could answer."""


@dataclass(eq=False)
class Request(Generic[M]):
    """A message plus the channel its single answer goes back on."""

    msg: M
    _reply: trio.MemorySendChannel[Outcome[Any]] = field(repr=False)

    def reply(self, value: object) -> None:
        self._send(Value(value))

    def fail(self, exc: BaseException) -> None:
        self._send(Error(exc))

    def _send(self, result: Outcome[Any]) -> None:
        try:
            self._reply.send_nowait(result)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            pass  # the asker gave up (cancelled or timed out); nothing to do
        finally:
            self._reply.close()


class Mailbox(Generic[M]):
    def __init__(self, name: str, capacity: int = 64) -> None:
        self.name = name
        self._send, self._recv = trio.open_memory_channel[Request[M]](capacity)

    def tell(self, msg: M) -> None:
        """Deliver without waiting for an answer (raises Busy when full)."""
        send, recv = trio.open_memory_channel[Outcome[Any]](1)
        recv.close()  # nobody waits: the actor's reply is dropped
        self._put(Request(msg, send))

    async def ask(self, msg: M, *, timeout: float = math.inf) -> Any:  # noqa: ASYNC109
        send, recv = trio.open_memory_channel[Outcome[Any]](1)
        async with recv:
            self._put(Request(msg, send))
            with trio.fail_after(timeout):
                try:
                    result = await recv.receive()
                except trio.EndOfChannel:
                    raise ActorGone(f"{self.name} stopped before answering") from None
        return result.unwrap()

    def _put(self, req: Request[M]) -> None:
        try:
            self._send.send_nowait(req)
        except trio.WouldBlock:
            req._reply.close()
            raise Busy(self.name) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            req._reply.close()
            raise ActorGone(f"{self.name} has stopped") from None

    async def receive(self) -> Request[M]:
        return await self._recv.receive()

    def close(self) -> None:
        """Stop accepting; pending requests are failed with ActorGone."""
        self._send.close()
        while True:
            try:
                req = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            req.fail(ActorGone(f"{self.name} has stopped"))
        self._recv.close()

    def statistics(self) -> dict[str, int]:
        s = self._send.statistics()
        return {"queued": s.current_buffer_used, "capacity": int(s.max_buffer_size)}
