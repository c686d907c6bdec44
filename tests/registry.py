"""A real OCI registry for tests, an image builder that pushes to it, and reference tools.

`LocalRegistry` runs Debian's `docker-registry` (distribution 2.8) on a free
loopback port with its storage in a temp dir, with or without htpasswd basic
auth; the session fixtures `registry` and `registry_auth` hand one out and
check at teardown that its process is gone. Images are made from real tar
layers: `Layer.build` writes a PAX tar of `Member`s (files, dirs, symlinks,
hard links, devices, fifos, whiteouts, opaque markers, xattrs), compressed
with gzip, zstd or nothing, straight to a temp file while hashing it (blob
digest and diff_id), so big layers never sit in memory; `push_image` uploads
the blobs (monolithic, or chunked PATCHes streamed from the file for big ones)
and writes the image config and an OCI or Docker v2 manifest; `push_index`
ties per-platform images into a multi-arch OCI index. `reference_unpack`
unpacks an image with skopeo + umoci and `compare_trees` lists every
difference between two trees, to hold aenv's lazy root filesystem against
what the reference tools produce.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import io
import json
import os
import random
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tarfile
import tempfile
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import httpx
import pytest

__all__ = [
    "BUSYBOX_CONFIG",
    "MTIME",
    "Compression",
    "Layer",
    "LocalRegistry",
    "Member",
    "PushedImage",
    "PushedIndex",
    "PushedLayer",
    "blockdev",
    "busybox_applets",
    "busybox_layer",
    "busybox_members",
    "chardev",
    "compare_trees",
    "directory",
    "fifo",
    "file",
    "file_from",
    "hardlink",
    "opaque",
    "push_big_image",
    "push_busybox",
    "push_image",
    "push_index",
    "push_rootfs_dir",
    "random_bytes",
    "random_file",
    "reference_unpack",
    "registry",
    "registry_auth",
    "scratch_dir",
    "snapshot_tree",
    "symlink",
    "whiteout",
]

REGISTRY_BIN = "/usr/bin/docker-registry"
BUSYBOX = Path("/bin/busybox")
MTIME = 1_700_000_000  # every builder entry's default mtime: layers are reproducible
MiB = 1 << 20
CHUNKED_UPLOAD_OVER = 64 * MiB  # blobs bigger than this go up in PATCH chunks
UPLOAD_CHUNK = 16 * MiB

Compression = Literal["gzip", "zstd", "none"]

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = {
    "none": "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = {
    "none": "application/vnd.docker.image.rootfs.diff.tar",
    "gzip": "application/vnd.docker.image.rootfs.diff.tar.gzip",
}


# -- registry process ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: the registry dies if the test process is killed outright.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class LocalRegistry:
    """A `docker-registry serve` process on 127.0.0.1:PORT, storage under `workdir`.

    With `auth=True` it demands HTTP basic auth against a bcrypt htpasswd file
    holding `username`/`password` (a random password unless given).
    """

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        auth: bool = False,
        username: str = "aenv",
        password: str | None = None,
    ) -> None:
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="aenv-test-registry-"))
        if self._own_workdir:
            atexit.register(shutil.rmtree, self.workdir, True)
        self.root = self.workdir / "storage"
        self.auth = auth
        self.username = username if auth else None
        self.password = (password or secrets.token_urlsafe(12)) if auth else None
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.config_path = self.workdir / "config.yml"
        self.log_path = self.workdir / "registry.log"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    @property
    def credentials(self) -> tuple[str, str] | None:
        if self.username is None or self.password is None:
            return None
        return (self.username, self.password)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _write_config(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        lines = [
            "version: 0.1",
            "log:",
            "  level: warn",
            "  accesslog:",
            "    disabled: true",
            "storage:",
            "  filesystem:",
            f"    rootdirectory: {self.root}",
            "  delete:",
            "    enabled: true",
            "  maintenance:",
            "    uploadpurging:",
            "      enabled: false",
            "http:",
            f"  addr: 127.0.0.1:{self.port}",
            f"  secret: {secrets.token_hex(16)}",
        ]
        if self.auth:
            import bcrypt

            assert self.username is not None and self.password is not None
            hashed = bcrypt.hashpw(self.password.encode(), bcrypt.gensalt(rounds=4)).decode()
            htpasswd = self.workdir / "htpasswd"
            htpasswd.write_text(f"{self.username}:{hashed}\n")
            lines += [
                "auth:",
                "  htpasswd:",
                "    realm: aenv-test",
                f"    path: {htpasswd}",
            ]
        self.config_path.write_text("\n".join(lines) + "\n")

    def start(self, *, timeout: float = 20, keep_port: bool = False) -> LocalRegistry:
        """Start (or restart after `stop()`, same storage); `keep_port` reuses the last port."""
        if self.alive():
            raise RuntimeError("registry already running")
        if not Path(REGISTRY_BIN).exists():
            raise FileNotFoundError(f"{REGISTRY_BIN} missing (Debian package docker-registry)")
        last = ""
        reuse = keep_port and self.port != 0
        for _attempt in range(1 if reuse else 5):  # a free port can be taken before the bind
            if not reuse:
                self.port = _free_port()
            self._write_config()
            with self.log_path.open("ab") as log:
                in_main = threading.current_thread() is threading.main_thread()
                self.proc = subprocess.Popen(
                    [REGISTRY_BIN, "serve", str(self.config_path)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # the death signal follows the forking *thread*: only tie it to the main one
                    preexec_fn=_die_with_parent if in_main else None,
                )
            try:
                if self._wait_ready(timeout):
                    return self
            except BaseException:
                self.stop()
                raise
            last = self.log_tail()
            self.stop()
        raise RuntimeError(f"docker-registry did not start:\n{last}")

    def _wait_ready(self, timeout: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                r = httpx.get(f"{self.url}/v2/", timeout=1)
                if r.status_code in (200, 401):
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cleanup(self) -> None:
        """Stop and delete the work dir (when this object made it)."""
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalRegistry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def _processes_using(path: Path) -> list[str]:
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "docker-registry" in line and str(path) in line]


@contextlib.contextmanager
def running_registry(tmp: Path, *, auth: bool) -> Iterator[LocalRegistry]:
    if not Path(REGISTRY_BIN).exists():
        pytest.skip(f"needs {REGISTRY_BIN} (Debian package docker-registry)")
    reg = LocalRegistry(tmp, auth=auth)
    reg.start()
    try:
        yield reg
    finally:
        reg.stop()
        left = _processes_using(reg.config_path)
        assert not left, f"registry process left behind: {left}"


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    """A registry without auth, shared by the session: use distinct repo names per test."""
    with running_registry(tmp_path_factory.mktemp("registry"), auth=False) as reg:
        yield reg


@pytest.fixture(scope="session")
def registry_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    """A registry demanding basic auth; `.username`/`.password` are accepted."""
    with running_registry(tmp_path_factory.mktemp("registry-auth"), auth=True) as reg:
        yield reg


# -- layer members -------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """One tar entry. Build with `file`, `directory`, `symlink`, ... rather than by hand."""

    path: str
    type: bytes  # a tarfile type: REGTYPE, DIRTYPE, SYMTYPE, LNKTYPE, CHRTYPE, BLKTYPE, FIFOTYPE
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime: int = MTIME
    data: bytes = b""
    source: Path | None = None  # regular file content read from this host file
    random_size: int = 0  # regular file content: this many seeded random bytes
    seed: int = 0
    linkname: str = ""
    devmajor: int = 0
    devminor: int = 0
    xattrs: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def size(self) -> int:
        if self.type != tarfile.REGTYPE:
            return 0
        if self.source is not None:
            return self.source.stat().st_size
        return self.random_size or len(self.data)


def _norm(path: str) -> str:
    p = path.strip("/")
    while p.startswith("./"):
        p = p[2:]
    return p


def _xattrs(x: Mapping[str, bytes | str] | None) -> dict[str, bytes]:
    return {k: v.encode() if isinstance(v, str) else v for k, v in (x or {}).items()}


def file(
    path: str,
    content: bytes | str = b"",
    *,
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    mtime: int = MTIME,
    xattrs: Mapping[str, bytes | str] | None = None,
) -> Member:
    data = content.encode() if isinstance(content, str) else content
    return Member(
        _norm(path), tarfile.REGTYPE, mode, uid, gid, mtime, data=data, xattrs=_xattrs(xattrs)
    )


def file_from(
    path: str,
    source: Path,
    *,
    mode: int | None = None,
    uid: int = 0,
    gid: int = 0,
    mtime: int = MTIME,
) -> Member:
    """A regular file whose content is streamed from `source` on the host."""
    m = stat.S_IMODE(source.stat().st_mode) if mode is None else mode
    return Member(_norm(path), tarfile.REGTYPE, m, uid, gid, mtime, source=Path(source))


def random_file(
    path: str, size: int, *, seed: int = 0, mode: int = 0o644, uid: int = 0, gid: int = 0
) -> Member:
    """A regular file of `size` incompressible bytes, reproducible from `seed`."""
    return Member(_norm(path), tarfile.REGTYPE, mode, uid, gid, random_size=size, seed=seed)


def random_bytes(size: int, *, seed: int = 0) -> bytes:
    """The content `random_file(..., size, seed=seed)` holds (for small sizes)."""
    return _RandomReader(size, seed).read(size)


def directory(
    path: str,
    *,
    mode: int = 0o755,
    uid: int = 0,
    gid: int = 0,
    mtime: int = MTIME,
    xattrs: Mapping[str, bytes | str] | None = None,
) -> Member:
    return Member(_norm(path), tarfile.DIRTYPE, mode, uid, gid, mtime, xattrs=_xattrs(xattrs))


def symlink(path: str, target: str, *, uid: int = 0, gid: int = 0, mtime: int = MTIME) -> Member:
    return Member(_norm(path), tarfile.SYMTYPE, 0o777, uid, gid, mtime, linkname=target)


def hardlink(path: str, target: str) -> Member:
    """A hard link to `target`, a path earlier in this layer or in a lower one."""
    return Member(_norm(path), tarfile.LNKTYPE, 0o644, linkname=_norm(target))


def chardev(
    path: str, major: int, minor: int, *, mode: int = 0o666, uid: int = 0, gid: int = 0
) -> Member:
    return Member(_norm(path), tarfile.CHRTYPE, mode, uid, gid, devmajor=major, devminor=minor)


def blockdev(
    path: str, major: int, minor: int, *, mode: int = 0o660, uid: int = 0, gid: int = 0
) -> Member:
    return Member(_norm(path), tarfile.BLKTYPE, mode, uid, gid, devmajor=major, devminor=minor)


def fifo(path: str, *, mode: int = 0o644, uid: int = 0, gid: int = 0) -> Member:
    return Member(_norm(path), tarfile.FIFOTYPE, mode, uid, gid)


def whiteout(path: str) -> Member:
    """Removes `path` (and everything under it) of the lower layers."""
    parent, _, name = _norm(path).rpartition("/")
    return Member(f"{parent}/.wh.{name}" if parent else f".wh.{name}", tarfile.REGTYPE, 0o600)


def opaque(path: str) -> Member:
    """Hides what lower layers hold under directory `path` (the dir itself stays)."""
    p = _norm(path)
    return Member(f"{p}/.wh..wh..opq" if p else ".wh..wh..opq", tarfile.REGTYPE, 0o600)


# -- layers --------------------------------------------------------------------

_scratch_dir: Path | None = None
_scratch_lock = threading.Lock()


def scratch_dir() -> Path:
    """A process-wide temp dir for layer files, removed at interpreter exit."""
    global _scratch_dir
    with _scratch_lock:
        if _scratch_dir is None:
            _scratch_dir = Path(tempfile.mkdtemp(prefix="aenv-test-layers-"))
            atexit.register(shutil.rmtree, _scratch_dir, True)
        return _scratch_dir


class _RandomReader:
    def __init__(self, size: int, seed: int) -> None:
        self.left = size
        self.rng = random.Random(seed)
        self.sha = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        self.left -= n
        b = self.rng.randbytes(n)
        self.sha.update(b)
        return b


class _Sink(io.RawIOBase):
    """What tarfile writes into: hashes the tar (diff_id), compresses, hashes and stores."""

    def __init__(self, out: BinaryIO, compression: Compression, level: int) -> None:
        self.out = out
        self.diff = hashlib.sha256()
        self.blob = hashlib.sha256()
        self.pos = 0
        self.blob_size = 0
        self.comp: Any
        if compression == "gzip":
            self.comp = zlib.compressobj(level, zlib.DEFLATED, 31)  # 31: gzip framing, mtime 0
        elif compression == "zstd":
            import zstandard

            self.comp = zstandard.ZstdCompressor(level=level).compressobj()
        elif compression == "none":
            self.comp = None
        else:
            raise ValueError(f"unknown compression {compression!r}")

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        b = bytes(b)
        self.diff.update(b)
        self.pos += len(b)
        self._emit(self.comp.compress(b) if self.comp is not None else b)
        return len(b)

    def tell(self) -> int:
        return self.pos

    def _emit(self, b: bytes) -> None:
        if b:
            self.blob.update(b)
            self.blob_size += len(b)
            self.out.write(b)

    def finish(self) -> None:
        if self.comp is not None:
            self._emit(self.comp.flush())


@dataclass
class Layer:
    """A layer blob on disk (in `scratch_dir()` unless told otherwise) and its hashes."""

    path: Path
    compression: Compression
    digest: str  # sha256 of the blob as stored
    size: int
    diff_id: str  # sha256 of the uncompressed tar
    tar_size: int
    contents: dict[str, str] = field(default_factory=dict)  # random files: path -> sha256 hex

    def media_type(self, *, docker: bool = False) -> str:
        table = DOCKER_LAYER if docker else OCI_LAYER
        if self.compression not in table:
            raise ValueError(f"no Docker v2 media type for a {self.compression} layer")
        return table[self.compression]

    def tar_bytes(self) -> bytes:
        """The uncompressed tar (small layers only)."""
        raw = self.path.read_bytes()
        if self.compression == "gzip":
            return zlib.decompress(raw, 31)
        if self.compression == "zstd":
            import zstandard

            return zstandard.ZstdDecompressor().decompressobj().decompress(raw)
        return raw

    def delete(self) -> None:
        self.path.unlink(missing_ok=True)

    @classmethod
    def _write(
        cls,
        fill: Any,
        *,
        compression: Compression,
        level: int | None,
        dest_dir: Path | None,
    ) -> Layer:
        lvl = level if level is not None else (1 if compression != "none" else 0)
        fd, name = tempfile.mkstemp(dir=dest_dir or scratch_dir(), suffix=".layer")
        contents: dict[str, str] = {}
        try:
            with os.fdopen(fd, "wb", buffering=MiB) as out:
                sink = _Sink(out, compression, lvl)
                with tarfile.TarFile(
                    fileobj=sink,
                    mode="w",
                    format=tarfile.PAX_FORMAT,
                    copybufsize=MiB,
                ) as tar:
                    fill(tar, contents)
                sink.finish()
        except BaseException:
            os.unlink(name)
            raise
        final = Path(name).with_name("sha256-" + sink.blob.hexdigest() + ".layer")
        os.replace(name, final)
        return cls(
            path=final,
            compression=compression,
            digest="sha256:" + sink.blob.hexdigest(),
            size=sink.blob_size,
            diff_id="sha256:" + sink.diff.hexdigest(),
            tar_size=sink.pos,
            contents=contents,
        )

    @classmethod
    def build(
        cls,
        members: Iterable[Member],
        *,
        compression: Compression = "gzip",
        level: int | None = None,
        dest_dir: Path | None = None,
    ) -> Layer:
        """A layer holding `members` in this order, exactly (no implied parent dirs)."""

        def fill(tar: tarfile.TarFile, contents: dict[str, str]) -> None:
            for m in members:
                _add_member(tar, m, contents)

        return cls._write(fill, compression=compression, level=level, dest_dir=dest_dir)

    @classmethod
    def from_dir(
        cls,
        root: Path,
        *,
        compression: Compression = "gzip",
        level: int | None = None,
        dest_dir: Path | None = None,
    ) -> Layer:
        """A layer of everything under `root` (owners, modes, hard links, devices, xattrs)."""
        root = Path(root)

        def keep(ti: tarfile.TarInfo) -> tarfile.TarInfo:
            ti.uname = ti.gname = ""
            host = root / ti.name
            try:
                names = os.listxattr(host, follow_symlinks=False)
            except OSError:
                names = []
            for n in sorted(names):
                if n.startswith("trusted.") or n == "security.selinux":
                    continue
                with contextlib.suppress(OSError):
                    val = os.getxattr(host, n, follow_symlinks=False)
                    _set_xattr(ti, n, val)
            return ti

        def fill(tar: tarfile.TarFile, contents: dict[str, str]) -> None:
            for name in sorted(os.listdir(root)):
                tar.add(root / name, arcname=name, recursive=True, filter=keep)

        return cls._write(fill, compression=compression, level=level, dest_dir=dest_dir)


def _set_xattr(ti: tarfile.TarInfo, name: str, value: bytes) -> None:
    headers = dict(ti.pax_headers)
    try:
        headers["SCHILY.xattr." + name] = value.decode("utf-8")
    except UnicodeDecodeError:
        headers["hdrcharset"] = "BINARY"  # tarfile then writes values back byte for byte
        headers["SCHILY.xattr." + name] = value.decode("utf-8", "surrogateescape")
    ti.pax_headers = headers


def _add_member(tar: tarfile.TarFile, m: Member, contents: dict[str, str]) -> None:
    ti = tarfile.TarInfo(m.path)
    ti.type = m.type
    ti.mode = m.mode
    ti.uid, ti.gid = m.uid, m.gid
    ti.uname = ti.gname = ""
    ti.mtime = m.mtime
    ti.linkname = m.linkname
    ti.devmajor, ti.devminor = m.devmajor, m.devminor
    for name, value in m.xattrs.items():
        _set_xattr(ti, name, value)
    if m.type != tarfile.REGTYPE:
        tar.addfile(ti)
        return
    ti.size = m.size
    if m.source is not None:
        with m.source.open("rb") as f:
            tar.addfile(ti, f)
    elif m.random_size:
        reader = _RandomReader(m.random_size, m.seed)
        tar.addfile(ti, reader)  # type: ignore[arg-type,unused-ignore]
        contents[m.path] = reader.sha.hexdigest()
    else:
        tar.addfile(ti, io.BytesIO(m.data))


# -- pushing -------------------------------------------------------------------


@dataclass(frozen=True)
class PushedLayer:
    digest: str
    diff_id: str
    size: int
    media_type: str


@dataclass(frozen=True)
class PushedImage:
    host: str  # "127.0.0.1:PORT"
    repo: str
    tag: str | None  # None: pushed by digest only (e.g. an index's child)
    manifest_digest: str
    manifest_media_type: str
    manifest: bytes
    config_digest: str
    config: dict[str, Any]  # the whole image config JSON
    layers: tuple[PushedLayer, ...]
    contents: dict[str, str] = field(default_factory=dict)  # random files: path -> sha256 hex

    @property
    def ref(self) -> str:
        """`host/repo:tag`, or `host/repo@digest` when pushed without a tag."""
        if self.tag is None:
            return self.digest_ref
        return f"{self.host}/{self.repo}:{self.tag}"

    @property
    def digest_ref(self) -> str:
        return f"{self.host}/{self.repo}@{self.manifest_digest}"

    @property
    def layer_digests(self) -> list[str]:
        return [layer.digest for layer in self.layers]

    @property
    def diff_ids(self) -> list[str]:
        return [layer.diff_id for layer in self.layers]


@dataclass(frozen=True)
class PushedIndex:
    host: str
    repo: str
    tag: str
    digest: str
    index: bytes
    images: dict[str, PushedImage]  # "linux/amd64", "linux/arm64/v8" -> image

    @property
    def ref(self) -> str:
        return f"{self.host}/{self.repo}:{self.tag}"

    @property
    def digest_ref(self) -> str:
        return f"{self.host}/{self.repo}@{self.digest}"


Auth = tuple[str, str] | Literal[False] | None


def _client(reg: LocalRegistry, auth: Auth) -> httpx.Client:
    creds = reg.credentials if auth is None else (auth or None)
    return httpx.Client(base_url=reg.url, auth=creds, timeout=120)


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _with_digest(location: str, digest: str) -> str:
    # httpx's params= would replace the upload URL's own query (its _state)
    return f"{location}{'&' if '?' in location else '?'}digest={digest}"


def _pieces(f: BinaryIO, length: int) -> Iterator[bytes]:
    # streamed request bodies: httpx requests/responses form reference cycles, so a
    # bytes body would stay alive until the next GC pass
    while length > 0 and (piece := f.read(min(MiB, length))):
        length -= len(piece)
        yield piece


def _upload(
    client: httpx.Client,
    repo: str,
    digest: str,
    *,
    data: bytes | None = None,
    path: Path | None = None,
) -> None:
    """One blob: skipped if present, else monolithic, or PATCH chunks when big."""
    head = client.head(f"/v2/{repo}/blobs/{digest}")
    if head.status_code == 200:
        return
    if head.status_code != 404:
        head.raise_for_status()
    r = client.post(f"/v2/{repo}/blobs/uploads/")
    r.raise_for_status()
    location = r.headers["location"]
    if data is not None:
        r = client.put(
            _with_digest(location, digest),
            content=data,
            headers={"content-type": "application/octet-stream"},
        )
        r.raise_for_status()
        return
    assert path is not None
    size = path.stat().st_size
    with path.open("rb") as f:
        if size <= CHUNKED_UPLOAD_OVER:
            r = client.put(
                _with_digest(location, digest),
                content=_pieces(f, size),
                headers={"content-type": "application/octet-stream", "content-length": str(size)},
            )
            r.raise_for_status()
            return
        offset = 0
        while offset < size:
            n = min(UPLOAD_CHUNK, size - offset)
            r = client.patch(
                location,
                content=_pieces(f, n),
                headers={
                    "content-type": "application/octet-stream",
                    "content-length": str(n),
                    "content-range": f"{offset}-{offset + n - 1}",
                },
            )
            r.raise_for_status()
            location = r.headers["location"]
            offset += n
    r = client.put(_with_digest(location, digest))
    r.raise_for_status()


def _put_manifest(
    client: httpx.Client, repo: str, reference: str, body: bytes, media_type: str
) -> str:
    r = client.put(
        f"/v2/{repo}/manifests/{reference}", content=body, headers={"content-type": media_type}
    )
    if r.status_code >= 400:
        raise httpx.HTTPStatusError(
            f"manifest PUT {repo}:{reference} -> {r.status_code}: {r.text}",
            request=r.request,
            response=r,
        )
    digest = _sha(body)
    assert r.headers.get("docker-content-digest", digest) == digest
    return digest


def push_image(
    reg: LocalRegistry,
    repo: str,
    tag: str | None,
    layers: Sequence[Layer] | Sequence[Any],
    *,
    config: Mapping[str, Any] | None = None,
    arch: str = "amd64",
    variant: str | None = None,
    docker_media_types: bool = False,
    auth: Auth = None,
    history: Sequence[str] | None = None,
) -> PushedImage:
    """Upload `layers` (bottom first), an image config and a manifest; tag it unless tag=None.

    `config` is the image config's "config" object (Env, WorkingDir, User,
    Entrypoint, Cmd, ...). `auth`: None uses the registry's own credentials (if
    any), False pushes anonymously, a (user, password) pair is sent as given.
    """
    image_config: dict[str, Any] = {
        "created": "2023-11-14T22:13:20Z",
        "architecture": arch,
        "os": "linux",
        "config": dict(config or {}),
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [
            {"created": "2023-11-14T22:13:20Z", "created_by": by}
            for by in (history or [f"aenv test layer {i}" for i in range(len(layers))])
        ],
    }
    if variant:
        image_config["variant"] = variant
    config_blob = json.dumps(image_config, sort_keys=True).encode()
    config_digest = _sha(config_blob)
    pushed = tuple(
        PushedLayer(
            layer.digest, layer.diff_id, layer.size, layer.media_type(docker=docker_media_types)
        )
        for layer in layers
    )
    manifest_type = DOCKER_MANIFEST if docker_media_types else OCI_MANIFEST
    manifest = {
        "schemaVersion": 2,
        "mediaType": manifest_type,
        "config": {
            "mediaType": DOCKER_CONFIG if docker_media_types else OCI_CONFIG,
            "digest": config_digest,
            "size": len(config_blob),
        },
        "layers": [
            {"mediaType": p.media_type, "digest": p.digest, "size": p.size}
            # a TOC-indexed layer (tests.toclayers) pins its TOC digest in annotations
            | ({"annotations": notes} if (notes := getattr(layer, "annotations", None)) else {})
            for p, layer in zip(pushed, layers, strict=True)
        ],
    }
    body = json.dumps(manifest, indent=2).encode()
    with _client(reg, auth) as client:
        for layer in layers:
            _upload(client, repo, layer.digest, path=layer.path)
        _upload(client, repo, config_digest, data=config_blob)
        digest = _put_manifest(client, repo, tag or _sha(body), body, manifest_type)
    contents: dict[str, str] = {}
    for layer in layers:
        contents.update(layer.contents)
    return PushedImage(
        host=reg.host,
        repo=repo,
        tag=tag,
        manifest_digest=digest,
        manifest_media_type=manifest_type,
        manifest=body,
        config_digest=config_digest,
        config=image_config,
        layers=pushed,
        contents=contents,
    )


def push_index(
    reg: LocalRegistry,
    repo: str,
    tag: str,
    images: Mapping[str, PushedImage],
    *,
    auth: Auth = None,
) -> PushedIndex:
    """A multi-arch OCI index over `images`, keyed "os/arch" or "os/arch/variant".

    The images must already be in `repo` (push them with tag=None to leave them untagged).
    """
    manifests = []
    for platform, img in images.items():
        if img.repo != repo or img.host != reg.host:
            raise ValueError(f"{platform}: image is in {img.host}/{img.repo}, not {repo}")
        parts = platform.split("/")
        plat: dict[str, str] = {"os": parts[0], "architecture": parts[1]}
        if len(parts) > 2:
            plat["variant"] = parts[2]
        manifests.append(
            {
                "mediaType": img.manifest_media_type,
                "digest": img.manifest_digest,
                "size": len(img.manifest),
                "platform": plat,
            }
        )
    body = json.dumps(
        {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}, indent=2
    ).encode()
    with _client(reg, auth) as client:
        digest = _put_manifest(client, repo, tag, body, OCI_INDEX)
    return PushedIndex(reg.host, repo, tag, digest, body, dict(images))


# -- common images -------------------------------------------------------------

BUSYBOX_CONFIG: dict[str, Any] = {
    "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
    "Cmd": ["/bin/sh"],
    "WorkingDir": "/",
}
_busybox_cache: dict[tuple[str, int | None], Layer] = {}


def busybox_applets() -> list[str]:
    out = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True)
    return sorted({a for a in out.stdout.split() if a and a != "busybox"})


def busybox_members() -> list[Member]:
    """Static busybox and its applet links, /etc/passwd with root and app (1000), /tmp, homes."""
    members = [
        directory("bin"),
        file_from("bin/busybox", BUSYBOX, mode=0o755),
        *[symlink(f"bin/{a}", "busybox") for a in busybox_applets()],
        directory("dev"),
        directory("etc"),
        file(
            "etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        ),
        file("etc/group", "root:x:0:\napp:x:1000:\nnogroup:x:65534:\n"),
        file("etc/hostname", "busybox\n"),
        directory("home"),
        directory("home/app", uid=1000, gid=1000),
        directory("proc", mode=0o555),
        directory("root", mode=0o700),
        directory("sys", mode=0o555),
        directory("tmp", mode=0o1777),
        directory("usr"),
        directory("usr/bin"),
        directory("var"),
    ]
    return members


def busybox_layer(*, compression: Compression = "gzip", level: int | None = None) -> Layer:
    """The busybox base layer; built once per process and compression, then reused."""
    if not BUSYBOX.exists():
        pytest.skip("needs /bin/busybox (Debian package busybox-static)")
    key = (compression, level)
    layer = _busybox_cache.get(key)
    if layer is None or not layer.path.exists():
        layer = Layer.build(busybox_members(), compression=compression, level=level)
        _busybox_cache[key] = layer
    return layer


def push_busybox(
    reg: LocalRegistry,
    repo: str = "busybox",
    tag: str | None = "latest",
    compression: Compression = "gzip",
    extra_layers: Sequence[Layer] = (),
    *,
    config: Mapping[str, Any] | None = None,
    arch: str = "amd64",
    variant: str | None = None,
    docker_media_types: bool = False,
    auth: Auth = None,
) -> PushedImage:
    """The busybox layer plus `extra_layers` on top."""
    return push_image(
        reg,
        repo,
        tag,
        [busybox_layer(compression=compression), *extra_layers],
        config=BUSYBOX_CONFIG if config is None else config,
        arch=arch,
        variant=variant,
        docker_media_types=docker_media_types,
        auth=auth,
    )


def push_rootfs_dir(
    reg: LocalRegistry,
    repo: str,
    tag: str | None,
    rootfs_dir: Path,
    *,
    compression: Compression = "gzip",
    config: Mapping[str, Any] | None = None,
    auth: Auth = None,
) -> PushedImage:
    """One layer made of an existing tree (e.g. a debootstrap rootfs), streamed via a temp file."""
    layer = Layer.from_dir(rootfs_dir, compression=compression)
    try:
        return push_image(
            reg, repo, tag, [layer], config=BUSYBOX_CONFIG if config is None else config, auth=auth
        )
    finally:
        layer.delete()


def push_big_image(
    reg: LocalRegistry,
    repo: str,
    tag: str | None,
    *,
    total_mb: int = 300,
    files: int = 30,
    layers: int = 3,
    compression: Compression = "gzip",
    seed: int = 0,
    base: Sequence[Layer] = (),
    auth: Auth = None,
    toc: str | None = None,
) -> PushedImage:
    """`total_mb` MiB of random (incompressible) content in `files` files over `layers` layers.

    Files are `big/l<L>/f<N>.bin`, sizes varied and not chunk-aligned; the
    result's `.contents` maps each to its sha256 hex. Layer files are deleted
    once pushed. Throughput on this machine: "none" and "zstd" ~300 MB/s,
    "gzip" (level 1) ~40 MB/s. `base` layers (e.g. `busybox_layer()`) go below.
    `toc` ("estargz", "zstd:chunked") writes the big layers in that TOC-indexed
    format instead (`tests.toclayers`, 4 MiB chunks; `compression` is then unused):
    the same content for the same seed.
    """
    if files < layers or layers < 1:
        raise ValueError("need at least one file per layer")
    total = total_mb * MiB
    rng = random.Random(seed)
    weights = [rng.uniform(0.5, 1.5) for _ in range(files)]
    sizes = [int(total * w / sum(weights)) for w in weights]
    sizes[-1] += total - sum(sizes)
    built: list[Any] = []
    try:
        for li in range(layers):
            idx = range(li * files // layers, (li + 1) * files // layers)
            members = [directory("big"), directory(f"big/l{li}")]
            members += [
                random_file(f"big/l{li}/f{i}.bin", sizes[i], seed=seed * 1_000_003 + i) for i in idx
            ]
            if toc is not None:
                from tests.toclayers import toc_layer  # it builds on this module

                built.append(toc_layer(members, fmt=toc, chunk_size=4 * MiB))  # type: ignore[arg-type]
            else:
                built.append(Layer.build(members, compression=compression))
        return push_image(reg, repo, tag, [*base, *built], config=BUSYBOX_CONFIG, auth=auth)
    finally:
        for layer in built:
            layer.delete()


# -- reference unpack and tree comparison --------------------------------------


def reference_unpack(
    reg: LocalRegistry,
    ref: str | PushedImage | PushedIndex,
    dest: Path,
    *,
    arch: str | None = None,
    variant: str | None = None,
) -> Path:
    """Unpack `ref` with skopeo + umoci (as root: owners kept) into `dest`; return the rootfs."""
    for tool in ("skopeo", "umoci"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool}")
    ref_s = ref if isinstance(ref, str) else ref.ref
    dest = Path(dest)
    layout, bundle = dest / "oci", dest / "bundle"
    dest.mkdir(parents=True, exist_ok=True)
    cmd = ["skopeo", "--insecure-policy"]
    if arch:
        cmd += ["--override-arch", arch]
    if variant:
        cmd += ["--override-variant", variant]
    copy = ["copy", "--quiet", "--src-tls-verify=false"]
    copy += [f"--src-creds={':'.join(reg.credentials)}"] if reg.credentials else ["--src-no-creds"]
    src, dst = f"docker://{ref_s}", f"oci:{layout}:img"
    unpack = ["umoci", "unpack", "--image", f"{layout}:img", str(bundle)]
    if os.geteuid() != 0:
        unpack.insert(2, "--rootless")
    _run([*cmd, *copy, src, dst])
    try:
        _run(unpack)
    except RuntimeError as e:
        if "not correct mediatype" not in str(e):
            raise
        # umoci 0.4.7 knows no zstd: let skopeo recompress the layers with gzip
        shutil.rmtree(layout)
        shutil.rmtree(bundle, ignore_errors=True)
        gzip = ["--dest-compress-format=gzip", "--dest-compress-level=1"]
        _run([*cmd, *copy, *gzip, src, dst])
        _run(unpack)
    return bundle / "rootfs"


def _run(cmd: list[str]) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> {p.returncode}\n{p.stdout}\n{p.stderr}")


def _type_char(mode: int) -> str:
    for test, c in (
        (stat.S_ISREG, "file"),
        (stat.S_ISDIR, "dir"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISCHR, "char"),
        (stat.S_ISBLK, "block"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return c
    return "?"


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while b := f.read(MiB):
            h.update(b)
    return h.hexdigest()


def snapshot_tree(root: Path, *, mtime: bool = True) -> dict[str, dict[str, Any]]:
    """Every path under `root` ("/" is root itself) -> its comparable metadata and content hash."""
    root = Path(root)
    out: dict[str, dict[str, Any]] = {}
    inodes: dict[tuple[int, int], list[str]] = {}

    def visit(path: Path, rel: str) -> None:
        st = os.lstat(path)
        kind = _type_char(st.st_mode)
        info: dict[str, Any] = {
            "type": kind,
            "mode": oct(stat.S_IMODE(st.st_mode)),
            "uid": st.st_uid,
            "gid": st.st_gid,
        }
        if kind == "symlink":
            info["target"] = os.readlink(path)
        elif kind == "file":
            info["size"] = st.st_size
            info["sha256"] = _hash_file(path)
            if st.st_nlink > 1:
                inodes.setdefault((st.st_dev, st.st_ino), []).append(rel)
        elif kind in ("char", "block"):
            info["rdev"] = (os.major(st.st_rdev), os.minor(st.st_rdev))
        if kind == "symlink":
            del info["mode"]  # always 0777 on Linux, not settable
        if mtime and kind != "dir":
            info["mtime"] = int(st.st_mtime)
        try:
            names = os.listxattr(path, follow_symlinks=False)
        except OSError:
            names = []
        xattrs = {}
        for n in sorted(names):
            if n.startswith("trusted.") or n == "security.selinux":
                continue
            with contextlib.suppress(OSError):
                xattrs[n] = os.getxattr(path, n, follow_symlinks=False)
        if xattrs:
            info["xattrs"] = xattrs
        out[rel] = info
        if kind == "dir":
            for name in sorted(os.listdir(path)):
                visit(path / name, name if rel == "/" else f"{rel}/{name}")

    visit(root, "/")
    for group in inodes.values():
        if len(group) > 1:
            for p in group:
                out[p]["hardlinks"] = sorted(group)
    return out


def compare_trees(a: Path, b: Path, *, mtime: bool = True, ignore: Iterable[str] = ()) -> list[str]:
    """Every difference between trees `a` and `b`, one line each; [] when they match.

    Compared: presence, type, permission bits, owner, size, content hash,
    symlink target, device numbers, hard-link grouping, xattrs (but not
    trusted.* and security.selinux), and mtime of non-directories (`mtime=False`
    skips it). Paths in `ignore` (relative, "/" for the root) are left out.
    """
    skip = {_norm(p) or "/" for p in ignore}
    sa, sb = snapshot_tree(a, mtime=mtime), snapshot_tree(b, mtime=mtime)
    diffs: list[str] = []
    for path in sorted(sa.keys() | sb.keys()):
        if path in skip:
            continue
        ia, ib = sa.get(path), sb.get(path)
        if ia is None:
            diffs.append(f"{path}: only in b ({ib and ib['type']})")
        elif ib is None:
            diffs.append(f"{path}: only in a ({ia['type']})")
        else:
            for key in sorted(ia.keys() | ib.keys()):
                if ia.get(key) != ib.get(key):
                    diffs.append(f"{path}: {key} {ia.get(key)!r} != {ib.get(key)!r}")
    return diffs
