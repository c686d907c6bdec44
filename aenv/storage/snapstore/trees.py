"""Layer indexes and the trees they describe, both ways (blocking; no store here).

`index_layer` describes a frozen overlay upper directory as a `LayerIndex`
(aenv.proto.layerindex): modes, owners, times, xattrs (overlay's own left
out), link targets; whiteouts become WHITEOUT entries and the opaque xattr
an OPAQUE entry; every regular file is cut by `file_chunks` at fixed
CHUNK_SIZE offsets. The other way, `build_skeleton` creates every entry
but file contents and hard links, returning the pieces to fill with
`write_piece`, and `finish_tree` adds hard links, owners, modes, xattrs,
opaque markers and, last, times. An index path that is absolute or climbs
out of the tree is a `BadIndex`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from aenv.proto.layerindex import CHUNK_SIZE, BadIndex, Chunk, Entry, Kind, LayerIndex

LAYER_MEDIA_TYPE = "application/vnd.aenv.frozen-layer.v1+json"

_OVL_PREFIX = "trusted.overlay."
_OPAQUE = "trusted.overlay.opaque"


def _xattrs(path: str) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    with contextlib.suppress(OSError):
        for name in os.listxattr(path, follow_symlinks=False):
            if name.startswith(_OVL_PREFIX):
                continue
            with contextlib.suppress(OSError):
                out[name] = os.getxattr(path, name, follow_symlinks=False)
    return out


def _is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, _OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def file_chunks(path: Path | str) -> tuple[Chunk, ...]:
    """The fixed-offset CHUNK_SIZE pieces of a file, hashed (blocking)."""
    chunks: list[Chunk] = []
    with open(path, "rb") as f:
        offset = 0
        while block := f.read(CHUNK_SIZE):
            chunks.append(Chunk("sha256:" + hashlib.sha256(block).hexdigest(), len(block), offset))
            offset += len(block)
    return tuple(chunks)


def read_piece(path: Path | str, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def index_layer(tree: Path) -> LayerIndex:
    """Describe a frozen overlay upper directory as a LayerIndex (blocking).

    Whiteouts (0/0 character devices) become WHITEOUT entries and the opaque
    xattr an OPAQUE entry after its directory; a regular file with several
    links appears once as a FILE, then as HARDLINKs to that path. Sockets
    are left out (nothing can restore one).
    """
    entries: list[Entry] = []
    seen: dict[tuple[int, int], str] = {}

    def node(path: str, kind: Kind, st: os.stat_result, full: str, **kw: Any) -> Entry:
        return Entry(
            path=path,
            kind=kind,
            mode=stat.S_IMODE(st.st_mode),
            uid=st.st_uid,
            gid=st.st_gid,
            mtime_ns=st.st_mtime_ns,
            xattrs=_xattrs(full),
            **kw,
        )

    def walk(rel: str, full: str) -> None:
        for name in sorted(os.listdir(full)):
            p = f"{rel}/{name}" if rel else name
            f = os.path.join(full, name)
            st = os.lstat(f)
            mode = st.st_mode
            if stat.S_ISCHR(mode) and st.st_rdev == 0:
                entries.append(Entry(path=p, kind=Kind.WHITEOUT))
            elif stat.S_ISDIR(mode):
                entries.append(node(p, Kind.DIR, st, f))
                if _is_opaque(f):
                    entries.append(Entry(path=p, kind=Kind.OPAQUE))
                walk(p, f)
            elif stat.S_ISREG(mode):
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in seen:
                    entries.append(Entry(path=p, kind=Kind.HARDLINK, link=seen[key]))
                    continue
                seen[key] = p
                entries.append(node(p, Kind.FILE, st, f, size=st.st_size, chunks=file_chunks(f)))
            elif stat.S_ISLNK(mode):
                entries.append(node(p, Kind.SYMLINK, st, f, link=os.readlink(f)))
            elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode):
                kind = (
                    Kind.CHAR
                    if stat.S_ISCHR(mode)
                    else Kind.BLOCK
                    if stat.S_ISBLK(mode)
                    else Kind.FIFO
                )
                dev = {"devmajor": os.major(st.st_rdev), "devminor": os.minor(st.st_rdev)}
                entries.append(node(p, kind, st, f, **dev))

    root = str(tree)
    entries.append(node("", Kind.DIR, os.lstat(root), root))
    if _is_opaque(root):
        entries.append(Entry(path="", kind=Kind.OPAQUE))
    walk("", root)
    return LayerIndex(
        digest="", diff_id="", media_type=LAYER_MEDIA_TYPE, size=0, entries=tuple(entries)
    )


def _check_rel(path: str) -> str:
    if path.startswith("/") or any(seg in ("", ".", "..") for seg in path.split("/")):
        raise BadIndex(f"unsafe path {path!r} in a layer index")
    return path


def build_skeleton(index: LayerIndex, tree: Path) -> list[tuple[Path, Chunk]]:
    """Create every entry but file contents and hard links; return the pieces to fill.

    Files are created empty at their final size; metadata comes later
    (`finish_tree`), once contents are written. Blocking.
    """
    pieces: list[tuple[Path, Chunk]] = []
    tree.mkdir(mode=0o700)
    for e in index.entries:
        if e.path == "":
            continue
        dest = tree / _check_rel(e.path)
        if e.kind is Kind.DIR:
            dest.mkdir(mode=0o700)
        elif e.kind is Kind.FILE:
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, e.size)
            finally:
                os.close(fd)
            pieces.extend((dest, c) for c in e.chunks)
        elif e.kind is Kind.SYMLINK:
            os.symlink(e.link, dest)
        elif e.kind is Kind.WHITEOUT:
            os.mknod(dest, stat.S_IFCHR | 0o000, os.makedev(0, 0))
        elif e.kind in (Kind.CHAR, Kind.BLOCK, Kind.FIFO):
            fmt = {Kind.CHAR: stat.S_IFCHR, Kind.BLOCK: stat.S_IFBLK, Kind.FIFO: stat.S_IFIFO}
            os.mknod(dest, fmt[e.kind] | 0o600, os.makedev(e.devmajor, e.devminor))
    return pieces


def write_piece(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def finish_tree(index: LayerIndex, tree: Path) -> None:
    """Hard links, owners, modes, xattrs, opaque markers and times (blocking)."""
    by_path = {e.path: e for e in index.entries if e.kind not in (Kind.OPAQUE, Kind.HARDLINK)}
    for e in index.entries:
        dest = tree / e.path if e.path else tree
        if e.kind is Kind.HARDLINK:
            os.link(tree / _check_rel(e.link), dest)
        elif e.kind is Kind.OPAQUE:
            os.setxattr(dest, _OPAQUE, b"y", follow_symlinks=False)
        elif e.kind is not Kind.WHITEOUT:
            os.chown(dest, e.uid, e.gid, follow_symlinks=False)
            if e.kind is not Kind.SYMLINK:
                os.chmod(dest, e.mode)
            for name, value in e.xattrs.items():
                os.setxattr(dest, name, value, follow_symlinks=False)
    # times last, children before parents, so writing an entry never bumps its directory's
    for path in sorted(by_path, key=lambda p: p.count("/") if p else -1, reverse=True):
        e = by_path[path]
        if e.kind is Kind.WHITEOUT:
            continue
        dest = tree / path if path else tree
        os.utime(dest, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)
