"""Group commit: the items submitted while a batch is being applied go together
in the next one.

A burst of callers that each need one short transaction on a shared resource
(a fork's 20 children each writing their network slot's firewall rules, one
`nft -f` at a time under the host network's lock) pay for one transaction per
batch instead of one each: the first caller to get the lock applies every item
queued by then, and those callers find theirs done when the lock comes to
them. If a batch of several fails, each of its items is applied alone, so
every caller hears its own outcome.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

T = TypeVar("T")


@dataclass(eq=False)
class _Entry(Generic[T]):
    item: T
    done: bool = False
    error: Exception | None = None


class GroupCommit(Generic[T]):
    """Apply submitted items in batches under `lock` (held by every other user of
    the resource too); `apply(items)` applies a batch, all or nothing, and
    raises if it could not."""

    def __init__(self, lock: trio.Lock, apply: Callable[[Sequence[T]], Awaitable[None]]) -> None:
        self._lock = lock
        self._apply = apply
        self._queue: list[_Entry[T]] = []
        self.batches = 0  # applied (for tests and metrics)

    async def submit(self, item: T) -> None:
        """Return once `item` is applied, alone or with others (raise what its
        own application raised)."""
        entry = _Entry(item)
        self._queue.append(entry)
        try:
            # trio's lock is fair: callers get it in turn, and each finds its item
            # applied by an earlier one, or applies everything queued until now
            async with self._lock:
                if not entry.done:
                    batch, self._queue = self._queue, []
                    await self._run(batch)
        finally:
            if not entry.done and entry in self._queue:
                self._queue.remove(entry)  # cancelled before anyone applied it
        if entry.error is not None:
            raise entry.error

    async def _run(self, batch: list[_Entry[T]]) -> None:
        try:
            try:
                await self._apply([e.item for e in batch])
                self.batches += 1
                for e in batch:
                    e.done = True
                return
            except Exception as exc:
                if len(batch) == 1:
                    batch[0].error, batch[0].done = exc, True
                    return
            for e in batch:  # which of them failed: each alone
                try:
                    await self._apply([e.item])
                    self.batches += 1
                except Exception as exc:
                    e.error = exc
                e.done = True
        finally:
            # cancelled part-way: what is not done goes back, first, for its own
            # caller (waiting for the lock, or cancelled too) to apply
            self._queue[:0] = [e for e in batch if not e.done]
