"""`GET /sandboxes/{id}/exec`: a WebSocket that runs one process in a sandbox.

The `aenv` CLI's `exec`, `connect` and `start` speak this small protocol
(docs/exec-protocol.md): text frames are JSON control messages, binary frames
are one channel byte followed by data. The handler authenticates with the
node's API key like every REST route, then turns the session into envd
Connect calls (`aenv.node.envd_client`) on the sandbox's network slot: one
`process.Process/Start` server stream for output and the exit status, and
unary `SendInput`, `Update`, `SendSignal` and `CloseStdin` calls for what
the client sends.
Flow control is end to end: the output loop sends each frame before it reads
more from envd, so a slow WebSocket client stops the read, which fills envd's
bounded fan-out, which stops envd reading the process's pipe. Nothing here
buffers more than one envd chunk. A client that goes away kills the process.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import httpx
import trio
from quart import Blueprint, Response, websocket

from aenv.api.auth import api_key_refusal
from aenv.api.common import deps, error_response
from aenv.node import service as sv
from aenv.node.envd_client import EnvdClient
from aenv.proto import connect as cn
from aenv.proto import envd_schema as es
from aenv.proto import jsonbody
from aenv.proto.pb import DecodeError, Message
from aenv.runtimes.base import ENVD_PORT

log = logging.getLogger("aenv.api.exec")

# Channel bytes that open every binary frame.
CH_STDIN = 0
CH_STDOUT = 1
CH_STDERR = 2
CH_PTY = 3
_OUT_CHANNELS = {"stdout": CH_STDOUT, "stderr": CH_STDERR, "pty": CH_PTY}

START_TIMEOUT_S = 30.0
DEFAULT_KEEPALIVE_S = 15.0
MIN_KEEPALIVE_S = 1.0
MAX_KEEPALIVE_S = 300.0
MAX_INPUT_FRAME = 1024 * 1024
CLEANUP_TIMEOUT_S = 5.0

_SIGNALS = {"TERM": es.Signal.SIGTERM, "KILL": es.Signal.SIGKILL}
# envd reports a signal death by name (its EndEvent status "signal: <name>").
_SIGNAL_NUMBERS = {
    "hangup": 1,
    "interrupt": 2,
    "quit": 3,
    "illegal instruction": 4,
    "trace/breakpoint trap": 5,
    "aborted": 6,
    "bus error": 7,
    "floating point exception": 8,
    "killed": 9,
    "user defined signal 1": 10,
    "segmentation fault": 11,
    "user defined signal 2": 12,
    "broken pipe": 13,
    "alarm clock": 14,
    "terminated": 15,
}


class ProtocolError(Exception):
    """The client broke the protocol; the session ends with this message."""


@dataclass(frozen=True)
class StartSpec:
    """A validated `start` message."""

    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None
    user: str | None  # None: the sandbox's default user
    pty: tuple[int, int] | None
    stdin: bool
    keepalive_s: float

    def start_request(self) -> Message:
        config: Message = {"cmd": self.cmd, "args": self.args, "envs": self.envs}
        if self.cwd is not None:
            config["cwd"] = self.cwd
        req: Message = {"process": config, "stdin": self.stdin}
        if self.pty is not None:
            cols, rows = self.pty
            req["pty"] = {"size": {"cols": cols, "rows": rows}}
        return req


def _size(obj: Any, what: str) -> tuple[int, int]:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} must be an object with cols and rows")
    cols, rows = obj.get("cols"), obj.get("rows")
    for name, v in (("cols", cols), ("rows", rows)):
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 10000:
            raise ProtocolError(f"{what}.{name} must be an integer between 1 and 10000")
    assert isinstance(cols, int) and isinstance(rows, int)
    return cols, rows


def parse_start(raw: str | bytes) -> StartSpec:
    """Validate the first message of a session (raises ProtocolError)."""
    if isinstance(raw, bytes):
        raise ProtocolError("the first message must be a JSON text frame of type start")
    try:
        msg = jsonbody.loads(raw)
    except ValueError as e:
        raise ProtocolError(f"invalid JSON: {e}") from None
    if not isinstance(msg, dict) or msg.get("type") != "start":
        raise ProtocolError("the first message must be of type start")
    cmd = msg.get("cmd")
    if not isinstance(cmd, str) or not cmd:
        raise ProtocolError("start.cmd must be a non-empty string")
    args = msg.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ProtocolError("start.args must be a list of strings")
    envs = msg.get("envs", {})
    if not isinstance(envs, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in envs.items()
    ):
        raise ProtocolError("start.envs must be an object of strings")
    cwd = msg.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise ProtocolError("start.cwd must be a string")
    user = msg.get("user")  # None: the sandbox's default user (its template's)
    if user is not None and (not isinstance(user, str) or not user or ":" in user):
        raise ProtocolError("start.user must be a user name")
    pty_raw = msg.get("pty")
    pty = None if pty_raw is None else _size(pty_raw, "start.pty")
    stdin = msg.get("stdin", True)
    if not isinstance(stdin, bool):
        raise ProtocolError("start.stdin must be a boolean")
    keepalive = msg.get("keepalive", DEFAULT_KEEPALIVE_S)
    if (
        not isinstance(keepalive, int | float)
        or isinstance(keepalive, bool)
        or not math.isfinite(keepalive)
    ):
        raise ProtocolError("start.keepalive must be a number of seconds")
    keepalive = min(MAX_KEEPALIVE_S, max(MIN_KEEPALIVE_S, float(keepalive)))
    return StartSpec(cmd, list(args), dict(envs), cwd, user, pty, stdin, keepalive)


def exit_message(end: Message) -> dict[str, Any]:
    """The `exit` message for envd's EndEvent: shell-style code (128+N for signal N)."""
    status = str(end.get("status", ""))
    if end.get("exited", False):
        return {"type": "exit", "code": int(end.get("exit_code", 0)), "status": status}
    name = status.removeprefix("signal: ")
    number = _SIGNAL_NUMBERS.get(name)
    if number is None and name.startswith("signal "):
        tail = name.removeprefix("signal ")
        number = int(tail) if tail.isdigit() else None
    out: dict[str, Any] = {"type": "exit", "code": 128 + number if number else 255}
    out["status"] = status
    if number:
        out["signal"] = number
    return out


class ExecSession:
    """One WebSocket session: the output pump, the input pump and keepalives."""

    def __init__(self, ws: Any, envd: EnvdClient, spec: StartSpec) -> None:
        self.ws = ws
        self.envd = envd
        self.spec = spec
        self.pid: int | None = None
        self.ended = False
        self._send_lock = trio.Lock()
        self._last_sent = trio.current_time()

    async def send_json(self, msg: dict[str, Any]) -> None:
        await self.send(json.dumps(msg, separators=(",", ":")))

    async def send(self, data: str | bytes) -> None:
        async with self._send_lock:
            await self.ws.send(data)
            self._last_sent = trio.current_time()

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keepalive)
                await self._output(nursery)
                nursery.cancel_scope.cancel()
        finally:
            if self.pid is not None and not self.ended:
                with trio.move_on_after(CLEANUP_TIMEOUT_S) as cleanup:
                    cleanup.shield = True
                    try:
                        await self.envd.unary(
                            "process.Process/SendSignal",
                            es.SEND_SIGNAL_REQUEST,
                            {"process": {"pid": self.pid}, "signal": int(es.Signal.SIGKILL)},
                        )
                    except (cn.ConnectError, httpx.HTTPError) as e:
                        log.info("killing pid %s after the client left: %s", self.pid, e)

    async def _keepalive(self) -> None:
        while True:
            await trio.sleep_until(self._last_sent + self.spec.keepalive_s)
            if trio.current_time() >= self._last_sent + self.spec.keepalive_s:
                await self.send_json({"type": "keepalive"})

    async def _output(self, nursery: trio.Nursery) -> None:
        try:
            stream = await self.envd.start_process(self.spec.start_request())
        except httpx.HTTPError as e:
            await self.send_json({"type": "error", "message": f"envd unreachable: {e}"})
            return
        except cn.ConnectError as e:
            await self.send_json({"type": "error", "message": e.message, "code": e.code.value})
            return
        async with stream:
            try:
                async for event in stream:
                    await self._event(event, nursery)
                    if self.ended:
                        return
            except cn.ConnectError as e:  # what envd ended the stream with
                if not self.ended:
                    await self.send_json(
                        {"type": "error", "message": e.message, "code": e.code.value}
                    )
                return
            except (httpx.HTTPError, DecodeError) as e:
                if not self.ended:
                    await self.send_json({"type": "error", "message": f"envd stream broke: {e}"})
                return
            if not self.ended and not stream.complete:
                await self.send_json(
                    {"type": "error", "message": "envd closed the stream without an exit status"}
                )

    async def _event(self, event: Message, nursery: trio.Nursery) -> None:
        if "start" in event:
            self.pid = int(event["start"].get("pid", 0))
            await self.send_json({"type": "started", "pid": self.pid})
            nursery.start_soon(self._input)
        elif "data" in event:
            for name, channel in _OUT_CHANNELS.items():
                data = event["data"].get(name)
                if data:
                    await self.send(bytes((channel,)) + data)
        elif "end" in event:
            self.ended = True
            await self.send_json(exit_message(event["end"]))

    async def _input(self) -> None:
        """Client frames, in order, as envd unary calls; failures are reported, not fatal."""
        assert self.pid is not None
        selector = {"pid": self.pid}
        while True:
            raw = await self.ws.receive()
            try:
                await self._handle_input(raw, selector)
            except ProtocolError as e:
                await self.send_json({"type": "error", "message": str(e), "fatal": False})
            except cn.ConnectError as e:
                await self.send_json(
                    {"type": "error", "message": e.message, "code": e.code.value, "fatal": False}
                )
            except httpx.HTTPError as e:
                await self.send_json(
                    {"type": "error", "message": f"envd unreachable: {e}", "fatal": False}
                )

    async def _handle_input(self, raw: str | bytes | None, selector: Message) -> None:
        if isinstance(raw, bytes):
            if not raw or raw[0] != CH_STDIN:
                raise ProtocolError("binary frames from the client must start with channel 0")
            if len(raw) > MAX_INPUT_FRAME + 1:
                raise ProtocolError(f"input frames are limited to {MAX_INPUT_FRAME} bytes")
            key = "pty" if self.spec.pty is not None else "stdin"
            await self.envd.unary(
                "process.Process/SendInput",
                es.SEND_INPUT_REQUEST,
                {"process": selector, "input": {key: raw[1:]}},
            )
            return
        if not raw:
            return
        try:
            msg = jsonbody.loads(raw)
        except ValueError as e:
            raise ProtocolError(f"invalid JSON: {e}") from None
        kind = msg.get("type") if isinstance(msg, dict) else None
        if kind == "resize":
            if self.spec.pty is None:
                raise ProtocolError("resize needs a session started with pty")
            cols, rows = _size(msg, "resize")
            await self.envd.unary(
                "process.Process/Update",
                es.UPDATE_REQUEST,
                {"process": selector, "pty": {"size": {"cols": cols, "rows": rows}}},
            )
        elif kind == "signal":
            sig = _SIGNALS.get(str(msg.get("signal", "")).upper().removeprefix("SIG"))
            if sig is None:
                raise ProtocolError("signal must be TERM or KILL")
            await self.envd.unary(
                "process.Process/SendSignal",
                es.SEND_SIGNAL_REQUEST,
                {"process": selector, "signal": int(sig)},
            )
        elif kind == "close-stdin":
            await self.envd.unary(
                "process.Process/CloseStdin", es.CLOSE_STDIN_REQUEST, {"process": selector}
            )
        elif kind == "keepalive":
            return
        else:
            raise ProtocolError(f"unknown message type {kind!r}")


bp = Blueprint("exec", __name__)


@bp.websocket("/sandboxes/<sandbox_id>/exec")
async def exec_ws(sandbox_id: str) -> Response | None:
    d = deps()
    refusal = api_key_refusal(
        websocket.headers.get("X-API-Key", ""),
        websocket.headers.get("Authorization", ""),
        d.api_key,
    )
    if refusal is not None:
        return error_response(401, refusal)
    try:
        endpoint = await d.service.endpoint(sandbox_id, ENVD_PORT)
    except sv.NotFound:
        return error_response(404, f"sandbox {sandbox_id!r} not found")
    except sv.NotRunning as e:
        if e.state not in ("running", "paused"):  # on its way in or out: not there
            return error_response(404, f"sandbox {sandbox_id!r} not found")
        return error_response(409, e.message)
    await websocket.accept()
    d.node.m_proxied.inc(kind="exec")
    first: str | bytes | None = None
    with trio.move_on_after(START_TIMEOUT_S):
        first = await websocket.receive()
    try:
        if first is None:
            raise ProtocolError(f"no start message within {START_TIMEOUT_S:g} s")
        spec = parse_start(first)
    except ProtocolError as e:
        await websocket.send(json.dumps({"type": "error", "message": str(e)}))
        await websocket.close(1008)
        return None
    envd = EnvdClient(
        endpoint.http, f"http://{endpoint.address}", endpoint.envd_access_token, user=spec.user
    )
    session = ExecSession(websocket, envd, spec)
    await session.run()
    await websocket.close(1000)
    return None
