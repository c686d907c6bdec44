"""Object storage for durable artefacts: one URL, a local directory or a bucket, via obstore.

`open_object_store(url)` picks the backend from one URL: `file:///abs/dir`
(a local or shared directory, created if missing), `s3://bucket/prefix`,
`gs://bucket/prefix` or `az://container/prefix`; the provider's standard
environment variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ALLOW_HTTP`,
`AWS_VIRTUAL_HOSTED_STYLE_REQUEST`, `GOOGLE_*`, `AZURE_*`, ...) configure
the rest, read by obstore itself; explicit `config` overrides them. The
returned `ObjectStore` is a thin trio shell over obstore's synchronous API
(its async API needs asyncio): every call runs in a worker thread under one
`CapacityLimiter`, is retried with jittered exponential backoff on trio's
clock when the failure is transient (connection refused or reset, timeouts,
5xx, 429) up to a bounded number of attempts, and ends in a clear exception:
`ObjectNotFound` (a `KeyError`), `StoreUnavailable` (retries exhausted; names
the store, endpoint and operation), `CorruptObject` (content hash mismatch)
or `StoreError`, their base. Large uploads are multipart (obstore's chunked
put), downloads to files go piece by piece with each piece retried on its
own and land by atomic rename. On top sit content-addressed blobs:
`put_blob` stores bytes or a file under `blobs/sha256/<2 hex>/<64 hex>` only
when absent, so the same content is uploaded once, and `get_blob` /
`download_blob` verify the sha256 of what they read. Conditional writes of
small objects, for records several nodes update (cluster ownership):
`create` (only if absent), `compare_and_swap` (only if still at the
`Version` that `get_versioned` returned), atomic on every backend; a
`file://` directory gets them from `aenv.storage.filecas`. The pure parts (URL
parsing, key rules, blob layout, error classification) are plain functions
so they can be tested without a store; the backoff is `aenv.kit.retry`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import enum
import hashlib
import os
import re
import secrets
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import obstore
import obstore.exceptions as oe
import trio
from obstore.store import LocalStore
from obstore.store import from_url as _obstore_from_url

from aenv.kit.retry import Backoff, Retries
from aenv.storage.filecas import CAS_DIR, FileCas

T = TypeVar("T")

MiB = 1024 * 1024
BLOB_PREFIX = "blobs/sha256"
DEFAULT_PART_SIZE = 8 * MiB
DEFAULT_PIECE_SIZE = 8 * MiB

# -- errors -------------------------------------------------------------------


class StoreError(Exception):
    """Base of every object store failure."""


class ObjectNotFound(StoreError, KeyError):
    """The key does not exist in the store."""

    def __init__(self, key: str, where: str = "") -> None:
        super().__init__(key)
        self.key = key
        self.where = where

    def __str__(self) -> str:
        return f"no object {self.key!r} in {self.where}" if self.where else repr(self.key)


class StoreUnavailable(StoreError):
    """The store could not be reached (or kept failing) within the retry budget."""


class CorruptObject(StoreError):
    """Content does not match its sha256 digest."""


# -- pure helpers -------------------------------------------------------------

_SCHEMES = {
    "file": "file",
    "s3": "s3",
    "s3a": "s3",
    "gs": "gs",
    "gcs": "gs",
    "az": "az",
    "azure": "az",
    "abfs": "az",
    "abfss": "az",
    "adl": "az",
}
_URL_HELP = "use file:///abs/dir, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix"


@dataclass(frozen=True)
class StoreLocation:
    """A parsed store URL: `scheme` is one of file, s3, gs, az."""

    scheme: str
    bucket: str  # bucket or container; "" for file
    prefix: str  # key prefix inside the bucket, or the absolute directory for file
    url: str


def parse_store_url(url: str) -> StoreLocation:
    """Parse and validate a store URL; ValueError with the accepted forms if it is not one."""
    parts = urllib.parse.urlsplit(url)
    scheme = _SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        what = f"scheme {parts.scheme!r}" if parts.scheme else "no scheme"
        raise ValueError(f"unsupported store URL {url!r} ({what}): {_URL_HELP}")
    if parts.query or parts.fragment:
        raise ValueError(f"store URL {url!r} must not have a query or fragment")
    path = urllib.parse.unquote(parts.path)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file store URL {url!r} must name a local absolute directory")
        if not path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"file store URL {url!r} must name a local absolute directory")
        return StoreLocation("file", "", os.path.normpath(path), url)
    if not parts.netloc:
        raise ValueError(f"store URL {url!r} has no bucket: {_URL_HELP}")
    prefix = path.strip("/")
    if prefix and any(seg in ("", ".", "..") for seg in prefix.split("/")):
        raise ValueError(f"store URL {url!r} has an invalid prefix {prefix!r}")
    return StoreLocation(scheme, parts.netloc, prefix, url)


def check_key(key: str) -> str:
    """A key is relative, '/'-separated, with no empty, '.' or '..' segment."""
    if not key or key.startswith("/") or key.endswith("/"):
        raise ValueError(f"invalid object key {key!r}")
    if any(seg in ("", ".", "..") for seg in key.split("/")):
        raise ValueError(f"invalid object key {key!r}")
    return key


_HEX64 = re.compile(r"[0-9a-f]{64}")


def blob_key(digest: str) -> str:
    """Key of a content-addressed blob: `blobs/sha256/<hex[:2]>/<hex>` for "sha256:<hex>"."""
    algo, _, hexdigest = digest.partition(":")
    if algo != "sha256" or not _HEX64.fullmatch(hexdigest):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return f"{BLOB_PREFIX}/{hexdigest[:2]}/{hexdigest}"


class ErrorKind(enum.Enum):
    NOT_FOUND = "not found"
    EXISTS = "exists"
    TRANSIENT = "transient"
    FATAL = "fatal"


# obstore reports network and HTTP failures as GenericError whose text carries
# the status or the transport error kind; these patterns pick the retryable ones.
_TRANSIENT_TEXT = re.compile(
    r"status(?: code)?:? (?:5\d\d|429)\b"
    r"|kind: (?:Connect|Request|Timeout|Interrupted|Decode)\b"
    r"|error sending request|connection (?:refused|reset|closed|aborted)"
    r"|broken pipe|\btimed out\b|\btimeout\b|incomplete message|unexpected eof",
    re.IGNORECASE,
)


def is_transient_message(text: str) -> bool:
    return _TRANSIENT_TEXT.search(text) is not None


def classify_error(exc: BaseException) -> ErrorKind:
    """How the retry loop treats an exception raised by an obstore call."""
    if isinstance(exc, oe.NotFoundError | FileNotFoundError):
        return ErrorKind.NOT_FOUND
    if isinstance(exc, oe.AlreadyExistsError | FileExistsError):
        return ErrorKind.EXISTS
    if isinstance(exc, ConnectionError | TimeoutError):
        return ErrorKind.TRANSIENT
    if isinstance(exc, oe.GenericError | oe.JoinError) and is_transient_message(str(exc)):
        return ErrorKind.TRANSIENT
    return ErrorKind.FATAL


def _is_conflict(exc: BaseException) -> bool:
    # S3 answers 409 ConditionalRequestConflict when conditional writes of one key race:
    # this write was not applied.
    return re.search(r"status(?: code)?:? 409\b|ConditionalRequestConflict", str(exc)) is not None


def error_summary(exc: BaseException) -> str:
    """The first line of an obstore error, without its multi-line debug dump."""
    text = str(exc).split("\n\nDebug source:", 1)[0].strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first if len(first) <= 300 else first[:300] + "..."


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Bounded retries: `attempts` tries per operation, full-jitter exponential backoff.

    `transport_retries` is obstore's own per-request retry count inside one
    attempt (it also retries single parts of a multipart upload); 0 makes
    this policy the only one.
    """

    attempts: int = 5
    base_delay: float = 0.2
    max_delay: float = 5.0
    transport_retries: int = 2

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_delay < 0 or self.max_delay < 0:
            raise ValueError(f"invalid retry policy {self}")

    def retries(self) -> Retries:
        """A new budget for one operation: waits drawn from [0, d], d = min(max_delay,
        base_delay * 2**n) before retry n (0-based)."""
        backoff = Backoff(base_s=self.base_delay, max_s=self.max_delay, jitter=1.0)
        return Retries(backoff, attempts=self.attempts)


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str | None
    last_modified: dt.datetime


@dataclass(frozen=True)
class Version:
    """Which version of an object a conditional write expects: the store's ETag (and
    object version where it keeps them), or the content's sha256 in a `file://` store.
    Only compare versions returned by `get_versioned`, `create` and `compare_and_swap`."""

    etag: str | None
    version: str | None = None


@dataclass(frozen=True)
class Versioned:
    """An object's content together with its version."""

    data: bytes
    version: Version


@dataclass
class StoreStatistics:
    bytes_uploaded: int = 0
    bytes_downloaded: int = 0
    requests: int = 0  # attempts of operations (a multipart upload counts once)
    retries: int = 0
    errors: int = 0  # operations that failed (a missing object is not an error)


def _info(meta: Mapping[str, Any]) -> ObjectInfo:
    return ObjectInfo(
        key=str(meta["path"]),
        size=int(meta["size"]),
        etag=meta.get("e_tag"),
        last_modified=meta["last_modified"],
    )


# -- the store ------------------------------------------------------------------


def open_object_store(
    url: str,
    *,
    config: Mapping[str, Any] | None = None,
    client_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    limiter: trio.CapacityLimiter | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    part_concurrency: int = 4,
    piece_size: int = DEFAULT_PIECE_SIZE,
) -> ObjectStore:
    """An `ObjectStore` for `url` (see the module docstring for the forms).

    `config` holds provider settings in obstore's names (S3: endpoint,
    access_key_id, secret_access_key, region, virtual_hosted_style_request,
    ...), overriding the environment; `client_options` are obstore's HTTP
    client options (allow_http, timeout, connect_timeout, ...).
    A `file://` directory is created if missing. Nothing is contacted here.
    """
    loc = parse_store_url(url)
    retry = retry or RetryPolicy()
    native: obstore.store.ObjectStore
    if loc.scheme == "file":
        if config or client_options:
            raise ValueError("a file:// store takes no config or client options")
        os.makedirs(loc.prefix, exist_ok=True)
        native = LocalStore(loc.prefix)
        where = f"file://{loc.prefix}"
    else:
        retry_config: dict[str, Any] = {
            "max_retries": retry.transport_retries,
            "backoff": {
                "init_backoff": dt.timedelta(seconds=min(retry.base_delay, 0.1)),
                "max_backoff": dt.timedelta(seconds=max(retry.max_delay, 0.1)),
                "base": 2,
            },
            "retry_timeout": dt.timedelta(seconds=60),
        }
        try:
            native = _obstore_from_url(
                url,
                config=cast(Any, dict(config or {})),
                client_options=cast(Any, _client_options(loc.scheme, client_options)),
                retry_config=cast(Any, retry_config),
            )
        except (oe.BaseError, ValueError) as exc:
            raise ValueError(f"cannot configure store {url!r}: {error_summary(exc)}") from exc
        where = f"{loc.scheme}://{loc.bucket}/{loc.prefix}".rstrip("/")
        endpoint = _native_config(native).get("endpoint") or _env_endpoint(loc.scheme)
        if endpoint:
            where += f" at {endpoint}"
    return ObjectStore(
        native,
        where=where,
        retry=retry,
        limiter=limiter or trio.CapacityLimiter(8),
        part_size=part_size,
        part_concurrency=part_concurrency,
        piece_size=piece_size,
    )


def _client_options(scheme: str, given: Mapping[str, Any] | None) -> dict[str, Any] | None:
    # obstore drops the client options it read from the environment (AWS_ALLOW_HTTP, ...)
    # as soon as any are passed: carry those over unless given explicitly.
    if not given:
        return None
    merged = dict(given)
    if scheme == "s3":
        for key in ("allow_http", "allow_invalid_certificates"):
            value = os.environ.get(f"AWS_{key.upper()}")
            if value is not None and key not in merged:
                merged[key] = value.strip().lower() in ("1", "true", "yes", "on")
    return merged


def _env_endpoint(scheme: str) -> str | None:
    # obstore reads the environment itself but `config` only shows explicit values.
    if scheme != "s3":
        return None
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
        if os.environ.get(name):
            return os.environ[name]
    return None


def _native_config(native: obstore.store.ObjectStore) -> Mapping[str, Any]:
    conf = getattr(native, "config", None)
    return conf if isinstance(conf, Mapping) else {}


PutOutcome = Literal["written", "exists", "unsupported"]


class ObjectStore:
    """Async (trio) object store operations; build one with `open_object_store`."""

    def __init__(
        self,
        native: obstore.store.ObjectStore,
        *,
        where: str,
        retry: RetryPolicy,
        limiter: trio.CapacityLimiter,
        part_size: int = DEFAULT_PART_SIZE,
        part_concurrency: int = 4,
        piece_size: int = DEFAULT_PIECE_SIZE,
    ) -> None:
        if part_size < 5 * MiB:
            raise ValueError("part_size must be at least 5 MiB (the S3 minimum part)")
        if piece_size < 1:
            raise ValueError("piece_size must be positive")
        self._native = native
        self.where = where
        self._retry = retry
        self._limiter = limiter
        self._part_size = part_size
        self._part_concurrency = part_concurrency
        self._piece_size = piece_size
        self._create_supported = True
        self._stats = StoreStatistics()
        # A directory store gets its conditional writes from FileCas (see there).
        self._files: FileCas | None = None
        if isinstance(native, LocalStore) and native.prefix is not None:
            self._files = FileCas(Path(native.prefix))

    def __repr__(self) -> str:
        return f"ObjectStore({self.where})"

    def statistics(self) -> StoreStatistics:
        return dataclasses.replace(self._stats)

    # -- retry shell ------------------------------------------------------------

    async def _call(
        self, op: str, key: str, fn: Callable[[], T], *, abandon_on_cancel: bool = False
    ) -> T:
        """Run `fn` in a worker thread, retrying transient failures within the policy."""
        retries = self._retry.retries()
        while True:
            self._stats.requests += 1
            try:
                return await trio.to_thread.run_sync(
                    fn, limiter=self._limiter, abandon_on_cancel=abandon_on_cancel
                )
            except StoreError:
                self._stats.errors += 1
                raise
            except Exception as exc:
                kind = classify_error(exc)
                if kind is ErrorKind.NOT_FOUND:
                    raise ObjectNotFound(key, self.where) from exc
                if kind is ErrorKind.TRANSIENT and (delay := retries.failed()) is not None:
                    self._stats.retries += 1
                    await trio.sleep(delay)
                    continue
                self._stats.errors += 1
                if kind is ErrorKind.TRANSIENT:
                    raise StoreUnavailable(
                        f"object store {self.where} unavailable: {op} {key!r} failed "
                        f"after {retries.failures} attempts: {error_summary(exc)}"
                    ) from exc
                raise StoreError(
                    f"object store {self.where}: {op} {key!r} failed: {error_summary(exc)}"
                ) from exc

    # -- basic operations ---------------------------------------------------------

    async def put(self, key: str, data: bytes | Path, *, if_absent: bool = False) -> bool:
        """Store `data` (bytes, or a file streamed from disk) at `key`, atomically.

        Objects larger than the part size go up as a multipart upload. With
        `if_absent`, an existing object is left alone; returns whether this
        call wrote the object. Small objects use the store's create-only put;
        large ones (and stores without it) check first, so a concurrent writer
        can win the race: fine for content-addressed data.
        """
        check_key(key)
        if isinstance(data, Path):
            path = data
            size = (await trio.to_thread.run_sync(path.stat)).st_size
        else:
            size = len(data)
        multipart = size > self._part_size
        create = if_absent and not multipart and self._create_supported
        if if_absent and not create and await self.exists(key):
            return False
        native = self._native
        mode: Literal["create", "overwrite"] = "create" if create else "overwrite"

        def run() -> PutOutcome:
            try:
                obstore.put(
                    native,
                    key,
                    data,
                    mode=mode,
                    use_multipart=multipart,
                    chunk_size=self._part_size,
                    max_concurrency=self._part_concurrency,
                )
            except (oe.AlreadyExistsError, FileExistsError):
                return "exists"
            except oe.NotSupportedError:
                if mode == "create":
                    return "unsupported"
                raise
            return "written"

        outcome = await self._call("put", key, run)
        if outcome == "unsupported":
            self._create_supported = False
            return await self.put(key, data, if_absent=if_absent)
        if outcome == "exists":
            return False
        self._stats.bytes_uploaded += size
        return True

    async def get(self, key: str) -> bytes:
        """The whole object; `ObjectNotFound` if missing."""
        check_key(key)
        native = self._native

        def run() -> bytes:
            return bytes(obstore.get(native, key).bytes())

        data = await self._call("get", key, run, abandon_on_cancel=True)
        self._stats.bytes_downloaded += len(data)
        return data

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes from `start`; shorter if the object ends first.

        A start at or past the end is a `StoreError`.
        """
        check_key(key)
        if start < 0 or length < 0:
            raise ValueError(f"invalid range start={start} length={length}")
        if length == 0:
            return b""
        native = self._native

        def run() -> bytes:
            return bytes(obstore.get_range(native, key, start=start, length=length))

        data = await self._call("get_range", key, run, abandon_on_cancel=True)
        self._stats.bytes_downloaded += len(data)
        return data

    async def head(self, key: str) -> ObjectInfo | None:
        """Size, etag and modification time of `key`, or None if it does not exist."""
        check_key(key)
        native = self._native

        def run() -> ObjectInfo:
            return _info(obstore.head(native, key))

        try:
            return await self._call("head", key, run, abandon_on_cancel=True)
        except ObjectNotFound:
            return None

    async def exists(self, key: str) -> bool:
        return await self.head(key) is not None

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object under `prefix`, recursively, sorted by key.

        Prefixes match whole path segments: "a/b" lists "a/b/c", not "a/bc".
        """
        if prefix:
            check_key(prefix.rstrip("/"))
        native = self._native

        hidden = f"{CAS_DIR}/" if self._files is not None else None

        def run() -> list[ObjectInfo]:
            metas = obstore.list(native, prefix.rstrip("/") or None).collect()
            found = (_info(m) for m in metas)
            if hidden is not None:
                found = (i for i in found if not i.key.startswith(hidden))
            return sorted(found, key=lambda i: i.key)

        return await self._call("list", prefix, run, abandon_on_cancel=True)

    async def delete(self, key: str) -> None:
        """Remove `key`; a missing key is fine."""
        check_key(key)
        native = self._native

        def run() -> None:
            obstore.delete(native, key)

        with contextlib.suppress(ObjectNotFound):
            await self._call("delete", key, run)

    # -- conditional writes -------------------------------------------------------------

    async def get_versioned(self, key: str) -> Versioned | None:
        """The object's content and the version a `compare_and_swap` compares, or None."""
        check_key(key)
        native, files = self._native, self._files

        def run() -> Versioned:
            if files is not None:
                found = files.read(key)
                if found is None:
                    raise FileNotFoundError(key)
                return Versioned(found[0], Version(found[1]))
            result = obstore.get(native, key)
            meta = result.meta
            return Versioned(bytes(result.bytes()), Version(meta.get("e_tag"), meta.get("version")))

        try:
            got = await self._call("get", key, run, abandon_on_cancel=True)
        except ObjectNotFound:
            return None
        self._stats.bytes_downloaded += len(got.data)
        return got

    async def create(self, key: str, data: bytes) -> Version | None:
        """Write `key` only if no object is there: its version, or None if one is.

        Atomic on every backend (S3 `If-None-Match: *`, GCS and Azure preconditions,
        `FileCas` for a directory); a backend without it is a `StoreError`, never a
        check-then-write. A transient failure is retried with the same request, so a
        None after retries can mean an earlier attempt of this call wrote the object:
        callers put something unique in `data` and read the object back to tell.
        A call cancelled while its request is out may still land, as one whose
        answer was lost.
        """
        check_key(key)
        native, files = self._native, self._files

        def run() -> Version | None:
            if files is not None:
                written = files.create(key, data)
                return None if written is None else Version(written)
            try:
                result = obstore.put(native, key, data, mode="create")
            except (oe.AlreadyExistsError, oe.PreconditionError, FileExistsError):
                return None
            except oe.GenericError as exc:
                if _is_conflict(exc):
                    return None
                raise
            return Version(result.get("e_tag"), result.get("version"))

        written = await self._call("create", key, run, abandon_on_cancel=True)
        if written is not None:
            self._stats.bytes_uploaded += len(data)
        return written

    async def compare_and_swap(self, key: str, data: bytes, *, expect: Version) -> Version | None:
        """Replace `key` only if it is still at version `expect`: the new version, or None
        if the object changed or is gone (S3 `If-Match`). The same caveat about retried
        attempts as for `create` applies."""
        check_key(key)
        native, files = self._native, self._files

        def run() -> Version | None:
            if files is not None:
                if expect.etag is None:
                    return None
                written = files.swap(key, data, expect.etag)
                return None if written is None else Version(written)
            mode: dict[str, str] = {}
            if expect.etag is not None:
                mode["e_tag"] = expect.etag
            if expect.version is not None:
                mode["version"] = expect.version
            if not mode:
                raise StoreError(f"object store {self.where}: {key!r} has no version to compare")
            try:
                result = obstore.put(native, key, data, mode=cast(Any, mode))
            except (oe.PreconditionError, oe.NotFoundError):
                return None
            except oe.GenericError as exc:
                if _is_conflict(exc):
                    return None
                raise
            return Version(result.get("e_tag"), result.get("version"))

        written = await self._call("compare_and_swap", key, run, abandon_on_cancel=True)
        if written is not None:
            self._stats.bytes_uploaded += len(data)
        return written

    async def download(self, key: str, path: Path) -> ObjectInfo:
        """Stream `key` into the file `path` (replaced atomically once complete)."""
        return await self._download(key, path, expect=None)

    async def _download(self, key: str, path: Path, *, expect: str | None) -> ObjectInfo:
        check_key(key)
        info = await self.head(key)
        if info is None:
            raise ObjectNotFound(key, self.where)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.part")
        native = self._native
        etag = info.etag
        hasher = hashlib.sha256() if expect is not None else None
        f = await trio.to_thread.run_sync(tmp.open, "wb")
        try:
            for start in range(0, info.size, self._piece_size):
                end = min(info.size, start + self._piece_size)

                def run(start: int = start, end: int = end) -> int:
                    opts: dict[str, Any] = {"range": (start, end)}
                    if etag is not None:
                        opts["if_match"] = etag
                    try:
                        buf = obstore.get(native, key, options=cast(Any, opts)).bytes()
                    except oe.PreconditionError as exc:
                        raise StoreError(
                            f"object store {self.where}: {key!r} changed during download"
                        ) from exc
                    view = memoryview(buf)
                    if len(view) != end - start:
                        raise StoreError(
                            f"object store {self.where}: short read of {key!r} at {start}"
                        )
                    f.seek(start)
                    f.write(view)
                    if hasher is not None:
                        hasher.update(view)
                    return len(view)

                self._stats.bytes_downloaded += await self._call("download", key, run)

            def finish() -> None:
                f.flush()
                os.fsync(f.fileno())
                f.close()

            await trio.to_thread.run_sync(finish, limiter=self._limiter)
            if hasher is not None and expect is not None:
                actual = "sha256:" + hasher.hexdigest()
                if actual != expect:
                    raise CorruptObject(
                        f"object store {self.where}: blob {key!r} hashes to {actual}, "
                        f"expected {expect}"
                    )
            await trio.to_thread.run_sync(os.replace, tmp, path)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_discard, f, tmp)
            raise
        return info

    # -- content-addressed blobs ------------------------------------------------------

    async def put_blob(
        self, data: bytes | Path, *, digest: str | None = None, rewrite: bool = False
    ) -> str:
        """Store content under its sha256 unless already there; returns "sha256:<hex>".

        If `digest` is given, the content must hash to it (else `CorruptObject`).
        With `rewrite`, the blob is written even if present (the same bytes: what
        changes is its modification time, which garbage collection reads).
        A file must not change while it is being stored.
        """
        if digest is not None:
            blob_key(digest)  # validates the form
        actual = await trio.to_thread.run_sync(content_digest, data, limiter=self._limiter)
        if digest is not None and digest != actual:
            raise CorruptObject(f"content hashes to {actual}, not the given {digest}")
        await self.put(blob_key(actual), data, if_absent=not rewrite)
        return actual

    async def get_blob(self, digest: str) -> bytes:
        """The blob's bytes, verified against `digest`; `CorruptObject` if they differ."""
        key = blob_key(digest)
        data = await self.get(key)
        actual = await trio.to_thread.run_sync(content_digest, data, limiter=self._limiter)
        if actual != digest:
            raise CorruptObject(
                f"object store {self.where}: blob {key!r} hashes to {actual}, expected {digest}"
            )
        return data

    async def download_blob(self, digest: str, path: Path) -> None:
        """Stream a blob into `path`, verified before it is renamed into place."""
        await self._download(blob_key(digest), path, expect=digest)

    async def has_blob(self, digest: str) -> bool:
        return await self.exists(blob_key(digest))

    async def blob_info(self, digest: str) -> ObjectInfo | None:
        return await self.head(blob_key(digest))


def content_digest(data: bytes | Path) -> str:
    """ "sha256:<hex>" of bytes or of a file's contents: a blob's name (blocking)."""
    h = hashlib.sha256()
    if isinstance(data, Path):
        with data.open("rb") as f:
            while block := f.read(MiB):
                h.update(block)
    else:
        h.update(data)
    return "sha256:" + h.hexdigest()


def _discard(f: Any, tmp: Path) -> None:
    with contextlib.suppress(OSError):
        f.close()
    with contextlib.suppress(OSError):
        tmp.unlink()
