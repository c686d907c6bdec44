"""Volumes on the wire (sans-IO): names, mounts, content paths and entry stats.

A volume is a named, size-capped file system that outlives sandboxes; a
sandbox mounts volumes by name at absolute paths (`volumeMounts` on create).
This module validates what users send - volume names, the `volumeMounts`
list, `sizeMB` (an aenv extension), the `path` of the content API, which is
always relative to the volume's root and can never climb out of it - and
renders an entry's stat as the SDKs' `VolumeEntryStat`. The records
themselves live with the node (`aenv.storage.volumes`).
"""

from __future__ import annotations

import datetime as dt
import itertools
import posixpath
import re
import stat as st
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_MOUNTS = 16
DEFAULT_SIZE_MB = 1024
MIN_SIZE_MB = 16
MAX_SIZE_MB = 1024 * 1024
# where a volume may not be mounted: what the sandbox needs to run
_RESERVED = ("/", "/proc", "/dev", "/sys", "/opt/aenv", "/tmp", "/etc", "/bin", "/usr", "/lib")


class VolumeRequestError(ValueError):
    """A request about volumes a user must fix (HTTP 400)."""


@dataclass(frozen=True)
class VolumeMount:
    """A volume mounted into a sandbox: by name as asked; `volume_id` once resolved."""

    name: str
    path: str
    volume_id: str = ""

    def to_doc(self) -> dict[str, str]:
        return {"name": self.name, "path": self.path, "volumeID": self.volume_id}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> VolumeMount:
        return cls(str(doc["name"]), str(doc["path"]), str(doc.get("volumeID") or ""))


def check_volume_name(value: object) -> str:
    if not isinstance(value, str) or NAME_RE.fullmatch(value) is None or ".." in value:
        raise VolumeRequestError(
            f"invalid volume name {value!r}: use 1-128 letters, digits, '.', '_' or '-'"
        )
    return value


def parse_new_volume(body: object) -> tuple[str, int]:
    """`POST /volumes`: (name, size in MiB)."""
    if not isinstance(body, Mapping):
        raise VolumeRequestError("request body must be a JSON object")
    name = check_volume_name(body.get("name"))
    size = body.get("sizeMB", DEFAULT_SIZE_MB)
    if isinstance(size, bool) or not isinstance(size, int):
        raise VolumeRequestError("sizeMB must be an integer")
    if not MIN_SIZE_MB <= size <= MAX_SIZE_MB:
        raise VolumeRequestError(f"sizeMB must be between {MIN_SIZE_MB} and {MAX_SIZE_MB}")
    return name, size


def mount_path(value: object) -> str:
    """A mount point inside a sandbox: absolute, normalised, not one the sandbox needs."""
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise VolumeRequestError(f"volume mount path {value!r} must be an absolute path")
    path = posixpath.normpath(value)
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    if any(path == r or (r != "/" and path.startswith(r + "/")) for r in _RESERVED[:5]):
        raise VolumeRequestError(f"volume mount path {path!r} is reserved")
    if path in _RESERVED:
        raise VolumeRequestError(f"volume mount path {path!r} is reserved")
    return path


def parse_mounts(raw: object) -> tuple[VolumeMount, ...]:
    """`volumeMounts` of a new sandbox: [{"name", "path"}], paths distinct and not nested."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise VolumeRequestError("volumeMounts must be a list")
    if len(raw) > MAX_MOUNTS:
        raise VolumeRequestError(f"at most {MAX_MOUNTS} volumeMounts")
    mounts: list[VolumeMount] = []
    for item in raw:
        if not isinstance(item, Mapping):
            raise VolumeRequestError("each volumeMounts entry must be an object {name, path}")
        mounts.append(
            VolumeMount(check_volume_name(item.get("name")), mount_path(item.get("path")))
        )
    paths = sorted(m.path for m in mounts)
    for a, b in itertools.pairwise(paths):
        if b == a or b.startswith(a + "/"):
            raise VolumeRequestError(f"volume mount paths {a!r} and {b!r} overlap")
    return tuple(mounts)


def content_path(value: object) -> str:
    """The content API's `path`, relative to the volume's root ("" is the root).

    "/a/b", "a/b" and "a/./b" all name the same entry; ".." may not climb
    above the root.
    """
    if not isinstance(value, str) or "\0" in value:
        raise VolumeRequestError("path is required")
    parts: list[str] = []
    for part in value.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise VolumeRequestError(f"path {value!r} leaves the volume")
            parts.pop()
            continue
        parts.append(part)
    return "/".join(parts)


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat().replace("+00:00", "Z")


def entry_stat(rel: str, s: Any, target: str | None = None) -> dict[str, Any]:
    """A `VolumeEntryStat` for the entry at `rel` with `os.lstat` result `s`."""
    mode = s.st_mode
    kind = (
        "directory"
        if st.S_ISDIR(mode)
        else "file"
        if st.S_ISREG(mode)
        else "symlink"
        if st.S_ISLNK(mode)
        else "unknown"
    )
    d: dict[str, Any] = {
        "name": rel.rsplit("/", 1)[-1] if rel else "",
        "type": kind,
        "path": "/" + rel,
        "size": s.st_size,
        "mode": st.S_IMODE(mode),
        "uid": s.st_uid,
        "gid": s.st_gid,
        "atime": _iso(s.st_atime),
        "mtime": _iso(s.st_mtime),
        "ctime": _iso(s.st_ctime),
    }
    if target is not None:
        d["target"] = target
    return d


def volume_view(volume_id: str, name: str) -> dict[str, Any]:
    return {"volumeID": volume_id, "name": name}


def volume_and_token(volume_id: str, name: str, token: str, **extra: Any) -> dict[str, Any]:
    return {"volumeID": volume_id, "name": name, "token": token, **extra}


def parse_mode(value: str | None, what: str = "mode") -> int | None:
    """A query parameter holding an integer (uid, gid, mode), None if absent."""
    if value is None or value == "":
        return None
    try:
        n = int(value, 0) if value.startswith("0o") else int(value)
    except ValueError:
        raise VolumeRequestError(f"{what} must be an integer") from None
    if n < 0 or n > 0xFFFFFFFF:
        raise VolumeRequestError(f"{what} is out of range")
    return n


def parse_flag(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "true", "yes")


def volume_of_route(method: str, path: str) -> str | None:
    """The volume (ID or name) a request is about, for a cluster to send it to
    the node that holds it: `/volumecontent/{id}/...`, `GET`/`DELETE /volumes/{id}`
    and `/volumes/{id}/persist`. None for anything else (a create, the list)."""
    parts = path.split("/")
    if len(parts) >= 4 and parts[1] == "volumecontent" and parts[2]:
        return parts[2]
    if len(parts) == 3 and parts[1] == "volumes" and parts[2] and method in ("GET", "DELETE"):
        return parts[2]
    if len(parts) == 4 and parts[1] == "volumes" and parts[2] and parts[3] == "persist":
        return parts[2]
    return None
