"""envd's resident spawner (`aenv.envd.spawner`), forked off the test process.

What a process started through it must get, as one envd starts itself:
its argv, env and cwd, pipes for stdin/stdout/stderr, its own process group,
the process limit hard and soft, its exit status, and the spawn's errors;
and what envd relies on when the spawner cannot serve: `Unavailable`. (In a
sandbox, tests/e2e/test_sdk.py and test_sandbox_pressure.py run every
command through it.)
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

import aenv
from aenv.envd.process import ProcessService
from aenv.envd.spawner import (
    Lost,
    MissingCwd,
    SpawnedProcess,
    SpawnerClient,
    Unavailable,
    fork_spawner,
)
from aenv.envd.state import EnvdState
from aenv.envd.users import UserDB

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LIMIT = 4096


@pytest.fixture
async def spawner() -> AsyncIterator[SpawnerClient]:
    client = SpawnerClient(*fork_spawner(LIMIT))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        try:
            yield client
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(client.pid, signal.SIGKILL)
            await trio.to_thread.run_sync(os.waitpid, client.pid, 0)
            nursery.cancel_scope.cancel()


async def start(
    client: SpawnerClient,
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str = "/",
    uid: int | None = None,
    gid: int | None = None,
    groups: list[int] | None = None,
    limit: int = LIMIT,
    stdin: bool = False,
    fallback: str | None = None,
) -> SpawnedProcess:
    """`client.spawn(argv)` as this test process's user (its uid, gid and
    group), on the standard PATH in /, unless told otherwise."""
    return await client.spawn(
        argv,
        env={"PATH": PATH} if env is None else env,
        cwd=cwd,
        uid=os.getuid() if uid is None else uid,
        gid=os.getgid() if gid is None else gid,
        groups=[os.getgid()] if groups is None else groups,
        limit=limit,
        stdin_enabled=stdin,
        fallback=fallback,
    )


async def spawn(
    client: SpawnerClient,
    script: str,
    *,
    env: dict[str, str] | None = None,
    cwd: str = "/",
    limit: int = LIMIT,
    stdin: bool = False,
) -> SpawnedProcess:
    """`script` run by /bin/sh, as `start` runs it."""
    return await start(
        client, ["/bin/sh", "-c", script], env=env, cwd=cwd, limit=limit, stdin=stdin
    )


async def read_all(stream: trio.abc.ReceiveStream | None) -> bytes:
    assert stream is not None
    out = b""
    while chunk := await stream.receive_some(65536):
        out += chunk
    return out


async def test_output_input_and_exit_status(spawner: SpawnerClient) -> None:
    proc = await spawn(spawner, "echo out; echo err >&2; read x; echo got $x; exit 3", stdin=True)
    assert proc.stdin is not None
    await proc.stdin.send_all(b"hi\n")
    await proc.stdin.aclose()
    assert await read_all(proc.stdout) == b"out\ngot hi\n"
    assert await read_all(proc.stderr) == b"err\n"
    assert await proc.wait() == 3


async def test_env_cwd_group_and_no_stdin(spawner: SpawnerClient) -> None:
    proc = await spawn(
        spawner,
        'pwd; echo "$FOO"; ps -o pgid= -p $$ 2>/dev/null || cut -d" " -f5 /proc/$$/stat; cat',
        env={"PATH": PATH, "FOO": "bar"},
        cwd="/tmp",
    )
    assert proc.stdin is None
    lines = (await read_all(proc.stdout)).decode().split()
    assert lines == ["/tmp", "bar", str(proc.pid)]  # its own group; stdin is /dev/null
    assert await proc.wait() == 0


async def test_children_inherit_the_limit_hard_and_soft(spawner: SpawnerClient) -> None:
    proc = await spawn(spawner, "grep '^Max processes' /proc/self/limits", limit=LIMIT)
    assert (await read_all(proc.stdout)).split()[2:4] == [str(LIMIT).encode()] * 2
    await proc.wait()
    # a lower limit (set by /init) is taken on for good ...
    proc = await spawn(spawner, "grep '^Max processes' /proc/self/limits", limit=100)
    assert (await read_all(proc.stdout)).split()[2:4] == [b"100"] * 2
    await proc.wait()
    # ... a higher one it could not raise back to: envd spawns those itself
    with pytest.raises(Unavailable):
        await spawn(spawner, "true", limit=LIMIT)


async def test_spawn_errors_are_the_spawns(spawner: SpawnerClient) -> None:
    with pytest.raises(OSError) as caught:
        await start(spawner, ["/nonexistent/binary"], env={}, groups=[])
    assert caught.value.errno == errno.ENOENT
    proc = await spawn(spawner, "exit 0")  # still serving
    assert await proc.wait() == 0


async def test_signals_reach_the_process(spawner: SpawnerClient) -> None:
    proc = await spawn(spawner, "sleep 30")
    os.killpg(proc.pid, signal.SIGTERM)
    with trio.fail_after(10):
        assert await proc.wait() == -signal.SIGTERM


async def test_a_gone_spawner_is_unavailable_and_its_children_still_end(
    spawner: SpawnerClient,
) -> None:
    proc = await spawn(spawner, "sleep 0.5")
    os.kill(spawner.pid, signal.SIGKILL)
    with trio.fail_after(10):
        await proc.wait()  # (its exit status went with the spawner, off pid 1)
        await spawner.gone.wait()
    with pytest.raises(Unavailable):
        await spawn(spawner, "true")


async def test_a_higher_limit_gets_a_spawner_of_its_own(spawner: SpawnerClient) -> None:
    # a memory image of a smaller sandbox restored as a larger one: /init
    # raises the limit, which the spawner cannot follow; envd forks another
    user = UserDB().lookup("root" if os.getuid() == 0 else str(os.getuid()))
    async with trio.open_nursery() as nursery:
        service = ProcessService(nursery, EnvdState(), UserDB(), lambda ctx: user, spawner=spawner)
        script = ["/bin/sh", "-c", "grep '^Max processes' /proc/self/limits"]
        env = {"PATH": PATH}
        groups = [os.getgid()]
        limits = []
        for limit in (100, 200):
            proc = await service._via_spawner(script, env, "/", user, groups, limit, False)
            assert proc is not None
            limits.append((await read_all(proc.stdout)).split()[2:4])
            await proc.wait()
        assert limits == [[b"100"] * 2, [b"200"] * 2]
        fresh = service.spawner_pids()
        assert fresh and fresh != [spawner.pid]
        with trio.fail_after(10):
            await spawner.gone.wait()  # the old one, retired with no child left, went
        os.kill(fresh[0], signal.SIGKILL)
        await trio.to_thread.run_sync(os.waitpid, fresh[0], 0)
        nursery.cancel_scope.cancel()


async def test_a_user_gets_its_own_credentials_and_path_lookup(spawner: SpawnerClient) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to change credentials")
    # ("sh", found on the request's PATH)
    proc = await start(
        spawner, ["sh", "-c", "id -u; id -g; id -G"], uid=1000, gid=1000, groups=[1000, 27]
    )
    assert (await read_all(proc.stdout)).decode().split() == ["1000", "1000", "1000", "27"]
    assert await proc.wait() == 0


async def test_a_missing_directory_is_the_spawns_error(spawner: SpawnerClient) -> None:
    with pytest.raises(MissingCwd):
        await spawn(spawner, "true", cwd="/nonexistent/dir")
    with pytest.raises(OSError) as caught:
        await start(spawner, ["no-such-command-here"], groups=[])
    assert caught.value.errno == errno.ENOENT


def test_the_spawner_imports_only_built_in_modules() -> None:
    # what it imports before the fork it holds privately in every sandbox
    code = "import sys; s = set(sys.modules); import aenv.envd.spawnd; print(*set(sys.modules) - s)"
    env = {**os.environ, "PYTHONPATH": str(Path(aenv.__file__).parent.parent)}
    out = subprocess.run(
        [sys.executable, "-S", "-P", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert "aenv.envd.spawnd" in out
    heavy = {"json", "subprocess", "socket", "typing", "re", "enum", "signal", "threading"}
    assert not heavy & set(out), heavy & set(out)


OTHER = 54321  # a uid and gid no account holds


def status_of(text: str) -> dict[str, str]:
    return {k: v.split() for k, _, v in (line.partition(":") for line in text.splitlines())}  # type: ignore[misc]


@pytest.mark.skipif(os.getuid() != 0, reason="switching to another user needs root")
async def test_another_users_process_has_only_that_users_credentials(
    spawner: SpawnerClient, tmp_path: Path
) -> None:
    # (started with the spawner's own credentials switched for the spawn:
    # nothing of root's may be left in the child, and the spawner is root after)
    for _ in range(2):
        proc = await start(
            spawner,
            ["/bin/cat", "/proc/self/status"],
            uid=OTHER,
            gid=OTHER,
            groups=[OTHER, OTHER + 1],
        )
        status = status_of((await read_all(proc.stdout)).decode())
        assert await proc.wait() == 0
        assert status["Uid"] == [str(OTHER)] * 4  # real, effective, saved, fs
        assert status["Gid"] == [str(OTHER)] * 4
        assert sorted(status["Groups"]) == sorted([str(OTHER), str(OTHER + 1)])
        assert int(status["CapEff"][0], 16) == 0
        assert int(status["CapPrm"][0], 16) == 0
        assert int(status.get("CapAmb", ["0"])[0], 16) == 0
        with open(f"/proc/{spawner.pid}/status") as f:  # noqa: ASYNC230 (procfs)
            own = status_of(f.read())
        assert own["Uid"] == ["0"] * 4 and own["Gid"] == ["0"] * 4
    # a cwd the user may not enter: still started there, as before
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    proc = await start(
        spawner,
        ["/bin/sh", "-c", "id -u; pwd"],
        cwd=str(private),
        uid=OTHER,
        gid=OTHER,
        groups=[OTHER],
    )
    assert (await read_all(proc.stdout)).decode().split() == [str(OTHER), str(private)]
    assert await proc.wait() == 0


async def test_a_missing_cwd_and_the_fallback_program(spawner: SpawnerClient) -> None:
    with pytest.raises(MissingCwd):
        await spawn(spawner, "true", cwd="/nonexistent/dir")
    proc = await start(spawner, ["/nonexistent/bash", "-c", "echo $0"], fallback="/bin/sh")
    assert (await read_all(proc.stdout)).strip() == b"/bin/sh"
    assert await proc.wait() == 0


async def test_the_spawner_outlives_a_users_signals(spawner: SpawnerClient) -> None:
    # (while it holds a user's credentials, that user may signal it)
    assert await (await spawn(spawner, "true")).wait() == 0  # (serving: its handlers are set)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGTSTP):
        os.kill(spawner.pid, sig)
    os.kill(spawner.pid, signal.SIGSTOP)  # envd sends SIGCONT when it does not answer
    with trio.fail_after(10):
        proc = await spawn(spawner, "trap - TERM; kill -TERM $$; sleep 5")
        assert await proc.wait() == -signal.SIGTERM  # its children: default dispositions
    assert spawner.alive


async def test_a_killed_spawner_is_replaced(spawner: SpawnerClient) -> None:
    user = UserDB().lookup("root" if os.getuid() == 0 else str(os.getuid()))
    async with trio.open_nursery() as nursery:
        service = ProcessService(nursery, EnvdState(), UserDB(), lambda ctx: user, spawner=spawner)
        os.kill(spawner.pid, signal.SIGKILL)
        with trio.fail_after(10):
            await spawner.gone.wait()
        script = ["/bin/sh", "-c", "echo hi"]
        proc = await service._via_spawner(
            script, {"PATH": PATH}, "/", user, [os.getgid()], LIMIT, False
        )
        assert proc is not None
        assert await read_all(proc.stdout) == b"hi\n"
        await proc.wait()
        fresh = service.spawner_pids()
        assert fresh and fresh != [spawner.pid]
        os.kill(fresh[0], signal.SIGKILL)
        await trio.to_thread.run_sync(os.waitpid, fresh[0], 0)
        nursery.cancel_scope.cancel()


async def test_a_spawner_lost_before_it_answers_is_never_asked_again(
    spawner: SpawnerClient,
) -> None:
    # (the process may have started: starting it once more could run it twice)
    assert await (await spawn(spawner, "true")).wait() == 0
    os.kill(spawner.pid, signal.SIGSTOP)  # holds the request unanswered ...
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_kill_soon, spawner.pid)
        with pytest.raises(Lost), trio.fail_after(10):
            await spawn(spawner, "true")  # ... until it is killed


async def _kill_soon(pid: int) -> None:
    await trio.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
