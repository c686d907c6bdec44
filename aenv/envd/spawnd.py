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
request with three file descriptors (stdin, stdout, stderr; or two, stdout
and stderr, stdin then the spawner's own /dev/null), a `marshal` reply
(`pid`, or `errno` and `message` (with `cwd` when the working directory is
missing), or `unavailable`), and for each child it started, once it has
exited, `exit` and `returncode` (negative: the signal that killed it, as
`subprocess` reports it). Only envd talks to it, over a socket pair:
marshal's format is private to one interpreter.

A process of another user is started with the spawner's own credentials
switched to that user's for the spawn (`_as_user`): real and effective uid,
gid and groups the user's, the saved uid kept at root so the spawner can
switch back. The child then needs nothing set between fork and exec, so
it is vforked (≈ 11 ms under gVisor) instead of forked to run setgid,
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
FDS = 3  # stdin, stdout, stderr (without stdin: /dev/null, the spawner's own)
_INT = 4  # bytes of a C int in an SCM_RIGHTS array


def _serve(sock: "_socket.socket", limit: int) -> None:  # pragma: no cover (the child)
    """The spawner's loop: never returns."""
    import resource
    import select

    held = [limit]
    devnull = os.open(os.devnull, os.O_RDONLY)
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
            _send(sock, {"exit": pid, "returncode": code})
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
            reply = _spawn(marshal.loads(data), fds, children, held, devnull)
        finally:
            for fd in fds:
                os.close(fd)
        _send(sock, reply)


def _send(sock: "_socket.socket", msg: "dict[str, Any]") -> None:  # pragma: no cover
    try:
        sock.send(marshal.dumps(msg))
    except OSError:  # envd is gone
        os._exit(0)


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
    req: "dict[str, Any]", fds: list[int], children: set[int], held: list[int], devnull: int
) -> "dict[str, Any]":  # pragma: no cover (the child)
    if len(fds) == FDS - 1:
        fds = [devnull, *fds]
    elif len(fds) != FDS:
        return {"unavailable": "file descriptors"}
    if req["limit"] != held[0]:
        if req["limit"] > held[0]:  # (raising it back would need CAP_SYS_RESOURCE)
            return {"unavailable": "limit"}
        import resource

        resource.setrlimit(resource.RLIMIT_NPROC, (req["limit"], req["limit"]))
        held[0] = req["limit"]
    argv = req["argv"]
    try:
        try:
            pid = _start_as(argv, fds, req)
        except FileNotFoundError:
            # (`fallback`: what to run when argv[0] does not exist, as /bin/sh for /bin/bash)
            fallback = req.get("fallback")
            if not fallback or os.path.exists(argv[0]) or not os.path.isdir(req["cwd"]):
                raise
            pid = _start_as([fallback, *argv[1:]], fds, req)
    except BlockingIOError:  # root's processes at the limit: envd spawns it
        return {"unavailable": "limit reached"}
    except OSError as e:
        reply: dict[str, Any] = {"errno": e.errno or errno.EINVAL, "message": e.strerror or str(e)}
        if not os.path.isdir(req["cwd"]):
            reply["cwd"] = True
        return reply
    except Exception as e:
        return {"unavailable": str(e)}
    children.add(pid)
    return {"pid": pid}


def _start_as(
    argv: list[str], fds: list[int], req: "dict[str, Any]"
) -> int:  # pragma: no cover (the child)
    """Start `argv` as the request's user: with the spawner's credentials
    switched to the user's (vfork), else with them set in the child (fork)."""
    uid, gid, groups = req["uid"], req["gid"], list(req["groups"])
    env, cwd = req["env"], req["cwd"]
    if os.getuid() != 0 or (
        (uid, gid) == (os.getuid(), os.getgid()) and set(groups) == set(os.getgroups())
    ):
        return start(argv, fds, env=env, cwd=cwd)  # nothing to set: vfork
    own = (os.getresuid(), os.getresgid(), os.getgroups())
    try:
        try:
            os.setgroups(groups)
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, 0)
        except OSError as e:
            raise _NoSwitch(e) from None
        try:
            return start(argv, fds, env=env, cwd=cwd)
        finally:
            _restore(*own)
    except (BlockingIOError, PermissionError, _NoSwitch):
        _restore(*own)  # (a no-op when the block restored them)
        # the user's processes at their limit, or a cwd (or binary) the user may
        # not use: as before, as root, the credentials set in the child (fork)
        return start(argv, fds, env=env, cwd=cwd, uid=uid, gid=gid, groups=groups)


class _NoSwitch(Exception):
    """The credentials could not be switched."""


def _restore(
    uids: "tuple[int, int, int]", gids: "tuple[int, int, int]", groups: list[int]
) -> None:  # pragma: no cover (the child)
    try:
        os.setresuid(*uids)  # (first: setting gids and groups needs root's capabilities)
        os.setresgid(*gids)
        os.setgroups(groups)
    except OSError as e:  # never serve another request with the wrong credentials
        print(f"aenv.envd.spawner: cannot restore credentials: {e!r}", file=sys.stderr, flush=True)
        os._exit(1)


def _ignore(signum: int, frame: object) -> None:  # pragma: no cover (the child)
    """A handler that does nothing (see the module's docstring)."""


# signals a user may send the spawner while it holds the user's credentials
_SURVIVED = (
    _signal.SIGHUP,
    _signal.SIGINT,
    _signal.SIGQUIT,
    _signal.SIGTERM,
    _signal.SIGUSR1,
    _signal.SIGUSR2,
    _signal.SIGALRM,
    _signal.SIGPIPE,
    _signal.SIGTSTP,
    _signal.SIGTTIN,
    _signal.SIGTTOU,
    _signal.SIGVTALRM,
    _signal.SIGPROF,
    _signal.SIGXCPU,
)


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
            for sig in _SURVIVED:
                _signal.signal(sig, _ignore)
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
