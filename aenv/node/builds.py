"""Template builds: E2B's `Template` builder steps run in a sandbox, kept as a snapshot.

`Builds` is the node's registry of builds. `request` reserves a build of a
named template (a new template ID for a new name, the same ID for a rebuild)
in state `waiting`; `start` runs it as a one-shot job of the node's
`services` supervisor (never restarted: its failure is recorded in the build):
pull the image (or resolve the base template), start a build sandbox from it,
apply the steps in order through the sandbox's envd (ENV accumulates, WORKDIR
makes the directory and moves there, USER switches user, RUN runs `/bin/sh -c`
and fails the build on a non-zero exit), start the start command and poll the
ready command, then capture the sandbox with its memory as a persistent
snapshot and record the template pointing at it. The template's sandboxes
start by restoring that snapshot, so what the start command launched is
already running. Every step's output becomes a build log entry; a failure
records which step failed (E2B's step names: "base", "1".."n", "finalize").
Build records live in memory: a node restart forgets builds, not templates.
COPY steps (file uploads) are not supported yet and fail the build.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import posixpath
import shlex
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import trio

from aenv.images.service import Images
from aenv.images.store import ImageRecord
from aenv.kit.supervisor import ONE_SHOT, StopToken, Strategy, Supervisor
from aenv.node.envd_client import EnvdClient
from aenv.node.sandbox import SandboxActor
from aenv.node.snapshots import Snapshots
from aenv.proto import connect as cn
from aenv.proto.ids import InvalidName, check_name
from aenv.proto.pb import DecodeError
from aenv.proto.requests import NewSandbox
from aenv.runtimes.base import ENVD_PORT
from aenv.storage.templates import Template, TemplateNotFound, TemplateStore, new_template_id

log = logging.getLogger("aenv.builds")

BUILD_SANDBOX_TIMEOUT_S = 3600
READY_TIMEOUT_S = 120.0
READY_POLL_S = 0.5
DEFAULT_READY_WAIT_S = 1.0
SNAPSHOT_TIMEOUT_S = 600.0
MAX_LOG_ENTRIES = 20_000
MAX_LINE = 8192
MAX_FINISHED_BUILDS = 200
STEP_TYPES = frozenset({"RUN", "ENV", "WORKDIR", "USER", "COPY"})


class BuildNotFound(LookupError):
    pass


class BuildConflict(Exception):
    """The name belongs to a template no build made, or the build already started."""


class StepFailed(Exception):
    def __init__(self, step: str, message: str) -> None:
        super().__init__(message)
        self.step = step
        self.message = message


@dataclass(frozen=True)
class Step:
    type: str
    args: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class BuildSpec:
    """What `POST /v2/templates/{id}/builds/{build}` asks for (validated)."""

    from_image: str | None = None
    from_template: str | None = None
    steps: tuple[Step, ...] = ()
    start_cmd: str | None = None
    ready_cmd: str | None = None


@dataclass(frozen=True)
class BuildLog:
    timestamp: float
    level: str
    message: str
    step: str | None = None


@dataclass(eq=False)
class Build:
    template_id: str
    build_id: str
    name: str
    cpu_count: int
    memory_mb: int
    created_at: float = field(default_factory=time.time)
    status: str = "waiting"  # waiting | building | ready | error
    logs: list[BuildLog] = field(default_factory=list)
    reason: str | None = None
    reason_step: str | None = None
    finished_at: float | None = None
    done: trio.Event = field(default_factory=trio.Event)  # set once ready or error
    _truncated: bool = False

    def log(self, message: str, level: str = "info", step: str | None = None) -> None:
        if len(self.logs) >= MAX_LOG_ENTRIES:
            if not self._truncated:
                self._truncated = True
                self.logs.append(BuildLog(time.time(), "warn", "further build logs dropped"))
            return
        self.logs.append(BuildLog(time.time(), level, message[:MAX_LINE], step))

    @property
    def finished(self) -> bool:
        return self.status in ("ready", "error")


@dataclass
class _State:
    """Where the build is: what ENV, WORKDIR and USER have set so far."""

    env: dict[str, str]
    workdir: str
    user: str


class _Lines:
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
        raise RuntimeError(f"build sandbox {actor.sandbox_id} is not running")
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
    lines = _Lines(on_output or (lambda _s, _l: None))
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


class BuildHost(Protocol):
    """What a build needs of the node (which is one): its stores and a few of its calls."""

    templates: TemplateStore
    snapshots: Snapshots
    images: Images
    durable: Sharing

    async def create(self, req: NewSandbox) -> SandboxActor: ...

    async def snapshot(
        self, source: SandboxActor, name: str | None, *, memory: bool, wait_s: float
    ) -> dict[str, Any]: ...

    async def resolve_template(self, name: str) -> Template: ...

    def image_template(
        self,
        record: ImageRecord,
        name: str | None = None,
        *,
        cpu_count: int | None = None,
        memory_mb: int | None = None,
    ) -> Template: ...

    async def collect_layers(self) -> None: ...


class Sharing(Protocol):
    def share_template(self, template: Template) -> None: ...


class Builds:
    """The node's template builds, by build ID; each running build is a one-shot
    job of `services`."""

    def __init__(self, node: BuildHost, services: Supervisor) -> None:
        self.node = node
        self._services = services
        self._builds: OrderedDict[str, Build] = OrderedDict()

    # -- registry --------------------------------------------------------------

    def get(self, template_id: str, build_id: str) -> Build:
        b = self._builds.get(build_id)
        if b is None or template_id not in (b.template_id, b.name):
            raise BuildNotFound(f"build {build_id!r} of template {template_id!r} not found")
        return b

    def of_template(self, template_id: str) -> list[Build]:
        return [b for b in self._builds.values() if b.template_id == template_id]

    async def request(self, name: str, *, cpu_count: int, memory_mb: int) -> Build:
        """Reserve a build of template `name` (raises BuildConflict, InvalidName)."""
        check_name(name, "template name")
        try:
            existing = await trio.to_thread.run_sync(self.node.templates.resolve, name)
        except TemplateNotFound:
            existing = None
        template_id: str | None = None
        if existing is not None:
            if existing.snapshot_id is None:
                raise BuildConflict(
                    f"template {name!r} exists and was not made by a build: "
                    "delete it or choose another name"
                )
            template_id = existing.template_id
            name = existing.aliases[0] if existing.aliases else name
        else:  # no await from here on: a concurrent request sees this build
            for b in reversed(self._builds.values()):
                if b.name == name:
                    template_id = b.template_id
                    break
        build = Build(
            template_id=template_id or new_template_id(),
            build_id=str(uuid.uuid4()),
            name=name,
            cpu_count=cpu_count,
            memory_mb=memory_mb,
        )
        self._builds[build.build_id] = build
        self._trim()
        return build

    def _trim(self) -> None:
        finished = [k for k, b in self._builds.items() if b.finished]
        for k in finished[: max(0, len(finished) - MAX_FINISHED_BUILDS)]:
            del self._builds[k]

    def start(self, build: Build, spec: BuildSpec) -> None:
        if build.status != "waiting":
            raise BuildConflict(f"build {build.build_id} was already started ({build.status})")
        if spec.from_template in (build.template_id, build.name):
            raise BuildConflict("a template cannot be built from itself")
        build.status = "building"

        async def run(_stop: StopToken) -> None:
            await self._run(build, spec)

        self._services.start_soon(
            f"build {build.build_id}",
            run,
            policy=ONE_SHOT,
            strategy=Strategy.FAIL,
            give_up=Strategy.FAIL,
            grace_s=0.0,  # a node stop cancels it: recorded "cancelled"
        )

    async def backing(self, snapshot_id: str) -> Template | None:
        """The template whose sandboxes restore `snapshot_id`, if any."""
        return await trio.to_thread.run_sync(self.node.templates.backing, snapshot_id)

    async def forget_template(self, template: Template) -> None:
        """After `template` was deleted: remove the snapshot it was restored from."""
        if template.snapshot_id is not None:
            await self.node.snapshots.delete(template.snapshot_id)
            await self.node.collect_layers()

    # -- one build -----------------------------------------------------------

    async def _run(self, build: Build, spec: BuildSpec) -> None:
        actor: SandboxActor | None = None
        snapshot_id: str | None = None
        done = False
        step = "base"
        try:
            for i, s in enumerate(spec.steps, 1):
                if s.type == "COPY":
                    raise StepFailed(str(i), f"step {i} (COPY): COPY is not supported yet")
            base = await self._base(build, spec)
            state = _State(env={}, workdir=base.default_workdir, user=base.default_user)
            build.log(f"starting a build sandbox from {base.template_id}", step=step)
            actor = await self.node.create(
                NewSandbox(
                    template=base.template_id,
                    timeout_s=BUILD_SANDBOX_TIMEOUT_S,
                    metadata={"aenv.build": build.build_id},
                    cpu_count=build.cpu_count,
                    memory_mb=build.memory_mb,
                )
            )
            for i, s in enumerate(spec.steps, 1):
                step = str(i)
                await self._step(build, actor, state, step, s)
            step = "finalize"
            if spec.start_cmd or spec.ready_cmd:
                await self._start(build, actor, state, spec)
            build.log("capturing the sandbox (memory and filesystem)", step=step)
            doc = await self.node.snapshot(actor, None, memory=True, wait_s=SNAPSHOT_TIMEOUT_S)
            snapshot_id = str(doc["snapshotID"])
            env = {**base.env_map, **state.env}
            template, replaced = await trio.to_thread.run_sync(
                functools.partial(
                    self.node.templates.put_built,
                    template_id=build.template_id,
                    build_id=build.build_id,
                    aliases=(build.name,),
                    base=base,
                    snapshot_id=snapshot_id,
                    env=[f"{k}={v}" for k, v in env.items()],
                    workdir=state.workdir,
                    user=state.user,
                    cpu_count=build.cpu_count,
                    memory_mb=build.memory_mb,
                    start_cmd=spec.start_cmd,
                    ready_cmd=spec.ready_cmd,
                )
            )
            done = True
            self.node.durable.share_template(template)
            if replaced not in (None, snapshot_id) and await self.backing(str(replaced)) is None:
                await self.node.snapshots.delete(str(replaced))
            build.log(f"template {template.template_id} ready", step=step)
            build.status = "ready"
        except StepFailed as exc:
            self._fail(build, exc.step, exc.message)
        except Exception as exc:
            log.exception("build %s of %s failed", build.build_id, build.template_id)
            self._fail(build, step, f"step {step} failed: {exc}")
        finally:
            build.finished_at = time.time()
            if build.status == "building":  # cancelled (node shutting down)
                build.status, build.reason, build.reason_step = "error", "cancelled", step
            build.done.set()
            with trio.CancelScope(shield=True):
                if actor is not None:
                    await actor.stop()
                if snapshot_id is not None and not done:
                    with contextlib.suppress(Exception):
                        await self.node.snapshots.delete(snapshot_id)
                with trio.move_on_after(30):
                    await self.node.collect_layers()

    def _fail(self, build: Build, step: str, message: str) -> None:
        build.log(message, level="error", step=step)
        build.status, build.reason, build.reason_step = "error", message, step

    async def _base(self, build: Build, spec: BuildSpec) -> Template:
        try:
            if spec.from_template is not None:
                build.log(f"using template {spec.from_template}", step="base")
                return await self.node.resolve_template(spec.from_template)
            assert spec.from_image is not None
            build.log(f"pulling {spec.from_image}", step="base")
            record = await self.node.images.pull(spec.from_image)
            build.log(f"pulled {record.reference} ({record.key[:12]})", step="base")
            template = await trio.to_thread.run_sync(self.node.image_template, record)
            await self.node.images.prepare(record.key)
            return template
        except (TemplateNotFound, InvalidName):
            raise StepFailed("base", f"base template {spec.from_template!r} not found") from None
        except Exception as exc:
            raise StepFailed("base", f"base image: {exc}") from None

    async def _step(
        self, build: Build, actor: SandboxActor, state: _State, step: str, s: Step
    ) -> None:
        args = s.args
        build.log(f"[{step}] {s.type} {' '.join(args)}".rstrip(), step=step)
        what = f"step {step} ({s.type})"
        if s.type == "ENV":
            if len(args) % 2:
                raise StepFailed(step, f"{what}: arguments must be key/value pairs")
            for k, v in zip(args[::2], args[1::2], strict=True):
                state.env[k] = v
        elif s.type == "WORKDIR":
            if len(args) != 1 or not args[0]:
                raise StepFailed(step, f"{what}: needs one path")
            path = posixpath.normpath(posixpath.join(state.workdir, args[0]))
            await self._exec(build, actor, state, step, f"mkdir -p -- {shlex.quote(path)}", "root")
            state.workdir = path
        elif s.type == "USER":
            if len(args) != 1 or not args[0]:
                raise StepFailed(step, f"{what}: needs one user name")
            user = args[0].partition(":")[0]
            await self._exec(build, actor, state, step, ":", user, quiet=True)
            state.user = user
        elif s.type == "RUN":
            if not 1 <= len(args) <= 2 or not args[0]:
                raise StepFailed(step, f"{what}: needs a command and optionally a user")
            user = args[1] if len(args) == 2 and args[1] else state.user
            await self._exec(build, actor, state, step, args[0], user)
        else:
            raise StepFailed(step, f"{what}: unknown step type")

    async def _exec(
        self,
        build: Build,
        actor: SandboxActor,
        state: _State,
        step: str,
        cmd: str,
        user: str,
        *,
        quiet: bool = False,
    ) -> None:
        def out(stream: str, line: str) -> None:
            if not quiet:
                build.log(line, step=step)

        try:
            code, status = await run_in_sandbox(
                actor, cmd, user=user, envs=state.env, cwd=state.workdir, on_output=out
            )
        except cn.ConnectError as exc:
            raise StepFailed(
                step, f"step {step} could not run as {user!r}: {exc.message}"
            ) from None
        if code != 0:
            detail = f"exit code {code}" if code >= 0 else status
            raise StepFailed(step, f"step {step} failed: {cmd!r} ended with {detail}")

    async def _start(
        self, build: Build, actor: SandboxActor, state: _State, spec: BuildSpec
    ) -> None:
        """Start the start command in the background; wait until the ready command passes."""
        step = "finalize"
        ended: list[tuple[int, str]] = []

        async def start_cmd(cmd: str, task_status: trio.TaskStatus[None]) -> None:
            # never raises: with strict exception groups a failure is recorded instead
            started = False

            def on_start(_pid: int) -> None:
                nonlocal started
                started = True
                task_status.started()

            try:
                ended.append(
                    await run_in_sandbox(
                        actor,
                        cmd,
                        user=state.user,
                        envs=state.env,
                        cwd=state.workdir,
                        on_output=lambda _s, line: build.log(line, step=step),
                        on_start=on_start,
                    )
                )
            except cn.ConnectError as exc:
                ended.append((-1, f"an error: {exc.message}"))
            except (httpx.HTTPError, DecodeError, RuntimeError) as exc:
                ended.append((-1, f"an error: {exc}"))
            if not started:
                task_status.started()

        failed: list[StepFailed] = []
        async with trio.open_nursery() as nursery:
            if spec.start_cmd:
                build.log(f"start command: {spec.start_cmd}", step=step)
                await nursery.start(start_cmd, spec.start_cmd)
            try:
                await self._wait_ready(build, actor, state, spec, ended)
            except StepFailed as exc:
                failed.append(exc)
            # detach: the process runs on without a client (envd drops its output)
            nursery.cancel_scope.cancel()
        if failed:
            raise failed[0]

    async def _wait_ready(
        self,
        build: Build,
        actor: SandboxActor,
        state: _State,
        spec: BuildSpec,
        ended: list[tuple[int, str]],
    ) -> None:
        step = "finalize"

        def check_start() -> None:
            if ended and ended[0][0] != 0:
                code, status = ended[0]
                detail = f"exit code {code}" if code >= 0 else status
                raise StepFailed(step, f"the start command ended with {detail}")

        if not spec.ready_cmd:
            await trio.sleep(DEFAULT_READY_WAIT_S)
            check_start()
            return
        build.log(f"waiting for the ready command: {spec.ready_cmd}", step=step)
        last: list[str] = []
        with trio.move_on_after(READY_TIMEOUT_S):
            while True:
                check_start()
                last.clear()
                try:
                    code, _ = await run_in_sandbox(
                        actor,
                        spec.ready_cmd,
                        user=state.user,
                        envs=state.env,
                        cwd=state.workdir,
                        on_output=lambda _s, line: last.append(line),
                    )
                except cn.ConnectError as exc:
                    raise StepFailed(
                        step, f"the ready command could not run: {exc.message}"
                    ) from None
                if code == 0:
                    check_start()
                    build.log("ready", step=step)
                    return
                await trio.sleep(READY_POLL_S)
        tail = f": {last[-1]}" if last else ""
        raise StepFailed(
            step, f"the ready command did not succeed within {READY_TIMEOUT_S:g} s{tail}"
        )
