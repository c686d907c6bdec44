"""`GET /files` (download) and `POST /files` (upload) of envd's HTTP API.

Downloads stream the file in chunks (gzip when the client accepts it).
Uploads take multipart/form-data (one or several `file` parts; the target is
the `path` query parameter or each part's filename) or application/octet-stream
(optionally gzip-encoded, `path` required) and stream to disk through a
bounded buffer, creating parent directories and the file as the requesting
user. `X-Metadata-<key>` headers become `user.e2b.<key>` extended attributes.
The answer is the JSON list of written entries the SDKs expect. When an access
token is set, a request needs the token header or a valid v1 signature.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import posixpath
import time
import zlib
from typing import Any

import trio

from aenv.envd.asgi import ClientDisconnected, Request, Response
from aenv.envd.filesystem import METADATA_PREFIX, read_metadata
from aenv.envd.multipart import (
    Done,
    MultipartError,
    MultipartParser,
    PartData,
    PartEnd,
    PartStart,
    boundary_of,
    parse_header_params,
)
from aenv.envd.state import EnvdState
from aenv.envd.users import UnknownUser, User, UserDB, ensure_dirs, resolve_path

READ_CHUNK = 256 * 1024
GZIP_MIN = 1024
WRITE_BUFFER = 1024 * 1024
MAX_METADATA_TOTAL = 4096
MAX_METADATA_KEY = 255 - len(METADATA_PREFIX)


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def signature(path: str, operation: str, username: str, token: str, expiration: int | None) -> str:
    raw = f"{path}:{operation}:{username}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


class FilesAPI:
    def __init__(self, state: EnvdState, users: UserDB) -> None:
        self._state = state
        self._users = users

    # ------------------------------------------------------------ helpers

    def _authorize(self, request: Request, operation: str) -> None:
        token = self._state.access_token
        if token is None:
            return
        header = request.headers.get("x-access-token")
        if header is not None:
            if not self._state.token_ok(header):
                raise HTTPError(401, "access token present in header but does not match")
            return
        sig = request.query_one("signature")
        if sig is None:
            raise HTTPError(401, "missing signature query parameter")
        raw_exp = request.query_one("signature_expiration")
        expiration: int | None = None
        if raw_exp is not None:
            try:
                expiration = int(raw_exp)
            except ValueError:
                raise HTTPError(401, "invalid signature expiration") from None
            if expiration < time.time():
                raise HTTPError(401, "signature is already expired")
        expected = signature(
            request.query_one("path") or "",
            operation,
            request.query_one("username") or "",
            token,
            expiration,
        )
        if not hmac.compare_digest(expected.encode(), sig.encode()):
            raise HTTPError(401, "invalid signature")

    def _user(self, request: Request) -> User:
        name = request.query_one("username") or self._state.default_user
        try:
            return self._users.lookup(name)
        except UnknownUser as e:
            raise HTTPError(401, f"error looking up user '{name}': {e}") from None

    def _resolve(self, raw: str, user: User) -> str:
        try:
            return resolve_path(raw, user, self._state.default_workdir)
        except ValueError as e:
            raise HTTPError(400, str(e)) from None

    async def handle(self, request: Request, response: Response) -> None:
        try:
            if request.method == "GET":
                await self._download(request, response)
            elif request.method == "POST":
                await self._upload(request, response)
            else:
                raise HTTPError(405, "method not allowed")
        except HTTPError as e:
            if not response.started:
                await response.error(e.status, e.message)
        except ClientDisconnected:
            return

    # ----------------------------------------------------------- download

    async def _download(self, request: Request, response: Response) -> None:
        self._authorize(request, "read")
        user = self._user(request)
        path = self._resolve(request.query_one("path") or "", user)

        def open_file() -> tuple[Any, int, bytes]:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise HTTPError(404, f"path '{path}' does not exist") from None
            except OSError as e:
                raise HTTPError(500, f"error checking if path exists: {e}") from None
            if os.path.isdir(path):
                raise HTTPError(400, f"path '{path}' is a directory")
            try:
                fobj = open(path, "rb")  # noqa: SIM115 (closed after the response)
            except PermissionError as e:
                raise HTTPError(401, f"error opening file '{path}': {e}") from None
            except OSError as e:
                raise HTTPError(500, f"error opening file '{path}': {e}") from None
            try:  # (the first chunk in the same thread hop: all of a small file)
                return fobj, st.st_size, fobj.read(READ_CHUNK)
            except BaseException:
                fobj.close()
                raise

        fobj, size, chunk = await trio.to_thread.run_sync(open_file)
        try:
            # (below a segment's worth, compressing saves no packet)
            gzip_ok = size >= GZIP_MIN and _accepts_gzip(request.headers.get("accept-encoding", ""))
            name = posixpath.basename(path).replace('"', '\\"')
            headers = [
                ("content-type", "application/octet-stream"),
                ("content-disposition", f'inline; filename="{name}"'),
                ("vary", "Accept-Encoding"),
                ("cache-control", "no-store"),
            ]
            compressor = None
            if gzip_ok:
                headers.append(("content-encoding", "gzip"))
                compressor = zlib.compressobj(6, zlib.DEFLATED, 31)
            else:
                headers.append(("content-length", str(size)))
            await response.start(200, headers)
            sent = 0
            while True:
                if not chunk:
                    break
                if compressor is None:
                    if sent + len(chunk) > size:  # file grew: keep Content-Length honest
                        chunk = chunk[: size - sent]
                    sent += len(chunk)
                    if sent >= size:  # the last chunk ends the response (one write)
                        await response.write(chunk, more=False)
                        return
                    if chunk:
                        await response.write(chunk)
                else:
                    out = compressor.compress(chunk)
                    if out:
                        await response.write(out)
                chunk = await trio.to_thread.run_sync(fobj.read, READ_CHUNK)
            if compressor is not None:
                await response.write(compressor.flush())
            await response.end()
        finally:
            fobj.close()

    # ------------------------------------------------------------- upload

    async def _upload(self, request: Request, response: Response) -> None:
        raw_path = request.query_one("path")
        self._authorize(request, "write")
        user = self._user(request)
        metadata = _metadata_from_headers(request.header_list)
        media, _ = parse_header_params(request.headers.get("content-type", ""))
        if media == "application/octet-stream":
            if not raw_path:
                raise HTTPError(400, "path query parameter is required for octet-stream uploads")
            target = self._resolve(raw_path, user)
            encoding = request.headers.get("content-encoding", "").strip().lower()
            if encoding not in ("", "identity", "gzip"):
                raise HTTPError(400, f"unsupported Content-Encoding {encoding!r}")
            writer = _FileWriter(target, user, metadata)
            try:
                decomp = zlib.decompressobj(wbits=47) if encoding == "gzip" else None
                async for chunk in request.iter_body():
                    if decomp is not None:
                        try:
                            chunk = decomp.decompress(chunk)
                        except zlib.error as e:
                            raise HTTPError(400, f"error decompressing request body: {e}") from None
                    await writer.write(chunk)
                if decomp is not None and not decomp.eof:
                    raise HTTPError(400, "error decompressing request body: truncated gzip data")
                await writer.finish()
            finally:
                await writer.abort()
            results = [writer.result()]
        elif media.startswith("multipart/"):
            results = await self._upload_multipart(request, user, raw_path, metadata)
        else:
            raise HTTPError(
                400,
                f"unsupported content type: {request.headers.get('content-type', '')}, "
                "expected multipart/form-data or application/octet-stream",
            )
        await response.json(200, results)

    async def _upload_multipart(
        self, request: Request, user: User, raw_path: str | None, metadata: dict[str, str]
    ) -> list[dict[str, Any]]:
        boundary = boundary_of(request.headers.get("content-type", ""))
        if boundary is None:
            raise HTTPError(400, "multipart body without boundary")
        try:
            parser = MultipartParser(boundary)
        except MultipartError as e:
            raise HTTPError(400, str(e)) from None
        results: list[dict[str, Any]] = []
        writer: _FileWriter | None = None
        skipping = False
        try:
            async for chunk in request.iter_body():
                try:
                    events = parser.feed(chunk)
                except MultipartError as e:
                    raise HTTPError(400, f"invalid multipart body: {e}") from None
                for event in events:
                    if isinstance(event, PartStart):
                        if event.name != "file":
                            skipping = True
                            continue
                        skipping = False
                        name = raw_path if raw_path else event.filename
                        if not name:
                            raise HTTPError(400, "file part without filename and no path given")
                        target = self._resolve(name, user)
                        if any(r["path"] == target for r in results):
                            raise HTTPError(
                                400,
                                f"you cannot upload multiple files to the same path '{target}' "
                                "in one upload request, only the first specified file was uploaded",
                            )
                        writer = _FileWriter(target, user, metadata)
                    elif isinstance(event, PartData):
                        if writer is not None and not skipping:
                            await writer.write(event.data)
                    elif isinstance(event, PartEnd):
                        if writer is not None:
                            await writer.finish()
                            results.append(writer.result())
                            writer = None
                    elif isinstance(event, Done):
                        pass
            try:
                parser.close()
            except MultipartError as e:
                raise HTTPError(400, f"invalid multipart body: {e}") from None
        finally:
            if writer is not None:
                await writer.abort()
        return results


def _accepts_gzip(header: str) -> bool:
    for item in header.split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() == "gzip":
            q = params.strip()
            return not (q.startswith("q=") and q[2:].strip() in ("0", "0.0", "0.00", "0.000"))
    return False


def _metadata_from_headers(headers: list[tuple[str, str]]) -> dict[str, str]:
    metadata: dict[str, str] = {}
    for name, value in headers:
        if not name.startswith("x-metadata-"):
            continue
        key = name[len("x-metadata-") :]
        if key and key not in metadata:
            metadata[key] = value
    total = 0
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise HTTPError(
                400, f"invalid metadata: metadata key {key!r} exceeds {MAX_METADATA_KEY} bytes"
            )
        for label, text in (("key", key), (f"value for key {key!r}", value)):
            if any(not 0x20 <= ord(c) <= 0x7E for c in text):
                raise HTTPError(
                    400, f"invalid metadata: metadata {label} contains non-printable-ASCII"
                )
        total += len(METADATA_PREFIX) + len(key) + len(value)
    if total > MAX_METADATA_TOTAL:
        raise HTTPError(
            400, f"invalid metadata: total metadata size {total} exceeds {MAX_METADATA_TOTAL} bytes"
        )
    return metadata


class _FileWriter:
    """Writes one uploaded file through a bounded buffer, in worker threads.

    The file is opened with its first full buffer, or at `finish`: a small
    file is created, written and closed in one worker-thread hop."""

    def __init__(self, path: str, user: User, metadata: dict[str, str]) -> None:
        self.path = path
        self._user = user
        self._fd: int | None = None
        self._metadata = metadata
        self._buf = bytearray()
        self._stored_metadata: dict[str, str] = {}

    def _open(self) -> None:  # (in a worker thread)
        path, user = self.path, self._user
        try:
            ensure_dirs(posixpath.dirname(path), user.uid, user.gid)
        except OSError as e:
            raise HTTPError(500, f"error ensuring directories: {e}") from None
        if os.path.isdir(path):
            raise HTTPError(400, f"path is a directory: {path}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        except OSError as e:
            status = 507 if e.errno == 28 else 500
            raise HTTPError(status, f"error opening file: {e}") from None
        try:
            os.fchown(fd, user.uid, user.gid)
        except OSError as e:
            os.close(fd)
            raise HTTPError(500, f"error changing file ownership: {e}") from None
        self._fd = fd

    def _write_all(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as e:
            if e.errno in (28, 122):  # ENOSPC, EDQUOT
                raise HTTPError(507, "not enough disk space available") from None
            raise HTTPError(500, f"error writing file: {e}") from None

    async def write(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) >= WRITE_BUFFER:
            chunk, self._buf = bytes(self._buf), bytearray()

            def work() -> None:
                if self._fd is None:
                    self._open()
                self._write_all(chunk)

            await trio.to_thread.run_sync(work)

    async def finish(self) -> None:
        chunk, self._buf = bytes(self._buf), bytearray()

        def work() -> None:
            if self._fd is None:
                self._open()
            if chunk:
                self._write_all(chunk)
            assert self._fd is not None
            self._apply_metadata(self._fd)
            os.close(self._fd)
            self._fd = None
            self._stored_metadata = read_metadata(self.path)

        await trio.to_thread.run_sync(work)

    def _apply_metadata(self, fd: int) -> None:
        try:
            existing = os.listxattr(fd)
        except OSError:
            if self._metadata:
                raise HTTPError(500, "filesystem does not support file metadata") from None
            return
        for name in existing:
            if (
                name.startswith(METADATA_PREFIX)
                and name[len(METADATA_PREFIX) :] not in self._metadata
            ):
                with contextlib.suppress(OSError):
                    os.removexattr(fd, name)
        for key, value in self._metadata.items():
            try:
                os.setxattr(fd, METADATA_PREFIX + key, value.encode())
            except OSError as e:
                status = 507 if e.errno in (28, 122) else 500
                raise HTTPError(status, f"error writing file metadata: {e}") from None

    async def abort(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(os.close, fd)

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": self.path,
            "name": posixpath.basename(self.path),
            "type": "file",
        }
        if self._stored_metadata:
            out["metadata"] = self._stored_metadata
        return out


__all__ = ["FilesAPI", "HTTPError", "signature"]
