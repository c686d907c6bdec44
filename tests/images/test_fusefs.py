"""The lazy image file system, mounted for real with FUSE.

Rules: needs root and /dev/fuse (skipped otherwise). The mount, the chunk
cache and any overlay live in `tmp_path`. The FUSE server runs in the test's
own trio loop, so the mount is only ever touched from worker threads
(`in_thread`); touching it from the trio thread would deadlock. File contents
come from a counting "origin" the cache fetches from, so a test can tell which
chunks a read pulled in.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio

from aenv.images.cache import ChunkCache
from aenv.images.fusefs import ImageBusy, ImageFS, open_image_fs, reap_stale_image_mount
from aenv.proto.imagetree import ROOT_INO, ImageTree, Inode
from aenv.proto.layerindex import CHUNK_SIZE, Chunk, Kind

T = TypeVar("T")
LAYER = "sha256:" + "cd" * 32
MTIME = 1_700_000_000_123_456_789
BIG = os.urandom(2 * CHUNK_SIZE + 12345)
PASSWD = b"root:x:0:0:root:/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n"
SUID = b"#!/bin/sh\necho hi\n"
MANY = 2000


@pytest.fixture(autouse=True)
def _needs_fuse() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting FUSE and overlayfs needs root")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine")


async def in_thread(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


def chunked(data: bytes) -> tuple[Chunk, ...]:
    out = []
    for off in range(0, len(data), CHUNK_SIZE):
        piece = data[off : off + CHUNK_SIZE]
        out.append(Chunk("sha256:" + hashlib.sha256(piece).hexdigest(), len(piece), 512 + off))
    return tuple(out)


def sample_tree() -> ImageTree:
    """/big (3 chunks, also hard-linked as /hard), /link -> big, /etc/passwd
    (xattrs, non-root owner), /bin/suid (setuid), /dev/tty, /run/fifo, /empty,
    /many/ with MANY entries."""
    nodes: dict[int, Inode] = {}

    def add(ino: int, kind: Kind, mode: int, **kw: Any) -> None:
        nodes[ino] = Inode(ino=ino, kind=kind, mode=mode, uid=0, gid=0, mtime_ns=MTIME, size=0)
        for name, value in kw.items():
            setattr(nodes[ino], name, value)

    def dir_(ino: int, parent: int, children: dict[str, int], mode: int = 0o755) -> None:
        add(ino, Kind.DIR, mode, children=children, parent=parent)

    def file(ino: int, data: bytes, mode: int = 0o644, **kw: Any) -> None:
        add(ino, Kind.FILE, mode, size=len(data), chunks=chunked(data), layer=LAYER, **kw)

    dir_(
        ROOT_INO,
        ROOT_INO,
        {
            "big": 2,
            "hard": 2,
            "link": 3,
            "etc": 4,
            "bin": 6,
            "dev": 8,
            "run": 10,
            "empty": 12,
            "many": 13,
        },
    )
    file(2, BIG, nlink=2)
    add(3, Kind.SYMLINK, 0o777, size=3, link="big")
    dir_(4, ROOT_INO, {"passwd": 5})
    file(
        5,
        PASSWD,
        uid=1000,
        gid=1001,
        mode=0o640,
        xattrs={"user.origin": b"layer-1", "trusted.t": b"\x00\x01"},
    )
    dir_(6, ROOT_INO, {"suid": 7})
    file(7, SUID, mode=0o4755)
    dir_(8, ROOT_INO, {"tty": 9})
    add(9, Kind.CHAR, 0o666, devmajor=5, devminor=0)
    dir_(10, ROOT_INO, {"fifo": 11}, mode=0o1777)
    add(11, Kind.FIFO, 0o600)
    file(12, b"")
    many = {f"entry-with-a-longish-name-{i:05d}": 100 + i for i in range(MANY)}
    dir_(13, ROOT_INO, many)
    for i in range(MANY):
        file(100 + i, b"")
    nodes[ROOT_INO].nlink = 2 + 6
    return ImageTree(nodes)


class Origin:
    def __init__(self, *datas: bytes) -> None:
        self.chunks = {
            c.digest: d[i * CHUNK_SIZE : (i + 1) * CHUNK_SIZE]
            for d in datas
            for i, c in enumerate(chunked(d))
        }
        self.fetched: list[str] = []
        self.error: Exception | None = None

    async def fetch(self, chunk: Chunk, layer: str) -> bytes:
        assert layer == LAYER
        self.fetched.append(chunk.digest)
        if self.error is not None:
            raise self.error
        return self.chunks[chunk.digest]


@dataclass
class Mounted:
    mnt: Path
    img: Path
    fs: ImageFS
    cache: ChunkCache
    origin: Origin


@asynccontextmanager
async def mounted(tmp_path: Path, *, max_bytes: int = 64 * CHUNK_SIZE) -> AsyncIterator[Mounted]:
    origin = Origin(BIG, PASSWD, SUID)
    cache = ChunkCache(root=tmp_path / "cache", max_bytes=max_bytes, fetch=origin.fetch)
    await cache.load()
    fs = ImageFS(cache=cache)
    fs.add("img", sample_tree())
    mnt = tmp_path / "mnt"
    try:
        async with open_image_fs(mnt, fs):
            yield Mounted(mnt, mnt / "img", fs, cache, origin)
    except RuntimeError as exc:
        if "fuse_session_mount failed" in str(exc):
            pytest.skip(f"cannot mount FUSE here: {exc}")
        raise
    assert str(mnt) not in await in_thread(Path("/proc/mounts").read_text)


def read_throughput(path: Path, *, block_size: int = 1 << 20) -> float:
    """Read `path` sequentially once; bytes per second (for benchmarks, blocking)."""
    total = 0
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(block_size):
            total += len(block)
    return total / max(time.perf_counter() - start, 1e-9)


async def test_metadata_matches_the_tree(tmp_path: Path) -> None:
    async with mounted(tmp_path) as m:
        img = m.img

        def check() -> None:
            assert os.listdir(m.mnt) == ["img"]
            assert sorted(os.listdir(img)) == sorted(
                ["big", "hard", "link", "etc", "bin", "dev", "run", "empty", "many"]
            )
            root = os.stat(img)
            assert stat.S_ISDIR(root.st_mode) and root.st_nlink == 8
            assert os.stat(img / "..").st_ino == os.stat(m.mnt).st_ino
            assert os.stat(img / "etc" / "..").st_ino == root.st_ino

            big, hard = os.stat(img / "big"), os.stat(img / "hard")
            assert stat.S_ISREG(big.st_mode) and big.st_size == len(BIG)
            assert (big.st_ino, big.st_nlink) == (hard.st_ino, 2)
            assert big.st_mtime_ns == MTIME and big.st_blocks == (len(BIG) + 511) // 512

            link = os.lstat(img / "link")
            assert stat.S_ISLNK(link.st_mode) and os.readlink(img / "link") == "big"
            assert os.stat(img / "link").st_ino == big.st_ino

            pw = os.stat(img / "etc" / "passwd")
            assert (pw.st_uid, pw.st_gid, stat.S_IMODE(pw.st_mode)) == (1000, 1001, 0o640)
            assert os.getxattr(img / "etc" / "passwd", "user.origin") == b"layer-1"
            assert os.getxattr(img / "etc" / "passwd", "trusted.t") == b"\x00\x01"
            assert sorted(os.listxattr(img / "etc" / "passwd")) == ["trusted.t", "user.origin"]
            with pytest.raises(OSError) as exc:
                os.getxattr(img / "etc" / "passwd", "user.absent")
            assert exc.value.errno == errno.ENODATA
            assert os.listxattr(img / "big") == []

            suid = os.stat(img / "bin" / "suid")
            assert stat.S_IMODE(suid.st_mode) == 0o4755
            tty = os.stat(img / "dev" / "tty")
            assert stat.S_ISCHR(tty.st_mode) and tty.st_rdev == os.makedev(5, 0)
            assert stat.S_ISFIFO(os.stat(img / "run" / "fifo").st_mode)
            assert stat.S_IMODE(os.stat(img / "run").st_mode) == 0o1777
            assert (img / "empty").read_bytes() == b""
            with pytest.raises(FileNotFoundError):
                os.stat(img / "nope")
            with pytest.raises(NotADirectoryError):
                os.stat(img / "big" / "x")

            names = os.listdir(img / "many")  # many readdir rounds: start_id resumes
            assert len(names) == MANY == len(set(names))
            with os.scandir(img / "many") as it:  # a second, partial listing
                first = [next(it).name for _ in range(10)]
            assert first == names[:10]

            vfs = os.statvfs(m.mnt)
            assert vfs.f_blocks * vfs.f_frsize >= len(BIG) + len(PASSWD)

        await in_thread(check)
        assert m.origin.fetched == []  # metadata alone fetches nothing


async def test_reads_fetch_only_the_chunks_they_touch(tmp_path: Path) -> None:
    async with mounted(tmp_path) as m:
        big_chunks = [c.digest for c in chunked(BIG)]
        assert await in_thread((m.img / "etc" / "passwd").read_bytes) == PASSWD
        assert m.origin.fetched == [chunked(PASSWD)[0].digest]

        def middle() -> bytes:
            with open(m.img / "big", "rb", buffering=0) as f:
                return os.pread(f.fileno(), 100, CHUNK_SIZE + 5000)

        assert await in_thread(middle) == BIG[CHUNK_SIZE + 5000 : CHUNK_SIZE + 5100]
        assert m.origin.fetched[1:] == [big_chunks[1]]

        def across() -> bytes:  # spans the boundary of chunks 0 and 1
            with open(m.img / "hard", "rb", buffering=0) as f:
                return os.pread(f.fileno(), 4096, CHUNK_SIZE - 2048)

        assert await in_thread(across) == BIG[CHUNK_SIZE - 2048 : CHUNK_SIZE + 2048]
        assert await in_thread((m.img / "link").read_bytes) == BIG
        assert sorted(set(m.origin.fetched)) == sorted({*big_chunks, chunked(PASSWD)[0].digest})
        assert len(m.origin.fetched) == 4  # every chunk once
        assert m.fs.statistics().bytes_served >= len(BIG) + len(PASSWD)
        assert m.cache.statistics().fetches == 4


async def test_writes_are_refused(tmp_path: Path) -> None:
    async with mounted(tmp_path) as m:

        def attempts() -> list[int | None]:
            codes = []
            for fn in (
                lambda: os.open(m.img / "big", os.O_WRONLY),
                lambda: os.open(m.img / "new", os.O_CREAT | os.O_WRONLY),
                lambda: os.mkdir(m.img / "d"),
                lambda: os.unlink(m.img / "big"),
                lambda: os.chmod(m.img / "big", 0o600),
                lambda: os.setxattr(m.img / "big", "user.x", b"1"),
            ):
                with pytest.raises(OSError) as exc:
                    fn()
                codes.append(exc.value.errno)
            return codes

        assert set(await in_thread(attempts)) == {errno.EROFS}


async def test_chunk_evicted_while_open_is_fetched_again(tmp_path: Path) -> None:
    async with mounted(tmp_path, max_bytes=3 * CHUNK_SIZE) as m:
        first = chunked(BIG)[0].digest

        def run() -> None:
            with open(m.img / "big", "rb", buffering=0) as f:
                fd = f.fileno()
                assert os.pread(fd, CHUNK_SIZE, 0) == BIG[:CHUNK_SIZE]
                # Push chunk 0 out of the cache, and its pages out of the kernel's cache.
                for _ in range(4):
                    filler = os.urandom(CHUNK_SIZE)
                    m.cache.put("sha256:" + hashlib.sha256(filler).hexdigest(), filler)
                assert first not in m.cache
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                assert os.pread(fd, 1000, 777_000) == BIG[777_000:778_000]

        await in_thread(run)
        assert m.origin.fetched.count(first) == 2
        assert m.cache.statistics().evictions >= 1


async def test_unfetchable_chunk_reads_as_eio(tmp_path: Path) -> None:
    async with mounted(tmp_path) as m:
        m.origin.error = ConnectionError("registry down")
        with pytest.raises(OSError) as exc:
            await in_thread((m.img / "bin" / "suid").read_bytes)
        assert exc.value.errno == errno.EIO
        assert m.fs.statistics().read_errors >= 1
        m.origin.error = None  # nothing poisoned: the next read works
        assert await in_thread((m.img / "bin" / "suid").read_bytes) == SUID


@contextmanager
def host_overlay(root: Path, *lowers: Path) -> Iterator[Path]:
    """The host's overlayfs over `lowers` (topmost first), its upper `root/upper`,
    mounted at `root/merged` for the block (blocking)."""
    upper, work, merged = root / "upper", root / "work", root / "merged"
    for d in (upper, work, merged):
        d.mkdir(parents=True)
    opts = f"lowerdir={':'.join(map(str, lowers))},upperdir={upper},workdir={work}"
    subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", opts, str(merged)],
        check=True,
        capture_output=True,
    )
    try:
        yield merged
    finally:
        subprocess.run(["umount", str(merged)], check=True)


async def test_host_overlay_on_an_image_directory(tmp_path: Path) -> None:
    async with mounted(tmp_path) as m:
        upper = tmp_path / "upper"

        def run() -> None:
            with host_overlay(tmp_path, m.img) as merged:
                assert (merged / "big").read_bytes() == BIG
                assert (merged / "etc" / "passwd").read_bytes() == PASSWD
                assert os.readlink(merged / "link") == "big"
                assert stat.S_IMODE(os.stat(merged / "bin" / "suid").st_mode) == 0o4755
                (merged / "new").write_bytes(b"written through the overlay")
                with open(merged / "etc" / "passwd", "ab") as f:  # copy-up
                    f.write(b"bob:x:1001:1001::/:/bin/sh\n")
                assert len(os.listdir(merged / "many")) == MANY
            assert (upper / "new").read_bytes() == b"written through the overlay"
            assert (upper / "etc" / "passwd").read_bytes().startswith(PASSWD)
            assert (m.img / "etc" / "passwd").read_bytes() == PASSWD

        await in_thread(run)


async def test_images_come_and_go(tmp_path: Path) -> None:
    async with mounted(tmp_path) as m:
        m.fs.add("other", sample_tree())
        assert sorted(await in_thread(lambda: os.listdir(m.mnt))) == ["img", "other"]
        f = await in_thread(lambda: open(m.mnt / "other" / "etc" / "passwd", "rb"))  # noqa: SIM115
        try:
            with pytest.raises(ImageBusy):
                m.fs.remove("other")
        finally:
            await in_thread(f.close)
        with trio.fail_after(5):  # the kernel sends RELEASE after close() returns
            while True:
                try:
                    m.fs.remove("other")
                    break
                except ImageBusy:
                    await trio.sleep(0.01)
        assert await in_thread(lambda: os.listdir(m.mnt)) == ["img"]

        def gone() -> None:
            time.sleep(1.2)  # the root's entry timeout
            with pytest.raises(FileNotFoundError):
                os.stat(m.mnt / "other" / "etc" / "passwd")

        await in_thread(gone)
        assert m.fs.keys() == ["img"]
        with pytest.raises(ValueError):
            m.fs.add("img", sample_tree())


async def test_throughput_helper_reads_whole_file(tmp_path: Path) -> None:
    async with mounted(tmp_path) as m:
        rate = await in_thread(lambda: read_throughput(m.img / "big"))
        assert rate > 0
        assert m.fs.statistics().bytes_served >= len(BIG)


_KILLED_SERVER = """
import sys, trio
from pathlib import Path
from aenv.images.cache import ChunkCache
from aenv.images.fusefs import ImageFS, open_image_fs

async def fetch(chunk, layer):
    raise OSError("unused")

async def main():
    fs = ImageFS(cache=ChunkCache(root=Path(sys.argv[2]), max_bytes=1 << 20, fetch=fetch))
    async with open_image_fs(Path(sys.argv[1]), fs):
        print("ready", flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def test_reap_a_mount_left_by_a_killed_server(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    assert await in_thread(lambda: reap_stale_image_mount(mnt)) is False  # nothing to do

    def kill_server() -> None:
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED_SERVER, str(mnt), str(tmp_path / "cache")],
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        assert os.path.ismount(mnt)
        proc.kill()
        proc.wait()
        proc.stdout.close()

    try:
        await in_thread(kill_server)
        with pytest.raises(OSError) as exc:
            await in_thread(lambda: os.statvfs(mnt))  # a dead FUSE connection
        assert exc.value.errno == errno.ENOTCONN
        assert await in_thread(lambda: reap_stale_image_mount(mnt)) is True
        assert str(mnt) not in await in_thread(Path("/proc/mounts").read_text)
    finally:  # never leave a dead mount behind in tmp_path
        await in_thread(lambda: subprocess.run(["umount", "-l", str(mnt)], capture_output=True))


def _frozen_upper(root: Path) -> Path:
    """An overlay upper as a pause leaves it: a whiteout, an opaque directory, new files."""
    upper = root / "frozen"
    (upper / "dir").mkdir(parents=True)
    os.mknod(upper / "gone", stat.S_IFCHR | 0o000, os.makedev(0, 0))
    os.setxattr(upper / "dir", "trusted.overlay.opaque", b"y")
    (upper / "dir" / "c").write_bytes(b"only c is left in dir")
    (upper / "big").write_bytes(BIG)
    return upper


def _tree_view(top: Path) -> dict[str, tuple[int, bytes]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(top))
            out[rel] = (stat.S_IFMT(os.lstat(p).st_mode), p.read_bytes() if p.is_file() else b"")
    return out


async def test_a_frozen_layer_served_raw_stacks_like_its_directory(tmp_path: Path) -> None:
    """A snapshot layer restored lazily: its index served with whiteouts and opaque
    markers kept, so the host overlay over it and the base shows what it showed over
    the frozen directory itself; `serve_local` then reads from a local copy."""
    from dataclasses import replace

    from aenv.storage.snapstore import index_layer

    base = tmp_path / "base"
    (base / "dir").mkdir(parents=True)
    (base / "dir" / "a").write_bytes(b"a")
    (base / "gone").write_bytes(b"whited out")
    (base / "keep").write_bytes(b"kept")
    upper = _frozen_upper(tmp_path)
    index = replace(await in_thread(lambda: index_layer(upper)), digest=LAYER)
    async with mounted(tmp_path) as m:
        m.origin.chunks.update(
            {
                c.digest: (upper / e.path).read_bytes()[c.offset : c.offset + c.size]
                for e in index.entries
                for c in e.chunks
            }
        )
        m.fs.add("layer", ImageTree.of_layer(index))

        def view(lower: Path) -> dict[str, tuple[int, bytes]]:
            with host_overlay(tmp_path / f"over-{lower.name}", lower, base) as merged:
                return _tree_view(merged)

        want = await in_thread(lambda: view(upper))
        assert set(want) == {"dir", "dir/c", "keep", "big"}
        assert await in_thread(lambda: view(m.mnt / "layer")) == want
        fetched = len(m.origin.fetched)
        assert fetched >= 3  # BIG came through the cache
        m.fs.serve_local("layer", upper)
        m.origin.error = RuntimeError("the store is gone")  # nothing may come from it now
        await in_thread(lambda: subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"]))
        before = m.cache.statistics()
        assert await in_thread(lambda: (m.mnt / "layer" / "big").read_bytes()) == BIG
        assert await in_thread(lambda: (m.mnt / "layer" / "dir" / "c").read_bytes()) == (
            b"only c is left in dir"
        )
        after = m.cache.statistics()
        assert (after.hits, after.misses) == (before.hits, before.misses)  # not the cache
