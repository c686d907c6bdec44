"""A build's `COPY` step: an uploaded archive's files put in place in the build sandbox.

The archive (`aenv.node.buildfiles`) holds the files the SDK matched, by
their path in the build context. Its regular files are streamed into a
staging directory in the sandbox through envd's `POST /files` (one multipart
request, read from the archive in a worker thread: nothing is unpacked on
the host), then one shell script run as root restores what an upload
cannot carry (directories, symbolic links, modes) and moves the files to the
destination the way `docker build` does: a directory's contents go into
`dest`; a file goes to `dest`, or into it when `dest` ends with `/`, names an
existing directory or several sources matched. Owner is the step's `user`
(`user[:group]`), else root (as Docker's and E2B's COPY); a mode given
replaces the archive's modes. `plan` and `script` are pure: the IO is in
`copy_into`.
"""

from __future__ import annotations

import posixpath
import re
import secrets
import shlex
import tarfile
from collections.abc import AsyncIterator, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import trio

from aenv.node.sandbox import SandboxActor
from aenv.runtimes.base import ENVD_PORT

__all__ = ["CopyError", "Member", "copy_into", "matches", "read_members", "script"]

_CHUNK = 1 << 20
_MAX_LINE = 32 * 1024  # per generated command: far below ARG_MAX
STAGING_ROOT = "/tmp"


class CopyError(Exception):
    pass


@dataclass(frozen=True)
class Member:
    """One archive entry: its normalized context path, kind ("file", "dir",
    "symlink"), mode and (symlinks) target."""

    name: str
    kind: str
    mode: int
    target: str = ""


def _norm(path: str) -> str:
    p = posixpath.normpath(path.replace("\\", "/")).lstrip("/")
    return "" if p == "." else p


def _glob_re(pattern: str) -> re.Pattern[str]:
    """A regex for a context-relative glob: `*`/`?`/`[...]` within a segment,
    `**` across segments (the SDK's GLOBSTAR)."""
    out: list[str] = []
    segments = pattern.split("/")
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if seg == "**":
            out.append(".*" if last else "(?:.*/)?")
            continue
        j, buf = 0, ""
        while j < len(seg):
            c = seg[j]
            if c == "*":
                buf += "[^/]*"
            elif c == "?":
                buf += "[^/]"
            elif c == "[":
                k = seg.find("]", j + 2)
                if k < 0:
                    buf += re.escape(c)
                else:
                    body = seg[j + 1 : k].replace("\\", "\\\\")
                    if body.startswith("!"):
                        body = "^" + body[1:]
                    buf += f"[{body}]"
                    j = k
            else:
                buf += re.escape(c)
            j += 1
        out.append(buf + ("" if last else "/"))
    return re.compile("".join(out))


def matches(members: list[Member], src: str) -> list[Member]:
    """The archive entries `src` names itself (not those under a matched directory)."""
    pattern = _norm(src)
    if pattern == "":
        return [Member("", "dir", 0o755)]
    rx = _glob_re(pattern)
    hits = sorted((m for m in members if rx.fullmatch(m.name)), key=lambda m: m.name)
    out: list[Member] = []
    for m in hits:
        if not any(o.kind == "dir" and m.name.startswith(o.name + "/") for o in out):
            out.append(m)
    return out


def read_members(archive: Path) -> list[Member]:
    """The entries of an uploaded archive (blocking). Raises CopyError for
    paths that leave the context or entry types a COPY cannot hold."""
    out: list[Member] = []
    with tarfile.open(archive, "r:*") as tar:
        for info in tar:
            name = _norm(info.name)
            if info.name.startswith("/") or name.split("/")[0] == "..":
                raise CopyError(f"archive entry {info.name!r} leaves the build context")
            if name == "":
                continue
            if info.isdir():
                out.append(Member(name, "dir", info.mode & 0o7777))
            elif info.isreg():
                out.append(Member(name, "file", info.mode & 0o7777))
            elif info.issym():
                out.append(Member(name, "symlink", 0o777, info.linkname))
            elif info.islnk():  # a hard link: copied as the file it names
                out.append(Member(name, "file", info.mode & 0o7777, _norm(info.linkname)))
            else:
                raise CopyError(f"archive entry {info.name!r} is not a file, directory or link")
    return out


def _batched(cmd: str, args: list[str]) -> Iterator[str]:
    line: list[str] = []
    size = len(cmd)
    for a in args:
        q = shlex.quote(a)
        if line and size + len(q) + 1 > _MAX_LINE:
            yield f"{cmd} {' '.join(line)}"
            line, size = [], len(cmd)
        line.append(q)
        size += len(q) + 1
    if line:
        yield f"{cmd} {' '.join(line)}"


def script(
    members: list[Member],
    src: str,
    dest: str,
    *,
    workdir: str,
    staging: str,
    owner: str | None,
    mode: int | None,
    several: bool = False,
) -> str:
    """The shell script that places files staged under `staging` (the archive's
    regular files at their context paths) for `COPY src dest`.

    `several`: other sources go to the same `dest` (so it is a directory).
    Raises CopyError if `src` matches nothing.
    """
    hits = matches(members, src)
    if not hits:
        raise CopyError(f"no files match {src!r} in the upload")
    st = staging.rstrip("/")
    lines = ["set -e", f"S={shlex.quote(st)}"]
    dirs = [f"{st}/{m.name}" for m in members if m.kind == "dir"]
    lines += _batched("mkdir -p --", dirs)
    for m in members:
        if m.kind == "symlink":
            lines.append(f"ln -sfn -- {shlex.quote(m.target)} {shlex.quote(f'{st}/{m.name}')}")
    by_mode: dict[int, list[str]] = {}
    for m in members:
        if m.kind != "symlink":
            by_mode.setdefault(mode if mode is not None else m.mode, []).append(f"{st}/{m.name}")
    for md, paths in sorted(by_mode.items()):
        lines += _batched(f"chmod {md:o} --", paths)
    into_dir = dest.endswith("/") or several or len(hits) > 1
    base = posixpath.normpath(posixpath.join(workdir, dest))
    owned: list[str] = []
    for m in hits:
        staged = shlex.quote(f"{st}/{m.name}" if m.name else st)
        if m.kind == "dir":
            lines.append(f"mkdir -p -- {shlex.quote(base)}")
            lines.append(f"cp -a {staged}/. {shlex.quote(base)}/")
            prefix = f"{m.name}/" if m.name else ""
            owned += [
                posixpath.join(base, x.name[len(prefix) :])
                for x in members
                if x.name.startswith(prefix) and x.name != m.name
            ]
            continue
        name = posixpath.basename(m.name)
        if into_dir:
            target = posixpath.join(base, name)
            lines.append(f"mkdir -p -- {shlex.quote(base)}")
            lines.append(f"rm -rf -- {shlex.quote(target)}")
            lines.append(f"cp -a {staged} {shlex.quote(target)}")
            owned.append(target)
        else:
            lines.append(f"T={shlex.quote(base)}")
            lines.append(f'if [ -d "$T" ] && [ ! -L "$T" ]; then T="$T"/{shlex.quote(name)}; fi')
            lines.append('mkdir -p -- "$(dirname -- "$T")" && rm -rf -- "$T"')
            lines.append(f'cp -a {staged} "$T"')
            if owner:
                lines.append(f'chown -h {shlex.quote(owner)} "$T"')
    if owner:
        lines += _batched(f"chown -h {shlex.quote(owner)} --", owned)
    return "\n".join(lines) + "\n"


def _multipart(
    archive: Path, staging: str, boundary: str, extra: dict[str, bytes]
) -> Generator[bytes, None, None]:
    """The multipart/form-data body of the archive's regular files (as parts
    named by their staging path) and the `extra` files (blocking)."""

    def head(path: str) -> bytes:
        return (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="{path}"\r\nContent-Type: application/octet-stream\r\n\r\n'
        ).encode()

    with tarfile.open(archive, "r:*") as tar:
        for info in tar:
            if not (info.isreg() or info.islnk()):
                continue
            name = _norm(info.name)
            f = tar.extractfile(info)
            if f is None:
                continue
            yield head(f"{staging}/{name}")
            with f:
                while chunk := f.read(_CHUNK):
                    yield chunk
            yield b"\r\n"
    for path, data in extra.items():
        yield head(path) + data + b"\r\n"
    yield f"--{boundary}--\r\n".encode()


async def copy_into(
    actor: SandboxActor,
    archive: Path,
    script_for: list[tuple[str, str, str | None, int | None]],
    *,
    workdir: str,
) -> str:
    """Stage `archive` in `actor` and write the placing script; returns the
    command that runs it (as root). `script_for`: (src, dest, owner, mode)
    per source of this step. Raises CopyError."""
    client = actor.http
    if client is None or actor.sandbox_ip is None:
        raise RuntimeError(f"build sandbox {actor.sandbox_id} is not running")
    members = await trio.to_thread.run_sync(read_members, archive)
    staging = f"{STAGING_ROOT}/.aenv-copy-{secrets.token_hex(6)}"
    several = len(script_for) > 1
    body = "\n".join(
        script(
            members,
            src,
            dest,
            workdir=workdir,
            staging=staging,
            owner=owner,
            mode=mode,
            several=several,
        )
        for src, dest, owner, mode in script_for
    )
    body += f"rm -rf -- {shlex.quote(staging)}\n"
    script_path = f"{staging}/.aenv-copy.sh"
    boundary = f"aenv-{secrets.token_hex(12)}"
    parts = _multipart(archive, staging, boundary, {script_path: body.encode()})

    async def stream() -> AsyncIterator[bytes]:
        while True:
            chunk = await trio.to_thread.run_sync(next, parts, None)
            if chunk is None:
                return
            yield chunk

    try:
        resp = await client.post(
            f"http://{actor.sandbox_ip}:{ENVD_PORT}/files",
            params={"username": "root"},
            headers={
                "x-access-token": actor.envd_access_token,
                "content-type": f"multipart/form-data; boundary={boundary}",
                "connection": "close",
            },
            content=stream(),
            timeout=600,
        )
    finally:
        parts.close()  # the archive is closed also when the upload broke off
    if resp.status_code != 200:
        raise CopyError(
            f"staging the files failed: envd answered {resp.status_code} {resp.text[:200]}"
        )
    return f"sh {shlex.quote(script_path)}"
