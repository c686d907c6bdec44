"""SandboxActor: one task that owns one sandbox from create to teardown.

The actor acquires, in order, a network slot, a writable root (overlay over
the template), and the runtime sandbox, each as an async context manager on
an exit stack, so leaving `run()` - by kill, TTL expiry, crash or node
shutdown - releases them in reverse order. It then waits for envd, calls
`/init`, reports ready, and serves its mailbox until the lifecycle machine
(`aenv.proto.lifecycle`) says stop. A failure after start is caught here and
recorded: one sandbox's crash never reaches the node.
"""

from __future__ import annotations

import collections
import logging
import secrets
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import trio

from aenv.kit.mailbox import Mailbox, Request
from aenv.proto import lifecycle as lc
from aenv.proto.netpolicy import EgressPolicy
from aenv.proto.requests import NewSandbox
from aenv.runtimes.base import ENVD_PORT, RunningSandbox, SandboxSpec, Usage
from aenv.runtimes.netns import NetSlot
from aenv.storage.bundle import envd_command
from aenv.storage.overlay import open_writable_root
from aenv.storage.templates import Template

if TYPE_CHECKING:
    from aenv.node.node import Node

log = logging.getLogger("aenv.sandbox")

ENVD_READY_TIMEOUT_S = 60.0
LOG_LINES = 1000


class SandboxNotRunning(Exception):
    def __init__(self, sandbox_id: str, state: lc.State) -> None:
        super().__init__(f"sandbox {sandbox_id} is {state.value}")
        self.state = state


class EnvdUnavailable(Exception):
    pass


# -- mailbox messages ---------------------------------------------------------


@dataclass(frozen=True)
class SetTimeout:
    timeout_s: int


@dataclass(frozen=True)
class ExtendTimeout:
    """Refresh: never shortens the TTL."""

    timeout_s: int


@dataclass(frozen=True)
class Kill:
    pass


@dataclass(frozen=True)
class SetNetwork:
    policy: EgressPolicy
    allow_internet_access: bool | None


@dataclass(frozen=True)
class GetUsage:
    pass


Msg = SetTimeout | ExtendTimeout | Kill | SetNetwork | GetUsage


@dataclass(frozen=True)
class LogEntry:
    timestamp: float
    level: str
    message: str
    fields: dict[str, str] = field(default_factory=dict)


class SandboxActor:
    def __init__(self, node: Node, sandbox_id: str, template: Template, req: NewSandbox) -> None:
        self.node = node
        self.sandbox_id = sandbox_id
        self.template = template
        self.metadata = dict(req.metadata)
        self.env_vars = dict(req.env_vars)
        self.policy = req.policy
        self.allow_internet_access = req.allow_internet_access
        self.allow_public_traffic = req.allow_public_traffic
        self.auto_pause = req.auto_pause
        self.cpu_count = req.cpu_count or template.cpu_count
        self.memory_mb = req.memory_mb or template.memory_mb
        self.envd_access_token = secrets.token_urlsafe(24)
        self.traffic_access_token = secrets.token_urlsafe(24)
        self.started_at = time.time()
        self.lifecycle = lc.Lifecycle()
        self.mailbox: Mailbox[Msg] = Mailbox(f"sandbox {sandbox_id}", capacity=32)
        self.sandbox_ip: str | None = None
        self.stopped = trio.Event()
        self.was_started = False
        self._timeout_s = req.timeout_s
        self._running: RunningSandbox | None = None
        self._slot: NetSlot | None = None
        self._serve_scope: trio.CancelScope | None = None
        self._killers: list[Request[Msg]] = []
        self._logs: collections.deque[LogEntry] = collections.deque(maxlen=LOG_LINES)
        self.workdir: Path = node.config.sandboxes_dir / sandbox_id

    # -- read-only views (sync, never block) ---------------------------------

    @property
    def state(self) -> lc.State:
        return self.lifecycle.state

    def end_at(self) -> float:
        """Wall-clock expiry time."""
        if self.lifecycle.deadline is None:
            return time.time()
        return time.time() + max(0.0, self.lifecycle.deadline - trio.current_time())

    def logs(self) -> list[LogEntry]:
        return list(self._logs)

    def console_tail(self, limit: int = LOG_LINES) -> list[str]:
        path = self.workdir / "console.log"
        try:
            with path.open("rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - 256 * 1024))
                data = f.read()
        except OSError:
            return []
        return data.decode("utf-8", "replace").splitlines()[-limit:]

    def _log(self, message: str, level: str = "info", **fields: str) -> None:
        self._logs.append(LogEntry(time.time(), level, message, dict(fields)))
        log.info("%s: %s", self.sandbox_id, message, extra={"sandbox_id": self.sandbox_id})

    # -- the actor -----------------------------------------------------------

    async def run(
        self, *, task_status: trio.TaskStatus[SandboxActor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        node = self.node
        started = self.was_started = False
        try:
            async with AsyncExitStack() as stack:
                self._log("creating", template=self.template.template_id)
                slot = await stack.enter_async_context(node.network.open_slot(self.policy))
                self._slot = slot
                self.sandbox_ip = slot.sandbox_ip
                root = await stack.enter_async_context(
                    open_writable_root([self.template.rootfs], self.workdir / "disk")
                )
                argv, env = envd_command(ENVD_PORT)
                spec = SandboxSpec(
                    sandbox_id=self.sandbox_id,
                    rootfs=root,
                    bundle=node.config.bundle_dir,
                    netns_path=slot.netns_path,
                    cpu_count=self.cpu_count,
                    memory_mb=self.memory_mb,
                    hostname="sandbox",  # what the template's /etc/hosts names
                    workdir=self.workdir / "runtime",
                    log_path=self.workdir / "console.log",
                    init_argv=tuple(argv),
                    init_env=env,
                )
                self._running = await stack.enter_async_context(node.runtime.open_sandbox(spec))
                await self._init_envd()
                self.lifecycle.step(lc.Ready(trio.current_time(), self._timeout_s))
                self._log("running")
                started = self.was_started = True
                task_status.started(self)
                try:
                    await self._serve()
                except Exception as exc:  # supervision: contain this sandbox's failure
                    log.exception("sandbox %s failed", self.sandbox_id)
                    self.lifecycle.step(lc.Crashed(repr(exc)))
                    self._log(f"failed: {exc!r}", level="error")
                self._log(
                    f"stopping: {self.lifecycle.reason.value if self.lifecycle.reason else 'unknown'}"
                )
        except Exception as exc:
            if not started:
                if self.lifecycle.can(lc.Crashed("")):
                    self.lifecycle.step(lc.Crashed(repr(exc)))
                raise
            log.exception("sandbox %s failed during teardown", self.sandbox_id)
        finally:
            if self.lifecycle.can(lc.Stopped()):
                self.lifecycle.step(lc.Stopped())
            self.mailbox.close()
            node._forget(self)
            self.stopped.set()
            for req in self._killers:
                req.reply(None)

    async def _init_envd(self) -> None:
        assert self.sandbox_ip is not None
        base = f"http://{self.sandbox_ip}:{ENVD_PORT}"
        client = self.node.http
        with trio.move_on_after(ENVD_READY_TIMEOUT_S) as scope:
            while True:
                try:
                    r = await client.get(f"{base}/health", timeout=2.0)
                    if r.status_code in (200, 204):
                        break
                except httpx.TransportError:
                    pass
                await trio.sleep(0.02)
        if scope.cancelled_caught:
            tail = "\n".join(self.console_tail(20))
            raise EnvdUnavailable(f"envd did not start within {ENVD_READY_TIMEOUT_S:g}s: {tail}")
        body: dict[str, Any] = {
            "envVars": self.env_vars,
            "accessToken": self.envd_access_token,
            "defaultUser": "user",
            "defaultWorkdir": "/home/user",
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        r = await client.post(f"{base}/init", json=body, timeout=10.0)
        if r.status_code >= 300:
            raise EnvdUnavailable(f"envd /init answered {r.status_code}: {r.text[:200]}")

    async def _serve(self) -> None:
        assert self._running is not None
        running = self._running
        async with trio.open_nursery() as nursery:

            async def watch_exit() -> None:
                status = await running.wait()
                if self.lifecycle.can(lc.Exited(status)):
                    self.lifecycle.step(lc.Exited(status))
                    self._log(f"sandbox process exited with status {status}", level="warn")
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_exit)
            while self.lifecycle.state is lc.State.RUNNING:
                deadline = self.lifecycle.deadline
                assert deadline is not None
                with trio.move_on_at(deadline):
                    req = await self.mailbox.receive()
                    await self._handle(req)
                    continue
                if self.lifecycle.step(lc.Expire(trio.current_time())):
                    self._log("timeout reached")
            nursery.cancel_scope.cancel()

    async def _handle(self, req: Request[Msg]) -> None:
        msg = req.msg
        try:
            match msg:
                case SetTimeout(timeout_s):
                    self.lifecycle.step(lc.SetTimeout(trio.current_time(), timeout_s))
                    req.reply(None)
                case ExtendTimeout(timeout_s):
                    now = trio.current_time()
                    current = self.lifecycle.deadline or now
                    if now + timeout_s > current:
                        self.lifecycle.step(lc.SetTimeout(now, timeout_s))
                    req.reply(None)
                case Kill():
                    self.lifecycle.step(lc.Kill())
                    self._killers.append(req)  # answered once teardown is done
                case SetNetwork(policy, allow_internet):
                    await self._set_network(policy)
                    self.allow_internet_access = allow_internet
                    req.reply(None)
                case GetUsage():
                    assert self._running is not None
                    usage: Usage = await self._running.usage()
                    req.reply(usage)
        except Exception as exc:
            req.fail(exc)

    async def _set_network(self, policy: EgressPolicy) -> None:
        assert self._slot is not None
        await self.node.network.set_policy(self._slot, policy)
        self.policy = policy
        self._log("network policy updated")

    # -- API used by the node/HTTP layer -------------------------------------

    def require_running(self) -> None:
        if self.lifecycle.state is not lc.State.RUNNING:
            raise SandboxNotRunning(self.sandbox_id, self.lifecycle.state)
