"""Memory snapshots against real runsc: checkpoint, restore, fork, freeze/thaw.

Rules: as in test_gvisor.py, every root is a host overlay over a layer of
static busybox only, the init is the bundle's Python, and traffic goes only
over the test's own veth pairs (10.214.N.0/30, one netns per sandbox, made
and deleted here). Frozen uppers go through `aenv.storage.layers`, the way
the node forks: checkpoint, unmount, freeze the upper, mount a fresh upper
per child over the frozen stack, restore. Each test checks that no runsc
process, cgroup, state file or mount is left. Timings are printed (-s).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from aenv.runtimes.base import CheckpointError, SandboxSpec
from aenv.runtimes.gvisor import CGROUP_ROOT, GVisorRuntime, GVisorSandbox
from aenv.storage.bundle import envd_command, python_command
from aenv.storage.layers import LayerStack, LayerStore
from aenv.storage.overlay import open_writable_root, unmount_root
from tests.runtimes.nets import Net

pytestmark = pytest.mark.runsc

CGROUP_PARENT = "aenvtest"

# A counter thread, a file written at start, and an HTTP server answering
# with its state; /write and /read touch files under /root.
GUEST = """
import http.server, json, os, secrets, socket, threading, time, urllib.parse
TOKEN = secrets.token_hex(8)
with open("/root/before", "w") as f:
    f.write("written before the checkpoint " + TOKEN)
state = {"n": 0}
def count():
    while True:
        state["n"] += 1
        with open("/root/count.tmp", "w") as f:  # whole numbers only, even when frozen
            f.write(str(state["n"]))
        os.replace("/root/count.tmp", "/root/count")
        time.sleep(0.05)
threading.Thread(target=count, daemon=True).start()
def echo():
    srv = socket.create_server(("0.0.0.0", 9000))
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(4096), b"")], daemon=True).start()
threading.Thread(target=echo, daemon=True).start()
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        url = urllib.parse.urlparse(self.path)
        q = dict(urllib.parse.parse_qsl(url.query))
        status, body = 200, {}
        if url.path == "/":
            body = {"n": state["n"], "token": TOKEN, "pid": os.getpid(),
                    "host": socket.gethostname(), "addr": self.connection.getsockname()[0]}
        elif url.path == "/write":
            with open("/root/" + q["name"], "w") as f:
                f.write(q["value"])
        elif url.path == "/read":
            try:
                body = {"value": open("/root/" + q["name"]).read()}
            except FileNotFoundError:
                status = 404
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""


def make_spec(tmp_path: Path, name: str, *, rootfs: Path, bundle: Path, net: Net) -> SandboxSpec:
    env = envd_command()[1]
    sandbox_id = f"t{name}{secrets.token_hex(3)}"
    return SandboxSpec(
        sandbox_id=sandbox_id,
        rootfs=rootfs,
        bundle=bundle,
        netns_path=net.path,
        cpu_count=1,
        memory_mb=256,
        hostname=f"sbx-{name}",
        workdir=tmp_path / f"driver-{name}",
        log_path=tmp_path / f"console-{name}.log",
        init_argv=(*python_command()[0], "-c", textwrap.dedent(GUEST)),
        init_env=env,
    )


async def get(net: Net, path: str = "/", *, within: float = 30) -> tuple[int, dict[str, Any]]:
    """GET from the guest's HTTP server over its veth, retrying until it answers."""
    with trio.fail_after(within):
        while True:
            try:
                stream = await trio.open_tcp_stream(net.guest_ip, 8080)
            except OSError:
                await trio.sleep(0.02)
                continue
            async with stream:
                await stream.send_all(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
                chunks = []
                while chunk := await stream.receive_some():
                    chunks.append(chunk)
            head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
            return int(head.split()[1]), json.loads(body or b"{}")


async def counter_after(net: Net, at_least: int) -> dict[str, Any]:
    with trio.fail_after(30):
        while True:
            _, state = await get(net)
            if state["n"] >= at_least:
                return state
            await trio.sleep(0.05)


def leftovers(rt: GVisorRuntime, tmp_path: Path) -> list[str]:
    found: list[str] = []
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    found += [line for line in ps.splitlines() if str(rt.state_root) in line]
    for prefix in ("tsrc", "tchild", "tfork", "tbad"):  # the ids make_spec gives
        found += [f"cgroup {p}" for p in CGROUP_ROOT.glob(f"*/{CGROUP_PARENT}/{prefix}*")]
    if rt.state_root.exists():
        found += [f"state {p.name}" for p in rt.state_root.iterdir()]
    found += [m for m in Path("/proc/mounts").read_text().splitlines() if str(tmp_path) in m]
    return found


@dataclass
class Source:
    """A checkpointed sandbox: its image, frozen layer stack and last observed state."""

    image: Path
    stack: LayerStack
    state: dict[str, Any]
    checkpoint_s: float
    freeze_s: float


@asynccontextmanager
async def checkpointed_source(
    tmp_path: Path, rt: GVisorRuntime, bundle: Path, lower: Path, net: Net
) -> AsyncIterator[Source]:
    """Run the guest, let it count, checkpoint it (stopping it), freeze its upper."""
    store = LayerStore(tmp_path / "layers")
    image = tmp_path / "image"
    base = LayerStack.of_base([lower])
    async with open_writable_root(base.lowers(), tmp_path / "src") as root:
        spec = make_spec(tmp_path, "src", rootfs=root, bundle=bundle, net=net)
        async with rt.open_sandbox(spec) as sandbox:
            state = await counter_after(net, 5)
            t0 = time.monotonic()
            await sandbox.checkpoint(image, leave_running=False)
            checkpoint_s = time.monotonic() - t0
            # The sandbox is gone at once: its process has exited.
            with trio.fail_after(1):
                await sandbox.wait()
            t0 = time.monotonic()
            upper = await unmount_root(tmp_path / "src")
            layer = await store.freeze(upper, below=base)
            freeze_s = time.monotonic() - t0
    yield Source(image, store.chain(layer), state, checkpoint_s, freeze_s)


def runtime(tmp_path: Path) -> GVisorRuntime:
    return GVisorRuntime(state_root=tmp_path / "runsc-state", cgroup_parent=CGROUP_PARENT)


async def test_restore_resumes_counter_files_and_listener_in_another_netns(
    tmp_path: Path, bundle: Path, busybox_lower: Path, make_netns: Callable[[], Net]
) -> None:
    rt = runtime(tmp_path)
    net_a, net_b = make_netns(), make_netns()
    async with checkpointed_source(tmp_path, rt, bundle, busybox_lower, net_a) as src:
        assert src.state["addr"] == net_a.guest_ip
        assert (src.image / "checkpoint.img").is_file()
        counted = int((src.stack.lowers()[0] / "root" / "count").read_text())
        assert counted >= src.state["n"]

        async with open_writable_root(src.stack.lowers(), tmp_path / "child") as root:
            spec = make_spec(tmp_path, "child", rootfs=root, bundle=bundle, net=net_b)
            t0 = time.monotonic()
            async with rt.open_restored(spec, src.image) as child:
                t_restore = time.monotonic() - t0
                assert child.sandbox_id == spec.sandbox_id
                _, state = await get(net_b, within=10)
                t_answer = time.monotonic() - t0
                # Same processes (same start token and pid), counting on from
                # where they stopped, reached at the new netns' address.
                assert state["token"] == src.state["token"]
                assert state["pid"] == src.state["pid"]
                assert counted <= state["n"] < counted + 400  # not restarted from 0
                assert state["addr"] == net_b.guest_ip
                # The restored kernel keeps its UTS namespace: the hostname is
                # the checkpointed sandbox's, not the new spec's.
                assert state["host"] == "sbx-src"
                later = await counter_after(net_b, state["n"] + 5)
                assert later["token"] == src.state["token"]
                assert (await get(net_b, "/read?name=before"))[1]["value"].endswith(
                    src.state["token"]
                )
                # Writes go to the child's own upper, not the frozen layer.
                assert int((tmp_path / "child" / "upper" / "root" / "count").read_text()) > counted
                assert int((src.stack.lowers()[0] / "root" / "count").read_text()) == counted
                # Nothing answers at the old address any more (refused or silent).
                with trio.move_on_after(2), pytest.raises(OSError):
                    await trio.open_tcp_stream(net_a.guest_ip, 8080)
    assert leftovers(rt, tmp_path) == []
    print(
        f"\ncheckpoint {src.checkpoint_s * 1000:.0f} ms "
        f"({(src.image / 'checkpoint.img').stat().st_size >> 10} KiB image), "
        f"freeze {src.freeze_s * 1000:.1f} ms, restore {t_restore * 1000:.0f} ms, "
        f"restored guest answering HTTP after {t_answer * 1000:.0f} ms"
    )


async def test_three_restores_of_one_image_are_independent_forks(
    tmp_path: Path, bundle: Path, busybox_lower: Path, make_netns: Callable[[], Net]
) -> None:
    rt = runtime(tmp_path)
    nets = [make_netns() for _ in range(4)]
    async with checkpointed_source(tmp_path, rt, bundle, busybox_lower, nets[0]) as src:
        children: dict[int, GVisorSandbox] = {}
        all_forked = trio.Event()
        t0 = time.monotonic()

        async def fork(i: int, task_status: trio.TaskStatus[None]) -> None:
            name = f"fork{i}"
            async with open_writable_root(src.stack.lowers(), tmp_path / name) as root:
                spec = make_spec(tmp_path, name, rootfs=root, bundle=bundle, net=nets[i + 1])
                async with rt.open_restored(spec, src.image) as child:
                    children[i] = child
                    if len(children) == 3:
                        all_forked.set()
                    task_status.started()
                    await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(nursery.start, fork, i)
            with trio.fail_after(60):
                await all_forked.wait()
            t_forked = time.monotonic() - t0
            states = [(await get(net))[1] for net in nets[1:]]
            t_answering = time.monotonic() - t0
            assert {s["token"] for s in states} == {src.state["token"]}
            assert [s["addr"] for s in states] == [n.guest_ip for n in nets[1:]]
            assert len({c.sandbox_pid for c in children.values()}) == 3

            # A write in one fork is invisible to the others.
            assert (await get(nets[1], "/write?name=mine&value=one"))[0] == 200
            assert (await get(nets[1], "/read?name=mine"))[1] == {"value": "one"}
            assert (await get(nets[2], "/read?name=mine"))[0] == 404
            assert (await get(nets[3], "/read?name=mine"))[0] == 404
            assert (await get(nets[3], "/write?name=mine&value=three"))[0] == 200
            assert (await get(nets[1], "/read?name=mine"))[1] == {"value": "one"}
            # Each counts on by itself; stopping one leaves the others running.
            await counter_after(nets[1], states[0]["n"] + 5)
            await counter_after(nets[2], states[1]["n"] + 5)
            await children[0].freeze()
            frozen_at = (await get(nets[2]))[1]["n"]
            await counter_after(nets[3], states[2]["n"] + 5)
            await counter_after(nets[2], frozen_at + 5)
            await children[0].thaw()
            nursery.cancel_scope.cancel()
    assert leftovers(rt, tmp_path) == []
    print(
        f"\nfork of 3: restored {t_forked * 1000:.0f} ms, all answering HTTP after "
        f"{t_answering * 1000:.0f} ms (checkpoint {src.checkpoint_s * 1000:.0f} ms, "
        f"freeze {src.freeze_s * 1000:.1f} ms)"
    )


async def test_leave_running_keeps_processes_but_resets_connections(
    tmp_path: Path, bundle: Path, busybox_lower: Path, make_netns: Callable[[], Net]
) -> None:
    rt = runtime(tmp_path)
    net = make_netns()
    async with open_writable_root([busybox_lower], tmp_path / "src") as root:
        spec = make_spec(tmp_path, "src", rootfs=root, bundle=bundle, net=net)
        async with rt.open_sandbox(spec) as sandbox:
            before = await counter_after(net, 5)
            # An established connection to the guest's echo server.
            with trio.fail_after(10):
                conn = await trio.open_tcp_stream(net.guest_ip, 9000)
                await conn.send_all(b"ping")
                assert await conn.receive_some() == b"ping"
            t0 = time.monotonic()
            await sandbox.checkpoint(tmp_path / "image", leave_running=True)
            t_ckpt = time.monotonic() - t0
            # The same sandbox process and guest processes carry on counting.
            assert await trio.Path(f"/proc/{sandbox.sandbox_pid}").exists()
            after = await counter_after(net, before["n"] + 5)
            assert after["token"] == before["token"] and after["pid"] == before["pid"]
            # ... but established connections were reset by the checkpoint.
            with trio.fail_after(10):
                try:
                    await conn.send_all(b"again")
                    reply = await conn.receive_some()
                except trio.BrokenResourceError:
                    reply = b"<reset>"
            assert reply in (b"", b"<reset>")
            await conn.aclose()
            # New connections work.
            with trio.fail_after(10):
                conn = await trio.open_tcp_stream(net.guest_ip, 9000)
                await conn.send_all(b"pong")
                assert await conn.receive_some() == b"pong"
                await conn.aclose()
            # freeze/thaw: no progress while frozen, memory kept.
            t0 = time.monotonic()
            await sandbox.freeze()
            t_freeze = time.monotonic() - t0
            count = tmp_path / "src" / "upper" / "root" / "count"
            stopped_at = count.read_text()
            await sandbox.usage()
            await trio.sleep(0.5)
            usage = await sandbox.usage()
            assert count.read_text() == stopped_at
            assert usage.cpu_used_pct < 5
            assert usage.mem_used_bytes > 0
            t0 = time.monotonic()
            await sandbox.thaw()
            t_thaw = time.monotonic() - t0
            resumed = await counter_after(net, int(stopped_at) + 5)
            assert resumed["token"] == before["token"]
    assert leftovers(rt, tmp_path) == []
    print(
        f"\ncheckpoint --leave-running {t_ckpt * 1000:.0f} ms, "
        f"pause {t_freeze * 1000:.0f} ms, resume {t_thaw * 1000:.0f} ms"
    )


async def test_bad_images_fail_cleanly(
    tmp_path: Path, bundle: Path, busybox_lower: Path, make_netns: Callable[[], Net]
) -> None:
    rt = runtime(tmp_path)
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "checkpoint.img").write_bytes(b"not an image")
    async with open_writable_root([busybox_lower], tmp_path / "root") as root:
        net = make_netns()
        spec = make_spec(tmp_path, "bad", rootfs=root, bundle=bundle, net=net)
        with pytest.raises(CheckpointError, match="restore"):
            async with rt.open_restored(spec, garbage):
                pytest.fail("restored garbage")
        assert [x for x in leftovers(rt, tmp_path) if not x.startswith("overlay")] == []
        # runsc strips the addresses off the netns it took over, also when
        # the restore failed: a second sandbox needs a fresh network slot.
        net = make_netns()
        spec = make_spec(tmp_path, "bad2", rootfs=root, bundle=bundle, net=net)
        async with rt.open_sandbox(spec) as sandbox:
            await counter_after(net, 1)
            # An image directory that is not empty is refused; the sandbox runs on.
            with pytest.raises(CheckpointError, match="not empty"):
                await sandbox.checkpoint(garbage, leave_running=False)
            await counter_after(net, 3)
    assert leftovers(rt, tmp_path) == []


async def test_an_image_packed_against_the_one_it_came_from_restores(
    tmp_path: Path, bundle: Path, busybox_lower: Path, make_netns: Callable[[], Net]
) -> None:
    """A restored sandbox's next image, packed against the image it was
    restored from (a hibernation), restores to where it was; a damaged pack
    fails the restore as a bad image does, and leaves nothing behind."""
    rt = runtime(tmp_path)
    net_a, net_b, net_c, net_d = make_netns(), make_netns(), make_netns(), make_netns()
    async with checkpointed_source(tmp_path, rt, bundle, busybox_lower, net_a) as src:
        packed = tmp_path / "packed"
        async with open_writable_root(src.stack.lowers(), tmp_path / "child") as root:
            spec = make_spec(tmp_path, "child", rootfs=root, bundle=bundle, net=net_b)
            async with rt.open_restored(spec, src.image) as child:
                assert isinstance(child, GVisorSandbox) and child.restored_from == src.image
                before = await counter_after(net_b, src.state["n"] + 3)
                await child.checkpoint(packed, leave_running=False)
                await child.compact_image(packed)
        names = sorted(p.name for p in packed.iterdir())
        assert "pages.img" not in names and {"pages.pack", "pages.base"} <= set(names)
        assert (packed / "pages.pack").stat().st_size < (packed / "pages.base").stat().st_size / 4
        async with open_writable_root(src.stack.lowers(), tmp_path / "fork") as root:
            spec = make_spec(tmp_path, "fork", rootfs=root, bundle=bundle, net=net_c)
            async with rt.open_restored(spec, packed):
                _, state = await get(net_c, within=10)
                assert state["token"] == src.state["token"]
                assert state["n"] >= before["n"]  # counting on from the packed image
                assert not (tmp_path / "driver-fork" / "unpacked-image").exists()
        pack = packed / "pages.pack"
        pack.write_bytes(pack.read_bytes()[:-100])
        async with open_writable_root(src.stack.lowers(), tmp_path / "bad") as root:
            spec = make_spec(tmp_path, "bad", rootfs=root, bundle=bundle, net=net_d)
            with pytest.raises(CheckpointError, match="unpacking"):
                async with rt.open_restored(spec, packed):
                    pytest.fail("restored a damaged pack")
            assert not (tmp_path / "driver-bad" / "unpacked-image").exists()
    assert leftovers(rt, tmp_path) == []
