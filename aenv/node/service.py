"""The sandbox operations the API calls: the `SandboxService` protocol and this node's.

`SandboxService` is the seam between the HTTP layer (`aenv.api`) and what
runs sandboxes. Its calls take and return plain frozen values (`SandboxInfo`,
`SandboxMetrics`, `SandboxLogs`, `SnapshotInfo`, request values from
`aenv.proto.requests`), never actors, and fail with the `ServiceError`
subclasses defined here, so a cluster layer can implement the same protocol
by routing each call to the node that owns the sandbox and forwarding it.
The one exception is `endpoint`, which hands the data plane (the sandbox
proxy, the exec WebSocket) the address and HTTP client to reach a sandbox.

A sandbox is addressable while it is running, pausing, paused or resuming;
one being created or stopped is not found, as in E2B.

`LocalSandboxService` implements the protocol on this node's `Node` and its
`SandboxActor`s, through their mailbox messages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import trio

from aenv.images.registry import (
    ImageNotFound,
    RegistryAuthError,
    RegistryNotAllowed,
    UnsupportedImage,
)
from aenv.images.store import PullError
from aenv.kit import mailbox
from aenv.kit.asgiforward import ForwardingClient
from aenv.node.defaults import TemplateFetching
from aenv.node.node import Died, Node, SandboxNotFound
from aenv.node.sandbox import (
    ExtendTimeout,
    GetUsage,
    Pause,
    PauseError,
    Resume,
    ResumeError,
    SandboxActor,
    SandboxNotRunning,
    SetNetwork,
    SetTimeout,
)
from aenv.node.snapshots import CorruptSnapshot
from aenv.proto import lifecycle as lc
from aenv.proto.envd_schema import ENVD_VERSION
from aenv.proto.ids import InvalidName, is_sandbox_id
from aenv.proto.netpolicy import EgressPolicy
from aenv.proto.requests import Limits, NewSandbox
from aenv.runtimes.base import Usage
from aenv.runtimes.gvisor import GVisorError
from aenv.runtimes.netns import NetworkSetupError
from aenv.storage.overlay import OverlayError
from aenv.storage.templates import TemplateNotFound
from aenv.storage.volumes import VolumeError

log = logging.getLogger("aenv.service")

T = TypeVar("T")

# Lifecycle states (`aenv.proto.lifecycle.State` values) a caller can address.
ADDRESSABLE = frozenset({"running", "pausing", "paused", "resuming"})
# The state `list` gives sandboxes whose runtime stopped by itself (a crash, the
# host's OOM killer) within the last hour: only when asked for by name (E2B's
# SDKs know only running and paused), never addressable.
DIED = "died"
# Those E2B reports as "paused".
PAUSED = frozenset({"pausing", "paused", "resuming"})
EVERY_STATE = frozenset(s.value for s in lc.State)

ASK_S = 60.0
PAUSE_S = 120.0
CAPTURE_S = 600.0
KILL_S = 120.0


# -- errors -----------------------------------------------------------------------


class ServiceError(Exception):
    """A sandbox operation was refused or failed; `message` says why, for the caller."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(ServiceError):
    """The request cannot be honoured as asked (a bad name, an unusable image)."""


class Forbidden(ServiceError):
    """Something the request needs refused this node (a registry's credentials)."""


class NotFound(ServiceError):
    """No such sandbox (or template, or image) for the caller."""


class Conflict(ServiceError):
    """The sandbox's state does not allow the call."""


class NotRunning(Conflict):
    """The call needs a running sandbox; `state` is the lifecycle state it is in."""

    def __init__(self, message: str, state: str) -> None:
        super().__init__(message)
        self.state = state


class Busy(ServiceError):
    """Too much work queued (the node or the sandbox); retry after `retry_after` s."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Failed(ServiceError):
    """The operation was tried and failed (a pause, a capture, a create)."""


class UpstreamFailed(ServiceError):
    """A service the node depends on (a registry) failed, after the node's own retries."""


class Unavailable(ServiceError):
    """The result is not there yet (a snapshot not durable in time, the node's
    network under repair); `retry_after` seconds, when known, is worth a retry."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# how long a create that failed while the node repairs its network should wait
REPAIR_RETRY_S = 5.0


def setup_error(exc: Exception, *, network_repairing: bool) -> ServiceError:
    """The service error for a sandbox whose host side could not be set up: what
    failed, in words, with the tool's complaint cut to its first line."""
    detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    if isinstance(exc, NetworkSetupError):
        message = f"the node's network could not be set up for the sandbox: {detail}"
        if network_repairing:
            return Unavailable(
                f"{message}; the node is repairing its network, retry shortly",
                retry_after=REPAIR_RETRY_S,
            )
        return Failed(message)
    if isinstance(exc, OverlayError):
        return Failed(f"the sandbox's file system could not be mounted: {detail}")
    return Failed(f"the sandbox's runtime could not start it: {detail}")


def pull_error(exc: PullError) -> ServiceError:
    """The service error for a failed image pull: what went wrong, at which registry."""
    cause = exc.__cause__
    if isinstance(cause, ImageNotFound):
        return NotFound(str(exc))
    if isinstance(cause, RegistryAuthError | RegistryNotAllowed):
        return Forbidden(str(exc))
    if isinstance(cause, UnsupportedImage) or cause is None:
        return BadRequest(str(exc))
    return UpstreamFailed(str(exc))


# -- values -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SandboxInfo:
    """What the API shows of a sandbox, as it was when the call answered."""

    sandbox_id: str
    template_id: str
    alias: str | None  # the template's first alias
    state: str  # an `aenv.proto.lifecycle.State` value
    metadata: Mapping[str, str]
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    started_at: float  # wall clock
    end_at: float  # wall clock: when the timeout expires
    envd_version: str
    envd_access_token: str
    traffic_access_token: str
    allow_public_traffic: bool
    allow_internet_access: bool | None
    policy: EgressPolicy
    auto_pause: bool
    auto_resume: bool
    paused_in_memory: bool
    pause_mode: str  # what the next (or the latest) pause saves: "full" or "filesystem"
    node: str  # the id of the node that runs it (E2B's clientID)
    # the volumes it mounts: {"name", "path"} each
    volume_mounts: tuple[Mapping[str, str], ...] = ()
    # state "died" only (`DIED`): when and why its runtime stopped by itself
    died: str | None = None

    def to_doc(self) -> dict[str, Any]:
        """All of it as JSON, for another node of the cluster (`from_doc`)."""
        doc = dataclasses.asdict(self)
        doc["metadata"] = dict(self.metadata)
        doc["policy"] = self.policy.to_doc()
        return doc

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> SandboxInfo:
        """What `to_doc` wrote (a peer's answer; a malformed one raises ValueError)."""
        try:
            fields = {
                f.name: doc[f.name]
                for f in dataclasses.fields(cls)
                if f.name in doc or f.default is dataclasses.MISSING  # a peer's older record
            }
            fields["policy"] = EgressPolicy.from_doc(doc["policy"])
            if "volume_mounts" in fields:
                fields["volume_mounts"] = tuple(dict(m) for m in fields["volume_mounts"])
            return cls(**fields)
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed sandbox record: {e}") from None


@dataclass(frozen=True)
class Connected:
    """The answer to `connect` and `resume`: the sandbox, and whether it was resumed."""

    sandbox: SandboxInfo
    resumed: bool


@dataclass(frozen=True, kw_only=True)
class SandboxMetrics:
    timestamp: float
    cpu_count: int
    cpu_used_pct: float
    mem_used_bytes: int
    mem_total_bytes: int
    disk_used_bytes: int
    disk_total_bytes: int


@dataclass(frozen=True)
class LogEntry:
    timestamp: float
    level: str  # debug | info | warn | error
    message: str
    fields: Mapping[str, str]


@dataclass(frozen=True)
class SandboxLogs:
    entries: tuple[LogEntry, ...]
    console: tuple[str, ...]  # the tail of the guest's console, if asked for


@dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: str
    names: tuple[str, ...]
    storage: str  # local | uploading | durable

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> SnapshotInfo:
        """From a snapshot's record (`aenv.node.snapshots`)."""
        return cls(
            str(doc["snapshotID"]),
            tuple(doc.get("names") or ()),
            str(doc.get("storage") or "local"),
        )


@dataclass(frozen=True)
class Endpoint:
    """Where a running sandbox's port is reached, and with which client.

    `http` is the node's client for the sandbox's current running period
    (closed when it pauses): local to this process, never serialised.
    """

    sandbox_id: str
    host: str
    port: int
    http: ForwardingClient
    envd_access_token: str
    allow_public_traffic: bool
    traffic_access_token: str
    # `network.maskRequestHost` and `network.httpsPorts` (see `aenv.proto.ingress`)
    mask_request_host: str | None = None
    https_ports: tuple[int, ...] = ()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


# -- the protocol -------------------------------------------------------------------


class SandboxService(Protocol):
    """The sandbox operations of E2B's API. Every call may raise `ServiceError`s."""

    @property
    def limits(self) -> Limits:
        """The bounds requests are validated against (timeouts, CPUs, memory)."""
        ...

    async def create(self, req: NewSandbox) -> SandboxInfo:
        """Start a sandbox from a template, snapshot or image; returns once it runs."""
        ...

    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    async def list(
        self,
        *,
        metadata: Mapping[str, str] | None = None,
        states: Collection[str] | None = None,
    ) -> tuple[SandboxInfo, ...]:
        """Sandboxes whose metadata has every item of `metadata`, in lifecycle
        `states` (default: `ADDRESSABLE`), oldest first (by start, then ID)."""
        ...

    async def connect(self, sandbox_id: str, timeout_s: int) -> Connected:
        """Resume a paused sandbox with this timeout, or extend a running one's to it."""
        ...

    async def resume(self, sandbox_id: str, timeout_s: int) -> SandboxInfo:
        """Resume a paused sandbox (`Conflict` if it is running)."""
        ...

    async def pause(self, sandbox_id: str, mode: str) -> None:
        """Pause a running sandbox, saving memory and files ("full") or files only."""
        ...

    async def fork(
        self, sandbox_id: str, count: int, timeout_s: int
    ) -> tuple[SandboxInfo | ServiceError, ...]:
        """`count` independent children of a running sandbox: one result per child."""
        ...

    async def snapshot(
        self, sandbox_id: str, *, name: str | None, memory: bool, durable: bool = False
    ) -> SnapshotInfo:
        """Capture a running sandbox, which runs on; with `durable`, wait until the
        object store holds the snapshot (`Unavailable` if it does not in time)."""
        ...

    async def kill(self, sandbox_id: str) -> None: ...

    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> None: ...

    async def refresh(self, sandbox_id: str, timeout_s: int) -> None:
        """Extend the timeout to at least `timeout_s` from now (never shortens it)."""
        ...

    async def set_network(
        self, sandbox_id: str, policy: EgressPolicy, allow_internet_access: bool | None
    ) -> None: ...

    async def metrics(self, sandbox_id: str) -> SandboxMetrics: ...

    async def logs(self, sandbox_id: str, *, console: bool = False) -> SandboxLogs: ...

    async def endpoint(self, sandbox_id: str, port: int, *, auto_resume: bool = False) -> Endpoint:
        """Where to send traffic for `port` of a running sandbox.

        With `auto_resume`, a paused (or pausing) sandbox created with
        autoResume is resumed first. Raises `NotFound` (no such sandbox) or
        `NotRunning` (any other state than running).
        """
        ...


# -- this node's ------------------------------------------------------------------------


class LocalSandboxService:
    """`SandboxService` on this node's `Node` and sandbox actors."""

    def __init__(self, node: Node) -> None:
        self._node = node

    @property
    def limits(self) -> Limits:
        return self._node.limits

    async def create(self, req: NewSandbox) -> SandboxInfo:
        node = self._node
        try:
            snap = await node.find_snapshot(req.template)
            actor = await (node.create_from_snapshot(snap, req) if snap else node.create(req))
        except CorruptSnapshot as e:
            raise Failed(f"snapshot {req.template!r} cannot be used: {e}") from None
        except TemplateNotFound:
            raise NotFound(f"template {req.template!r} not found") from None
        except TemplateFetching as e:
            raise Unavailable(str(e), retry_after=e.retry_after) from None
        except (InvalidName, VolumeError) as e:
            raise BadRequest(str(e)) from None
        except PullError as e:
            raise pull_error(e) from None
        except mailbox.Busy as e:
            raise Busy(str(e), e.retry_after) from None
        except (NetworkSetupError, OverlayError, GVisorError) as e:
            log.error("create failed: %s", e)
            raise setup_error(e, network_repairing=node.network.repairing) from None
        except Exception as e:
            log.exception("create failed")
            raise Failed(f"failed to create sandbox: {e}") from None
        return _info(actor)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return _info(self._actor(sandbox_id))

    async def list(
        self,
        *,
        metadata: Mapping[str, str] | None = None,
        states: Collection[str] | None = None,
    ) -> tuple[SandboxInfo, ...]:
        wanted = ADDRESSABLE if states is None else states
        meta = metadata or {}
        found = [
            _info(a)
            for a in self._node.list()
            if a.state.value in wanted and all(a.metadata.get(k) == v for k, v in meta.items())
        ]
        if DIED in wanted:
            node = self._node.config.effective_node_id
            live = {a.sandbox_id for a in self._node.list()}  # (an ID taken again)
            found.extend(
                _died_info(d, node)
                for d in self._node.died_recently()
                if d.sandbox_id not in live and all(d.metadata.get(k) == v for k, v in meta.items())
            )
            found.sort(key=lambda i: (i.started_at, i.sandbox_id))
        return tuple(found)

    async def connect(self, sandbox_id: str, timeout_s: int) -> Connected:
        actor = self._actor(sandbox_id)
        self._room_to_resume(actor)
        resumed = bool(await _ask(actor, Resume(timeout_s), PAUSE_S))
        if not resumed:
            await _ask(actor, ExtendTimeout(timeout_s))
        return Connected(_info(actor), resumed)

    async def resume(self, sandbox_id: str, timeout_s: int) -> SandboxInfo:
        actor = self._actor(sandbox_id)
        self._room_to_resume(actor)
        if not await _ask(actor, Resume(timeout_s), PAUSE_S):
            raise Conflict(f"sandbox {sandbox_id!r} is already running")
        return _info(actor)

    async def pause(self, sandbox_id: str, mode: str) -> None:
        await _ask(self._actor(sandbox_id), Pause(mode), PAUSE_S)

    async def fork(
        self, sandbox_id: str, count: int, timeout_s: int
    ) -> tuple[SandboxInfo | ServiceError, ...]:
        actor = self._actor(sandbox_id)
        results = await _answer(actor, self._node.fork(actor, count, timeout_s, wait_s=CAPTURE_S))
        out: list[SandboxInfo | ServiceError] = []
        for r in results:
            if isinstance(r, SandboxActor):
                out.append(_info(r))
            elif isinstance(r, mailbox.Busy):
                out.append(Busy(str(r), r.retry_after))
            else:
                out.append(Failed(str(r)))
        return tuple(out)

    async def snapshot(
        self, sandbox_id: str, *, name: str | None, memory: bool, durable: bool = False
    ) -> SnapshotInfo:
        actor = self._actor(sandbox_id)
        doc = await _answer(
            actor, self._node.snapshot(actor, name, memory=memory, wait_s=CAPTURE_S)
        )
        if durable:
            doc = await self._node.durable.wait_durable(doc["snapshotID"])
            if doc.get("storage") != "durable":
                why = doc.get("storageError") or "no object store is configured"
                raise Unavailable(f"snapshot {doc['snapshotID']} is not durable yet: {why}")
        return SnapshotInfo.from_doc(doc)

    async def kill(self, sandbox_id: str) -> None:
        actor = self._actor(sandbox_id)
        try:
            await self._node.kill(actor.sandbox_id)
        except (SandboxNotFound, mailbox.ActorGone):
            raise NotFound(f"sandbox {sandbox_id!r} not found") from None
        except mailbox.Busy as e:
            raise Busy(str(e), e.retry_after) from None

    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> None:
        await _ask(self._actor(sandbox_id), SetTimeout(timeout_s))

    async def refresh(self, sandbox_id: str, timeout_s: int) -> None:
        await _ask(self._actor(sandbox_id), ExtendTimeout(timeout_s))

    async def set_network(
        self, sandbox_id: str, policy: EgressPolicy, allow_internet_access: bool | None
    ) -> None:
        await _ask(self._actor(sandbox_id), SetNetwork(policy, allow_internet_access))

    async def metrics(self, sandbox_id: str) -> SandboxMetrics:
        actor = self._actor(sandbox_id)
        usage: Usage = await _ask(actor, GetUsage())
        upper = actor.upper
        total = actor.disk_mb << 20 or actor.template.disk_size_mb << 20
        disk = 0
        if upper is not None:
            disk, total = await trio.to_thread.run_sync(_disk_use, upper, actor.disk_mb > 0, total)
        return SandboxMetrics(
            timestamp=time.time(),
            cpu_count=actor.cpu_count,
            cpu_used_pct=usage.cpu_used_pct,
            mem_used_bytes=usage.mem_used_bytes,
            mem_total_bytes=usage.mem_total_bytes,
            disk_used_bytes=disk,
            disk_total_bytes=total,
        )

    async def logs(self, sandbox_id: str, *, console: bool = False) -> SandboxLogs:
        actor = self._actor(sandbox_id)
        entries = tuple(
            LogEntry(e.timestamp, e.level, e.message, dict(e.fields)) for e in actor.logs()
        )
        tail = await trio.to_thread.run_sync(actor.console_tail) if console else []
        return SandboxLogs(entries, tuple(tail))

    async def endpoint(self, sandbox_id: str, port: int, *, auto_resume: bool = False) -> Endpoint:
        if auto_resume:
            await self._wake(sandbox_id)
        try:
            actor = self._node.get(sandbox_id)
        except SandboxNotFound:
            raise NotFound(f"sandbox {sandbox_id!r} not found") from None
        state = actor.state.value
        if state != "running" or actor.sandbox_ip is None or actor.http is None:
            raise NotRunning(f"sandbox {sandbox_id} is {state}", state)
        return Endpoint(
            sandbox_id=sandbox_id,
            host=actor.sandbox_ip,
            port=port,
            http=actor.http,
            envd_access_token=actor.envd_access_token,
            allow_public_traffic=actor.allow_public_traffic,
            traffic_access_token=actor.traffic_access_token,
            mask_request_host=actor.policy.mask_request_host,
            https_ports=actor.policy.https_ports,
        )

    async def _wake(self, sandbox_id: str) -> None:
        """Resume a paused sandbox created with autoResume before its traffic goes in."""
        try:
            actor = self._node.get(sandbox_id)
        except SandboxNotFound:
            return
        # a pause in progress answers the resume once it is done (the mailbox queues it)
        if actor.auto_resume and actor.state.value in ("paused", "pausing"):
            try:
                await actor.mailbox.ask(Resume(None), timeout=PAUSE_S)
            except Exception as exc:  # the traffic then fails as for any paused sandbox
                log.warning("auto-resume of %s failed: %r", sandbox_id, exc)

    def _room_to_resume(self, actor: SandboxActor) -> None:
        try:
            self._node.check_room_to_resume(actor)
        except mailbox.Busy as e:
            raise Busy(str(e), e.retry_after) from None

    def _actor(self, sandbox_id: str) -> SandboxActor:
        """The addressable sandbox `sandbox_id` (raises NotFound)."""
        if not is_sandbox_id(sandbox_id):
            raise NotFound(f"sandbox {sandbox_id!r} not found")
        try:
            actor = self._node.get(sandbox_id)
        except SandboxNotFound as e:
            raise NotFound(str(e)) from None
        if actor.state.value not in ADDRESSABLE:  # being created, or stopping (and why)
            raise NotFound(str(SandboxNotFound(sandbox_id, self._node.why_gone(sandbox_id))))
        return actor


async def _ask(actor: SandboxActor, msg: Any, wait_s: float = ASK_S) -> Any:
    """Ask a sandbox's actor; its refusals become service errors."""
    return await _answer(actor, actor.mailbox.ask(msg, timeout=wait_s))


async def _answer(actor: SandboxActor, pending: Awaitable[T]) -> T:
    """What a call that asks a sandbox's actor returns; the actor's refusals
    become service errors."""
    try:
        return await pending
    except mailbox.ActorGone:
        raise NotFound(f"sandbox {actor.sandbox_id!r} not found") from None
    except mailbox.Busy as e:
        raise Busy(str(e), e.retry_after) from None
    except SandboxNotRunning as e:
        raise NotRunning(str(e), e.state.value) from None
    except (PauseError, ResumeError) as e:
        raise Failed(str(e)) from None


def _info(a: SandboxActor) -> SandboxInfo:
    t = a.template
    return SandboxInfo(
        sandbox_id=a.sandbox_id,
        template_id=t.template_id,
        alias=t.aliases[0] if t.aliases else None,
        state=a.state.value,
        metadata=dict(a.metadata),
        cpu_count=a.cpu_count,
        memory_mb=a.memory_mb,
        disk_size_mb=a.disk_mb or t.disk_size_mb,  # its disk's size, as `df` in it shows
        started_at=a.started_at,
        end_at=a.end_at(),
        envd_version=ENVD_VERSION,
        envd_access_token=a.envd_access_token,
        traffic_access_token=a.traffic_access_token,
        allow_public_traffic=a.allow_public_traffic,
        allow_internet_access=a.allow_internet_access,
        policy=a.policy,
        auto_pause=a.auto_pause,
        auto_resume=a.auto_resume,
        paused_in_memory=a.paused_in_memory,
        pause_mode=a.pause_mode,
        node=a.node.config.effective_node_id,
        volume_mounts=tuple({"name": m.name, "path": m.path} for m in a.volume_mounts),
    )


def _died_info(d: Died, node: str) -> SandboxInfo:
    """A died sandbox as lists show it: state `DIED`, its end when it died."""
    return SandboxInfo(
        sandbox_id=d.sandbox_id,
        template_id=d.template_id,
        alias=d.alias,
        state=DIED,
        metadata=dict(d.metadata),
        cpu_count=d.cpu_count,
        memory_mb=d.memory_mb,
        disk_size_mb=d.disk_mb,
        started_at=d.started_at,
        end_at=d.died_at,
        envd_version=ENVD_VERSION,
        envd_access_token="",
        traffic_access_token="",
        allow_public_traffic=False,
        allow_internet_access=None,
        policy=EgressPolicy(),
        auto_pause=False,
        auto_resume=False,
        paused_in_memory=False,
        pause_mode="full",
        node=node,
        died=d.why(),
    )


def _disk_use(upper: Path, sized: bool, total: int) -> tuple[int, int]:
    """(used, total) bytes of a sandbox's disk: its own file system's figures,
    as `df` in the sandbox shows them, where it has one (`sized`)."""
    if sized:
        with contextlib.suppress(OSError):
            st = os.statvfs(upper)
            return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize
    return _dir_size(upper), total


def _dir_size(path: Path) -> int:
    """Bytes allocated under `path` (the sandbox's writable layer)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
    return total
