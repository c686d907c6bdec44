"""Conditional writes for a directory store: create-if-absent and compare-and-swap on files.

obstore's `LocalStore` creates objects only if absent but cannot update one
only if it is unchanged, and its etags (inode, mtime, size) may repeat after
a file is replaced. `FileCas` gives a `file://` store both operations, safe
between threads, processes and hosts that share the directory: every
conditional write of a key holds one of `STRIPES` lock files under
`<root>/.cas/` (an exclusive `flock`, plus a process-wide thread lock
because a file system that emulates `flock` with POSIX locks, as NFS does,
does not exclude two threads of one process), reads the current content,
compares its version, writes the new content to a temporary file under
`<root>/.cas/tmp/`, fsyncs it and renames it over the object. A version is
the sha256 of the content, so it never repeats unless the content does.
Readers take no lock: a rename replaces the file whole.

What this assumes of a shared file system: `flock` (or its emulation by
POSIX locks) is honoured by every host, and lock holders that die have
their locks released (the kernel does it locally; NFSv4 after its lease
time); rename within the file system is atomic; data written and fsynced
before a lock is released is visible to the next holder of the lock (NFS's
close-to-open and lock-to-lock consistency). Readers without the lock may
see an older version for a while on NFS (attribute caching): that can make
a compare-and-swap fail, never succeed wrongly. Every call blocks; the
object store runs them in worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

CAS_DIR = ".cas"
STRIPES = 64

_thread_locks: dict[tuple[str, int], threading.Lock] = {}
_thread_locks_guard = threading.Lock()


def content_version(data: bytes) -> str:
    """The version of an object with this content: "sha256:<hex>"."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _thread_lock(root: str, stripe: int) -> threading.Lock:
    with _thread_locks_guard:
        return _thread_locks.setdefault((root, stripe), threading.Lock())


class FileCas:
    """Conditional writes of whole objects under `root` (keys already validated)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.realpath(root))
        self._cas = self.root / CAS_DIR  # made by the first conditional write

    def read(self, key: str) -> tuple[bytes, str] | None:
        """The content and version of `key`, or None if it does not exist."""
        data = self._read(self.root / key)
        return None if data is None else (data, content_version(data))

    def create(self, key: str, data: bytes) -> str | None:
        """Write `key` only if it does not exist: its new version, or None if it does."""
        with self._locked(key):
            path = self.root / key
            if self._read(path) is not None:
                return None
            self._replace(path, data)
        return content_version(data)

    def swap(self, key: str, data: bytes, expect: str) -> str | None:
        """Replace `key` only if its version is `expect`: the new version, or None if the
        object changed or is gone."""
        with self._locked(key):
            path = self.root / key
            current = self._read(path)
            if current is None or content_version(current) != expect:
                return None
            self._replace(path, data)
        return content_version(data)

    def delete(self, key: str, expect: str | None = None) -> bool:
        """Remove `key` (only at version `expect` if given); whether this call removed it."""
        with self._locked(key):
            path = self.root / key
            current = self._read(path)
            if current is None or (expect is not None and content_version(current) != expect):
                return False
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            _fsync_dir(path.parent)
        return True

    # -- internals --------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        stripe = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % STRIPES
        with _thread_lock(str(self.root), stripe):
            (self._cas / "tmp").mkdir(parents=True, exist_ok=True)
            fd = os.open(self._cas / f"{stripe:02x}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    @staticmethod
    def _read(path: Path) -> bytes | None:
        for _ in range(3):
            try:
                return path.read_bytes()
            except FileNotFoundError:
                return None
            except OSError as exc:
                # NFS: the name was replaced under a cached file handle; look it up again.
                if exc.errno != errno.ESTALE:
                    raise
        return path.read_bytes()

    def _replace(self, path: Path, data: bytes) -> None:
        tmp = self._cas / "tmp" / f"{secrets.token_hex(8)}.tmp"
        try:
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
