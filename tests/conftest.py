"""Shared fixtures: a real node process driven over HTTP.

Rules for tests using `node`: the node runs as a separate `aenv serve`
process on a loopback port (port 0 is not possible for a subprocess, so a
free port is picked), with `AENV_TEST_HOME` (built by `make test`: envd
bundle and templates) as its home, its own netns prefix and slot range so it
never touches a node started with `make serve`. The session ends with a leak
check: no runsc process, netns, veth, nft table or mount of that node remains.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, settings

from tests.registry import registry, registry_auth  # noqa: F401  (fixtures)

# Property tests check behaviour, never timing: no per-example deadline (a busy
# CI machine makes a 200 ms default fail at random), and no "too slow" checks.
settings.register_profile(
    "aenv", deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
settings.load_profile("aenv")

REPO = Path(__file__).resolve().parent.parent
# Overridable so two test runs on one machine never share network state.
NET_PREFIX = os.environ.get("AENV_TEST_NET_PREFIX", "aenvs")
SLOT_CIDR = os.environ.get("AENV_TEST_SLOT_CIDR", "10.233.0.0/16")
# Every test node's sandbox disk size (MiB).
TEST_DISK_MB = 512


def _dead_mounts_under(root: Path) -> list[Path]:
    """Mount points below `root` whose file system no longer answers (a FUSE
    daemon killed with its node)."""
    dead: list[Path] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        fstype = fields[fields.index("-") + 1]
        if not fstype.startswith("fuse"):
            continue
        path = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
        if not path.is_relative_to(root):
            continue
        try:
            os.stat(path)
        except OSError as e:
            if e.errno == errno.ENOTCONN:
                dead.append(path)
    return dead


def _detach_dead_mounts() -> None:
    """A test that kills a node (or an earlier run that was itself killed)
    can leave a dead FUSE mount under the temp dir; pytest's removal of old
    temp dirs then fails on it. Detach them: they serve nothing."""
    for path in sorted(_dead_mounts_under(Path(tempfile.gettempdir())), reverse=True):
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def pytest_sessionstart(session: pytest.Session) -> None:
    _detach_dead_mounts()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _detach_dead_mounts()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def built_home() -> Path | None:
    raw = os.environ.get("AENV_TEST_HOME")
    if not raw:
        return None
    home = Path(raw)
    if not (home / "bundle").is_dir() or not (home / "templates").is_dir():
        return None
    return home


@dataclass
class NodeProc:
    url: str
    api_key: str
    home: Path
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def start_node(
    home: Path,
    *,
    api_key: str,
    log_path: Path,
    extra_env: dict[str, str] | None = None,
    tls_ca: Path | None = None,
) -> NodeProc:
    """Start `aenv serve` and wait for /health; with `tls_ca` the node serves TLS
    (its AENV_TLS_* in `extra_env`) and is checked against that CA.

    The port is one the kernel had free a moment before; another socket can
    take it before the node binds it (a client's connection gets its local port
    from the same range), so a node that finds it in use is started again on
    another, at most three times."""
    for attempt in range(3):
        try:
            return _start_node_once(home, api_key, log_path, extra_env, tls_ca)
        except _PortTaken as taken:
            if attempt == 2:
                raise RuntimeError(f"node found its port in use three times:\n{taken}") from None
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    pass


def _log_since(log_path: Path, start: int) -> str:
    with log_path.open("rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace")[-4000:]


def _start_node_once(
    home: Path,
    api_key: str,
    log_path: Path,
    extra_env: dict[str, str] | None,
    tls_ca: Path | None,
) -> NodeProc:
    port = free_port()
    start = log_path.stat().st_size if log_path.exists() else 0
    env = dict(os.environ)
    env.update(
        {
            "AENV_HOME": str(home),
            "AENV_LISTEN": f"127.0.0.1:{port}",
            "AENV_API_KEY": api_key,
            "AENV_NET_PREFIX": NET_PREFIX,
            "AENV_SLOT_CIDR": SLOT_CIDR,
            "AENV_NODE_TAG": "test",
            # Sandboxes in tests reach nothing beyond this machine: only the
            # documentation range where network tests put their fake internet host.
            "AENV_EGRESS_CAP": "198.51.100.0/24",
            # Registries in tests are on loopback: a silent one is a hung one.
            "AENV_REGISTRY_TIMEOUT": "3",
            # A stopped test node leaves nothing behind (restart tests keep them).
            "AENV_ON_STOP": "stop",
            # Small disks: a test fills one in seconds (tests.e2e.test_disk).
            "AENV_SANDBOX_DISK_MB": str(TEST_DISK_MB),
        }
    )
    env.update(extra_env or {})
    logf = log_path.open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "aenv", "serve", "--log-level", "info"],
        env=env,
        stdout=logf,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    logf.close()
    url = f"{'https' if tls_ca else 'http'}://127.0.0.1:{port}"
    verify: ssl.SSLContext | bool = True
    if tls_ca is not None:
        verify = ssl.create_default_context(cafile=str(tls_ca))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = _log_since(log_path, start)
            if "Address already in use" in log:
                raise _PortTaken(log)
            raise RuntimeError(f"node exited with {proc.returncode}:\n{log}")
        try:
            if httpx.get(f"{url}/health", timeout=1, verify=verify).status_code == 200:
                return NodeProc(url, api_key, home, proc, log_path)
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"node did not answer /health in 60s:\n{log_path.read_text()[-4000:]}")


@contextlib.contextmanager
def sdk_pointed_at(url: str, api_key: str) -> Iterator[None]:
    """The e2b SDK's environment (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY)
    pointed at the node at `url` for the block; E2B_DOMAIN unset."""
    names = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")
    old = {k: os.environ.get(k) for k in names}
    os.environ.pop("E2B_DOMAIN", None)
    os.environ.update({"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": api_key})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def stop_node(node: NodeProc, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    node.proc.send_signal(sig)
    try:
        return node.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        node.proc.kill()
        node.proc.wait()
        raise


def leaks(home: Path, prefix: str | None = NET_PREFIX) -> list[str]:
    """What a stopped node on `home` left: runsc processes and mounts under it and,
    with its netns `prefix` (None: a prefix the node derived itself), namespaces,
    links, nftables tables and cgroups."""
    found: list[str] = []
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    found += [line for line in ps.splitlines() if "runsc" in line and str(home) in line]
    mounts = Path("/proc/mounts").read_text()
    found += [f"mount {line}" for line in mounts.splitlines() if str(home) in line]
    if prefix is None:
        return found
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [f"netns {line}" for line in netns.splitlines() if line.startswith(prefix + "-")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found += [
        f"link {line.split(':')[1].strip()}" for line in links.splitlines() if f" {prefix}h" in line
    ]
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    found += [f"nft {line}" for line in tables.splitlines() if line.split()[-1:] == [prefix]]
    cgroups = Path("/sys/fs/cgroup")  # the node's cgroup parent, v2 or any v1 hierarchy
    found += [f"cgroup {p}" for p in [cgroups / prefix, *cgroups.glob(f"*/{prefix}")] if p.is_dir()]
    return found


def link_home(built: Path, private: Path) -> None:
    """Give `private` the built bundle and templates without copying their data.

    The bundle is a symlink; templates are a hard-linked copy, so templates a
    test node adds (pulled images) never land in the shared built home.
    """
    (private / "bundle").symlink_to(built / "bundle")
    done = subprocess.run(
        ["cp", "-al", str(built / "templates"), str(private / "templates")],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:  # another filesystem: share it read-mostly instead
        shutil.rmtree(private / "templates", ignore_errors=True)
        (private / "templates").symlink_to(built / "templates")


requires_node = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("runsc") is None or built_home() is None,
    reason="needs root, runsc and AENV_TEST_HOME built by `make test`",
)


@contextlib.contextmanager
def private_node(
    env: dict[str, str] | None = None, *, leak_prefix: str | None = NET_PREFIX
) -> Iterator[NodeProc]:
    """A node of its own, the e2b SDK pointed at it, on a private home whose
    bundle and templates link to the built ones (a node clears its home's
    sandboxes at start, so two runs must never share one; it lives outside
    pytest's basetemp, which another pytest run on the machine may rotate away).
    On leaving, the node must stop cleanly and leave nothing (`leaks`, on
    `leak_prefix`), and its home is removed."""
    home = built_home()
    if home is None or os.geteuid() != 0:
        pytest.skip("needs root and AENV_TEST_HOME built by `make test`")
    private = Path(tempfile.mkdtemp(prefix="aenv-test-node-"))
    link_home(home, private)
    n = start_node(
        private,
        api_key="aenv_test_" + secrets.token_hex(8),
        log_path=private / "node.log",
        extra_env=env,
    )
    try:
        with sdk_pointed_at(n.url, n.api_key):
            yield n
    finally:
        code = stop_node(n)
        left = leaks(private, leak_prefix)
        if code != 0 or left:
            print(n.log_tail(), file=sys.stderr)
        assert code == 0, f"node exited with {code}"
        assert not left, f"node left behind: {left}"
        shutil.rmtree(private, ignore_errors=True)


@pytest.fixture(scope="session")
def node() -> Iterator[NodeProc]:
    with private_node() as n:
        yield n


@pytest.fixture(scope="session")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The envd bundle, built once per session (a rebuild is a hash check)."""
    from aenv.storage.bundle import build_bundle

    dest = tmp_path_factory.getbasetemp() / "aenv-bundle"
    build_bundle(dest)
    return dest


@pytest.fixture(scope="session")
def busybox_lower(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A read-only root layer of static busybox only: no libc, no Python."""
    from aenv.storage.rootfs import build_busybox_rootfs

    if not Path("/bin/busybox").exists():
        pytest.skip("needs Debian's busybox-static")
    if os.geteuid() != 0:
        pytest.skip("needs root")
    root = tmp_path_factory.getbasetemp() / "busybox-lower"
    if not (root / "bin" / "busybox").exists():
        build_busybox_rootfs(root)
        (root / "etc" / "lower-marker").write_text("from the lower layer\n")
    return root
