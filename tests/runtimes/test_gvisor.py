"""The gVisor driver against real runsc: start, isolation, limits, teardown.

Rules: every sandbox's root is a host overlay whose only lower layer is a
static busybox (no libc, no Python) and whose init is the bundle's Python;
traffic goes only over the test's own veth pair (10.213.N.0/30); each test
uses its own runsc state root and sandbox ids, and checks afterwards that no
runsc process, cgroup, state file or mount of it is left. Timings are printed
(run with -s to see them).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from aenv.runtimes import gvisor
from aenv.runtimes.base import SandboxSpec
from aenv.runtimes.gvisor import CGROUP_ROOT, GVisorRuntime, oci_config
from aenv.storage.bundle import BUNDLE_MOUNT, envd_command, python_command
from aenv.storage.overlay import open_writable_root, reap_stale_mounts

pytestmark = pytest.mark.runsc

CGROUP_PARENT = "aenvtest"


def python_argv(code: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """argv/env running `code` with the bundle's Python, like envd_command does."""
    env = envd_command()[1]
    return (*python_command()[0], "-c", textwrap.dedent(code)), env


def make_spec(
    tmp_path: Path,
    *,
    rootfs: Path,
    bundle: Path,
    netns: Any,
    code: str,
    memory_mb: int = 256,
    cpu_count: int = 1,
) -> SandboxSpec:
    sandbox_id = "t" + secrets.token_hex(4)
    argv, env = python_argv(code)
    return SandboxSpec(
        sandbox_id=sandbox_id,
        rootfs=rootfs,
        bundle=bundle,
        netns_path=netns.path,
        cpu_count=cpu_count,
        memory_mb=memory_mb,
        hostname=f"sbx-{sandbox_id}",
        workdir=tmp_path / "driver",
        log_path=tmp_path / "console.log",
        init_argv=argv,
        init_env=env,
    )


def runtime(tmp_path: Path) -> GVisorRuntime:
    return GVisorRuntime(state_root=tmp_path / "runsc-state", cgroup_parent=CGROUP_PARENT)


def cgroup_dirs(sandbox_id: str) -> list[Path]:
    return [p for p in CGROUP_ROOT.glob(f"*/{CGROUP_PARENT}/{sandbox_id}") if p.exists()] + [
        p for p in [CGROUP_ROOT / CGROUP_PARENT / sandbox_id] if p.exists()
    ]


def leftovers(rt: GVisorRuntime, sandbox_id: str, *paths: Path) -> list[str]:
    found: list[str] = []
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    found += [line for line in ps.splitlines() if str(rt.state_root) in line]
    found += [f"cgroup {p}" for p in cgroup_dirs(sandbox_id)]
    if rt.state_root.exists():
        found += [f"state {p.name}" for p in rt.state_root.iterdir()]
    mounts = Path("/proc/mounts").read_text()
    found += [f"mount {m}" for m in mounts.splitlines() for p in paths if str(p) in m]
    return found


async def http_get(host: str, port: int, path: str, *, within: float) -> bytes:
    """GET over a plain TCP stream, retrying until the server answers."""
    with trio.fail_after(within):
        while True:
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError:
                await trio.sleep(0.02)
                continue
            async with stream:
                await stream.send_all(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
                chunks = []
                while chunk := await stream.receive_some():
                    chunks.append(chunk)
                return b"".join(chunks)


SERVE = """
    import http.server, os, socket, functools
    os.makedirs("/root/www", exist_ok=True)
    with open("/root/www/hello", "w") as f:
        f.write("hello from " + socket.gethostname())
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory="/root/www")
    http.server.ThreadingHTTPServer(("0.0.0.0", 8080), handler).serve_forever()
"""


async def test_sandbox_writes_to_overlay_serves_http_and_leaves_nothing(
    tmp_path: Path, bundle: Path, busybox_lower: Path, netns: Any
) -> None:
    rt = runtime(tmp_path)
    ovl = tmp_path / "overlay"
    async with open_writable_root([busybox_lower], ovl) as root:
        spec = make_spec(
            tmp_path, rootfs=root, bundle=bundle, netns=netns, code=SERVE, memory_mb=300
        )
        t0 = time.monotonic()
        async with rt.open_sandbox(spec) as sandbox:
            t_open = time.monotonic() - t0
            assert sandbox.sandbox_id == spec.sandbox_id
            body = await http_get(netns.guest_ip, 8080, "/hello", within=30)
            t_serving = time.monotonic() - t0
            assert body.startswith(b"HTTP/1.0 200")
            assert body.endswith(f"hello from sbx-{spec.sandbox_id}".encode())

            # The guest's write went through the gofer into the overlay's upper
            # directory on the host, not into gVisor memory nor the lower layer.
            upper_file = ovl / "upper" / "root" / "www" / "hello"
            assert upper_file.read_text() == f"hello from sbx-{spec.sandbox_id}"
            assert not (busybox_lower / "root" / "www").exists()

            # Limits are set on the host cgroup of the sandbox: its memory plus
            # the headroom the in-sandbox OOM killer acts in (the guest sees 300 MiB)
            limit = CGROUP_ROOT / "memory" / CGROUP_PARENT / spec.sandbox_id
            assert int((limit / "memory.limit_in_bytes").read_text()) == rt.host_memory_bytes(300)
            assert rt.host_memory_bytes(300) == (300 + 256) * 1024 * 1024
            # and its host tasks, so ptrace's threads cannot use up the host's pids
            pids = CGROUP_ROOT / "pids" / CGROUP_PARENT / spec.sandbox_id / "pids.max"
            assert int(pids.read_text()) == rt.host_tasks_limit(300)
            cpu = CGROUP_ROOT / "cpu" / CGROUP_PARENT / spec.sandbox_id
            quota = int((cpu / "cpu.cfs_quota_us").read_text())
            assert quota == int((cpu / "cpu.cfs_period_us").read_text())
            procs = (limit / "cgroup.procs").read_text().split()
            assert str(sandbox.sandbox_pid) in procs

            usage = await sandbox.usage()
            assert usage.mem_total_bytes == 300 * 1024 * 1024
            assert 0 < usage.mem_used_bytes < usage.mem_total_bytes
            assert 0.0 <= usage.cpu_used_pct <= 100.0
            t_stop = time.monotonic()
        t_teardown = time.monotonic() - t_stop
        assert leftovers(rt, spec.sandbox_id) == []
        assert not spec.workdir.exists()
        assert "Traceback" not in spec.log_path.read_text()
    assert leftovers(rt, spec.sandbox_id, ovl) == []
    assert not ovl.exists()
    print(
        f"\ngvisor: open_sandbox {t_open * 1000:.0f} ms, guest serving HTTP after "
        f"{t_serving * 1000:.0f} ms, teardown {t_teardown * 1000:.0f} ms"
    )


async def test_bundle_python_imports_envd_deps_in_libc_less_guest(
    tmp_path: Path, bundle: Path, busybox_lower: Path, netns: Any
) -> None:
    rt = runtime(tmp_path)
    code = """
        import os, sys, ssl, hashlib, json, zlib
        import trio, hypercorn, hypercorn.trio, h2, wsproto, h11, aenv.proto
        assert not os.path.exists("/lib/x86_64-linux-gnu/libc.so.6")
        print("imports ok", trio.__version__, sys.prefix, flush=True)
        sys.exit(3)
    """
    async with open_writable_root([busybox_lower], tmp_path / "overlay") as root:
        spec = make_spec(tmp_path, rootfs=root, bundle=bundle, netns=netns, code=code)
        async with rt.open_sandbox(spec) as sandbox:
            with trio.fail_after(60):
                status = await sandbox.wait()
        log = spec.log_path.read_text()
        assert "imports ok" in log, log
        assert "/opt/aenv" in log
        # runsc's sandbox exits with the container's status; it is readable
        # only while the exited process is not yet reaped by its parent.
        assert status in (3, -1)
    assert leftovers(rt, spec.sandbox_id) == []


@pytest.mark.parametrize(("memory_mb", "fits"), [(256, False), (2048, True)])
async def test_memory_limit_is_enforced(
    tmp_path: Path, bundle: Path, busybox_lower: Path, netns: Any, memory_mb: int, fits: bool
) -> None:
    rt = runtime(tmp_path)
    code = """
        import sys
        blocks = [b"x" * (16 << 20) for _ in range(64)]
        print("allocated", len(blocks) * 16, "MiB", flush=True)
    """
    async with open_writable_root([busybox_lower], tmp_path / "overlay") as root:
        spec = make_spec(
            tmp_path, rootfs=root, bundle=bundle, netns=netns, code=code, memory_mb=memory_mb
        )
        async with rt.open_sandbox(spec) as sandbox:
            with trio.fail_after(60):
                status = await sandbox.wait()
        log = spec.log_path.read_text()
        # 1 GiB fits in 2 GiB but not in 256 MiB: there the guest is killed.
        assert ("allocated 1024 MiB" in log) == fits, log
        assert status in ((0, -1) if fits else (128 + signal.SIGKILL, -1))
    assert leftovers(rt, spec.sandbox_id) == []


async def test_cancellation_tears_everything_down(
    tmp_path: Path, bundle: Path, busybox_lower: Path, netns: Any
) -> None:
    rt = runtime(tmp_path)
    ovl = tmp_path / "overlay"
    with trio.move_on_after(30) as scope:
        async with open_writable_root([busybox_lower], ovl) as root:
            spec = make_spec(tmp_path, rootfs=root, bundle=bundle, netns=netns, code=SERVE)
            async with rt.open_sandbox(spec):
                await http_get(netns.guest_ip, 8080, "/hello", within=30)
                scope.cancel()
                await trio.sleep_forever()
    assert scope.cancelled_caught
    assert leftovers(rt, spec.sandbox_id, ovl) == []
    assert not ovl.exists()


async def test_the_cgroup_parent_is_released_once_empty(
    tmp_path: Path, bundle: Path, busybox_lower: Path, netns: Any
) -> None:
    """A stopping node removes its cgroup parent, but not while a sandbox is in it."""
    parent = f"aenvrel{os.getpid()}"
    rt = GVisorRuntime(state_root=tmp_path / "runsc-state", cgroup_parent=parent)
    async with open_writable_root([busybox_lower], tmp_path / "overlay") as root:
        spec = make_spec(tmp_path, rootfs=root, bundle=bundle, netns=netns, code=SERVE)
        async with rt.open_sandbox(spec):
            await http_get(netns.guest_ip, 8080, "/hello", within=30)
            parents = [CGROUP_ROOT / parent, *CGROUP_ROOT.glob(f"*/{parent}")]
            assert any(p.exists() for p in parents)
            assert not rt.release_parent()
            await http_get(netns.guest_ip, 8080, "/hello", within=5)  # still served
    assert rt.release_parent()
    assert not [p for p in parents if p.exists()]


def test_oci_config_shape(tmp_path: Path) -> None:
    spec = SandboxSpec(
        sandbox_id="abc",
        rootfs=tmp_path / "root",
        bundle=tmp_path / "bundle",
        netns_path=Path("/var/run/netns/x"),
        cpu_count=2,
        memory_mb=512,
        hostname="h",
        workdir=tmp_path,
        log_path=tmp_path / "log",
        init_argv=("/init", "a"),
        init_env={"A": "1"},
    )
    cfg = oci_config(spec, cgroups_path="/aenv/abc")
    assert cfg["root"] == {"path": str(tmp_path / "root"), "readonly": False}
    assert cfg["process"]["args"] == ["/init", "a"]
    assert "A=1" in cfg["process"]["env"]
    assert cfg["process"]["user"] == {"uid": 0, "gid": 0}
    assert gvisor.BUNDLE_MOUNT == BUNDLE_MOUNT
    bundle_mount = next(m for m in cfg["mounts"] if m["destination"] == BUNDLE_MOUNT)
    assert bundle_mount["source"] == str(tmp_path / "bundle")
    assert "ro" in bundle_mount["options"]
    # two CPUs' quota, and shares in proportion (1024 a CPU) against busy neighbours
    assert cfg["linux"]["resources"]["cpu"] == {"quota": 200_000, "period": 100_000, "shares": 2048}
    assert cfg["linux"]["resources"]["memory"] == {"limit": 512 << 20}
    assert {"type": "network", "path": "/var/run/netns/x"} in cfg["linux"]["namespaces"]


CRASHING_NODE = """
import sys, trio
from pathlib import Path
from aenv.runtimes import gvisor
from aenv.runtimes.base import SandboxSpec
from aenv.runtimes.gvisor import GVisorRuntime
from aenv.storage.overlay import open_writable_root

async def main(args):
    tmp, lower, bundle, netns, sid, code = args
    tmp = Path(tmp)
    rt = GVisorRuntime(state_root=tmp / "runsc-state", cgroup_parent="aenvtest")
    async with open_writable_root([Path(lower)], tmp / "overlay") as root:
        spec = SandboxSpec(sandbox_id=sid, rootfs=root, bundle=Path(bundle),
            netns_path=Path(netns), cpu_count=1, memory_mb=128, hostname="h",
            workdir=tmp / "driver", log_path=tmp / "console.log",
            init_argv=tuple(sys.argv[7:]), init_env={"PYTHONHOME": "/opt/aenv"})
        async with rt.open_sandbox(spec):
            print("ready", flush=True)
            await trio.sleep_forever()

trio.run(main, sys.argv[1:7])
"""


def test_host_memory_grows_with_the_process_limit(tmp_path: Path) -> None:
    # the runtime holds host memory per guest task outside the guest's: a fork
    # bomb at the limit beside a full guest must still fit under the host's limit
    rt = GVisorRuntime(state_root=tmp_path, process_limit=lambda memory_mb: memory_mb // 4)
    MiB = 1 << 20
    assert rt.host_memory_bytes(512) == (512 + 256 + 128 * gvisor.MIB_PER_PROCESS) * MiB
    assert rt.host_memory_bytes(4096) == (4096 + 512 + 1024 * gvisor.MIB_PER_PROCESS) * MiB
    assert GVisorRuntime(state_root=tmp_path).host_memory_bytes(512) == (512 + 256) * MiB


def test_host_tasks_are_a_share_of_the_hosts_pids(tmp_path: Path) -> None:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    rt = GVisorRuntime(state_root=tmp_path, process_limit=lambda memory_mb: memory_mb // 4)
    assert rt.host_tasks_limit(512) == max(pid_max // 4, 8 * 128)
    # never below what systrap needs for the guest's own limit
    assert rt.host_tasks_limit(1 << 20) == max(pid_max // 4, 8 * (1 << 18))
    # the task valve measures against what the memory headroom holds, if less
    share = 128 * gvisor.MIB_PER_PROCESS * 1024 // gvisor.KIB_PER_HOST_TASK
    assert rt.valve_tasks(512) == min(rt.host_tasks_limit(512), share)
    # an operator's limit (AENV_SANDBOX_HOST_TASKS)
    set_by_hand = GVisorRuntime(state_root=tmp_path, process_limit=lambda _: 128, tasks_limit=2048)
    assert set_by_hand.host_tasks_limit(512) == 2048
    assert set_by_hand.valve_tasks(512) == 2048


async def test_reap_stale_after_node_crash(
    tmp_path: Path, bundle: Path, busybox_lower: Path, netns: Any
) -> None:
    sandbox_id = "t" + secrets.token_hex(4)
    argv, _env = python_argv("import time; time.sleep(600)")
    node = await trio.lowlevel.open_process(
        [sys.executable, "-c", CRASHING_NODE, str(tmp_path), str(busybox_lower), str(bundle),
         str(netns.path), sandbox_id, "-", *argv],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    rt = runtime(tmp_path)
    ovl = tmp_path / "overlay"
    try:
        try:
            assert node.stdout is not None
            line = b""
            with trio.fail_after(60):
                while not line.endswith(b"\n"):
                    chunk = await node.stdout.receive_some()
                    assert chunk, "the node process exited before its sandbox was ready"
                    line += chunk
            assert line == b"ready\n"
        finally:
            node.send_signal(signal.SIGKILL)
            await node.wait()
        assert leftovers(rt, sandbox_id, ovl) != []  # the crash left a sandbox behind
    finally:
        await rt.reap_stale()
        await trio.to_thread.run_sync(reap_stale_mounts, tmp_path)
    assert leftovers(rt, sandbox_id, ovl) == []
    assert os.listdir(ovl / "upper")  # data stays; only mounts and processes go
