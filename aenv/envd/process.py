"""process.Process: starting, attaching to and controlling user processes.

Each process runs in a task of envd's service nursery, not of the request
that started it, so background commands survive the Start stream's client
going away. Output is fanned out to every attached stream (Start or Connect)
through bounded channels, in the order it is read; output produced while no
stream is attached is dropped, as in E2B's envd. A process runs as the
requested user (setgid/setgroups/setuid by the spawn), in its own process
group (signals go to the group), with stdin a pipe or /dev/null, or on a new
PTY with the PTY as its controlling terminal. When `Connect-Timeout-Ms` is
set on Start, the process is killed when it expires. Ended processes are
kept for a while so a late Connect still gets the exit status.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import signal
import struct
import subprocess
import termios
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from aenv.envd.guard import limit_processes
from aenv.envd.rpc import CallContext, SendMessage
from aenv.envd.spawner import (
    LimitTooHigh,
    Lost,
    MissingCwd,
    SpawnedProcess,
    SpawnerClient,
    Unavailable,
    fork_spawner,
)
from aenv.envd.state import EnvdState
from aenv.envd.users import User, UserDB, process_env, resolve_path
from aenv.proto.connect import Code, ConnectError
from aenv.proto.envd_schema import (
    PROCESS_CONFIG,
    PROCESS_SELECTOR,
    START_REQUEST,
    Signal,
)
from aenv.proto.pb import Message, which_oneof

log = logging.getLogger("aenv.envd.process")

CHUNK = 32 * 1024
PTY_CHUNK = 16 * 1024
SUBSCRIBER_BUFFER = 64
DEFAULT_KEEPALIVE = 90.0
EXIT_DRAIN_IDLE = 0.1
RETAINED_EXITS = 256

_SIGNAL_NAMES = {
    signal.SIGHUP: "hangup",
    signal.SIGINT: "interrupt",
    signal.SIGQUIT: "quit",
    signal.SIGILL: "illegal instruction",
    signal.SIGTRAP: "trace/breakpoint trap",
    signal.SIGABRT: "aborted",
    signal.SIGBUS: "bus error",
    signal.SIGFPE: "floating point exception",
    signal.SIGKILL: "killed",
    signal.SIGUSR1: "user defined signal 1",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGUSR2: "user defined signal 2",
    signal.SIGPIPE: "broken pipe",
    signal.SIGALRM: "alarm clock",
    signal.SIGTERM: "terminated",
}


def end_event(returncode: int) -> Message:
    """The EndEvent for a wait status as Python reports it (negative = signal)."""
    if returncode >= 0:
        status = f"exit status {returncode}"
        msg: Message = {"exit_code": returncode, "exited": True, "status": status}
        if returncode != 0:
            msg["error"] = status
        return msg
    sig = -returncode
    try:
        name = _SIGNAL_NAMES.get(signal.Signals(sig), f"signal {sig}")
    except ValueError:
        name = f"signal {sig}"
    status = f"signal: {name}"
    return {"exit_code": -1, "exited": False, "status": status, "error": status}


def _set_ctty() -> None:  # runs in the child between fork and exec
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _both(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:  # runs in the child between fork and exec
        first()
        then()

    return run


# what runs in place of a program that does not exist (as E2B's envd does)
SHELL_FALLBACK = {"/bin/bash": "/bin/sh"}


async def _checked(argv: list[str], cwd: str) -> list[str]:
    """What the spawner checks, for a process envd starts itself: the cwd
    exists (else `MissingCwd`), and argv with its fallback if argv[0] does not."""
    cwd_ok, has_cmd = await trio.to_thread.run_sync(
        lambda: (os.path.isdir(cwd), os.path.exists(argv[0]))
    )
    if not cwd_ok:
        raise MissingCwd(cwd)
    if argv[0] in SHELL_FALLBACK and not has_cmd:
        return [SHELL_FALLBACK[argv[0]], *argv[1:]]
    return argv


def set_winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


@dataclass(eq=False)
class ManagedProcess:
    config: Message
    tag: str | None
    pid: int = 0
    is_pty: bool = False
    master_fd: int | None = None
    stdin: trio.abc.SendStream | None = None
    pty_stream: trio.lowlevel.FdStream | None = None
    proc: trio.Process | SpawnedProcess | None = None
    subscribers: set[trio.MemorySendChannel[Message]] = field(default_factory=set)
    end: Message | None = None
    ended: trio.Event = field(default_factory=trio.Event)
    input_lock: trio.Lock = field(default_factory=trio.Lock)
    last_output: float = 0.0
    busy: int = 0
    readers_open: int = 0
    readers_done: trio.Event = field(default_factory=trio.Event)

    def subscribe(self) -> trio.MemoryReceiveChannel[Message]:
        send, receive = trio.open_memory_channel[Message](SUBSCRIBER_BUFFER)
        if self.end is not None:
            send.send_nowait({"end": self.end})
            send.close()
        else:
            self.subscribers.add(send)
        return receive

    def offer(self, event: Message) -> list[trio.MemorySendChannel[Message]]:
        """Publish `event` at once to every subscriber with room for it; those
        without (a full buffer: a slow client) are returned for `publish`."""
        full = []
        for channel in list(self.subscribers):
            try:
                channel.send_nowait(event)
            except trio.WouldBlock:
                full.append(channel)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.subscribers.discard(channel)
        return full

    async def publish(
        self, event: Message, to: list[trio.MemorySendChannel[Message]] | None = None
    ) -> None:
        """Publish `event` to every subscriber (or those of `to`), waiting for room."""
        for channel in list(self.subscribers) if to is None else to:
            try:
                await channel.send(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.subscribers.discard(channel)

    def info(self) -> Message:
        msg: Message = {"config": self.config, "pid": self.pid}
        if self.tag is not None:
            msg["tag"] = self.tag
        return msg

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)
        except PermissionError:
            os.kill(self.pid, sig)


class ProcessService:
    """Handlers of process.Process, holding the table of live processes."""

    def __init__(
        self,
        nursery: trio.Nursery,
        state: EnvdState,
        users: UserDB,
        resolve_user: Callable[[CallContext], User],
        spawner: SpawnerClient | None = None,
    ) -> None:
        self._nursery = nursery
        self._spawner = spawner
        self._state = state
        self._users = users
        self._resolve_user = resolve_user
        self.live: dict[int, ManagedProcess] = {}
        # spawns under way whose pid is not in `live` yet (the orphan reaper
        # must not collect such a child if it exits at once)
        self.spawning = 0
        self.retained: OrderedDict[int, ManagedProcess] = OrderedDict()

    def handlers(self) -> dict[str, Any]:
        p = "/process.Process/"
        return {
            p + "Start": self.start,
            p + "Connect": self.connect,
            p + "List": self.list,
            p + "SendInput": self.send_input,
            p + "StreamInput": self.stream_input,
            p + "CloseStdin": self.close_stdin,
            p + "SendSignal": self.send_signal,
            p + "Update": self.update,
        }

    # ----------------------------------------------------------- lookup

    def _find(self, selector: Message | None, *, include_ended: bool = False) -> ManagedProcess:
        selector = selector or PROCESS_SELECTOR.default()
        kind = which_oneof(selector, PROCESS_SELECTOR, "selector")
        tables = [self.live] + ([self.retained] if include_ended else [])
        if kind == "tag":
            tag = selector["tag"]
            for table in tables:
                for mp in table.values():
                    if mp.tag == tag:
                        return mp
            raise ConnectError(Code.NOT_FOUND, f"process with tag {tag} not found")
        pid = selector.get("pid", 0)
        for table in tables:
            if pid in table:
                return table[pid]
        raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found")

    # ------------------------------------------------------------ start

    async def start(self, req: Message, ctx: CallContext, send: SendMessage) -> Message | None:
        user = self._resolve_user(ctx)
        config = req.get("process") or PROCESS_CONFIG.default()
        cmd = config.get("cmd", "")
        if not cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process cmd is empty")
        try:
            cwd = resolve_path(config.get("cwd", ""), user, self._state.default_workdir)
        except ValueError as e:
            raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from None
        argv = [cmd, *config.get("args", [])]
        env = process_env(user, self._state.env_vars, config.get("envs", {}))
        mp = ManagedProcess(config=config, tag=req.get("tag"))
        receive = mp.subscribe()
        pty = req.get("pty")
        stdin_enabled = req.get("stdin", True)
        deadline = trio.current_time() + ctx.timeout if ctx.timeout else float("inf")
        with receive:
            await self._launch(mp, argv, env, cwd, user, pty, stdin_enabled, deadline)
            await send({"event": {"start": {"pid": mp.pid}}})
            return await self._forward(receive, ctx, send)

    async def _forward(
        self, receive: trio.MemoryReceiveChannel[Message], ctx: CallContext, send: SendMessage
    ) -> Message | None:
        """Send the process's events as they come; the last, its `end`, is
        returned, to go out with the end of the stream."""
        interval = DEFAULT_KEEPALIVE
        raw = ctx.header("keepalive-ping-interval")
        if raw and raw.strip().isdigit() and int(raw) > 0:
            interval = float(int(raw))
        while True:
            with trio.move_on_after(interval) as idle:
                try:
                    event = await receive.receive()
                except trio.EndOfChannel:
                    return None
            if idle.cancelled_caught:
                await send({"event": {"keepalive": {}}})
                continue
            if "end" in event:
                return {"event": event}
            await send({"event": event})

    async def _spawn(
        self,
        mp: ManagedProcess,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        user: User,
        pty: Message | None,
        stdin_enabled: bool,
    ) -> trio.Process | SpawnedProcess:
        groups = self._users.groups_of(user)
        common: dict[str, Any] = {
            "env": env,
            "cwd": cwd,
            "close_fds": True,
            "restore_signals": True,
        }
        if os.getuid() == 0:
            common.update(user=user.uid, group=user.gid, extra_groups=groups)
        limit = self._state.process_limit
        checked = False
        if cwd not in (user.home, resolve_path("", user, self._state.default_workdir)):
            # a cwd elsewhere may be on a volume mount that hangs: stat it in a worker
            # thread here rather than let the spawner (which serves every spawn) hang
            argv, checked = await _checked(argv, cwd), True
        if pty is None and self._spawner is not None and limit is not None:
            # the resident spawner holds the limit: no Python between fork and exec
            spawned = await self._via_spawner(argv, env, cwd, user, groups, limit, stdin_enabled)
            if spawned is not None:
                mp.stdin = spawned.stdin
                return spawned
        if not checked:
            argv = await _checked(argv, cwd)
        cap = None if limit is None else limit_processes(limit)
        if pty is not None:
            master, slave = os.openpty()
            size = pty.get("size") or {}
            cols, rows = size.get("cols", 0) or 80, size.get("rows", 0) or 24
            try:
                set_winsize(slave, cols, rows)
                proc = await trio.lowlevel.open_process(
                    argv,
                    stdin=slave,
                    stdout=slave,
                    stderr=slave,
                    start_new_session=True,
                    preexec_fn=_set_ctty if cap is None else _both(cap, _set_ctty),
                    **common,
                )
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)
            mp.is_pty = True
            mp.master_fd = master
            mp.pty_stream = trio.lowlevel.FdStream(master)
            return proc
        proc = await trio.lowlevel.open_process(
            argv,
            stdin=subprocess.PIPE if stdin_enabled else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            process_group=0,
            preexec_fn=cap,
            **common,
        )
        mp.stdin = proc.stdin
        return proc

    def spawner_pids(self) -> list[int]:
        return [self._spawner.pid] if self._spawner is not None else []

    async def _via_spawner(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        user: User,
        groups: list[int],
        limit: int,
        stdin_enabled: bool,
    ) -> SpawnedProcess | None:
        """The process started by the spawner, or None: spawn it in envd."""
        for _ in range(3):
            spawner = self._spawner
            if spawner is None:
                return None
            if not spawner.alive:
                # (killed: a user may, while it holds the user's credentials)
                if not self._replace_spawner(spawner, limit):
                    return None
                continue
            try:
                return await spawner.spawn(
                    argv,
                    env=env,
                    cwd=cwd,
                    uid=user.uid,
                    gid=user.gid,
                    groups=groups,
                    limit=limit,
                    stdin_enabled=stdin_enabled,
                    fallback=SHELL_FALLBACK.get(argv[0]),
                )
            except LimitTooHigh:
                # (a memory image of a smaller sandbox): a new spawner at this limit
                if not self._replace_spawner(spawner, limit):
                    return None
            except Unavailable:
                return None
        return None

    def _replace_spawner(self, spawner: SpawnerClient, limit: int) -> bool:
        """Retire `spawner` for a new one (forked from envd) holding `limit`;
        False if there is none now."""
        if spawner is not self._spawner:  # (replaced meanwhile)
            return self._spawner is not None
        self._spawner = None
        spawner.retire()
        try:
            fresh = SpawnerClient(*fork_spawner(limit))
        except OSError:
            log.exception("could not fork a new spawner")
            return False
        self._nursery.start_soon(fresh.run)
        self._spawner = fresh
        return True

    async def _launch(
        self,
        mp: ManagedProcess,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        user: User,
        pty: Message | None,
        stdin_enabled: bool,
        deadline: float,
    ) -> None:
        """Start the process (in the calling task: no task to wait for), then
        hand it to a task of the service nursery that outlives the call."""
        self.spawning += 1
        try:
            proc = await self._spawn(mp, argv, env, cwd, user, pty, stdin_enabled)
        except MissingCwd:
            raise ConnectError(Code.INVALID_ARGUMENT, f"cwd '{cwd}' does not exist") from None
        except Lost as e:
            raise ConnectError(Code.INTERNAL, f"error starting process: {e}") from None
        except OSError as e:
            raise ConnectError(
                Code.INVALID_ARGUMENT,
                f"error starting process '{' '.join(argv)}': {e.strerror or e}",
            ) from None
        else:
            # (no checkpoint from here to start_soon: the process is never left unwatched)
            mp.proc = proc
            mp.pid = proc.pid
            self.live[mp.pid] = mp
            self.retained.pop(mp.pid, None)
            self._nursery.start_soon(self._run, mp, proc, deadline)
        finally:
            self.spawning -= 1

    async def _run(
        self, mp: ManagedProcess, proc: trio.Process | SpawnedProcess, deadline: float
    ) -> None:
        """Forward the process's output, kill it at `deadline`, publish its end."""
        mp.last_output = trio.current_time()
        try:
            async with trio.open_nursery() as readers:
                mp.readers_open = 1 if mp.pty_stream is not None else 2
                if mp.pty_stream is not None:
                    readers.start_soon(self._read, mp, mp.pty_stream, "pty", PTY_CHUNK)
                else:
                    assert proc.stdout is not None and proc.stderr is not None
                    readers.start_soon(self._read, mp, proc.stdout, "stdout", CHUNK)
                    readers.start_soon(self._read, mp, proc.stderr, "stderr", CHUNK)
                with trio.move_on_at(deadline):
                    await proc.wait()
                if proc.returncode is None:
                    mp.signal(signal.SIGKILL)
                    await proc.wait()
                # The process is gone; take what its pipes still hold, but do not
                # wait for grandchildren that inherited them and stay silent.
                while not mp.readers_done.is_set():
                    with trio.move_on_after(EXIT_DRAIN_IDLE):
                        await mp.readers_done.wait()
                        break
                    if not mp.busy and trio.current_time() - mp.last_output >= EXIT_DRAIN_IDLE:
                        break
                readers.cancel_scope.cancel()
                # (the readers are done or cancelled: nothing is published after the
                # end; offered here, it does not wait for the nursery to close)
                assert proc.returncode is not None
                mp.end = end_event(proc.returncode)
                full = mp.offer({"end": mp.end})
            if full:
                await mp.publish({"end": mp.end}, to=full)
        finally:
            with trio.CancelScope(shield=True):
                if proc.returncode is None:
                    mp.signal(signal.SIGKILL)
                for channel in list(mp.subscribers):
                    channel.close()
                mp.subscribers.clear()
                for stream in (mp.stdin, mp.pty_stream, proc.stdout, proc.stderr):
                    if stream is not None:
                        with trio.move_on_after(1):
                            await stream.aclose()
                if mp.end is None:
                    mp.end = end_event(proc.returncode if proc.returncode is not None else -9)
                mp.ended.set()
                if self.live.get(mp.pid) is mp:
                    del self.live[mp.pid]
                self.retained[mp.pid] = mp
                while len(self.retained) > RETAINED_EXITS:
                    self.retained.popitem(last=False)
                if proc.returncode is None:
                    with trio.move_on_after(2):
                        await proc.wait()

    async def _read(
        self, mp: ManagedProcess, stream: trio.abc.ReceiveStream, name: str, size: int
    ) -> None:
        try:
            while True:
                try:
                    data = await stream.receive_some(size)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                except OSError as e:
                    if e.errno == errno.EIO:  # PTY slave closed
                        return
                    raise
                if not data:
                    return
                mp.busy += 1
                try:
                    await mp.publish({"data": {name: data}})
                finally:
                    mp.busy -= 1
                    mp.last_output = trio.current_time()
        finally:
            mp.readers_open -= 1
            if mp.readers_open <= 0:
                mp.readers_done.set()

    # ------------------------------------------------------- other calls

    async def connect(self, req: Message, ctx: CallContext, send: SendMessage) -> Message | None:
        mp = self._find(req.get("process"), include_ended=True)
        receive = mp.subscribe()
        with receive:
            await send({"event": {"start": {"pid": mp.pid}}})
            return await self._forward(receive, ctx, send)

    async def list(self, req: Message, ctx: CallContext) -> Message:
        return {"processes": [mp.info() for mp in self.live.values()]}

    async def _write_input(self, mp: ManagedProcess, inp: Message | None) -> None:
        inp = inp or {}
        target: trio.abc.SendStream
        if "pty" in inp:
            if mp.pty_stream is None:
                raise ConnectError(
                    Code.INTERNAL, "error writing to tty: tty not assigned to process"
                )
            data, target = inp["pty"], mp.pty_stream
        elif "stdin" in inp:
            if mp.is_pty:
                raise ConnectError(
                    Code.INTERNAL,
                    "error writing to stdin: tty assigned to process — input should be "
                    "written to the pty, not the stdin",
                )
            if mp.stdin is None:
                raise ConnectError(
                    Code.INTERNAL, "error writing to stdin: stdin not enabled or closed"
                )
            data, target = inp["stdin"], mp.stdin
        else:
            raise ConnectError(Code.UNIMPLEMENTED, "invalid input type")
        if not data:
            return
        async with mp.input_lock:
            try:
                await target.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
                raise ConnectError(Code.INTERNAL, f"error writing input: {e}") from None

    async def send_input(self, req: Message, ctx: CallContext) -> Message:
        mp = self._find(req.get("process"))
        await self._write_input(mp, req.get("input"))
        return {}

    async def stream_input(self, requests: Any, ctx: CallContext) -> Message:
        mp: ManagedProcess | None = None
        async for msg in requests:
            if "start" in msg:
                mp = self._find(msg["start"].get("process"))
            elif "data" in msg:
                if mp is None:
                    raise ConnectError(Code.FAILED_PRECONDITION, "input before start event")
                await self._write_input(mp, msg["data"].get("input"))
        return {}

    async def close_stdin(self, req: Message, ctx: CallContext) -> Message:
        mp = self._find(req.get("process"))
        if mp.is_pty:
            raise ConnectError(
                Code.UNKNOWN,
                "error closing stdin: cannot close stdin for PTY process — send Ctrl+D (0x04) instead",
            )
        if mp.stdin is not None:
            stdin, mp.stdin = mp.stdin, None
            async with mp.input_lock:
                await stdin.aclose()
        return {}

    async def send_signal(self, req: Message, ctx: CallContext) -> Message:
        mp = self._find(req.get("process"))
        sig = req.get("signal", 0)
        if sig == Signal.SIGKILL:
            mp.signal(signal.SIGKILL)
        elif sig == Signal.SIGTERM:
            mp.signal(signal.SIGTERM)
        else:
            raise ConnectError(Code.UNIMPLEMENTED, f"invalid signal: {sig}")
        return {}

    async def update(self, req: Message, ctx: CallContext) -> Message:
        mp = self._find(req.get("process"))
        pty = req.get("pty")
        if pty is not None:
            if mp.master_fd is None:
                raise ConnectError(Code.INTERNAL, "error resizing tty: tty not assigned to process")
            size = pty.get("size") or {}
            try:
                set_winsize(mp.master_fd, size.get("cols", 0), size.get("rows", 0))
            except OSError as e:
                raise ConnectError(Code.INTERNAL, f"error resizing tty: {e}") from None
        return {}


__all__ = ["START_REQUEST", "ManagedProcess", "ProcessService", "end_event"]
