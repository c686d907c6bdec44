"""The node's image service: registry client, image store, chunk cache and image mount.

`open_images(config)` wires the pieces for one node and owns them for the
node's lifetime: the registry client lives in the node's loop, the chunk
cache and FUSE file system in the image mount's own thread (see
`aenv.images.mount`). `Images.prepare(key)` makes a pulled image's tree
visible at `mount / key` before a sandbox's overlay is stacked on it.
`Images.attach_store(objects)` shares converted layers through the node's
object store (the node passes its `ObjectStore`; images/ never imports it).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from aenv.config import Config
from aenv.images.cache import ChunkCache
from aenv.images.fusefs import ImageFS
from aenv.images.mount import ImageMount, main_loop_fetcher, open_image_mount
from aenv.images.objects import ChunkStore
from aenv.images.registry import RegistryConfig, open_registry_client
from aenv.images.store import ImageRecord, ImageStore

__all__ = ["CredentialsFile", "Images", "load_credentials", "open_images"]

log = logging.getLogger("aenv.images")


def load_credentials(path: Path) -> dict[str, tuple[str, str]]:
    """Registry credentials from a Docker-style `config.json` (`auths` entries).

    Each entry has `auth` (base64 of `user:password`) or `username` and
    `password`. A missing file means no credentials; a malformed one is an
    error naming the file, never silently ignored.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        doc = json.loads(raw)
        auths = doc.get("auths", {}) if isinstance(doc, dict) else None
        if not isinstance(auths, dict):
            raise ValueError("'auths' is not an object")
        creds: dict[str, tuple[str, str]] = {}
        for host, entry in auths.items():
            if not isinstance(entry, dict):
                raise ValueError(f"entry for {host!r} is not an object")
            if entry.get("auth"):
                user, sep, password = base64.b64decode(entry["auth"]).decode().partition(":")
                if not sep:
                    raise ValueError(f"'auth' for {host!r} is not base64 of user:password")
            else:
                user, password = str(entry.get("username", "")), str(entry.get("password", ""))
            key = str(host).removeprefix("https://").removeprefix("http://").rstrip("/")
            creds[key.removesuffix("/v1").removesuffix("/v2")] = (user, password)
        return creds
    except (ValueError, UnicodeDecodeError, binascii.Error) as exc:
        raise ValueError(f"registry credentials in {path} are malformed: {exc}") from None


class CredentialsFile(Mapping[str, tuple[str, str]]):
    """`load_credentials(path)`, read again whenever the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._creds: dict[str, tuple[str, str]] = {}

    def _current(self) -> dict[str, tuple[str, str]]:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = (0, 0)
        if stamp != self._stamp:
            self._creds = load_credentials(self.path)
            self._stamp = stamp
        return self._creds

    def __getitem__(self, key: str) -> tuple[str, str]:
        return self._current()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())


class Images:
    def __init__(
        self, *, store: ImageStore, mount: ImageMount, nursery: trio.Nursery | None = None
    ) -> None:
        self.store = store
        self.mount = mount
        self._nursery = nursery
        self._shown: set[str] = set()

    def attach_store(self, objects: ChunkStore | None) -> None:
        """Share converted layers through the node's object store (None: durable storage off).

        Layer uploads run in the image service's own tasks, ended with it.
        """
        if self._nursery is None:
            raise RuntimeError("Images was not opened with open_images")
        self.store.use_object_store(objects, self._nursery)

    @property
    def cache(self) -> ChunkCache:
        return self.mount.cache

    def path(self, key: str) -> Path:
        return self.mount.path / key

    async def prepare(self, key: str) -> Path:
        """Show pulled image `key` on the mount (idempotent); returns its root path."""
        if key not in self._shown:
            tree = await self.store.tree(key)
            await self.mount.call(self.mount.fs.add, key, tree)
            self._shown.add(key)
        return self.path(key)

    async def pull(self, reference: str, *, missing_only: bool = False) -> ImageRecord:
        return await self.store.pull(reference, missing_only=missing_only)

    def statistics(self) -> dict[str, Any]:
        return {
            "cache": self.cache.statistics(),
            "fs": self.mount.fs.statistics(),
            "bytesDownloaded": self.store.bytes_downloaded,
            "bytesFromStore": self.store.bytes_from_store,
            "layersFromStore": self.store.layers_from_store,
            "layersFromToc": self.store.toc_layers.layers_indexed,
            "tocFallbacks": self.store.toc_layers.fallbacks,
            "tocPrefetchedBytes": self.store.toc_layers.prefetched_bytes,
            "uploads": self.store.uploads.statistics(),
        }


@asynccontextmanager
async def open_images(config: Config) -> AsyncIterator[Images]:
    registry_config = RegistryConfig(
        credentials=CredentialsFile(config.auth_file),
        read_timeout=config.registry_timeout_s,
        connect_timeout=min(10.0, config.registry_timeout_s),
        mirrors=config.registry_mirrors,
        allowlist=config.registry_allow,
        insecure=config.registry_insecure,
    )
    async with open_registry_client(config=registry_config) as registry:
        store_box: list[ImageStore] = []

        async def fetch(chunk: Any, layer: str) -> bytes:
            return await store_box[0].fetch_chunk(chunk, layer)

        cache = ChunkCache(
            root=config.cache_dir / "chunks",
            max_bytes=config.cache_max_bytes,
            fetch=main_loop_fetcher(fetch, trio.lowlevel.current_trio_token()),
        )
        store = ImageStore(root=config.images_dir, cache=cache, registry=registry)
        store_box.append(store)
        fs = ImageFS(cache=cache)
        async with (
            open_image_mount(config.run_dir / "images", fs=fs, cache=cache) as mount,
            trio.open_nursery() as nursery,
        ):
            try:
                yield Images(store=store, mount=mount, nursery=nursery)
            finally:
                nursery.cancel_scope.cancel()  # layer uploads resume at the next start
