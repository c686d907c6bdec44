"""The exec WebSocket's server side: `start` validation and exit codes."""

from __future__ import annotations

import json

import pytest

from aenv.api.exec_ws import ProtocolError, exit_message, parse_start
from aenv.proto.envd_schema import START_REQUEST


def start(**kw: object) -> str:
    return json.dumps({"type": "start", "cmd": "sh", **kw})


def test_minimal_start_defaults() -> None:
    spec = parse_start(start())
    assert (spec.args, spec.envs, spec.cwd, spec.user, spec.pty, spec.stdin) == (
        [],
        {},
        None,
        None,  # the sandbox's default user (its template's)
        None,
        True,
    )
    req = spec.start_request()
    assert START_REQUEST.decode(START_REQUEST.encode(req)) == {
        "process": {"cmd": "sh", "args": [], "envs": {}},
        "stdin": True,
    }


def test_full_start_becomes_envd_request() -> None:
    spec = parse_start(
        start(
            args=["-c", "x"],
            envs={"A": "b"},
            cwd="/tmp",
            user="root",
            pty={"cols": 100, "rows": 30},
            stdin=False,
            keepalive=0.01,
        )
    )
    assert spec.keepalive_s == 1.0  # clamped
    req = START_REQUEST.decode(START_REQUEST.encode(spec.start_request()))
    assert req["process"] == {"cmd": "sh", "args": ["-c", "x"], "envs": {"A": "b"}, "cwd": "/tmp"}
    assert req["pty"] == {"size": {"cols": 100, "rows": 30}}
    assert req["stdin"] is False


@pytest.mark.parametrize(
    "raw",
    [
        b"binary",
        "not json",
        json.dumps({"type": "resize"}),
        json.dumps({"type": "start"}),
        start(cmd=""),
        start(args="-c x"),
        start(envs={"A": 1}),
        start(cwd=3),
        start(user="a:b"),
        start(pty={"cols": 0, "rows": 10}),
        start(pty={"cols": True, "rows": 10}),
        start(stdin="yes"),
        start(keepalive="soon"),
        json.dumps([1, 2]),
    ],
)
def test_bad_starts_are_protocol_errors(raw: str | bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_start(raw)


def test_exit_codes() -> None:
    assert exit_message({"exit_code": 3, "exited": True, "status": "exit status 3"})["code"] == 3
    killed = exit_message({"exit_code": -1, "exited": False, "status": "signal: killed"})
    assert (killed["code"], killed["signal"]) == (137, 9)
    assert exit_message({"exited": False, "status": "signal: interrupt"})["code"] == 130
    assert exit_message({"exited": False, "status": "signal: signal 40"})["code"] == 168
    assert exit_message({"exited": False, "status": "weird"})["code"] == 255
