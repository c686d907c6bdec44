"""Sandbox disks made ahead, so a start takes one instead of making it.

A sized disk (`aenv.storage.disks.make_disk`) is a truncate, a `mkfs.ext4`, a
loop mount and a `losetup`: a few milliseconds alone, but the loop devices
are set up one at a time by the kernel, and a fork of 20 children made 20 at
once, each waiting for the others (a child's root took 200-500 ms of its
start, docs/performance.md, Forks). `SpareDisks.keep` holds disks of
the node's default size mounted in a directory of their own; `take` hands one
out, which `take_disk` moves to the sandbox's directory (one mount move and a
rename). A spare is unused, so which one a sandbox gets does not matter.

As many are kept as the largest burst of starts seen needed (at most
`count`, `aenv.proto.spares`); refills wait until no disk was taken for a
moment (a refill must not compete with the burst it refills after) and make
one disk at a time. The spares are
removed when `keep` ends; the spares an earlier node process left are under
the sandboxes directory, whose stale disks a starting node removes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import shutil
from collections import deque
from pathlib import Path

import trio

from aenv.kit.refill import Refill
from aenv.proto.spares import Bursts
from aenv.storage.disks import DiskError, disk_image, make_disk, remove_disk

log = logging.getLogger("aenv.sparedisks")


class SpareDisks:
    """Up to `count` disks of `size_bytes` made ahead in `directory` (see the module)."""

    def __init__(
        self, directory: Path, *, size_bytes: int, count: int, quiet_s: float = 1.0, least: int = 1
    ) -> None:
        self.directory = directory
        self.size_bytes = size_bytes
        self.count = count
        self.quiet_s = quiet_s
        self._ready: deque[Path] = deque()
        self._names = itertools.count()
        self.demand = Bursts(most=count, gap_s=quiet_s, least=least)
        self._refill = Refill(self.demand)
        self.taken = 0

    def take(self, size_bytes: int) -> Path | None:
        """A ready spare's mount point for a disk of `size_bytes` (None: none
        of that size ready); the caller moves it away (`take_disk`) or removes it."""
        if size_bytes != self.size_bytes:
            return None
        self._refill.took()
        if not self._ready:
            return None
        self.taken += 1
        return self._ready.popleft()

    async def keep(self) -> None:
        """Keep the spares made until cancelled; then remove them."""
        try:
            await trio.to_thread.run_sync(self._clear)
            await self._refill.keep(
                kept=lambda: len(self._ready),
                make=self._make_one,
                failed=lambda exc: log.warning("making a spare disk failed: %s", exc),
                retry_s=max(self.quiet_s, 5.0),
                going=lambda: self.count > 0,  # (`count` is 0 once a host refused a move)
                errors=(DiskError, OSError),
            )
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._clear)

    async def _make_one(self) -> bool:
        """One more spare, ready to take."""
        path = self.directory / str(next(self._names))
        await trio.to_thread.run_sync(self._make, path)
        self._ready.append(path)
        return True

    def _make(self, path: Path) -> None:
        path.mkdir(parents=True)
        try:
            make_disk(path, self.size_bytes)
        except BaseException:
            with contextlib.suppress(OSError):
                path.rmdir()
            raise

    def _clear(self) -> None:
        """Remove every spare in the directory (blocking)."""
        self._ready.clear()
        if not self.directory.is_dir():
            return
        for path in self.directory.iterdir():
            if path.is_dir():
                remove_disk(path)
                with contextlib.suppress(OSError):
                    path.rmdir()
            with contextlib.suppress(FileNotFoundError):
                disk_image(path).unlink()
        shutil.rmtree(self.directory, ignore_errors=True)
