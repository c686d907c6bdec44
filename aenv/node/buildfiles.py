"""Build files: the archives `COPY` steps upload, kept by the hash the SDK names them by.

The E2B SDKs hash what a `COPY` step copies (paths, modes, sizes, contents:
its `filesHash`), ask `GET /templates/{id}/files/{hash}` whether the node
has it, and if not `PUT` a tar archive (gzip or not) of those files to the
URL the answer names. The node keeps one archive per hash, shared by every
template and build (a second template copying the same files uploads
nothing). The upload URL is signed (HMAC of the hash and an expiry with the
node's key): it is the SDK's upload client that calls it, without the API
key. An upload is written to `<hash>.part` and renamed into place once whole
and readable as a tar archive. It is resumable: a `PUT` with `Content-Range:
bytes START-END/TOTAL` appends at START when START is what the node already
holds (else 416 with the received range in `Range`), and `Content-Range:
bytes */TOTAL` asks how much arrived (308 with `Range`), as resumable
uploads to object stores work. Archives beyond 8 GiB in all go, least
recently used first, after builds. The methods with blocking file work are
called from worker threads.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import tarfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import trio

__all__ = ["BadUpload", "BuildFiles", "ContentRange", "parse_content_range"]

HASH_RE = re.compile(r"[0-9a-f]{64}")
UPLOAD_URL_TTL_S = 3600
MAX_BYTES = 8 << 30  # archives kept, least recently used first out
_RANGE_RE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_STATUS_RE = re.compile(r"bytes \*/(\d+|\*)")


class BadUpload(ValueError):
    """An upload the node refuses; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ContentRange:
    """A `Content-Range` of a PUT: bytes `start`..`end` (inclusive) of `total`
    (None: unknown yet); `start` None asks for the state only (`bytes */N`)."""

    start: int | None
    end: int | None
    total: int | None


def parse_content_range(value: str) -> ContentRange:
    value = value.strip()
    m = _STATUS_RE.fullmatch(value)
    if m:
        return ContentRange(None, None, None if m.group(1) == "*" else int(m.group(1)))
    m = _RANGE_RE.fullmatch(value)
    if m is None:
        raise BadUpload(400, f"invalid Content-Range {value!r}")
    start, end = int(m.group(1)), int(m.group(2))
    total = None if m.group(3) == "*" else int(m.group(3))
    if end < start or (total is not None and end >= total):
        raise BadUpload(400, f"invalid Content-Range {value!r}")
    return ContentRange(start, end, total)


class BuildFiles:
    """The node's uploaded build archives under `root`, by files hash."""

    def __init__(self, root: Path, key: bytes) -> None:
        self.root = root
        self._key = key
        root.mkdir(parents=True, exist_ok=True)

    def path(self, files_hash: str) -> Path:
        if not HASH_RE.fullmatch(files_hash):
            raise BadUpload(400, "the files hash must be a lowercase hex SHA-256")
        return self.root / f"{files_hash}.tar"

    def _part(self, files_hash: str) -> Path:
        return self.path(files_hash).with_suffix(".part")

    def present(self, files_hash: str) -> bool:
        return self.path(files_hash).is_file()

    def received(self, files_hash: str) -> int:
        """How many bytes of an unfinished upload the node holds."""
        try:
            return self._part(files_hash).stat().st_size
        except FileNotFoundError:
            return 0

    def touch(self, files_hash: str) -> None:
        """Mark an archive used (trimming keeps the recently used)."""
        os.utime(self.path(files_hash))

    def trim(self, max_bytes: int = MAX_BYTES, *, keep: frozenset[str] = frozenset()) -> list[str]:
        """Remove the least recently used archives beyond `max_bytes` (not those
        in `keep`, nor unfinished uploads); their hashes."""
        entries = []
        for p in self.root.glob("*.tar"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        gone: list[str] = []
        for _, size, p in sorted(entries):
            if total <= max_bytes:
                break
            if p.stem in keep:
                continue
            p.unlink(missing_ok=True)
            total -= size
            gone.append(p.stem)
        return gone

    # -- signed upload URLs --------------------------------------------------

    def _sig(self, files_hash: str, expires: int) -> str:
        msg = f"build-files\0{files_hash}\0{expires}".encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def upload_query(self, files_hash: str, *, now: float | None = None) -> str:
        """The query string that authorizes an upload of `files_hash` for an hour."""
        expires = int((time.time() if now is None else now) + UPLOAD_URL_TTL_S)
        return f"expires={expires}&sig={self._sig(files_hash, expires)}"

    def check_signature(
        self, files_hash: str, expires: str, sig: str, *, now: float | None = None
    ) -> None:
        try:
            when = int(expires)
        except ValueError:
            raise BadUpload(403, "invalid upload URL") from None
        if not hmac.compare_digest(self._sig(files_hash, when), sig):
            raise BadUpload(403, "invalid upload URL")
        if when < (time.time() if now is None else now):
            raise BadUpload(403, "the upload URL expired: ask for the files again")

    # -- receiving -----------------------------------------------------------

    async def receive(
        self, files_hash: str, body: AsyncIterator[bytes], content_range: ContentRange | None
    ) -> bool:
        """Write an upload's bytes; True once the archive is whole (and in place).

        Without `content_range` the body is the whole archive. Raises BadUpload.
        """
        part = self._part(files_hash)
        if self.present(files_hash):  # a concurrent or repeated upload: already here
            async for _ in body:
                pass
            return True
        have = await trio.to_thread.run_sync(self.received, files_hash)
        if content_range is not None and content_range.start is None:
            raise BadUpload(308, f"{have} bytes received")
        start = 0 if content_range is None else content_range.start
        assert start is not None
        if start != 0 and start != have:
            raise BadUpload(416, f"the upload holds {have} bytes, not {start}")
        f = await trio.to_thread.run_sync(_open_at, part, start)
        try:
            written = start
            async for chunk in body:
                if chunk:
                    await trio.to_thread.run_sync(f.write, chunk)
                    written += len(chunk)
            await trio.to_thread.run_sync(f.flush)
        finally:
            await trio.to_thread.run_sync(f.close)
        if content_range is not None:
            if content_range.end is not None and written != content_range.end + 1:
                raise BadUpload(400, "the body is shorter than its Content-Range")
            if content_range.total is None or written < content_range.total:
                return False
        try:
            await trio.to_thread.run_sync(_check_archive, part)
        except BadUpload:
            await trio.to_thread.run_sync(lambda: part.unlink(missing_ok=True))
            raise
        await trio.to_thread.run_sync(os.replace, part, self.path(files_hash))
        return True


def _open_at(path: Path, offset: int) -> BinaryIO:
    f = open(path, "r+b" if offset else "wb")  # noqa: SIM115 (closed by the caller)
    f.truncate(offset)
    f.seek(offset)
    return f


def _check_archive(path: Path) -> None:
    try:
        with tarfile.open(path, "r:*") as tar:
            for _ in tar:
                pass
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise BadUpload(400, f"the upload is not a tar archive: {exc}") from None
