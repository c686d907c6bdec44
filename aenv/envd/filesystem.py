"""filesystem.Filesystem: stat, list, make, move, remove and watch paths.

Paths resolve like E2B's envd: `~` and relative paths against the calling
user's home (or the default workdir for an empty path); directories created on
a user's behalf are owned by that user. Entries follow E2B's EntryInfo
conventions: `mode` holds the permission bits, `permissions` Go's mode string
(e.g. `drwxr-xr-x`, `Lrwxrwxrwx`), a symlink reports its target's type with
`is_symlink` set, and `metadata` carries the file's `user.e2b.*` extended
attributes. Blocking filesystem work runs in worker threads.
"""

from __future__ import annotations

import collections
import contextlib
import os
import posixpath
import secrets
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from aenv.envd.rpc import CallContext, SendMessage
from aenv.envd.state import EnvdState
from aenv.envd.users import User, UserDB, ensure_dirs, resolve_path
from aenv.envd.watch import WatchEvent, run_watcher
from aenv.proto.connect import Code, ConnectError
from aenv.proto.envd_schema import EventType, FileType
from aenv.proto.pb import Message

METADATA_PREFIX = "user.e2b."
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p")
MAX_WATCHER_EVENTS = 10_000
DEFAULT_KEEPALIVE = 90.0


def go_mode_string(mode: int) -> str:
    """Go's os.FileMode.String() for a stat mode."""
    kinds = ""
    if stat.S_ISDIR(mode):
        kinds += "d"
    if stat.S_ISLNK(mode):
        kinds += "L"
    if stat.S_ISBLK(mode) or stat.S_ISCHR(mode):
        kinds += "D"
    if stat.S_ISFIFO(mode):
        kinds += "p"
    if stat.S_ISSOCK(mode):
        kinds += "S"
    if mode & stat.S_ISUID:
        kinds += "u"
    if mode & stat.S_ISGID:
        kinds += "g"
    if stat.S_ISCHR(mode):
        kinds += "c"
    if mode & stat.S_ISVTX:
        kinds += "t"
    perms = "".join(ch if mode & (1 << (8 - i)) else "-" for i, ch in enumerate("rwxrwxrwx"))
    return (kinds or "-") + perms


def _file_type(mode: int) -> FileType:
    if stat.S_ISREG(mode):
        return FileType.FILE
    if stat.S_ISDIR(mode):
        return FileType.DIRECTORY
    if stat.S_ISLNK(mode):
        return FileType.SYMLINK
    return FileType.UNSPECIFIED


def read_metadata(path: str) -> dict[str, str]:
    try:
        names = os.listxattr(path)
    except OSError:
        return {}
    out: dict[str, str] = {}
    for name in names:
        if not name.startswith(METADATA_PREFIX):
            continue
        try:
            value = os.getxattr(path, name)
            out[name[len(METADATA_PREFIX) :]] = value.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
    return out


def entry_info(path: str, users: UserDB, *, display_path: str | None = None) -> Message:
    """EntryInfo of `path` (not following a final symlink). Raises OSError."""
    st = os.lstat(path)
    entry: Message = {
        "name": posixpath.basename(path.rstrip("/")) or "/",
        "path": display_path or path,
        "size": st.st_size,
        "permissions": go_mode_string(st.st_mode),
        "owner": users.user_name(st.st_uid),
        "group": users.group_name(st.st_gid),
        "modified_time": {
            "seconds": st.st_mtime_ns // 1_000_000_000,
            "nanos": st.st_mtime_ns % 1_000_000_000,
        },
        "metadata": {},
        "is_symlink": False,
    }
    if stat.S_ISLNK(st.st_mode):
        target = os.path.realpath(path)
        entry["symlink_target"] = target
        entry["is_symlink"] = True
        try:
            tst = os.stat(path)
        except OSError:
            entry["type"], entry["mode"] = FileType.UNSPECIFIED, 0
        else:
            entry["type"], entry["mode"] = (
                _file_type(tst.st_mode),
                stat.S_IMODE(tst.st_mode) & 0o777,
            )
    else:
        entry["type"], entry["mode"] = _file_type(st.st_mode), st.st_mode & 0o777
    entry["metadata"] = read_metadata(path)
    return entry


def _not_found(what: str, e: OSError) -> ConnectError:
    return ConnectError(Code.NOT_FOUND, f"{what}: {e.strerror}: {e.filename or ''}".rstrip(": "))


def _stat_entry(path: str, users: UserDB) -> Message:
    try:
        return entry_info(path, users)
    except FileNotFoundError as e:
        raise _not_found("file not found", e) from None
    except NotADirectoryError as e:
        raise _not_found("file not found", e) from None
    except OSError as e:
        raise ConnectError(Code.INTERNAL, f"error getting file info: {e}") from None


def _network_mount(path: str) -> bool:
    """Whether `path` lies on a network or FUSE filesystem (per mountinfo)."""
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mount_point = fields[4].replace("\\040", " ")
                if (path == mount_point or path.startswith(mount_point.rstrip("/") + "/")) and len(
                    mount_point
                ) >= len(best):
                    best, fstype = mount_point, right.split()[0]
    except OSError:
        return False
    if best == "/":
        # The sandbox's own root, however the runtime serves it (gVisor's gofer
        # shows it as 9p), is local storage and always watchable.
        return False
    return fstype in NETWORK_FS or fstype.startswith("fuse")


@dataclass(eq=False)
class _Watcher:
    root: str
    include_entry: bool
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    events: collections.deque[Message] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_WATCHER_EVENTS)
    )
    error: ConnectError | None = None


class FilesystemService:
    """Handlers of filesystem.Filesystem."""

    def __init__(
        self,
        nursery: trio.Nursery,
        state: EnvdState,
        users: UserDB,
        resolve_user: Callable[[CallContext], User],
    ) -> None:
        self._nursery = nursery
        self._state = state
        self._users = users
        self._resolve_user = resolve_user
        self._watchers: dict[str, _Watcher] = {}

    def handlers(self) -> dict[str, Any]:
        p = "/filesystem.Filesystem/"
        return {
            p + "Stat": self.stat,
            p + "MakeDir": self.make_dir,
            p + "Move": self.move,
            p + "ListDir": self.list_dir,
            p + "Remove": self.remove,
            p + "WatchDir": self.watch_dir,
            p + "CreateWatcher": self.create_watcher,
            p + "GetWatcherEvents": self.get_watcher_events,
            p + "RemoveWatcher": self.remove_watcher,
        }

    def _path(self, ctx: CallContext, raw: str) -> tuple[User, str]:
        user = self._resolve_user(ctx)
        try:
            return user, resolve_path(raw, user, self._state.default_workdir)
        except ValueError as e:
            raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from None

    async def stat(self, req: Message, ctx: CallContext) -> Message:
        _, path = self._path(ctx, req.get("path", ""))
        return {"entry": await trio.to_thread.run_sync(_stat_entry, path, self._users)}

    async def make_dir(self, req: Message, ctx: CallContext) -> Message:
        user, path = self._path(ctx, req.get("path", ""))

        def work() -> Message:
            if os.path.isdir(path):
                raise ConnectError(Code.ALREADY_EXISTS, f"directory already exists: {path}")
            if os.path.lexists(path):
                raise ConnectError(
                    Code.INVALID_ARGUMENT, f"path already exists but it is not a directory: {path}"
                )
            try:
                ensure_dirs(path, user.uid, user.gid)
            except OSError as e:
                raise ConnectError(Code.INTERNAL, f"error creating directory: {e}") from None
            return _stat_entry(path, self._users)

        return {"entry": await trio.to_thread.run_sync(work)}

    async def move(self, req: Message, ctx: CallContext) -> Message:
        user, source = self._path(ctx, req.get("source", ""))
        _, destination = self._path(ctx, req.get("destination", ""))

        def work() -> Message:
            try:
                ensure_dirs(posixpath.dirname(destination), user.uid, user.gid)
            except OSError as e:
                raise ConnectError(Code.INTERNAL, f"error creating directories: {e}") from None
            try:
                os.rename(source, destination)
            except FileNotFoundError as e:
                raise _not_found("source file not found", e) from None
            except OSError as e:
                raise ConnectError(Code.INTERNAL, f"error renaming: {e}") from None
            return _stat_entry(destination, self._users)

        return {"entry": await trio.to_thread.run_sync(work)}

    async def list_dir(self, req: Message, ctx: CallContext) -> Message:
        _, requested = self._path(ctx, req.get("path", ""))
        depth = req.get("depth", 0) or 1
        users = self._users

        def work() -> Message:
            if not os.path.lexists(requested):
                raise ConnectError(Code.NOT_FOUND, f"path not found: {requested}")
            resolved = os.path.realpath(requested)
            if not os.path.exists(resolved):
                raise ConnectError(Code.NOT_FOUND, f"path not found: {requested}")
            if not os.path.isdir(resolved):
                raise ConnectError(Code.INVALID_ARGUMENT, f"path is not a directory: {requested}")
            entries: list[Message] = []

            def walk(directory: str, shown: str, level: int) -> None:
                try:
                    names = sorted(os.listdir(directory))
                except OSError as e:
                    if level == 1:
                        raise ConnectError(
                            Code.INTERNAL, f"error reading directory {directory}: {e}"
                        ) from None
                    return
                for name in names:
                    full = posixpath.join(directory, name)
                    try:
                        entry = entry_info(full, users, display_path=posixpath.join(shown, name))
                    except FileNotFoundError:
                        continue
                    except OSError as e:
                        raise ConnectError(Code.INTERNAL, f"error getting file info: {e}") from None
                    entries.append(entry)
                    if (
                        level < depth
                        and entry["type"] == FileType.DIRECTORY
                        and not entry["is_symlink"]
                    ):
                        walk(full, posixpath.join(shown, name), level + 1)

            walk(resolved, requested, 1)
            return {"entries": entries}

        return await trio.to_thread.run_sync(work)

    async def remove(self, req: Message, ctx: CallContext) -> Message:
        _, path = self._path(ctx, req.get("path", ""))

        def work() -> None:
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                return
            except OSError as e:
                raise ConnectError(
                    Code.INTERNAL, f"error removing file or directory: {e}"
                ) from None

        await trio.to_thread.run_sync(work)
        return {}

    # ---------------------------------------------------------- watching

    async def _check_watch_path(self, req: Message, ctx: CallContext) -> str:
        _, path = self._path(ctx, req.get("path", ""))

        def work() -> None:
            try:
                st = os.stat(path)
            except FileNotFoundError as e:
                raise ConnectError(Code.NOT_FOUND, f"path {path} not found: {e.strerror}") from None
            except OSError as e:
                raise ConnectError(Code.INTERNAL, f"error statting path {path}: {e}") from None
            if not stat.S_ISDIR(st.st_mode):
                raise ConnectError(Code.INVALID_ARGUMENT, f"path {path} not a directory")
            if not req.get("allow_network_mounts") and _network_mount(os.path.realpath(path)):
                raise ConnectError(
                    Code.INVALID_ARGUMENT, f"cannot watch path on network filesystem: {path}"
                )

        await trio.to_thread.run_sync(work)
        return path

    def _event(self, root: str, path: str, op: EventType, include_entry: bool) -> Message:
        name = posixpath.relpath(path, root) if path != root else "."
        event: Message = {"name": name, "type": op}
        if include_entry and op in (EventType.CREATE, EventType.WRITE, EventType.CHMOD):
            with contextlib.suppress(OSError):
                event["entry"] = entry_info(path, self._users)
        return event

    async def watch_dir(self, req: Message, ctx: CallContext, send: SendMessage) -> None:
        root = await self._check_watch_path(req, ctx)
        include_entry = bool(req.get("include_entry"))
        interval = DEFAULT_KEEPALIVE
        raw = ctx.header("keepalive-ping-interval")
        if raw and raw.strip().isdigit() and int(raw) > 0:
            interval = float(int(raw))
        tx, rx = trio.open_memory_channel[WatchEvent](1024)
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(
                    lambda task_status: run_watcher(
                        root, tx, recursive=bool(req.get("recursive")), task_status=task_status
                    )
                )
            except OSError as e:
                raise ConnectError(
                    Code.INTERNAL, f"error adding path {root} to watcher: {e}"
                ) from None
            await send({"start": {}})
            while True:
                with trio.move_on_after(interval) as idle:
                    path, op = await rx.receive()
                if idle.cancelled_caught:
                    await send({"keepalive": {}})
                    continue
                event = await trio.to_thread.run_sync(self._event, root, path, op, include_entry)
                await send({"filesystem": event})

    async def create_watcher(self, req: Message, ctx: CallContext) -> Message:
        root = await self._check_watch_path(req, ctx)
        watcher = _Watcher(root, bool(req.get("include_entry")))
        watcher_id = secrets.token_hex(8)
        tx, rx = trio.open_memory_channel[WatchEvent](1024)

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with watcher.scope:
                async with trio.open_nursery() as nursery:
                    await nursery.start(
                        lambda task_status: run_watcher(
                            root, tx, recursive=bool(req.get("recursive")), task_status=task_status
                        )
                    )
                    task_status.started()
                    async for path, op in rx:
                        watcher.events.append(self._event(root, path, op, watcher.include_entry))
            self._watchers.pop(watcher_id, None)

        try:
            await self._nursery.start(run)
        except OSError as e:
            raise ConnectError(Code.INTERNAL, f"error adding path {root} to watcher: {e}") from None
        self._watchers[watcher_id] = watcher
        return {"watcher_id": watcher_id}

    async def get_watcher_events(self, req: Message, ctx: CallContext) -> Message:
        watcher = self._watchers.get(req.get("watcher_id", ""))
        if watcher is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher with id {req.get('watcher_id')} not found")
        events = list(watcher.events)
        watcher.events.clear()
        return {"events": events}

    async def remove_watcher(self, req: Message, ctx: CallContext) -> Message:
        watcher = self._watchers.pop(req.get("watcher_id", ""), None)
        if watcher is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher with id {req.get('watcher_id')} not found")
        watcher.scope.cancel()
        return {}
