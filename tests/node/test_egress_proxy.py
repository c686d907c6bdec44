"""The egress proxy on the host's real path, without runsc: nftables redirect, SNI/Host, resolver.

Rules: needs root, `ip`, `nft` and curl. The internet is `tests.egressnet`
(netns `aenvcip` by default); the slots are a `HostNetwork` with prefix `aenvcp` in (by default)
10.232.202.0/24 whose table carries the proxy's port; the proxy runs in the
test's trio loop and asks the internet's resolver. The "sandbox" is curl in
a slot's namespace (the kernel's netstack; gVisor's sits behind the same
rules), giving up after 5 s. A refused connection is reset at once.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from aenv.node.egress import (
    EgressEvent,
    EgressProxy,
)
from aenv.proto.netpolicy import EgressPolicy
from aenv.runtimes.netns import HostNetwork
from tests.egressnet import (
    NAMES,
    PREFIX,
    Internet,
    curl,
    internet_fixture,
    open_proxied_network,
    policy,
)

pytestmark = [
    pytest.mark.runsc,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("nft") or not shutil.which("curl"),
        reason="needs root, nft and curl",
    ),
]

ALLOWED, OTHER = NAMES["allowed.test"][0], NAMES["other.test"][0]
# this file's host network: its own names and range (a concurrent run sets others)
NS_PREFIX = PREFIX.removesuffix("i") + "p"
SLOTS = os.environ.get("AENV_TEST_EGRESS_SLOTS", "10.232.202.0/24")


internet = internet_fixture("p")


@asynccontextmanager
async def proxied(
    events: list[EgressEvent],
) -> AsyncIterator[tuple[HostNetwork, EgressProxy, int]]:
    async with open_proxied_network(prefix=NS_PREFIX, slots=SLOTS, events=events) as p:
        yield p.network, p.proxy, p.port


async def test_names_decide_and_addresses_must_match(internet: Internet) -> None:
    events: list[EgressEvent] = []
    only = policy(allowOut=["allowed.test"], denyOut=["0.0.0.0/0"])
    async with proxied(events) as (network, proxy, port), network.open_slot(only) as slot:
        ca = internet.ca_pem
        t0 = trio.current_time()
        assert (await curl(slot, ca, "https://allowed.test/")).startswith(f"from {ALLOWED} ")
        assert (await curl(slot, ca, "http://allowed.test/")).startswith(f"from {ALLOWED} ")
        assert await curl(slot, ca, "https://other.test/") == "refused"
        assert await curl(slot, ca, "https://allowed.test/", to=OTHER) == "refused"
        assert await curl(slot, ca, f"http://{OTHER}/", host="allowed.test") == "refused"
        assert await curl(slot, ca, f"http://{OTHER}/") == "refused"
        # the proxy itself is not a destination
        assert await curl(slot, ca, f"http://{slot.host_ip}:{port}/", host="allowed.test") == (
            "refused"
        )
        assert trio.current_time() - t0 < 10, "refusals are resets, not timeouts"
        # a live change: new connections follow the new rules at once
        await network.set_policy(slot, policy(allowOut=["other.test"], denyOut=["0.0.0.0/0"]))
        assert (await curl(slot, ca, "https://other.test/")).startswith(f"from {OTHER} ")
        assert await curl(slot, ca, "https://allowed.test/") == "refused"
        seen = [(e.host, e.ip, e.allowed, e.proto) for e in events]
        assert seen == [
            ("allowed.test", ALLOWED, True, "tls"),
            ("allowed.test", ALLOWED, True, "http"),
            ("other.test", OTHER, False, "tls"),
            ("allowed.test", OTHER, False, "tls"),
            ("allowed.test", OTHER, False, "http"),
            (None, OTHER, False, "http"),
            ("other.test", OTHER, True, "tls"),
            ("allowed.test", ALLOWED, False, "tls"),
        ]
        assert events[0].bytes_in > 0 and events[0].bytes_out > 0
        assert "not an address of allowed.test" in events[3].reason
        assert proxy.statistics()["active"] == 0


async def test_slots_without_names_never_reach_the_proxy(internet: Internet) -> None:
    events: list[EgressEvent] = []
    async with proxied(events) as (network, _, port), network.open_slot(EgressPolicy()) as slot:
        out = await curl(slot, internet.ca_pem, "https://allowed.test/", to=OTHER)
        assert out.startswith(f"from {OTHER} ")  # no name rules: nothing is checked
        assert events == []
        # the proxy's port is closed to everything but the slots' redirects
        with pytest.raises(trio.TooSlowError), trio.fail_after(1):
            await trio.open_tcp_stream("127.0.0.1", port)
