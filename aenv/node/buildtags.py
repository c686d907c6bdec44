"""Template tags: names for a template's builds (`name:tag`), as E2B's tags API has them.

Every finished build of a built template is recorded with what a sandbox
needs to start from it (its snapshot, env, workdir, user, start and ready
commands, sizes) and gets the tags it was built with, `default` when none
were given. `name` means `name:default`; `name:<build ID>` names a build
directly. Assigning a tag moves it to another build (the previous
assignments are kept, latest first, for the assignments listing); removing
a tag forgets it. The template's own record (`template.json`) is the build
the default tag names, or the newest build while no build has it. A build
no tag names and that is not the template's current one is dropped: its
snapshot is returned to the caller to delete. Stored as one JSON file per
template under `root`; the methods do blocking file work (worker threads).
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from aenv.kit.files import write_atomic
from aenv.storage.templates import Template

__all__ = ["DEFAULT_TAG", "BadTag", "TagNotFound", "TagStore", "check_tag"]

DEFAULT_TAG = "default"
_TAG_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")


class BadTag(ValueError):
    pass


class TagNotFound(LookupError):
    pass


def check_tag(tag: str) -> str:
    tag = tag.strip().lower() if isinstance(tag, str) else tag
    if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag):
        raise BadTag(f"invalid tag {tag!r}: use 1-128 lowercase letters, digits, '.', '_' or '-'")
    return tag


def _build_fields(t: Template) -> dict[str, Any]:
    return {
        "buildID": t.build_id,
        "snapshotID": t.snapshot_id,
        "rootfs": str(t.rootfs),
        "imageKey": t.image_key,
        "imageRef": t.image_ref,
        "env": list(t.env),
        "workdir": t.workdir,
        "user": t.user,
        "startCmd": t.start_cmd,
        "readyCmd": t.ready_cmd,
        "cpuCount": t.cpu_count,
        "memoryMB": t.memory_mb,
        "diskSizeMB": t.disk_size_mb,
        "createdAt": t.updated_at,
    }


class TagStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def _path(self, template_id: str) -> Path:
        return self.root / f"{template_id}.json"

    def _load(self, template_id: str) -> dict[str, Any]:
        try:
            data = json.loads(self._path(template_id).read_bytes())
        except FileNotFoundError:
            return {"builds": {}, "tags": {}}
        if not isinstance(data, dict):
            return {"builds": {}, "tags": {}}
        data.setdefault("builds", {})
        data.setdefault("tags", {})
        return data

    def _save(self, template_id: str, data: dict[str, Any]) -> None:
        write_atomic(self._path(template_id), json.dumps(data, sort_keys=True).encode())

    @staticmethod
    def _assign(data: dict[str, Any], tag: str, build_id: str) -> None:
        history = data["tags"].setdefault(tag, [])
        history.insert(
            0, {"assignmentID": str(uuid.uuid4()), "buildID": build_id, "assignedAt": time.time()}
        )
        del history[50:]

    @staticmethod
    def _prune(data: dict[str, Any], current: str | None) -> list[str]:
        named = {h[0]["buildID"] for h in data["tags"].values() if h}
        doomed = [b for b in data["builds"] if b not in named and b != current]
        snaps = []
        for b in doomed:
            snap = data["builds"].pop(b).get("snapshotID")
            if snap:
                snaps.append(str(snap))
        return snaps

    def default_moves(self, template_id: str, tags: list[str]) -> bool:
        """Whether a build with `tags` becomes the template's current record."""
        with self._lock:
            data = self._load(template_id)
        return DEFAULT_TAG in tags or not data["tags"].get(DEFAULT_TAG)

    def record(self, built: Template, tags: list[str], *, current: str) -> list[str]:
        """Record finished build `built` with `tags`; `current`: the build of the
        template's own record now. Returns snapshots no build holds any more."""
        with self._lock:
            data = self._load(built.template_id)
            data["builds"][built.build_id] = _build_fields(built)
            for tag in tags:
                self._assign(data, tag, built.build_id)
            gone = self._prune(data, current)
            self._save(built.template_id, data)
            return gone

    def assign(self, template_id: str, source: str, tags: list[str], *, current: str) -> str:
        """Point `tags` at the build `source` (a tag or a build ID) names; its build ID."""
        with self._lock:
            data = self._load(template_id)
            build_id = self._find(data, source)
            for tag in tags:
                self._assign(data, tag, build_id)
            self._save(template_id, data)
            return build_id

    def remove(self, template_id: str, tags: list[str], *, current: str) -> list[str]:
        """Forget `tags`; the snapshots of builds no one names any more."""
        with self._lock:
            data = self._load(template_id)
            missing = [t for t in tags if t not in data["tags"]]
            if missing:
                raise TagNotFound(f"tag {missing[0]!r} of template {template_id!r} not found")
            for tag in tags:
                del data["tags"][tag]
            gone = self._prune(data, current)
            self._save(template_id, data)
            return gone

    @staticmethod
    def _find(data: dict[str, Any], source: str) -> str:
        history = data["tags"].get(source)
        if history:
            return str(history[0]["buildID"])
        if source in data["builds"]:
            return source
        raise TagNotFound(f"no build is tagged or identified by {source!r}")

    def resolve(self, current: Template, tag: str) -> Template:
        """The template as build `tag` (a tag or a build ID) of it has it."""
        with self._lock:
            data = self._load(current.template_id)
        if tag == current.build_id:
            return current
        if tag == DEFAULT_TAG and not data["tags"].get(DEFAULT_TAG):
            return current
        b = data["builds"][self._find(data, tag)]
        return dataclasses.replace(
            current,
            build_id=str(b["buildID"]),
            snapshot_id=b.get("snapshotID"),
            rootfs=Path(str(b["rootfs"])),
            image_key=b.get("imageKey"),
            image_ref=b.get("imageRef"),
            env=tuple(b.get("env") or ()),
            workdir=b.get("workdir"),
            user=b.get("user"),
            start_cmd=b.get("startCmd"),
            ready_cmd=b.get("readyCmd"),
            cpu_count=int(b["cpuCount"]),
            memory_mb=int(b["memoryMB"]),
            disk_size_mb=int(b["diskSizeMB"]),
            updated_at=float(b["createdAt"]),
        )

    def build_of(self, template_id: str, tag: str) -> str | None:
        with self._lock:
            data = self._load(template_id)
        try:
            return self._find(data, tag)
        except TagNotFound:
            return None

    def tags(self, template_id: str) -> list[dict[str, Any]]:
        """[{tag, buildID, assignedAt, history}] of the template, by tag."""
        with self._lock:
            data = self._load(template_id)
        out = []
        for tag, history in sorted(data["tags"].items()):
            if history:
                out.append(
                    {
                        "tag": tag,
                        "buildID": history[0]["buildID"],
                        "assignedAt": history[0]["assignedAt"],
                        "history": [
                            {**h, "build": data["builds"].get(h["buildID"])} for h in history
                        ],
                    }
                )
        return out

    def snapshots(self, template_id: str) -> set[str]:
        with self._lock:
            data = self._load(template_id)
        return {str(b["snapshotID"]) for b in data["builds"].values() if b.get("snapshotID")}

    def drop(self, template_id: str) -> set[str]:
        """Forget the template's tags and builds; the snapshots they held."""
        with self._lock:
            snaps = self.snapshots_unlocked(template_id)
            self._path(template_id).unlink(missing_ok=True)
            return snaps

    def snapshots_unlocked(self, template_id: str) -> set[str]:
        data = self._load(template_id)
        return {str(b["snapshotID"]) for b in data["builds"].values() if b.get("snapshotID")}
