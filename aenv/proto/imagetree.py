"""An image's merged root filesystem tree, built from its layer indexes, sans-IO.

`ImageTree.build(layers)` applies layers bottom first as Docker and the OCI
image spec do: a later entry replaces an earlier one at the same path (a
non-directory replacing a directory removes the directory's subtree; a
directory over a directory keeps its children and takes the new metadata);
a whiteout removes the path and everything under it from lower layers; an
opaque marker hides the lower contents of its directory but keeps what the
same layer adds; a hard link shares the inode of its target (resolved by
path in the tree as merged so far), so `nlink` counts every name. Missing
parent directories are created (mode 0755, root-owned) as the spec allows.

Nodes are numbered from `ROOT_INO` (1) and never change once built; the tree
is immutable afterwards and safe to share between readers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from aenv.proto.layerindex import Chunk, Kind, LayerIndex

__all__ = ["ROOT_INO", "ImageTree", "Inode", "TreeError"]

ROOT_INO = 1


class TreeError(ValueError):
    """The layers cannot be merged (e.g. a hard link to a missing or non-file target)."""


@dataclass(slots=True, kw_only=True)
class Inode:
    ino: int
    kind: Kind  # FILE, DIR, SYMLINK, CHAR, BLOCK or FIFO (never HARDLINK/WHITEOUT/OPAQUE)
    mode: int  # permission bits (0o7777)
    uid: int
    gid: int
    mtime_ns: int
    size: int  # FILE: content size; SYMLINK: len of the target in bytes; DIR: 0
    link: str = ""  # SYMLINK target
    devmajor: int = 0
    devminor: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)
    chunks: tuple[Chunk, ...] = ()
    layer: str = ""  # FILE: digest of the layer blob whose entry supplied `chunks`
    nlink: int = 1  # DIR: 2 + number of child directories
    # DIR only: name -> ino, in insertion order (readdir order)
    children: dict[str, int] | None = None
    parent: int = ROOT_INO  # DIR only: its parent (the root is its own parent)


class ImageTree:
    def __init__(self, inodes: dict[int, Inode]) -> None:
        self.inodes = inodes

    @classmethod
    def build(cls, layers: Sequence[LayerIndex]) -> ImageTree:
        """Merge `layers` (bottom first) into one tree."""
        raise NotImplementedError

    def __getitem__(self, ino: int) -> Inode:
        return self.inodes[ino]

    def lookup(self, parent: int, name: str) -> Inode | None:
        """The child `name` of directory `parent`, or None."""
        raise NotImplementedError

    def resolve(self, path: str) -> Inode | None:
        """The inode at a relative path ("" is the root), without following symlinks."""
        raise NotImplementedError

    def walk(self) -> list[tuple[str, Inode]]:
        """Every (path, inode) pair, parents before children, the root as ""."""
        raise NotImplementedError

    @property
    def content_bytes(self) -> int:
        """Total size of distinct file contents (each inode counted once)."""
        return sum(i.size for i in self.inodes.values() if i.kind is Kind.FILE)
