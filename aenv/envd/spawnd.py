"""The spawner's own side (see `aenv.envd.spawner`): standard library only.

`python -m aenv.envd --guard` forks it before importing trio, hypercorn or
the rest of envd (`early_spawner`), so the copy holds a small interpreter's
heap, not envd's: forked from the full envd it cost ≈ 19 MiB more host
memory per sandbox (CPython's reference counts and garbage collector write
to every page of the parent's heap, each write copying a page the child
shares). It serves one request at a time on a SOCK_SEQPACKET socket: a
JSON request with three file descriptors (stdin, stdout, stderr), a JSON
reply (`pid`, or `errno` and `message`, or `unavailable`), and for each
child it started, once it has exited, `exit` and `returncode`.
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
from typing import Any

# Processes (threads included) one user may run at once, unless /init says otherwise.
DEFAULT_PROCESS_LIMIT = 1024
MAX_MESSAGE = 1 << 20
FDS = 3  # stdin, stdout, stderr


def _serve(sock: socket.socket, limit: int) -> None:  # pragma: no cover (runs in the guest)
    """The spawner's loop: never returns."""
    held = [limit]
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
                sock.send(json.dumps({"exit": pid, "returncode": code}).encode())
        if sock.fileno() not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, FDS)
        except OSError:
            os._exit(0)
        if not data:  # envd is gone
            os._exit(0)
        try:
            reply = _spawn(json.loads(data), fds, children, held)
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps(reply).encode())


def _spawn(
    req: dict[str, Any],
    fds: list[int],
    children: dict[int, subprocess.Popen[bytes]],
    held: list[int],
) -> dict[str, Any]:  # pragma: no cover (runs in the guest)
    if len(fds) != FDS:
        return {"unavailable": "file descriptors"}
    if req["limit"] != held[0]:
        if req["limit"] > held[0]:  # (raising it back would need CAP_SYS_RESOURCE)
            return {"unavailable": "limit"}
        resource.setrlimit(resource.RLIMIT_NPROC, (req["limit"], req["limit"]))
        held[0] = req["limit"]
    kw: dict[str, Any] = {}
    same = (req["uid"], req["gid"]) == (os.getuid(), os.getgid()) and sorted(
        set(req["groups"])
    ) == sorted(set(os.getgroups()))
    if os.getuid() == 0 and not same:  # (credentials to set: fork; else vfork, cheaper)
        kw.update(user=req["uid"], group=req["gid"], extra_groups=req["groups"])
    try:
        popen = subprocess.Popen(
            req["argv"],
            stdin=fds[0],
            stdout=fds[1],
            stderr=fds[2],
            env=req["env"],
            cwd=req["cwd"],
            close_fds=True,
            restore_signals=True,
            process_group=0,
            **kw,
        )
    except BlockingIOError:  # root's processes at the limit: envd spawns it
        return {"unavailable": "limit reached"}
    except OSError as e:
        return {"errno": e.errno or errno.EINVAL, "message": e.strerror or str(e)}
    except Exception as e:
        return {"unavailable": str(e)}
    children[popen.pid] = popen
    return {"pid": popen.pid}


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
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_DFL)
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
