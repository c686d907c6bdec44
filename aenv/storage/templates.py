"""Template store: named, read-only root filesystems that sandboxes start from.

Each template lives in `<root>/<template_id>/` as a `rootfs/` directory (the
read-only lower layer of every sandbox's overlay) and a `template.json` with
its metadata. Names from callers are validated with `check_name` before they
touch the filesystem, and paths are always derived from the validated ID,
never read from metadata. A template appears atomically: it is assembled in a
hidden staging directory and renamed into place; deletion renames it away
before removing it. Aliases are indexed in `<root>/.aliases/` (one symlink
per alias, naming its template's ID), so resolving a name reads at most
two templates however many there are. A built template (`put_built`) has no root filesystem
of its own: it names the snapshot its sandboxes are restored from, over its
base's root filesystem, and a rebuild rewrites its `template.json` in place.
A corrupt `template.json` is logged and skipped. The
methods do blocking filesystem work: call them from a worker thread
(`trio.to_thread.run_sync`) on the node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import heapq
import json
import logging
import os
import secrets
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from aenv.kit.files import fsync_dir, write_atomic
from aenv.proto.envd_schema import ENVD_VERSION
from aenv.proto.ids import NAME_RE, InvalidName, check_name

log = logging.getLogger(__name__)

METADATA_FILE = "template.json"
# how many names `TemplateStore.resolve` remembers (then it starts over)
_RESOLVED_MAX = 1024
_Stat = tuple[int, int, int] | None
_Seen = tuple[_Stat, _Stat, str | None, _Stat]
# `<root>/.share-pending/<template id>` while a template is still to be put in
# the object store (aenv.node.durable): a node that stops before the share
# finishes resumes it. Homes from before kept it in the template's directory as
# SHARE_PENDING_FILE; the index build moves it.
SHARE_PENDING_DIR = ".share-pending"
SHARE_PENDING_FILE = "share-pending"
# In a default template's directory: the digest of its root filesystem's layer
# index (aenv.storage.snapstore.defaults), its content identity, computed once.
ROOTFS_INDEX_FILE = "rootfs-index"
ROOTFS_DIR = "rootfs"
METADATA_VERSION = 1
# Version of the envd API reported for templates until envd states its own.
# Templates installed by `aenv.storage.rootfs.ensure_default_templates`.
DEFAULT_TEMPLATE_IDS = frozenset({"base", "busybox", "code-interpreter-v1"})
_ID_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
_LOCK_FILE = ".lock"
_STAGING_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
# `<root>/.aliases/<alias>`: a symlink whose target is the ID of the template
# with that alias, so resolving an alias reads one template, not all of them.
ALIASES_DIR = ".aliases"
_ALIASES_COMPLETE = ".complete"  # in ALIASES_DIR once it holds every alias
# `<root>/.aliases/.snapshots/<snapshot id>`: a symlink naming the built template
# whose sandboxes restore that snapshot (built and swapped with the aliases).
_SNAPSHOTS_SUBDIR = ".snapshots"
_T = TypeVar("_T")
# `names` lists the directories again after this long even if their stamps say
# nothing changed (a change within a timestamp's granularity)
_NAMES_KEPT_S = 60.0


class TemplateNotFound(LookupError):
    """No template has this ID or alias."""


class TemplateConflict(ValueError):
    """A template ID or alias is already taken."""


def new_template_id() -> str:
    """A fresh template ID: 20 random lowercase base36 characters, like E2B's."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True, kw_only=True)
class Template:
    template_id: str
    build_id: str
    aliases: tuple[str, ...]
    rootfs: Path
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    created_at: float
    updated_at: float
    public: bool = True
    start_cmd: str | None = None
    ready_cmd: str | None = None
    # Image templates: the pulled image's key (its tree is `rootfs`, served
    # lazily on the image mount), the reference it came from, and what the
    # image config asks of processes (Env, WorkingDir, User).
    image_key: str | None = None
    image_ref: str | None = None
    env: tuple[str, ...] = ()
    workdir: str | None = None
    user: str | None = None
    # Built templates (`aenv.node.builds`): the persistent snapshot (layers
    # and memory) their sandboxes are restored from; env, workdir and user
    # are then the build's, for image and directory bases alike.
    snapshot_id: str | None = None
    # The disk size of its sandboxes in MiB, where the template sets one
    # (a build's `diskSizeMB`); None: the node's (`AENV_SANDBOX_DISK_MB`).
    sandbox_disk_mb: int | None = None

    @property
    def default_user(self) -> str:
        """Who commands run as: the template's (or image config's) User; else
        "user" for E2B templates, root for images."""
        if self.user:
            return self.user.partition(":")[0] or "root"
        return "user" if self.image_key is None else "root"

    @property
    def default_workdir(self) -> str:
        """Where commands start: the template's WorkingDir; else the E2B home, or
        "/" for images (as `docker run` does)."""
        if self.workdir:
            return self.workdir
        return "/home/user" if self.image_key is None else "/"

    @property
    def env_map(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for item in self.env:
            key, _, value = item.partition("=")
            if key:
                out[key] = value
        return out

    def to_api(
        self,
        *,
        envd_version: str = ENVD_VERSION,
        spawn_count: int = 0,
        last_spawned_at: float | None = None,
    ) -> dict[str, object]:
        """The E2B `Template` JSON object (as listed by `GET /templates`)."""
        return {
            "templateID": self.template_id,
            "buildID": self.build_id,
            "cpuCount": self.cpu_count,
            "memoryMB": self.memory_mb,
            "diskSizeMB": self.disk_size_mb,
            "public": self.public,
            "aliases": list(self.aliases),
            "names": list(self.aliases),
            "createdAt": _iso(self.created_at),
            "updatedAt": _iso(self.updated_at),
            "createdBy": None,
            "lastSpawnedAt": None if last_spawned_at is None else _iso(last_spawned_at),
            "spawnCount": spawn_count,
            "buildCount": 1,
            "envdVersion": envd_version,
            "buildStatus": "ready",
            "isDefault": self.template_id in DEFAULT_TEMPLATE_IDS,
        }

    def to_json(self) -> dict[str, object]:
        return {
            "version": METADATA_VERSION,
            "templateID": self.template_id,
            "buildID": self.build_id,
            "aliases": list(self.aliases),
            "cpuCount": self.cpu_count,
            "memoryMB": self.memory_mb,
            "diskSizeMB": self.disk_size_mb,
            "sandboxDiskMB": self.sandbox_disk_mb,
            "createdAt": self.created_at,
            "updatedAt": self.updated_at,
            "public": self.public,
            "startCmd": self.start_cmd,
            "readyCmd": self.ready_cmd,
            "image": None
            if self.image_key is None
            else {
                "key": self.image_key,
                "ref": self.image_ref,
                "env": list(self.env),
                "workdir": self.workdir,
                "user": self.user,
            },
            "build": None
            if self.snapshot_id is None
            else {
                "snapshotID": self.snapshot_id,
                # a directory base: whose rootfs the snapshot's layers lie over
                "rootfsOf": None if self.image_key is not None else self.rootfs.parent.name,
                "env": list(self.env),
                "workdir": self.workdir,
                "user": self.user,
            },
        }


class _Corrupt(ValueError):
    pass


def _field(data: dict[str, object], key: str, kind: type[_T]) -> _T:
    value = data.get(key)
    # bool is an int subclass: never accept it where a number is expected.
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise _Corrupt(f"{key!r} is not a {kind.__name__}")
    return value


def _optional_str(data: dict[str, object], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise _Corrupt(f"{key!r} is not a string")
    return value


def _parse_image(data: dict[str, object]) -> dict[str, object]:
    image = data.get("image")
    if image is None:
        return {}
    if not isinstance(image, dict):
        raise _Corrupt("'image' is not an object")
    key = _field(image, "key", str)
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise _Corrupt("'image.key' is not a sha256 hex digest")
    env = image.get("env") or []
    if not isinstance(env, list) or not all(isinstance(e, str) for e in env):
        raise _Corrupt("'image.env' is not a list of strings")
    return {
        "image_key": key,
        "image_ref": _optional_str(image, "ref"),
        "env": tuple(env),
        "workdir": _optional_str(image, "workdir"),
        "user": _optional_str(image, "user"),
    }


def _parse_build(data: dict[str, object]) -> dict[str, object]:
    build = data.get("build")
    if build is None:
        return {}
    if not isinstance(build, dict):
        raise _Corrupt("'build' is not an object")
    env = build.get("env") or []
    if not isinstance(env, list) or not all(isinstance(e, str) for e in env):
        raise _Corrupt("'build.env' is not a list of strings")
    rootfs_of = _optional_str(build, "rootfsOf")
    try:
        check_name(_field(build, "snapshotID", str), "snapshot ID")
        if rootfs_of is not None:
            check_name(rootfs_of, "template ID")
    except InvalidName as exc:
        raise _Corrupt(str(exc)) from None
    return {
        "snapshot_id": build["snapshotID"],
        "rootfs_of": rootfs_of,
        "env": tuple(env),
        "workdir": _optional_str(build, "workdir"),
        "user": _optional_str(build, "user"),
    }


def _parse(
    template_id: str, template_dir: Path, raw: bytes, image_root: Path | None = None
) -> Template:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _Corrupt(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _Corrupt("not a JSON object")
    if data.get("version") != METADATA_VERSION:
        raise _Corrupt(f"unknown version {data.get('version')!r}")
    if _field(data, "templateID", str) != template_id:
        raise _Corrupt("templateID does not match its directory")
    aliases = _field(data, "aliases", list)
    try:
        checked = tuple(check_name(a, "alias") for a in aliases)
    except InvalidName as exc:
        raise _Corrupt(str(exc)) from None
    numbers = {k: _field(data, k, int) for k in ("cpuCount", "memoryMB", "diskSizeMB")}
    if numbers["cpuCount"] < 1 or numbers["memoryMB"] < 1 or numbers["diskSizeMB"] < 0:
        raise _Corrupt("resources out of range")
    sandbox_disk = data.get("sandboxDiskMB")
    if sandbox_disk is not None and (
        not isinstance(sandbox_disk, int) or isinstance(sandbox_disk, bool) or sandbox_disk < 0
    ):
        raise _Corrupt("sandboxDiskMB is not a size")
    image = _parse_image(data)
    built = _parse_build(data)
    rootfs_of = built.pop("rootfs_of", None)
    if image and image_root is None:
        raise _Corrupt("an image template, but this store has no image mount")
    stamps: dict[str, float] = {}
    for key in ("createdAt", "updatedAt"):
        value = data.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _Corrupt(f"{key!r} is not a number")
        stamps[key] = float(value)
    return Template(
        template_id=template_id,
        build_id=_field(data, "buildID", str),
        aliases=checked,
        rootfs=(image_root or Path("/nonexistent")) / str(image["image_key"])
        if image
        else template_dir.parent / str(rootfs_of or template_id) / ROOTFS_DIR,
        cpu_count=numbers["cpuCount"],
        memory_mb=numbers["memoryMB"],
        disk_size_mb=numbers["diskSizeMB"],
        created_at=stamps["createdAt"],
        updated_at=stamps["updatedAt"],
        public=_field(data, "public", bool),
        start_cmd=_optional_str(data, "startCmd"),
        ready_cmd=_optional_str(data, "readyCmd"),
        sandbox_disk_mb=sandbox_disk or None,
        **{**image, **built},  # type: ignore[arg-type]
    )


def _write_json_atomic(path: Path, data: dict[str, object]) -> None:
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def tree_size_mb(path: Path) -> int:
    """Apparent size of a directory tree in MiB, rounded up (hard links counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [path]
    while stack:
        with os.scandir(stack.pop()) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                if (st.st_dev, st.st_ino) in seen:
                    continue
                if st.st_nlink > 1:
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_size
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
    return -(-total // (1 << 20))


def _move_tree(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`, copying (owners, modes, links, xattrs) across filesystems."""
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno != 18:  # EXDEV
            raise
        subprocess.run(["cp", "-a", "--reflink=auto", "--", str(src), str(dst)], check=True)
        shutil.rmtree(src)


class TemplateStore:
    """Templates under one directory (`$AENV_HOME/templates`)."""

    def __init__(self, root: Path, *, image_root: Path | None = None) -> None:
        self.root = root
        # Where image templates' trees appear (the node's image mount).
        self.image_root = image_root
        self._aliases = root / ALIASES_DIR
        self._snapshots = self._aliases / _SNAPSHOTS_SUBDIR
        self._pending = root / SHARE_PENDING_DIR
        self._names: tuple[list[int], int, float, list[str]] | None = None
        # name -> (what `resolve` answered, the stats of the files it read then)
        self._resolved: dict[str, tuple[Template, _Seen]] = {}
        root.mkdir(parents=True, exist_ok=True)
        self._pending.mkdir(exist_ok=True)
        with self._locked():
            for leftover in root.iterdir():
                if leftover.name.startswith((_STAGING_PREFIX, _TRASH_PREFIX)):
                    log.info("removing leftover %s", leftover)
                    shutil.rmtree(leftover, ignore_errors=True)
            if not (self._aliases / _ALIASES_COMPLETE).exists():
                self._index_aliases()
            self._snapshots.mkdir(exist_ok=True)

    # -- the alias index -----------------------------------------------------
    #
    # A pointer is written (and its directory synced) before the template that
    # names the alias appears, and removed after it goes, all under the lock;
    # `resolve` believes a pointer only if the template it leads to lists the
    # alias. So a crash anywhere leaves every alias findable, and at worst a
    # stale pointer that nothing believes and the next writer replaces.

    def _index_aliases(self) -> None:
        """Build the alias index from every template, and move share markers from
        template directories to SHARE_PENDING_DIR (a home from before these, or
        one whose build a crash interrupted; hold the lock)."""
        staging = self.root / f"{_STAGING_PREFIX}aliases-{secrets.token_hex(4)}"
        staging.mkdir()
        (staging / _SNAPSHOTS_SUBDIR).mkdir()
        count = 0
        moved: list[Path] = []
        for template in self.list():
            for alias in template.aliases:
                with contextlib.suppress(FileExistsError):  # the first by ID keeps it
                    os.symlink(template.template_id, staging / alias)
                    count += 1
            if template.snapshot_id is not None:
                with contextlib.suppress(FileExistsError):
                    os.symlink(
                        template.template_id, staging / _SNAPSHOTS_SUBDIR / template.snapshot_id
                    )
            old_marker = self.root / template.template_id / SHARE_PENDING_FILE
            if old_marker.exists():
                (self._pending / template.template_id).touch()
                moved.append(old_marker)
        if moved:
            fsync_dir(self._pending)
            for old_marker in moved:
                old_marker.unlink()
        (staging / _ALIASES_COMPLETE).touch()
        fsync_dir(staging / _SNAPSHOTS_SUBDIR)
        fsync_dir(staging)
        if self._aliases.exists():
            os.rename(self._aliases, self.root / f"{_TRASH_PREFIX}aliases-{secrets.token_hex(4)}")
        os.rename(staging, self._aliases)
        fsync_dir(self.root)
        for trash in self.root.glob(f"{_TRASH_PREFIX}aliases-*"):
            shutil.rmtree(trash, ignore_errors=True)
        log.info("indexed %d template aliases", count)

    def _pointer(self, name: str, where: Path | None = None) -> str | None:
        try:
            return os.readlink((where or self._aliases) / name)
        except OSError:
            return None

    def backing(self, snapshot_id: str) -> Template | None:
        """The built template whose sandboxes restore `snapshot_id`, if any (one read)."""
        target = self._pointer(snapshot_id, self._snapshots)
        if target is None or NAME_RE.fullmatch(target) is None:
            return None
        template = self._load(target)
        return template if template is not None and template.snapshot_id == snapshot_id else None

    def _by_alias(self, alias: str) -> Template | None:
        target = self._pointer(alias)
        if target is None:
            return None
        try:
            check_name(target)
        except InvalidName:
            return None
        template = self._load(target)
        return template if template is not None and alias in template.aliases else None

    def _point(self, aliases: Sequence[str], template_id: str, where: Path | None = None) -> None:
        """Make `aliases` (or snapshot IDs, `where` given) lead to `template_id`
        (durably; hold the lock)."""
        where = where or self._aliases
        if not aliases:
            return
        for alias in aliases:
            tmp = where / f".{alias}.{secrets.token_hex(4)}.tmp"
            os.symlink(template_id, tmp)
            os.replace(tmp, where / alias)
        fsync_dir(where)

    def _unpoint(self, aliases: Sequence[str], template_id: str, where: Path | None = None) -> None:
        """Remove the pointers of `aliases` that lead to `template_id` (hold the lock)."""
        where = where or self._aliases
        for alias in aliases:
            if self._pointer(alias, where) == template_id:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(where / alias)

    def _point_snapshot(self, template: Template) -> None:
        if template.snapshot_id is not None:
            self._point([template.snapshot_id], template.template_id, self._snapshots)

    def _unpoint_snapshot(self, template: Template | None, keep: str | None = None) -> None:
        if template is not None and template.snapshot_id not in (None, keep):
            self._unpoint([str(template.snapshot_id)], template.template_id, self._snapshots)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialise writers (in this process and others) on `<root>/.lock`."""
        fd = os.open(self.root / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _load(self, template_id: str) -> Template | None:
        """The template in `<root>/<template_id>`, or None if absent or corrupt."""
        template_dir = self.root / template_id
        if template_dir.is_symlink():
            log.warning("skipping template %r: its directory is a symlink", template_id)
            return None
        try:
            raw = (template_dir / METADATA_FILE).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("skipping template %r: cannot read metadata: %s", template_id, exc)
            return None
        try:
            return _parse(template_id, template_dir, raw, self.image_root)
        except _Corrupt as exc:
            log.warning("skipping template %r: corrupt %s: %s", template_id, METADATA_FILE, exc)
            return None

    def names(self, limit: int) -> list[str]:
        """The first `limit` template IDs and aliases in sorted order, from directory
        entries alone (no template is read), listed again only when a directory
        changed or `_NAMES_KEPT_S` passed: two stats when nothing changed, so a
        node with a hundred thousand templates can gossip them every few seconds."""
        stamp = []
        for where in (self.root, self._aliases):
            st = os.stat(where)
            stamp += [st.st_mtime_ns, st.st_nlink, st.st_size]
        cached = self._names
        if (
            cached is not None
            and cached[0] == stamp
            and cached[1] >= limit
            and time.monotonic() - cached[2] < _NAMES_KEPT_S
        ):
            return cached[3][:limit]
        found: set[str] = set()
        for where in (self.root, self._aliases):
            with os.scandir(where) as it:
                found.update(e.name for e in it if not e.name.startswith("."))
        names = heapq.nsmallest(limit, (n for n in found if NAME_RE.fullmatch(n)))
        self._names = (stamp, limit, time.monotonic(), names)
        return names

    def list(self) -> list[Template]:
        """Every valid template, sorted by ID."""
        found = []
        for entry in sorted(self.root.iterdir()):
            try:
                check_name(entry.name)
            except InvalidName:
                continue  # dot-files, staging and trash directories
            if entry.is_dir() and (template := self._load(entry.name)) is not None:
                found.append(template)
        return found

    def resolve(self, name_or_id: str) -> Template:
        """The template with this ID, else the one with this alias (at most two
        template reads, however many templates there are)."""
        check_name(name_or_id, "template name")
        before = self._seen(name_or_id)
        template = self._load(name_or_id) or self._by_alias(name_or_id)
        if template is not None:
            if before == self._seen(name_or_id):  # nothing changed while it was read
                if len(self._resolved) >= _RESOLVED_MAX:
                    self._resolved.clear()
                self._resolved[name_or_id] = (template, before)
            return template
        raise TemplateNotFound(f"template {name_or_id!r} not found")

    def resolve_known(self, name_or_id: str) -> Template | None:
        """What `resolve` last answered for this name if none of the files it read
        changed since (a few stats, no read: cheap enough for the event loop, where a
        worker thread per create costs a thread start in a burst); else None."""
        known = self._resolved.get(name_or_id)
        if known is None or self._seen(name_or_id) != known[1]:
            return None
        return known[0]

    def _seen(self, name: str) -> _Seen:
        """The identity of what `resolve(name)` reads: the template directory and its
        metadata, the alias and its target's metadata (a write replaces a file, so
        its inode changes; a missing one is None)."""

        def stat(path: Path, follow: bool = True) -> tuple[int, int, int] | None:
            try:
                st = path.stat() if follow else path.lstat()
            except (OSError, ValueError):
                return None
            return (st.st_ino, st.st_mtime_ns, st.st_size)

        target = self._pointer(name)
        return (
            stat(self.root / name, follow=False),
            stat(self.root / name / METADATA_FILE),
            target,
            None if target is None else stat(self.root / target / METADATA_FILE),
        )

    def _check_new(
        self, template_id: str, aliases: Sequence[str], cpu_count: int, memory_mb: int
    ) -> tuple[str, ...]:
        check_name(template_id, "template ID")
        if isinstance(aliases, str):
            raise TypeError("aliases must be a sequence of names, not a string")
        clean_aliases = tuple(dict.fromkeys(check_name(a, "alias") for a in aliases))
        if cpu_count < 1 or memory_mb < 1:
            raise ValueError("cpu_count and memory_mb must be positive")
        return clean_aliases

    def _check_free(self, template_id: str, aliases: tuple[str, ...]) -> None:
        """Raise TemplateConflict if the ID or an alias is taken (hold the lock)."""

        def taken(name: str) -> bool:
            path = self.root / name
            return path.exists() or path.is_symlink() or self._by_alias(name) is not None

        if taken(template_id):
            raise TemplateConflict(f"template {template_id!r} already exists")
        clash = [a for a in aliases if taken(a)]
        if clash:
            raise TemplateConflict(f"alias {clash[0]!r} is already taken")

    def add(
        self,
        *,
        template_id: str,
        rootfs_dir: Path,
        aliases: Sequence[str] = (),
        cpu_count: int = 2,
        memory_mb: int = 512,
        start_cmd: str | None = None,
        ready_cmd: str | None = None,
    ) -> Template:
        """Install `rootfs_dir` (moved, not copied, when on the same filesystem) as a template."""
        clean_aliases = self._check_new(template_id, aliases, cpu_count, memory_mb)
        if rootfs_dir.is_symlink() or not rootfs_dir.is_dir():
            raise NotADirectoryError(f"{rootfs_dir} is not a directory")
        with self._locked():
            self._check_free(template_id, clean_aliases)
            disk_size_mb = tree_size_mb(rootfs_dir)
            now = time.time()
            template_dir = self.root / template_id
            template = Template(
                template_id=template_id,
                build_id=str(uuid.uuid4()),
                aliases=clean_aliases,
                rootfs=template_dir / ROOTFS_DIR,
                cpu_count=cpu_count,
                memory_mb=memory_mb,
                disk_size_mb=disk_size_mb,
                created_at=now,
                updated_at=now,
                start_cmd=start_cmd,
                ready_cmd=ready_cmd,
            )
            staging = self.root / f"{_STAGING_PREFIX}{template_id}-{secrets.token_hex(4)}"
            staging.mkdir(mode=0o755)
            moved = False
            try:
                _move_tree(rootfs_dir, staging / ROOTFS_DIR)
                moved = True
                _write_json_atomic(staging / METADATA_FILE, template.to_json())
                self._point(clean_aliases, template_id)
                os.rename(staging, template_dir)
                fsync_dir(self.root)
            except BaseException:
                if moved and not rootfs_dir.exists():
                    # Give the caller its directory back rather than losing it.
                    with contextlib.suppress(OSError):
                        os.rename(staging / ROOTFS_DIR, rootfs_dir)
                shutil.rmtree(staging, ignore_errors=True)
                raise
        log.info("added template %s (aliases %s, %d MiB)", template_id, clean_aliases, disk_size_mb)
        return template

    def add_image(
        self,
        *,
        template_id: str,
        image_key: str,
        image_ref: str,
        size_bytes: int,
        aliases: Sequence[str] = (),
        env: Sequence[str] = (),
        workdir: str | None = None,
        user: str | None = None,
        cpu_count: int = 2,
        memory_mb: int = 512,
        start_cmd: str | None = None,
        ready_cmd: str | None = None,
    ) -> Template:
        """Record a template whose root filesystem is pulled image `image_key`."""
        if self.image_root is None:
            raise ValueError("this template store has no image mount")
        clean_aliases = self._check_new(template_id, aliases, cpu_count, memory_mb)
        with self._locked():
            self._check_free(template_id, clean_aliases)
            now = time.time()
            template = Template(
                template_id=template_id,
                build_id=str(uuid.uuid4()),
                aliases=clean_aliases,
                rootfs=self.image_root / image_key,
                cpu_count=cpu_count,
                memory_mb=memory_mb,
                disk_size_mb=-(-size_bytes // (1 << 20)),
                created_at=now,
                updated_at=now,
                start_cmd=start_cmd,
                ready_cmd=ready_cmd,
                image_key=image_key,
                image_ref=image_ref,
                env=tuple(env),
                workdir=workdir or None,
                user=user or None,
            )
            self._publish(template)
        log.info("added template %s from image %s (%s)", template_id, image_ref, image_key[:12])
        return template

    def put_built(
        self,
        *,
        template_id: str,
        build_id: str,
        aliases: Sequence[str],
        base: Template,
        snapshot_id: str,
        env: Sequence[str] = (),
        workdir: str | None = None,
        user: str | None = None,
        cpu_count: int = 2,
        memory_mb: int = 512,
        start_cmd: str | None = None,
        ready_cmd: str | None = None,
        sandbox_disk_mb: int | None = None,
    ) -> tuple[Template, str | None]:
        """Record a finished build of `template_id`: a new template, or a new build of one.

        The template's sandboxes restore `snapshot_id`, whose layers lie over
        `base`'s root filesystem. Rebuilding keeps the ID, aliases and creation
        time. Returns the template and the snapshot of the build it replaced.
        Only a built template can be rebuilt (TemplateConflict otherwise).
        """
        clean_aliases = self._check_new(template_id, aliases, cpu_count, memory_mb)
        check_name(snapshot_id, "snapshot ID")
        with self._locked():
            old = self._load(template_id)
            if old is not None and old.snapshot_id is None:
                raise TemplateConflict(
                    f"template {template_id!r} was not made by a build and cannot be rebuilt"
                )
            if old is None:
                self._check_free(template_id, clean_aliases)
            now = time.time()
            template = Template(
                template_id=template_id,
                build_id=build_id,
                aliases=old.aliases if old is not None else clean_aliases,
                rootfs=base.rootfs,
                cpu_count=cpu_count,
                memory_mb=memory_mb,
                disk_size_mb=base.disk_size_mb,
                created_at=old.created_at if old is not None else now,
                updated_at=now,
                start_cmd=start_cmd,
                ready_cmd=ready_cmd,
                image_key=base.image_key,
                image_ref=base.image_ref,
                env=tuple(env),
                workdir=workdir or None,
                user=user or None,
                snapshot_id=snapshot_id,
                sandbox_disk_mb=sandbox_disk_mb,
            )
            if old is not None:
                self._point_snapshot(template)
                _write_json_atomic(self.root / template_id / METADATA_FILE, template.to_json())
                self._unpoint_snapshot(old, keep=snapshot_id)
            else:
                self._publish(template)
        log.info("template %s: build %s ready (snapshot %s)", template_id, build_id, snapshot_id)
        return template, None if old is None else old.snapshot_id

    def _publish(self, template: Template) -> None:
        """Make a template that has no root filesystem of its own appear (hold the
        lock); one of the same ID (an older build another node shared) is replaced."""
        staging = self.root / f"{_STAGING_PREFIX}{template.template_id}-{secrets.token_hex(4)}"
        staging.mkdir(mode=0o755)
        target = self.root / template.template_id
        old = self.root / f"{_STAGING_PREFIX}{template.template_id}-old-{secrets.token_hex(4)}"
        try:
            _write_json_atomic(staging / METADATA_FILE, template.to_json())
            self._point(template.aliases, template.template_id)
            self._point_snapshot(template)
            if target.exists():
                os.rename(target, old)
            os.rename(staging, target)
            fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(old, ignore_errors=True)

    def adopt(self, raw: bytes) -> Template:
        """Record a template another node made (its `to_json`, from the object store).

        An image template's image, or a built template's snapshot and base,
        must be available to this node before a sandbox starts from it. A
        template of the same ID already here is returned as it is, unless the
        record is a newer build of it (rebuilt on another node), which
        replaces it.
        """
        try:
            doc = json.loads(raw)
            template_id = check_name(str(doc["templateID"]), "template ID")
        except (ValueError, KeyError, TypeError, InvalidName) as exc:
            raise TemplateConflict(f"not a template record: {exc}") from None
        try:
            template = _parse(template_id, self.root / template_id, raw, self.image_root)
        except _Corrupt as exc:
            raise TemplateConflict(f"template record {template_id}: {exc}") from None
        with self._locked():
            existing = self._load(template_id)
            newer = existing is not None and (
                existing.build_id != template.build_id and template.updated_at > existing.updated_at
            )
            if existing is not None and not newer:
                return existing
            if existing is None:
                self._check_free(template_id, template.aliases)
            self._publish(template)
            if existing is not None:
                self._unpoint(
                    [a for a in existing.aliases if a not in template.aliases], template_id
                )
                self._unpoint_snapshot(existing, keep=template.snapshot_id)
        log.info(
            "adopted %s template %s from the object store",
            "a newer build of" if newer else "",
            template_id,
        )
        return template

    def mark_share_pending(self, template_id: str, pending: bool) -> None:
        """Record (or clear) that the template is still to be put in the object store."""
        marker = self._pending / check_name(template_id)
        if pending:
            if (self.root / template_id).is_dir():  # not deleted meanwhile
                write_atomic(marker, b"")
        else:
            with contextlib.suppress(FileNotFoundError):
                marker.unlink()
                fsync_dir(marker.parent)

    def share_pending(self) -> Sequence[Template]:
        """The templates whose share was asked for and has not finished (only
        those are read; a marker of a deleted template is skipped)."""
        found = []
        for entry in sorted(self._pending.iterdir()):
            with contextlib.suppress(InvalidName):
                if (template := self._load(check_name(entry.name))) is not None:
                    found.append(template)
        return found

    def rootfs_index(self, template_id: str) -> str | None:
        """The recorded digest of the template's root filesystem index, if any."""
        try:
            raw = (self.root / check_name(template_id) / ROOTFS_INDEX_FILE).read_text()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return raw.strip() or None

    def record_rootfs_index(self, template_id: str, digest: str) -> None:
        """Record the digest of the template's root filesystem index (its content)."""
        with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
            write_atomic(self.root / check_name(template_id) / ROOTFS_INDEX_FILE, digest.encode())

    def set_public(self, name_or_id: str, public: bool) -> Template:
        """Make a template public or team-only (`PATCH /templates/{id}`)."""
        with self._locked():
            template = self.resolve(name_or_id)
            if template.public != public:
                template = dataclasses.replace(template, public=public, updated_at=time.time())
                _write_json_atomic(
                    self.root / template.template_id / METADATA_FILE, template.to_json()
                )
        return template

    def delete(self, name_or_id: str) -> None:
        """Remove a template (by ID or alias) and its root filesystem."""
        check_name(name_or_id, "template name")
        with self._locked():
            template = self.resolve(name_or_id)
            trash = self.root / f"{_TRASH_PREFIX}{template.template_id}-{secrets.token_hex(4)}"
            os.rename(self.root / template.template_id, trash)
            fsync_dir(self.root)
            self._unpoint(template.aliases, template.template_id)
            self._unpoint_snapshot(template)
            (self._pending / template.template_id).unlink(missing_ok=True)
        shutil.rmtree(trash, ignore_errors=True)
        log.info("deleted template %s", template.template_id)
