"""What a user may have done in a sandbox before its memory is captured.

Each sequence drives envd through the real e2b SDK the way the issue's
reports did (stdin closed, a PTY session, killed background commands) and
leaves the sandbox idle, with the SDK's connections to envd open (each
call through the node's proxy leaves one in the pool). A fork, or a pause
written to disk, must then give sandboxes whose envd answers at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from e2b import PtySize, Sandbox

KEPT = "from the source"


def stdin_closed(s: Sandbox) -> None:
    """A process fed on stdin, whose stdin is then closed: it ends on its own."""
    h = s.commands.run("cat", background=True, stdin=True)
    s.commands.send_stdin(h.pid, "x\n")
    h.close_stdin()
    assert h.wait().stdout == "x\n"


def pty_session(s: Sandbox) -> None:
    """A PTY shell that exits after its input, and one that is killed."""
    h = s.pty.create(PtySize(rows=24, cols=80))
    s.pty.send_stdin(h.pid, b"echo typed > /tmp/typed.txt; exit 0\n")
    assert h.wait().exit_code == 0
    killed = s.pty.create(PtySize(rows=24, cols=80))
    s.pty.send_stdin(killed.pid, b"echo still here\n")
    assert s.pty.kill(killed.pid)
    _gone(s, killed.pid)
    assert s.files.read("/tmp/typed.txt") == "typed\n"


def background_killed(s: Sandbox) -> None:
    """Background commands (one with stdin open) killed before the capture.

    Their handles are held until the processes are gone, as a user's would
    be: each keeps the SDK's stream of its command, and its connection."""
    handles = [
        s.commands.run("sleep 1000", background=True),
        s.commands.run("sleep 1000", background=True, stdin=True),
    ]
    for h in handles:
        assert h.kill()
    for h in handles:
        _gone(s, h.pid)


def _gone(s: Sandbox, pid: int, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while pid in {p.pid for p in s.commands.list()}:
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.1)


SEQUENCES: dict[str, Callable[[Sandbox], None]] = {
    "stdin-closed": stdin_closed,
    "pty": pty_session,
    "background-killed": background_killed,
}


def answers(s: Sandbox) -> None:
    """The sandbox runs a command and keeps the file written before the capture."""
    assert s.commands.run("echo alive").stdout.strip() == "alive"
    assert s.files.read("/home/user/kept.txt") == KEPT
