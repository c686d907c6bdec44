"""The SOCKS5 client core (`aenv.proto.socks5`) and `egressProxy` validation, sans-IO.

Rules: the proxy's side is written out byte by byte as RFC 1928/1929 give it;
every handshake is also fed one byte at a time, which must give the same result.
"""

from __future__ import annotations

import pytest

from aenv.proto.netpolicy import EgressPolicy, PolicyError
from aenv.proto.socks5 import Handshake, ProxyConfig, ProxyConfigError, Socks5Error

REPLY_OK = bytes([5, 0, 0, 1, 203, 0, 113, 196, 0x9C, 0x40])


def run(shake: Handshake, answers: list[bytes], *, bytewise: bool = False) -> list[bytes]:
    sent = [shake.initial()]
    for a in answers:
        chunks = [a[i : i + 1] for i in range(len(a))] if bytewise else [a]
        out = b"".join(shake.receive_data(c) for c in chunks)
        if out:
            sent.append(out)
    return sent


@pytest.mark.parametrize("bytewise", [False, True])
def test_connect_by_name_with_credentials(bytewise: bool) -> None:
    shake = Handshake("allowed.test", 443, username="u", password="pw")
    sent = run(shake, [b"\x05\x02", b"\x01\x00", REPLY_OK + b"early"], bytewise=bytewise)
    assert sent == [
        b"\x05\x02\x00\x02",
        b"\x01\x01u\x02pw",
        b"\x05\x01\x00\x03\x0callowed.test\x01\xbb",
    ]
    assert shake.done and shake.bound == ("203.0.113.196", 40000)
    assert shake.leftover == b"early"


def test_connect_by_address_without_auth() -> None:
    shake = Handshake("203.0.113.161", 80)
    sent = run(shake, [b"\x05\x00", REPLY_OK])
    assert sent == [b"\x05\x01\x00", b"\x05\x01\x00\x01\xcb\x00\x71\xa1\x00\x50"]
    assert shake.done and shake.leftover == b""


@pytest.mark.parametrize(
    ("answers", "why"),
    [
        ([b"\x05\x02", b"\x01\x01"], "rejected the username/password"),
        ([b"\x05\xff"], "none of our authentication methods"),
        ([b"\x05\x00", b"\x05\x05\x00\x01" + bytes(6)], "connection refused"),
        ([b"\x05\x00", b"\x05\x02\x00\x01" + bytes(6)], "not allowed by ruleset"),
        ([b"HTTP/1.1 400 Bad Request\r\n"], "not a SOCKS5 proxy"),
        ([b"\x05\x00", b"\x05\x00\x00\x09"], "address type 9"),
        ([b"\x05"], "closed the connection"),
    ],
)
def test_failures_are_socks5_errors(answers: list[bytes], why: str) -> None:
    shake = Handshake("a.test", 443, username="u", password="bad")
    with pytest.raises(Socks5Error, match=why):
        run(shake, [*answers, b""] if answers == [b"\x05"] else answers)
    assert not shake.done


def test_no_auth_offered_means_user_pass_is_refused() -> None:
    with pytest.raises(Socks5Error, match="did not offer"):
        run(Handshake("a.test", 443), [b"\x05\x02"])


def test_config_from_the_sdk_shape_and_masked_report() -> None:
    raw = {
        "address": "Proxy.Example.test:1080",
        "username": "user",
        "password": "s3cret",
        "tls": {
            "enabled": True,
            "serverName": "proxy.test",
            "caCert": "-----BEGIN CERTIFICATE-----x",
        },
    }
    cfg = ProxyConfig.from_request(raw)
    assert (cfg.host, cfg.port, cfg.tls, cfg.server_name) == (
        "proxy.example.test",
        1080,
        True,
        "proxy.test",
    )
    assert cfg.to_api() == {
        "address": "proxy.example.test:1080",
        "username": "user",
        "tls": {"enabled": True, "serverName": "proxy.test"},
    }
    assert "s3cret" not in repr(cfg)
    assert ProxyConfig.from_doc(cfg.to_doc()) == cfg
    assert ProxyConfig.from_request({"address": "203.0.113.196:1080"}).to_api() == {
        "address": "203.0.113.196:1080"
    }


@pytest.mark.parametrize(
    "raw",
    [
        {"address": "x"},
        {"address": "proxy.test:0"},
        {"address": "proxy.test:99999"},
        {"address": "bad host:1080"},
        {"address": "proxy.test:1080", "password": "p"},
        {"address": "proxy.test:1080", "username": "u" * 256},
        {"address": "proxy.test:1080", "tls": {"caCert": "not pem"}},
        {"address": "proxy.test:1080", "tls": True},
        "proxy.test:1080",
    ],
)
def test_bad_configs(raw: object) -> None:
    with pytest.raises(ProxyConfigError):
        ProxyConfig.from_request(raw)


def test_policy_carries_the_proxy_and_refuses_internal_addresses() -> None:
    net = {"egressProxy": {"address": "203.0.113.196:1080", "username": "u", "password": "p"}}
    policy = EgressPolicy.from_request(allow_internet_access=None, network=net)
    assert policy.tunnels and not policy.has_hosts
    assert EgressPolicy.from_doc(policy.to_doc()) == policy
    assert policy.to_api()["egressProxy"] == {"address": "203.0.113.196:1080", "username": "u"}
    for internal in ("10.0.0.1:1080", "127.0.0.1:1080", "169.254.169.254:80"):
        with pytest.raises(PolicyError, match="internal"):
            EgressPolicy.from_request(
                allow_internet_access=None, network={"egressProxy": {"address": internal}}
            )
