"""Network slots and egress policy on a real host: netns, veths, nftables.

Rules: needs root, `ip` and `nft`. Everything this file creates is named with
the test prefix `aenvn` (netns `aenvn-N`, veths `aenvnhN`) and the nft table
`aenvntest`, so neither a node running with the default `aenv` names nor the
gVisor runtime tests (`aenvtest-*`, `aenvth*`) are touched; cleanup matches
exact name shapes, never a bare prefix.
The "internet" is a test netns `aenvn-inet` on its own veth (`aenvni0`) holding
198.51.100.1/24 (TEST-NET-2) plus 10.99.0.1 and 192.168.99.1 on its loopback,
routed from the host; no real external address is ever contacted. Plain
processes run in the slot netns with `ip netns exec` (the kernel's netstack;
gVisor's netstack sits behind the same host rules). A blocked connection is a
connect that times out after 1 s. Every test starts and ends with no
`aenvn*` state on the host, also when it fails.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio

from aenv.proto.netpolicy import EgressPolicy
from aenv.runtimes.netns import (
    HostNetwork,
    NetSlot,
    NetworkSetupError,
    NoFreeSlot,
    open_host_network,
)

pytestmark = pytest.mark.runsc

PREFIX = "aenvn"
TABLE = "aenvntest"
CIDR = "10.232.0.0/16"
INET_NS = "aenvn-inet"
INET_LINK = "aenvni0"
INET_IP = "198.51.100.1"
INET_HOST_IP = "198.51.100.254"  # the host's end of the fake internet link
PRIVATE_BEHIND_INET = ("10.99.0.1", "192.168.99.1")
PORT = 8080
CONNECT_TIMEOUT_S = 1.0

# Accepts on every given address (same port) and answers with the peer's IP.
SERVER = r"""
import socket, sys, threading
port = int(sys.argv[1])
socks = []
for addr in sys.argv[2:]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(64)
    port = s.getsockname()[1]
    socks.append(s)
def serve(s):
    while True:
        c, peer = s.accept()
        with c:
            c.sendall(peer[0].encode() + b"\n")
for s in socks:
    threading.Thread(target=serve, args=(s,), daemon=True).start()
print(port, flush=True)
threading.Event().wait()
"""

# `python -m http.server` resolves its own address (DNS, which a slot cannot
# reach from here); a plain TCPServer does not.
HTTP_SERVER = r"""
import functools, http.server, socketserver, sys
handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[2])
socketserver.TCPServer((sys.argv[1], 8000), handler).serve_forever()
"""

PROBE = r"""
import errno, socket, sys
ip, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    with socket.create_connection((ip, port), timeout=timeout) as c:
        c.settimeout(timeout)
        print("ok:" + c.recv(100).decode().strip())
except socket.timeout:
    print("blocked")
except OSError as e:
    if e.errno == errno.EHOSTUNREACH:  # the firewall's reject (admin-prohibited)
        print("blocked")
        sys.exit(0)
    print("error:" + errno.errorcode.get(e.errno or 0, str(e)))
"""


def _root_ready() -> str | None:
    import os

    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    return None


if (_why := _root_ready()) is not None:
    pytest.skip(_why, allow_module_level=True)


# -- host state helpers (sync: used in fixtures' finally) ---------------------------


def sh(*argv: str, check: bool = True) -> str:
    p = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and p.returncode != 0:
        raise RuntimeError(f"{argv}: {p.stderr.strip()}")
    return p.stdout


def netns_names() -> list[str]:
    return [e["name"] for e in json.loads(sh("ip", "-j", "netns", "list") or "[]")]


def link_names() -> list[str]:
    return [e["ifname"] for e in json.loads(sh("ip", "-j", "link", "show") or "[]")]


def table_names() -> list[str]:
    return re.findall(r"^table inet (\S+)$", sh("nft", "list", "tables", "inet"), re.M)


# Exactly the names this file creates: other test suites on this machine may
# use similar prefixes (e.g. `aenvntest-...`), and those are not ours to touch.
OUR_NETNS = re.compile(r"^aenvn-(\d+|inet|keep)$")
OUR_LINKS = re.compile(r"^aenvn(h\d+|i0|p\d+)$")


def leftovers() -> list[str]:
    return (
        [f"netns {n}" for n in netns_names() if OUR_NETNS.match(n)]
        + [f"link {n}" for n in link_names() if OUR_LINKS.match(n)]
        + [f"table {t}" for t in table_names() if t == TABLE]
    )


def force_cleanup() -> None:
    for name in link_names():
        if OUR_LINKS.match(name):
            sh("ip", "link", "del", "dev", name, check=False)
    for name in netns_names():
        if OUR_NETNS.match(name):
            sh("ip", "netns", "del", name, check=False)
    if TABLE in table_names():
        sh("nft", "delete", "table", "inet", TABLE, check=False)


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    force_cleanup()
    try:
        yield
        left = leftovers()
        assert not left, f"test left host state behind: {left}"
    finally:
        force_cleanup()


# -- processes in namespaces --------------------------------------------------------


def in_netns(netns: str | None, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", netns, *argv] if netns else list(argv)


@asynccontextmanager
async def serving(netns: str | None, port: int, *addrs: str) -> AsyncIterator[int]:
    """Run SERVER (in `netns`, or on the host) until the block ends; yield its port."""
    argv = in_netns(netns, sys.executable, "-c", SERVER, str(port), *addrs)
    async with trio.open_nursery() as nursery:
        proc = await nursery.start(
            partial(trio.run_process, argv, stdout=subprocess.PIPE, check=False)
        )
        line = b""
        with trio.fail_after(10):
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(100)
                if not chunk:
                    raise RuntimeError(f"server {argv} exited")
                line += chunk
        try:
            yield int(line)
        finally:
            nursery.cancel_scope.cancel()


async def probe(netns: str, ip: str, port: int = PORT) -> str:
    """Connect from `netns` to ip:port: 'ok:<ip the server saw>', 'blocked' or 'error:E...'."""
    argv = in_netns(netns, sys.executable, "-c", PROBE, ip, str(port), str(CONNECT_TIMEOUT_S))
    p = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    return str(p.stdout.decode().strip() or p.stderr.decode().strip())


async def connect_from_host(ip: str, port: int, payload: bytes = b"") -> bytes:
    with trio.fail_after(3):
        stream = await trio.open_tcp_stream(ip, port)
        async with stream:
            if payload:
                await stream.send_all(payload)
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
            return data


# -- fixtures ------------------------------------------------------------------------


@pytest.fixture
async def hostnet() -> AsyncIterator[HostNetwork]:
    async with open_host_network(prefix=PREFIX, table=TABLE, cidr=CIDR) as hn:
        yield hn
    # Leaving removed everything (checked again by no_leaks).
    assert [x for x in leftovers() if "inet" not in x] == []


@pytest.fixture
async def internet() -> AsyncIterator[str]:
    """The fake internet host at 198.51.100.1, serving on PORT; yields its IP."""
    try:
        sh("ip", "netns", "add", INET_NS)
        sh("ip", "link", "add", INET_LINK, "type", "veth", "peer", "name", "eth0", "netns", INET_NS)
        sh("ip", "addr", "add", f"{INET_HOST_IP}/24", "dev", INET_LINK)
        sh("ip", "link", "set", "dev", INET_LINK, "up")
        sh("ip", "-n", INET_NS, "addr", "add", f"{INET_IP}/24", "dev", "eth0")
        sh("ip", "-n", INET_NS, "link", "set", "dev", "eth0", "up")
        sh("ip", "-n", INET_NS, "link", "set", "dev", "lo", "up")
        for ip in PRIVATE_BEHIND_INET:
            sh("ip", "-n", INET_NS, "addr", "add", f"{ip}/32", "dev", "lo")
            sh("ip", "route", "add", f"{ip}/32", "via", INET_IP, "dev", INET_LINK)
        async with serving(INET_NS, PORT, "0.0.0.0"):
            yield INET_IP
    finally:
        sh("ip", "link", "del", "dev", INET_LINK, check=False)
        sh("ip", "netns", "del", INET_NS, check=False)


# -- tests ---------------------------------------------------------------------------


async def test_slot_layout_and_host_reaches_sandbox(hostnet: HostNetwork, tmp_path: Path) -> None:
    (tmp_path / "hello.txt").write_text("hello from the slot\n")
    async with hostnet.open_slot(EgressPolicy()) as a, hostnet.open_slot(EgressPolicy()) as b:
        assert (a.index, a.host_ip, a.sandbox_ip, a.prefix_len) == (
            0,
            "10.232.0.1",
            "10.232.0.2",
            30,
        )
        assert (b.index, b.host_ip, b.sandbox_ip) == (1, "10.232.0.5", "10.232.0.6")
        assert (a.netns_name, a.host_veth) == ("aenvn-0", "aenvnh0")
        assert a.netns_path == Path("/run/netns/aenvn-0") and a.netns_path.exists()
        assert {"aenvn-0", "aenvn-1"} <= set(netns_names())
        assert {"aenvnh0", "aenvnh1"} <= set(link_names())
        # No IPv6 address anywhere in the slot, no link-local either.
        addrs = json.loads(sh("ip", "-n", a.netns_name, "-j", "addr", "show", "dev", "eth0"))
        families = {i["family"] for i in addrs[0]["addr_info"]}
        assert families == {"inet"}
        assert "default via 10.232.0.1" in sh("ip", "-n", a.netns_name, "route")

        argv = in_netns(
            a.netns_name, sys.executable, "-c", HTTP_SERVER, a.sandbox_ip, str(tmp_path)
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(trio.run_process, argv, check=False, capture_stderr=True))
            with trio.fail_after(10):
                while True:
                    try:
                        body = await connect_from_host(
                            a.sandbox_ip, 8000, b"GET /hello.txt HTTP/1.0\r\n\r\n"
                        )
                        break
                    except OSError:
                        await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        assert body.startswith(b"HTTP/1.0 200")
        assert body.endswith(b"hello from the slot\n")
        assert hostnet.statistics()["slots_open"] == 2
    stats = hostnet.statistics()
    assert stats["slots_open"] == 0
    assert stats["slots_opened_total"] == 2
    assert stats["slots_free"] == stats["slots_max"] == 1024
    assert not [x for x in leftovers() if x != f"table {TABLE}"]


async def test_egress_policy_to_internet_host(hostnet: HostNetwork, internet: str) -> None:
    async with hostnet.open_slot(EgressPolicy()) as slot:
        ns = slot.netns_name
        # Default: the internet is reachable and the server sees the host's address.
        assert await probe(ns, internet) == f"ok:{INET_HOST_IP}"

        steps: list[tuple[EgressPolicy, bool]] = [
            (EgressPolicy(allow_internet=False), False),
            (EgressPolicy(allow_internet=False, allow_out=("198.51.100.1/32",)), True),
            (EgressPolicy(deny_out=("198.51.100.0/24",)), False),
            (EgressPolicy(allow_out=("198.51.100.1",), deny_out=("0.0.0.0/0",)), True),
            (EgressPolicy(deny_out=("0.0.0.0/0",)), False),
            (EgressPolicy(deny_out=("203.0.113.0/24",)), True),
        ]
        for policy, reachable in steps:
            await hostnet.set_policy(slot, policy)
            assert policy.allows(internet) is reachable
            got = await probe(ns, internet)
            assert got == (f"ok:{INET_HOST_IP}" if reachable else "blocked"), policy
        assert hostnet.statistics()["policy_updates_total"] == len(steps)

    # A slot opened without internet is closed from its first packet.
    async with hostnet.open_slot(EgressPolicy(allow_internet=False)) as slot:
        assert await probe(slot.netns_name, internet) == "blocked"


async def test_host_private_ranges_and_other_sandboxes_unreachable(
    hostnet: HostNetwork, internet: str
) -> None:
    # allowOut that names everything still cannot open the always-blocked ranges.
    everything = EgressPolicy(
        allow_out=("0.0.0.0/0", "10.0.0.0/8", "192.168.0.0/16", "127.0.0.0/8", CIDR)
    )
    async with (
        hostnet.open_slot(everything) as a,
        hostnet.open_slot(EgressPolicy()) as b,
        serving(b.netns_name, PORT, b.sandbox_ip),
        serving(None, 0, a.host_ip, b.host_ip, "127.0.0.1") as host_port,
    ):
        # The listeners are up: the host reaches each of them.
        for ip, port in [
            (b.sandbox_ip, PORT),
            (a.host_ip, host_port),
            (b.host_ip, host_port),
            ("127.0.0.1", host_port),
            *((ip, PORT) for ip in PRIVATE_BEHIND_INET),
        ]:
            assert (await connect_from_host(ip, port)).strip(), ip

        targets = [
            (a.host_ip, host_port),  # the host's end of the sandbox's own veth
            (b.host_ip, host_port),  # another slot's host address
            (b.sandbox_ip, PORT),  # another sandbox
            *((ip, PORT) for ip in PRIVATE_BEHIND_INET),  # private ranges, routed
            (INET_HOST_IP, host_port),  # a host address on another interface
        ]
        results: dict[tuple[str, int], str] = {}

        async def run(ip: str, port: int) -> None:
            results[(ip, port)] = await probe(a.netns_name, ip, port)

        async with trio.open_nursery() as nursery:
            for ip, port in targets:
                nursery.start_soon(run, ip, port)
            nursery.start_soon(run, "127.0.0.1", host_port)
        for target in targets:
            assert results[target] == "blocked", (target, results)
        # 127.0.0.1 is the sandbox's own loopback: it never reaches the host's.
        assert not results[("127.0.0.1", host_port)].startswith("ok")
        # The reference decision agrees, given what the node adds to the
        # always-blocked ranges (its slot CIDR; its own addresses).
        for ip, _ in targets:
            assert not everything.allows(ip, blocked=[CIDR, f"{INET_HOST_IP}/32"])
        # The same policy still reaches the internet.
        assert await probe(a.netns_name, internet) == f"ok:{INET_HOST_IP}"


async def test_cancelled_open_leaves_nothing(hostnet: HostNetwork) -> None:
    with trio.CancelScope() as cs:
        cs.cancel()
        async with hostnet.open_slot(EgressPolicy()):
            pytest.fail("a cancelled open_slot must not yield")  # pragma: no cover
    with trio.CancelScope() as cs:
        async with hostnet.open_slot(EgressPolicy()) as slot:
            assert slot.netns_path.exists()
            cs.cancel()
            await trio.sleep_forever()
    assert not slot.netns_path.exists()
    assert [x for x in leftovers() if x != f"table {TABLE}"] == []
    nft = sh("nft", "list", "table", "inet", TABLE)
    assert "slot" not in nft.replace("slots", "")
    stats = hostnet.statistics()
    assert (stats["slots_open"], stats["slots_quarantined"], stats["cleanup_failures_total"]) == (
        0,
        0,
        0,
    )


async def test_slot_exhaustion_and_reuse_order() -> None:
    async with open_host_network(prefix=PREFIX, table=TABLE, cidr=CIDR, max_slots=2) as hn:
        async with hn.open_slot(EgressPolicy()) as a, hn.open_slot(EgressPolicy()) as b:
            assert (a.index, b.index) == (0, 1)
            with pytest.raises(NoFreeSlot):
                async with hn.open_slot(EgressPolicy()):
                    pass  # pragma: no cover
        async with hn.open_slot(EgressPolicy()) as c:
            assert c.index == 1  # b left first (inner block): freed first, reused first
    with pytest.raises(RuntimeError, match="closed"):
        async with hn.open_slot(EgressPolicy()):
            pass  # pragma: no cover


async def test_set_policy_on_closed_slot_fails(hostnet: HostNetwork) -> None:
    async with hostnet.open_slot(EgressPolicy()) as slot:
        pass
    with pytest.raises(RuntimeError, match="not open"):
        await hostnet.set_policy(slot, EgressPolicy())


async def test_exit_removes_slots_still_open() -> None:
    slot: NetSlot | None = None
    async with open_host_network(prefix=PREFIX, table=TABLE, cidr=CIDR) as hn:
        cm = hn.open_slot(EgressPolicy())
        slot = await cm.__aenter__()
    # The host network is gone although the slot's owner has not left yet.
    assert leftovers() == []
    await cm.__aexit__(None, None, None)
    assert leftovers() == []
    assert slot.index == 0


async def test_stale_state_from_a_crash_is_reaped() -> None:
    sh("ip", "netns", "add", "aenvn-7")
    sh("ip", "netns", "add", "aenvn-keep")  # not a slot name: left alone
    sh("ip", "link", "add", "aenvnh7", "type", "veth", "peer", "name", "aenvnp7")
    sh("ip", "link", "add", "aenvnh12", "type", "veth", "peer", "name", "aenvnp12")
    sh("nft", "add", "table", "inet", TABLE)
    sh("nft", "add", "chain", "inet", TABLE, "stale_chain")
    try:
        async with open_host_network(prefix=PREFIX, table=TABLE, cidr=CIDR) as hn:
            assert "aenvn-7" not in netns_names()
            assert "aenvn-keep" in netns_names()
            assert not {"aenvnh7", "aenvnp7", "aenvnh12", "aenvnp12"} & set(link_names())
            assert "stale_chain" not in sh("nft", "list", "table", "inet", TABLE)
            async with hn.open_slot(EgressPolicy()) as slot:
                assert slot.netns_path.exists()
        assert leftovers() == ["netns aenvn-keep"]
    finally:
        sh("ip", "netns", "del", "aenvn-keep", check=False)


async def test_bad_parameters_touch_nothing() -> None:
    for kwargs in (
        {"prefix": "Aenv"},
        {"prefix": "aenvtoolongname"},
        {"table": "bad table"},
        {"cidr": "10.232.0.0/30", "max_slots": 2},
        {"cidr": "fd00::/64"},
    ):
        with pytest.raises(ValueError):
            async with open_host_network(**kwargs):
                pass  # pragma: no cover
    assert leftovers() == []


# -- the watchdog: damage done under open slots, and its repair -------------------------


def chain_rules(chain: str) -> int:
    listing = json.loads(sh("nft", "-j", "list", "table", "inet", TABLE))
    return sum(1 for o in listing["nftables"] if o.get("rule", {}).get("chain") == chain)


async def test_a_deleted_table_comes_back_with_every_slots_rules(
    hostnet: HostNetwork, internet: str
) -> None:
    async with (
        hostnet.open_slot(EgressPolicy()) as open_,
        hostnet.open_slot(EgressPolicy(allow_internet=False)) as closed,
    ):
        assert (await hostnet.check()).healthy  # type: ignore[union-attr]
        sh("nft", "delete", "table", "inet", TABLE)  # as `nft flush ruleset` would
        found = await hostnet.check()
        assert found is not None and found.table == "the table is gone"
        assert chain_rules("forward") == 5 and chain_rules("slot0") == 6
        # each slot's policy holds again: the one without internet is still closed
        assert await probe(open_.netns_name, internet) == f"ok:{INET_HOST_IP}"
        assert await probe(closed.netns_name, internet) == "blocked"
        stats = hostnet.statistics()
        assert (stats["repairs_table"], stats["repairing"], stats["slots_lost_total"]) == (1, 0, 0)
        assert (await hostnet.check()).healthy  # type: ignore[union-attr]


async def test_a_slots_flushed_rules_are_added_again(hostnet: HostNetwork, internet: str) -> None:
    async with hostnet.open_slot(EgressPolicy(allow_internet=False)) as slot:
        sh("nft", "flush", "chain", "inet", TABLE, "slot0")
        found = await hostnet.check()
        assert found is not None and found.rules == {0: "chain slot0 has 0 of its 5 rules"}
        assert chain_rules("slot0") == 5
        assert await probe(slot.netns_name, internet) == "blocked"
        assert hostnet.statistics()["repairs_slot_rules"] == 1


async def test_a_deleted_namespace_name_is_given_back(hostnet: HostNetwork) -> None:
    async with hostnet.open_slot(EgressPolicy()) as slot, trio.open_nursery() as nursery:
        # a process in the namespace keeps it alive, as the sandbox's runtime does
        argv = in_netns(slot.netns_name, "sleep", "60")
        nursery.start_soon(partial(trio.run_process, argv, check=False))
        inode = slot.netns_path.stat().st_ino
        with trio.fail_after(5):
            while True:
                if sh("ip", "netns", "pids", slot.netns_name).strip():
                    break
                await trio.sleep(0.02)
        sh("ip", "netns", "del", slot.netns_name)
        assert not slot.netns_path.exists()
        found = await hostnet.check()
        assert found is not None and found.netns_gone == (0,)
        assert slot.netns_path.stat().st_ino == inode  # the same namespace, named again
        assert hostnet.statistics()["repairs_netns"] == 1
        nursery.cancel_scope.cancel()


async def test_a_slot_whose_veth_vanished_is_reported_lost_once(hostnet: HostNetwork) -> None:
    lost: list[tuple[int, str]] = []
    heard = trio.Event()

    def on_lost(slot: NetSlot, why: str) -> None:
        lost.append((slot.index, why))
        heard.set()

    async with hostnet.open_slot(EgressPolicy()) as slot, trio.open_nursery() as nursery:
        nursery.start_soon(partial(hostnet.guard, every_s=0.05, on_lost=on_lost))
        sh("ip", "link", "del", "dev", slot.host_veth)
        with trio.fail_after(5):
            await heard.wait()
        await trio.sleep(0.2)  # a few more checks: still reported once
        nursery.cancel_scope.cancel()
    assert lost == [(0, "its veth aenvnh0 was deleted")]
    assert hostnet.statistics()["slots_lost_total"] == 1
    assert hostnet.statistics()["slots_free"] == 1024  # leaving the slot freed it anyway


async def test_a_slot_opened_on_a_damaged_host_is_repaired_and_made(hostnet: HostNetwork) -> None:
    sh("nft", "delete", "table", "inet", TABLE)
    async with hostnet.open_slot(EgressPolicy()) as slot:
        assert slot.netns_path.exists() and chain_rules("slot0") == 6
        assert hostnet.statistics()["repairs_table"] == 1
    # a failure the node cannot mend is told in words
    sh("ip", "netns", "add", "aenvn-1")  # in the way of the next slot's namespace
    try:
        with pytest.raises(NetworkSetupError, match=r"^creating its network namespace failed"):
            async with hostnet.open_slot(EgressPolicy()):
                pass  # pragma: no cover
        assert hostnet.repairing is False
    finally:
        sh("ip", "netns", "del", "aenvn-1", check=False)


# -- spare slots ------------------------------------------------------------------------


async def wait_for(check: Callable[[], bool], within_s: float = 20.0) -> None:
    with trio.fail_after(within_s):
        while not check():  # noqa: ASYNC110 - the host is polled
            await trio.sleep(0.02)


async def test_spare_slots_are_handed_out_with_the_policy_asked_for(internet: str) -> None:
    lost: list[tuple[NetSlot, str]] = []
    async with (
        open_host_network(prefix=PREFIX, table=TABLE, cidr=CIDR) as hn,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(partial(hn.keep_spares, 2, quiet_s=0.05, least=2))
        nursery.start_soon(partial(hn.guard, every_s=0.1, on_lost=lambda s, w: lost.append((s, w))))
        await wait_for(lambda: hn.statistics()["slots_spare"] == 2)
        made = set(netns_names())
        async with hn.open_slot(EgressPolicy(allow_internet=False)) as closed:
            assert closed.netns_name in made  # made before it was asked for
            assert await probe(closed.netns_name, internet) == "blocked"
            async with hn.open_slot(EgressPolicy()) as open_:
                assert open_.netns_name in made
                assert await probe(open_.netns_name, internet) == f"ok:{INET_HOST_IP}"
                # the two take their rules along, and the spares are made again
                await wait_for(lambda: hn.statistics()["slots_spare"] == 2)
                assert await probe(closed.netns_name, internet) == "blocked"
        stats = hn.statistics()
        assert (stats["spares_taken_total"], stats["slots_opened_total"]) == (2, 2)
        assert stats["policy_updates_total"] == 0  # (the caller made none)
        # a spare whose veth goes is nobody's loss: it is made again
        spare = next(i for i in range(4) if f"{PREFIX}h{i}" in link_names() and i not in (
            closed.index, open_.index))  # fmt: skip
        sh("ip", "link", "del", "dev", f"{PREFIX}h{spare}")
        await wait_for(lambda: f"{PREFIX}-{spare}" not in netns_names())
        await wait_for(lambda: hn.statistics()["slots_spare"] == 2)
        assert lost == []
        nursery.cancel_scope.cancel()
    assert [x for x in leftovers() if INET_NS not in x and INET_LINK not in x] == []


async def test_slots_opened_at_once_share_rules_transactions(internet: str) -> None:
    """A burst of opens (a fork's children) writes its slots' rules in a few nft
    transactions, not one each, and every slot still gets its own policy."""
    policies = [EgressPolicy(allow_internet=i % 2 == 0) for i in range(6)]
    async with open_host_network(prefix=PREFIX, table=TABLE, cidr=CIDR) as hn:
        slots: list[NetSlot | None] = [None] * len(policies)
        async with AsyncExitStack() as stack:

            async def one(i: int) -> None:
                slots[i] = await stack.enter_async_context(hn.open_slot(policies[i]))

            async with trio.open_nursery() as nursery:
                for i in range(len(policies)):
                    nursery.start_soon(one, i)
            for slot, policy in zip(slots, policies, strict=True):
                assert slot is not None
                want = f"ok:{INET_HOST_IP}" if policy.allow_internet else "blocked"
                assert await probe(slot.netns_name, internet) == want
            assert hn.statistics()["rules_transactions_total"] < len(policies)
    assert [x for x in leftovers() if INET_NS not in x and INET_LINK not in x] == []
