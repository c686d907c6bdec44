"""Commands the node runs in a sandbox through its envd: build steps, start commands.

`run_in_sandbox` runs `/bin/sh -c` as a user and streams its output by
lines (`Lines`); template builds (`aenv.node.builds`) run their steps with it.

A default template that runs a server (`code-interpreter-v1`: its start and
ready commands come from `aenv.storage.rootfs.START_COMMANDS`) is captured
only once that server answers, so every sandbox restored from the capture
has it running (`aenv.node.warm`). `start_and_wait` starts the start command
through the sandbox's envd, detached (the process runs on after the call),
and polls the ready command until it exits 0; a start command that ends, or
a ready command that does not pass within the timeout, raises `StartFailed`
with the tail of the output.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import httpx
import trio

from aenv.node.envd_client import EnvdClient
from aenv.node.sandbox import SandboxActor
from aenv.proto import connect as cn
from aenv.proto.pb import DecodeError
from aenv.runtimes.base import ENVD_PORT
from aenv.storage.templates import Template

READY_POLL_S = 0.25
TAIL_LINES = 20
MAX_LINE = 8192  # a longer partial line is passed on as it is


class StartFailed(Exception):
    """A template's start command ended, or its ready command did not pass."""


class Lines:
    """Splits a process's output into log lines (per stream, keeping partial lines)."""

    def __init__(self, emit: Callable[[str, str], None]) -> None:
        self.emit = emit
        self.partial: dict[str, bytes] = {}

    def feed(self, stream: str, data: bytes) -> None:
        buf = self.partial.get(stream, b"") + data
        *lines, rest = buf.split(b"\n")
        for line in lines:
            self.emit(stream, line.decode("utf-8", "replace").rstrip("\r"))
        if len(rest) > MAX_LINE:
            self.emit(stream, rest.decode("utf-8", "replace"))
            rest = b""
        self.partial[stream] = rest

    def flush(self) -> None:
        for stream, rest in self.partial.items():
            if rest:
                self.emit(stream, rest.decode("utf-8", "replace"))
        self.partial.clear()


async def run_in_sandbox(
    actor: SandboxActor,
    cmd: str,
    *,
    user: str,
    envs: dict[str, str],
    cwd: str | None,
    on_output: Callable[[str, str], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> tuple[int, str]:
    """Run `/bin/sh -c cmd` through the sandbox's envd; (exit code, envd's status).

    A process killed by a signal has exit code -1. Raises cn.ConnectError if
    envd refuses to start it, and httpx errors if envd goes away.
    """
    client = actor.http
    if client is None or actor.sandbox_ip is None:
        raise RuntimeError(f"sandbox {actor.sandbox_id} is not running")
    # no idle connection may stay behind: a memory capture would hold it
    envd = EnvdClient(
        client,
        f"http://{actor.sandbox_ip}:{ENVD_PORT}",
        actor.envd_access_token,
        user=user,
        close_connections=True,
    )
    config: dict[str, Any] = {"cmd": "/bin/sh", "args": ["-c", cmd], "envs": envs}
    if cwd is not None:
        config["cwd"] = cwd
    lines = Lines(on_output or (lambda _s, _l: None))
    async with await envd.start_process({"process": config, "stdin": False}) as stream:
        async for event in stream:
            if "start" in event and on_start is not None:
                on_start(int(event["start"].get("pid", 0)))
            elif "data" in event:
                for name in ("stdout", "stderr", "pty"):
                    data = event["data"].get(name)
                    if data:
                        lines.feed(name, data)
            elif "end" in event:
                lines.flush()
                end = event["end"]
                status = str(end.get("status", ""))
                code = int(end.get("exit_code", 0)) if end.get("exited", False) else -1
                return code, status
    how = "ended" if stream.complete else "closed"
    raise cn.ConnectError(cn.Code.UNKNOWN, f"envd {how} the stream without an exit status")


async def start_and_wait(actor: SandboxActor, template: Template, *, timeout_s: float) -> None:
    """Start `template.start_cmd` in `actor`, detached, and return once
    `template.ready_cmd` passes."""
    assert template.start_cmd is not None
    output: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    ended: list[str] = []
    as_template: dict[str, Any] = {
        "user": template.default_user,
        "envs": template.env_map,
        "cwd": template.default_workdir,
    }

    def keep(_stream: str, line: str) -> None:
        output.append(line)

    async def start(task_status: trio.TaskStatus[None]) -> None:
        # never raises: a failure is recorded in `ended` for the waiting loop
        reported = False

        def on_start(_pid: int) -> None:
            nonlocal reported
            reported = True
            task_status.started()

        try:
            code, status = await run_in_sandbox(
                actor, template.start_cmd or "", **as_template, on_output=keep, on_start=on_start
            )
            ended.append(f"exit code {code}" if code >= 0 else status)
        except (cn.ConnectError, httpx.HTTPError, DecodeError, RuntimeError) as exc:
            ended.append(f"an error: {exc}")
        if not reported:
            task_status.started()

    def failed(why: str) -> StartFailed:
        tail = "\n".join(output)
        return StartFailed(f"{why}" + (f"; its output ends:\n{tail}" if tail else ""))

    async with trio.open_nursery() as nursery:
        await nursery.start(start)
        with trio.move_on_after(timeout_s) as waiting:
            while True:
                if ended:
                    raise failed(f"the start command ended with {ended[0]}")
                if template.ready_cmd is None:
                    break
                try:
                    code, _ = await run_in_sandbox(actor, template.ready_cmd, **as_template)
                    if code == 0:
                        break
                except cn.ConnectError as exc:
                    raise failed(f"the ready command could not run: {exc.message}") from None
                await trio.sleep(READY_POLL_S)
        if waiting.cancelled_caught:
            raise failed(f"the ready command did not pass within {timeout_s:g} s")
        # detach: the process runs on without a client (envd drops its output)
        nursery.cancel_scope.cancel()
