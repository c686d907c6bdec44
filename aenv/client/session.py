"""Client side of the exec WebSocket (docs/exec-protocol.md), on trio.

`run_session` connects to `/sandboxes/{id}/exec`, starts one process and
pumps bytes both ways until it exits: local stdin to the process (with the
detach sequence filtered out on a TTY), its stdout/stderr (or PTY output) to
local file descriptors, SIGWINCH as `resize`, and, when the terminal is not
in raw mode, SIGINT as `signal TERM` (a second one as `signal KILL`). Output
is written to the local descriptors before the next frame is read, and the
WebSocket's receive queue holds one message, so a slow local reader slows
the remote process instead of growing memory. Silence from the node for
three keepalive intervals counts as a lost connection.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import signal
import ssl
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
import trio_websocket

from aenv.client.config import Credentials
from aenv.client.errors import CliError, ProtocolViolation, ServerError, Unreachable, from_status
from aenv.client.terminal import DetachFilter, raw_mode, window_size
from aenv.kit.errors import first_leaf, sole_leaf

CH_STDIN = 0
CH_STDOUT = 1
CH_STDERR = 2
CH_PTY = 3
EXIT_NOT_STARTED = 127
KEEPALIVE_S = 15.0
READ_SIZE = 64 * 1024
MAX_MESSAGE = 16 * 1024 * 1024


class CommandNotStarted(CliError):
    """envd refused to start the command (missing binary, bad cwd, unknown user)."""

    exit_code = EXIT_NOT_STARTED


@dataclass
class ExecRequest:
    cmd: str
    args: list[str] = field(default_factory=list)
    envs: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None  # None: the sandbox's default user
    pty: bool = False
    stdin: bool = True

    def start_message(self, size: tuple[int, int] | None, keepalive: float) -> dict[str, Any]:
        msg: dict[str, Any] = {
            "type": "start",
            "cmd": self.cmd,
            "args": self.args,
            "envs": self.envs,
            "stdin": self.stdin,
            "keepalive": keepalive,
        }
        if self.user is not None:
            msg["user"] = self.user
        if self.cwd is not None:
            msg["cwd"] = self.cwd
        if self.pty:
            cols, rows = size or (80, 24)
            msg["pty"] = {"cols": cols, "rows": rows}
        return msg


@dataclass
class SessionResult:
    exit_code: int
    detached: bool = False
    status: str = ""


@dataclass
class Terminal:
    """Local descriptors of a session and how to treat them."""

    stdin_fd: int | None = 0
    stdout_fd: int = 1
    stderr_fd: int = 2
    raw: bool = False  # stdin is a TTY in raw mode: detach keys, resize, no SIGINT
    resize_fd: int | None = None  # the TTY whose size SIGWINCH reports


class _Detached(Exception):
    pass


class _LocalSignal(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def single_error(group: BaseExceptionGroup[Any]) -> BaseException:
    """The one meaningful exception inside a (nested) group, else the group."""
    return first_leaf(group, _Detached, _LocalSignal, CliError) or sole_leaf(group) or group


def _ws_target(url: str, sandbox_id: str) -> tuple[str, int, str, bool | ssl.SSLContext]:
    parts = urllib.parse.urlsplit(url)
    secure = parts.scheme == "https"
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if secure else 80)
    resource = parts.path.rstrip("/") + f"/sandboxes/{urllib.parse.quote(sandbox_id, safe='')}/exec"
    return host, port, resource, (ssl.create_default_context() if secure else False)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


async def _read_some(fd: int) -> bytes:
    """Read from `fd` without blocking trio (epoll where it works, a thread where not)."""
    try:
        await trio.lowlevel.wait_readable(fd)
    except OSError as e:
        if e.errno != errno.EPERM:  # regular files and /dev/null cannot be polled
            raise
        return await trio.to_thread.run_sync(os.read, fd, READ_SIZE)
    return os.read(fd, READ_SIZE)


def _rejection(e: trio_websocket.ConnectionRejected) -> CliError:
    message = f"HTTP {e.status_code}"
    try:
        body = json.loads(e.body or b"")
        if isinstance(body, dict) and isinstance(body.get("message"), str):
            message = body["message"]
    except ValueError:
        pass
    return from_status(e.status_code, message)


async def run_session(
    creds: Credentials,
    sandbox_id: str,
    req: ExecRequest,
    term: Terminal,
    *,
    keepalive: float = KEEPALIVE_S,
    on_started: Callable[[int], None] | None = None,
    refresh: Callable[[], object] | None = None,
    refresh_every: float = 60.0,
) -> SessionResult:
    """Run `req` in the sandbox until it exits (or the user detaches)."""
    host, port, resource, use_ssl = _ws_target(creds.url, sandbox_id)
    headers = [(b"x-api-key", creds.api_key.encode()), (b"user-agent", b"aenv-cli")]
    try:
        async with trio_websocket.open_websocket(
            host,
            port,
            resource,
            use_ssl=use_ssl,
            extra_headers=headers,
            message_queue_size=1,
            max_message_size=MAX_MESSAGE,
            connect_timeout=15,
            disconnect_timeout=2,
        ) as ws:
            return await _Session(ws, req, term, keepalive).run(on_started, refresh, refresh_every)
    except BaseExceptionGroup as group:
        raise _map_error(single_error(group), creds.url) from None
    except Exception as e:
        raise _map_error(e, creds.url) from None


def _map_error(err: BaseException, url: str) -> BaseException:
    if isinstance(err, CliError):
        return err
    if isinstance(err, trio_websocket.ConnectionRejected):
        return _rejection(err)
    if isinstance(err, trio_websocket.DisconnectionTimeout):
        return Unreachable("the node did not close the session in time")
    if isinstance(err, OSError | trio_websocket.HandshakeError | trio_websocket.ConnectionTimeout):
        inner = err.__cause__ or err.__context__
        detail = str(err) or (str(inner) if inner is not None else "") or type(err).__name__
        return Unreachable(f"cannot reach the node at {url}: {detail}")
    if isinstance(err, trio_websocket.ConnectionClosed):
        return Unreachable("the node closed the session before the command finished")
    return err


class _Session:
    def __init__(
        self,
        ws: trio_websocket.WebSocketConnection,
        req: ExecRequest,
        term: Terminal,
        keepalive: float,
    ) -> None:
        self.ws = ws
        self.req = req
        self.term = term
        self.keepalive = keepalive
        self.result: SessionResult | None = None
        self.interrupts = 0

    async def _send_json(self, msg: dict[str, Any]) -> None:
        await self._send(json.dumps(msg, separators=(",", ":")))

    async def _send(self, data: str | bytes) -> None:
        """Send a frame; a closed connection is left for the output loop to report."""
        with contextlib.suppress(trio_websocket.ConnectionClosed):
            await self.ws.send_message(data)

    async def _receive(self) -> str | bytes:
        with trio.move_on_after(self.keepalive * 3) as idle:
            try:
                return await self.ws.get_message()
            except trio_websocket.ConnectionClosed as e:
                reason = e.reason
                detail = f" ({reason.code} {reason.reason or ''})".rstrip() if reason else ""
                raise Unreachable(
                    f"the node closed the session before the command finished{detail}"
                ) from None
        assert idle.cancelled_caught
        raise Unreachable(f"connection lost: no word from the node for {self.keepalive * 3:g} s")

    async def run(
        self,
        on_started: Callable[[int], None] | None,
        refresh: Callable[[], object] | None,
        refresh_every: float,
    ) -> SessionResult:
        size = window_size(self.term.resize_fd) if self.term.resize_fd is not None else None
        await self._send_json(self.req.start_message(size, self.keepalive))
        pid = await self._wait_started()
        if on_started is not None:
            on_started(pid)
        try:
            async with trio.open_nursery() as nursery:
                if self.req.stdin and self.term.stdin_fd is not None:
                    nursery.start_soon(self._stdin_pump, self.term.stdin_fd)
                if self.req.pty and self.term.resize_fd is not None:
                    nursery.start_soon(self._resize_pump, self.term.resize_fd)
                nursery.start_soon(self._signal_pump)
                if refresh is not None:
                    nursery.start_soon(self._refresh_pump, refresh, refresh_every)
                await self._output()
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            err = single_error(group)
            if isinstance(err, _Detached):
                return SessionResult(0, detached=True)
            if isinstance(err, _LocalSignal):
                return SessionResult(128 + err.signum, status="interrupted locally")
            raise err from None
        assert self.result is not None
        return self.result

    async def _wait_started(self) -> int:
        while True:
            raw = await self._receive()
            if isinstance(raw, bytes):
                raise ProtocolViolation("the node sent output before the process started")
            msg = self._parse(raw)
            kind = msg.get("type")
            if kind == "started":
                pid = msg.get("pid")
                return pid if isinstance(pid, int) else 0
            if kind == "error":
                text = str(msg.get("message", "unknown error"))
                if msg.get("code") in ("invalid_argument", "not_found", "unauthenticated"):
                    raise CommandNotStarted(f"cannot start {self.req.cmd!r}: {text}")
                raise ServerError(f"exec: {text}", 500)
            if kind != "keepalive":
                raise ProtocolViolation(f"unexpected {kind!r} message before the process started")

    @staticmethod
    def _parse(raw: str) -> dict[str, Any]:
        try:
            msg = json.loads(raw)
        except ValueError:
            raise ProtocolViolation("the node sent a malformed control message") from None
        if not isinstance(msg, dict):
            raise ProtocolViolation("the node sent a malformed control message")
        return msg

    async def _output(self) -> None:
        while True:
            raw = await self._receive()
            if isinstance(raw, bytes):
                if not raw:
                    continue
                fd = self.term.stderr_fd if raw[0] == CH_STDERR else self.term.stdout_fd
                await trio.to_thread.run_sync(_write_all, fd, raw[1:])
                continue
            msg = self._parse(raw)
            kind = msg.get("type")
            if kind == "exit":
                code = msg.get("code")
                self.result = SessionResult(
                    code if isinstance(code, int) else 255, status=str(msg.get("status", ""))
                )
                return
            if kind == "error":
                text = str(msg.get("message", "unknown error"))
                if msg.get("fatal", True):
                    raise ServerError(f"exec: {text}", 500)
                await trio.to_thread.run_sync(
                    _write_all, self.term.stderr_fd, f"aenv: remote: {text}\r\n".encode()
                )

    async def _stdin_pump(self, fd: int) -> None:
        detach = DetachFilter() if self.term.raw else None
        while True:
            data = await _read_some(fd)
            if not data:
                if self.req.pty:
                    await self._send(bytes((CH_STDIN,)) + b"\x04")
                else:
                    await self._send_json({"type": "close-stdin"})
                return
            if detach is not None:
                data, leave = detach.feed(data)
                if data:
                    await self._send(bytes((CH_STDIN,)) + data)
                if leave:
                    raise _Detached()
                continue
            await self._send(bytes((CH_STDIN,)) + data)

    async def _resize_pump(self, fd: int) -> None:
        with trio.open_signal_receiver(signal.SIGWINCH) as signals:
            async for _ in signals:
                cols, rows = window_size(fd)
                await self._send_json({"type": "resize", "cols": cols, "rows": rows})

    async def _signal_pump(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async for sig in signals:
                if self.term.raw and sig != signal.SIGINT:
                    raise _LocalSignal(sig)  # leave, restoring the terminal
                self.interrupts += 1
                strong = sig != signal.SIGINT or self.interrupts > 1
                await self._send_json({"type": "signal", "signal": "KILL" if strong else "TERM"})

    async def _refresh_pump(self, refresh: Callable[[], object], every: float) -> None:
        while True:
            await trio.sleep(every)
            with contextlib.suppress(CliError):
                await trio.to_thread.run_sync(refresh)


def run_attached(
    creds: Credentials,
    sandbox_id: str,
    req: ExecRequest,
    *,
    on_started: Callable[[int], None] | None = None,
    refresh: Callable[[], object] | None = None,
) -> SessionResult:
    """Run a session on this process's stdin/stdout/stderr.

    With `req.pty` and a TTY on stdin, the terminal is put in raw mode for
    the session (Ctrl-C and friends go to the remote process; `Ctrl-] d`
    detaches) and restored however the session ends.
    """
    stdin_tty = os.isatty(0)
    raw = req.pty and stdin_tty
    resize_fd: int | None = None
    if req.pty:
        resize_fd = 0 if stdin_tty else (1 if os.isatty(1) else None)
    term = Terminal(stdin_fd=0 if req.stdin else None, raw=raw, resize_fd=resize_fd)
    guard = raw_mode(0) if raw else contextlib.nullcontext()
    with guard:
        return trio.run(
            functools.partial(
                run_session, creds, sandbox_id, req, term, on_started=on_started, refresh=refresh
            )
        )
