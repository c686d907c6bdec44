"""A lab of real aenv nodes for the cluster tests: network namespaces, a bridge, a store, faults.

Each node is a real `python -m aenv serve` in a network namespace of its own,
and every namespace hangs off one Linux bridge in the root namespace, where
the test process runs:

    root netns: bridge aenvlbr  10.219.0.1/24   the test process, the nodes' gateway
                                10.219.0.2      the S3 store (moto, in this process)
                                203.0.113.219   the "internet" sandboxes may reach
                                203.0.113.220   internet beyond the nodes' egress cap
      aenvlu0 <-> lab0 10.219.0.10 in netns aenvl-n0: node 0 on :8000, names aenvl0,
                                                   slots 10.220.0.0/16
      aenvlu1 <-> lab0 10.219.0.11 in netns aenvl-n1: node 1 ... (10.221.0.0/16)

A node is started with `nsenter --net`, which enters its network namespace
only. `ip netns exec` would also give it a private mount namespace: the FUSE
and overlay mounts and the slot namespaces' names a node makes there are out
of sight of the next node process on the same home, so a restarted node could
not take its sandboxes back. The node makes its sandboxes' slots (netns
`aenvl{i}-N`, veths `aenvl{i}hN`, nft table `aenvl{i}`) inside its namespace;
the names of network namespaces (/run/netns), host claims (/run/aenv),
mounts, cgroups and runsc processes are global. A sandbox's egress leaves
through the node's uplink and is masqueraded to the node's lab address; the
egress cap is the lab's internet address, and nothing the lab sends may leave
the machine (the root table `aenvl` drops what the bridge would route out).

Faults live in the node's namespace, in the nft table `aenvlf` (rewritten in
one transaction from the lab's state on every change, see `render_faults`):
a partition drops packets between two nodes' addresses in both nodes, both
directions (a silent network, not a refusal); cutting a node from the store
drops its packets to and from the store's address; loss drops a share of the
packets on the node's link in each direction (`numgen random`, since this
kernel has no `sch_netem`; where it has one, `set_delay` adds latency with
netem). `kill -9`, SIGSTOP and SIGCONT go to the node process.

The names and ranges above are the defaults; a test run that shares the
machine with another one gives its lab its own with AENV_TEST_LAB_PREFIX
(`aenvl`), AENV_TEST_LAB_SUBNET (a /24), AENV_TEST_LAB_SLOTS (a /14, split
between the nodes) and AENV_TEST_LAB_INTERNET (two TEST-NET addresses from
it). One lab of a prefix runs at a time: `open_lab` takes the lock
`/run/{prefix}.lock` (waiting a while for another run's lab), and first reaps
what an earlier, crashed lab of that prefix left (`reap_leftovers`: only
names of the lab's shapes and homes under `{prefix}-lab-` temp dirs).
Closing it stops the nodes, reports what they left behind (`Lab.leaks`) and
removes everything.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

import httpx
import pytest

from tests.conftest import built_home, link_home
from tests.s3 import MotoS3

# Overridable, so two test runs on one machine each have a lab of their own (the
# prefix must be unique on the machine: everything named after it is reaped).
LAB = os.environ.get("AENV_TEST_LAB_PREFIX", "aenvl")
SUBNET = ipaddress.IPv4Network(os.environ.get("AENV_TEST_LAB_SUBNET", "10.219.0.0/24"))
SLOT_SPACE = ipaddress.IPv4Network(os.environ.get("AENV_TEST_LAB_SLOTS", "10.220.0.0/14"))
# TEST-NET-3: never routed on the internet; the next address is outside the nodes' egress cap
INTERNET_IP = os.environ.get("AENV_TEST_LAB_INTERNET", "203.0.113.219")
OFF_CAP_IP = str(ipaddress.IPv4Address(INTERNET_IP) + 1)

BRIDGE = f"{LAB}br"
ROOT_TABLE = LAB  # in the root netns: nothing from the lab leaves the machine
FAULT_TABLE = f"{LAB}f"  # in each node's netns
UPLINK = "lab0"  # a node's end of its link to the bridge (inside its netns)
GATEWAY_IP = str(SUBNET.network_address + 1)
STORE_IP = str(SUBNET.network_address + 2)
NODE_PORT = 8000
LOCK_PATH = Path(f"/run/{LAB}.lock")
LOCK_WAIT_S = 120.0  # another run's lab of the same prefix: wait for it, then give up
HOME_PREFIX = f"{LAB}-lab-"
MAX_NODES = 16
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0
# the shapes of the names the lab and its nodes make (nothing else is ever reaped)
_NETNS_RE = re.compile(rf"^{re.escape(LAB)}(-n\d+|\d+-\d+)$")
_LINK_RE = re.compile(rf"^{re.escape(LAB)}(br|u\d+)$")
_CGROUP_RE = re.compile(rf"^{re.escape(LAB)}\d+$")
if not re.fullmatch(r"[a-z][a-z0-9]{3,6}", LAB):
    raise ValueError(f"AENV_TEST_LAB_PREFIX must be 4-7 lowercase alphanumerics, not {LAB!r}")

Store = Literal["s3", "file"]

requires_lab = pytest.mark.skipif(
    os.geteuid() != 0
    or shutil.which("runsc") is None
    or shutil.which("nsenter") is None
    or built_home() is None,
    reason="needs root, runsc, nsenter and AENV_TEST_HOME built by `make test`",
)


class SdkOptions(TypedDict):
    """Keyword arguments of the e2b SDK's calls that point them at one node."""

    api_key: str
    api_url: str
    sandbox_url: str


class LabError(RuntimeError):
    """The lab cannot do what was asked (set up, a fault this kernel lacks, ...)."""


def node_ip(index: int) -> str:
    return str(SUBNET.network_address + 10 + index)


def slot_cidr(index: int, nodes: int) -> str:
    """Node `index`'s sandbox range: `SLOT_SPACE` split in 4 for up to 4 nodes, in 16 beyond."""
    split = 2 if nodes <= 4 else 4
    return str(list(SLOT_SPACE.subnets(prefixlen_diff=split))[index])


def render_faults(*, uplink: str = UPLINK, cut: Collection[str] = (), loss_pct: float = 0.0) -> str:
    """The `nft -f` script of a node namespace's fault table: it replaces the
    previous one in one transaction.

    Packets to or from an address in `cut` are dropped on the uplink; so is
    `loss_pct` percent (0.01 steps) of all packets in each direction.
    """
    if not 0 <= loss_pct <= 100:
        raise ValueError(f"loss must be 0..100 percent, not {loss_pct:g}")
    t = FAULT_TABLE
    elements = ", ".join(str(ipaddress.IPv4Address(a)) for a in sorted(cut))
    lines = [
        f"add table inet {t}",
        f"delete table inet {t}",
        f"add table inet {t}",
        f"add set inet {t} cut {{ type ipv4_addr; "
        + (f"elements = {{ {elements} }}; }}" if elements else "}"),
        # before conntrack, so a dropped packet leaves no trace in the node
        f"add chain inet {t} ingress {{ type filter hook prerouting priority raw - 10; "
        "policy accept; }",
        f"add chain inet {t} egress {{ type filter hook postrouting priority raw - 10; "
        "policy accept; }",
        f'add rule inet {t} ingress iifname "{uplink}" ip saddr @cut drop',
        f'add rule inet {t} egress oifname "{uplink}" ip daddr @cut drop',
    ]
    per_10k = round(loss_pct * 100)
    if per_10k:
        for chain, side in (("ingress", "iifname"), ("egress", "oifname")):
            lines.append(
                f'add rule inet {t} {chain} {side} "{uplink}" '
                f"numgen random mod 10000 < {per_10k} drop"
            )
    return "\n".join(lines) + "\n"


def render_root_table() -> str:
    """The root namespace's table: what the lab's nodes and sandboxes send stays on the bridge."""
    t = ROOT_TABLE
    return "\n".join(
        [
            f"add table inet {t}",
            f"delete table inet {t}",
            f"add table inet {t}",
            f"add chain inet {t} forward {{ type filter hook forward priority filter - 10; "
            "policy accept; }",
            f'add rule inet {t} forward iifname "{BRIDGE}" oifname != "{BRIDGE}" drop',
            f'add rule inet {t} forward oifname "{BRIDGE}" iifname != "{BRIDGE}" drop',
            "",
        ]
    )


# -- commands --------------------------------------------------------------------


def _run(
    argv: Sequence[str], *, input: str | None = None, check: bool = True, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        list(argv),
        input=input,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        stdin=None if input is not None else subprocess.DEVNULL,
    )
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _in_netns(netns: str, argv: Sequence[str]) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{netns}", "--", *argv]


def _netns_names() -> list[str]:
    out = _run(["ip", "-j", "netns", "list"]).stdout
    return [str(e["name"]) for e in json.loads(out or "[]") if "name" in e]


def _links(netns: str | None = None) -> list[str]:
    argv = ["ip", "-j", "link", "show"] if netns is None else ["ip", "-n", netns, "-j", "link"]
    out = _run(argv).stdout
    return [str(e["ifname"]) for e in json.loads(out or "[]") if "ifname" in e]


def _nft_tables(netns: str | None = None) -> list[str]:
    argv = ["nft", "list", "tables"]
    out = _run(argv if netns is None else _in_netns(netns, argv), check=False).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def _netns_inode(name: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return None


def _mounts_under(marker: str) -> list[str]:
    """Mount points whose path contains `marker`, deepest first."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
        if marker in point:
            found.append(point)
    return sorted(set(found), key=lambda p: (-p.count("/"), p))


def _processes(*, netns_inodes: Collection[int], marker: str) -> dict[int, str]:
    """pid -> command line of the processes in one of `netns_inodes` or whose
    command line contains `marker` (never this process)."""
    found: dict[int, str] = {}
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ino = os.stat(entry / "ns" / "net").st_ino
        except OSError:
            continue
        if ino in netns_inodes or (marker and marker in args):
            found[int(entry.name)] = args.strip()
    return found


def _cgroups(prefixes: Iterable[str]) -> list[Path]:
    """Cgroups under the nodes' parents (`/sys/fs/cgroup/{prefix}`), deepest first."""
    found: list[Path] = []
    for prefix in prefixes:
        parent = Path("/sys/fs/cgroup") / prefix
        if parent.is_dir():
            found += [Path(d) for d, _, _ in os.walk(parent)]
    return sorted(found, key=lambda p: -len(p.parts))


def reap_leftovers() -> list[str]:
    """Remove what an earlier lab left on this machine; returns what was removed.

    Only what is the lab's by name: processes in the lab's network namespaces
    (`{LAB}-nI`, `{LAB}I-N`) or running from a home under a `{LAB}-lab-`
    directory (runsc), mounts under such homes, the namespaces, the root links
    (`{LAB}br`, `{LAB}uI`), the nodes' cgroups (`{LAB}I`), the root table
    `inet {LAB}`, and the old homes in the temp dir. Call it only with the lab
    lock held.
    """
    removed: list[str] = []
    names = [n for n in _netns_names() if _NETNS_RE.match(n)]
    inodes = {ino for n in names if (ino := _netns_inode(n)) is not None}
    procs = _processes(netns_inodes=inodes, marker="/" + HOME_PREFIX)
    for pid, args in procs.items():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            removed.append(f"process {pid} {args[:100]}")
    deadline = time.monotonic() + 10
    while procs and time.monotonic() < deadline:
        procs = {p: a for p, a in procs.items() if Path(f"/proc/{p}").exists()}
        time.sleep(0.05)
    for point in _mounts_under("/" + HOME_PREFIX):
        if _run(["umount", "-l", point], check=False).returncode == 0:
            removed.append(f"mount {point}")
    for cg in _cgroups(sorted(_cgroup_parents())):
        with contextlib.suppress(OSError):
            cg.rmdir()
            removed.append(f"cgroup {cg}")
    for link in _links():
        if _LINK_RE.match(link) and _run(["ip", "link", "del", link], check=False).returncode == 0:
            removed.append(f"link {link}")
    for name in names:
        if _run(["ip", "netns", "del", name], check=False).returncode == 0:
            removed.append(f"netns {name}")
    if f"table inet {ROOT_TABLE}" in _nft_tables():
        _run(["nft", "delete", "table", "inet", ROOT_TABLE], check=False)
        removed.append(f"nft table inet {ROOT_TABLE}")
    for old in Path(tempfile.gettempdir()).glob(HOME_PREFIX + "*"):
        if _mounts_under(str(old) + "/"):
            removed.append(f"kept {old}: something is still mounted under it")
            continue  # never delete through a mount
        shutil.rmtree(old, ignore_errors=True)
        removed.append(f"dir {old}")
    return removed


def _cgroup_parents() -> set[str]:
    root = Path("/sys/fs/cgroup")
    return {p.name for p in root.iterdir() if _CGROUP_RE.match(p.name)} if root.is_dir() else set()


# -- the lab ---------------------------------------------------------------------


@dataclass
class LabNode:
    """One node of the lab; `Lab` starts, stops and faults it by `index`."""

    index: int
    node_id: str
    ip: str
    netns: str  # the node's network namespace, aenvl-n{index}
    prefix: str  # its AENV_NET_PREFIX: slot netns aenvl{index}-N, veths aenvl{index}hN
    slot_cidr: str
    home: Path
    env: dict[str, str]  # its environment beyond the test process's (changes apply at start)
    proc: subprocess.Popen[bytes] | None = None
    paused: bool = False
    # the lab's faults on this node (see `render_faults`)
    cut: set[str] = field(default_factory=set)
    loss_pct: float = 0.0
    delay_ms: float = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{NODE_PORT}"

    @property
    def api_key(self) -> str:
        return self.env["AENV_API_KEY"]

    @property
    def log_path(self) -> Path:
        return self.home / "node.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def sdk(self) -> SdkOptions:
        """Keyword arguments that point an e2b SDK call at this node
        (`Sandbox.create("base", **node.sdk())`)."""
        return {"api_key": self.api_key, "api_url": self.url, "sandbox_url": self.url}

    def sdk_env(self) -> dict[str, str]:
        """The same as environment variables (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY)."""
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": self.api_key}

    def client(self, *, timeout: float = 10.0) -> httpx.Client:
        """An HTTP client for the node's API (base URL and API key set)."""
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.api_key}, timeout=timeout)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Lab:
    """Nodes in network namespaces with a shared store; get one with `open_lab`."""

    def __init__(
        self,
        *,
        root: Path,
        nodes: int,
        store: Store,
        api_key: str,
        env: Mapping[str, str],
        node_env: Mapping[int, Mapping[str, str]],
        bare_homes: Collection[int] = (),
        cluster: bool = True,
    ) -> None:
        self.root = root
        self.cluster = cluster
        self.api_key = api_key
        self.cluster_secret = secrets.token_hex(16)
        self.store: Store = store
        self.s3: MotoS3 | None = None
        self.store_dir: Path | None = None
        self.nodes: list[LabNode] = []
        self._netem: bool | None = None
        # set by `open_lab` on leaving: each node's exit status, what the nodes left behind
        self.closed: tuple[dict[int, int], list[str]] | None = None
        self._env = dict(env)
        self._node_env = {i: dict(e) for i, e in node_env.items()}
        self._count = nodes
        self._bare = set(bare_homes)

    # -- set up and tear down ------------------------------------------------------

    def _setup(self) -> None:
        built = built_home()
        if built is None:
            raise LabError("needs AENV_TEST_HOME built by `make test` (bundle, templates)")
        self._setup_bridge()
        if self.store == "s3":
            # a bucket per lab: moto keeps every bucket for the whole test process,
            # and a lab's store holds what only its cluster secret opens (the OIDC
            # key ring, secrets), which the next lab's nodes would refuse
            self.s3 = MotoS3(bucket=f"aenv-lab-{secrets.token_hex(4)}", host=STORE_IP)
            self.s3.start()
            store_env = {**self.s3.env(), "AENV_STORE_URL": self.s3.url("cluster")}
        else:
            self.store_dir = self.root / "store"
            self.store_dir.mkdir()
            store_env = {"AENV_STORE_URL": f"file://{self.store_dir}"}
        urls = [f"http://{node_ip(i)}:{NODE_PORT}" for i in range(self._count)]
        for i in range(self._count):
            home = self.root / f"n{i}"
            home.mkdir()
            if i in self._bare:  # the node's software only: its templates must come from the store
                (home / "bundle").symlink_to(built / "bundle")
            else:
                link_home(built, home)
            env = {
                "AENV_HOME": str(home),
                "AENV_LISTEN": f"{node_ip(i)}:{NODE_PORT}",
                "AENV_API_KEY": self.api_key,
                "AENV_NODE_ID": f"node{i}",
                "AENV_NODE_TAG": f"n{i:03d}",
                "AENV_NET_PREFIX": f"{LAB}{i}",
                "AENV_SLOT_CIDR": slot_cidr(i, self._count),
                # sandboxes reach the lab's internet host and nothing else
                "AENV_EGRESS_CAP": f"{INTERNET_IP}/32",
                "AENV_REGISTRY_TIMEOUT": "3",
                "AENV_ON_STOP": "stop",
                # a lab with bare homes shares the default templates through its
                # store; the others keep each node's (no 262 MB upload per lab)
                "AENV_SHARE_DEFAULT_TEMPLATES": "auto" if self._bare else "off",
                **(
                    {  # the nodes form one cluster
                        "AENV_CLUSTER_PEERS": ",".join(u for j, u in enumerate(urls) if j != i),
                        "AENV_CLUSTER_SECRET": self.cluster_secret,
                        "AENV_ADVERTISE_URL": urls[i],
                    }
                    if self.cluster
                    else {}
                ),
                **store_env,
                **self._env,
                **self._node_env.get(i, {}),
            }
            node = LabNode(
                index=i,
                node_id=env["AENV_NODE_ID"],
                ip=node_ip(i),
                netns=f"{LAB}-n{i}",
                prefix=env["AENV_NET_PREFIX"],
                slot_cidr=env["AENV_SLOT_CIDR"],
                home=home,
                env=env,
            )
            self._setup_node_net(node)
            self.nodes.append(node)
        self.start_nodes()

    def _setup_bridge(self) -> None:
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        batch = [
            f"addr add {GATEWAY_IP}/{SUBNET.prefixlen} dev {BRIDGE}",
            f"addr add {STORE_IP}/32 dev {BRIDGE}",
            f"addr add {INTERNET_IP}/32 dev {BRIDGE}",
            f"addr add {OFF_CAP_IP}/32 dev {BRIDGE}",
            f"link set dev {BRIDGE} up",
        ]
        _run(["ip", "-batch", "-"], input="\n".join(batch) + "\n")
        _run(["nft", "-f", "-"], input=render_root_table())

    def _setup_node_net(self, node: LabNode) -> None:
        _run(["ip", "netns", "add", node.netns])
        outer = f"{LAB}u{node.index}"
        _run(
            ["ip", "-batch", "-"],
            input="\n".join(
                [
                    f"link add {outer} type veth peer name {UPLINK} netns {node.netns}",
                    f"link set dev {outer} master {BRIDGE}",
                    f"link set dev {outer} up",
                ]
            )
            + "\n",
        )
        _run(
            ["ip", "-n", node.netns, "-batch", "-"],
            input="\n".join(
                [
                    "link set dev lo up",
                    f"addr add {node.ip}/{SUBNET.prefixlen} dev {UPLINK}",
                    f"link set dev {UPLINK} up",
                    f"route add default via {GATEWAY_IP} dev {UPLINK}",
                ]
            )
            + "\n",
        )
        self._apply_faults(node)

    def close(self) -> tuple[dict[int, int], list[str]]:
        """Stop every node (SIGTERM, its sandboxes stop with it), then remove the lab.

        Returns each node's exit status and what the nodes left behind
        (`leaks`, looked at before the lab removes everything anyway).
        """
        codes: dict[int, int] = {}
        for node in self.nodes:
            if node.paused and node.proc is not None:
                node.proc.send_signal(signal.SIGCONT)
                node.paused = False
        for node in self.nodes:
            if node.running:
                assert node.proc is not None
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            if node.proc is not None:
                try:
                    codes[node.index] = node.proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    codes[node.index] = node.proc.wait()
                node.proc = None
        left = self.leaks()
        if self.s3 is not None:
            self.s3.stop()
        # then everything, whatever the nodes did
        for node in self.nodes:
            _run(["ip", "link", "del", f"{LAB}u{node.index}"], check=False)
        reap_leftovers()
        return codes, left

    # -- nodes -----------------------------------------------------------------------

    def node(self, index: int) -> LabNode:
        return self.nodes[index]

    def start_node(self, index: int, *, env: Mapping[str, str] | None = None) -> LabNode:
        """Start node `index` on its home (again, after a stop or a kill) and wait
        for its API; `env` updates its environment from this start on."""
        self.start_nodes([index], env={index: env or {}})
        return self.nodes[index]

    def start_nodes(
        self,
        indices: Iterable[int] | None = None,
        *,
        env: Mapping[int, Mapping[str, str]] | None = None,
    ) -> None:
        """Start the nodes `indices` (default: all that are not running) at once
        and wait until each answers /health."""
        chosen = [
            self.nodes[i]
            for i in (range(len(self.nodes)) if indices is None else indices)
            if not self.nodes[i].running
        ]
        for node in chosen:
            node.env.update((env or {}).get(node.index, {}))
            inherited = {
                k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "AWS_", "E2B_"))
            }
            with node.log_path.open("ab") as log:
                node.proc = subprocess.Popen(
                    _in_netns(
                        node.netns,
                        [sys.executable, "-m", "aenv", "serve", "--log-level", "info"],
                    ),
                    env={**inherited, **node.env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            node.paused = False
        deadline = time.monotonic() + START_TIMEOUT_S
        for node in chosen:
            self._wait_healthy(node, deadline)

    def _wait_healthy(self, node: LabNode, deadline: float) -> None:
        assert node.proc is not None
        while time.monotonic() < deadline:
            if node.proc.poll() is not None:
                raise LabError(
                    f"node {node.index} exited with {node.proc.returncode}:\n{node.log_tail()}"
                )
            try:
                if httpx.get(f"{node.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise LabError(f"node {node.index} did not answer /health in time:\n{node.log_tail()}")

    def stop_node(
        self, index: int, sig: int = signal.SIGTERM, *, timeout: float = STOP_TIMEOUT_S
    ) -> int:
        """Send `sig` to node `index` and wait for it to exit; returns its exit status
        (negative: the signal that ended it). A paused node is continued first."""
        node = self.nodes[index]
        if node.proc is None:
            raise LabError(f"node {index} is not running")
        if node.paused and sig != signal.SIGKILL:
            node.proc.send_signal(signal.SIGCONT)
        node.proc.send_signal(sig)
        try:
            code = node.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()
            raise
        node.proc = None
        node.paused = False
        return code

    def kill_node(self, index: int) -> None:
        """`kill -9` node `index` (its sandboxes' runsc processes live on)."""
        self.stop_node(index, signal.SIGKILL)

    def restart_node(self, index: int, sig: int = signal.SIGKILL) -> LabNode:
        """Stop node `index` with `sig` (default: a crash) and start it again on its home."""
        self.stop_node(index, sig)
        return self.start_node(index)

    def pause_node(self, index: int) -> None:
        """SIGSTOP node `index`: a node too slow to answer (the kernel still
        accepts connections on its port; nothing answers them)."""
        node = self.nodes[index]
        if node.proc is None:
            raise LabError(f"node {index} is not running")
        node.proc.send_signal(signal.SIGSTOP)
        node.paused = True

    def resume_node(self, index: int) -> None:
        """SIGCONT node `index`."""
        node = self.nodes[index]
        if node.proc is None:
            raise LabError(f"node {index} is not running")
        node.proc.send_signal(signal.SIGCONT)
        node.paused = False

    # -- network faults ----------------------------------------------------------------

    def _apply_faults(self, node: LabNode) -> None:
        script = render_faults(cut=node.cut, loss_pct=node.loss_pct)
        _run(_in_netns(node.netns, ["nft", "-f", "-"]), input=script)

    def partition(self, a: int | Iterable[int], b: int | Iterable[int]) -> None:
        """Cut every node of `a` off from every node of `b`, both ways, until `heal`.

        Packets are dropped silently in both nodes' namespaces: connections
        hang and time out, as on a real partition. The test process and the
        store still reach every node.
        """
        side_a = [a] if isinstance(a, int) else list(a)
        side_b = [b] if isinstance(b, int) else list(b)
        if set(side_a) & set(side_b):
            raise ValueError(f"a node cannot be partitioned from itself: {side_a} / {side_b}")
        changed = set()
        for x in side_a:
            for y in side_b:
                self.nodes[x].cut.add(self.nodes[y].ip)
                self.nodes[y].cut.add(self.nodes[x].ip)
                changed |= {x, y}
        for i in sorted(changed):
            self._apply_faults(self.nodes[i])

    def isolate(self, index: int) -> None:
        """Partition node `index` from every other node."""
        self.partition(index, [n.index for n in self.nodes if n.index != index])

    def heal(
        self, a: int | Iterable[int] | None = None, b: int | Iterable[int] | None = None
    ) -> None:
        """Undo `partition(a, b)`; with no arguments, every partition between nodes
        (a cut from the store stays until `restore_store`)."""
        peers = {n.ip for n in self.nodes}
        if a is None and b is None:
            for node in self.nodes:
                if node.cut & peers:
                    node.cut -= peers
                    self._apply_faults(node)
            return
        if a is None or b is None:
            raise ValueError("heal takes both sides or none")
        side_a = [a] if isinstance(a, int) else list(a)
        side_b = [b] if isinstance(b, int) else list(b)
        for x in side_a:
            for y in side_b:
                self.nodes[x].cut.discard(self.nodes[y].ip)
                self.nodes[y].cut.discard(self.nodes[x].ip)
        for i in sorted(set(side_a) | set(side_b)):
            self._apply_faults(self.nodes[i])

    def cut_store(self, index: int) -> None:
        """Partition node `index` from the S3 store (its requests hang, then time out)."""
        if self.store != "s3":
            raise LabError("a file:// store is a directory: the network cannot cut it off")
        node = self.nodes[index]
        node.cut.add(STORE_IP)
        self._apply_faults(node)

    def restore_store(self, index: int) -> None:
        """Undo `cut_store(index)`."""
        node = self.nodes[index]
        node.cut.discard(STORE_IP)
        self._apply_faults(node)

    def set_loss(self, index: int, percent: float) -> None:
        """Drop `percent` of the packets on node `index`'s link, in each direction
        (nftables `numgen random`; 0 turns it off)."""
        node = self.nodes[index]
        render_faults(loss_pct=percent)  # validates before the state changes
        node.loss_pct = percent
        self._apply_faults(node)

    @property
    def has_netem(self) -> bool:
        """Whether this kernel has `sch_netem` (for `set_delay`)."""
        if self._netem is None:
            probe = ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
            ns = self.nodes[0].netns
            self._netem = _run(_in_netns(ns, probe), check=False).returncode == 0
            if self._netem:
                _run(_in_netns(ns, ["tc", "qdisc", "del", "dev", "lo", "root"]), check=False)
        return self._netem

    def set_delay(self, index: int, ms: float, *, jitter_ms: float = 0.0) -> None:
        """Delay what node `index` sends by `ms` (tc netem on its uplink; 0 turns
        it off). Raises LabError where the kernel has no netem (`has_netem`)."""
        node = self.nodes[index]
        if ms <= 0:
            _run(_in_netns(node.netns, ["tc", "qdisc", "del", "dev", UPLINK, "root"]), check=False)
            node.delay_ms = 0.0
            return
        if not self.has_netem:
            raise LabError("this kernel has no sch_netem: delay is not available (loss is)")
        argv = ["tc", "qdisc", "replace", "dev", UPLINK, "root", "netem", "delay", f"{ms}ms"]
        if jitter_ms:
            argv.append(f"{jitter_ms}ms")
        _run(_in_netns(node.netns, argv))
        node.delay_ms = ms

    def clear_faults(self) -> None:
        """Heal every partition, reconnect the store, stop loss and delay."""
        for node in self.nodes:
            if node.delay_ms:
                self.set_delay(node.index, 0)
            if node.cut or node.loss_pct:
                node.cut.clear()
                node.loss_pct = 0.0
                self._apply_faults(node)

    def reset(self) -> None:
        """Back to a healthy lab: no faults, every node continued and running, the store up."""
        self.clear_faults()
        for node in self.nodes:
            if node.paused:
                self.resume_node(node.index)
            if node.proc is not None and node.proc.poll() is not None:
                node.proc = None  # died on its own: start it again
        if self.s3 is not None and not self.s3.running:
            self.s3.start()
        self.start_nodes()

    # -- looking from inside ----------------------------------------------------------

    def run_in(
        self, index: int, argv: Sequence[str], *, timeout: float = 30, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` in node `index`'s network namespace (not checked)."""
        return _run(
            _in_netns(self.nodes[index].netns, argv), input=input, check=False, timeout=timeout
        )

    def probe(self, src: int, url: str, *, timeout: float = 2.0) -> int | None:
        """GET `url` from node `src`'s namespace: the HTTP status, or None if no
        answer came within `timeout` seconds (refused, unreachable, silent)."""
        done = self.run_in(
            src,
            [
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                str(timeout),
                url,
            ],
            timeout=timeout + 10,
        )
        code = done.stdout.strip()
        return int(code) if done.returncode == 0 and code.isdigit() and code != "000" else None

    def reachable(self, src: int, dst: int, *, timeout: float = 2.0) -> bool:
        """Whether node `dst`'s API answers /health to node `src`."""
        return self.probe(src, f"{self.nodes[dst].url}/health", timeout=timeout) == 200

    def claim(self, sid: str) -> dict[str, Any] | None:
        """Sandbox `sid`'s ownership claim as stored (None: no claim, or no S3 store),
        read behind the nodes' backs."""
        if self.s3 is None:
            return None
        try:
            got = self.s3.boto().get_object(
                Bucket=self.s3.bucket, Key=f"cluster/cluster/sandboxes/{sid}"
            )
        except Exception:
            return None
        doc: dict[str, Any] = json.loads(got["Body"].read())
        return doc

    def leaks(self) -> list[str]:
        """What the nodes left behind that a stopped node must not: runsc processes
        and mounts of their homes, slot namespaces, veths and nft tables in the
        node namespaces, sandbox cgroups. (Meaningful once the nodes are stopped.)"""
        found: list[str] = []
        marker = str(self.root) + "/"
        procs = _processes(netns_inodes=set(), marker=marker)
        found += [f"process {pid} {args[:120]}" for pid, args in procs.items()]
        found += [f"mount {p}" for p in _mounts_under(marker)]
        names = _netns_names()
        for node in self.nodes:
            own = re.compile(rf"^{re.escape(node.prefix)}-\d+$")
            found += [f"netns {n}" for n in names if own.match(n)]
            if node.netns in names:
                veth = re.compile(rf"^{re.escape(node.prefix)}h\d+$")
                found += [f"link {n} in {node.netns}" for n in _links(node.netns) if veth.match(n)]
                found += [
                    f"nft {t} in {node.netns}"
                    for t in _nft_tables(node.netns)
                    if t != f"table inet {FAULT_TABLE}"
                ]
            found += [f"cgroup {cg}" for cg in _cgroups([node.prefix]) if cg.name != node.prefix]
        return found


@contextlib.contextmanager
def open_lab(
    *,
    nodes: int = 3,
    store: Store = "s3",
    env: Mapping[str, str] | None = None,
    node_env: Mapping[int, Mapping[str, str]] | None = None,
    bare_homes: Collection[int] = (),
    cluster: bool = True,
) -> Iterator[Lab]:
    """A running lab of `nodes` nodes sharing one store (`"s3"`: moto at
    10.219.0.2; `"file"`: one shared directory), forming one cluster unless
    `cluster` is false (independent nodes); `env` goes to every node,
    `node_env[i]` to node i (both over the lab's own settings). The homes of
    the nodes in `bare_homes` have the envd bundle but no templates; the
    others link the built test home's.

    On leaving, the nodes are stopped and the lab removed; the block's
    `Lab.closed` holds the nodes' exit statuses and leaks for the caller to check.
    """
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"a lab has 1..{MAX_NODES} nodes, not {nodes}")
    if os.geteuid() != 0:
        raise LabError("the lab needs root")
    LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LabError(
                        f"another lab with the prefix {LAB} runs on this machine (it holds "
                        f"{LOCK_PATH}); give this run its own AENV_TEST_LAB_PREFIX, "
                        "AENV_TEST_LAB_SUBNET, AENV_TEST_LAB_SLOTS and AENV_TEST_LAB_INTERNET"
                    ) from None
                time.sleep(0.5)
        reap_leftovers()
        root = Path(tempfile.mkdtemp(prefix=HOME_PREFIX))
        lab = Lab(
            root=root,
            nodes=nodes,
            store=store,
            api_key="aenv_lab_" + secrets.token_hex(8),
            env=env or {},
            node_env=node_env or {},
            bare_homes=bare_homes,
            cluster=cluster,
        )
        try:
            lab._setup()
            yield lab
        finally:
            lab.closed = lab.close()
    finally:
        os.close(lock)
