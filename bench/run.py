"""aenv benchmarks: p50/p95 of what an E2B SDK user waits for, next to the runsc floor.

One run starts three nodes (`python -m aenv serve`) one after the other, each
on a free loopback port with a private home (bundle and templates linked),
the netns prefix `aenvk` and slot range 10.227.0.0/16 (overridable, see
NET_PREFIX below), and times through the
real `e2b` Python SDK: `Sandbox.create(template)` alone and until a first
`commands.run("true")` returns, on a node that boots every sandbox
(`AENV_WARM_TEMPLATES=0 AENV_POOL_SIZE=0`), on one that restores the
template's snapshot (`AENV_POOL_SIZE=0`, after the snapshot exists) and on
one with the default pool (samples spaced so the pool can refill; pool hits
counted from the sandboxes' logs). On the pool node it then times a
`commands.run("true")` round trip, writing and reading 1 MiB, pause, resume
from frozen (at once) and from disk (after the node hibernated the sandbox)
until connect returns and until a first command, the hibernation itself, fork(count=1), fork(count=4) and
create_snapshot, and the bytes a capture writes (the new frozen layer and the
memory image) after 1 MiB of a file changed. In the same run it times the
floor, the same operations done directly with `runsc` and no aenv at all,
started the way aenv's gVisor driver starts sandboxes (the driver's OCI
config, its runsc flags and platform, a private mount namespace with a tmpfs
over /proc/sys/net, `--network=sandbox` in a netns of its own holding a
veth, the node's checkpoint compression): `runsc run` of a busybox root
filesystem until its first command (`true`) exits, `runsc exec <id> true`,
`runsc exec` of `sh -c 'cat > f'` / `cat f` for 1 MiB; then, for a busybox
sandbox and for the sandbox aenv runs (the template's root filesystem under
an overlay, envd as init), `runsc checkpoint` of the running sandbox and
`runsc restore` of its image into a fresh container ID (then `runsc exec
true`), `runsc checkpoint --leave-running`, and that plus 1 or 4 concurrent
restores, each into a netns of its own (a fork). It prints a table (with the
issue's targets, met or not) and writes JSON to bench/results/<timestamp>.json.
Every loop is bounded, all traffic stays on loopback or in the bench's own
netns, and everything is cleaned up (nodes stopped with SIGTERM and their
homes removed, runsc containers deleted, netns and veths removed) also when
a step fails or the run is interrupted. Needs root and runsc.

    .venv/bin/python bench/run.py [--n 10] [--home DIR] [--template base]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from aenv.config import Config  # noqa: E402
from aenv.runtimes.base import ENVD_PORT, SandboxSpec  # noqa: E402
from aenv.runtimes.gvisor import oci_config  # noqa: E402
from aenv.storage.bundle import envd_command  # noqa: E402
from tests.conftest import NodeProc, leaks, link_home, start_node, stop_node  # noqa: E402

# The nodes' netns prefix, slot range and tag (unique on this machine: other
# benchmarks and test suites use other prefixes and 10.229-10.239). Two runs
# at once on one machine each need their own: AENV_BENCH_NET_PREFIX (5
# characters, not the start of another prefix in use), AENV_BENCH_SLOT_CIDR
# (a /16 for the nodes' slots) and AENV_BENCH_FLOOR_NET (the first two octets
# of a /16 for the floor's own links).
NET_PREFIX = os.environ.get("AENV_BENCH_NET_PREFIX", "aenvk")
SLOT_CIDR = os.environ.get("AENV_BENCH_SLOT_CIDR", "10.227.0.0/16")
_FLOOR_NET = os.environ.get("AENV_BENCH_FLOOR_NET", "10.228")
NODE_TAG = "bnch"
# The floor's own netns and veth (outside the node's naming and slot range).
FLOOR_NETNS = f"{NET_PREFIX}floor"
FLOOR_VETH = f"{NET_PREFIX}fh"
FLOOR_HOST_IP = f"{_FLOOR_NET}.1.1"
FLOOR_GUEST_IP = f"{_FLOOR_NET}.1.2"
# One more netns per floor fork child (i = 1..FORK_MAX): <prefix>f<i>, veth
# <prefix>fh<i>, <floor net>.0.<4i+1>/30 on the host side.
FORK_MAX = 4
FLOOR_CGROUP = "aenvbench"
PAYLOAD = 1 << 20
GUEST_FILE = "/tmp/aenv-bench.bin"
STEP_TIMEOUT_S = 120.0
# Between pool samples: a refill takes ~0.5-1 s here.
HIBERNATE_AFTER_S = 2
POOL_SPACING_S = 1.5
# How long a node may take to make the template a snapshot.
WARM_WAIT_S = 180.0
RESULTS = REPO / "bench" / "results"

# (label, aenv key, floor key, target): target is a p50 bound in ms, or the
# string "1.3x" (within 1.3x the floor's p50), or None.
Row = tuple[str, str | None, str | None, float | str | None]
# Floor keys measured on the sandbox aenv runs (template rootfs, envd as init)
ENVD = "_envd"
ROWS: tuple[Row, ...] = (
    ("create (boot) -> first command", "create_boot", "create_to_first_command", "1.3x"),
    ("  of which Sandbox.create", "create_boot_only", None, None),
    ("create (restore template snapshot) -> first cmd", "create_restore",
     "restore_to_first_command", "1.3x"),
    ("  of which Sandbox.create", "create_restore_only", "restore", "1.3x"),
    ("create (pool) -> first command", "create_pool", None, None),
    ("  of which Sandbox.create", "create_pool_only", None, 50.0),
    ('commands.run("true")', "command_roundtrip", "command_roundtrip", None),
    ("files.write 1 MiB", "file_write_1mib", "file_write_1mib", None),
    ("files.read 1 MiB", "file_read_1mib", "file_read_1mib", None),
    ("pause (full: frozen in memory)", "pause", "checkpoint" + ENVD, 100.0),
    ("resume (from frozen): connect", "resume_only", None, 50.0),
    ("resume (from frozen) -> first cmd", "resume", None, None),
    ("hibernate (frozen -> on disk)", "hibernate", "checkpoint" + ENVD, "1.3x"),
    ("resume (from disk): connect", "resume_disk_only", "restore" + ENVD, "1.3x"),
    ("resume (from disk) -> first cmd", "resume_disk", "restore_to_first_command" + ENVD,
     "1.3x"),
    ("fork(count=1)", "fork_1", "fork_1" + ENVD, "1.3x"),
    ("fork(count=4)", "fork_4", "fork_4" + ENVD, "1.3x"),
    ("create_snapshot", "snapshot", "checkpoint_leave_running" + ENVD, "1.3x"),
    ("busybox floor: runsc checkpoint", None, "checkpoint", None),
    ("busybox floor: runsc restore", None, "restore", None),
    ("busybox floor: checkpoint --leave-running", None, "checkpoint_leave_running", None),
    ("busybox floor: fork(count=1)", None, "fork_1", None),
    ("busybox floor: fork(count=4)", None, "fork_4", None),
)  # fmt: skip
AENV_KEYS = (
    *dict.fromkeys(r[1] for r in ROWS if r[1]),
    "capture_layer_bytes",
    "capture_image_bytes",
)
FLOOR_KEYS = (*dict.fromkeys(r[2] for r in ROWS if r[2]), "image_bytes", "image_bytes" + ENVD)


class Interrupted(BaseException):
    """SIGTERM arrived: unwind through every cleanup block."""


def interrupt_on_sigterm() -> None:
    """From now on SIGTERM raises `Interrupted` in the main thread, so a
    benchmark stopped by a timeout still stops its nodes and removes its files."""

    def on_sigterm(signum: int, frame: object) -> None:
        raise Interrupted(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)


def bench_home(
    p: argparse.ArgumentParser,
    given: Path | None,
    *,
    needs: tuple[str, ...] = ("bundle", "templates"),
    why: str = "runsc, network namespaces",
) -> Path:
    """The built home a benchmark runs from (`given`, else $AENV_TEST_HOME, else
    .state/test-home), checked: root, and `needs` in it; else `p.error`."""
    if os.geteuid() != 0:
        p.error(f"must run as root ({why})")
    home = (given or Path(os.environ.get("AENV_TEST_HOME") or REPO / ".state/test-home")).resolve()
    missing = [n for n in needs if not (home / n).is_dir()]
    if missing:
        p.error(f"{home} has no {', '.join(missing)}; build it with `make test-artefacts`")
    return home


@dataclass
class Series:
    samples: list[float] = field(default_factory=list)
    error: str | None = None
    note: str | None = None
    unit: str = "ms"

    def to_json(self) -> dict[str, Any]:
        u = self.unit
        out: dict[str, Any] = {"n": len(self.samples), f"samples_{u}": self.samples}
        if self.samples:
            out[f"p50_{u}"] = percentile(self.samples, 50)
            out[f"p95_{u}"] = percentile(self.samples, 95)
        if self.note:
            out["note"] = self.note
        if self.error:
            out["error"] = self.error
        return out


def percentile(samples: list[float], q: int) -> float:
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


def timed(
    series: Series, n: int, op: Callable[[], object], check: Callable[[object], None]
) -> None:
    """Run `op` n times, recording each duration; stop at the first failure."""
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            result = op()
        except Exception as e:
            series.error = _describe(e)
            return
        series.samples.append((time.perf_counter() - t0) * 1000)
        check(result)


def _ignore(_: object) -> None:
    pass


def run(argv: list[str], *, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[bytes]:
    if "input" not in kw:
        kw.setdefault("stdin", subprocess.DEVNULL)
    kw.setdefault("timeout", STEP_TIMEOUT_S)
    if "stdout" not in kw and "capture_output" not in kw:
        kw["capture_output"] = True
    proc = subprocess.run(argv, check=False, **kw)
    if check and proc.returncode != 0:
        err = (proc.stderr or b"").decode(errors="replace").strip()[-1500:]
        raise RuntimeError(f"{shlex.join(argv[:6])} exited {proc.returncode}: {err}")
    return proc


def disk_bytes(path: Path) -> int:
    """Bytes allocated on disk under `path` (each inode once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in (".", *dirnames, *filenames):
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


# -- aenv through the e2b SDK -------------------------------------------------------


@dataclass
class NodeRun:
    """One node of the run: its name in the report, the env it gets, what it measures."""

    name: str
    env: dict[str, str]
    measure: Callable[[NodeProc, str, int, dict[str, Series]], None]


def bench_aenv(home: Path, template: str, n: int, workdir: Path) -> dict[str, Series]:
    results = {key: Series() for key in AENV_KEYS}
    for key in ("capture_layer_bytes", "capture_image_bytes"):
        results[key].unit = "bytes"
    runs = (
        NodeRun("boot", {"AENV_WARM_TEMPLATES": "0", "AENV_POOL_SIZE": "0"}, _bench_boot),
        NodeRun("restore", {"AENV_POOL_SIZE": "0"}, _bench_restore),
        # paused sandboxes go to disk 2 s after their pause (the default is 60 s)
        NodeRun("pool", {"AENV_HIBERNATE_AFTER": str(HIBERNATE_AFTER_S)}, _bench_pool),
    )
    for node_run in runs:
        print(f"  node {node_run.name} ...", flush=True)
        _with_node(home, workdir / node_run.name, node_run, template, n, results)
    return results


def _with_node(
    built: Path,
    workdir: Path,
    node_run: NodeRun,
    template: str,
    n: int,
    results: dict[str, Series],
) -> None:
    private = workdir / "home"
    private.mkdir(parents=True)
    link_home(built, private)
    log_path = workdir / "node.log"
    errors_before = sum(1 for s in results.values() if s.error)
    try:
        node = start_node(
            private,
            api_key="aenv_bench_" + secrets.token_hex(8),
            log_path=log_path,
            extra_env={
                "AENV_NET_PREFIX": NET_PREFIX,
                "AENV_SLOT_CIDR": SLOT_CIDR,
                "AENV_NODE_TAG": NODE_TAG,
                **node_run.env,
            },
        )
    except Exception as e:
        _fail(results, AENV_KEYS, e)
        return
    try:
        with _sdk_env(node):
            node_run.measure(node, template, n, results)
    finally:
        code = stop_node(node)
        left = leaks(private, prefix=NET_PREFIX)
        failed = sum(1 for s in results.values() if s.error) > errors_before
        if code != 0 or left or failed:
            print(f"--- node {node_run.name} log (exit {code}) ---\n{node.log_tail(40)}",
                  file=sys.stderr)  # fmt: skip
        if left:
            print(f"node {node_run.name} left behind: {left}", file=sys.stderr)
        shutil.rmtree(private, ignore_errors=True)


@contextlib.contextmanager
def _sdk_env(node: NodeProc) -> Iterator[None]:
    keys = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN", "E2B_DEBUG")
    old = {k: os.environ.get(k) for k in keys}
    for k in ("E2B_DOMAIN", "E2B_DEBUG"):
        os.environ.pop(k, None)
    os.environ.update(
        {"E2B_API_URL": node.url, "E2B_SANDBOX_URL": node.url, "E2B_API_KEY": node.api_key}
    )
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _create_samples(
    template: str,
    n: int,
    total: Series,
    alone: Series,
    *,
    spacing_s: float = 0.0,
    after: Callable[[Any], None] | None = None,
) -> None:
    """n times: `Sandbox.create` (timed alone) + `commands.run("true")`, then kill."""
    from e2b import Sandbox

    for i in range(n):
        if i and spacing_s:
            time.sleep(spacing_s)
        sbx = None
        t0 = time.perf_counter()
        try:
            sbx = Sandbox.create(template, timeout=300)
            created = time.perf_counter() - t0
            sbx.commands.run("true")
            elapsed = time.perf_counter() - t0
            if after is not None:
                after(sbx)
        except Exception as e:
            total.error = _describe(e)
            break
        finally:
            if sbx is not None:
                with contextlib.suppress(Exception):
                    sbx.kill()
        total.samples.append(elapsed * 1000)
        alone.samples.append(created * 1000)


def _warm_up(node: NodeProc, template: str) -> None:
    """One untimed create; then wait until the node has made the template a snapshot."""
    from e2b import Sandbox

    Sandbox.create(template, timeout=120).kill()
    deadline = time.monotonic() + WARM_WAIT_S
    while "is now a snapshot" not in node.log_path.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"template {template} not a snapshot after {WARM_WAIT_S:g}s")
        time.sleep(0.2)
    Sandbox.create(template, timeout=120).kill()  # a restore (pool node: marks it hot)


def _bench_boot(node: NodeProc, template: str, n: int, results: dict[str, Series]) -> None:
    from e2b import Sandbox

    try:
        Sandbox.create(template, timeout=120).kill()  # untimed: page cache, first connection
    except Exception as e:
        _fail(results, ("create_boot", "create_boot_only"), e)
        return
    _create_samples(template, n, results["create_boot"], results["create_boot_only"])


def _bench_restore(node: NodeProc, template: str, n: int, results: dict[str, Series]) -> None:
    try:
        _warm_up(node, template)
    except Exception as e:
        _fail(results, ("create_restore", "create_restore_only"), e)
        return
    _create_samples(template, n, results["create_restore"], results["create_restore_only"])


def _bench_pool(node: NodeProc, template: str, n: int, results: dict[str, Series]) -> None:
    from e2b import Sandbox

    rest = (
        "command_roundtrip", "file_write_1mib", "file_read_1mib", "pause", "resume_only",
        "resume", "hibernate", "resume_disk_only", "resume_disk", "fork_1", "fork_4",
        "snapshot", "capture_layer_bytes", "capture_image_bytes",
    )  # fmt: skip
    try:
        _warm_up(node, template)
        time.sleep(3 * POOL_SPACING_S)  # let the pool fill
    except Exception as e:
        _fail(results, ("create_pool", "create_pool_only", *rest), e)
        return
    hits: list[bool] = []

    def from_pool(sbx: Any) -> None:
        lines = httpx.get(
            f"{node.url}/sandboxes/{sbx.sandbox_id}/logs",
            headers={"X-API-Key": node.api_key},
            timeout=10,
        ).json()["logs"]
        hits.append(any("adopted from the pool" in e["line"] for e in lines))

    _create_samples(
        template,
        n,
        results["create_pool"],
        results["create_pool_only"],
        spacing_s=POOL_SPACING_S,
        after=from_pool,
    )
    note = f"{sum(hits)}/{len(hits)} from the pool, samples {POOL_SPACING_S:g} s apart"
    results["create_pool"].note = results["create_pool_only"].note = note

    try:
        sbx = Sandbox.create(template, timeout=600)
    except Exception as e:
        _fail(results, rest, e)
        return
    try:
        for _ in range(3):  # warm the connection pool and envd
            sbx.commands.run("true")
        timed(results["command_roundtrip"], n, lambda: sbx.commands.run("true"), _ignore)

        data = os.urandom(PAYLOAD)

        def same(got: object) -> None:
            if not isinstance(got, bytes | bytearray) or bytes(got) != data:
                raise AssertionError("files.read returned other bytes than were written")

        sbx.files.write(GUEST_FILE, data)
        timed(results["file_write_1mib"], n, lambda: sbx.files.write(GUEST_FILE, data), _ignore)
        read = lambda: sbx.files.read(GUEST_FILE, format="bytes")  # noqa: E731
        timed(results["file_read_1mib"], n, read, same)
        _bench_snapshots(node, sbx, n, results)
    except Exception as e:
        _fail(results, rest, e)
    finally:
        with contextlib.suppress(Exception):
            sbx.kill()
    try:
        _bench_capture_bytes(node, template, n, results)
    except Exception as e:
        _fail(results, ("capture_layer_bytes", "capture_image_bytes"), e)


def _on_disk(node: NodeProc, sandbox_id: str, limit_s: float = 120.0) -> None:
    """Wait until a paused sandbox is written to disk (its pausedInMemory goes false)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        d = httpx.get(
            f"{node.url}/sandboxes/{sandbox_id}", headers={"X-API-Key": node.api_key}, timeout=10
        ).json()
        if d.get("state") == "paused" and not d.get("pausedInMemory"):
            return
        time.sleep(0.01)
    raise RuntimeError(f"sandbox {sandbox_id} was not written to disk within {limit_s:g} s")


def _bench_snapshots(node: NodeProc, sbx: Any, n: int, results: dict[str, Series]) -> None:
    """Pause/resume (both tiers), fork and snapshot of a sandbox running a counter loop."""
    from e2b import Sandbox

    sbx.commands.run(
        "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.1; done", background=True
    )
    for _ in range(n):  # frozen in memory: resumed well before it hibernates
        t0 = time.perf_counter()
        sbx.pause()
        results["pause"].samples.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        back = Sandbox.connect(sbx.sandbox_id, timeout=600)
        connected = time.perf_counter() - t0
        back.commands.run("true")
        results["resume"].samples.append((time.perf_counter() - t0) * 1000)
        results["resume_only"].samples.append(connected * 1000)
    for _ in range(n):  # left paused until it is on disk, then resumed from there
        sbx.pause()
        t0 = time.perf_counter()
        _on_disk(node, sbx.sandbox_id)
        # what the node spent writing it, beyond the wait before it started
        spent = (time.perf_counter() - t0) * 1000 - HIBERNATE_AFTER_S * 1000
        results["hibernate"].samples.append(max(0.0, spent))
        t0 = time.perf_counter()
        back = Sandbox.connect(sbx.sandbox_id, timeout=600)
        connected = time.perf_counter() - t0
        back.commands.run("true")
        results["resume_disk"].samples.append((time.perf_counter() - t0) * 1000)
        results["resume_disk_only"].samples.append(connected * 1000)
    results[
        "hibernate"
    ].note = f"time from pause to on disk minus the {HIBERNATE_AFTER_S:g} s wait (10 ms polling)"
    for count in (1, 4):
        series = results[f"fork_{count}"]
        for _ in range(n):
            t0 = time.perf_counter()
            children = sbx.fork(count=count, timeout=120)
            series.samples.append((time.perf_counter() - t0) * 1000)
            for c in children:
                if isinstance(c, Exception):
                    raise c
                c.kill()
    for _ in range(n):
        t0 = time.perf_counter()
        info = sbx.create_snapshot()
        results["snapshot"].samples.append((time.perf_counter() - t0) * 1000)
        Sandbox.delete_snapshot(info.snapshot_id)


def _bench_capture_bytes(node: NodeProc, template: str, n: int, results: dict[str, Series]) -> None:
    """Bytes a pause writes after 1 MiB of a file changed: the new layer, the memory image."""
    from e2b import Sandbox

    layers_dir = node.home / "layers" / "layers"
    sbx = Sandbox.create(template, timeout=600)
    workdir = node.home / "sandboxes" / sbx.sandbox_id
    try:
        for i in range(n):
            # a new file under $HOME: on the root overlay (not a tmpfs)
            sbx.commands.run(f"head -c {PAYLOAD} /dev/urandom > ~/aenv-bench-capture-{i}.bin")
            before = set(os.listdir(layers_dir)) if layers_dir.is_dir() else set()
            sbx.pause()
            _on_disk(node, sbx.sandbox_id)  # the layer and image are written on hibernation
            new = set(os.listdir(layers_dir)) - before
            if len(new) != 1:
                raise RuntimeError(f"pause made {len(new)} new layers, expected 1: {sorted(new)}")
            images = [p for p in workdir.glob("image*") if p.suffix != ".tmp"]
            if len(images) != 1:
                raise RuntimeError(f"{workdir} holds {len(images)} memory images, expected 1")
            results["capture_layer_bytes"].samples.append(disk_bytes(layers_dir / new.pop()))
            results["capture_image_bytes"].samples.append(disk_bytes(images[0]))
            sbx = Sandbox.connect(sbx.sandbox_id, timeout=600)
    finally:
        with contextlib.suppress(Exception):
            sbx.kill()


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


def _fail(results: dict[str, Series], keys: tuple[str, ...], e: Exception) -> None:
    """Record `e` on every series in `keys` that has neither samples nor an error yet."""
    for key in keys:
        if results[key].error is None and not results[key].samples:
            results[key].error = _describe(e)


# -- the floor: runsc without aenv ------------------------------------------------


@dataclass(frozen=True)
class FloorNet:
    """A netns holding one end of a veth, as an aenv network slot has."""

    netns: str
    veth: str
    host_ip: str
    guest_ip: str

    @property
    def path(self) -> Path:
        return Path("/run/netns") / self.netns


MAIN_NET = FloorNet(FLOOR_NETNS, FLOOR_VETH, FLOOR_HOST_IP, FLOOR_GUEST_IP)


def fork_nets(count: int) -> tuple[FloorNet, ...]:
    """The nets of `count` floor fork children (at most 63: one /30 each in
    <floor net>.0.0/24, after the first)."""
    assert 0 <= count <= 63
    return tuple(
        FloorNet(
            f"{NET_PREFIX}f{i}",
            f"{NET_PREFIX}fh{i}",
            f"{_FLOOR_NET}.0.{4 * i + 1}",
            f"{_FLOOR_NET}.0.{4 * i + 2}",
        )
        for i in range(1, count + 1)
    )


FORK_NETS = fork_nets(FORK_MAX)


# A floor sandbox's init process: argv and environment.
Init = tuple[tuple[str, ...], dict[str, str]]
SLEEP: Init = (("/bin/sleep", "3600"), {})


@dataclass
class Floor:
    """runsc set up as aenv's gVisor driver does it, with nothing of aenv running."""

    home: Path
    workdir: Path
    runsc: str
    platform: str
    net_disconnect_ok: bool = False
    compression: str = "none"  # of memory images, as the node's setting
    containers: set[str] = field(default_factory=set)

    @property
    def state_root(self) -> Path:
        return self.workdir / "runsc-root"

    def command(self, *args: str) -> list[str]:
        return [
            self.runsc,
            "--root", str(self.state_root),
            "--platform", self.platform,
            "--network", "sandbox",
            "--overlay2", "none",
            *(["--net-disconnect-ok"] if self.net_disconnect_ok else []),
            *args,
        ]  # fmt: skip

    @staticmethod
    def in_private_netfs(cmd: list[str]) -> list[str]:
        script = "mount -t tmpfs -o size=4k aenv-netfs /proc/sys/net && exec " + shlex.join(cmd)
        return ["unshare", "--mount", "--propagation", "slave", "sh", "-c", script]

    def bundle(
        self,
        cid: str,
        argv: tuple[str, ...],
        rootfs: Path,
        net: FloorNet = MAIN_NET,
        env: dict[str, str] | None = None,
    ) -> Path:
        bundle_dir = self.workdir / "bundles" / cid
        bundle_dir.mkdir(parents=True)
        spec = SandboxSpec(
            sandbox_id=cid,
            rootfs=rootfs,
            bundle=self.home / "bundle",
            netns_path=net.path,
            cpu_count=2,
            memory_mb=512,
            hostname="sandbox",
            workdir=bundle_dir,
            log_path=bundle_dir / "console.log",
            init_argv=argv,
            init_env=env or {},
        )
        config = oci_config(spec, cgroups_path=f"/{FLOOR_CGROUP}/{cid}")
        (bundle_dir / "config.json").write_text(json.dumps(config, indent=1))
        return bundle_dir

    @staticmethod
    def reset_guest_address(net: FloorNet = MAIN_NET) -> None:
        """Give eth0 its address back (netstack takes it over from the previous sandbox)."""
        run(["ip", "-n", net.netns, "addr", "replace", f"{net.guest_ip}/30", "dev", "eth0"])
        run(["ip", "-n", net.netns, "route", "replace", "default", "via", net.host_ip])

    def run_once(self, cid: str, rootfs: Path) -> None:
        """`runsc run` of `true` in the foreground, until it has exited."""
        bundle_dir = self.bundle(cid, ("/bin/true",), rootfs)
        self.containers.add(cid)
        with (bundle_dir / "console.log").open("ab") as log:
            start = self.command("run", "--bundle", str(bundle_dir), cid)
            proc = run(self.in_private_netfs(start), check=False, stdout=log, stderr=log)
        if proc.returncode != 0:
            tail = (bundle_dir / "console.log").read_text(errors="replace")[-1500:]
            raise RuntimeError(f"runsc run {cid} exited {proc.returncode}: {tail}")

    def start_detached(self, cid: str, rootfs: Path, init: Init = SLEEP) -> None:
        bundle_dir = self.bundle(cid, init[0], rootfs, env=init[1])
        self.containers.add(cid)
        with (bundle_dir / "console.log").open("ab") as log:
            start = self.command(
                "run", "--detach", "--bundle", str(bundle_dir),
                "--pid-file", str(bundle_dir / "sandbox.pid"), cid,
            )  # fmt: skip
            proc = run(self.in_private_netfs(start), check=False, stdout=log, stderr=log)
        if proc.returncode != 0:
            tail = (bundle_dir / "console.log").read_text(errors="replace")[-1500:]
            raise RuntimeError(f"runsc run --detach {cid} exited {proc.returncode}: {tail}")

    def checkpoint(self, cid: str, image_dir: Path, *, leave_running: bool = False) -> None:
        """`runsc checkpoint` into `image_dir`, in a private mount namespace as aenv runs it."""
        args = ["checkpoint", "--image-path", str(image_dir), "--compression", self.compression]
        if leave_running:
            args.append("--leave-running")
        run(self.in_private_netfs(self.command(*args, cid)))

    def prepare_restore(
        self, cid: str, rootfs: Path, image_dir: Path, net: FloorNet, init: Init = SLEEP
    ) -> tuple[list[str], Path]:
        """The bundle (same rootfs) and command of a `runsc restore --detach` into `net`."""
        bundle_dir = self.bundle(cid, init[0], rootfs, net, env=init[1])
        self.reset_guest_address(net)
        cmd = self.command(
            "restore", "--image-path", str(image_dir), "--detach", "--bundle", str(bundle_dir),
            "--pid-file", str(bundle_dir / "sandbox.pid"), cid,
        )  # fmt: skip
        return self.in_private_netfs(cmd), bundle_dir

    def restore_all(
        self, prepared: list[tuple[str, list[str], Path]], limit: int | None = None
    ) -> list[float]:
        """Run the prepared restores concurrently (at most `limit` at once, in
        order); return once all have (raise if one failed), with when each
        ended (`time.perf_counter()`, in order)."""
        gate = threading.Semaphore(limit or len(prepared) or 1)
        ended = [0.0] * len(prepared)
        codes: list[int | None] = [None] * len(prepared)
        turns = [threading.Event() for _ in prepared]  # each starts after the one before

        def one(i: int, cid: str, cmd: list[str], bundle_dir: Path) -> None:
            if i:
                turns[i - 1].wait()
            with gate:
                try:
                    with (bundle_dir / "console.log").open("ab") as log:
                        proc = subprocess.Popen(
                            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log
                        )
                finally:
                    turns[i].set()  # (a restore that did not start: codes[i] stays None)
                try:
                    codes[i] = proc.wait(timeout=STEP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    codes[i] = proc.wait()
                ended[i] = time.perf_counter()

        for cid, _, _ in prepared:
            self.containers.add(cid)
        # one thread per restore: each one's end, not the slowest before it
        threads = [threading.Thread(target=one, args=(i, *p)) for i, p in enumerate(prepared)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = []
        for (cid, _, bundle_dir), code in zip(prepared, codes, strict=True):
            if code != 0:
                tail = (bundle_dir / "console.log").read_text(errors="replace")[-1500:]
                failed.append(f"runsc restore {cid} exited {code}: {tail}")
        if failed:
            raise RuntimeError("; ".join(failed))
        return ended

    def exec(self, cid: str, *argv: str, data: bytes | None = None) -> bytes:
        kw: dict[str, Any] = {"input": data} if data is not None else {}
        return run(self.command("exec", cid, *argv), **kw).stdout

    def delete(self, cid: str) -> None:
        run(self.command("kill", cid, "SIGKILL"), check=False, timeout=10)
        run(self.command("delete", "--force", cid), check=False, timeout=30)
        self.containers.discard(cid)

    def cleanup(self) -> None:
        for cid in sorted(self.containers):
            with contextlib.suppress(Exception):
                self.delete(cid)
        for ctl in Path("/sys/fs/cgroup").iterdir():
            parent = ctl / FLOOR_CGROUP
            if parent.is_dir():
                for child in sorted(parent.rglob("*"), reverse=True):
                    if child.is_dir():
                        with contextlib.suppress(OSError):
                            child.rmdir()
                with contextlib.suppress(OSError):
                    parent.rmdir()


@contextlib.contextmanager
def floor_network(nets: tuple[FloorNet, ...]) -> Iterator[None]:
    """Each net's netns and veth, created fresh; removed afterwards."""
    remove_floor_network(nets)
    try:
        for net in nets:
            ns = net.netns
            run(["ip", "netns", "add", ns])
            run(["ip", "link", "add", net.veth, "type", "veth", "peer", "name", "eth0",
                 "netns", ns])  # fmt: skip
            run(["ip", "addr", "add", f"{net.host_ip}/30", "dev", net.veth])
            run(["ip", "link", "set", net.veth, "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            run(["ip", "-n", ns, "addr", "add", f"{net.guest_ip}/30", "dev", "eth0"])
            run(["ip", "-n", ns, "route", "add", "default", "via", net.host_ip])
        yield
    finally:
        remove_floor_network(nets)


def remove_floor_network(nets: tuple[FloorNet, ...]) -> None:
    for net in nets:
        run(["ip", "link", "del", net.veth], check=False, timeout=15)
        run(["ip", "netns", "del", net.netns], check=False, timeout=15)


def floor_rootfs(home: Path, dest: Path) -> Path:
    """A private, writable copy of the busybox template (or of the host's static busybox)."""
    template = home / "templates" / "busybox" / "rootfs"
    dest.parent.mkdir(parents=True, exist_ok=True)
    if template.is_dir():
        run(["cp", "-a", str(template), str(dest)])
    else:
        busybox = shutil.which("busybox") or "/bin/busybox"
        for d in ("bin", "etc", "root", "tmp", "proc", "sys", "dev"):
            (dest / d).mkdir(parents=True, exist_ok=True)
        shutil.copy2(busybox, dest / "bin" / "busybox")
        run([str(dest / "bin" / "busybox"), "--install", "-s", str(dest / "bin")])
    (dest / "tmp").mkdir(exist_ok=True)
    os.chmod(dest / "tmp", 0o1777)
    for mountpoint in ("opt/aenv", "proc", "dev", "sys"):
        (dest / mountpoint).mkdir(parents=True, exist_ok=True)
    return dest


@contextlib.contextmanager
def envd_rootfs(home: Path, template: str, work: Path) -> Iterator[Path]:
    """The template's root filesystem under a fresh writable overlay, as aenv mounts it."""
    lower = home / "templates" / template / "rootfs"
    for d in ("upper", "work", "merged"):
        (work / d).mkdir(parents=True)
    opts = f"lowerdir={lower},upperdir={work / 'upper'},workdir={work / 'work'}"
    run(["mount", "-t", "overlay", "overlay", "-o", opts, str(work / "merged")])
    try:
        yield work / "merged"
    finally:
        run(["umount", "-l", str(work / "merged")], check=False)


def bench_floor(
    home: Path, n: int, workdir: Path, config: Config, template: str = "base"
) -> dict[str, Series]:
    results = {key: Series() for key in FLOOR_KEYS}
    results["image_bytes"].unit = results["image_bytes" + ENVD].unit = "bytes"
    flags = run([config.runsc_binary, "flags"], check=False, timeout=30)
    knows = b"-net-disconnect-ok" in flags.stdout + flags.stderr
    floor = Floor(
        home=home,
        workdir=workdir,
        runsc=config.runsc_binary,
        platform=config.runsc_platform,
        net_disconnect_ok=knows,
        compression=config.checkpoint_compression,
    )
    tag = secrets.token_hex(3)
    try:
        with floor_network((MAIN_NET, *FORK_NETS)):
            # Each foreground run gets its own copy, as each aenv sandbox gets its own upper.
            series = results["create_to_first_command"]
            for i in range(n):
                cid = f"aenvbench-run-{tag}-{i}"
                try:
                    rootfs = floor_rootfs(home, workdir / "rootfs" / cid)
                    floor.reset_guest_address()
                    t0 = time.perf_counter()
                    floor.run_once(cid, rootfs)
                except Exception as e:
                    series.error = _describe(e)
                    break
                series.samples.append((time.perf_counter() - t0) * 1000)
                floor.delete(cid)

            try:
                _floor_exec_ops(floor, home, workdir, tag, n, results)
            except Exception as e:
                _fail(results, ("command_roundtrip", "file_write_1mib", "file_read_1mib"), e)
            try:
                rootfs = floor_rootfs(home, workdir / "rootfs" / f"aenvbench-ckpt-{tag}")
                _floor_checkpoints(floor, rootfs, workdir, tag, n, results)
            except Exception as e:
                _fail(results, tuple(k for k in FLOOR_KEYS if not k.endswith(ENVD)), e)
            try:
                with envd_rootfs(home, template, workdir / "envd-root") as rootfs:
                    init = envd_command(ENVD_PORT)
                    _floor_checkpoints(floor, rootfs, workdir, tag, n, results,
                                       init=(init[0], dict(init[1])), suffix=ENVD)  # fmt: skip
            except Exception as e:
                _fail(results, tuple(k for k in FLOOR_KEYS if k.endswith(ENVD)), e)
    finally:
        floor.cleanup()
    return results


def _floor_exec_ops(
    floor: Floor, home: Path, workdir: Path, tag: str, n: int, results: dict[str, Series]
) -> None:
    cid = f"aenvbench-exec-{tag}"
    floor.reset_guest_address()
    floor.start_detached(cid, floor_rootfs(home, workdir / "rootfs" / cid))
    for _ in range(3):
        floor.exec(cid, "/bin/true")
    timed(results["command_roundtrip"], n, lambda: floor.exec(cid, "/bin/true"), _ignore)

    data = os.urandom(PAYLOAD)
    write = ("/bin/sh", "-c", f"cat > {GUEST_FILE}")

    def same(got: object) -> None:
        if got != data:
            raise AssertionError("cat returned other bytes than were written")

    floor.exec(cid, *write, data=data)
    timed(results["file_write_1mib"], n, lambda: floor.exec(cid, *write, data=data), _ignore)
    timed(results["file_read_1mib"], n, lambda: floor.exec(cid, "/bin/cat", GUEST_FILE), same)
    floor.delete(cid)


def _floor_checkpoints(
    floor: Floor,
    rootfs: Path,
    workdir: Path,
    tag: str,
    n: int,
    results: dict[str, Series],
    *,
    init: Init = SLEEP,
    suffix: str = "",
) -> None:
    """checkpoint/restore of one sandbox, over and over (as aenv's pause/resume);
    then checkpoint --leave-running (a snapshot) and that + k concurrent restores (a fork).

    Busybox running sleep (keys as they are), or the sandbox aenv runs (the
    template's root filesystem with envd as init; keys + `suffix`)."""
    images = workdir / f"images{suffix}"
    tag = f"{tag}{suffix.replace('_', '-')}"
    cid = f"aenvbench-ckpt-{tag}-0"
    floor.reset_guest_address()
    floor.start_detached(cid, rootfs, init)
    floor.exec(cid, "/bin/sh", "-c", "echo 1 > /tmp/state")
    for i in range(n):
        image = images / f"pause-{i}"
        image.mkdir(parents=True)
        t0 = time.perf_counter()
        floor.checkpoint(cid, image)
        results["checkpoint" + suffix].samples.append((time.perf_counter() - t0) * 1000)
        results["image_bytes" + suffix].samples.append(disk_bytes(image))
        floor.delete(cid)
        # a fresh container ID from the image, the same root filesystem, a netns
        # no sandbox holds (aenv restores into a new slot)
        cid = f"aenvbench-ckpt-{tag}-{i + 1}"
        cmd, bundle_dir = floor.prepare_restore(cid, rootfs, image, MAIN_NET, init)
        t0 = time.perf_counter()
        floor.restore_all([(cid, cmd, bundle_dir)])
        restored = time.perf_counter() - t0
        floor.exec(cid, "/bin/true")
        results["restore" + suffix].samples.append(restored * 1000)
        results["restore_to_first_command" + suffix].samples.append(
            (time.perf_counter() - t0) * 1000
        )
        if floor.exec(cid, "/bin/cat", "/tmp/state").strip() != b"1":
            raise AssertionError("the restored sandbox lost its file")
        shutil.rmtree(image)

    for i in range(n):
        image = images / f"snapshot-{i}"
        image.mkdir(parents=True)
        t0 = time.perf_counter()
        floor.checkpoint(cid, image, leave_running=True)
        results["checkpoint_leave_running" + suffix].samples.append(
            (time.perf_counter() - t0) * 1000
        )
        floor.exec(cid, "/bin/true")
        shutil.rmtree(image)

    for count in (1, 4):
        for i in range(n):
            image = images / f"fork{count}-{i}"
            image.mkdir(parents=True)
            children = []
            for j, net in enumerate(FORK_NETS[:count]):
                child = f"aenvbench-fork-{tag}-{count}-{i}-{j}"
                children.append((child, *floor.prepare_restore(child, rootfs, image, net, init)))
            t0 = time.perf_counter()
            floor.checkpoint(cid, image, leave_running=True)
            floor.restore_all(children)
            results[f"fork_{count}{suffix}"].samples.append((time.perf_counter() - t0) * 1000)
            for child, _, _ in children:
                floor.exec(child, "/bin/true")
                floor.delete(child)
            shutil.rmtree(image)
    floor.delete(cid)


# -- report -------------------------------------------------------------------------


def _p50(series: Series | None) -> float | None:
    return percentile(series.samples, 50) if series and series.samples else None


def _fmt(series: Series | None, q: int, scale: float = 1.0) -> str:
    if series is None:
        return "-"
    if not series.samples:
        return "error" if series.error else "-"
    return f"{percentile(series.samples, q) / scale:.{1 if scale == 1.0 else 2}f}"


def verdict(target: float | str | None, a: Series | None, f: Series | None) -> tuple[str, str]:
    """(target text, "yes"/"no"/"-") for a row."""
    mine, floor = _p50(a), _p50(f)
    if target is None:
        return "", ""
    if isinstance(target, str):
        if mine is None or floor is None:
            return f"<= {target} floor", "-"
        return f"<= {target} floor", "yes" if mine <= 1.3 * floor else "no"
    return f"<= {target:g} ms", "-" if mine is None else ("yes" if mine <= target else "no")


def _grid(rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        cells = [
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def table(aenv: dict[str, Series] | None, floor: dict[str, Series] | None) -> str:
    head = ("operation", "n", "aenv p50", "aenv p95", "floor p50", "floor p95", "x floor",
            "target (p50)", "met")  # fmt: skip
    rows = [head]
    for label, akey, fkey, target in ROWS:
        a = aenv.get(akey) if aenv and akey else None
        f = floor.get(fkey) if floor and fkey else None
        count = max(len(a.samples) if a else 0, len(f.samples) if f else 0)
        mine, base = _p50(a), _p50(f)
        ratio = f"{mine / base:.2f}" if mine is not None and base else "-"
        rows.append((label, str(count), _fmt(a, 50), _fmt(a, 95), _fmt(f, 50), _fmt(f, 95),
                     ratio, *verdict(target, a, f)))  # fmt: skip
    lines = _grid(rows)
    lines.append(
        "(milliseconds; floor = runsc alone: create, commands and files on a busybox rootfs; "
        "pause, resume, fork and snapshot on the same sandbox aenv runs (the template's "
        "rootfs with envd as init), busybox rows for reference; fork floor = checkpoint "
        "--leave-running + concurrent restores; pause freezes in memory, hibernate writes "
        "to disk)"
    )
    mib = float(1 << 20)
    brows = [("bytes per capture (MiB)", "n", "p50", "p95")]
    for label, side, key in (
        ("aenv pause after 1 MiB changed: new layer", aenv, "capture_layer_bytes"),
        ("aenv pause after 1 MiB changed: memory image", aenv, "capture_image_bytes"),
        ("floor runsc checkpoint (same sandbox): image", floor, "image_bytes" + ENVD),
        ("floor runsc checkpoint (busybox): image", floor, "image_bytes"),
    ):
        s = side.get(key) if side else None
        brows.append((label, str(len(s.samples) if s else 0), _fmt(s, 50, mib), _fmt(s, 95, mib)))
    lines += ["", *_grid(brows)]
    notes = [
        f"{side} {key}: {s.note}"
        for side, res in (("aenv", aenv), ("floor", floor))
        for key, s in (res or {}).items()
        if s.note and not key.endswith("_only")
    ]
    errors = [
        f"{side} {key}: {s.error}"
        for side, res in (("aenv", aenv), ("floor", floor))
        for key, s in (res or {}).items()
        if s.error
    ]
    return "\n".join(lines + notes + errors)


def runsc_version(binary: str) -> str:
    with contextlib.suppress(Exception):
        return run([binary, "--version"], timeout=10).stdout.decode().splitlines()[0]
    return "unknown"


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=10, help="samples per operation (default 10)")
    p.add_argument("--home", type=Path, help="built home with bundle and templates "
                   "(default $AENV_TEST_HOME, else .state/test-home)")  # fmt: skip
    p.add_argument("--template", default="base", help="template for the aenv side (default base)")
    p.add_argument("--skip-aenv", action="store_true", help="measure only the runsc floor")
    p.add_argument("--skip-floor", action="store_true", help="measure only aenv")
    args = p.parse_args(argv)
    if not 1 <= args.n <= 10_000:
        p.error("--n must be in 1..10000")
    home = bench_home(p, args.home)
    config = Config.from_env()
    if shutil.which(config.runsc_binary) is None:
        p.error(f"{config.runsc_binary} not found")
    interrupt_on_sigterm()
    started = datetime.datetime.now(datetime.UTC)
    load_start = loadavg()
    aenv_res: dict[str, Series] | None = None
    floor_res: dict[str, Series] | None = None
    workdir = Path(tempfile.mkdtemp(prefix="aenv-bench-"))
    try:
        if not args.skip_floor:
            print(f"floor: runsc ({config.runsc_platform}), n={args.n} ...", flush=True)
            floor_res = bench_floor(home, args.n, workdir / "floor", config, args.template)
        if not args.skip_aenv:
            print(f"aenv: nodes + e2b SDK, template {args.template}, n={args.n} ...", flush=True)
            (workdir / "aenv").mkdir()
            aenv_res = bench_aenv(home, args.template, args.n, workdir / "aenv")
    except (KeyboardInterrupt, Interrupted):
        print("interrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    load_end = loadavg()
    elapsed = datetime.datetime.now(datetime.UTC) - started
    print()
    print(table(aenv_res, floor_res))
    print(f"\nload average {load_start} at start, {load_end} at end; "
          f"{os.cpu_count()} CPUs; {elapsed.total_seconds():.0f} s")  # fmt: skip
    report = {
        "started": started.isoformat(),
        "seconds": round(elapsed.total_seconds(), 1),
        "n": args.n,
        "template": args.template,
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "runsc": runsc_version(config.runsc_binary),
            "runsc_platform": config.runsc_platform,
            "loadavg_start": load_start,
            "loadavg_end": load_end,
        },
        "targets": {
            (akey or fkey or label): verdict(
                target,
                aenv_res.get(akey) if aenv_res and akey else None,
                floor_res.get(fkey) if floor_res and fkey else None,
            )
            for label, akey, fkey, target in ROWS
            if target is not None
        },
        "aenv": {k: s.to_json() for k, s in (aenv_res or {}).items() if s.samples or s.error},
        "floor": {k: s.to_json() for k, s in (floor_res or {}).items() if s.samples or s.error},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {out.relative_to(REPO)}")
    failed = any(s.error for res in (aenv_res, floor_res) for s in (res or {}).values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
