"""`egressProxy` on the host's real path, without runsc: nft redirect, egress proxy, SOCKS5 out.

Rules: needs root, `ip`, `nft` and curl. The internet is `tests.egressnet`
(netns `{egress prefix}s`) with `tests.socksserver` on its `PROXY_IP`
(credentials u/pw; a TLS one on port 1081 with the internet's certificate);
the slots are a `HostNetwork` named from `AENV_TEST_NET_PREFIX` in the last
/24 of `AENV_TEST_SLOT_CIDR`. The "sandbox" is curl in a slot's namespace,
giving up after 5 s. A request that went through the proxy is answered
`peer=<PROXY_IP>` and leaves a `CONNECT` line in the proxy's log; one that
went direct would be answered from the node's address, which never happens.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from aenv.node.egress import EgressEvent
from aenv.proto.netpolicy import EgressPolicy
from aenv.runtimes.netns import HostNetwork
from tests.conftest import NET_PREFIX, SLOT_CIDR
from tests.egressnet import (
    NAMES,
    PROXY_IP,
    Internet,
    curl,
    internet_fixture,
    open_proxied_network,
    policy,
    socks_fixture,
)
from tests.socksserver import open_socks

pytestmark = [
    pytest.mark.runsc,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("nft") or not shutil.which("curl"),
        reason="needs root, nft and curl",
    ),
]

ALLOWED, OTHER = NAMES["allowed.test"][0], NAMES["other.test"][0]
SLOTS = str(list(ipaddress.IPv4Network(SLOT_CIDR).subnets(new_prefix=24))[-1])
CREDS = {"username": "u", "password": "pw"}


internet = internet_fixture("s")
socks = socks_fixture()


@asynccontextmanager
async def proxied(events: list[EgressEvent]) -> AsyncIterator[HostNetwork]:
    async with open_proxied_network(prefix=NET_PREFIX + "q", slots=SLOTS, events=events) as p:
        yield p.network


async def test_traffic_leaves_through_the_proxy(internet: Internet, socks: Path) -> None:
    events: list[EgressEvent] = []
    proxy = {"address": f"{PROXY_IP}:1080", **CREDS}
    async with proxied(events) as network:
        async with network.open_slot(policy(egressProxy=proxy)) as slot:
            out = await curl(slot, internet.ca_pem, f"http://{OTHER}/")
            assert out.startswith(f"from {OTHER} ") and out.endswith(f"peer={PROXY_IP}")
        only = policy(allowOut=["allowed.test", OTHER], denyOut=["0.0.0.0/0"], egressProxy=proxy)
        async with network.open_slot(only) as slot:
            out = await curl(slot, internet.ca_pem, "https://allowed.test/")
            assert "sni=allowed.test" in out and out.endswith(f"peer={PROXY_IP}")
            # an allowOut address goes through the proxy too, by address
            assert (await curl(slot, internet.ca_pem, f"http://{OTHER}/")).endswith(
                f"peer={PROXY_IP}"
            )
            # filtering comes first: a denied host never reaches the proxy
            assert await curl(slot, internet.ca_pem, "https://cdn.test/") == "refused"
    log = (await trio.Path(socks).read_text()).splitlines()
    assert log == [
        f"CONNECT {OTHER} 80 user=u ok",
        "CONNECT allowed.test 443 user=u ok",  # by name: the node verified it
        f"CONNECT {OTHER} 80 user=u ok",
    ]
    assert [e.allowed for e in events] == [True, True, True, False]


async def test_fails_closed(internet: Internet, socks: Path, tmp_path: Path) -> None:
    events: list[EgressEvent] = []
    wrong = {"address": f"{PROXY_IP}:1080", "username": "u", "password": "nope"}
    async with proxied(events) as network:
        async with network.open_slot(policy(egressProxy=wrong)) as slot:
            assert await curl(slot, internet.ca_pem, f"http://{OTHER}/") == "refused"
        nobody = {"address": f"{PROXY_IP}:1099"}  # nothing listens there
        async with network.open_slot(policy(egressProxy=nobody)) as slot:
            assert await curl(slot, internet.ca_pem, f"https://{OTHER}/") == "refused"
            # and without a proxy the same request goes straight out (the check can fail)
            await network.set_policy(slot, EgressPolicy())
            assert (await curl(slot, internet.ca_pem, f"http://{OTHER}/")).startswith("from ")
    assert (await trio.Path(socks).read_text()).splitlines() == ["AUTH-FAILED user=u"]
    assert all("egress proxy" in e.reason for e in events)


async def test_tls_to_the_proxy(internet: Internet, tmp_path: Path) -> None:
    events: list[EgressEvent] = []
    log = tmp_path / "tls.log"
    ca = await trio.Path(internet.ca_pem).read_text()
    with open_socks(
        internet.netns,
        PROXY_IP,
        log,
        port=1081,
        names=NAMES,
        user="u",
        password="pw",
        cert=internet.cert,
        key=internet.key,
    ):
        tls = {"address": f"{PROXY_IP}:1081", **CREDS, "tls": {"enabled": True, "caCert": ca}}
        async with proxied(events) as network, network.open_slot(policy(egressProxy=tls)) as slot:
            out = await curl(slot, internet.ca_pem, f"http://{OTHER}/")
            assert out.endswith(f"peer={PROXY_IP}")
            # a proxy whose certificate the configured CA does not sign is refused
            untrusted = {**tls, "tls": {"enabled": True}}
            await network.set_policy(slot, policy(egressProxy=untrusted))
            assert await curl(slot, internet.ca_pem, f"http://{OTHER}/") == "refused"
            # plaintext SOCKS5 to a TLS port is not SOCKS5: refused, never direct
            await network.set_policy(slot, policy(egressProxy={**tls, "tls": None}))
            assert await curl(slot, internet.ca_pem, f"http://{OTHER}/") == "refused"
    assert (await trio.Path(log).read_text()).splitlines() == [f"CONNECT {OTHER} 80 user=u ok"]
