"""Frozen filesystem layers: incremental capture, fork stacks, compaction, gc.

A sandbox's root is a host overlay of one writable upper directory over a
`LayerStack`: store layers (earlier frozen uppers, topmost first) over the
base lowers that live outside the store (the template's rootfs). To pause
a sandbox, storage freezes its upper once the sandbox is checkpointed or
stopped and its overlay unmounted: `LayerStore.freeze` renames the upper
into `root/layers/<id>/tree` (no copying; a copy only when the store is on
another filesystem), records which layers it was frozen over, and returns
the new `Layer`; `chain` gives the stack it heads, so every child mounts a
fresh upper over `chain(layer).lowers()`. To snapshot or fork a sandbox
that keeps running, `LayerStore.capture` copies what its mounted upper
changed since its previous capture (entries whose inode, ctime, mtime, size
or mode differ; whiteouts for entries that went) into a new layer over
that capture's layer, while the runtime holds the sandbox still. Layers are immutable
once frozen (the layer directory is made read-only, mode 0555) and named by a
random id, not by content: content addressing happens when layers are
uploaded. `compact` flattens a stack's store layers into one layer by
applying overlayfs semantics (whiteouts, opaque directories, type changes)
layer by layer with a Python walk that keeps modes, owners, times, xattrs,
symlinks, device nodes and hard links within a layer; it copies only what
the layers hold, never the base. `gc` is mark and sweep: everything a live
layer was frozen over stays. Every change is crash safe: built under
`root/tmp`, fsynced, then renamed into place; a new store removes what a
crash left in `root/tmp`. Blocking work runs in worker threads; one lock
serialises freeze, compact and gc.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import secrets
import shutil
import stat
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from aenv.kit.files import fsync_dir

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "Captured",
    "EntryKey",
    "Layer",
    "LayerError",
    "LayerStack",
    "LayerStore",
]

# Deeper stacks are flattened by `LayerStore.limit_depth` (overlayfs allows
# 500 lowers and one page of mount options, but lookups get slower per layer).
DEFAULT_MAX_DEPTH = 16

_OVL_PREFIX = "trusted.overlay."
_OPAQUE = "trusted.overlay.opaque"
# Written only with redirect_dir / metacopy on; compaction cannot follow them.
_UNSUPPORTED_XATTRS = ("trusted.overlay.redirect", "trusted.overlay.metacopy")
_META = "layer.json"
# ioctl(dst, FICLONE, src): share src's extents (btrfs, xfs with reflink=1)
_FICLONE = 0x40049409
# File timestamps come from the kernel's coarse clock (CLOCK_REALTIME_COARSE,
# 5 on Linux): one of its ticks (4 ms at HZ=250) plus a margin, at most 20 ms.
# A capture holds its sandbox while it waits for the clock to pass a tick.
_CTIME_TICK_NS = min(int(time.clock_getres(5) * 1e9) + 1_000_000, 20_000_000)
_TREE = "tree"
# A layer restored from the object store keeps its index (the stored bytes) here;
# until its files are on disk (lazy), its `tree` is a symlink to where the image
# mount serves that index, and `tree.new` is the directory swapped in once complete.
_INDEX = "index.json"
_TREE_NEW = "tree.new"
_RENAME_EXCHANGE = 2


class LayerError(RuntimeError):
    """A layer could not be frozen, found, compacted or removed."""


@dataclass(frozen=True, kw_only=True)
class Layer:
    """One immutable frozen upper directory in the store."""

    id: str
    # The directory to stack as an overlay lower.
    path: Path
    # Store layers this one was frozen over, topmost first (its whiteouts refer to them).
    below: tuple[str, ...]
    # Lowers outside the store under those (the template rootfs), topmost first.
    base: tuple[Path, ...]
    size_bytes: int
    created: float


@dataclass(frozen=True)
class LayerStack:
    """What a sandbox's root is mounted over: store layers, then base lowers."""

    layers: tuple[Layer, ...] = ()
    base: tuple[Path, ...] = ()

    @classmethod
    def of_base(cls, base: Sequence[Path]) -> LayerStack:
        """A stack of base lowers only (a sandbox started from a template)."""
        return cls((), tuple(Path(p) for p in base))

    @property
    def depth(self) -> int:
        return len(self.layers)

    @property
    def top(self) -> Layer | None:
        return self.layers[0] if self.layers else None

    def ids(self) -> tuple[str, ...]:
        return tuple(layer.id for layer in self.layers)

    def lowers(self) -> list[Path]:
        """Overlay lower directories, topmost first."""
        return [layer.path for layer in self.layers] + list(self.base)


# What a live capture records of each upper entry (by path relative to the
# upper): a change to any of these means the entry changed.
EntryKey = tuple[int, int, int, int, int]  # inode, ctime ns, mtime ns, size, mode


@dataclass(frozen=True)
class Captured:
    """A live capture of a running sandbox's upper (`LayerStore.capture`)."""

    # The captured filesystem: the new layer over what it was captured over.
    stack: LayerStack
    # Every upper entry as it was then; the next capture copies what differs.
    entries: dict[str, EntryKey]
    # File bytes this capture copied.
    copied_bytes: int


class LayerStore:
    """Frozen layers under `root`; see the module docstring."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.abspath(root))
        self.layers_dir = self.root / "layers"
        self.tmp_dir = self.root / "tmp"
        self._lock = trio.Lock()
        _recover(self.root)

    # -- reading -----------------------------------------------------------

    def get(self, layer_id: str) -> Layer:
        """The layer `layer_id` (reads one small metadata file)."""
        return _read_layer(self.layers_dir, layer_id)

    def ids(self) -> set[str]:
        """Ids of every layer in the store."""
        try:
            return {p.name for p in self.layers_dir.iterdir() if (p / _META).is_file()}
        except FileNotFoundError:
            return set()

    def chain(self, layer: Layer | str) -> LayerStack:
        """The full stack `layer` heads: it, the layers it was frozen over, their base."""
        top = layer if isinstance(layer, Layer) else self.get(layer)
        return LayerStack((top, *(self.get(i) for i in top.below)), top.base)

    # -- freezing ----------------------------------------------------------

    async def freeze(self, upper: Path, *, below: LayerStack) -> Layer:
        """Turn an unmounted overlay upper (frozen over `below`) into a new layer.

        `upper` is moved, not copied, when it is on the store's filesystem; it
        no longer exists afterwards. Raises LayerError if its overlay is still
        mounted (`aenv.storage.overlay.unmount_root` first).
        """
        async with self._lock:
            return await trio.to_thread.run_sync(self._freeze_sync, Path(upper), below)

    def _freeze_sync(self, upper: Path, below: LayerStack) -> Layer:
        upper = Path(os.path.abspath(upper))
        if not upper.is_dir():
            raise LayerError(f"{upper} is not a directory")
        if _is_mountpoint(upper.parent / "merged") or _is_mountpoint(upper):
            raise LayerError(f"the overlay of {upper} is still mounted")
        layer_id, staging = self._staging()
        tree = staging / _TREE
        try:
            os.rename(upper, tree)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            _copy_tree(upper, tree)
        _syncfs(tree)
        return self._publish(
            layer_id, staging, below=below.ids(), base=below.base, moved_from=upper
        )

    # -- live capture ------------------------------------------------------

    async def capture(
        self, upper: Path, *, below: LayerStack, since: Captured | None = None, sync: bool = True
    ) -> Captured:
        """A new layer holding what a still-mounted upper changed since `since`.

        For snapshots and forks of a sandbox that keeps running: the caller
        holds the sandbox (no process writes) while this runs. The upper stays
        where it is, in use. The first capture of an upper (over `below`, the
        stack it is mounted over) copies all of it; each later one copies
        only the entries whose inode, ctime, mtime, size or mode changed since
        `since`, and whiteouts for those that went, over `since`'s stack, so
        the cost follows what changed, not the root filesystem. Returns
        when the kernel's clock has moved past every change seen, so any later
        write gets a later ctime and is seen by the next capture. Without
        `sync` the new layer's files are not flushed yet: the caller calls
        `sync()` before anything durable names the layer.
        """
        async with self._lock:
            return await trio.to_thread.run_sync(
                self._capture_sync, Path(upper), below, since, sync
            )

    async def sync(self) -> None:
        """Flush the file system the layers are on (after `capture(sync=False)`)."""
        await trio.to_thread.run_sync(_syncfs, self.layers_dir)

    def _capture_sync(
        self, upper: Path, below: LayerStack, since: Captured | None, sync: bool = True
    ) -> Captured:
        if not upper.is_dir():
            raise LayerError(f"{upper} is not a directory")
        layer_id, staging = self._staging()
        tree = staging / _TREE
        try:
            diff = _UpperDiff(upper, tree, since.entries if since is not None else {})
            diff.run()
            over = since.stack if since is not None else below
            if not diff.changed:  # the stack it was captured over is the capture
                _rmtree(staging)
                return Captured(stack=over, entries=diff.entries, copied_bytes=0)
            if sync:
                _syncfs(tree)
            layer = self._publish(layer_id, staging, below=over.ids(), base=over.base,
                                  moved_from=None)  # fmt: skip
        except BaseException:
            _rmtree(staging)
            raise
        # ctimes come from a coarse clock: wait until it is past the newest seen
        wait_ns = diff.newest_ctime_ns + _CTIME_TICK_NS - time.time_ns()
        if wait_ns > 0:
            time.sleep(min(wait_ns, _CTIME_TICK_NS) / 1e9)
        return Captured(stack=self.chain(layer), entries=diff.entries, copied_bytes=diff.copied)

    # -- layers brought from elsewhere (the object store) -----------------

    def new_staging(self) -> Path:
        """A new empty directory to build a layer's `tree` in (a crash leaves it to clean up)."""
        return self._staging()[1]

    async def adopt(
        self, staging: Path, layer_id: str, *, below: Sequence[str], base: Sequence[Path]
    ) -> Layer:
        """Publish `staging/tree` (from `new_staging`) as layer `layer_id`.

        For layers restored from elsewhere, which keep their id. If the store
        already has `layer_id`, the staging directory is discarded and the
        existing layer returned.
        """
        async with self._lock:
            if layer_id in await trio.to_thread.run_sync(self.ids):
                await trio.to_thread.run_sync(_rmtree, staging)
                return self.get(layer_id)
            _read_layer_id_check(layer_id)
            await trio.to_thread.run_sync(_syncfs, staging / _TREE)
            return await trio.to_thread.run_sync(
                lambda: self._publish(
                    layer_id,
                    staging,
                    below=tuple(below),
                    base=tuple(Path(p) for p in base),
                    moved_from=None,
                )
            )

    async def adopt_lazy(
        self,
        layer_id: str,
        *,
        below: Sequence[str],
        base: Sequence[Path],
        target: Path,
        index: bytes,
        size_bytes: int,
    ) -> Layer:
        """Publish layer `layer_id` whose tree is served elsewhere for now (`target`, a
        directory of the image mount), with its stored `index`; `materialise` swaps
        the real tree in later. An existing layer of that id is returned as it is."""
        async with self._lock:
            if layer_id in await trio.to_thread.run_sync(self.ids):
                return self.get(layer_id)
            _read_layer_id_check(layer_id)

            def run() -> Layer:
                _, staging = self._staging()
                os.symlink(target, staging / _TREE)
                _write_durably(staging / _INDEX, index)
                return self._publish(
                    layer_id,
                    staging,
                    below=tuple(below),
                    base=tuple(Path(p) for p in base),
                    moved_from=None,
                    size_bytes=size_bytes,
                )

            return await trio.to_thread.run_sync(run)

    def stored_index(self, layer_id: str) -> bytes | None:
        """The object store's index of a layer restored from it (None: made here)."""
        _read_layer_id_check(layer_id)
        try:
            return (self.layers_dir / layer_id / _INDEX).read_bytes()
        except FileNotFoundError:
            return None

    def lazy_ids(self) -> set[str]:
        """Layers whose tree is not on disk yet (blocking); clears half-done swaps."""
        out = set()
        for layer_id in self.ids():
            d = self.layers_dir / layer_id
            _unlink_any(d / _TREE_NEW)
            if (d / _TREE).is_symlink():
                out.add(layer_id)
        return out

    async def materialise(self, layer_id: str, staging: Path) -> Layer:
        """Swap `staging/tree` (complete) in for a lazy layer's symlink, atomically."""
        async with self._lock:

            def run() -> Layer:
                d = self.layers_dir / layer_id
                try:
                    if not (d / _TREE).is_symlink():
                        raise LayerError(f"layer {layer_id} is not lazy (any more)")
                    _syncfs(staging / _TREE)
                    os.rename(staging / _TREE, d / _TREE_NEW)
                    _exchange(d / _TREE_NEW, d / _TREE)
                    _unlink_any(d / _TREE_NEW)
                    fsync_dir(d)
                finally:
                    _rmtree(staging)
                return self.get(layer_id)

            return await trio.to_thread.run_sync(run)

    # -- compaction --------------------------------------------------------

    async def compact(self, stack: LayerStack) -> Layer:
        """One layer equivalent to all store layers of `stack` (over the same base).

        The source layers are left in place (gc removes them once unused).
        """
        if not stack.layers:
            raise LayerError("nothing to compact: the stack has no store layers")
        async with self._lock:
            return await trio.to_thread.run_sync(self._compact_sync, stack)

    def _compact_sync(self, stack: LayerStack) -> Layer:
        layer_id, staging = self._staging()
        tree = staging / _TREE
        tree.mkdir()
        for layer in reversed(stack.layers):  # bottom up: upper layers override
            _apply_layer(layer.path, tree, {}, stack.base)
        _syncfs(tree)
        return self._publish(layer_id, staging, below=(), base=stack.base, moved_from=None)

    async def limit_depth(
        self, stack: LayerStack, max_depth: int = DEFAULT_MAX_DEPTH
    ) -> LayerStack:
        """`stack` itself if it has at most `max_depth` store layers, else it compacted."""
        if stack.depth <= max_depth:
            return stack
        return self.chain(await self.compact(stack))

    # -- garbage collection ------------------------------------------------

    async def gc(self, live: Iterable[str], *, min_age_s: float = 0.0) -> list[str]:
        """Remove every layer not reachable from `live`; return the removed ids.

        A live layer keeps all layers it was frozen over. Layers younger than
        `min_age_s` (by their creation time) are kept too, for callers that
        freeze while another task computes `live`.
        """
        live = set(live)
        async with self._lock:
            return await trio.to_thread.run_sync(self._gc_sync, live, min_age_s)

    def _gc_sync(self, live: set[str], min_age_s: float) -> list[str]:
        present = self.ids()
        marked: set[str] = set()
        for layer_id in live & present:
            marked.add(layer_id)
            marked.update(self.get(layer_id).below)
        now = time.time()
        removed: list[str] = []
        for layer_id in sorted(present - marked):
            with contextlib.suppress(LayerError):
                if now - self.get(layer_id).created < min_age_s:
                    continue
            self._remove(layer_id)
            removed.append(layer_id)
        return removed

    def _remove(self, layer_id: str) -> None:
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        doomed = self.tmp_dir / f"{layer_id}.gc"
        os.rename(self.layers_dir / layer_id, doomed)
        fsync_dir(self.layers_dir)
        _rmtree(doomed)

    # -- helpers -----------------------------------------------------------

    def _staging(self) -> tuple[str, Path]:
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.layers_dir.mkdir(parents=True, exist_ok=True)
        layer_id = secrets.token_hex(12)
        staging = self.tmp_dir / layer_id
        staging.mkdir()
        return layer_id, staging

    def _publish(
        self,
        layer_id: str,
        staging: Path,
        *,
        below: tuple[str, ...],
        base: tuple[Path, ...],
        moved_from: Path | None,
        size_bytes: int | None = None,
    ) -> Layer:
        """Write the metadata, fsync, rename the staging directory into place."""
        final = self.layers_dir / layer_id
        try:
            meta = {
                "id": layer_id,
                "below": list(below),
                "base": [str(p) for p in base],
                "size_bytes": _tree_size(staging / _TREE) if size_bytes is None else size_bytes,
                "created": time.time(),
            }
            _write_durably(staging / _META, json.dumps(meta, indent=1).encode())
            fsync_dir(staging)
            os.rename(staging, final)
            fsync_dir(self.layers_dir)
            if moved_from is not None:
                fsync_dir(moved_from.parent)
        except BaseException:
            if moved_from is not None and (staging / _TREE).exists():
                # Put the upper back so the caller still has its data.
                with contextlib.suppress(OSError):
                    os.rename(staging / _TREE, moved_from)
            _rmtree(staging)
            raise
        os.chmod(final / _META, 0o444)
        os.chmod(final, 0o555)
        return _layer_from_meta(self.layers_dir, meta)


# -- metadata -----------------------------------------------------------------


def _read_layer_id_check(layer_id: str) -> None:
    if not layer_id or "/" in layer_id or layer_id.startswith("."):
        raise LayerError(f"bad layer id {layer_id!r}")


def _read_layer(layers_dir: Path, layer_id: str) -> Layer:
    _read_layer_id_check(layer_id)
    try:
        meta = json.loads((layers_dir / layer_id / _META).read_text())
    except FileNotFoundError:
        raise LayerError(f"no layer {layer_id}") from None
    except (OSError, ValueError) as exc:
        raise LayerError(f"layer {layer_id} is unreadable: {exc}") from exc
    return _layer_from_meta(layers_dir, meta)


def _layer_from_meta(layers_dir: Path, meta: dict[str, Any]) -> Layer:
    layer_id = str(meta["id"])
    return Layer(
        id=layer_id,
        path=layers_dir / layer_id / _TREE,
        below=tuple(str(i) for i in meta["below"]),
        base=tuple(Path(p) for p in meta["base"]),
        size_bytes=int(meta["size_bytes"]),
        created=float(meta["created"]),
    )


def _recover(root: Path) -> None:
    """Remove what an interrupted freeze, compaction or gc left under root/tmp."""
    tmp = root / "tmp"
    with contextlib.suppress(FileNotFoundError):
        for leftover in tmp.iterdir():
            _rmtree(leftover)


# -- durability ----------------------------------------------------------------


def _write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)


_libc: ctypes.CDLL | None = None


def _syncfs(path: Path) -> None:
    """Flush the whole filesystem holding `path` (a tree of many files: one call)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> None:
    """renameat2(RENAME_EXCHANGE): swap two names atomically (a directory and a symlink)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd = -100
    if _libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE):
        err = ctypes.get_errno()
        raise LayerError(f"cannot swap {a} and {b}: {os.strerror(err)}")


def _unlink_any(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        _rmtree(path)


def _rmtree(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.chmod(path, 0o700)
    shutil.rmtree(path, ignore_errors=True)


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in (*dirnames, *filenames):
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


# -- copying and overlay semantics ---------------------------------------------


def _copy_tree(src: Path, dst: Path) -> None:
    """A faithful copy (modes, owners, xattrs, links, devices) for cross-filesystem freezes."""
    proc = subprocess.run(
        ["cp", "-a", "--reflink=auto", "--", str(src), str(dst)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise LayerError(f"copying {src} to {dst} failed: {proc.stderr.strip()}")
    shutil.rmtree(src)


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, _OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _set_opaque(path: Path) -> None:
    os.setxattr(path, _OPAQUE, b"y", follow_symlinks=False)


def _remove_any(path: Path) -> bool:
    """Remove whatever is at `path`; True if something was there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)
    return True


def _clear_dir(path: Path) -> None:
    for entry in os.scandir(path):
        _remove_any(Path(entry.path))


def _make_whiteout(path: Path) -> None:
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


# Hard links within one layer: (st_dev, st_ino) of the source -> (dest path, dest st_ino).
_Links = dict[tuple[int, int], tuple[Path, int]]


def _apply_layer(src_root: Path, dst_root: Path, links: _Links, base: Sequence[Path]) -> None:
    """Lay `src_root` (a frozen upper) over `dst_root` with overlayfs semantics.

    `base` is what `dst_root` will be mounted over: a whiteout is kept only
    where the base has something to hide (overlayfs lists whiteouts in a
    directory no lower merges with).
    """
    _apply_dir(src_root, dst_root, links, list(base), hidden=False)
    _copy_meta(src_root, dst_root, os.lstat(src_root))


def _apply_dir(src: Path, dst: Path, links: _Links, base: list[Path], *, hidden: bool) -> None:
    _check_supported(src)
    if _is_opaque(src):
        _clear_dir(dst)
        _set_opaque(dst)
    hidden = hidden or _is_opaque(dst)
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        s = Path(entry.path)
        d = dst / entry.name
        below = [] if hidden else [b / entry.name for b in base]
        st = os.lstat(s)
        if _is_whiteout(st):
            _remove_any(d)
            if any(os.path.lexists(b) for b in below):
                _make_whiteout(d)
        elif stat.S_ISDIR(st.st_mode):
            try:
                dst_st: os.stat_result | None = os.lstat(d)
            except FileNotFoundError:
                dst_st = None
            if dst_st is not None and stat.S_ISDIR(dst_st.st_mode):
                _apply_dir(s, d, links, below, hidden=False)
            else:
                replaced = _remove_any(d)
                os.mkdir(d, 0o700)
                if replaced:
                    # Below, a whiteout or non-directory hid the base's entry;
                    # a plain directory here would merge with it again.
                    _set_opaque(d)
                _apply_dir(s, d, links, below, hidden=replaced)
            _copy_meta(s, d, st)
        else:
            _remove_any(d)
            _copy_node(s, d, st, links)


class _UpperDiff:
    """Copy what changed in a live upper since `prev` into `tree` (see `LayerStore.capture`).

    Overlay semantics of the result, laid over the layer `prev` was captured
    into: an entry that is new or changed is copied; one that went gets a
    whiteout (only where its parent directory is still the same directory:
    a replaced or removed parent hides it anyway); a directory that is new
    where something else was, or that is opaque in the upper, is copied
    whole and made opaque; a directory that is the same one as before
    (same inode) is a plain directory holding only what changed inside it.
    """

    def __init__(self, upper: Path, tree: Path, prev: dict[str, EntryKey]) -> None:
        self.upper = upper
        self.tree = tree
        self.prev = prev
        self.entries: dict[str, EntryKey] = {}
        self.copied = 0
        self.newest_ctime_ns = 0
        self._links: _Links = {}
        # whether the tree holds anything (else the capture needs no new layer)
        self.changed = False
        self._same_dirs: set[str] = {""}
        self._made: set[str] = {""}

    def run(self) -> None:
        self.tree.mkdir()
        st = os.lstat(self.upper)
        root = self.entries[""] = self._note(st)
        self._walk(self.upper, "", copy_all=not self.prev)
        for rel in sorted(self.prev.keys() - self.entries.keys()):
            parent = os.path.dirname(rel)
            if parent in self._same_dirs:
                self._ensure_dir(parent)
                _make_whiteout(self.tree / rel)
                self.changed = True
        _copy_meta(self.upper, self.tree, st)
        if self.prev.get("", root) != root:
            self.changed = True

    def _note(self, st: os.stat_result) -> EntryKey:
        self.newest_ctime_ns = max(self.newest_ctime_ns, st.st_ctime_ns)
        return (st.st_ino, st.st_ctime_ns, st.st_mtime_ns, st.st_size, st.st_mode)

    def _walk(self, src: Path, rel: str, *, copy_all: bool) -> None:
        _check_supported(src)
        for entry in sorted(os.scandir(src), key=lambda e: e.name):
            s = Path(entry.path)
            r = f"{rel}/{entry.name}" if rel else entry.name
            st = os.lstat(s)
            key = self.entries[r] = self._note(st)
            old = self.prev.get(r)
            if stat.S_ISDIR(st.st_mode):
                same = old is not None and old[0] == st.st_ino and stat.S_ISDIR(old[4])
                if copy_all or not same:
                    d = self.tree / r
                    self._ensure_dir(rel)
                    os.mkdir(d, 0o700)
                    self.changed = True
                    self._made.add(r)
                    self._walk(s, r, copy_all=True)
                    if _is_opaque(s) or (not copy_all and old is not None):
                        _set_opaque(d)
                    _copy_meta(s, d, st)
                else:
                    self._same_dirs.add(r)
                    if key != old:
                        self._ensure_dir(r)
                    self._walk(s, r, copy_all=False)
            elif copy_all or key != old:
                self._ensure_dir(rel)
                _copy_node(s, self.tree / r, st, self._links)
                self.changed = True
                if stat.S_ISREG(st.st_mode):
                    self.copied += st.st_size

    def _ensure_dir(self, rel: str) -> None:
        """`rel` (a directory the upper has had since `prev`) exists in the tree."""
        if rel in self._made:
            return
        self._ensure_dir(os.path.dirname(rel))
        d = self.tree / rel
        os.mkdir(d, 0o700)
        self._made.add(rel)
        self.changed = True
        _copy_meta(self.upper / rel, d, os.lstat(self.upper / rel))


def _check_supported(path: Path) -> None:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return
    for name in names:
        if name in _UNSUPPORTED_XATTRS:
            raise LayerError(
                f"{path} carries {name}: layers written with redirect_dir or "
                "metacopy cannot be compacted"
            )


def _copy_node(src: Path, dst: Path, st: os.stat_result, links: _Links) -> None:
    key = (st.st_dev, st.st_ino)
    if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode) and key in links:
        target, target_ino = links[key]
        with contextlib.suppress(OSError):
            if os.lstat(target).st_ino == target_ino:
                os.link(target, dst)
                return
    mode = st.st_mode
    if stat.S_ISREG(mode):
        _check_supported(src)
        _copy_data(src, dst)
    elif stat.S_ISLNK(mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        os.mknod(dst, mode, st.st_rdev)
    else:
        raise LayerError(f"{src}: unsupported file type {stat.S_IFMT(mode):o}")
    _copy_meta(src, dst, st)
    if st.st_nlink > 1:
        links[key] = (dst, os.lstat(dst).st_ino)


def _copy_data(src: Path, dst: Path) -> None:
    """A regular file's bytes: shared extents (a reflink) where the filesystem
    can, else an in-kernel copy (no trip through user space)."""
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
            return
        except OSError:
            pass  # ext4, tmpfs, across filesystems: copy
        size = os.fstat(fin.fileno()).st_size
        copied = 0
        try:
            while copied < size:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), size - copied)
                if n == 0:
                    break
                copied += n
        except OSError:
            fin.seek(copied)
            fout.seek(copied)
            shutil.copyfileobj(fin, fout, 1 << 20)


def _copy_meta(src: Path, dst: Path, st: os.stat_result) -> None:
    """Owner, mode, xattrs (not overlayfs' own) and times of `src` onto `dst`."""
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    with contextlib.suppress(OSError):
        for name in os.listxattr(src, follow_symlinks=False):
            if name.startswith(_OVL_PREFIX):
                continue
            with contextlib.suppress(OSError):
                value = os.getxattr(src, name, follow_symlinks=False)
                os.setxattr(dst, name, value, follow_symlinks=False)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _is_mountpoint(path: Path) -> bool:
    target = os.path.abspath(path)
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                mountpoint = line.split()[4]
                if "\\" in mountpoint:
                    mountpoint = mountpoint.encode().decode("unicode_escape")
                if mountpoint == target:
                    return True
    except OSError:
        return False
    return False
