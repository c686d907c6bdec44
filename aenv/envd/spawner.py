"""A resident spawner: the process that forks envd's user processes for it.

Under gVisor, what a spawn costs is decided by what runs between fork and
exec. envd gives every user process the sandbox's process limit
(`RLIMIT_NPROC`, see `aenv.envd.guard`); set by a `preexec_fn`, that is
Python code in the child of a large interpreter, which makes CPython fork
instead of vfork and run its after-fork hooks, touching (and so copying)
many of the parent's pages: ≈ 40 ms of a ≈ 65 ms spawn here
(docs/performance.md). The limit cannot instead be carried by envd itself:
envd (root, without CAP_SYS_RESOURCE inside the sandbox) could never raise
it again, and gVisor enforces it for root too.

So envd forks one helper at its start, before it imports anything large
(`aenv.envd.spawnd`, built-in modules only: a fork of the full envd cost ≈ 19 MiB of
host memory per sandbox, its heap copied page by page as envd touched it),
captured in every memory snapshot with envd, that holds the limit as its own, hard and soft; a process it
starts inherits it without any code between fork and exec. envd sends it
a request (argv, env, cwd, uid, gid, groups, limit) with the child's
stdin, stdout and stderr as file descriptors over a SOCK_SEQPACKET socket
pair; it answers with the pid or the spawn's error, and later with each
child's exit status (it is their parent and waits for them). Orphans of
those children are still handed to pid 1, envd, which collects them.

A process of another user than root it starts with its own credentials
switched to the user's for the spawn, so that it can vfork
(`aenv.envd.spawnd`). It also checks the working directory (a missing
one is `MissingCwd`) and takes `fallback` when argv[0] does not exist, so
envd needs no stat of its own (in a worker thread) before a spawn.

`SpawnerClient` is envd's side (trio). A lower limit (from `/init`) the
spawner takes on for good; a higher one it cannot (`LimitTooHigh`), and
envd forks a new spawner at that limit, retiring the old one; one that is
gone (a user may SIGKILL it while it holds the user's credentials) envd
replaces the same way. Whenever the spawner cannot serve a request otherwise
(not started, the limit met by root's processes, gone before the request),
envd spawns the process itself as before; a spawner gone after a request
and before its answer is `Lost` (the process may have started: starting it
again could run a command twice). A spawner that does not answer for
`STALLED_S` is sent SIGCONT (a user may SIGSTOP it as well). A process
whose spawner is gone is waited for by envd, its new parent.
"""

from __future__ import annotations

import contextlib
import errno
import marshal
import os
import signal
import socket
from dataclasses import dataclass
from typing import Any

import trio

from aenv.envd.spawnd import MAX_MESSAGE, fork_spawner

__all__ = [
    "LimitTooHigh",
    "Lost",
    "MissingCwd",
    "SpawnedProcess",
    "SpawnerClient",
    "Unavailable",
    "fork_spawner",
]

ORPHAN_POLL_S = 0.05
STALLED_S = 1.0


class Unavailable(Exception):
    """The spawner cannot serve this request: spawn in envd instead."""


class LimitTooHigh(Unavailable):
    """The request's limit is above the spawner's, which it cannot raise:
    a new spawner, forked with that limit, can serve it."""


class Lost(Exception):
    """The spawner went away between a request and its answer: whether the
    process started is unknown."""


class MissingCwd(Exception):
    """The request's working directory does not exist (or is no directory)."""


# -------------------------------------------------------- envd's side (trio)


@dataclass(eq=False)
class SpawnedProcess:
    """A process the spawner started: what envd's process table needs of trio.Process."""

    pid: int
    stdin: trio.lowlevel.FdStream | None = None
    stdout: trio.lowlevel.FdStream | None = None
    stderr: trio.lowlevel.FdStream | None = None
    returncode: int | None = None

    def __post_init__(self) -> None:
        self._exited = trio.Event()

    def _set_exit(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode


class SpawnerClient:
    """envd's handle on the spawner: `spawn` requests, `run` reads the answers."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self._raw = sock
        self._sock = trio.socket.from_stdlib_socket(sock)
        self._lock = trio.Lock()
        self._reply: trio.MemorySendChannel[dict[str, Any]] | None = None
        self._children: dict[int, SpawnedProcess] = {}
        self._retired = False
        self.gone = trio.Event()

    def retire(self) -> None:
        """Take no more requests; let the spawner go once its children have exited."""
        self._retired = True
        if not self._children:
            self._sock.close()  # (the reader sees it closed and ends; the spawner, EOF)

    @property
    def alive(self) -> bool:
        return not self.gone.is_set()

    async def run(self) -> None:
        """Read the spawner's messages until it goes (then envd waits for its children)."""
        try:
            while True:
                try:
                    data = await self._sock.recv(MAX_MESSAGE)
                except (OSError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    break
                msg = marshal.loads(data)
                if "exit" in msg:
                    child = self._children.pop(msg["exit"], None)
                    if child is not None:
                        child._set_exit(msg["returncode"])
                    if self._retired and not self._children:
                        break
                elif self._reply is not None:
                    if "pid" in msg:  # known before its exit can arrive (the next message)
                        msg["process"] = self._children[msg["pid"]] = SpawnedProcess(msg["pid"])
                    self._reply.send_nowait(msg)
        finally:
            self.gone.set()
            if self._reply is not None:
                self._reply.close()
            self._sock.close()
            orphaned, self._children = list(self._children.values()), {}
            if orphaned:
                with trio.CancelScope(shield=True):
                    async with trio.open_nursery() as nursery:
                        for child in orphaned:
                            nursery.start_soon(_wait_adopted, child)

    async def _request(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """Send one request with `fds` (closed here, sent or not); its reply."""
        # (uncontended, the lock is taken and the request sent without yielding:
        # the spawner has it a scheduling round sooner)
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()
        try:
            send, receive = trio.open_memory_channel[dict[str, Any]](1)
            self._reply = send
            try:
                message = [marshal.dumps(req)]
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _fd_array(fds))]
                try:
                    try:
                        self._raw.sendmsg(message, rights)  # (non-blocking, set by trio)
                    except BlockingIOError:
                        await self._sock.sendmsg(message, rights)
                finally:
                    for fd in fds:
                        os.close(fd)
                while True:
                    with trio.move_on_after(STALLED_S):
                        try:
                            return await receive.receive()
                        except trio.EndOfChannel:
                            raise Lost("the spawner went away while starting it") from None
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.pid, signal.SIGCONT)  # (stopped by a user?)
            finally:
                self._reply = None
        finally:
            self._lock.release()

    async def spawn(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        uid: int,
        gid: int,
        groups: list[int],
        limit: int,
        stdin_enabled: bool,
        fallback: str | None = None,
    ) -> SpawnedProcess:
        """Start `argv` (`fallback` in place of argv[0] if that does not exist)
        with pipes for stdout and stderr (and stdin, or /dev/null).

        Raises OSError for the spawn's own errors (`MissingCwd` for a missing
        `cwd`), `Unavailable` when envd should spawn it itself, `Lost` when
        the spawner went before it answered."""
        if not self.alive or self._retired:
            raise Unavailable("spawner unavailable")
        req: dict[str, Any] = {
            # (exact built-in types: what marshal carries)
            "argv": [str(a) for a in argv],
            "env": {str(k): str(v) for k, v in env.items()},
            "cwd": str(cwd),
            "uid": int(uid),
            "gid": int(gid),
            "groups": [int(g) for g in groups],
            "limit": int(limit),
        }
        if fallback is not None:
            req["fallback"] = str(fallback)
        ours: list[int] = []
        theirs: list[int] = []
        try:
            # (os.pipe's ends are not inheritable; without stdin, the spawner's
            # own /dev/null is the child's: two file descriptors to send)
            if stdin_enabled:
                r, w = os.pipe()
                theirs.append(r)
                ours.append(w)
            for _ in range(2):
                r, w = os.pipe()
                theirs.append(w)
                ours.append(r)
            # shielded, as trio.lowlevel.open_process is: once asked, the spawner
            # answers, and the answer is this request's (one at a time)
            sent, theirs = theirs, []
            with trio.CancelScope(shield=True):
                reply = await self._request(req, sent)
            if "pid" in reply:
                proc: SpawnedProcess = reply["process"]
                streams = [trio.lowlevel.FdStream(fd) for fd in ours]
                ours = []
                proc.stdin = streams.pop(0) if stdin_enabled else None
                proc.stdout, proc.stderr = streams
                return proc
            if reply.get("cwd"):
                raise MissingCwd(cwd)
            if "errno" in reply:
                raise OSError(reply["errno"], reply["message"])
            if reply.get("unavailable") == "limit":
                raise LimitTooHigh("limit above the spawner's")
            raise Unavailable(str(reply.get("unavailable")))
        except OSError as e:
            if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.EBADF):
                raise Unavailable("spawner gone") from None
            raise
        finally:
            for fd in ours + theirs:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _fd_array(fds: list[int]) -> bytes:
    import array

    return array.array("i", fds).tobytes()


async def _wait_adopted(child: SpawnedProcess) -> None:
    """Wait for a child of a spawner that is gone (now envd's, as pid 1's)."""
    while child.returncode is None:
        try:
            pid, status = os.waitpid(child.pid, os.WNOHANG)  # noqa: ASYNC222 (never blocks)
        except ChildProcessError:
            if not os.path.exists(f"/proc/{child.pid}"):  # noqa: ASYNC240 (procfs)
                child._set_exit(-signal.SIGKILL)
                return
        else:
            if pid:
                child._set_exit(os.waitstatus_to_exitcode(status))
                return
        await trio.sleep(ORPHAN_POLL_S)
    child._set_exit(child.returncode)
