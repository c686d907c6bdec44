"""The spawner's own side (see `aenv.envd.spawner`): standard library only.

`python -m aenv.envd --guard` forks it before importing trio, hypercorn or
the rest of envd (`early_spawner`), so the copy holds a small interpreter's
heap, not envd's: forked from the full envd it cost ≈ 19 MiB more host
memory per sandbox (CPython's reference counts and garbage collector write
to every page of the parent's heap, each write copying a page the child
shares). It serves one request at a time on a SOCK_SEQPACKET socket: a
JSON request with three file descriptors (stdin, stdout, stderr; or two,
stdin then /dev/null), a JSON
reply (`pid`, or `errno` and `message` (with `cwd` when the working
directory is missing), or `unavailable`), and for each child it started,
once it has exited, `exit` and `returncode`.

A process of another user is started with the spawner's own credentials
switched to that user's for the spawn (`_as_user`): real and effective uid,
gid and groups the user's, the saved uid kept at root so the spawner can
switch back. The child then needs nothing set between fork and exec, so
CPython vforks (≈ 11 ms under gVisor) instead of forking to run setgid,
setgroups and setuid in the child (≈ 22 to 25 ms, and more the busier the
machine); exec makes its saved ids the user's too (execve copies the
effective ids into the saved ones) and its capabilities empty. A spawn
this way cannot serve (the user's processes at their limit, now counted
against the user as the fork happens, or a working directory the user may
not enter) is made the old way, as root, the credentials set in the child.
For the few milliseconds of the switch the user may signal the spawner
(its real uid is theirs): it handles every catchable signal that would
stop or end it (handled, not ignored, so its children start with the
default dispositions); SIGSTOP envd answers with SIGCONT; after SIGKILL
envd forks another (`aenv.envd.spawner`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

# Processes (threads included) one user may run at once, unless /init says otherwise.
DEFAULT_PROCESS_LIMIT = 1024
MAX_MESSAGE = 1 << 20
FDS = 3  # stdin, stdout, stderr (without stdin: /dev/null, the spawner's own)


def _serve(sock: socket.socket, limit: int) -> None:  # pragma: no cover (runs in the guest)
    """The spawner's loop: never returns."""
    held = [limit]
    devnull = os.open(os.devnull, os.O_RDONLY)
    resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, subprocess.Popen[bytes]] = {}
    while True:
        try:
            ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        for pid, popen in list(children.items()):
            code = popen.poll()
            if code is not None:
                del children[pid]
                _send(sock, {"exit": pid, "returncode": code})
        if sock.fileno() not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, FDS)
        except OSError:
            os._exit(0)
        if not data:  # envd is gone
            os._exit(0)
        try:
            reply = _spawn(json.loads(data), fds, children, held, devnull)
        finally:
            for fd in fds:
                os.close(fd)
        _send(sock, reply)


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:  # pragma: no cover
    try:
        sock.send(json.dumps(msg).encode())
    except OSError:  # envd is gone
        os._exit(0)


def _spawn(
    req: dict[str, Any],
    fds: list[int],
    children: dict[int, subprocess.Popen[bytes]],
    held: list[int],
    devnull: int,
) -> dict[str, Any]:  # pragma: no cover (runs in the guest)
    if len(fds) == FDS - 1:
        fds = [devnull, *fds]
    elif len(fds) != FDS:
        return {"unavailable": "file descriptors"}
    if req["limit"] != held[0]:
        if req["limit"] > held[0]:  # (raising it back would need CAP_SYS_RESOURCE)
            return {"unavailable": "limit"}
        resource.setrlimit(resource.RLIMIT_NPROC, (req["limit"], req["limit"]))
        held[0] = req["limit"]
    kw: dict[str, Any] = {
        "stdin": fds[0],
        "stdout": fds[1],
        "stderr": fds[2],
        "env": req["env"],
        "cwd": req["cwd"],
        "close_fds": True,
        "restore_signals": True,
        "process_group": 0,
    }
    argv = req["argv"]
    try:
        try:
            popen = _popen(argv, req, kw)
        except FileNotFoundError:
            # (`fallback`: what to run when argv[0] does not exist, as /bin/sh for /bin/bash)
            if not req.get("fallback") or os.path.exists(argv[0]) or not os.path.isdir(req["cwd"]):
                raise
            popen = _popen([req["fallback"], *argv[1:]], req, kw)
    except BlockingIOError:  # root's processes at the limit: envd spawns it
        return {"unavailable": "limit reached"}
    except OSError as e:
        reply: dict[str, Any] = {"errno": e.errno or errno.EINVAL, "message": e.strerror or str(e)}
        if not os.path.isdir(req["cwd"]):
            reply["cwd"] = True
        return reply
    except Exception as e:
        return {"unavailable": str(e)}
    children[popen.pid] = popen
    return {"pid": popen.pid}


def _popen(  # pragma: no cover (runs in the guest)
    argv: list[str], req: dict[str, Any], kw: dict[str, Any]
) -> subprocess.Popen[bytes]:
    """Start `argv`: with the spawner's credentials switched to the caller's
    (vfork), else with them set in the child (fork)."""
    uid, gid, groups = req["uid"], req["gid"], req["groups"]
    if os.getuid() != 0 or (
        (uid, gid) == (os.getuid(), os.getgid()) and set(groups) == set(os.getgroups())
    ):
        return subprocess.Popen(argv, **kw)  # nothing to set: vfork
    try:
        with _as_user(uid, gid, groups):
            return subprocess.Popen(argv, **kw)
    except (BlockingIOError, PermissionError, _NoSwitch):
        # the user's processes at their limit, or a cwd (or binary) the user may
        # not use: as before, as root, the credentials set in the child (fork)
        return subprocess.Popen(argv, user=uid, group=gid, extra_groups=groups, **kw)


class _NoSwitch(Exception):
    """The credentials could not be switched (the spawner is back at its own)."""


@contextlib.contextmanager
def _as_user(uid: int, gid: int, groups: list[int]) -> Iterator[None]:  # pragma: no cover
    """Run the block with real and effective uid, gid and groups the user's, the
    saved uid root's (to come back). Called as root, single-threaded."""
    own = (os.getresuid(), os.getresgid(), os.getgroups())
    try:
        os.setgroups(groups)
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, 0)
    except OSError as e:
        _restore(*own)
        raise _NoSwitch(e) from None
    try:
        yield
    finally:
        _restore(*own)


def _restore(  # pragma: no cover (runs in the guest)
    uids: tuple[int, int, int], gids: tuple[int, int, int], groups: list[int]
) -> None:
    try:
        os.setresuid(*uids)  # (first: setting gids and groups needs root's capabilities)
        os.setresgid(*gids)
        os.setgroups(groups)
    except OSError as e:  # never serve another request with the wrong credentials
        print(f"aenv.envd.spawner: cannot restore credentials: {e!r}", file=sys.stderr, flush=True)
        os._exit(1)


def _ignore(signum: int, frame: object) -> None:  # pragma: no cover (runs in the guest)
    """A handler that does nothing (see the module's docstring)."""


# signals a user may send the spawner while it holds the user's credentials
_SURVIVED = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGPIPE,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
    signal.SIGVTALRM,
    signal.SIGPROF,
    signal.SIGXCPU,
)


def fork_spawner(limit: int) -> tuple[int, socket.socket]:
    """Fork the spawner off this process (call before any thread starts);
    returns its pid and envd's end of the socket."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            ours.close()
            os.closerange(3, theirs.fileno())
            os.closerange(theirs.fileno() + 1, 1 << 16)
            for sig in _SURVIVED:
                signal.signal(sig, _ignore)
            signal.set_wakeup_fd(-1)
            _serve(theirs, limit)
        except BaseException as e:
            print(f"aenv.envd.spawner: {e!r}", file=sys.stderr, flush=True)
        os._exit(1)
    theirs.close()
    return pid, ours


def early_spawner(argv: list[str]) -> tuple[int, socket.socket] | None:
    """For `python -m aenv.envd`: the spawner, forked now when envd will run
    as a sandbox's pid 1 (`--guard`), else None."""
    if "--guard" not in argv:
        return None
    try:
        return fork_spawner(DEFAULT_PROCESS_LIMIT)
    except OSError as e:
        print(f"aenv.envd: no spawner ({e}); envd spawns processes itself", file=sys.stderr)
        return None
