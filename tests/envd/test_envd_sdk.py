"""The real `e2b` Python SDK against envd, through a stub of the node's REST API.

Rules: the stub answers sandbox create with envdVersion=ENVD_VERSION and the
SDK reaches envd directly through E2B_SANDBOX_URL; everything is loopback.
These are sync tests: the SDK's sync client runs its own IO.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2b import AsyncSandbox, CommandExitException, Sandbox
from e2b.exceptions import NotFoundException
from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox.filesystem.filesystem import FileType
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType
from envd_helpers import TEST_USER, Envd, Stub


@pytest.fixture
def sandbox(envd: Envd, api_stub: Stub, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sandbox]:
    monkeypatch.setenv("E2B_API_URL", api_stub.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", envd.url)
    monkeypatch.setenv("E2B_API_KEY", "e2b_test")
    monkeypatch.setenv("E2B_DOMAIN", "localhost")
    sbx = Sandbox.create(timeout=60)
    try:
        yield sbx
    finally:
        sbx.kill()


def test_run_exit_codes_and_output(sandbox: Sandbox) -> None:
    result = sandbox.commands.run("echo hello; echo oops >&2")
    assert result.exit_code == 0
    assert result.stdout == "hello\n"
    assert result.stderr == "oops\n"
    with pytest.raises(CommandExitException) as info:
        sandbox.commands.run("echo bad >&2; exit 7")
    assert info.value.exit_code == 7
    assert info.value.stderr == "bad\n"


def test_run_user_env_cwd(sandbox: Sandbox, test_user: pwd.struct_passwd, home: Path) -> None:
    result = sandbox.commands.run("id -un; pwd; echo $HOME")
    assert result.stdout.split() == [TEST_USER, test_user.pw_dir, test_user.pw_dir]
    result = sandbox.commands.run("echo $FOO-$BAR", envs={"FOO": "a", "BAR": "b"})
    assert result.stdout == "a-b\n"
    result = sandbox.commands.run("pwd", cwd=str(home))
    assert result.stdout.strip() == str(home)
    result = sandbox.commands.run("id -u", user="root")
    assert result.stdout.strip() == "0"


def test_envd_environment_does_not_leak(sandbox: Sandbox) -> None:
    out = sandbox.commands.run("env").stdout
    assert "AENV_ENVD_TEST_MARKER" not in out
    assert "PYTHONPATH" not in out
    assert "PYTHONHOME" not in out and "LD_LIBRARY_PATH" not in out
    assert "E2B_SANDBOX=true" in out


def test_on_stdout_streams(sandbox: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    start = time.monotonic()
    sandbox.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.3; done",
        on_stdout=lambda line: seen.append((time.monotonic() - start, line)),
    )
    assert "".join(s for _, s in seen) == "line1\nline2\nline3\n"
    assert seen[0][0] < seen[-1][0] - 0.4  # arrived as produced, not at the end


def test_background_list_kill(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("sleep 30", background=True)
    pids = [p.pid for p in sandbox.commands.list()]
    assert handle.pid in pids
    assert sandbox.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException):
        handle.wait()
    assert handle.pid not in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(handle.pid) is False


def test_stdin(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("head -n 2", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "one\n")
    sandbox.commands.send_stdin(handle.pid, "two\n")
    result = handle.wait()
    assert result.stdout == "one\ntwo\n"
    handle = sandbox.commands.run("wc -c", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "12345")
    sandbox.commands.close_stdin(handle.pid)
    assert handle.wait().stdout.strip() == "5"


def test_pty(sandbox: Sandbox) -> None:
    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    sandbox.pty.resize(handle.pid, PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(handle.pid, b"stty size; tty; exit 3\n")
    output = bytearray()
    with pytest.raises(CommandExitException) as info:
        handle.wait(on_pty=output.extend)
    assert info.value.exit_code == 3
    assert b"30 100" in output
    assert b"/dev/pts/" in output


def test_files_roundtrip(sandbox: Sandbox, home: Path, test_user: pwd.struct_passwd) -> None:
    info = sandbox.files.write(f"{home}/a/b.txt", "hello world")
    assert info.path == f"{home}/a/b.txt"
    assert sandbox.files.read(f"{home}/a/b.txt") == "hello world"
    st = os.stat(home / "a" / "b.txt")
    assert (st.st_uid, st.st_gid) == (test_user.pw_uid, test_user.pw_gid)
    assert os.stat(home / "a").st_uid == test_user.pw_uid
    blob = os.urandom(10 * 1024 * 1024)
    sandbox.files.write(f"{home}/blob.bin", blob)
    assert bytes(sandbox.files.read(f"{home}/blob.bin", format="bytes")) == blob
    rel = home.relative_to(test_user.pw_dir)
    assert sandbox.files.read(f"{rel}/a/b.txt") == "hello world"


def test_files_ops(sandbox: Sandbox, home: Path) -> None:
    assert sandbox.files.make_dir(f"{home}/d/e") is True
    assert sandbox.files.make_dir(f"{home}/d/e") is False
    sandbox.files.write(f"{home}/d/x.txt", "x")
    names = sorted(e.name for e in sandbox.files.list(f"{home}/d"))
    assert names == ["e", "x.txt"]
    deep = sorted(e.path for e in sandbox.files.list(str(home), depth=3))
    assert f"{home}/d/e" in deep and f"{home}/d/x.txt" in deep
    assert sandbox.files.exists(f"{home}/d/x.txt")
    assert not sandbox.files.exists(f"{home}/nope")
    info = sandbox.files.get_info(f"{home}/d/x.txt")
    assert info.type == FileType.FILE and info.size == 1 and info.owner == TEST_USER
    moved = sandbox.files.rename(f"{home}/d/x.txt", f"{home}/d/y.txt")
    assert moved.path == f"{home}/d/y.txt"
    sandbox.files.remove(f"{home}/d")
    assert not (home / "d").exists()
    with pytest.raises(NotFoundException):
        sandbox.files.read(f"{home}/missing.txt")


def test_watch_dir_polling(sandbox: Sandbox, home: Path) -> None:
    handle = sandbox.files.watch_dir(str(home), recursive=True)
    try:
        sandbox.files.make_dir(f"{home}/sub")
        time.sleep(0.2)
        sandbox.files.write(f"{home}/sub/f.txt", "data")
        events = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(e.name == "sub/f.txt" for e in events):
            events.extend(handle.get_new_events())
            time.sleep(0.05)
    finally:
        handle.stop()
    kinds = {(e.name, e.type) for e in events}
    assert ("sub", FilesystemEventType.CREATE) in kinds
    assert ("sub/f.txt", FilesystemEventType.CREATE) in kinds


def _run_async(envd: Envd, api_stub: Stub, monkeypatch: pytest.MonkeyPatch, body: Any) -> Any:
    """Run `body(sandbox)` with the SDK's asyncio AsyncSandbox (the SDK is asyncio-only)."""
    monkeypatch.setenv("E2B_API_URL", api_stub.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", envd.url)
    monkeypatch.setenv("E2B_API_KEY", "e2b_test")

    async def main() -> Any:
        sbx = await AsyncSandbox.create(timeout=60)
        try:
            return await body(sbx)
        finally:
            await sbx.kill()

    return asyncio.run(main())


def test_watch_dir_stream(
    envd: Envd, api_stub: Stub, monkeypatch: pytest.MonkeyPatch, home: Path
) -> None:
    async def body(sbx: AsyncSandbox) -> list[Any]:
        events: list[Any] = []
        handle = await sbx.files.watch_dir(
            str(home), on_event=events.append, recursive=True, include_entry=True
        )
        try:
            await sbx.files.make_dir(f"{home}/sub")
            await asyncio.sleep(0.2)
            await sbx.files.write(f"{home}/sub/f.txt", "data")
            for _ in range(100):
                if any(e.name == "sub/f.txt" for e in events):
                    break
                await asyncio.sleep(0.05)
        finally:
            await handle.stop()
        return events

    events = _run_async(envd, api_stub, monkeypatch, body)
    kinds = {(e.name, e.type) for e in events}
    assert ("sub", FilesystemEventType.CREATE) in kinds
    assert ("sub/f.txt", FilesystemEventType.CREATE) in kinds
    created = next(e for e in events if e.name == "sub/f.txt")
    assert created.entry is not None and created.entry.name == "f.txt"


def test_async_commands(envd: Envd, api_stub: Stub, monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(sbx: AsyncSandbox) -> tuple[Any, list[str]]:
        chunks: list[str] = []
        result = await sbx.commands.run("echo a; sleep 0.2; echo b", on_stdout=chunks.append)
        handle = await sbx.commands.run("sleep 20", background=True)
        await handle.kill()
        return result, chunks

    result, chunks = _run_async(envd, api_stub, monkeypatch, body)
    assert result.stdout == "a\nb\n"
    assert "".join(chunks) == "a\nb\n"
