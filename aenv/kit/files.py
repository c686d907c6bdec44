"""Durable file writes: atomic replacement and fsync of files and directory trees.

Blocking helpers (call them from a worker thread in async code). A file
written with `write_atomic` is either the old one or the whole new one
after a crash; `fsync_tree` flushes a directory's files and entries before
a record that points at them is written; `link_files` makes a cheap copy of
a flat directory (a memory image) by hard links.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

__all__ = ["fsync_dir", "fsync_tree", "link_files", "write_atomic"]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(tree: Path) -> None:
    """fsync every regular file under `tree`, then every directory of it."""
    for dirpath, _dirs, files in os.walk(tree):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def write_atomic(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Replace `path` with `data`: written to a temporary sibling, fsynced, renamed."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def link_files(src: Path, dest: Path) -> None:
    """Hard-link every file of directory `src` into new directory `dest`
    (copied where a link is refused, as across file systems)."""
    dest.mkdir()
    for f in src.iterdir():
        if f.is_file():
            try:
                os.link(f, dest / f.name)
            except OSError:
                shutil.copy2(f, dest / f.name)
