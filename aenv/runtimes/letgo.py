"""A held sandbox's `runsc resume`, started before the hold ends.

A live capture (`GVisorSandbox.held`) stops the guest with `runsc pause`,
checkpoints it and copies its files, then lets it go with `runsc resume`.
The guest stands still until that resume reaches the sandbox, and a runsc
command spends most of its time before that: the Go runtime's start, its
flags, its configuration (16 ms of a 20 ms resume on a quiet host, more
under load). runsc serialises the commands on one container with an
exclusive flock(2) of the container's lock file beside its state file, which
a command takes before it reads the state. `EarlyResume.start` takes that
lock itself (once the checkpoint has let go of it) and starts `runsc resume`,
which starts up and then waits for the lock while the files are copied;
`finish` lets go of the lock, and the resume is a few milliseconds away.

The guest cannot run before `finish`: the resume cannot read the state,
let alone reach the sandbox, while the lock is held. If the lock is taken
(another command on the container), there is no early resume, and the
caller resumes as before. If the node dies while holding it, the kernel
releases the lock and the resume goes on: the guest is let go, as the
caller would have done.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import trio


class EarlyResume:
    """A `runsc resume` waiting for the container's lock, which this holds."""

    def __init__(self, lock_fd: int, proc: trio.Process) -> None:
        self._fd: int | None = lock_fd
        self.proc = proc

    @classmethod
    async def start(cls, lock: Path, cmd: Sequence[str], out: Path) -> EarlyResume | None:
        """Take `lock` (runsc's lock of the container) and start `cmd` (its
        `runsc resume`, output to `out`); None if the lock is held already."""
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            log = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                proc = await trio.lowlevel.open_process(
                    list(cmd), stdin=subprocess.DEVNULL, stdout=log, stderr=log
                )
            finally:
                os.close(log)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, proc)

    def release(self) -> None:
        """Let go of the lock: the resume proceeds (idempotent)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # (closing the last descriptor releases the flock)

    async def finish(self, timeout_s: float) -> int | None:
        """Let the resume proceed and wait for it: its exit status (None: it
        did not end within `timeout_s`, and was killed)."""
        self.release()
        with trio.move_on_after(timeout_s):
            return await self.proc.wait()
        self.proc.kill()
        await self.proc.wait()
        return None
