"""The template build cache: a step whose inputs did not change is not run again.

A step's key chains its parent's key with the step itself (type, arguments
and, for COPY, the files hash), starting from the base: an image's content
key or a template's ID and build. Equal keys mean the same file system and
the same ENV/WORKDIR/USER state after the step. After every step that
changes files (RUN, WORKDIR, COPY) a build captures the build sandbox's files
(no memory: cheap, incremental) into an internal snapshot named
`~build/<key>` whose record also holds the state; a later build finds the
last step it can reuse, starts its build sandbox from that snapshot and runs
only the steps after it. The final step (start and ready commands, captured
with memory) is reused when the template's current snapshot was made from
the same key. Entries are local to the node, dropped with the templates
they stand on or were made for, and the oldest go beyond `MAX_ENTRIES`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from aenv.node.snapshots import BUILD_CACHE_PREFIX, Snapshots, is_build_cache

__all__ = ["FILE_STEPS", "BuildCache", "CachedStep", "chain", "final_key"]

MAX_ENTRIES = 256
FILE_STEPS = frozenset({"RUN", "WORKDIR", "COPY"})


def chain(parent: str, *parts: object) -> str:
    """The key of a step: its parent's and its own parts, hashed."""
    h = hashlib.sha256(parent.encode())
    h.update(json.dumps(parts, separators=(",", ":"), default=str).encode())
    return h.hexdigest()


def final_key(
    last: str,
    *,
    template_id: str,
    start_cmd: str | None,
    ready_cmd: str | None,
    cpu_count: int = 0,
    memory_mb: int = 0,
) -> str:
    """The key of a build's final snapshot: its memory image is of that size."""
    return chain(
        last, "finalize", template_id, start_cmd or "", ready_cmd or "", cpu_count, memory_mb
    )


@dataclass(frozen=True)
class CachedStep:
    """A cached step: its snapshot and the build's state after it."""

    snapshot: dict[str, Any]
    env: dict[str, str]
    workdir: str
    user: str


class BuildCache:
    """Cached build steps as internal snapshots of `snapshots`."""

    def __init__(self, snapshots: Snapshots) -> None:
        self.snapshots = snapshots

    @staticmethod
    def name(key: str) -> str:
        return f"{BUILD_CACHE_PREFIX}{key}"

    async def lookup(self, key: str) -> CachedStep | None:
        doc = await self.snapshots.resolve(self.name(key))
        if doc is None or not is_build_cache(doc):
            return None
        state = doc.get("buildState") or {}
        return CachedStep(
            snapshot=doc,
            env={str(k): str(v) for k, v in (state.get("env") or {}).items()},
            workdir=str(state.get("workdir") or "/"),
            user=str(state.get("user") or "root"),
        )

    async def stamp(
        self, snap_id: str, *, env: dict[str, str], workdir: str, user: str, built_for: str
    ) -> None:
        """Record the build state on cache snapshot `snap_id` (just captured)."""
        await self.snapshots.update(
            snap_id,
            buildState={"env": env, "workdir": workdir, "user": user},
            buildFor=built_for,
        )

    async def forget(self, template_id: str) -> list[str]:
        """Drop the entries made for `template_id` or standing on it; their IDs."""
        gone: list[str] = []
        for doc in await self.snapshots.list():
            if is_build_cache(doc) and template_id in (doc.get("buildFor"), doc.get("templateID")):
                await self.snapshots.delete(str(doc["snapshotID"]), local_only=True)
                gone.append(str(doc["snapshotID"]))
        return gone

    async def trim(self, limit: int = MAX_ENTRIES) -> int:
        """Drop the oldest entries beyond `limit`; how many went."""
        docs = sorted(
            (d for d in await self.snapshots.list() if is_build_cache(d)),
            key=lambda d: float(d.get("createdAt") or 0),
        )
        doomed = docs[: max(0, len(docs) - limit)]
        for doc in doomed:
            await self.snapshots.delete(str(doc["snapshotID"]), local_only=True)
        return len(doomed)
