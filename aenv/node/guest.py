"""A template's start command, started in a sandbox the node boots for it.

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


class StartFailed(Exception):
    pass


async def _run(
    actor: SandboxActor,
    cmd: str,
    template: Template,
    output: collections.deque[str],
    on_start: Callable[[], None] = lambda: None,
) -> int:
    """Run `/bin/sh -c cmd` as the template's user, in its directory; its exit code
    (-1 if killed). Output lines go to `output`; `on_start` is called once the
    process started."""
    if actor.http is None or actor.sandbox_ip is None:
        raise StartFailed(f"sandbox {actor.sandbox_id} is not running")
    envd = EnvdClient(
        actor.http,
        f"http://{actor.sandbox_ip}:{ENVD_PORT}",
        actor.envd_access_token,
        user=template.default_user,
        close_connections=True,  # a memory capture must not hold a connection
    )
    config: dict[str, Any] = {
        "cmd": "/bin/sh",
        "args": ["-c", cmd],
        "envs": template.env_map,
        "cwd": template.default_workdir,
    }
    started = False
    async with await envd.start_process({"process": config, "stdin": False}) as stream:
        async for event in stream:
            if "start" in event and not started:
                started = True
                on_start()
            elif "data" in event:
                for name in ("stdout", "stderr", "pty"):
                    data = event["data"].get(name)
                    if data:
                        output.extend(data.decode("utf-8", "replace").splitlines())
            elif "end" in event:
                end = event["end"]
                return int(end.get("exit_code", 0)) if end.get("exited", False) else -1
    raise StartFailed("envd ended the stream without an exit status")


async def start_and_wait(actor: SandboxActor, template: Template, *, timeout_s: float) -> None:
    """Start `template.start_cmd` in `actor`, detached, and return once
    `template.ready_cmd` passes."""
    assert template.start_cmd is not None
    output: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    ended: list[str] = []

    async def start(task_status: trio.TaskStatus[None]) -> None:
        # never raises: a failure is recorded in `ended` for the waiting loop
        reported = False

        def on_start() -> None:
            nonlocal reported
            reported = True
            task_status.started()

        try:
            code = await _run(actor, template.start_cmd or "", template, output, on_start)
            ended.append(f"exit code {code}")
        except (cn.ConnectError, httpx.HTTPError, DecodeError, StartFailed) as exc:
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
                probe: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
                try:
                    if await _run(actor, template.ready_cmd, template, probe) == 0:
                        break
                except cn.ConnectError as exc:
                    raise failed(f"the ready command could not run: {exc.message}") from None
                await trio.sleep(READY_POLL_S)
        if waiting.cancelled_caught:
            raise failed(f"the ready command did not pass within {timeout_s:g} s")
        # detach: the process runs on without a client (envd drops its output)
        nursery.cancel_scope.cancel()
