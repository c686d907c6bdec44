"""Directory watching for WatchDir and the polling watcher API.

`open_watcher(path, recursive=...)` yields a channel of `(absolute path,
EventType)` pairs. It uses inotify through ctypes (fsnotify's event mapping:
create/moved-to = CREATE, modify = WRITE, delete = REMOVE, moved-from =
RENAME, attrib = CHMOD) and watches new subdirectories as they appear when
recursive; where inotify is unavailable it falls back to scanning the tree
every `POLL_INTERVAL` seconds and diffing (name, mtime, size, mode).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import struct

import trio

from aenv.proto.envd_schema import EventType

POLL_INTERVAL = 0.5
EVENT_BUFFER = 1024

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
_MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
)
_HEADER = struct.Struct("iIII")

WatchEvent = tuple[str, EventType]


def _ops(mask: int) -> list[EventType]:
    ops = []
    if mask & (IN_CREATE | IN_MOVED_TO):
        ops.append(EventType.CREATE)
    if mask & (IN_MOVED_FROM | IN_MOVE_SELF):
        ops.append(EventType.RENAME)
    if mask & IN_ATTRIB:
        ops.append(EventType.CHMOD)
    if mask & IN_MODIFY:
        ops.append(EventType.WRITE)
    if mask & (IN_DELETE | IN_DELETE_SELF):
        ops.append(EventType.REMOVE)
    return ops


class _Inotify:
    def __init__(self) -> None:
        name = ctypes.util.find_library("c") or "libc.so.6"
        self._libc = ctypes.CDLL(name, use_errno=True)
        fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        self.fd: int = fd
        self.paths: dict[int, str] = {}

    def add(self, path: str) -> None:
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), _MASK)
        if wd < 0:
            e = ctypes.get_errno()
            if e in (errno.ENOENT, errno.ENOTDIR):
                return
            raise OSError(e, os.strerror(e), path)
        self.paths[wd] = path

    def add_tree(self, root: str) -> None:
        self.add(root)
        for dirpath, dirnames, _ in os.walk(root):
            for d in dirnames:
                full = os.path.join(dirpath, d)
                if not os.path.islink(full):
                    self.add(full)

    def close(self) -> None:
        os.close(self.fd)

    def parse(self, data: bytes, recursive: bool, root: str) -> list[WatchEvent]:
        out: list[WatchEvent] = []
        pos = 0
        while pos + _HEADER.size <= len(data):
            wd, mask, _cookie, length = _HEADER.unpack_from(data, pos)
            raw = data[pos + _HEADER.size : pos + _HEADER.size + length]
            pos += _HEADER.size + length
            base = self.paths.get(wd)
            if mask & IN_IGNORED:
                self.paths.pop(wd, None)
                continue
            if base is None:
                continue
            name = raw.split(b"\0", 1)[0]
            path = os.path.join(base, os.fsdecode(name)) if name else base
            if not name and base != root:
                continue  # self events of subdirectories are reported by their parent
            if recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
                with contextlib.suppress(OSError):
                    self.add_tree(path)
            out.extend((path, op) for op in _ops(mask))
        return out


async def _inotify_loop(
    ino: _Inotify, root: str, recursive: bool, send: trio.MemorySendChannel[WatchEvent]
) -> None:
    while True:
        await trio.lowlevel.wait_readable(ino.fd)
        try:
            data = os.read(ino.fd, 64 * 1024)
        except BlockingIOError:
            continue
        for event in ino.parse(data, recursive, root):
            await send.send(event)


def _snapshot(root: str, recursive: bool) -> dict[str, tuple[int, int, int]]:
    out: dict[str, tuple[int, int, int]] = {}
    stack = [root]
    while stack:
        current = stack.pop()
        try:
            entries = list(os.scandir(current))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            out[entry.path] = (st.st_mtime_ns, st.st_size, st.st_mode)
            if recursive and entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    return out


async def _poll_loop(root: str, recursive: bool, send: trio.MemorySendChannel[WatchEvent]) -> None:
    before = await trio.to_thread.run_sync(_snapshot, root, recursive)
    while True:
        await trio.sleep(POLL_INTERVAL)
        after = await trio.to_thread.run_sync(_snapshot, root, recursive)
        for path in sorted(after.keys() - before.keys()):
            await send.send((path, EventType.CREATE))
        for path in sorted(before.keys() & after.keys()):
            old, new = before[path], after[path]
            if old[2] != new[2]:
                await send.send((path, EventType.CHMOD))
            if old[:2] != new[:2]:
                await send.send((path, EventType.WRITE))
        for path in sorted(before.keys() - after.keys()):
            await send.send((path, EventType.REMOVE))
        before = after


async def run_watcher(
    path: str,
    send: trio.MemorySendChannel[WatchEvent],
    *,
    recursive: bool,
    force_poll: bool = False,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Watch the directory `path`, sending events to `send` until cancelled.

    Reports "inotify" or "poll" through `task_status` once watching.
    """
    ino: _Inotify | None = None
    if not force_poll:
        try:
            ino = _Inotify()
            if recursive:
                await trio.to_thread.run_sync(ino.add_tree, path)
            else:
                ino.add(path)
        except (OSError, AttributeError):
            if ino is not None:
                ino.close()
            ino = None
    try:
        if ino is not None:
            task_status.started("inotify")
            await _inotify_loop(ino, path, recursive, send)
        else:
            task_status.started("poll")
            await _poll_loop(path, recursive, send)
    finally:
        if ino is not None:
            ino.close()
