"""The spawner's own side (see `aenv.envd.spawner`): built-in C modules only.

`python -c 'from aenv.envd.__main__ import main; main()' --guard` forks it
before importing anything else (`early_spawner`), so the copy holds a bare
interpreter's heap, not envd's: every page the two share at the fork is
copied once envd writes to it (CPython's reference counts and garbage
collector write to every page of its heap), so what the spawner holds at
the fork it holds privately in every sandbox. Forked from the full envd it
cost ≈ 19 MiB of host memory per sandbox; after `runpy`, `json`,
`subprocess` and `socket` ≈ 5.4 MiB; from the bare interpreter, with
only built-in modules (`_socket`, `_signal`, `marshal`, `_posixsubprocess`,
`select`, `resource`), ≈ 2.7 MiB (docs/performance.md, Density).

It serves one request at a time on a SOCK_SEQPACKET socket: a `marshal`
request with three file descriptors (stdin, stdout, stderr), a `marshal`
reply (`pid`, or `errno` and `message`, or `unavailable`), and for each
child it started, once it has exited, `exit` and `returncode` (negative:
the signal that killed it, as `subprocess` reports it). Only envd talks
to it, over a socket pair: marshal's format is private to one interpreter.
"""

import _signal  # type: ignore[import-not-found]  # (signal.py imports enum)
import _socket
import errno
import marshal
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from typing import Any

# Processes (threads included) one user may run at once, unless /init says otherwise.
DEFAULT_PROCESS_LIMIT = 1024
MAX_MESSAGE = 1 << 20
FDS = 3  # stdin, stdout, stderr
_INT = 4  # bytes of a C int in an SCM_RIGHTS array


def _serve(sock: "_socket.socket", limit: int) -> None:  # pragma: no cover (the child)
    """The spawner's loop: never returns."""
    import resource
    import select

    held = [limit]
    resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    _signal.set_wakeup_fd(wake_w)
    _signal.signal(_signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    space = _socket.CMSG_SPACE(FDS * _INT)
    while True:
        try:
            ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            try:  # (no contextlib: the spawner imports nothing it can avoid)  # noqa: SIM105
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        for pid, code in _reap(children):
            sock.send(marshal.dumps({"exit": pid, "returncode": code}))
        if sock.fileno() not in ready:
            continue
        try:
            data, ancdata, _, _ = sock.recvmsg(MAX_MESSAGE, space)
        except OSError:
            os._exit(0)
        if not data:  # envd is gone
            os._exit(0)
        fds = _received_fds(ancdata)
        try:
            reply = _spawn(marshal.loads(data), fds, children, held)
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(marshal.dumps(reply))


def _received_fds(ancdata: "list[tuple[int, int, bytes]]") -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            usable = len(data) - len(data) % _INT
            fds += [
                int.from_bytes(data[i : i + _INT], sys.byteorder, signed=True)
                for i in range(0, usable, _INT)
            ]
    return fds


def _reap(children: set[int]) -> "list[tuple[int, int]]":
    """The children that have exited, with their return codes (as `subprocess`'s)."""
    done = []
    for pid in list(children):
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            got, status = pid, 0  # (reaped elsewhere: as `Popen.poll`)
        if got == pid:
            children.discard(pid)
            done.append((pid, os.waitstatus_to_exitcode(status)))
    return done


def _spawn(
    req: "dict[str, Any]", fds: list[int], children: set[int], held: list[int]
) -> "dict[str, Any]":  # pragma: no cover (the child)
    if len(fds) != FDS:
        return {"unavailable": "file descriptors"}
    if req["limit"] != held[0]:
        if req["limit"] > held[0]:  # (raising it back would need CAP_SYS_RESOURCE)
            return {"unavailable": "limit"}
        import resource

        resource.setrlimit(resource.RLIMIT_NPROC, (req["limit"], req["limit"]))
        held[0] = req["limit"]
    same = (req["uid"], req["gid"]) == (os.getuid(), os.getgid()) and sorted(
        set(req["groups"])
    ) == sorted(set(os.getgroups()))
    # credentials to set: fork; else vfork, cheaper
    creds = os.getuid() == 0 and not same
    try:
        pid = start(
            req["argv"],
            fds,
            env=req["env"],
            cwd=req["cwd"],
            uid=req["uid"] if creds else None,
            gid=req["gid"] if creds else None,
            groups=list(req["groups"]) if creds else None,
        )
    except BlockingIOError:  # root's processes at the limit: envd spawns it
        return {"unavailable": "limit reached"}
    except OSError as e:
        return {"errno": e.errno or errno.EINVAL, "message": e.strerror or str(e)}
    except Exception as e:
        return {"unavailable": str(e)}
    children.add(pid)
    return {"pid": pid}


def start(
    argv: list[str],
    fds: list[int],
    *,
    env: dict[str, str],
    cwd: str,
    uid: int | None = None,
    gid: int | None = None,
    groups: list[int] | None = None,
) -> int:
    """Start `argv` with `fds` as its stdin, stdout, stderr; its pid.

    What `subprocess.Popen(argv, stdin=, stdout=, stderr=, env=, cwd=,
    close_fds=True, restore_signals=True, process_group=0, user=, group=,
    extra_groups=)` does, through the same C function (vfork unless
    credentials change), without importing `subprocess` (≈ 2 MiB of a
    small interpreter's heap). Raises OSError as Popen does, for the
    fork, the directory or the executable.
    """
    import _posixsubprocess

    if not argv:
        raise OSError(errno.ENOENT, "empty command")
    env_list = []
    for k, v in env.items():
        key = os.fsencode(k)
        if b"=" in key:
            raise ValueError("illegal environment variable name")
        env_list.append(key + b"=" + os.fsencode(v))
    exe = os.fsencode(argv[0])
    if os.path.dirname(exe):
        exe_list: tuple[bytes, ...] = (exe,)
    else:  # as os._execvpe
        exe_list = tuple(os.path.join(os.fsencode(d), exe) for d in os.get_exec_path(env))
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = _posixsubprocess.fork_exec(
            [os.fsencode(a) for a in argv], exe_list,
            True, (err_w,),  # close_fds, fds_to_keep
            cwd, env_list,
            fds[0], -1, -1, fds[1], -1, fds[2],  # stdin, stdout, stderr (ours: none)
            err_r, err_w,
            True, False, 0,  # restore_signals, start_new_session, process_group
            gid, groups, uid, -1,  # umask unchanged
            None, True,  # type: ignore[arg-type]  # preexec_fn (None: none), allow_vfork
        )  # fmt: skip
        os.close(err_w)
        err_w = -1
        failure = b""
        while chunk := os.read(err_r, 50000):
            failure += chunk
    finally:
        os.close(err_r)
        if err_w >= 0:
            os.close(err_w)
    if failure:
        os.waitpid(pid, 0)
        _raise_child_error(failure, cwd, argv[0])
    return pid


def _raise_child_error(failure: bytes, cwd: str, exe: str) -> None:
    """Raise what the child reported ("ExceptionName:hex errno:message") as Popen does."""
    try:
        _name, hex_errno, message = failure.split(b":", 2)
        number = int(hex_errno, 16)
    except ValueError:
        raise OSError(errno.EINVAL, f"bad error report from the child: {failure!r}") from None
    if number:
        # "noexec": it failed before exec, on the directory
        filename = cwd if message == b"noexec" else exe
        raise OSError(number, os.strerror(number), filename)
    raise OSError(errno.EINVAL, message.decode(errors="replace"))


def _fork(limit: int) -> tuple[int, int]:
    """Fork the spawner (call before any thread starts); its pid and envd's
    end of the socket, as a file descriptor."""
    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            ours.close()
            os.closerange(3, theirs.fileno())
            os.closerange(theirs.fileno() + 1, 1 << 16)
            for sig in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGPIPE):
                _signal.signal(sig, _signal.SIG_DFL)
            _signal.set_wakeup_fd(-1)
            _serve(theirs, limit)
        except BaseException as e:
            print(f"aenv.envd.spawner: {e!r}", file=sys.stderr, flush=True)
        os._exit(1)
    theirs.close()
    return pid, ours.detach()


def fork_spawner(limit: int) -> "tuple[int, socket.socket]":
    """Fork the spawner off this process (call before any thread starts);
    returns its pid and envd's end of the socket."""
    pid, fd = _fork(limit)
    import socket

    return pid, socket.socket(fileno=fd)


def early_spawner(argv: list[str]) -> "tuple[int, socket.socket] | None":
    """For envd's entry point: the spawner, forked now when envd will run as a
    sandbox's pid 1 (`--guard`), else None."""
    if "--guard" not in argv:
        return None
    try:
        return fork_spawner(DEFAULT_PROCESS_LIMIT)
    except OSError as e:
        print(f"aenv.envd: no spawner ({e}); envd spawns processes itself", file=sys.stderr)
        return None
