"""The host's envd client (`aenv.node.envd_client`) against a real envd.

Rules: envd runs as a subprocess on 127.0.0.1 (session fixture, default user
`aenvtest`; a test that sets an access token starts its own envd). Every
stream is closed by the client; a process the test leaves running is killed.
"""

from __future__ import annotations

import pwd
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from envd_helpers import TEST_USER, Envd, start_envd, stop_envd

from aenv.node.envd_client import EnvdClient
from aenv.proto import connect as cn
from aenv.proto import envd_schema as es
from aenv.proto.pb import Message


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=20) as client:
        yield client


def _sh(cmd: str, *, stdin: bool = False) -> Message:
    return {"process": {"cmd": "/bin/sh", "args": ["-c", cmd], "envs": {}}, "stdin": stdin}


async def _run(envd: EnvdClient, req: Message) -> tuple[list[str], bytes, Message]:
    """Event kinds in order, all stdout, and the end event."""
    kinds: list[str] = []
    out = b""
    end: Message = {}
    async with await envd.start_process(req) as stream:
        async for event in stream:
            ((kind, value),) = event.items()
            kinds.append(kind)
            if kind == "data":
                out += value.get("stdout", b"")
            elif kind == "end":
                end = value
        assert stream.complete
    return kinds, out, end


async def test_a_process_streams_its_output_and_exit(envd: Envd, http: httpx.AsyncClient) -> None:
    client = EnvdClient(http, envd.url, "", close_connections=True)
    kinds, out, end = await _run(client, _sh("id -un; echo two; exit 3"))
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert out == f"{TEST_USER}\ntwo\n".encode()
    assert end["exited"] and end["exit_code"] == 3


async def test_runs_as_the_user_asked_for(envd: Envd, http: httpx.AsyncClient) -> None:
    client = EnvdClient(http, envd.url, "", user="root")
    _, out, end = await _run(client, _sh("id -un"))
    assert out == b"root\n" and end["exit_code"] == 0


async def test_unary_calls_reach_the_running_process(envd: Envd, http: httpx.AsyncClient) -> None:
    client = EnvdClient(http, envd.url, "")
    out = b""
    async with await client.start_process(_sh("cat", stdin=True)) as stream:
        async for event in stream:
            if "start" in event:
                process = {"pid": event["start"]["pid"]}
                await client.unary(
                    "process.Process/SendInput",
                    es.SEND_INPUT_REQUEST,
                    {"process": process, "input": {"stdin": b"hello\n"}},
                )
                await client.unary(
                    "process.Process/CloseStdin", es.CLOSE_STDIN_REQUEST, {"process": process}
                )
            elif "data" in event:
                out += event["data"].get("stdout", b"")
            elif "end" in event:
                assert event["end"]["exit_code"] == 0
                break
    assert out == b"hello\n"


async def test_refusals_are_connect_errors(envd: Envd, http: httpx.AsyncClient) -> None:
    client = EnvdClient(http, envd.url, "")
    with pytest.raises(cn.ConnectError) as info:
        await client.unary(
            "process.Process/SendSignal",
            es.SEND_SIGNAL_REQUEST,
            {"process": {"pid": 999_999}, "signal": int(es.Signal.SIGKILL)},
        )
    assert info.value.code is cn.Code.NOT_FOUND
    nobody = EnvdClient(http, envd.url, "", user="no-such-user-here")
    with pytest.raises(cn.ConnectError):
        await _run(nobody, _sh("true"))


@pytest.fixture
def private_envd(test_user: pwd.struct_passwd) -> Iterator[Envd]:
    server = start_envd()
    try:
        yield server
    finally:
        stop_envd(server)


async def test_the_access_token_is_sent(private_envd: Envd, http: httpx.AsyncClient) -> None:
    r = await http.post(
        private_envd.url + "/init", json={"accessToken": "s3cret", "defaultUser": TEST_USER}
    )
    assert r.status_code == 204
    with pytest.raises(cn.ConnectError) as info:
        await EnvdClient(http, private_envd.url, "wrong").start_process(_sh("true"))
    assert "unauthorized" in info.value.message
    _, out, _ = await _run(EnvdClient(http, private_envd.url, "s3cret"), _sh("echo ok"))
    assert out == b"ok\n"
