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
COPY puts an uploaded archive's files in place (`aenv.node.buildfiles`,
`aenv.node.buildcopy`). A base image name that is a template of this node
(`FROM base`) builds on that template. Unchanged steps are not run again
(`aenv.node.buildcache`): the logs say which were cached.
Build records live in memory: a node restart forgets builds, not templates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import posixpath
import shlex
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import trio

from aenv.config import Config
from aenv.images.service import Images
from aenv.images.store import ImageRecord
from aenv.kit.supervisor import ONE_SHOT, StopToken, Strategy, Supervisor
from aenv.node.buildcache import FILE_STEPS, BuildCache, CachedStep, chain, final_key
from aenv.node.buildcopy import CopyError, copy_into
from aenv.node.buildfiles import BuildFiles
from aenv.node.buildtags import DEFAULT_TAG, TagNotFound, TagStore
from aenv.node.guest import MAX_LINE, run_in_sandbox
from aenv.node.sandbox import SandboxActor
from aenv.node.snapshots import Snapshots
from aenv.proto import connect as cn
from aenv.proto.ids import InvalidName, check_name
from aenv.proto.pb import DecodeError
from aenv.proto.requests import NewSandbox
from aenv.storage.layers import LayerStore
from aenv.storage.templates import Template, TemplateNotFound, TemplateStore, new_template_id

log = logging.getLogger("aenv.builds")

BUILD_SANDBOX_TIMEOUT_S = 3600
READY_TIMEOUT_S = 120.0
READY_POLL_S = 0.5
DEFAULT_READY_WAIT_S = 1.0
SNAPSHOT_TIMEOUT_S = 600.0
MAX_LOG_ENTRIES = 20_000
MAX_FINISHED_BUILDS = 200
STEP_TYPES = frozenset({"RUN", "ENV", "WORKDIR", "USER", "COPY"})
# E2B's default user: every E2B template has it, and the SDKs end a
# Dockerfile's steps with `USER user`; a build from an image that lacks it
# creates it (home /home/user), as E2B's own template builds do.
E2B_USER = "user"
_ENSURE_E2B_USER = (
    "id -u user >/dev/null 2>&1 || {"
    " uid=$(awk -F: 'BEGIN {m = 999} $3 > m && $3 < 60000 {m = $3} END {print m + 1}'"
    " /etc/passwd);"
    " useradd -m -u $uid -s /bin/sh user 2>/dev/null"
    " || adduser -D -u $uid -h /home/user -s /bin/sh user 2>/dev/null"
    ' || { echo "user:x:$uid:$uid::/home/user:/bin/sh" >> /etc/passwd'
    ' && echo "user:x:$uid:" >> /etc/group && mkdir -p /home/user'
    " && chown $uid:$uid /home/user; }; }"
)


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
    files_hash: str | None = None  # COPY: the uploaded archive's
    force: bool = False  # run it (and what follows) even if cached


@dataclass(frozen=True, kw_only=True)
class BuildSpec:
    """What `POST /v2/templates/{id}/builds/{build}` asks for (validated)."""

    from_image: str | None = None
    from_template: str | None = None
    steps: tuple[Step, ...] = ()
    start_cmd: str | None = None
    ready_cmd: str | None = None
    force: bool = False  # use no cached step


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
    # its template's sandboxes' disk size (MiB); None: the node's
    disk_mb: int | None = None
    tags: tuple[str, ...] = (DEFAULT_TAG,)
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


class BuildHost(Protocol):
    """What a build needs of the node (which is one): its stores and a few of its calls."""

    config: Config
    api_key: str
    layers: LayerStore
    templates: TemplateStore
    snapshots: Snapshots
    images: Images
    durable: Sharing

    async def create(self, req: NewSandbox) -> SandboxActor: ...

    async def create_from_snapshot(
        self, doc: dict[str, Any], req: NewSandbox, *, template: Template | None = None
    ) -> SandboxActor: ...

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
        self.files = BuildFiles(node.config.home / "build-files", node.api_key.encode())
        self.cache = BuildCache(node.snapshots)
        self.tags = TagStore(node.config.home / "build-tags")
        self._specs: dict[Build, BuildSpec] = {}  # started builds, until they end

    # -- registry --------------------------------------------------------------

    def get(self, template_id: str, build_id: str) -> Build:
        b = self._builds.get(build_id)
        if b is None or template_id not in (b.template_id, b.name):
            raise BuildNotFound(f"build {build_id!r} of template {template_id!r} not found")
        return b

    def of_template(self, template_id: str) -> list[Build]:
        return [b for b in self._builds.values() if b.template_id == template_id]

    async def request(
        self,
        name: str,
        *,
        cpu_count: int,
        memory_mb: int,
        disk_mb: int | None = None,
        tags: tuple[str, ...] = (DEFAULT_TAG,),
    ) -> Build:
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
            disk_mb=disk_mb,
            tags=tags,
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
        self._specs[build] = spec

        async def run(_stop: StopToken) -> None:
            try:
                await self._run(build, spec)
            finally:
                self._specs.pop(build, None)

        self._services.start_soon(
            f"build {build.build_id}",
            run,
            policy=ONE_SHOT,
            strategy=Strategy.FAIL,
            give_up=Strategy.FAIL,
            grace_s=0.0,  # a node stop cancels it: recorded "cancelled"
        )

    async def backing(self, snapshot_id: str) -> Template | None:
        """The template whose sandboxes restore `snapshot_id` (as its current
        build, found by the index, or a tagged one), if any."""
        found = await trio.to_thread.run_sync(self.node.templates.backing, snapshot_id)
        if found is not None:
            return found
        for t in await trio.to_thread.run_sync(self.node.templates.list):
            if snapshot_id in await trio.to_thread.run_sync(self.tags.snapshots, t.template_id):
                return t
        return None

    async def tagged(self, name: str) -> Template | None:
        """The build `name:tag` names (a tag or a build ID); None if `name` is no
        template of this node. Raises TemplateNotFound for an unknown tag."""
        base, _, tag = name.rpartition(":")
        try:
            current = await trio.to_thread.run_sync(self.node.templates.resolve, base)
        except (TemplateNotFound, InvalidName):
            return None
        if current.snapshot_id is None:  # not built: `busybox:1.36` stays an image
            return None
        try:
            return await trio.to_thread.run_sync(self.tags.resolve, current, tag.lower())
        except TagNotFound:
            raise TemplateNotFound(f"template {name!r} not found (no such tag)") from None

    async def drop_snapshots(self, snapshot_ids: set[str] | list[str], *, keep: str | None) -> None:
        """Delete snapshots a rebuild or a tag change left unused."""
        for snap in set(snapshot_ids) - {keep}:
            if await self.backing(snap) is None:
                with contextlib.suppress(Exception):
                    await self.node.snapshots.delete(snap)

    async def forget_cache(self, template: Template) -> None:
        """Before `template` is deleted: drop the cached build steps made for it
        or standing on it."""
        await self.cache.forget(template.template_id)

    async def forget_template(self, template: Template) -> None:
        """After `template` was deleted: remove the snapshot it was restored from."""
        held = await trio.to_thread.run_sync(self.tags.drop, template.template_id)
        for snap in held | ({template.snapshot_id} if template.snapshot_id else set()):
            with contextlib.suppress(Exception):
                await self.node.snapshots.delete(snap)
        await self.node.collect_layers()

    # -- one build -----------------------------------------------------------

    async def _run(self, build: Build, spec: BuildSpec) -> None:
        actor: SandboxActor | None = None
        snapshot_id: str | None = None
        done = False
        step = "base"
        try:
            for i, s in enumerate(spec.steps, 1):
                if s.type == "COPY" and (s.files_hash is None or len(s.args) < 2):
                    raise StepFailed(
                        str(i), f"step {i} (COPY): needs a source, a destination and a files hash"
                    )
                if s.type == "COPY" and not self.files.present(s.files_hash or ""):
                    raise StepFailed(
                        str(i), f"step {i} (COPY): the files of {s.args[0]!r} were not uploaded"
                    )
            base, base_key = await self._base(build, spec)
            state = _State(env={}, workdir=base.default_workdir, user=base.default_user)
            keys: list[str] = []
            key = base_key
            for s in spec.steps:
                key = chain(key, s.type, s.args, s.files_hash)
                keys.append(key)
            done_upto, cached = await self._cached_prefix(build, spec, keys)
            if cached is not None:
                state = _State(env=dict(cached.env), workdir=cached.workdir, user=cached.user)
            last = keys[-1] if keys else base_key
            fkey = final_key(
                last,
                template_id=build.template_id,
                start_cmd=spec.start_cmd,
                ready_cmd=spec.ready_cmd,
                cpu_count=build.cpu_count,
                memory_mb=build.memory_mb,
            )
            rest = spec.steps[done_upto:]
            if not spec.force and all(s.type in ("ENV", "USER") and not s.force for s in rest):
                final = await self._cached_final(build, fkey)
                if final is not None:
                    for i, s in enumerate(rest, done_upto + 1):
                        self._replay(build, state, str(i), s)
                    snapshot_id = final
                    step = "finalize"
                    build.log("[finalize] CACHED", step=step)
                    await self._record(build, spec, base, state, snapshot_id, fkey)
                    done = True
                    return
            req = NewSandbox(
                # a built base by its build: a tagged one need not be the current
                template=f"{base.template_id}:{base.build_id}"
                if base.snapshot_id is not None
                else base.template_id,
                timeout_s=BUILD_SANDBOX_TIMEOUT_S,
                metadata={"aenv.build": build.build_id},
                cpu_count=build.cpu_count,
                memory_mb=build.memory_mb,
            )
            if cached is not None:
                build.log(f"starting a build sandbox from cached step {done_upto}", step=step)
                actor = await self.node.create_from_snapshot(cached.snapshot, req, template=base)
            else:
                build.log(f"starting a build sandbox from {base.template_id}", step=step)
                actor = await self.node.create(req)
            for i, s in enumerate(rest, done_upto + 1):
                step = str(i)
                await self._step(build, actor, state, step, s)
                if s.type in FILE_STEPS:
                    await self._remember(build, actor, state, keys[i - 1])
            step = "finalize"
            if spec.start_cmd or spec.ready_cmd:
                await self._start(build, actor, state, spec)
            build.log("capturing the sandbox (memory and filesystem)", step=step)
            doc = await self.node.snapshot(actor, None, memory=True, wait_s=SNAPSHOT_TIMEOUT_S)
            snapshot_id = str(doc["snapshotID"])
            await self._record(build, spec, base, state, snapshot_id, fkey)
            done = True
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
                    with contextlib.suppress(Exception):
                        await self.cache.trim()
                    in_use = frozenset(
                        st.files_hash
                        for b, sp in self._specs.items()
                        if not b.finished
                        for st in sp.steps
                        if st.files_hash
                    )
                    with contextlib.suppress(Exception):
                        await trio.to_thread.run_sync(
                            functools.partial(self.files.trim, keep=in_use)
                        )
                    await self.node.collect_layers()

    async def _record(
        self,
        build: Build,
        spec: BuildSpec,
        base: Template,
        state: _State,
        snapshot_id: str,
        fkey: str,
    ) -> None:
        """Make the template point at `snapshot_id` (made from final key `fkey`)."""
        await self.node.snapshots.update(snapshot_id, buildKey=fkey)
        env = [f"{k}={v}" for k, v in {**base.env_map, **state.env}.items()]
        tags = list(build.tags)
        exists = True
        try:
            current = await trio.to_thread.run_sync(self.node.templates.resolve, build.template_id)
        except TemplateNotFound:
            exists = False
        replaced: str | None = None
        if not exists or await trio.to_thread.run_sync(
            self.tags.default_moves, build.template_id, tags
        ):
            template, replaced = await trio.to_thread.run_sync(
                functools.partial(
                    self.node.templates.put_built,
                    template_id=build.template_id,
                    build_id=build.build_id,
                    aliases=(build.name,),
                    base=base,
                    snapshot_id=snapshot_id,
                    env=env,
                    workdir=state.workdir,
                    user=state.user,
                    cpu_count=build.cpu_count,
                    memory_mb=build.memory_mb,
                    start_cmd=spec.start_cmd,
                    ready_cmd=spec.ready_cmd,
                    sandbox_disk_mb=build.disk_mb,
                )
            )
            current = template
            self.node.durable.share_template(template)
        else:  # a tagged build that does not move the default tag
            template = dataclasses.replace(
                current,
                build_id=build.build_id,
                snapshot_id=snapshot_id,
                rootfs=base.rootfs,
                image_key=base.image_key,
                image_ref=base.image_ref,
                disk_size_mb=base.disk_size_mb,
                env=tuple(env),
                workdir=state.workdir or None,
                user=state.user or None,
                start_cmd=spec.start_cmd,
                ready_cmd=spec.ready_cmd,
                cpu_count=build.cpu_count,
                memory_mb=build.memory_mb,
                sandbox_disk_mb=build.disk_mb,
                updated_at=time.time(),
            )
        gone = await trio.to_thread.run_sync(
            functools.partial(self.tags.record, template, tags, current=current.build_id)
        )
        await self.drop_snapshots([*gone, *([replaced] if replaced else [])], keep=snapshot_id)
        build.log(f"template {template.template_id} ready", step="finalize")
        build.status = "ready"

    async def _cached_prefix(
        self, build: Build, spec: BuildSpec, keys: list[str]
    ) -> tuple[int, CachedStep | None]:
        """How many leading steps a cached entry covers, and that entry; logs them."""
        if spec.force:
            return 0, None
        limit = next((i for i, s in enumerate(spec.steps) if s.force), len(spec.steps))
        for i in range(limit - 1, -1, -1):
            if spec.steps[i].type not in FILE_STEPS:
                continue
            hit = await self.cache.lookup(keys[i])
            if hit is None:
                continue
            local = await trio.to_thread.run_sync(
                self.node.snapshots.local_gaps, hit.snapshot, self.node.layers.layers_dir
            )
            if local:
                continue
            for j, s in enumerate(spec.steps[: i + 1], 1):
                build.log(f"[{j}] CACHED {s.type} {' '.join(s.args)}".rstrip(), step=str(j))
            return i + 1, hit
        return 0, None

    async def _cached_final(self, build: Build, fkey: str) -> str | None:
        """The template's current snapshot if it was made from final key `fkey`."""
        try:
            current = await trio.to_thread.run_sync(self.node.templates.resolve, build.template_id)
        except (TemplateNotFound, InvalidName):
            return None
        if current.snapshot_id is None:
            return None
        doc = await self.node.snapshots.resolve(current.snapshot_id)
        if doc is None or doc.get("buildKey") != fkey:
            return None
        return current.snapshot_id

    def _replay(self, build: Build, state: _State, step: str, s: Step) -> None:
        """Apply a state-only step (ENV, USER) without a sandbox."""
        build.log(f"[{step}] CACHED {s.type} {' '.join(s.args)}".rstrip(), step=step)
        if s.type == "ENV":
            for k, v in zip(s.args[::2], s.args[1::2], strict=False):
                state.env[k] = v
        elif s.type == "USER" and s.args:
            state.user = s.args[0].partition(":")[0]

    async def _remember(self, build: Build, actor: SandboxActor, state: _State, key: str) -> None:
        """Capture the build sandbox's files as the cache entry of `key`."""
        doc = await self.node.snapshot(
            actor, self.cache.name(key), memory=False, wait_s=SNAPSHOT_TIMEOUT_S
        )
        await self.cache.stamp(
            str(doc["snapshotID"]),
            env=dict(state.env),
            workdir=state.workdir,
            user=state.user,
            built_for=build.template_id,
        )

    def _fail(self, build: Build, step: str, message: str) -> None:
        build.log(message, level="error", step=step)
        build.status, build.reason, build.reason_step = "error", message, step

    async def _base(self, build: Build, spec: BuildSpec) -> tuple[Template, str]:
        """The template the build starts from and its cache key. A base image
        that is a bare name of one of this node's templates is that template."""
        name = spec.from_template
        image = spec.from_image
        if name is None and image is not None and not any(c in image for c in "/@"):
            with contextlib.suppress(TemplateNotFound, InvalidName):
                if ":" not in image:
                    await trio.to_thread.run_sync(self.node.templates.resolve, image)
                    name = image
                elif await self.tagged(image) is not None:  # `FROM app:v1`, a built one
                    name = image
        try:
            if name is not None:
                build.log(f"using template {name}", step="base")
                t = await self.node.resolve_template(name)
                return t, chain("template", t.template_id, t.build_id)
            assert spec.from_image is not None
            build.log(f"pulling {spec.from_image}", step="base")
            record = await self.node.images.pull(spec.from_image)
            build.log(f"pulled {record.reference} ({record.key[:12]})", step="base")
            template = await trio.to_thread.run_sync(self.node.image_template, record)
            await self.node.images.prepare(record.key)
            return template, chain("image", record.key)
        except (TemplateNotFound, InvalidName):
            raise StepFailed("base", f"base template {name!r} not found") from None
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
            if user == E2B_USER:  # E2B's templates all have it; an image may not
                await self._exec(build, actor, state, step, _ENSURE_E2B_USER, "root", quiet=True)
            await self._exec(build, actor, state, step, ":", user, quiet=True)
            state.user = user
        elif s.type == "RUN":
            if not 1 <= len(args) <= 2 or not args[0]:
                raise StepFailed(step, f"{what}: needs a command and optionally a user")
            user = args[1] if len(args) == 2 and args[1] else state.user
            await self._exec(build, actor, state, step, args[0], user)
        elif s.type == "COPY":
            await self._copy(build, actor, state, step, s)
        else:
            raise StepFailed(step, f"{what}: unknown step type")

    async def _copy(
        self, build: Build, actor: SandboxActor, state: _State, step: str, s: Step
    ) -> None:
        src, dest = s.args[0], s.args[1]
        owner = s.args[2] if len(s.args) > 2 and s.args[2] else None
        mode: int | None = None
        if len(s.args) > 3 and s.args[3]:
            try:
                mode = int(s.args[3], 8)
            except ValueError:
                raise StepFailed(step, f"step {step} (COPY): invalid mode {s.args[3]!r}") from None
        archive: Path = self.files.path(s.files_hash or "")
        await trio.to_thread.run_sync(self.files.touch, s.files_hash or "")
        try:
            cmd = await copy_into(actor, archive, [(src, dest, owner, mode)], workdir=state.workdir)
        except CopyError as exc:
            raise StepFailed(step, f"step {step} (COPY): {exc}") from None
        await self._exec(build, actor, state, step, cmd, "root")

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
