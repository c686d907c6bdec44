"""The egress proxy's sans-IO pieces: the name sniffer, the DNS codec and the
host-rule decision, on real bytes (ClientHellos made by Python's `ssl`).

Rules: no sockets; each case states what the proxy would do with it.
"""

from __future__ import annotations

import contextlib
import ssl

import pytest

from aenv.proto import dnswire
from aenv.proto.netpolicy import EgressPolicy
from aenv.proto.sniff import Found, Need, NoName, sniff


def client_hello(name: str) -> bytes:
    """The first flight a real TLS client sends for `name`."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    conn = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname=name)
    with contextlib.suppress(ssl.SSLWantReadError):
        conn.do_handshake()
    return outgoing.read()


def http_head(name: str, *, port: int) -> bytes:
    return f"GET / HTTP/1.1\r\nHost: {name}:{port}\r\nAccept: */*\r\n\r\n".encode()


def test_tls_server_name() -> None:
    hello = client_hello("API.Example.com")
    assert sniff(hello) == Found("api.example.com", "tls")
    assert sniff(hello[:40]) == Need()


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (http_head("example.com", port=8080), Found("example.com", "http")),
        (b"GET / HTTP/1.1\r\nhost:  Example.COM.\r\n\r\n", Found("example.com", "http")),
        (b"GET / HTTP/1.1\r\nAccept: */*\r\n", Need()),
        (b"GET / HTTP/1.1\r\n\r\n", NoName("http", "no Host header")),
        (
            b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n",
            NoName("http", "several Host headers"),
        ),
        (b"GET / HTTP/1.1\r\nHost: 192.0.2.1\r\n\r\n", NoName("http", "Host is not a host name")),
        (b"SSH-2.0-OpenSSH_9.2\r\n", NoName("other", "neither TLS nor HTTP")),
    ],
)
def test_http_host(head: bytes, expected: object) -> None:
    assert sniff(head) == expected


def test_dns_round_trip() -> None:
    q = dnswire.query("Allowed.Test", 77)
    r = dnswire.answer(q, {"allowed.test": ["192.0.2.10", "192.0.2.11"]}, ttl=30)
    ans = dnswire.parse_answer(r, 77, "allowed.test")
    assert ans.addresses == ("192.0.2.10", "192.0.2.11") and ans.ttl == 30
    missing = dnswire.parse_answer(dnswire.answer(dnswire.query("x.test", 5), {}), 5, "x.test")
    assert missing.addresses == () and missing.rcode == dnswire.RCODE_NXDOMAIN
    with pytest.raises(dnswire.DnsError):
        dnswire.parse_answer(r, 78, "allowed.test")  # not the answer to this query


ONLY = EgressPolicy.from_request(
    allow_internet_access=None,
    network={"allowOut": ["api.test", "*.cdn.test", "192.0.2.99"], "denyOut": ["0.0.0.0/0"]},
)


@pytest.mark.parametrize(
    ("ip", "name", "allowed", "verify"),
    [
        ("192.0.2.10", "api.test", True, "api.test"),  # allowed by name, if it is its address
        ("192.0.2.10", "x.y.cdn.test", True, "x.y.cdn.test"),
        ("192.0.2.10", "cdn.test", False, None),  # a wildcard does not match its apex
        ("192.0.2.10", "other.test", False, None),
        ("192.0.2.10", None, False, None),  # a raw-IP connection no CIDR allows
        ("192.0.2.99", None, True, None),  # an allowed CIDR needs no name
        ("8.8.8.8", None, True, None),  # the default resolver is opened by a name rule
        ("10.1.2.3", "api.test", False, None),  # private ranges, whatever the name
    ],
)
def test_only_these_hosts(ip: str, name: str | None, allowed: bool, verify: str | None) -> None:
    d = ONLY.decide(ip, name)
    assert (d.allowed, d.verify) == (allowed, verify)


def test_needs_name_only_where_a_name_can_change_the_verdict() -> None:
    assert ONLY.needs_name("192.0.2.10") and not ONLY.needs_name("192.0.2.99")
    deny = EgressPolicy.from_request(allow_internet_access=None, network={"denyOut": ["bad.test"]})
    assert deny.needs_name("192.0.2.10")
    assert not deny.decide("192.0.2.10", "bad.test").allowed
    assert deny.decide("192.0.2.10", "good.test").allowed
    assert deny.resolvers == ()  # dnsServers are opened only by names in allowOut
    open_ = EgressPolicy.from_request(allow_internet_access=None, network={"allowOut": ["a.test"]})
    assert not open_.needs_name("192.0.2.10")  # the internet is open: nothing to decide


def test_dns_servers() -> None:
    p = EgressPolicy.from_request(
        allow_internet_access=False, network={"allowOut": ["a.test"], "dnsServers": ["192.0.2.53"]}
    )
    assert p.resolvers == ("192.0.2.53",) and p.allows("192.0.2.53") and not p.allows("8.8.8.8")
    assert p.to_api()["dnsServers"] == ["192.0.2.53"]
    none = EgressPolicy.from_request(
        allow_internet_access=False, network={"allowOut": ["a.test"], "dnsServers": []}
    )
    assert none.resolvers == () and not none.allows("8.8.8.8")
