"""The CLI's exec client against a WebSocket server that speaks docs/exec-protocol.md.

Rules: loopback only; the server here is a protocol peer written from the
document (the real node is exercised in tests/e2e/test_cli.py); local stdio
is replaced by pipes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import pytest
import trio
import trio_websocket

from aenv.client.config import Credentials
from aenv.client.errors import AuthFailed, NotFound, Unreachable
from aenv.client.session import CommandNotStarted, ExecRequest, Terminal, run_session

Handler = Callable[[trio_websocket.WebSocketConnection, dict[str, Any]], Awaitable[None]]


async def serve(nursery: trio.Nursery, handler: Handler, *, reject: int | None = None) -> int:
    async def on_request(request: trio_websocket.WebSocketRequest) -> None:
        if reject is not None:
            body = json.dumps({"code": reject, "message": f"rejected {reject}"}).encode()
            await request.reject(reject, body=body)
            return
        ws = await request.accept()
        start = json.loads(await ws.get_message())
        assert start["type"] == "start"
        await handler(ws, start)

    listeners = await nursery.start(
        partial(trio_websocket.serve_websocket, on_request, "127.0.0.1", 0, ssl_context=None)
    )
    return int(listeners.port)


def pipes() -> tuple[Terminal, int, int, int]:
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    term = Terminal(stdin_fd=in_r, stdout_fd=out_w, stderr_fd=err_w)
    return term, in_w, out_r, err_r


def read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    out = b""
    try:
        while chunk := os.read(fd, 65536):
            out += chunk
    except BlockingIOError:
        pass
    return out


def creds(port: int) -> Credentials:
    return Credentials(f"http://127.0.0.1:{port}", "key")


async def test_stdin_output_and_exit_code() -> None:
    seen: list[dict[str, Any]] = []

    async def handler(ws: trio_websocket.WebSocketConnection, start: dict[str, Any]) -> None:
        seen.append(start)
        await ws.send_message(json.dumps({"type": "started", "pid": 7}))
        await ws.send_message(json.dumps({"type": "keepalive"}))
        got = b""
        while True:
            msg = await ws.get_message()
            if isinstance(msg, bytes):
                assert msg[0] == 0
                got += msg[1:]
                await ws.send_message(b"\x01" + msg[1:].upper())
            elif json.loads(msg)["type"] == "close-stdin":
                break
        await ws.send_message(b"\x02" + f"{len(got)} bytes".encode())
        await ws.send_message(json.dumps({"type": "exit", "code": 3, "status": "exit status 3"}))

    term, in_w, out_r, err_r = pipes()
    os.write(in_w, b"hello ")
    os.write(in_w, b"world")
    os.close(in_w)
    async with trio.open_nursery() as nursery:
        port = await serve(nursery, handler)
        req = ExecRequest("cat", ["-"], envs={"A": "b"}, cwd="/tmp")
        result = await run_session(creds(port), "s" * 20, req, term)
        nursery.cancel_scope.cancel()
    assert result.exit_code == 3
    assert read_all(out_r) == b"HELLO WORLD"
    assert read_all(err_r) == b"11 bytes"
    assert seen[0]["cmd"] == "cat" and seen[0]["args"] == ["-"] and seen[0]["cwd"] == "/tmp"
    assert "pty" not in seen[0]


async def test_silent_node_is_a_lost_connection() -> None:
    async def handler(ws: trio_websocket.WebSocketConnection, start: dict[str, Any]) -> None:
        assert start["keepalive"] == 0.2
        await ws.send_message(json.dumps({"type": "started", "pid": 1}))
        await trio.sleep_forever()

    term, in_w, _, _ = pipes()
    async with trio.open_nursery() as nursery:
        port = await serve(nursery, handler)
        t0 = trio.current_time()
        with pytest.raises(Unreachable, match="no word from the node"):
            await run_session(creds(port), "s" * 20, ExecRequest("x"), term, keepalive=0.2)
        assert 0.5 <= trio.current_time() - t0 < 3
        nursery.cancel_scope.cancel()
    os.close(in_w)


async def test_close_before_exit_is_a_lost_connection() -> None:
    async def handler(ws: trio_websocket.WebSocketConnection, start: dict[str, Any]) -> None:
        await ws.send_message(json.dumps({"type": "started", "pid": 1}))
        await ws.aclose(1011)

    term, in_w, _, _ = pipes()
    async with trio.open_nursery() as nursery:
        port = await serve(nursery, handler)
        with pytest.raises(Unreachable, match="before the command finished"):
            await run_session(creds(port), "s" * 20, ExecRequest("x"), term)
        nursery.cancel_scope.cancel()
    os.close(in_w)


async def test_start_failure_is_127() -> None:
    async def handler(ws: trio_websocket.WebSocketConnection, start: dict[str, Any]) -> None:
        await ws.send_message(
            json.dumps({"type": "error", "code": "invalid_argument", "message": "no such file"})
        )

    term, in_w, _, _ = pipes()
    async with trio.open_nursery() as nursery:
        port = await serve(nursery, handler)
        with pytest.raises(CommandNotStarted, match="no such file") as ei:
            await run_session(creds(port), "s" * 20, ExecRequest("/nope"), term)
        assert ei.value.exit_code == 127
        nursery.cancel_scope.cancel()
    os.close(in_w)


@pytest.mark.parametrize(("status", "error"), [(401, AuthFailed), (404, NotFound)])
async def test_rejections_map_to_cli_errors(status: int, error: type[Exception]) -> None:
    async def never(ws: trio_websocket.WebSocketConnection, start: dict[str, Any]) -> None:
        raise AssertionError("not reached")

    term, in_w, _, _ = pipes()
    async with trio.open_nursery() as nursery:
        port = await serve(nursery, never, reject=status)
        with pytest.raises(error, match=f"rejected {status}"):
            await run_session(creds(port), "s" * 20, ExecRequest("x"), term)
        nursery.cancel_scope.cancel()
    os.close(in_w)
