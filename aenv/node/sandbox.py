"""SandboxActor: one task that owns one sandbox from create to teardown.

The actor acquires, in order, a writable root (over the template's layers),
a network slot and the runtime sandbox from the node's host facilities
(`aenv.node.host.Host`), each as an async context manager on an exit stack,
so leaving `run()` - by kill, TTL expiry, crash or node shutdown - releases
them in reverse order. It then waits for envd, calls `/init`, reports ready,
and serves its mailbox until the lifecycle machine (`aenv.proto.lifecycle`)
says stop. Memory images and file layers (pause, hibernation, write-behind,
snapshot, fork) are made by `aenv.node.capture`. A failure after start is
caught here and recorded: one sandbox's crash never reaches the node.
"""

from __future__ import annotations

import collections
import datetime
import functools
import logging
import math
import os
import secrets
import shutil
import ssl
import time
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar

import httpx
import trio

from aenv.config import Config
from aenv.kit.asgiforward import ForwardingClient
from aenv.kit.errors import one_error
from aenv.kit.faults import crash_point
from aenv.kit.files import fsync_tree, link_files
from aenv.kit.mailbox import Mailbox, Request
from aenv.kit.metrics import Metric
from aenv.node import capture
from aenv.node.host import EnvdUnavailable, Host
from aenv.node.oomwatch import follow_kills
from aenv.proto import lifecycle as lc
from aenv.proto.netpolicy import EgressPolicy
from aenv.proto.oomevent import OomKill
from aenv.proto.requests import NewSandbox
from aenv.proto.volumes import VolumeMount
from aenv.runtimes import memvalve
from aenv.runtimes.base import ENVD_PORT, RunningSandbox, SandboxSpec, Usage
from aenv.runtimes.netns import NetSlot
from aenv.storage.bundle import envd_command
from aenv.storage.layers import Captured, LayerStack, LayerStore
from aenv.storage.metadata import Metadata
from aenv.storage.templates import Template
from aenv.storage.volumes import Volumes

log = logging.getLogger("aenv.sandbox")

ENVD_READY_TIMEOUT_S = 60.0
# a runtime that fails this soon after its sandbox was at the host memory limit
# failed of it (the valve's opening lasts up to 15 s, then the kernel decides)
AT_LIMIT_S = 60.0
LOG_LINES = 1000
_A = TypeVar("_A")
_B = TypeVar("_B")
# how long envd gets to close its side of the node's connections before a checkpoint
_CLOSE_WAIT_S = 1.0


@functools.cache
def client_tls_context() -> ssl.SSLContext:
    """One TLS context for every sandbox client (they speak plain HTTP, but httpx
    builds a context per client otherwise: ~35 ms of CPU each, paid on every
    create, resume and capture). Built as the node starts (`aenv.node.primer`),
    not on its first create."""
    return ssl.create_default_context()


async def _enter_both(
    stack: AsyncExitStack,
    first: AbstractAsyncContextManager[_A],
    second: AbstractAsyncContextManager[_B],
    phases: capture.Phases | None = None,
    names: tuple[str, str] = ("first", "second"),
) -> tuple[_A, _B]:
    """Enter two independent context managers onto `stack` at once; the first
    failure is raised as it is (the other, if entered, is left on the stack).
    With `phases`, each one's time is noted under its name in `names`."""
    got: list[Any] = [None, None]

    async def enter(i: int, cm: AbstractAsyncContextManager[Any]) -> None:
        async def entered() -> None:
            got[i] = await stack.enter_async_context(cm)

        if phases is None:
            await entered()
        else:
            await phases.timed(names[i], entered())

    with one_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(enter, 0, first)
            nursery.start_soon(enter, 1, second)
    return got[0], got[1]


def _http_client() -> ForwardingClient:
    """The node's client for one sandbox's envd and proxied traffic."""
    return ForwardingClient(
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=32),
        timeout=httpx.Timeout(30.0),
        verify=client_tls_context(),
    )


class SandboxNotRunning(Exception):
    def __init__(self, sandbox_id: str, state: lc.State) -> None:
        super().__init__(f"sandbox {sandbox_id} is {state.value}")
        self.state = state


class PauseError(Exception):
    """The pause failed; the sandbox is still running."""


class ResumeError(Exception):
    """The resume failed; the sandbox is still paused."""


def policy_of(doc: dict[str, Any]) -> EgressPolicy:
    """The egress policy a journal record holds (`SandboxActor.paused_record`)."""
    return EgressPolicy.from_doc(doc["policy"])


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
    reason: lc.StopReason = lc.StopReason.KILLED
    # said in the sandbox's log when the node stops it (not its user)
    why: str | None = None


@dataclass(frozen=True)
class SetNetwork:
    policy: EgressPolicy
    allow_internet_access: bool | None


@dataclass(frozen=True)
class GetUsage:
    pass


@dataclass(frozen=True)
class Pause:
    # "full": memory and filesystem; "filesystem": resuming boots fresh from it
    mode: str = "full"


@dataclass(frozen=True)
class Resume:
    """Answers True if the sandbox was resumed, False if it was already running."""

    timeout_s: int | None = None


@dataclass(frozen=True)
class Fork:
    """Capture the running sandbox for `count` children: answers a `LiveCapture`
    with a memory image (the children are started by the asker, `aenv.node.forks`)."""

    count: int


@dataclass(frozen=True)
class Snapshot:
    """Capture the running sandbox for a snapshot: answers a `LiveCapture`, with
    a memory image if `memory` (the asker records it, `aenv.node.snapshots`)."""

    memory: bool = True


@dataclass(frozen=True)
class LiveCapture:
    """A running sandbox's capture, the answer to `Fork` and `Snapshot`: its
    memory image (None: files only) over the layer stack its files were
    captured into. It is sent while the sandbox is still held, so the asker's
    work (restoring children) overlaps letting it go. The image lies in the
    sandbox's directory and is the asker's to remove once used."""

    image: Path | None
    stack: LayerStack


@dataclass(frozen=True)
class Hibernate:
    """Write a frozen paused sandbox to disk now (node shutdown, memory needed)."""


@dataclass(frozen=True)
class WriteBehind:
    """Give a frozen paused sandbox its copy on disk now, if it has none (a node
    stop that leaves sandboxes to the next node process); answers once written."""


@dataclass(frozen=True)
class CopyPaused:
    """A paused sandbox on disk: answer a `PausedCopy` of what resumes it (a
    cluster makes it durable in the object store, so another node can)."""


@dataclass(frozen=True)
class PausedCopy:
    """The answer to `CopyPaused`: hard links to its memory image (None for a
    filesystem pause) in a directory of its own (the asker's to remove), the
    layer stack it resumes over and its record (`SandboxActor.paused_record`)."""

    image: Path | None
    stack: LayerStack
    record: dict[str, Any]


@dataclass(frozen=True)
class PoolFreeze:
    """Freeze a pooled sandbox's processes until it is adopted."""


@dataclass(frozen=True)
class Adopt:
    """Make a pooled sandbox the caller's: its request, tokens and timeout. Answers the actor."""

    req: NewSandbox


Msg = (
    SetTimeout
    | ExtendTimeout
    | Kill
    | SetNetwork
    | GetUsage
    | Pause
    | Resume
    | Fork
    | Snapshot
    | PoolFreeze
    | Adopt
    | Hibernate
    | WriteBehind
    | CopyPaused
)


@dataclass(frozen=True)
class LogEntry:
    timestamp: float
    level: str
    message: str
    fields: dict[str, str] = field(default_factory=dict)


class SandboxHost(Protocol):
    """What a sandbox actor needs of the node that owns it (the node is one)."""

    config: Config
    host: Host
    layers: LayerStore
    meta: Metadata
    # processes killed by sandboxes' OOM killer (aenv_sandbox_oom_kills_total)
    m_oom_kills: Metric
    volumes: Volumes
    egress_ca_pem: str | None  # the egress CA sandboxes with `network.rules` trust

    def forget(self, actor: SandboxActor, *, keep_files: bool = False) -> None:
        """Take the actor out of the node's table (its task is ending)."""
        ...

    async def collect_layers(self) -> None: ...


def disk_mb_of(template: Template, node_default: int) -> int:
    """The disk size (MiB; 0: unbounded) of a new sandbox of `template`: the
    template's own where it sets one, else the node's."""
    return template.sandbox_disk_mb or node_default


class SandboxActor:
    def __init__(
        self, node: SandboxHost, sandbox_id: str, template: Template, req: NewSandbox
    ) -> None:
        self.node = node
        self.sandbox_id = sandbox_id
        self.template = template
        # why the runtime stopped by itself, if it did (kept for the API once it is gone)
        self.exit_cause: str | None = None
        self.host_oom_killed = False
        self._memory_limit_at: float | None = None  # when the valve last opened
        self.metadata = dict(req.metadata)
        # The image's Env first; the caller's envVars override it.
        self.env_vars = {**template.env_map, **req.env_vars}
        self.policy = req.policy
        self.allow_internet_access = req.allow_internet_access
        self.allow_public_traffic = req.allow_public_traffic
        self.auto_pause = req.auto_pause
        self.auto_resume = req.auto_resume
        # volumes bind-mounted at every start (resolved: with their IDs)
        self.volume_mounts = req.volume_mounts
        # paused by a node stop (its root is served by the node): resumed at start
        self.resume_at_start = False
        self.cpu_count = req.cpu_count or template.cpu_count
        self.memory_mb = req.memory_mb or template.memory_mb
        # what it may write over its template, for its whole life (MiB; 0: unbounded)
        self.disk_mb = disk_mb_of(template, node.config.sandbox_disk_mb)
        self.envd_access_token = secrets.token_urlsafe(24)
        self.traffic_access_token = secrets.token_urlsafe(24)
        self.started_at = time.time()
        self.lifecycle = lc.Lifecycle(auto_pause=req.auto_pause)
        # what the next (or the latest) pause saves: "full" or "filesystem"
        self.pause_mode = "full" if req.auto_pause_memory else "filesystem"
        self.paused_at: float | None = None
        self.mailbox: Mailbox[Msg] = Mailbox(f"sandbox {sandbox_id}", capacity=32)
        self.sandbox_ip: str | None = None
        self.stopped = trio.Event()
        self.was_started = False
        # the node's own sandboxes (template warm-ups, pool members) are not shown
        self.hidden = False
        # a pool member waiting, frozen, to be adopted by a create
        self.pooled = False
        self._frozen = False
        # paused by freezing: the runtime, mount and slot are kept until it hibernates
        self.frozen_pause = False
        self._hibernate_now = False
        # writing a frozen sandbox to disk: if that fails, it is frozen again
        self._hibernating = False
        # a paused sandbox whose record and memory image are on disk (it survives a crash)
        self.on_disk = False
        # the state of this sandbox's journal record (None: not journaled)
        self._journaled: str | None = None
        # a frozen sandbox's write-behind copy on disk: (memory image, layer stack)
        self._behind: tuple[Path, LayerStack] | None = None
        # a sandbox taken back frozen whose runtime may be gone keeps its files
        self.keep_files = False
        # set on a sandbox taken back running after a node restart: its journal record
        self._adoption: dict[str, Any] | None = None
        # set once a frozen pause ends: resumed, written to disk, or killed
        self.unfrozen = trio.Event()
        self.unfrozen.set()
        self._timeout_s = req.timeout_s
        self._running: RunningSandbox | None = None
        # Node -> sandbox HTTP (envd control calls, proxied traffic) for the
        # current running period. A checkpoint must not catch idle keep-alive
        # connections (envd does not survive restoring them), so pausing closes
        # this client first and resuming opens a new one.
        self.http: ForwardingClient | None = None
        self._runtime_stack: AsyncExitStack | None = None
        # The sandbox's read-only layers (frozen uppers over the template) and
        # the memory image the next running period restores (None: boot).
        self.stack = LayerStack.of_base([template.rootfs])
        self._resume_image: Path | None = None
        # the running period's writable upper, and its latest live capture
        # (a snapshot or fork of the running sandbox; the next copies what changed since)
        self._upper: Path | None = None
        self._period_stack: AsyncExitStack | None = None
        self._live: Captured | None = None
        # set on a fork child: the parent's envd token, which the child rotates
        self._prior_token: str | None = None
        self._period = 0
        self._captures = 0
        # set on a sandbox recovered paused after a node restart: the TTL it had left
        self._recovered_remaining: float | None = None
        self._recovered_timeout: float | None = None
        self._slot: NetSlot | None = None
        self._serve_scope: trio.CancelScope | None = None
        self._killers: list[Request[Msg]] = []
        self._pausers: list[Request[Msg]] = []
        self._resumers: list[Request[Msg]] = []
        self._logs: collections.deque[LogEntry] = collections.deque(maxlen=LOG_LINES)
        self.workdir: Path = node.config.sandboxes_dir / sandbox_id

    # -- read-only views (sync, never block) ---------------------------------

    @property
    def state(self) -> lc.State:
        return self.lifecycle.state

    @property
    def paused_in_memory(self) -> bool:
        """Paused (or pausing) but not yet on disk: fast to resume, lost in a crash."""
        paused = self.lifecycle.state in (lc.State.PAUSED, lc.State.PAUSING)
        return paused and not self.on_disk

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

    def note(self, message: str, level: str = "info", **fields: str) -> None:
        """Add an entry to this sandbox's log only (not the node's): the egress
        proxy's per-connection entries."""
        self._logs.append(LogEntry(time.time(), level, message, dict(fields)))

    def _log(self, message: str, level: str = "info", **fields: str) -> None:
        self._logs.append(LogEntry(time.time(), level, message, dict(fields)))
        log.info("%s: %s", self.sandbox_id, message, extra={"sandbox_id": self.sandbox_id})

    # -- the actor -----------------------------------------------------------

    async def run(
        self, *, task_status: trio.TaskStatus[SandboxActor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The sandbox's whole life: periods of running, separated by pauses.

        Each running period has its own writable upper over the sandbox's
        layer stack, network slot and runtime sandbox. Pausing checkpoints the
        runtime (full) or stops it (filesystem), freezes the upper into an
        immutable layer on top of the stack, and releases everything else, so
        a paused sandbox holds no CPU, memory, mount or network namespace.
        Resuming mounts a fresh upper over the new stack and restores the
        image (or boots fresh) into a new slot. A fork child starts this way
        from its parent's image and stack.
        """
        node = self.node
        started = self.was_started = False
        try:
            image = self._resume_image
            if self._recovered_remaining is not None:
                # paused before the node restarted: take it up again, still paused
                self.lifecycle.step(
                    lc.Recovered(self._recovered_remaining, self._recovered_timeout)
                )
                self._log("recovered after a node restart, paused")
                started = self.was_started = True
                task_status.started(self)
                if not await self._serve_paused():
                    self._log(
                        "stopping: "
                        + (self.lifecycle.reason.value if self.lifecycle.reason else "unknown")
                    )
                    return
                image = self._resume_image
            elif self._adoption is not None:
                self._log("taking it back after a node restart")
            else:
                self._log("creating", template=self.template.template_id)
            while True:
                stopping = await self._run_period(image, task_status, first=not started)
                started = self.was_started = True
                if stopping:
                    break
                image = self._resume_image
                if not await self._serve_paused():
                    break
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
            # cancelled while paused = the node is shutting down: the sandbox
            # stays recorded (and its files kept) for the next node process
            keep = self.lifecycle.state is lc.State.PAUSED or self.keep_files
            if not keep:
                await self._forget_record()
            if self.lifecycle.can(lc.Stopped()):
                self.lifecycle.step(lc.Stopped())
            self.mailbox.close()
            node.forget(self, keep_files=keep)
            with trio.CancelScope(shield=True):
                await node.collect_layers()
            self.stopped.set()
            for req in self._killers:
                req.reply(None)
            for req in self._pausers + self._resumers:
                req.fail(SandboxNotRunning(self.sandbox_id, self.lifecycle.state))

    async def _run_period(
        self,
        image: Path | None,
        task_status: trio.TaskStatus[SandboxActor],
        *,
        first: bool,
    ) -> bool:
        """Run until stopped (returns True) or paused (returns False)."""
        node, host = self.node, self.node.host
        adoption, self._adoption = self._adoption, None
        self._period = int(adoption["period"]) if adoption else self._period + 1
        disk = self.workdir / f"disk{self._period}"
        self._upper, self._live = disk / "upper", None
        phases = capture.Phases()
        async with AsyncExitStack() as period:
            try:
                # the root and the network slot do not wait for each other
                root_cm = (
                    host.roots.adopt_root(disk)
                    if adoption
                    else host.roots.open_root(
                        self.stack.lowers(),
                        disk,
                        disk_bytes=self.disk_mb << 20,
                        # what it wrote before (its pauses, its fork parent's) counts
                        carried_bytes=sum(layer.size_bytes for layer in self.stack.layers),
                    )
                )
                slot_cm = (
                    host.network.adopt_slot(int(adoption["slot"]))
                    if adoption
                    else host.network.open_slot(self.policy)
                )
                root, slot = await _enter_both(
                    period, root_cm, slot_cm, phases, ("root", "network")
                )
                phases.skip()
                self._slot = slot
                self.sandbox_ip = slot.sandbox_ip
                argv, env = envd_command(ENVD_PORT)
                binds = [
                    (await node.volumes.host_path(m.volume_id), m.path) for m in self.volume_mounts
                ]
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
                    binds=tuple(binds),
                )
                self._period_stack = period
                self.http = await period.enter_async_context(_http_client())
                if adoption:
                    opener = host.runtime.open_adopted(spec, frozen=adoption["state"] == "frozen")
                elif image is None:
                    opener = host.runtime.open_sandbox(spec)
                else:
                    opener = host.runtime.open_restored(spec, image)
                self._runtime_stack = await period.enter_async_context(AsyncExitStack())
                self._running = await self._runtime_stack.enter_async_context(opener)
                phases.mark("restore" if image is not None else "runtime")
                if not adoption:
                    crash_point("create.started" if first else "resume.restored")
                    await self._init_envd(resumed=image is not None)
                    phases.mark("envd")
                self._prior_token = None
            except Exception as exc:
                if first:
                    raise
                # a failed resume leaves the sandbox paused, its image intact
                self.lifecycle.step(lc.ResumeFailed(repr(exc)))
                self._log(f"resume failed: {exc!r}", level="error")
                for req in self._resumers:
                    req.fail(ResumeError(f"resume failed: {exc}"))
                self._resumers.clear()
                self._running = None
                return False
            if adoption:
                now = trio.current_time()
                if adoption["state"] == "running":
                    remaining = float(adoption["endAt"] or 0.0) - time.time()
                else:
                    remaining = float(adoption.get("remaining") or 0.0)
                self.lifecycle.step(lc.Adopted(now, remaining, adoption.get("timeoutS")))
                self._log(f"taken back {adoption['state']} after a node restart")
                task_status.started(self)
                if adoption["state"] == "frozen":  # it still is
                    self.lifecycle.step(lc.Pause(now))
                    await self._freeze_for_pause(frozen_already=True)
            elif first:
                self.lifecycle.step(lc.Ready(trio.current_time(), self._timeout_s))
                await self._journal("running")
                phases.mark("journal")
                self._log(f"running: started in {phases}")
                crash_point("create.journaled")
                task_status.started(self)
            else:
                self.lifecycle.step(lc.Resumed(trio.current_time()))
                # (its image stays, but its next pause is in memory until written)
                self.on_disk = False
                await self._journal("running")
                phases.mark("journal")
                self._log(f"resumed in {phases}")
                for req in self._resumers:
                    req.reply(True)
                self._resumers.clear()
            try:
                while True:
                    await self._serve()
                    if self.frozen_pause and await self._serve_frozen():
                        self.unfrozen.set()
                        continue  # thawed: running again
                    try:
                        if self.lifecycle.state is not lc.State.PAUSING:
                            return True
                        if await self._pause(disk):
                            return False
                    finally:
                        if not self.frozen_pause:  # (a failed hibernation froze it again)
                            self.unfrozen.set()
            except Exception as exc:  # supervision: contain this sandbox's failure
                log.exception("sandbox %s failed", self.sandbox_id)
                if self.lifecycle.can(lc.Crashed("")):
                    self.lifecycle.step(lc.Crashed(repr(exc)))
                self._log(f"failed: {exc!r}", level="error")
                return True
            finally:
                self._running = None
                self._period_stack = None
                self._slot = None
                self.sandbox_ip = None
                self.http = None

    async def _freeze_for_pause(self, *, frozen_already: bool = False) -> bool:
        """The fast tier of a full pause: stop every process, keep everything.

        False if the runtime could not freeze (the caller falls back to
        writing the sandbox to disk at once).
        """
        assert self._running is not None
        try:
            if not frozen_already:
                await self._running.freeze()
        except Exception as exc:
            self._log(f"freezing failed, writing to disk instead: {exc!r}", level="warn")
            return False
        crash_point("pause.frozen")
        self.lifecycle.step(lc.Paused(trio.current_time()))
        self.frozen_pause = True
        self.unfrozen = trio.Event()
        self.paused_at = self.paused_at or time.time()
        self._log("paused (frozen)")
        if self._journaled != "frozen":  # (one taken back frozen is journaled so)
            await self._journal("frozen")
        return True

    async def _serve_frozen(self) -> bool:
        """Paused in memory: wait for resume (True), kill, or the time to hibernate.

        Returns False with the lifecycle in PAUSING (hibernate: write it to
        disk now) or STOPPING (killed). The sandbox is thawed either way:
        a checkpoint and the stop ladder both need it running.
        """
        assert self._running is not None
        now = trio.current_time()
        hibernate_at = now + self.node.config.hibernate_after_s
        behind_s = self.node.config.write_behind_s
        behind_at = now + behind_s if behind_s > 0 and self._behind is None else math.inf
        while self.lifecycle.state is lc.State.PAUSED and not self._hibernate_now:
            with trio.move_on_at(min(hibernate_at, behind_at)):
                req = await self.mailbox.receive()
                await self._handle(req)
                continue
            if trio.current_time() >= hibernate_at:
                break
            behind_at = math.inf
            await self._write_behind()
        self.frozen_pause = False
        self._hibernate_now = False
        try:
            await self._running.thaw()
        except Exception as exc:
            self._log(f"thawing failed: {exc!r}", level="error")
            if self.lifecycle.can(lc.Crashed("")):
                self.lifecycle.step(lc.Crashed(repr(exc)))
            return False
        if self.lifecycle.state is lc.State.RESUMING:
            self.lifecycle.step(lc.Resumed(trio.current_time()))
            self.paused_at = None
            self._log("resumed (from memory)")
            await self._drop_behind()
            await self._journal("running")
            for r in self._resumers:
                r.reply(True)
            self._resumers.clear()
            return True
        if self.lifecycle.state is lc.State.PAUSED:
            self.lifecycle.step(lc.Hibernate())
            self._hibernating = True
            self._log("hibernating (writing memory to disk)")
        return False

    async def _write_behind(self) -> None:
        """Give a frozen sandbox a copy on disk (memory image and a layer of
        what its files changed) while it stays frozen, journaled with it: a
        host reboot then keeps it paused, and its hibernation needs no second
        checkpoint. A failure leaves it frozen as it was."""
        assert self._running is not None and self._upper is not None
        t0 = time.perf_counter()
        image = self._next_image()
        try:
            # it cannot acknowledge closes while frozen: the restore resets them
            await self._close_connections(reopen=True, wait=False)
            self._live = await capture.write_behind(
                self._running,
                self.node.layers,
                self._upper,
                below=self.stack,
                since=self._live,
                image=image,
            )
        except Exception as exc:
            self._log(f"writing a copy to disk failed, still paused: {exc!r}", level="warn")
            return
        self._behind = (image, self._live.stack)
        await self._journal("frozen")
        crash_point("pause.written-behind")
        self._log(f"paused copy written to disk in {1000 * (time.perf_counter() - t0):.0f} ms")

    async def _drop_behind(self) -> None:
        """Running again: the write-behind copy is stale."""
        if self._behind is not None:
            image, self._behind = self._behind[0], None
            await trio.to_thread.run_sync(shutil.rmtree, image, True)

    async def _pause(self, disk: Path) -> bool:
        """Capture the sandbox (memory unless filesystem mode) and freeze its upper.

        Returns False (still running) if the runtime could not be checkpointed.
        """
        assert self._running is not None
        now = trio.current_time()
        image: Path | None = None
        behind, self._behind = (self._behind if self._hibernating else None), None
        try:
            await self._close_connections(reopen=False)
            if behind is not None:  # written while frozen: it is what it holds now
                image = behind[0]
            elif self.pause_mode == "full":
                image = self._next_image()
                await capture.checkpoint_image(self._running, image, leave_running=False)
        except Exception as exc:
            self.lifecycle.step(lc.PauseFailed(now, repr(exc)))
            self._log(f"pause failed, still running: {exc!r}", level="error")
            for req in self._pausers:
                req.fail(PauseError(f"pause failed: {exc}"))
            self._pausers.clear()
            self._reopen_http()
            await self._journal("running")
            if self._hibernating:  # the caller heard "paused": stay paused, in memory
                self._hibernating = False
                self.lifecycle.step(lc.Pause(now))  # its time left as it was
                if not await self._freeze_for_pause():
                    self._log("the sandbox runs again: it could not be frozen", level="error")
            return False
        # stop (or clean up after) the runtime, then freeze what it wrote
        what = "hibernate" if self._hibernating else "pause"
        crash_point(f"{what}.captured")
        assert self._runtime_stack is not None
        running = self._running
        await self._runtime_stack.aclose()
        if image is not None:  # (on disk for a while: its difference from its base)
            await running.compact_image(image)
        upper = await self.node.host.roots.unmount(disk)
        if behind is not None:  # its files too (the upper goes with the disk)
            self.stack = behind[1]
        else:
            self.stack = await capture.freeze_upper(
                self.node.layers, upper, below=self.stack, fault=f"{what}.layer-frozen"
            )
        self._upper, self._live = None, None
        self._hibernating = False
        old, self._resume_image = self._resume_image, image
        if old is not None and old != image and old.parent == self.workdir:
            # only its own: a snapshot's or a fork parent's image is not this sandbox's
            await trio.to_thread.run_sync(shutil.rmtree, old, True)
        self.lifecycle.step(lc.Paused(trio.current_time()))
        self.paused_at = time.time()
        # recorded before anyone hears "paused": a crash after the answer keeps it
        await self._persist_paused()
        self._log(f"paused ({self.pause_mode}), {self.stack.depth} layers")
        for req in self._pausers:
            req.reply(None)
        self._pausers.clear()
        return True

    async def _capture_live(self, msg: Fork | Snapshot, req: Request[Msg]) -> None:
        """Snapshot or fork the sandbox without stopping it.

        The sandbox is held (its processes stopped, the runtime answering)
        while the runtime writes its memory image, leaving it running, and
        storage copies what its upper changed since the previous capture into
        a new layer; then it runs on, with its ID, network, processes and
        expiry (the node's connections into it are closed before the image is
        taken). The asker gets that image over that layer (`LiveCapture`) while
        it is still held, and starts the children (or records the snapshot).
        """
        assert self._running is not None and self._upper is not None
        memory = isinstance(msg, Fork) or msg.memory
        phases = capture.Phases()
        image: Path | None = None
        replied = False

        def reply(captured: Captured) -> None:
            nonlocal replied
            self._live = captured
            # the asker's children start restoring while the source is let go
            req.reply(LiveCapture(image, captured.stack))
            replied = True

        try:
            if memory:
                await self._close_connections(reopen=True)
                image = self._next_image()
            phases.mark("connections")
            captured = await capture.capture_live(
                self._running,
                self.node.layers,
                self._upper,
                below=self.stack,
                since=self._live,
                image=image,
                fault="fork.captured" if isinstance(msg, Fork) else "snapshot.captured",
                then=reply,
                # a snapshot is recorded: it hears of its layer once that is on disk
                durable=isinstance(msg, Snapshot),
                phases=phases,
            )
        except Exception as exc:
            if replied:  # captured, but the sandbox could not be let go
                raise
            self._log(f"capture failed, still running: {exc!r}", level="error")
            if image is not None:
                await trio.to_thread.run_sync(shutil.rmtree, image, True)
            req.fail(PauseError(f"capturing the sandbox failed: {exc}"))
            return
        what = f"a fork of {msg.count}" if isinstance(msg, Fork) else "a snapshot"
        self._log(
            f"captured for {what} in {phases}: {captured.copied_bytes} bytes of files "
            f"copied, {captured.stack.depth} layers"
        )

    def _next_image(self) -> Path:
        """Where this sandbox's next memory image goes (in its own workdir)."""
        self._captures += 1
        return self.workdir / f"image{self._captures}"

    async def _close_connections(self, *, reopen: bool, wait: bool = True) -> None:
        """Close the node's connections into the sandbox before a memory image is taken.

        An image must hold no connection the sandbox has not closed its side
        of (a restored envd whose socket runsc reset while saving the image
        never answers again; see aenv.kit.tcpstate): returns once envd has
        closed its side of each (the host's TCP table shows it), or after a
        bound. With `reopen` (the sandbox runs on), later requests get a new
        client.
        """
        if self.http is None:
            return
        await self.http.aclose()
        if (
            wait
            and self.sandbox_ip is not None
            and not await self.node.host.envd.wait_closed(self.sandbox_ip, within_s=_CLOSE_WAIT_S)
        ):
            self._log("envd kept a connection open; capturing anyway", level="warn")
        if reopen:
            self._reopen_http()

    def _reopen_http(self) -> None:
        """A new client for this running period (after `_close_connections`)."""
        if self.http is not None and self.http.is_closed and self._period_stack is not None:
            self.http = _http_client()
            self._period_stack.push_async_callback(self.http.aclose)

    def on_node_served_fs(self) -> bool:
        """Whether its root stands on layers this node process serves (an image
        template's tree, a lazily restored layer: the image FUSE mount), which
        stop working when the process does (blocking: reads symlinks)."""
        mount = Path(os.path.abspath(self.node.config.run_dir / "images"))
        for lower in self.stack.lowers():
            path = Path(os.path.abspath(lower))
            if path.is_symlink():
                path = Path(os.path.abspath(path.parent / os.readlink(path)))
            if path.is_relative_to(mount):
                return True
        return False

    @property
    def upper(self) -> Path | None:
        """The running period's writable upper directory (None while paused)."""
        return self._upper

    def layer_ids(self) -> set[str]:
        """Layers this sandbox stands on or captured last (garbage collection keeps them)."""
        live = set(self.stack.ids())
        if self._live is not None:
            live.update(self._live.stack.ids())
        return live

    # -- surviving a node restart ---------------------------------------------

    def paused_record(self) -> dict[str, Any]:
        """What a new node process needs to take this paused sandbox up again."""
        p = self.policy
        return {
            "version": 1,
            "sandboxID": self.sandbox_id,
            "templateID": self.template.template_id,
            "layers": list(self.stack.ids()),
            "image": None if self._resume_image is None else self._resume_image.name,
            "pauseMode": self.pause_mode,
            "envdToken": self.envd_access_token,
            "trafficToken": self.traffic_access_token,
            "metadata": self.metadata,
            "envVars": self.env_vars,
            "policy": p.to_doc(),
            "allowInternetAccess": self.allow_internet_access,
            "allowPublicTraffic": self.allow_public_traffic,
            "autoPause": self.auto_pause,
            "autoResume": self.auto_resume,
            "cpuCount": self.cpu_count,
            "memoryMB": self.memory_mb,
            "diskMB": self.disk_mb,
            "startedAt": self.started_at,
            "pausedAt": self.paused_at,
            "remaining": self.lifecycle.remaining or 0.0,
            "timeoutS": self.lifecycle.timeout_s,
            "captures": self._captures,
            "resumeAtStart": self.resume_at_start,
            "volumeMounts": [m.to_doc() for m in self.volume_mounts],
        }

    async def journal_paused(self) -> None:
        """Journal this sandbox, not started yet, as paused (one brought from
        another node: a restart of this node takes it up paused)."""
        await self._persist_paused()

    def paused_key(self) -> str:
        """What identifies this sandbox's current pause: its image and layers
        (a durable copy of an earlier pause is stale)."""
        image = "" if self._resume_image is None else self._resume_image.name
        return ":".join([image, *self.stack.ids()])

    async def _persist_paused(self) -> None:
        """Record this paused sandbox durably (its image and layers flushed to disk first).

        A crash before this returns loses the paused state (the journal still
        says the sandbox runs, and its runtime is gone: it is reported lost);
        after it, the sandbox survives the crash, paused.
        """
        try:
            if self._resume_image is not None:
                await trio.to_thread.run_sync(fsync_tree, self._resume_image)
            # and its layers (a fork's layer is flushed after its children start)
            await self.node.layers.sync()
        except Exception:
            log.exception("flushing the memory image of sandbox %s failed", self.sandbox_id)
            return
        await self._journal("paused")
        self.on_disk = self._journaled == "paused"

    async def _journal(self, state: str) -> None:
        """Write this sandbox's journal record (SQLite, committed before returning):
        `running` and `frozen` ones are taken back with their runtime after a
        node restart, `paused` ones from their image. The node's own sandboxes
        (pool members, warm-ups, builds) are not journaled: a restart reaps them."""
        if self.hidden:
            return
        doc = self.paused_record()
        doc["state"] = state
        if state != "paused":
            doc["period"] = self._period
            doc["slot"] = None if self._slot is None else self._slot.index
            doc["endAt"] = self.end_at() if state == "running" else None
        if state == "frozen" and self._behind is not None:
            # what it is taken back from, paused, if its runtime is gone (a reboot)
            doc["durableImage"] = self._behind[0].name
            doc["durableLayers"] = list(self._behind[1].ids())
        meta = self.node.meta
        # a running record over none or a running one: a host crash, which would
        # lose it, leaves no running sandbox to take back anyway (no sync to disk)
        sync = not (state == "running" and self._journaled in (None, "running"))
        try:
            with trio.CancelScope(shield=True):
                await meta.put_sandbox(self.sandbox_id, state, doc, time.time(), sync=sync)
            self._journaled = state
        except Exception:
            log.exception("journaling sandbox %s (%s) failed", self.sandbox_id, state)

    async def _forget_record(self) -> None:
        self.on_disk = False
        # (a running record that a host crash brings back finds no runtime: it goes then)
        sync, self._journaled = self._journaled not in (None, "running"), None
        meta = self.node.meta
        with trio.CancelScope(shield=True):
            try:
                await meta.delete_sandbox(self.sandbox_id, sync=sync)
            except Exception:
                log.exception("removing the record of sandbox %s failed", self.sandbox_id)

    @classmethod
    def from_journal(
        cls, node: SandboxHost, template: Template, doc: dict[str, Any]
    ) -> SandboxActor:
        """A sandbox an earlier node process journaled (`_journal`): one paused
        comes back paused, from its image; a running or frozen one is taken
        back with its runtime, mount and network slot."""
        req = NewSandbox(
            template=template.template_id,
            timeout_s=1,
            metadata=dict(doc["metadata"]),
            env_vars=dict(doc["envVars"]),
            policy=policy_of(doc),
            allow_internet_access=doc["allowInternetAccess"],
            allow_public_traffic=bool(doc["allowPublicTraffic"]),
            auto_pause=bool(doc["autoPause"]),
            auto_resume=bool(doc.get("autoResume")),
            auto_pause_memory=doc["pauseMode"] == "full",
            cpu_count=int(doc["cpuCount"]),
            memory_mb=int(doc["memoryMB"]),
            volume_mounts=tuple(VolumeMount.from_doc(m) for m in doc.get("volumeMounts") or ()),
        )
        actor = cls(node, str(doc["sandboxID"]), template, req)
        actor.env_vars = dict(doc["envVars"])  # as the sandbox had them, image Env included
        actor.envd_access_token = str(doc["envdToken"])
        actor.traffic_access_token = str(doc["trafficToken"])
        actor.started_at = float(doc["startedAt"])
        actor.paused_at = doc.get("pausedAt")
        actor.pause_mode = str(doc["pauseMode"])
        actor.disk_mb = int(doc.get("diskMB", actor.disk_mb))
        layers = list(doc["layers"])
        actor.stack = (
            node.layers.chain(layers[0]) if layers else LayerStack.of_base([template.rootfs])
        )
        image = None if doc["image"] is None else actor.workdir / str(doc["image"])
        actor._captures = int(doc.get("captures") or 0)
        if doc.get("state", "paused") == "paused":
            actor._resume_image = image
            actor._recovered_remaining = float(doc.get("remaining") or 0.0)
            actor._recovered_timeout = doc.get("timeoutS")
            actor.on_disk = True
        else:
            # the image it last started from, if its own (a running one needs none)
            actor._resume_image = image if image is not None and image.is_dir() else None
            actor._adoption = doc
            if doc.get("durableImage"):
                behind = actor.workdir / str(doc["durableImage"])
                below = list(doc.get("durableLayers") or ())
                stack = (
                    node.layers.chain(below[0]) if below else LayerStack.of_base([template.rootfs])
                )
                actor._behind = (behind, stack)
        actor._journaled = doc.get("state", "paused")
        actor.resume_at_start = bool(doc.get("resumeAtStart"))
        return actor

    async def _serve_paused(self) -> bool:
        """Wait, paused, for resume (True) or kill (False). No TTL runs while paused."""
        while self.lifecycle.state is lc.State.PAUSED:
            req = await self.mailbox.receive()
            await self._handle(req)
        return self.lifecycle.state is lc.State.RESUMING

    @classmethod
    def from_snapshot(
        cls,
        node: SandboxHost,
        sandbox_id: str,
        template: Template,
        req: NewSandbox,
        *,
        stack: LayerStack,
        image: Path | None,
        prior_token: str,
        cpu_count: int,
        memory_mb: int,
        disk_mb: int | None = None,
    ) -> SandboxActor:
        """A sandbox that starts from a stored snapshot (its image, or a fresh boot)."""
        actor = cls(node, sandbox_id, template, req)
        if disk_mb is not None and actor.disk_mb > 0:
            # at least what the snapshot's sandbox had: its files must fit
            actor.disk_mb = max(actor.disk_mb, disk_mb)
        actor.stack = stack
        actor._resume_image = image
        actor._prior_token = prior_token if image is not None else None
        actor.cpu_count = req.cpu_count or cpu_count
        actor.memory_mb = req.memory_mb or memory_mb
        return actor

    @classmethod
    def fork_of(
        cls, parent: SandboxActor, sandbox_id: str, image: Path, stack: LayerStack, timeout_s: int
    ) -> SandboxActor:
        """A child that starts from `parent`'s capture: `image` over `stack`."""
        req = NewSandbox(
            template=parent.template.template_id,
            timeout_s=timeout_s,
            metadata=dict(parent.metadata),
            env_vars=dict(parent.env_vars),
            policy=parent.policy,
            allow_internet_access=parent.allow_internet_access,
            allow_public_traffic=parent.allow_public_traffic,
            auto_pause=parent.auto_pause,
            auto_resume=parent.auto_resume,
            auto_pause_memory=parent.pause_mode == "full",
            cpu_count=parent.cpu_count,
            memory_mb=parent.memory_mb,
            volume_mounts=parent.volume_mounts,  # the same volumes, not copies
        )
        child = cls(parent.node, sandbox_id, parent.template, req)
        child.disk_mb = parent.disk_mb
        child.stack = stack
        child._resume_image = image
        child._prior_token = parent.envd_access_token
        return child

    async def _init_envd(self, *, resumed: bool = False) -> None:
        """Hand envd its environment and token: a booted envd once it answers,
        a restored one (a resume, a fork child, a pool member) at once, its
        answer to /init being the readiness."""
        address, client, envd = self.sandbox_ip, self.http, self.node.host.envd
        assert address is not None and client is not None
        if not resumed:
            with trio.move_on_after(ENVD_READY_TIMEOUT_S) as scope:
                await envd.wait_ready(client, address)
            if scope.cancelled_caught:
                self._envd_did_not_start()
        body: dict[str, Any] = {
            "envVars": self.env_vars,
            "accessToken": self.envd_access_token,
            "defaultUser": self.template.default_user,
            "defaultWorkdir": self.template.default_workdir,
            # aenv's own: RLIMIT_NPROC of the user's processes (aenv.envd.guard)
            "processLimit": self.node.config.process_limit_for(self.memory_mb),
            # microseconds: envd ignores an /init not newer than the last (a pool
            # member is initialised twice within a second when adopted at once)
            "timestamp": datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z"),
        }
        if self.policy.rules and self.node.egress_ca_pem:
            # the egress proxy intercepts the rules' hosts: trust its CA (aenv.envd.trust)
            body["caCertificates"] = self.node.egress_ca_pem
        if not resumed:
            await envd.init(client, address, body, token=None)
            return
        # A restored envd runs already and holds a token it wants to re-init
        # with: /init at once, its answer is the readiness (one round trip, not
        # a health check first). A connection refused or reset means not yet;
        # a repeated /init is ignored (its timestamp is not newer).
        current = self._prior_token or self.envd_access_token
        with trio.move_on_after(ENVD_READY_TIMEOUT_S):
            while True:
                try:
                    await envd.init(client, address, body, token=current)
                    return
                except httpx.TransportError:
                    await trio.sleep(0.02)
        self._envd_did_not_start()

    def _envd_did_not_start(self) -> NoReturn:
        tail = "\n".join(self.console_tail(20))
        raise EnvdUnavailable(f"envd did not start within {ENVD_READY_TIMEOUT_S:g}s: {tail}")

    async def _serve(self) -> None:
        assert self._running is not None
        running = self._running
        async with trio.open_nursery() as nursery:

            async def watch_exit() -> None:
                status = await running.wait()
                if self.lifecycle.can(lc.Exited(status)):
                    self.lifecycle.step(lc.Exited(status))
                    # the runtime itself may fail at the host limit rather than be
                    # killed there (its own allocations refused): the valve saw it
                    at_limit = (
                        status != 0
                        and self._memory_limit_at is not None
                        and trio.current_time() - self._memory_limit_at <= AT_LIMIT_S
                    )
                    self.exit_cause = f"its runtime exited with status {status}" + (
                        " (the host killed it: out of memory)"
                        if running.host_oom_killed
                        else " (at its host memory limit: out of memory)"
                        if at_limit
                        else ""
                    )
                    self.host_oom_killed = running.host_oom_killed or at_limit
                    self._log(f"sandbox process exited with status {status}", level="warn")
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_exit)
            nursery.start_soon(follow_kills, self.workdir / "console.log", self._on_oom_kill)
            guard = getattr(running, "guard_memory", None)  # (gVisor on cgroup v1 hosts)
            if guard is not None:
                nursery.start_soon(guard, self._on_memory_valve)
            tasks = getattr(running, "guard_tasks", None)  # (gVisor)
            if tasks is not None:
                nursery.start_soon(tasks, self._on_task_valve)
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

    def _on_memory_valve(self, message: str) -> None:
        if message.startswith(memvalve.LIMIT_REACHED):
            self._memory_limit_at = trio.current_time()
        self._log(message, level="warn", event="memory-valve")

    def _on_task_valve(self, message: str) -> None:
        self._log(message, level="warn", event="task-valve")

    def _on_oom_kill(self, kill: OomKill) -> None:
        self._log(kill.describe(), level="warn", event="oom-kill", pid=str(kill.pid))
        self.node.m_oom_kills.inc()

    async def _handle(self, req: Request[Msg]) -> None:
        msg = req.msg
        try:
            paused = self.lifecycle.state is lc.State.PAUSED
            match msg:
                case SetTimeout(timeout_s):
                    if paused:
                        raise SandboxNotRunning(self.sandbox_id, self.lifecycle.state)
                    self.lifecycle.step(lc.SetTimeout(trio.current_time(), timeout_s))
                    await self._journal("running")
                    req.reply(None)
                case ExtendTimeout(timeout_s):
                    now = trio.current_time()
                    current = self.lifecycle.deadline or now
                    if not paused and now + timeout_s > current:
                        self.lifecycle.step(lc.SetTimeout(now, timeout_s))
                        await self._journal("running")
                    req.reply(None)
                case Kill(reason, why):
                    if why:
                        self._log(why, level="error")
                    self.lifecycle.step(lc.Kill(reason))
                    self._killers.append(req)  # answered once teardown is done
                case SetNetwork(policy, allow_internet):
                    # an update carries no `iam` nor ingress settings: the sandbox keeps its own
                    policy = replace(
                        policy,
                        iam_tokens=self.policy.iam_tokens,
                        mask_request_host=self.policy.mask_request_host,
                        https_ports=self.policy.https_ports,
                    )
                    if paused and not self.frozen_pause:
                        self.policy = policy  # applied to the next running period's slot
                    else:
                        await self._set_network(policy, update=True)
                    self.allow_internet_access = allow_internet
                    if self._journaled is not None:
                        await self._journal(self._journaled)
                    req.reply(None)
                case GetUsage():
                    if self._running is None:
                        req.reply(Usage(cpu_used_pct=0.0, mem_used_bytes=0, mem_total_bytes=0))
                    else:
                        usage: Usage = await self._running.usage()
                        req.reply(usage)
                case Pause(mode):
                    if self.lifecycle.state is not lc.State.RUNNING:
                        raise SandboxNotRunning(self.sandbox_id, self.lifecycle.state)
                    self.pause_mode = mode
                    self.lifecycle.step(lc.Pause(trio.current_time()))
                    if mode == "full" and await self._freeze_for_pause():
                        req.reply(None)  # frozen: paused; written to disk later
                    else:
                        self._pausers.append(req)  # answered once the pause is done
                case Hibernate():
                    self._hibernate_now = True
                    req.reply(None)
                case WriteBehind():
                    if self.frozen_pause and self._behind is None:
                        await self._write_behind()
                    req.reply(None)
                case Fork() | Snapshot():
                    if self.lifecycle.state is not lc.State.RUNNING or self._running is None:
                        raise SandboxNotRunning(self.sandbox_id, self.lifecycle.state)
                    await self._capture_live(msg, req)
                case CopyPaused():
                    if not paused or self.frozen_pause or not self.on_disk:
                        raise SandboxNotRunning(self.sandbox_id, self.lifecycle.state)
                    copy: Path | None = None
                    if self._resume_image is not None:
                        copy = self.workdir / f"copy-{secrets.token_hex(4)}"
                        await trio.to_thread.run_sync(link_files, self._resume_image, copy)
                    req.reply(PausedCopy(copy, self.stack, self.paused_record()))
                case PoolFreeze():
                    if self.pooled and self._running is not None and not self._frozen:
                        # thawed before anything else: adopted, or killed
                        await self._running.freeze(may_checkpoint=False)
                        self._frozen = True
                    req.reply(None)
                case Adopt(new):
                    if not self.pooled or self.lifecycle.state is not lc.State.RUNNING:
                        raise SandboxNotRunning(self.sandbox_id, self.lifecycle.state)
                    await self._adopt(new)
                    req.reply(self)
                case Resume(timeout_s):
                    if self.lifecycle.state is lc.State.RUNNING:
                        req.reply(False)
                    elif paused:
                        self.lifecycle.step(lc.Resume(trio.current_time(), timeout_s))
                        self._resumers.append(req)  # answered once running again
                    else:
                        raise SandboxNotRunning(self.sandbox_id, self.lifecycle.state)
        except Exception as exc:
            req.fail(exc)

    async def stop(self, *, within_s: float = 60.0) -> None:
        """Kill this sandbox and wait for its teardown; never raises, survives cancellation.

        For the node's own sandboxes (build, warm-up, pool): best effort, bounded.
        """
        with trio.CancelScope(shield=True), trio.move_on_after(within_s):
            try:
                await self.mailbox.ask(Kill(), timeout=within_s)
                await self.stopped.wait()
            except Exception:
                log.debug("sandbox %s was gone before its kill", self.sandbox_id)

    async def freeze_pooled(self) -> None:
        await self.mailbox.ask(PoolFreeze(), timeout=60)

    async def adopt(self, req: NewSandbox) -> SandboxActor:
        """Hand this pooled sandbox to the creator of `req` (see `aenv.node.pool`)."""
        actor: SandboxActor = await self.mailbox.ask(Adopt(req), timeout=60)
        return actor

    async def _adopt(self, new: NewSandbox) -> None:
        assert self._running is not None
        steps = capture.Phases()
        if self._frozen:
            await self._running.thaw()
            self._frozen = False
            steps.mark("thaw")
        if new.policy != self.policy:
            await self._set_network(new.policy)
            steps.mark("network")
        self.metadata = dict(new.metadata)
        env_vars = {**self.template.env_map, **new.env_vars}
        # envd was given this member's environment and a token of its own (one
        # nobody outside this node has seen) when the member was restored: a create
        # that asks for nothing else keeps both, and its /init would change nothing
        init = env_vars != self.env_vars or bool(self.policy.rules)
        self.env_vars = env_vars
        self.allow_internet_access = new.allow_internet_access
        self.allow_public_traffic = new.allow_public_traffic
        self.auto_pause = self.lifecycle.auto_pause = new.auto_pause
        self.auto_resume = new.auto_resume
        self.pause_mode = "full" if new.auto_pause_memory else "filesystem"
        if init:
            self._prior_token = self.envd_access_token
            self.envd_access_token = secrets.token_urlsafe(24)
        self.traffic_access_token = secrets.token_urlsafe(24)
        self.started_at = time.time()
        self.lifecycle.step(lc.SetTimeout(trio.current_time(), new.timeout_s))
        # envd's /init (when needed) and the journal record at once; both are done
        # before the create returns (one that fails is stopped, its record removed)
        self.hidden = False
        with one_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(steps.timed, "journal", self._journal("running"))
                if init:
                    await steps.timed("envd", self._init_envd(resumed=True))
        steps.skip()
        self._prior_token = None
        self.pooled = False
        self._log(f"adopted from the pool in {steps}")

    @property
    def slot_index(self) -> int | None:
        """The network slot the sandbox holds now (None: none open)."""
        return None if self._slot is None else self._slot.index

    async def _set_network(self, policy: EgressPolicy, *, update: bool = False) -> None:
        assert self._slot is not None
        await self.node.host.network.set_policy(self._slot, policy)
        newly_intercepted = bool(policy.rules) and not self.policy.rules
        self.policy = policy
        if newly_intercepted and update:
            await self._init_envd(resumed=True)  # its clients now trust the egress CA
        self._log("network policy updated")

    # -- API used by the node/HTTP layer -------------------------------------

    def require_running(self) -> None:
        if self.lifecycle.state is not lc.State.RUNNING:
            raise SandboxNotRunning(self.sandbox_id, self.lifecycle.state)
