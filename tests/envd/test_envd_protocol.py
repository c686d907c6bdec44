"""envd over the wire with httpx: Connect JSON/proto, HTTP/1.1 and h2c, HTTP routes.

Rules: envd runs as a subprocess on 127.0.0.1 (session fixture, default user
`aenvtest`); tests that change envd's global state (/init with a token) start
their own envd. The client always closes first.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import pwd
import socket
import struct
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from envd_helpers import TEST_USER, Envd, start_envd, stop_envd

from aenv.envd.files_http import signature
from aenv.proto import connect
from aenv.proto import envd_schema as schema
from aenv.proto.envd_schema import METHODS_BY_PATH
from aenv.proto.pb import Message

CODECS = ["json", "proto"]


def _basic(user: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


@pytest.fixture(params=["http1", "h2c"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[httpx.AsyncClient]:
    if request.param == "h2c":
        c = httpx.AsyncClient(http1=False, http2=True, timeout=20)
    else:
        c = httpx.AsyncClient(timeout=20)
    async with c:
        yield c


async def unary(
    client: httpx.AsyncClient,
    base: str,
    path: str,
    msg: Message,
    *,
    codec: str = "json",
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    method = METHODS_BY_PATH[path]
    body = method.request.encode_json(msg) if codec == "json" else method.request.encode(msg)
    r = await client.post(
        base + path,
        content=body,
        headers={"content-type": f"application/{codec}", **(headers or {})},
    )
    if r.status_code != 200:
        return r.status_code, r.json()
    assert r.headers["content-type"] == f"application/{codec}"
    data = (
        method.response.decode_json(r.content)
        if codec == "json"
        else method.response.decode(r.content)
    )
    return 200, data


async def stream(
    client: httpx.AsyncClient,
    base: str,
    path: str,
    msg: Message,
    *,
    codec: str = "json",
    headers: dict[str, str] | None = None,
    stop_after: int | None = None,
) -> tuple[list[Message], connect.ConnectError | None]:
    """Messages of a server stream and its end-of-stream error."""
    method = METHODS_BY_PATH[path]
    payload = method.request.encode_json(msg) if codec == "json" else method.request.encode(msg)
    decode = method.response.decode_json if codec == "json" else method.response.decode
    messages: list[Message] = []
    error: connect.ConnectError | None = None
    decoder = connect.EnvelopeDecoder()
    async with client.stream(
        "POST",
        base + path,
        content=connect.encode_envelope(payload),
        headers={"content-type": f"application/connect+{codec}", **(headers or {})},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == f"application/connect+{codec}"
        async for chunk in r.aiter_raw():
            for env in decoder.feed(chunk):
                if env.end_stream:
                    error, _ = connect.parse_end_stream(env.data)
                else:
                    messages.append(decode(env.data))
                    if stop_after is not None and len(messages) >= stop_after:
                        return messages, None
    decoder.close()
    return messages, error


def _events(messages: list[Message]) -> list[tuple[str, Any]]:
    out = []
    for m in messages:
        ((kind, value),) = m["event"].items()
        out.append((kind, value))
    return out


def _run(cmd: str, **extra: Any) -> Message:
    return {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd], **extra}}


@pytest.mark.parametrize("codec", CODECS)
async def test_start_stream(envd: Envd, client: httpx.AsyncClient, codec: str) -> None:
    messages, error = await stream(
        client,
        envd.url,
        "/process.Process/Start",
        _run("echo out; echo err >&2; exit 4"),
        codec=codec,
    )
    assert error is None
    events = _events(messages)
    assert events[0][0] == "start" and events[0][1]["pid"] > 0
    out = b"".join(v.get("stdout", b"") for k, v in events if k == "data")
    err = b"".join(v.get("stderr", b"") for k, v in events if k == "data")
    assert (out, err) == (b"out\n", b"err\n")
    assert events[-1] == (
        "end",
        {"exit_code": 4, "exited": True, "status": "exit status 4", "error": "exit status 4"},
    )


@pytest.mark.parametrize("codec", CODECS)
async def test_unary_and_errors(
    envd: Envd, client: httpx.AsyncClient, codec: str, home: Path
) -> None:
    status, body = await unary(
        client, envd.url, "/filesystem.Filesystem/Stat", {"path": str(home)}, codec=codec
    )
    assert status == 200
    entry = body["entry"]
    assert entry["type"] == schema.FileType.DIRECTORY and entry["owner"] == TEST_USER
    assert entry["permissions"].startswith("d")
    status, body = await unary(
        client, envd.url, "/filesystem.Filesystem/Stat", {"path": str(home / "x")}, codec=codec
    )
    assert status == 404 and body["code"] == "not_found"
    status, body = await unary(
        client,
        envd.url,
        "/process.Process/SendSignal",
        {"process": {"pid": 999999}, "signal": 9},
        codec=codec,
    )
    assert status == 404 and body["code"] == "not_found"
    status, body = await unary(
        client,
        envd.url,
        "/filesystem.Filesystem/Stat",
        {"path": "/"},
        codec=codec,
        headers=_basic("nobody-here"),
    )
    assert status == 401 and body["code"] == "unauthenticated"
    messages, error = await stream(
        client, envd.url, "/process.Process/Connect", {"process": {"pid": 999999}}, codec=codec
    )
    assert messages == [] and error is not None and error.code is connect.Code.NOT_FOUND


async def test_bad_requests(envd: Envd, client: httpx.AsyncClient) -> None:
    r = await client.post(
        envd.url + "/process.Process/List", content=b"{}", headers={"content-type": "text/plain"}
    )
    assert r.status_code == 415
    r = await client.post(
        envd.url + "/process.Process/List",
        content=b"{nope",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    r = await client.post(
        envd.url + "/process.Process/Start",
        content=b"\x00\x00\x00\x00\x09garbage!!",
        headers={"content-type": "application/connect+proto"},
    )
    assert r.status_code == 200
    env = connect.decode_envelopes([r.content])[-1]
    err, _ = connect.parse_end_stream(env.data)
    assert err is not None and err.code is connect.Code.INVALID_ARGUMENT
    r = await client.post(
        envd.url + "/process.Process/List",
        content=b"{}",
        headers={"content-type": "application/json", "connect-timeout-ms": "soon"},
    )
    assert r.status_code == 400


async def test_background_process_survives_disconnect_and_reattach(
    envd: Envd, client: httpx.AsyncClient, home: Path
) -> None:
    marker = home / "done"
    cmd = f"echo started; sleep 1; echo finished; touch {marker}"
    messages, _ = await stream(
        client,
        envd.url,
        "/process.Process/Start",
        {**_run(cmd), "tag": f"bg-{home.name}"},
        stop_after=2,
    )
    pid = messages[0]["event"]["start"]["pid"]
    _, listing = await unary(client, envd.url, "/process.Process/List", {})
    assert pid in [p["pid"] for p in listing["processes"]]
    info = next(p for p in listing["processes"] if p["pid"] == pid)
    assert info["tag"] == f"bg-{home.name}" and info["config"]["args"][-1] == cmd
    messages, _ = await stream(
        client, envd.url, "/process.Process/Connect", {"process": {"tag": f"bg-{home.name}"}}
    )
    events = _events(messages)
    assert events[0] == ("start", {"pid": pid})
    assert b"finished\n" in b"".join(v.get("stdout", b"") for k, v in events if k == "data")
    assert events[-1][0] == "end" and events[-1][1]["exit_code"] == 0
    assert marker.exists()
    # after the end, Connect still reports the exit
    messages, _ = await stream(
        client, envd.url, "/process.Process/Connect", {"process": {"pid": pid}}
    )
    assert _events(messages)[-1][0] == "end"


async def test_timeout_kills_process_and_keepalive(envd: Envd, client: httpx.AsyncClient) -> None:
    start = trio.current_time()
    messages, error = await stream(
        client,
        envd.url,
        "/process.Process/Start",
        _run("sleep 30"),
        headers={"connect-timeout-ms": "2500", "keepalive-ping-interval": "1"},
    )
    events = _events(messages)
    assert ("keepalive", {}) in events
    ends = [v for k, v in events if k == "end"]
    if ends:
        assert ends[0]["status"] == "signal: killed" and ends[0]["exit_code"] == -1
    else:
        assert error is not None and error.code is connect.Code.DEADLINE_EXCEEDED
    assert trio.current_time() - start < 10


async def test_stdin_client_stream_and_signals(envd: Envd, client: httpx.AsyncClient) -> None:
    base = envd.url
    async with trio.open_nursery() as nursery:
        result: list[Any] = []

        async def run() -> None:
            result.append(
                await stream(client, base, "/process.Process/Start", {**_run("cat"), "stdin": True})
            )

        nursery.start_soon(run)
        pid = 0
        for _ in range(100):
            status, listing = await unary(client, base, "/process.Process/List", {})
            pids = [p["pid"] for p in listing["processes"] if p["config"]["args"][-1] == "cat"]
            if pids:
                pid = pids[0]
                break
            await trio.sleep(0.05)
        assert pid
        req = schema.STREAM_INPUT_REQUEST
        body = b"".join(
            connect.encode_envelope(req.encode_json(m))
            for m in (
                {"start": {"process": {"pid": pid}}},
                {"data": {"input": {"stdin": b"via stream\n"}}},
                {"keepalive": {}},
            )
        )
        r = await client.post(
            base + "/process.Process/StreamInput",
            content=body,
            headers={"content-type": "application/connect+json"},
        )
        assert r.status_code == 200
        envs = connect.decode_envelopes([r.content])
        assert connect.parse_end_stream(envs[-1].data)[0] is None
        status, _ = await unary(
            client,
            base,
            "/process.Process/SendInput",
            {"process": {"pid": pid}, "input": {"stdin": b"via unary\n"}},
        )
        assert status == 200
        status, _ = await unary(
            client, base, "/process.Process/CloseStdin", {"process": {"pid": pid}}
        )
        assert status == 200
    messages, _ = result[0]
    out = b"".join(v.get("stdout", b"") for k, v in _events(messages) if k == "data")
    assert out == b"via stream\nvia unary\n"
    assert _events(messages)[-1][1]["exit_code"] == 0


async def test_process_runs_as_user_with_clean_env(envd: Envd, client: httpx.AsyncClient) -> None:
    messages, _ = await stream(
        client,
        envd.url,
        "/process.Process/Start",
        {"process": {"cmd": "/usr/bin/env", "envs": {"EXTRA": "1"}}},
    )
    out = b"".join(v.get("stdout", b"") for k, v in _events(messages) if k == "data").decode()
    env = dict(line.split("=", 1) for line in out.splitlines())
    user = pwd.getpwnam(TEST_USER)
    assert env["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert env["HOME"] == user.pw_dir and env["USER"] == TEST_USER and env["SHELL"] == user.pw_shell
    assert env["EXTRA"] == "1"
    assert not any(k.startswith(("AENV_", "PYTHON", "LD_")) for k in env)
    messages, _ = await stream(
        client, envd.url, "/process.Process/Start", {"process": {"cmd": "/usr/bin/id"}}
    )
    out = b"".join(v.get("stdout", b"") for k, v in _events(messages) if k == "data").decode()
    assert f"uid={user.pw_uid}(" in out
    messages, error = await stream(
        client, envd.url, "/process.Process/Start", {"process": {"cmd": "/nonexistent"}}
    )
    assert error is not None and error.code is connect.Code.INVALID_ARGUMENT


async def test_files_http(envd: Envd, client: httpx.AsyncClient, home: Path) -> None:
    base = envd.url
    files = [("file", (f"{home}/m/one.txt", b"1")), ("file", (f"{home}/m/two.txt", b"22"))]
    r = await client.post(base + "/files", files=files)
    assert r.status_code == 200
    assert sorted(e["path"] for e in r.json()) == [f"{home}/m/one.txt", f"{home}/m/two.txt"]
    assert (home / "m" / "two.txt").read_bytes() == b"22"
    # a file this small is not worth compressing: sent as is, with its length
    r = await client.get(
        base + "/files", params={"path": f"{home}/m/two.txt"}, headers={"accept-encoding": "gzip"}
    )
    assert r.status_code == 200 and r.content == b"22"
    assert "content-encoding" not in r.headers and r.headers["content-length"] == "2"
    payload = os.urandom(300_000)
    r = await client.post(
        base + "/files",
        params={"path": f"{home}/g.bin"},
        content=gzip.compress(payload),
        headers={
            "content-type": "application/octet-stream",
            "content-encoding": "gzip",
            "x-metadata-Owner": "me",
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()[0]["type"] == "file"
    assert (home / "g.bin").read_bytes() == payload
    r = await client.get(
        base + "/files", params={"path": f"{home}/g.bin"}, headers={"accept-encoding": "gzip"}
    )
    assert r.status_code == 200 and r.headers["content-encoding"] == "gzip" and r.content == payload
    r = await client.get(base + "/files", params={"path": str(home)})
    assert r.status_code == 400
    r = await client.get(base + "/files", params={"path": f"{home}/none"})
    assert r.status_code == 404 and r.json()["code"] == 404
    r = await client.get(
        base + "/files", params={"path": "/etc/hostname", "username": "no-such-user"}
    )
    assert r.status_code == 401
    r = await client.post(base + "/files", content=b"x", headers={"content-type": "text/plain"})
    assert r.status_code == 400
    assert (await client.get(base + "/envs")).json()["E2B_SANDBOX"] == "true"
    metrics = (await client.get(base + "/metrics")).json()
    assert metrics["mem_total"] > 0 and metrics["cpu_count"] >= 1


@pytest.fixture
def private_envd(test_user: pwd.struct_passwd) -> Iterator[Envd]:
    server = start_envd()
    try:
        yield server
    finally:
        stop_envd(server)


async def test_access_token(private_envd: Envd) -> None:
    base = private_envd.url
    async with httpx.AsyncClient(timeout=20) as client:
        r = await client.post(
            base + "/init",
            json={"accessToken": "s3cret", "envVars": {"A": "1"}, "defaultUser": TEST_USER},
        )
        assert r.status_code == 204
        assert (await client.get(base + "/health")).status_code == 204
        r = await client.post(
            base + "/process.Process/List",
            content=b"{}",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 401
        ok = {"x-access-token": "s3cret"}
        status, _ = await unary(client, base, "/process.Process/List", {}, headers=ok)
        assert status == 200
        assert (
            await client.get(base + "/envs", headers={"x-access-token": "nope"})
        ).status_code == 401
        assert (await client.get(base + "/envs", headers=ok)).json()["A"] == "1"
        # /files: header or signed URL
        assert (
            await client.get(base + "/files", params={"path": "/etc/hostname"})
        ).status_code == 401
        sig = signature("/etc/hostname", "read", "", "s3cret", None)
        r = await client.get(base + "/files", params={"path": "/etc/hostname", "signature": sig})
        assert r.status_code == 200
        expired = int(time.time()) - 5
        sig = signature("/etc/hostname", "read", "", "s3cret", expired)
        r = await client.get(
            base + "/files",
            params={"path": "/etc/hostname", "signature": sig, "signature_expiration": expired},
        )
        assert r.status_code == 401
        # a different token may only be set by someone holding the current one
        r = await client.post(base + "/init", json={"accessToken": "other"})
        assert r.status_code == 401
        r = await client.post(base + "/init", json={"accessToken": "other"}, headers=ok)
        assert r.status_code == 204
        status, _ = await unary(
            client, base, "/process.Process/List", {}, headers={"x-access-token": "other"}
        )
        assert status == 200


def test_h2c_upgrade(envd: Envd) -> None:
    with socket.create_connection(("127.0.0.1", envd.port), timeout=5) as sock:
        sock.sendall(
            b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
        )
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 101")


def test_envelope_helper_is_big_endian() -> None:
    assert connect.encode_envelope(b"ab") == struct.pack(">BI", 0, 2) + b"ab"
    assert json.loads(connect.end_stream_body()) == {}


async def test_exit_not_held_up_by_background_grandchild(
    envd: Envd, client: httpx.AsyncClient
) -> None:
    start = trio.current_time()
    messages, error = await stream(
        client, envd.url, "/process.Process/Start", _run("(sleep 2 &); echo parent-done")
    )
    assert error is None
    events = _events(messages)
    assert b"parent-done\n" in b"".join(v.get("stdout", b"") for k, v in events if k == "data")
    assert events[-1][0] == "end" and events[-1][1]["exit_code"] == 0
    assert trio.current_time() - start < 1.5
