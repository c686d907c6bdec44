"""aenv benchmarks: p50/p95 of what an E2B SDK user waits for, next to the runsc floor.

One run starts a node (`python -m aenv serve`) on a free loopback port with
its own netns prefix and slot range, and times, through the real `e2b`
Python SDK: `Sandbox.create()` until a first `commands.run("true")` returns,
a `commands.run("true")` round trip through the node's proxy, and writing and
reading 1 MiB (`files.write`, `files.read(format="bytes")`). In the same run
it times the floor, the same operations done directly with `runsc` and no
aenv at all, started the way aenv's gVisor driver starts sandboxes (the
driver's OCI config, its runsc flags and platform, a private mount namespace
with a tmpfs over /proc/sys/net, `--network=sandbox` in a netns of its own
holding a veth): `runsc run` of a busybox root filesystem until its first
command (`true`) exits, `runsc exec <id> true`, and `runsc exec` of
`sh -c 'cat > f'` / `cat f` for 1 MiB. It prints a table and writes JSON to
bench/results/<timestamp>.json. Every loop is bounded, all traffic stays on
loopback or in the bench's own netns, and everything is cleaned up (node
stopped with SIGTERM, runsc containers deleted, netns and veth removed) also
when a step fails or the run is interrupted. Needs root and runsc.

    .venv/bin/python bench/run.py [--n 20] [--home DIR] [--template base]
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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from aenv.config import Config  # noqa: E402
from aenv.runtimes.base import SandboxSpec  # noqa: E402
from aenv.runtimes.gvisor import oci_config  # noqa: E402
from tests.conftest import NodeProc, leaks, start_node, stop_node  # noqa: E402

NET_PREFIX = "aenvb"
SLOT_CIDR = "10.234.0.0/16"
NODE_TAG = "bnch"
# The floor's own netns and veth (outside the node's naming and slot range).
FLOOR_NETNS = "aenvbfloor"
FLOOR_VETH = "aenvbfh"
FLOOR_HOST_IP = "10.235.0.1"
FLOOR_GUEST_IP = "10.235.0.2"
FLOOR_CGROUP = "aenvbench"
PAYLOAD = 1 << 20
GUEST_FILE = "/tmp/aenv-bench.bin"
STEP_TIMEOUT_S = 120.0
RESULTS = REPO / "bench" / "results"

OPS = (
    ("create_to_first_command", "create -> first command"),
    ("create_only", "  of which Sandbox.create"),
    ("command_roundtrip", 'commands.run("true")'),
    ("file_write_1mib", "files.write 1 MiB"),
    ("file_read_1mib", "files.read 1 MiB"),
    ("pause", "pause (full, memory)"),
    ("resume", "resume -> first command"),
    ("fork_1", "fork(count=1)"),
    ("snapshot", "create_snapshot"),
)


class Interrupted(BaseException):
    """SIGTERM arrived: unwind through every cleanup block."""


@dataclass
class Series:
    samples_ms: list[float] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n": len(self.samples_ms), "samples_ms": self.samples_ms}
        if self.samples_ms:
            out["p50_ms"] = percentile(self.samples_ms, 50)
            out["p95_ms"] = percentile(self.samples_ms, 95)
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
        series.samples_ms.append((time.perf_counter() - t0) * 1000)
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


# -- aenv through the e2b SDK -------------------------------------------------------


def bench_aenv(home: Path, template: str, n: int, workdir: Path) -> dict[str, Series]:
    results = {key: Series() for key, _ in OPS}
    node = start_node(
        home,
        api_key="aenv_bench_" + secrets.token_hex(8),
        log_path=workdir / "node.log",
        extra_env={
            "AENV_NET_PREFIX": NET_PREFIX,
            "AENV_SLOT_CIDR": SLOT_CIDR,
            "AENV_NODE_TAG": NODE_TAG,
        },
    )
    try:
        with _sdk_env(node):
            _bench_sdk(node, template, n, results)
    finally:
        code = stop_node(node)
        left = leaks(home, prefix=NET_PREFIX)
        if code != 0 or left or any(s.error for s in results.values()):
            print(f"--- node log (exit {code}) ---\n{node.log_tail(40)}", file=sys.stderr)
        if left:
            print(f"node left behind: {left}", file=sys.stderr)
    return results


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


def _bench_sdk(node: NodeProc, template: str, n: int, results: dict[str, Series]) -> None:
    from e2b import Sandbox

    series = results["create_to_first_command"]
    for _ in range(n):
        sbx = None
        t0 = time.perf_counter()
        try:
            sbx = Sandbox.create(template, timeout=300)
            created = time.perf_counter() - t0
            sbx.commands.run("true")
            elapsed = time.perf_counter() - t0
        except Exception as e:
            series.error = _describe(e)
            break
        finally:
            if sbx is not None:
                with contextlib.suppress(Exception):
                    sbx.kill()
        series.samples_ms.append(elapsed * 1000)
        results["create_only"].samples_ms.append(created * 1000)

    rest = (
        "command_roundtrip",
        "file_write_1mib",
        "file_read_1mib",
        "pause",
        "resume",
        "fork_1",
        "snapshot",
    )
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
        _bench_snapshots(sbx, n, results)
    except Exception as e:
        _fail(results, rest, e)
    finally:
        with contextlib.suppress(Exception):
            sbx.kill()


def _bench_snapshots(sbx: Any, n: int, results: dict[str, Series]) -> None:
    """Pause/resume, fork and snapshot of a sandbox running a counter loop."""
    from e2b import Sandbox

    sbx.commands.run(
        "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.1; done", background=True
    )
    for _ in range(n):
        t0 = time.perf_counter()
        sbx.pause()
        results["pause"].samples_ms.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        back = Sandbox.connect(sbx.sandbox_id, timeout=600)
        back.commands.run("true")
        results["resume"].samples_ms.append((time.perf_counter() - t0) * 1000)
    for _ in range(n):
        t0 = time.perf_counter()
        children = sbx.fork(count=1, timeout=120)
        results["fork_1"].samples_ms.append((time.perf_counter() - t0) * 1000)
        for c in children:
            if isinstance(c, Exception):
                raise c
            c.kill()
    for _ in range(n):
        t0 = time.perf_counter()
        info = sbx.create_snapshot()
        results["snapshot"].samples_ms.append((time.perf_counter() - t0) * 1000)
        Sandbox.delete_snapshot(info.snapshot_id)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


def _fail(results: dict[str, Series], keys: tuple[str, ...], e: Exception) -> None:
    """Record `e` on every series in `keys` that has neither samples nor an error yet."""
    for key in keys:
        if results[key].error is None and not results[key].samples_ms:
            results[key].error = _describe(e)


# -- the floor: runsc without aenv ------------------------------------------------


@dataclass
class Floor:
    """runsc set up as aenv's gVisor driver does it, with nothing of aenv running."""

    home: Path
    workdir: Path
    runsc: str
    platform: str
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
            *args,
        ]  # fmt: skip

    @staticmethod
    def in_private_netfs(cmd: list[str]) -> list[str]:
        script = "mount -t tmpfs -o size=4k aenv-netfs /proc/sys/net && exec " + shlex.join(cmd)
        return ["unshare", "--mount", "--propagation", "slave", "sh", "-c", script]

    def bundle(self, cid: str, argv: tuple[str, ...], rootfs: Path) -> Path:
        bundle_dir = self.workdir / "bundles" / cid
        bundle_dir.mkdir(parents=True)
        spec = SandboxSpec(
            sandbox_id=cid,
            rootfs=rootfs,
            bundle=self.home / "bundle",
            netns_path=Path("/run/netns") / FLOOR_NETNS,
            cpu_count=2,
            memory_mb=512,
            hostname="sandbox",
            workdir=bundle_dir,
            log_path=bundle_dir / "console.log",
            init_argv=argv,
        )
        config = oci_config(spec, cgroups_path=f"/{FLOOR_CGROUP}/{cid}")
        (bundle_dir / "config.json").write_text(json.dumps(config, indent=1))
        return bundle_dir

    def reset_guest_address(self) -> None:
        """Give eth0 its address back (netstack takes it over from the previous sandbox)."""
        run(["ip", "-n", FLOOR_NETNS, "addr", "replace", f"{FLOOR_GUEST_IP}/30", "dev", "eth0"])
        run(["ip", "-n", FLOOR_NETNS, "route", "replace", "default", "via", FLOOR_HOST_IP])

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

    def start_detached(self, cid: str, rootfs: Path) -> None:
        bundle_dir = self.bundle(cid, ("/bin/sleep", "3600"), rootfs)
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
def floor_network() -> Iterator[None]:
    """A netns holding one end of a veth, as an aenv network slot has; removed afterwards."""
    remove_floor_network()
    try:
        run(["ip", "netns", "add", FLOOR_NETNS])
        run(["ip", "link", "add", FLOOR_VETH, "type", "veth", "peer", "name", "eth0",
             "netns", FLOOR_NETNS])  # fmt: skip
        run(["ip", "addr", "add", f"{FLOOR_HOST_IP}/30", "dev", FLOOR_VETH])
        run(["ip", "link", "set", FLOOR_VETH, "up"])
        run(["ip", "-n", FLOOR_NETNS, "link", "set", "lo", "up"])
        run(["ip", "-n", FLOOR_NETNS, "link", "set", "eth0", "up"])
        run(["ip", "-n", FLOOR_NETNS, "addr", "add", f"{FLOOR_GUEST_IP}/30", "dev", "eth0"])
        run(["ip", "-n", FLOOR_NETNS, "route", "add", "default", "via", FLOOR_HOST_IP])
        yield
    finally:
        remove_floor_network()


def remove_floor_network() -> None:
    run(["ip", "link", "del", FLOOR_VETH], check=False, timeout=15)
    run(["ip", "netns", "del", FLOOR_NETNS], check=False, timeout=15)


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


def bench_floor(home: Path, n: int, workdir: Path, config: Config) -> dict[str, Series]:
    results = {key: Series() for key, _ in OPS}
    floor = Floor(
        home=home, workdir=workdir, runsc=config.runsc_binary, platform=config.runsc_platform
    )
    tag = secrets.token_hex(3)
    try:
        with floor_network():
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
                series.samples_ms.append((time.perf_counter() - t0) * 1000)
                floor.delete(cid)

            try:
                _floor_exec_ops(floor, home, workdir, tag, n, results)
            except Exception as e:
                _fail(results, ("command_roundtrip", "file_write_1mib", "file_read_1mib"), e)
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


# -- report -------------------------------------------------------------------------


def _fmt(series: Series | None, q: int) -> str:
    if series is None:
        return "-"
    if not series.samples_ms:
        return "error" if series.error else "-"
    return f"{percentile(series.samples_ms, q):.1f}"


def table(aenv: dict[str, Series] | None, floor: dict[str, Series] | None) -> str:
    head = ("operation", "n", "aenv p50", "aenv p95", "floor p50", "floor p95")
    rows = [head]
    for key, label in OPS:
        a = aenv.get(key) if aenv else None
        f = floor.get(key) if floor else None
        count = max(len(a.samples_ms) if a else 0, len(f.samples_ms) if f else 0)
        rows.append((label, str(count), _fmt(a, 50), _fmt(a, 95), _fmt(f, 50), _fmt(f, 95)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for j, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("(milliseconds; floor = runsc alone, busybox rootfs)")
    errors = [
        f"{side} {key}: {s.error}"
        for side, res in (("aenv", aenv), ("floor", floor))
        for key, s in (res or {}).items()
        if s.error
    ]
    return "\n".join(lines + errors)


def runsc_version(binary: str) -> str:
    with contextlib.suppress(Exception):
        return run([binary, "--version"], timeout=10).stdout.decode().splitlines()[0]
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=20, help="samples per operation (default 20)")
    p.add_argument("--home", type=Path, help="node home with bundle and templates "
                   "(default $AENV_TEST_HOME, else .state/test-home)")  # fmt: skip
    p.add_argument("--template", default="base", help="template for the aenv side (default base)")
    p.add_argument("--skip-aenv", action="store_true", help="measure only the runsc floor")
    p.add_argument("--skip-floor", action="store_true", help="measure only aenv")
    args = p.parse_args(argv)
    if not 1 <= args.n <= 10_000:
        p.error("--n must be in 1..10000")
    if os.geteuid() != 0:
        p.error("must run as root (runsc, network namespaces)")
    home = (
        args.home or Path(os.environ.get("AENV_TEST_HOME") or REPO / ".state/test-home")
    ).resolve()
    if not (home / "bundle").is_dir() or not (home / "templates").is_dir():
        p.error(f"{home} has no bundle/ and templates/; build it with `make test-artefacts`")
    config = Config.from_env()
    if shutil.which(config.runsc_binary) is None:
        p.error(f"{config.runsc_binary} not found")

    def on_sigterm(signum: int, frame: object) -> None:
        raise Interrupted(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)
    started = datetime.datetime.now(datetime.UTC)
    aenv_res: dict[str, Series] | None = None
    floor_res: dict[str, Series] | None = None
    workdir = Path(tempfile.mkdtemp(prefix="aenv-bench-"))
    try:
        if not args.skip_floor:
            print(f"floor: runsc ({config.runsc_platform}), n={args.n} ...", flush=True)
            floor_res = bench_floor(home, args.n, workdir / "floor", config)
        if not args.skip_aenv:
            print(f"aenv: node + e2b SDK, template {args.template}, n={args.n} ...", flush=True)
            (workdir / "aenv").mkdir()
            aenv_res = bench_aenv(home, args.template, args.n, workdir / "aenv")
    except (KeyboardInterrupt, Interrupted):
        print("interrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(table(aenv_res, floor_res))
    report = {
        "started": started.isoformat(),
        "n": args.n,
        "template": args.template,
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "runsc": runsc_version(config.runsc_binary),
            "runsc_platform": config.runsc_platform,
        },
        "aenv": {k: s.to_json() for k, s in (aenv_res or {}).items() if s.samples_ms or s.error},
        "floor": {k: s.to_json() for k, s in (floor_res or {}).items() if s.samples_ms or s.error},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {out.relative_to(REPO)}")
    failed = any(s.error for res in (aenv_res, floor_res) for s in (res or {}).values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
