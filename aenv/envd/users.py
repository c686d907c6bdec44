"""Guest users: /etc/passwd and /etc/group lookups, paths and process envs.

envd runs as root and acts on behalf of the user the SDK names (HTTP Basic
username, `username` query parameter, or the default user from /init).
This module resolves such names to uid/gid/home/shell from the guest's own
files (not NSS: the interpreter bundle may not match the guest's libc),
expands request paths against the user's home, and builds the environment
of user processes from a clean base so none of envd's own variables
(PYTHONHOME, LD_LIBRARY_PATH, AENV_*) leak into them.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass

BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class UnknownUser(LookupError):
    pass


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    shell: str


# path -> (its stat's identity, its lines): a file is read again only once changed
_parsed: dict[str, tuple[tuple[int, ...], list[list[str]]]] = {}


def _read_lines(path: str) -> list[list[str]]:
    """The colon-separated fields of each line of an account file (a stat per
    call, every command starts with two lookups; read again once it changed)."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    key = (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    cached = _parsed.get(path)
    if cached is not None and cached[0] == key:
        return cached[1]
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [line.rstrip("\n").split(":") for line in f if line.strip() and line[0] != "#"]
    except OSError:
        return []
    _parsed[path] = (key, lines)
    return lines


def _passwd(root: str) -> list[User]:
    users = []
    for parts in _read_lines(posixpath.join(root, "etc/passwd")):
        if len(parts) < 7:
            continue
        try:
            uid, gid = int(parts[2]), int(parts[3])
        except ValueError:
            continue
        users.append(User(parts[0], uid, gid, parts[5] or "/", parts[6] or "/bin/sh"))
    return users


@dataclass(frozen=True)
class UserDB:
    """Reads the guest's account files under `root` (default `/`)."""

    root: str = "/"

    def lookup(self, name: str) -> User:
        for user in _passwd(self.root):
            if user.name == name:
                return user
        if name.isdigit():
            try:
                return self.by_uid(int(name))
            except UnknownUser:
                # As Docker does for a numeric USER without an account: gid 0, home /.
                return User(name, int(name), 0, "/", "/bin/sh")
        raise UnknownUser(f"user: unknown user {name}")

    def by_uid(self, uid: int) -> User:
        for user in _passwd(self.root):
            if user.uid == uid:
                return user
        raise UnknownUser(f"user: unknown userid {uid}")

    def user_name(self, uid: int) -> str:
        for user in _passwd(self.root):
            if user.uid == uid:
                return user.name
        return str(uid)

    def group_name(self, gid: int) -> str:
        for parts in _read_lines(posixpath.join(self.root, "etc/group")):
            if len(parts) >= 3 and parts[2] == str(gid):
                return parts[0]
        return str(gid)

    def groups_of(self, user: User) -> list[int]:
        """The user's primary group followed by its supplementary groups."""
        gids = [user.gid]
        for parts in _read_lines(posixpath.join(self.root, "etc/group")):
            if len(parts) >= 4 and user.name in parts[3].split(","):
                try:
                    gid = int(parts[2])
                except ValueError:
                    continue
                if gid not in gids:
                    gids.append(gid)
        return gids


def resolve_path(path: str, user: User, default_workdir: str | None = None) -> str:
    """An absolute, normalised path: `~` expands to the user's home, relative
    paths resolve against the default workdir (if set) or the user's home."""
    if not path:
        path = default_workdir or ""
    if path.startswith("~"):
        if len(path) > 1 and path[1] != "/":
            raise ValueError(f"cannot expand user-specific home dir in {path!r}")
        path = user.home + path[1:]
    if not posixpath.isabs(path):
        path = posixpath.join(user.home, path)
    return posixpath.normpath(path).replace("//", "/")


def process_env(
    user: User, defaults: Mapping[str, str], extra: Mapping[str, str]
) -> dict[str, str]:
    """Environment for a user process: clean base, /init vars, request vars."""
    env = {
        "PATH": BASE_PATH,
        "HOME": user.home,
        "USER": user.name,
        "LOGNAME": user.name,
        "SHELL": user.shell,
    }
    env.update(defaults)
    env.update(extra)
    return {k: v for k, v in env.items() if k and "=" not in k and "\0" not in k + v}


def ensure_dirs(path: str, uid: int, gid: int) -> None:
    """Create `path` and missing parents, each created one owned by uid:gid.

    Raises NotADirectoryError if a component exists and is not a directory.
    """
    missing = []
    current = path
    while current and current != "/":
        if os.path.isdir(current):
            break
        if os.path.lexists(current) and not os.path.isdir(current):
            raise NotADirectoryError(f"path is a file: {current}")
        missing.append(current)
        current = posixpath.dirname(current)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o755)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise NotADirectoryError(f"path is a file: {directory}") from None
        os.chown(directory, uid, gid)
