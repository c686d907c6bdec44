"""An image's merged root filesystem tree, built from its layer indexes, sans-IO.

`ImageTree.build(layers)` applies layers bottom first as Docker and the OCI
image spec do: a later entry replaces an earlier one at the same path (a
non-directory replacing a directory removes the directory's subtree; a
directory over a directory keeps its children and takes the new metadata);
a whiteout removes the path and everything under it from lower layers; an
opaque marker hides the lower contents of its directory but keeps what the
same layer adds; a hard link shares the inode of its target (resolved by
path in the tree as merged so far), so `nlink` counts every name. Missing
parent directories are created (mode 0755, root-owned) as the spec allows,
replacing a non-directory that stood in their place; the directories that hold
a whiteout or an opaque marker exist in that layer too. Within one layer,
whiteouts and opaque markers apply only to the layers below (they are applied
first), so a layer may both white out `x` and add a new `x`, in any order.
Every FILE inode records the digest of the layer that supplied its content.
Extended attributes under `trusted.` are dropped (the host's overlayfs keeps
its own state there); the rest (`security.capability`, `user.*`, ...) are
kept. Entry paths must be normalised (see `aenv.proto.layerindex`); anything
else, and a hard link to a missing path or a directory, raises `TreeError`.

Nodes are numbered from `ROOT_INO` (1) and never change once built; the tree
is immutable afterwards and safe to share between readers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from aenv.proto.layerindex import Chunk, Entry, Kind, LayerIndex

__all__ = ["OPAQUE_XATTR", "ROOT_INO", "ImageTree", "Inode", "TreeError"]

ROOT_INO = 1
OPAQUE_XATTR = "trusted.overlay.opaque"


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


def _names(path: str) -> list[str]:
    """A layer entry's path as components; anything not normalised raises."""
    if not path:
        return []
    names = path.split("/")
    if any(n in ("", ".", "..") for n in names):
        raise TreeError(f"path {path!r} is not a normalised relative path")
    return names


def _keep_xattrs(xattrs: dict[str, bytes]) -> dict[str, bytes]:
    # trusted.* belongs to the host (overlayfs keeps its own state there).
    return {k: v for k, v in xattrs.items() if not k.startswith("trusted.")}


class _Builder:
    def __init__(self) -> None:
        self.inodes: dict[int, Inode] = {}
        self.next_ino = ROOT_INO
        self.root = self.new_dir(ROOT_INO, mode=0o755, uid=0, gid=0, mtime_ns=0, xattrs={})

    def new_ino(self) -> int:
        ino = self.next_ino
        self.next_ino += 1
        return ino

    def new_dir(
        self, parent: int, *, mode: int, uid: int, gid: int, mtime_ns: int, xattrs: dict[str, bytes]
    ) -> Inode:
        ino = self.new_ino()
        node = Inode(
            ino=ino,
            kind=Kind.DIR,
            mode=mode,
            uid=uid,
            gid=gid,
            mtime_ns=mtime_ns,
            size=0,
            xattrs=xattrs,
            children={},
            parent=parent,
            nlink=2,
        )
        self.inodes[ino] = node
        return node

    def find(self, names: list[str]) -> Inode | None:
        node = self.root
        for name in names:
            if node.children is None:
                return None
            child = node.children.get(name)
            if child is None:
                return None
            node = self.inodes[child]
        return node

    def unlink(self, parent: Inode, name: str) -> None:
        """Remove `name` from `parent`, dropping a directory's whole subtree."""
        assert parent.children is not None
        ino = parent.children.pop(name, None)
        if ino is not None:
            self.drop(self.inodes[ino])

    def drop(self, node: Inode) -> None:
        stack = [node]
        while stack:
            node = stack.pop()
            if node.children is not None:
                stack.extend(self.inodes[c] for c in node.children.values())
                del self.inodes[node.ino]
                continue
            node.nlink -= 1
            if node.nlink == 0:
                del self.inodes[node.ino]

    def parent_dir(self, names: list[str]) -> Inode:
        """The directory that holds `names[-1]`, creating missing parents (0755, root)."""
        node = self.root
        for name in names[:-1]:
            assert node.children is not None
            ino = node.children.get(name)
            child = self.inodes[ino] if ino is not None else None
            if child is None or child.kind is not Kind.DIR:
                if child is not None:
                    self.unlink(node, name)
                child = self.new_dir(node.ino, mode=0o755, uid=0, gid=0, mtime_ns=0, xattrs={})
                node.children[name] = child.ino
            node = child
        return node

    def remove_lower(self, layer: LayerIndex) -> None:
        """Apply the layer's whiteouts and opaque markers to the layers below it."""
        for e in layer.entries:
            if e.kind is Kind.WHITEOUT:
                names = _names(e.path)
                if not names:
                    raise TreeError("a whiteout cannot remove the root")
                parent = self.find(names[:-1])
                if parent is not None and parent.children is not None:
                    self.unlink(parent, names[-1])
            elif e.kind is Kind.OPAQUE:
                node = self.find(_names(e.path))
                if node is not None and node.children is not None:
                    for name in list(node.children):
                        self.unlink(node, name)

    def add(self, layer: LayerIndex, e: Entry) -> None:
        names = _names(e.path)
        if not names:
            if e.kind is not Kind.DIR:
                raise TreeError(f"layer {layer.digest}: the root must be a directory")
            self.root.mode, self.root.uid, self.root.gid = e.mode & 0o7777, e.uid, e.gid
            self.root.mtime_ns, self.root.xattrs = e.mtime_ns, _keep_xattrs(e.xattrs)
            return
        parent = self.parent_dir(names)
        assert parent.children is not None
        name = names[-1]
        old_ino = parent.children.get(name)
        old = self.inodes[old_ino] if old_ino is not None else None
        if e.kind is Kind.DIR:
            if old is not None and old.kind is Kind.DIR:
                old.mode, old.uid, old.gid = e.mode & 0o7777, e.uid, e.gid
                old.mtime_ns, old.xattrs = e.mtime_ns, _keep_xattrs(e.xattrs)
                return
            self.unlink(parent, name)
            d = self.new_dir(
                parent.ino,
                mode=e.mode & 0o7777,
                uid=e.uid,
                gid=e.gid,
                mtime_ns=e.mtime_ns,
                xattrs=_keep_xattrs(e.xattrs),
            )
            parent.children[name] = d.ino
            return
        if e.kind is Kind.HARDLINK:
            target = self.find(_names(e.link))
            if target is None:
                raise TreeError(f"layer {layer.digest}: hard link {e.path!r} to missing {e.link!r}")
            if target.kind is Kind.DIR:
                raise TreeError(
                    f"layer {layer.digest}: hard link {e.path!r} to directory {e.link!r}"
                )
            if old is target:
                return
            target.nlink += 1  # before unlinking `old`, which may hold the last other name
            self.unlink(parent, name)
            parent.children[name] = target.ino
            return
        if e.kind not in (Kind.FILE, Kind.SYMLINK, Kind.CHAR, Kind.BLOCK, Kind.FIFO):
            raise TreeError(f"layer {layer.digest}: unexpected entry kind {e.kind} at {e.path!r}")
        self.unlink(parent, name)
        ino = self.new_ino()
        self.inodes[ino] = Inode(
            ino=ino,
            kind=e.kind,
            mode=e.mode & 0o7777,
            uid=e.uid,
            gid=e.gid,
            mtime_ns=e.mtime_ns,
            size=(
                e.size
                if e.kind is Kind.FILE
                else len(e.link.encode("utf-8", "surrogateescape"))
                if e.kind is Kind.SYMLINK
                else 0
            ),
            link=e.link if e.kind is Kind.SYMLINK else "",
            devmajor=e.devmajor,
            devminor=e.devminor,
            xattrs=_keep_xattrs(e.xattrs),
            chunks=e.chunks if e.kind is Kind.FILE else (),
            layer=layer.digest if e.kind is Kind.FILE else "",
        )
        parent.children[name] = ino


class ImageTree:
    def __init__(self, inodes: dict[int, Inode]) -> None:
        self.inodes = inodes

    @classmethod
    def build(cls, layers: Sequence[LayerIndex]) -> ImageTree:
        """Merge `layers` (bottom first) into one tree."""
        b = _Builder()
        for layer in layers:
            b.remove_lower(layer)
            for e in layer.entries:
                if e.kind is Kind.WHITEOUT:  # its directory exists in this layer
                    b.parent_dir(_names(e.path))
                elif e.kind is Kind.OPAQUE:
                    b.parent_dir([*_names(e.path), ""])
                else:
                    b.add(layer, e)
        for node in b.inodes.values():
            if node.children is not None:
                node.nlink = 2 + sum(
                    1 for c in node.children.values() if b.inodes[c].kind is Kind.DIR
                )
        return cls(b.inodes)

    @classmethod
    def of_layer(cls, layer: LayerIndex) -> ImageTree:
        """One layer as overlayfs reads it as a lower directory, merged with nothing:
        whiteouts stay as 0/0 character devices and opaque markers become the
        `trusted.overlay.opaque` xattr of their directory (the frozen upper as
        it was on disk, so the host's overlayfs applies them to the lowers below)."""
        entries: list[Entry] = []
        opaque: list[str] = []
        for e in layer.entries:
            if e.kind is Kind.WHITEOUT:
                entries.append(Entry(path=e.path, kind=Kind.CHAR, mode=0))
            elif e.kind is Kind.OPAQUE:
                opaque.append(e.path)
            else:
                entries.append(e)
        tree = cls.build([replace(layer, entries=tuple(entries))])
        for path in opaque:
            node = tree.resolve(path)
            if node is None or node.kind is not Kind.DIR:
                raise TreeError(f"opaque marker on {path!r}, which is not a directory")
            node.xattrs[OPAQUE_XATTR] = b"y"
        return tree

    def __getitem__(self, ino: int) -> Inode:
        return self.inodes[ino]

    def lookup(self, parent: int, name: str) -> Inode | None:
        """The child `name` of directory `parent`, or None."""
        node = self.inodes.get(parent)
        if node is None or node.children is None:
            return None
        ino = node.children.get(name)
        return None if ino is None else self.inodes[ino]

    def resolve(self, path: str) -> Inode | None:
        """The inode at a relative path ("" is the root), without following symlinks."""
        node: Inode | None = self.inodes[ROOT_INO]
        for name in path.split("/"):
            if name and node is not None:
                node = self.lookup(node.ino, name)
        return node

    def walk(self) -> list[tuple[str, Inode]]:
        """Every (path, inode) pair, parents before children, the root as ""."""
        out: list[tuple[str, Inode]] = []
        stack: list[tuple[str, Inode]] = [("", self.inodes[ROOT_INO])]
        while stack:
            path, node = stack.pop()
            out.append((path, node))
            if node.children:
                prefix = f"{path}/" if path else ""
                stack.extend(
                    (prefix + name, self.inodes[ino])
                    for name, ino in reversed(node.children.items())
                )
        return out

    @property
    def content_bytes(self) -> int:
        """Total size of distinct file contents (each inode counted once)."""
        return sum(i.size for i in self.inodes.values() if i.kind is Kind.FILE)
