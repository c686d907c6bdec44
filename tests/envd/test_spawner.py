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
from aenv.envd.spawner import SpawnedProcess, SpawnerClient, Unavailable, fork_spawner
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


async def spawn(
    client: SpawnerClient, script: str, *, limit: int = LIMIT, stdin: bool = False, **kw: object
) -> SpawnedProcess:
    return await client.spawn(
        ["/bin/sh", "-c", script],
        env=kw.get("env", {"PATH": PATH}),  # type: ignore[arg-type]
        cwd=kw.get("cwd", "/"),  # type: ignore[arg-type]
        uid=os.getuid(),
        gid=os.getgid(),
        groups=[os.getgid()],
        limit=limit,
        stdin_enabled=stdin,
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
        await spawner.spawn(
            ["/nonexistent/binary"],
            env={},
            cwd="/",
            uid=os.getuid(),
            gid=os.getgid(),
            groups=[],
            limit=LIMIT,
            stdin_enabled=False,
        )
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
    proc = await spawner.spawn(
        ["sh", "-c", "id -u; id -g; id -G"],  # found on the request's PATH
        env={"PATH": PATH},
        cwd="/",
        uid=1000,
        gid=1000,
        groups=[1000, 27],
        limit=LIMIT,
        stdin_enabled=False,
    )
    assert (await read_all(proc.stdout)).decode().split() == ["1000", "1000", "1000", "27"]
    assert await proc.wait() == 0


async def test_a_missing_directory_is_the_spawns_error(spawner: SpawnerClient) -> None:
    with pytest.raises(OSError) as caught:
        await spawn(spawner, "true", cwd="/nonexistent/dir")
    assert caught.value.errno == errno.ENOENT
    with pytest.raises(OSError) as caught:
        await spawner.spawn(
            ["no-such-command-here"],
            env={"PATH": PATH},
            cwd="/",
            uid=os.getuid(),
            gid=os.getgid(),
            groups=[],
            limit=LIMIT,
            stdin_enabled=False,
        )
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
