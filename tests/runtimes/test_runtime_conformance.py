"""One behavioural suite for every `Runtime`: the scripted fake and runsc.

The in-process node tests (tests/node/) run on `tests.fakes.runtime.FakeRuntime`;
this suite checks that what they rely on is what runsc does. Each check runs
against the fake (default suite, on trio's MockClock) and against
`GVisorRuntime` (marked runsc: root, runsc, a busybox-only root layer and the
bundle's Python as the guest, traffic only over the test's own veth pair,
10.214.N.0/30, one netns per sandbox). Observations go through a small driver: the guest answers
(HTTP on :8080 for runsc, the fake's state), the guest exits by itself, and
what the runtime left behind. Checks only the fake can afford (runsc hangs
until its timeout on them) are at the end, named as such.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest
import trio
import trio.testing

from aenv.runtimes.base import CheckpointError, RunningSandbox, Runtime, SandboxGone, SandboxSpec
from aenv.storage.bundle import envd_command, python_command
from tests.fakes.runtime import FakeRuntime, FakeSandbox, Guest
from tests.runtimes.nets import Net

CGROUP_PARENT = "aenvconf"

SERVE = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""


class Driver(Protocol):
    runtime: Runtime

    def root(self, name: str) -> Any:
        """An async context manager yielding a root filesystem for one sandbox."""
        ...

    def spec(self, name: str, rootfs: Path, *, exits_with: int | None = None) -> SandboxSpec: ...

    async def answers(self, sandbox: RunningSandbox) -> bool:
        """Whether the guest runs (answers within a short while)."""
        ...

    async def guest_exits(self, sandbox: RunningSandbox, status: int) -> None:
        """Let a guest started with `exits_with=status` exit."""
        ...

    def leftovers(self) -> list[str]: ...


@dataclass
class FakeDriver:
    tmp_path: Path
    runtime: FakeRuntime

    @asynccontextmanager
    async def root(self, name: str) -> AsyncIterator[Path]:
        path = self.tmp_path / name
        path.mkdir()
        yield path

    def spec(self, name: str, rootfs: Path, *, exits_with: int | None = None) -> SandboxSpec:
        return _spec(self.tmp_path, name, rootfs, Path("/run/netns/fake"), ("/init",), {})

    async def answers(self, sandbox: RunningSandbox) -> bool:
        assert isinstance(sandbox, FakeSandbox)
        await trio.lowlevel.checkpoint()
        return sandbox.state is Guest.RUNNING

    async def guest_exits(self, sandbox: RunningSandbox, status: int) -> None:
        assert isinstance(sandbox, FakeSandbox)
        await trio.sleep(1)
        sandbox.guest_exit(status)

    def leftovers(self) -> list[str]:
        found = [f"sandbox {i}" for i in self.runtime.sandboxes]
        found += [str(p) for p in self.tmp_path.glob("driver-*/config.json")]
        return found


@dataclass
class GVisorDriver:
    tmp_path: Path
    runtime: Any
    bundle: Path
    lower: Path
    make_netns: Callable[[], Net]
    # each sandbox its own netns: runsc takes its interfaces' addresses over
    nets: dict[str, Net] = field(default_factory=dict)

    def root(self, name: str) -> Any:
        from aenv.storage.overlay import open_writable_root

        return open_writable_root([self.lower], self.tmp_path / name)

    def spec(self, name: str, rootfs: Path, *, exits_with: int | None = None) -> SandboxSpec:
        env = envd_command()[1]
        code = (
            SERVE
            if exits_with is None
            else f"import sys, time; time.sleep(1); sys.exit({exits_with})"
        )
        init = (*python_command()[0], "-c", textwrap.dedent(code))
        net = self.nets.setdefault(name, self.make_netns())
        spec = _spec(self.tmp_path, name, rootfs, net.path, init, env, bundle=self.bundle)
        self.nets[spec.sandbox_id] = net
        return spec

    async def answers(self, sandbox: RunningSandbox) -> bool:
        address = self.nets[sandbox.sandbox_id].guest_ip
        with trio.move_on_after(3):
            while True:
                try:
                    stream = await trio.open_tcp_stream(address, 8080)
                except OSError:
                    await trio.sleep(0.05)
                    continue
                async with stream:
                    await stream.send_all(b"GET / HTTP/1.0\r\n\r\n")
                    reply = b""
                    while chunk := await stream.receive_some():
                        reply += chunk
                    return reply.startswith(b"HTTP/1.0 200")
        return False

    async def guest_exits(self, sandbox: RunningSandbox, status: int) -> None:
        pass  # the guest's code exits by itself

    def leftovers(self) -> list[str]:
        rt = self.runtime
        found: list[str] = []
        ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True)
        found += [line for line in ps.stdout.splitlines() if str(rt.state_root) in line]
        if rt.state_root.exists():
            found += [f"state {p.name}" for p in rt.state_root.iterdir()]
        mounts = Path("/proc/mounts").read_text().splitlines()
        found += [f"mount {m}" for m in mounts if str(self.tmp_path) in m]
        return found


def _spec(
    tmp_path: Path,
    name: str,
    rootfs: Path,
    netns: Path,
    init: tuple[str, ...],
    env: dict[str, str],
    *,
    bundle: Path | None = None,
) -> SandboxSpec:
    return SandboxSpec(
        sandbox_id=f"c{name}{secrets.token_hex(3)}",
        rootfs=rootfs,
        bundle=bundle or tmp_path / "bundle",
        netns_path=netns,
        cpu_count=1,
        memory_mb=256,
        hostname=name,
        workdir=tmp_path / f"driver-{name}",
        log_path=tmp_path / f"console-{name}.log",
        init_argv=init,
        init_env=env,
    )


@pytest.fixture(params=["fake", pytest.param("gvisor", marks=pytest.mark.runsc)])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock(kind: str) -> trio.testing.MockClock | None:
    """The fake runs on trio's MockClock; runsc on the real one."""
    return trio.testing.MockClock(autojump_threshold=0) if kind == "fake" else None


@pytest.fixture
def driver(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Driver]:
    if kind == "fake":
        yield FakeDriver(tmp_path, FakeRuntime())
        return
    if os.geteuid() != 0 or shutil.which("runsc") is None:
        pytest.skip("needs root and runsc")
    from aenv.runtimes.gvisor import GVisorRuntime

    rt = GVisorRuntime(state_root=tmp_path / "runsc-state", cgroup_parent=CGROUP_PARENT)
    yield GVisorDriver(
        tmp_path,
        rt,
        request.getfixturevalue("bundle"),
        request.getfixturevalue("busybox_lower"),
        request.getfixturevalue("make_netns"),
    )


async def test_a_sandbox_runs_until_its_block_is_left_and_leaves_nothing(
    driver: Driver, clock: Any
) -> None:
    async with driver.root("a") as root:
        spec = driver.spec("a", root)
        async with driver.runtime.open_sandbox(spec) as sandbox:
            assert sandbox.sandbox_id == spec.sandbox_id
            assert await driver.answers(sandbox)
            usage = await sandbox.usage()
            assert usage.mem_total_bytes == 256 << 20
            assert 0 < usage.mem_used_bytes <= usage.mem_total_bytes
    assert driver.leftovers() == []


async def test_wait_returns_the_status_the_guest_exits_with(driver: Driver, clock: Any) -> None:
    async with driver.root("x") as root:
        spec = driver.spec("x", root, exits_with=3)
        async with driver.runtime.open_sandbox(spec) as sandbox, trio.open_nursery() as n:
            n.start_soon(driver.guest_exits, sandbox, 3)
            with trio.fail_after(30):
                status = await sandbox.wait()
    # runsc reports the container's status when it can still read it, else -1
    assert status in (3, -1)
    assert driver.leftovers() == []


async def test_a_checkpoint_that_stops_the_sandbox_restores_elsewhere(
    driver: Driver, clock: Any, tmp_path: Path
) -> None:
    image = tmp_path / "image"
    async with (
        driver.root("src") as root,
        driver.runtime.open_sandbox(driver.spec("src", root)) as sandbox,
    ):
        assert await driver.answers(sandbox)
        await sandbox.checkpoint(image, leave_running=False)
        with trio.fail_after(5):  # it is gone when the checkpoint returns
            await sandbox.wait()
    assert any(image.iterdir())
    async with (
        driver.root("dst") as root,
        driver.runtime.open_restored(driver.spec("dst", root), image) as restored,
    ):
        assert await driver.answers(restored)
        assert (await restored.usage()).mem_used_bytes > 0
    assert driver.leftovers() == []


async def test_a_checkpoint_needs_an_empty_image_directory(
    driver: Driver, clock: Any, tmp_path: Path
) -> None:
    image = tmp_path / "image"
    image.mkdir()
    (image / "stale").write_text("left from before")
    async with (
        driver.root("a") as root,
        driver.runtime.open_sandbox(driver.spec("a", root)) as sandbox,
    ):
        with pytest.raises(CheckpointError):
            await sandbox.checkpoint(image, leave_running=True)
        assert await driver.answers(sandbox)
    assert driver.leftovers() == []


async def test_restoring_from_a_missing_or_empty_image_fails(
    driver: Driver, clock: Any, tmp_path: Path
) -> None:
    (tmp_path / "empty").mkdir()
    for image in (tmp_path / "missing", tmp_path / "empty"):
        async with driver.root(f"r{image.name}") as root:
            spec = driver.spec(f"r{image.name}", root)
            with pytest.raises(CheckpointError):
                async with driver.runtime.open_restored(spec, image):
                    pass
    assert driver.leftovers() == []


async def test_a_frozen_sandbox_is_checkpointed_frozen_and_thaws(
    driver: Driver, clock: Any, tmp_path: Path
) -> None:
    image = tmp_path / "image"
    async with (
        driver.root("f") as root,
        driver.runtime.open_sandbox(driver.spec("f", root)) as sandbox,
    ):
        assert await driver.answers(sandbox)
        await sandbox.freeze()
        await sandbox.freeze()  # idempotent
        assert not await driver.answers(sandbox)
        await sandbox.checkpoint_frozen(image)
        assert any(image.iterdir())
        assert not await driver.answers(sandbox)  # still stopped
        await sandbox.thaw()
        assert await driver.answers(sandbox)
    assert driver.leftovers() == []


async def test_a_held_sandbox_is_checkpointed_and_runs_on(
    driver: Driver, clock: Any, tmp_path: Path
) -> None:
    image = tmp_path / "image"
    async with (
        driver.root("h") as root,
        driver.runtime.open_sandbox(driver.spec("h", root)) as sandbox,
    ):
        assert await driver.answers(sandbox)
        async with sandbox.held():
            await sandbox.checkpoint(image, leave_running=True)
            # held until the block ends (gVisor's resume starts early and waits)
            assert not await driver.answers(sandbox)
        assert any(image.iterdir())
        assert await driver.answers(sandbox)
    assert driver.leftovers() == []


async def test_adopting_a_sandbox_that_is_not_there_raises_sandbox_gone(
    driver: Driver, clock: Any
) -> None:
    async with driver.root("g") as root:
        with pytest.raises(SandboxGone):
            async with driver.runtime.open_adopted(driver.spec("g", root)):
                pass
    assert driver.leftovers() == []


# -- the fake only (runsc hangs until its timeout on these) ---------------------


async def test_fake_refuses_to_checkpoint_or_hold_a_frozen_sandbox(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    driver = FakeDriver(tmp_path, FakeRuntime())
    async with (
        driver.root("z") as root,
        driver.runtime.open_sandbox(driver.spec("z", root)) as sandbox,
    ):
        await sandbox.freeze()
        with pytest.raises(CheckpointError):
            await sandbox.checkpoint(tmp_path / "image", leave_running=True)
        with pytest.raises(CheckpointError):
            async with sandbox.held():
                pass
        await sandbox.thaw()
        async with sandbox.held():
            pass


async def test_fake_start_takes_its_time_and_a_cancelled_start_leaves_nothing(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    driver = FakeDriver(tmp_path, FakeRuntime())
    t0 = trio.current_time()
    async with driver.root("s") as root:
        with trio.move_on_after(0.25):
            async with driver.runtime.open_sandbox(driver.spec("s", root)):
                raise AssertionError("started sooner than runsc does")
        assert trio.current_time() == t0 + 0.25 + driver.runtime.timings.stop_s
        driver.runtime.faults.fail_next("start")
        with pytest.raises(RuntimeError, match="injected"):
            async with driver.runtime.open_sandbox(driver.spec("s2", root)):
                pass
    assert driver.leftovers() == []
