"""A node defends its host state: other nodes on the host, and damage done under it.

Rules: each test runs its own nodes (never the session node), each in its own
temp home linked to AENV_TEST_HOME, with no AENV_NET_PREFIX, as a new user
starts them: their names come from their homes. Their address ranges are set
(`CIDRS`, from AENV_TEST_HOSTNET_CIDRS: /16s no other test file uses), not
picked: on a machine shared with test runs of older nodes, which claim
nothing, a picked range can be taken by one of them after the pick (picking
is tested in tests/runtimes/test_hostclaim.py). Template warm-up and the pool
are off, so a node's first sandbox has slot 0 and its second slot 1. Damage
is done only to the test node's own names (its table, a slot's chain, a
netns, a veth), never with `nft flush ruleset`, which would hit every table
on the machine. Commands run through the e2b SDK pointed at one node per
call. Loopback only. Nothing of any node may leak at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from aenv.config import Config
from aenv.proto.netstate import Claim
from aenv.runtimes.hostclaim import CLAIMS_DIR
from tests.conftest import (
    NodeProc,
    built_home,
    leaks,
    link_home,
    requires_node,
    start_node,
    stop_node,
)

pytestmark = [requires_node, pytest.mark.runsc]

CIDRS = os.environ.get(
    "AENV_TEST_HOSTNET_CIDRS", "10.252.0.0/16,10.253.0.0/16,10.254.0.0/16"
).split(",")
# as a new user starts a node: no names prefix (empty is unset)
ENV = {
    "AENV_NET_PREFIX": "",
    "AENV_SLOT_CIDR": CIDRS[0],
    "AENV_WARM_TEMPLATES": "0",
    "AENV_POOL_SIZE": "0",
}


class Nodes:
    """Nodes with homes of their own; everything they started is stopped at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.running: list[NodeProc] = []
        self.homes: list[Path] = []

    def home(self, name: str) -> Path:
        built = built_home()
        assert built is not None
        h = self.tmp / name
        h.mkdir()
        link_home(built, h)
        self.homes.append(h)
        return h

    def start(self, home: Path, **env: str) -> NodeProc:
        n = start_node(
            home,
            api_key="k" + secrets.token_hex(8),
            log_path=home / "node.log",
            extra_env={**ENV, **env},
        )
        self.running.append(n)
        return n

    def stop(self, n: NodeProc) -> None:
        self.running.remove(n)
        assert stop_node(n) == 0, n.log_tail()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    ns = Nodes(tmp_path)
    try:
        yield ns
    finally:
        for n in list(ns.running):
            with contextlib.suppress(Exception):
                print(n.log_tail())
                ns.stop(n)
        for h in ns.homes:
            left = leaks(h, prefix_of(h))
            assert not left, left


def prefix_of(home: Path) -> str:
    return Config(home=home).effective_net_prefix


def claim_of(n: NodeProc) -> Claim:
    claim = Claim.from_json((CLAIMS_DIR / f"{prefix_of(n.home)}.json").read_text())
    assert claim is not None and claim.pid == n.proc.pid
    return claim


def sdk(n: NodeProc) -> dict[str, Any]:
    return {"api_key": n.api_key, "api_url": n.url, "sandbox_url": n.url}


def run(sbx: Sandbox, word: str) -> str:
    return str(sbx.commands.run(f"echo {word}", timeout=30).stdout.strip())


def create(n: NodeProc) -> Sandbox:
    return Sandbox.create("busybox", timeout=300, **sdk(n))


def sh(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def netns_names() -> set[str]:
    return {e["name"] for e in json.loads(sh("ip", "-j", "netns", "list") or "[]")}


def chain_rules(table: str, chain: str) -> int:
    listing = json.loads(sh("nft", "-j", "list", "table", "inet", table))
    return sum(1 for o in listing["nftables"] if o.get("rule", {}).get("chain") == chain)


def metric(n: NodeProc, name: str) -> float:
    text = httpx.get(f"{n.url}/metrics", headers={"X-API-Key": n.api_key}, timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def until(what: str, cond: Callable[[], bool], within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within:g}s")
        time.sleep(0.1)


def test_a_second_node_on_the_host_leaves_the_first_nodes_sandboxes_alone(nodes: Nodes) -> None:
    home_a, home_b = nodes.home("a"), nodes.home("b")
    a = nodes.start(home_a)
    first = create(a)
    assert run(first, "one") == "one"
    pa = prefix_of(home_a)

    b = nodes.start(home_b, AENV_SLOT_CIDR=CIDRS[1])
    ca, cb = claim_of(a), claim_of(b)
    assert (ca.prefix, cb.prefix) == (pa, prefix_of(home_b)) and pa != cb.prefix
    assert (ca.cidr, cb.cidr) == (CIDRS[0], CIDRS[1])
    # the first node's sandbox, its netns, veth and table were left alone
    assert f"{pa}-0" in netns_names() and chain_rules(pa, "slot0") > 0
    assert run(first, "still") == "still"
    again = create(a)
    assert run(again, "two") == "two"
    other = create(b)
    assert run(other, "three") == "three"
    assert f"{cb.prefix}-0" in netns_names()

    # a node may not take another's range or names: it says so and does not start
    home_c = nodes.home("c")
    with pytest.raises(RuntimeError, match=r"cannot start: .*sandboxes in " + re.escape(ca.cidr)):
        nodes.start(home_c, AENV_SLOT_CIDR=ca.cidr)
    with pytest.raises(RuntimeError, match=f"uses the network names prefix '{pa}'"):
        nodes.start(home_c, AENV_NET_PREFIX=pa, AENV_SLOT_CIDR=CIDRS[2])
    with pytest.raises(RuntimeError, match=f"home {home_a} .* runs on this home already"):
        nodes.start(home_a)
    assert run(first, "after") == "after"

    other.kill()
    nodes.stop(b)
    assert run(first, "last") == "last" and run(again, "last") == "last"
    first.kill()
    again.kill()


def test_a_restarted_node_takes_its_sandboxes_back_under_the_same_names(nodes: Nodes) -> None:
    home = nodes.home("r")
    n = nodes.start(home)
    s = create(n)
    assert run(s, "before") == "before"
    claim = claim_of(n)
    nodes.running.remove(n)
    n.proc.kill()  # a crash: the claim file stays, its lock goes with the process
    n.proc.wait()
    n = nodes.start(home)
    assert claim_of(n) == Claim(prefix=claim.prefix, home=claim.home, cidr=CIDRS[0], pid=n.proc.pid)
    s = Sandbox.connect(s.sandbox_id, **sdk(n))  # the node listens on another port now
    assert run(s, "after") == "after"  # taken back: same netns, veth and address
    s.kill()


def test_the_node_repairs_its_network_under_running_sandboxes(nodes: Nodes) -> None:
    home = nodes.home("w")
    # (no spare slots: the slots' numbers are the test's)
    n = nodes.start(home, AENV_NETWORK_CHECK_INTERVAL="0.3", AENV_START_SPARES="0")
    p = prefix_of(home)
    s1 = create(n)
    assert run(s1, "up") == "up"

    def repairs(what: str) -> float:
        return metric(n, f'aenv_host_network_repairs_total{{what="{what}"}}')

    # the whole table goes (an operator flushing it, another tool)
    sh("nft", "delete", "table", "inet", p)
    until("the table is back", lambda: repairs("table") >= 1)
    assert chain_rules(p, "forward") == 5 and chain_rules(p, "slot0") == 6
    assert run(s1, "table") == "table"
    # the sandbox's own rules go
    sh("nft", "flush", "chain", "inet", p, "slot0")
    until("the slot's rules are back", lambda: repairs("slot_rules") >= 1)
    assert chain_rules(p, "slot0") == 6
    # the name of its network namespace goes (the namespace lives on in the sandbox)
    sh("ip", "netns", "del", f"{p}-0")
    until("the namespace has its name again", lambda: repairs("netns") >= 1)
    assert f"{p}-0" in netns_names()
    assert run(s1, "netns") == "netns"

    # a veth that goes takes the sandbox's network with it: that sandbox is stopped
    s2 = create(n)
    assert run(s2, "two") == "two"
    sh("ip", "link", "del", "dev", f"{p}h1")
    headers = {"X-API-Key": n.api_key}

    def gone() -> bool:
        return httpx.get(f"{n.url}/sandboxes/{s2.sandbox_id}", headers=headers).status_code == 404

    until("the sandbox without network is stopped", gone)
    r = httpx.get(f"{n.url}/sandboxes/{s2.sandbox_id}", headers=headers)
    assert "its network was removed from the host" in r.json()["message"]
    assert f"its veth {p}h1 was deleted" in r.json()["message"]
    assert metric(n, "aenv_host_network_slots_lost_total") == 1
    stopped = 'aenv_sandboxes_stopped_total{reason="network_lost"}'
    until("its teardown is done", lambda: metric(n, stopped) == 1)
    assert metric(n, "aenv_host_network_repairing") == 0
    assert run(s1, "alive") == "alive"
    s3 = create(n)
    assert run(s3, "three") == "three"
    s1.kill()
    s3.kill()


def test_a_create_mends_what_it_can_and_says_what_it_cannot(nodes: Nodes) -> None:
    home = nodes.home("c")
    # no watchdog pass in the test, and no spare slot: the next slot's number is the test's
    n = nodes.start(home, AENV_NETWORK_CHECK_INTERVAL="3600", AENV_START_SPARES="0")
    p = prefix_of(home)
    headers = {"X-API-Key": n.api_key}
    body = {"templateID": "busybox", "timeout": 120}
    sh("nft", "delete", "table", "inet", p)
    r = httpx.post(f"{n.url}/v2/sandboxes", json=body, headers=headers, timeout=120)
    assert r.status_code == 201, r.text  # the create found the damage, repaired it, went on
    assert metric(n, 'aenv_host_network_repairs_total{what="table"}') == 1
    s1 = Sandbox.connect(r.json()["sandboxID"], **sdk(n))
    assert run(s1, "mended") == "mended"

    # something in the way the node cannot mend: the next slot's namespace name taken
    sh("ip", "netns", "add", f"{p}-1")
    try:
        r = httpx.post(f"{n.url}/v2/sandboxes", json=body, headers=headers, timeout=120)
    finally:
        subprocess.run(["ip", "netns", "del", f"{p}-1"], capture_output=True)
    assert r.status_code == 500, r.text
    message = r.json()["message"]
    assert message.startswith(
        "the node's network could not be set up for the sandbox: "
        "creating its network namespace failed (ip: "
    )
    assert "\n" not in message and len(message) < 400
    s2 = create(n)  # and the node goes on
    assert run(s2, "next") == "next"
    s1.kill()
    s2.kill()


def test_a_create_from_a_spare_slot_mends_the_host_network_too(nodes: Nodes) -> None:
    home = nodes.home("m")
    n = nodes.start(home, AENV_NETWORK_CHECK_INTERVAL="3600")  # no watchdog pass
    p = prefix_of(home)
    until("a spare slot is made", lambda: f"{p}-0" in netns_names())
    sh("nft", "delete", "table", "inet", p)  # the spare's rules go with it
    s1 = create(n)
    assert metric(n, 'aenv_host_network_repairs_total{what="table"}') == 1
    assert chain_rules(p, "slot0") == 6
    assert run(s1, "mended") == "mended"
    s1.kill()
