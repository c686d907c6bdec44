"""The `aenv` CLI against a real node: REST commands, exec streaming, the shell.

Rules: loopback only; the session `node` fixture owns the node process; the
CLI runs as a subprocess (`python -m aenv`) configured through AENV_URL /
AENV_API_KEY (and a private XDG_CONFIG_HOME, so no user credentials leak in);
interactive sessions run on a pseudo-terminal through pexpect; every test
kills the sandboxes it starts (the `sid` fixture) so the leak check at session
end sees a clean node. Errors must be one line on stderr, no traceback, with
the exit codes of docs/cli.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pexpect
import pytest

from tests.conftest import NodeProc, free_port, requires_node
from tests.registry import LocalRegistry, push_busybox

pytestmark = [requires_node, pytest.mark.runsc]

TEMPLATE = os.environ.get("AENV_TEST_TEMPLATE", "base")
AENV = [sys.executable, "-m", "aenv"]
EXIT_USAGE, EXIT_NOT_FOUND, EXIT_UNREACHABLE, EXIT_AUTH = 64, 66, 69, 77


@pytest.fixture
def env(node: NodeProc, tmp_path: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    e.update(
        {
            "AENV_URL": node.url,
            "AENV_API_KEY": node.api_key,
            "XDG_CONFIG_HOME": str(tmp_path / "config"),
            "TERM": "xterm",
        }
    )
    return e


def aenv(
    env: dict[str, str], *args: str, input: bytes | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*AENV, *args],
        env=env,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
        capture_output=True,
        timeout=timeout,
    )


def ok(env: dict[str, str], *args: str, input: bytes | None = None) -> str:
    r = aenv(env, *args, input=input)
    assert r.returncode == 0, (args, r.returncode, r.stderr.decode())
    return r.stdout.decode()


def one_line_error(r: subprocess.CompletedProcess[bytes], code: int) -> str:
    err = r.stderr.decode()
    assert r.returncode == code, (r.returncode, err)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("aenv: "), err
    return lines[0]


@pytest.fixture
def sid(env: dict[str, str]) -> Iterator[str]:
    s = ok(env, "start", TEMPLATE, "-d", "--timeout", "600", "--metadata", "suite=cli").strip()
    try:
        yield s
    finally:
        aenv(env, "rm", s)


def listed(env: dict[str, str]) -> list[str]:
    return [s["sandboxID"] for s in json.loads(ok(env, "ls"))]


# -- REST commands -----------------------------------------------------------------


def test_template_list_is_json_when_piped(env: dict[str, str]) -> None:
    items = json.loads(ok(env, "template", "ls"))
    assert TEMPLATE in {a for t in items for a in t["aliases"]}
    table = ok(env, "template", "list", "--output", "table")
    assert table.splitlines()[0].split()[:2] == ["TEMPLATE", "ID"]


def test_start_list_prefix_timeout_delete(env: dict[str, str]) -> None:
    s = ok(env, "start", TEMPLATE, "-d", "--metadata", "suite=cli").strip()
    try:
        assert len(s) == 20
        assert s in listed(env)
        table = ok(env, "list", "--output", "table", "--state", "running")
        row = next(line for line in table.splitlines() if line.startswith(s))
        assert "running" in row and "suite=cli" in row
        assert json.loads(ok(env, "ls", "--state", "paused")) == [
            x for x in json.loads(ok(env, "ls")) if x["state"] == "paused"
        ]
        ok(env, "timeout", s[:8], "900")
        detail = json.loads(ok(env, "ls"))
        end = next(x["endAt"] for x in detail if x["sandboxID"] == s)
        assert end > time.strftime("%Y-%m-%dT%H:%M", time.gmtime(time.time() + 800))
        assert ok(env, "exec", s[:6], "--", "echo", "via prefix") == "via prefix\n"
    finally:
        r = aenv(env, "rm", s[:10])
    assert r.returncode == 0 and r.stdout.decode().strip() == s
    assert s not in listed(env)


def test_start_sizes_the_sandbox(env: dict[str, str]) -> None:
    sid = ok(env, "start", TEMPLATE, "-d", "--cpu", "1", "--memory", "300").strip()
    try:
        detail = next(x for x in json.loads(ok(env, "ls")) if x["sandboxID"] == sid)
        assert (detail["cpuCount"], detail["memoryMB"]) == (1, 300)
    finally:
        ok(env, "rm", sid)
    before = set(listed(env))
    r = aenv(env, "start", TEMPLATE, "-d", "--cpu", "4096")
    line = one_line_error(r, 64)
    assert "cpuCount must be between 1 and" in line
    assert set(listed(env)) == before


def test_pause_and_resume(env: dict[str, str], sid: str) -> None:
    ok(env, "pause", sid)
    state = next(x["state"] for x in json.loads(ok(env, "ls")) if x["sandboxID"] == sid)
    assert state == "paused"
    line = one_line_error(aenv(env, "pause", sid), 1)
    assert "paused" in line
    ok(env, "resume", sid)
    assert ok(env, "exec", sid, "--", "echo", "back") == "back\n"


def test_fork(env: dict[str, str], sid: str) -> None:
    out = ok(env, "fork", sid, "--count", "2")
    children = [x for x in listed(env) if x in out and x != sid]
    try:
        assert len(children) == 2, out
        for c in children:
            assert ok(env, "exec", c, "--", "echo", "child") == "child\n"
    finally:
        for c in children:
            aenv(env, "rm", c)


def test_snapshots(env: dict[str, str], sid: str) -> None:
    created = json.loads(ok(env, "snapshot", "create", sid, "--name", "cli-snap"))
    snap = created["snapshotID"]
    assert created["names"] == ["cli-snap"]
    assert snap in ok(env, "snapshot", "list", "--output", "json")
    started = ok(env, "start", "cli-snap", "-d").strip()
    try:
        assert ok(env, "exec", started, "--", "echo", "from-snapshot") == "from-snapshot\n"
    finally:
        ok(env, "rm", started)
    ok(env, "snapshot", "delete", snap)
    assert snap not in ok(env, "snapshot", "list", "--output", "json")
    one_line_error(aenv(env, "snapshot", "delete", snap), 66)


def test_pull_makes_a_template_to_start_from(env: dict[str, str], registry: LocalRegistry) -> None:
    img = push_busybox(registry, "cli-pull", "1", config={"Env": ["FROM=cli"]})
    r = aenv(env, "pull", img.ref, "--name", "cli-busybox", "--memory", "256")
    assert r.returncode == 0, r.stderr.decode()
    assert "cli-busybox" in r.stdout.decode()
    assert f"pulled {img.ref}: 1 layers" in r.stderr.decode()  # progress goes to stderr
    started = ok(env, "start", "cli-busybox", "--detach").strip()
    try:
        assert ok(env, "exec", started, "--", "sh", "-c", "echo $FROM") == "cli\n"
    finally:
        ok(env, "rm", started)
    ok(env, "template", "rm", "cli-busybox")
    # -d: the node pulls in the background; the template appears when it is done
    other = push_busybox(registry, "cli-pull", "2", config={"Env": ["FROM=detached"]})
    r = aenv(env, "pull", other.ref, "--name", "cli-detached", "-d")
    assert r.returncode == 0 and "pulling" in r.stderr.decode(), r.stderr.decode()
    deadline = time.monotonic() + 60
    while "cli-detached" not in ok(env, "template", "ls", "--output", "json"):
        assert time.monotonic() < deadline, "the detached pull never made its template"
        time.sleep(0.3)
    ok(env, "template", "rm", "cli-detached")
    line = one_line_error(aenv(env, "pull", f"{registry.host}/no-such-image:1", "--name", "x"), 66)
    assert "no-such-image" in line
    line = one_line_error(aenv(env, "pull", "Not//A Reference", "--name", "y"), EXIT_USAGE)
    assert "reference" in line.lower()


def test_template_delete_unknown(env: dict[str, str]) -> None:
    line = one_line_error(aenv(env, "template", "rm", "no-such-template"), EXIT_NOT_FOUND)
    assert "no-such-template" in line


# -- exec --------------------------------------------------------------------------------


def test_exec_streams_exit_codes_and_stdin(env: dict[str, str], sid: str) -> None:
    r = aenv(env, "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (r.returncode, r.stdout, r.stderr) == (7, b"out\n", b"err\n")
    r = aenv(env, "exec", sid, "--", "sh", "-c", "kill -9 $$")
    assert r.returncode == 128 + 9
    r = aenv(env, "exec", sid, "--", "sha256sum", input=b"x" * 3_000_000)
    assert r.returncode == 0
    assert r.stdout.split()[0].decode() == hashlib.sha256(b"x" * 3_000_000).hexdigest()
    r = aenv(env, "exec", sid, "--cwd", "/tmp", "--env", "A=b", "--", "sh", "-c", 'echo "$A:$PWD"')
    assert r.stdout == b"b:/tmp\n"
    r = aenv(env, "exec", sid, "--", "id", "-un")
    assert r.stdout == b"user\n"
    line = one_line_error(aenv(env, "exec", sid, "--", "/no/such/binary"), 127)
    assert "/no/such/binary" in line


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


class RssSampler:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.samples.append(_rss_kb(self.pid))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_exec_200mb_keeps_node_memory_flat(
    env: dict[str, str], sid: str, node: NodeProc, capsys: pytest.CaptureFixture[str]
) -> None:
    # warm up the code paths so the baseline includes them
    assert aenv(env, "exec", sid, "--", "sh", "-c", "yes | head -c 1000000").returncode == 0
    base = _rss_kb(node.proc.pid)
    with RssSampler(node.proc.pid) as counted:
        r = aenv(env, "exec", sid, "--", "sh", "-c", "yes | head -c 200000000 | wc -c")
    assert r.returncode == 0 and r.stdout.strip() == b"200000000"

    # 200 MB through envd, the node and the WebSocket, read by a slow consumer
    # that stalls for 5 s: the node must not buffer what the reader did not take.
    proc = subprocess.Popen(
        [*AENV, "exec", sid, "--", "sh", "-c", "yes | head -c 200000000"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    total = 0
    t0 = time.monotonic()
    with RssSampler(node.proc.pid) as streamed:
        total += len(proc.stdout.read(1 << 20))
        time.sleep(5)
        while chunk := proc.stdout.read1(1 << 20):
            total += len(chunk)
    elapsed = time.monotonic() - t0
    assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else b""
    assert total == 200_000_000
    peak = max(counted.samples + streamed.samples)
    with capsys.disabled():
        print(
            f"\nnode RSS: baseline {base / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB "
            f"({len(counted.samples) + len(streamed.samples)} samples); "
            f"200 MB streamed in {elapsed:.1f} s including a 5 s stall"
        )
    assert peak - base < 24 * 1024, (base, peak)


# -- interactive shell ----------------------------------------------------------------


def _spawn(env: dict[str, str], script: str) -> pexpect.spawn:
    child = pexpect.spawn(
        "/bin/sh",
        ["-c", script],
        env=env,
        dimensions=(24, 80),
        timeout=30,
        encoding="utf-8",
        codec_errors="replace",
    )
    return child


PROMPT = r"[$#] "


def test_connect_shell_resize_ctrl_c_exit_code(env: dict[str, str], sid: str) -> None:
    aenv_cmd = " ".join([*AENV, "cn", sid[:7]])
    child = _spawn(env, f'stty -g; {aenv_cmd}; echo "rc=$?"; stty -g')
    seen = io.StringIO()
    child.logfile_read = seen
    child.expect(r"([0-9a-f:]{20,})\r\n")
    before = child.match.group(1)
    child.expect(PROMPT)
    child.sendline("echo $((6*7))")
    child.expect(r"[^0-9]42\r\n")
    child.sendline("stty size")
    child.expect(r"[^0-9]24 80\r\n")
    child.setwinsize(31, 101)
    time.sleep(0.5)
    child.sendline("stty size")
    child.expect(r"[^0-9]31 101\r\n")
    child.sendline("sleep 100; echo not-interrupted")
    time.sleep(1)
    t0 = time.monotonic()
    child.sendcontrol("c")
    child.expect(PROMPT)
    assert time.monotonic() - t0 < 10
    child.sendline("echo status=$?")
    child.expect(r"status=130")
    child.sendline("exit 3")
    child.expect(r"rc=3\r\n")
    child.expect(r"([0-9a-f:]{20,})\r\n")
    assert child.match.group(1) == before  # terminal attributes restored
    child.expect(pexpect.EOF)
    assert "\r\nnot-interrupted" not in seen.getvalue()


def test_start_attached_kills_sandbox_on_exit(env: dict[str, str]) -> None:
    before = set(listed(env))
    child = _spawn(env, " ".join([*AENV, "start", TEMPLATE]) + '; echo "rc=$?"')
    child.expect(PROMPT, timeout=60)
    child.sendline("exit 5")
    child.expect(r"rc=5\r\n")
    child.expect(pexpect.EOF)
    assert set(listed(env)) == before


def test_detach_leaves_sandbox_running(env: dict[str, str]) -> None:
    before = set(listed(env))
    child = _spawn(env, " ".join([*AENV, "start", TEMPLATE]) + '; echo "rc=$?"')
    child.expect(r"Sandbox ([a-z0-9]{20}) started", timeout=60)
    new = child.match.group(1)
    try:
        child.expect(PROMPT, timeout=60)
        child.send("\x1d")  # Ctrl-]
        child.send("d")
        child.expect(r"Detached from ([a-z0-9]{20})")
        child.expect(r"rc=0\r\n")
        assert new in set(listed(env)) - before
        assert ok(env, "exec", new, "--", "echo", "still here") == "still here\n"
    finally:
        aenv(env, "rm", new)


# -- files -------------------------------------------------------------------------------


def test_upload_download_roundtrip(env: dict[str, str], sid: str, tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    out = ok(env, "upload", sid, str(src), "/home/user/dir/blob.bin")
    assert out.strip() == "/home/user/dir/blob.bin"
    r = aenv(env, "exec", sid, "--", "sha256sum", "/home/user/dir/blob.bin")
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    dest = tmp_path / "back.bin"
    ok(env, "download", sid, "/home/user/dir/blob.bin", str(dest))
    assert dest.read_bytes() == data
    piped = aenv(env, "download", sid, "/home/user/dir/blob.bin", "-")
    assert piped.returncode == 0 and piped.stdout == data
    ok(env, "upload", sid, "-", "/tmp/from-stdin.txt", input=b"piped in\n")
    assert ok(env, "exec", sid, "--", "cat", "/tmp/from-stdin.txt") == "piped in\n"
    line = one_line_error(aenv(env, "download", sid, "/no/such/file", str(dest)), EXIT_NOT_FOUND)
    assert "/no/such/file" in line
    assert dest.read_bytes() == data  # a failed download leaves the old file alone
    one_line_error(aenv(env, "upload", sid, str(tmp_path / "missing"), "/tmp/x"), EXIT_NOT_FOUND)


# -- credentials and bad input ----------------------------------------------------------


def test_auth_writes_private_credentials(
    env: dict[str, str], node: NodeProc, tmp_path: Path
) -> None:
    bare = {k: v for k, v in env.items() if k not in ("AENV_URL", "AENV_API_KEY")}
    one_line_error(aenv(bare, "ls"), 78)
    r = aenv(bare, "auth", "--url", node.url, "--api-key", "wrong")
    one_line_error(r, EXIT_AUTH)
    path = tmp_path / "config" / "aenv" / "credentials"
    assert not path.exists()
    r = aenv(bare, "auth", "--url", node.url, "--api-key", node.api_key)
    assert r.returncode == 0, r.stderr
    assert path.stat().st_mode & 0o777 == 0o600
    assert json.loads(path.read_text()) == {"url": node.url, "api_key": node.api_key}
    assert isinstance(json.loads(ok(bare, "ls")), list)
    # the environment and the flags override the file
    one_line_error(aenv({**bare, "AENV_API_KEY": "nope"}, "ls"), EXIT_AUTH)
    assert isinstance(
        json.loads(ok({**bare, "AENV_API_KEY": "nope"}, "ls", "--api-key", node.api_key)), list
    )


def test_bad_input_gives_one_line_and_distinct_codes(env: dict[str, str], sid: str) -> None:
    unknown = "0" * 20
    assert "not found" in one_line_error(aenv(env, "exec", unknown, "--", "true"), EXIT_NOT_FOUND)
    one_line_error(aenv(env, "rm", unknown), EXIT_NOT_FOUND)
    one_line_error(aenv(env, "cn", "zzzz"), EXIT_NOT_FOUND)
    bad_key = {**env, "AENV_API_KEY": "wrong"}
    one_line_error(aenv(bad_key, "ls"), EXIT_AUTH)
    one_line_error(aenv(bad_key, "exec", sid, "--", "true"), EXIT_AUTH)
    down = {**env, "AENV_URL": f"http://127.0.0.1:{free_port()}"}
    one_line_error(aenv(down, "ls"), EXIT_UNREACHABLE)
    one_line_error(aenv(down, "exec", sid, "--", "true"), EXIT_UNREACHABLE)
    for args in (
        ["ls", "--output", "xml"],
        ["timeout", sid, "soon"],
        ["exec", sid],
        ["start"],
        ["nonsense"],
        ["ls", "--state", "sleeping"],
        ["start", TEMPLATE, "-d", "--metadata", "novalue"],
    ):
        one_line_error(aenv(env, *args), EXIT_USAGE)


def test_completion_offers_live_sandbox_ids(env: dict[str, str], sid: str) -> None:
    for shell in ("bash", "zsh", "fish"):
        script = ok(env, "completion", shell)
        assert "__complete" in script
    out = ok(env, "__complete", "exec", sid[:5])
    assert sid in out
    with contextlib.suppress(Exception):
        assert "cn" in ok(env, "__complete", "c")


def test_sigterm_while_attached_restores_terminal(env: dict[str, str], sid: str) -> None:
    child = pexpect.spawn(AENV[0], [*AENV[1:], "cn", sid], env=env, timeout=30, encoding="utf-8")
    child.expect(PROMPT)
    lflag = termios.tcgetattr(child.child_fd)[3]
    assert not lflag & (termios.ICANON | termios.ECHO)  # raw while attached
    child.kill(signal.SIGTERM)
    child.expect(pexpect.EOF)
    lflag = termios.tcgetattr(child.child_fd)[3]
    assert lflag & termios.ICANON and lflag & termios.ECHO
    child.close()
    assert child.exitstatus == 128 + signal.SIGTERM
    assert ok(env, "exec", sid, "--", "echo", "alive") == "alive\n"
