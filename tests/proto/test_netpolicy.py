"""EgressPolicy: validation, E2B precedence, always-blocked ranges, reporting, nft text.

Pure tests, no network. Addresses are plain strings; the reference model in
`_model` restates the E2B rule (allowOut beats denyOut, no internet means deny
0.0.0.0/0 except allowOut) so Hypothesis can compare `allows` against it.
"""

from __future__ import annotations

import contextlib
import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv.proto.netpolicy import (
    ALWAYS_BLOCKED,
    EgressPolicy,
    PolicyError,
    render_slot_delete,
    render_slot_rules,
    render_table,
)


def req(
    allow_internet_access: bool | None = None,
    allow_out: list[object] | None = None,
    deny_out: list[object] | None = None,
) -> EgressPolicy:
    network: dict[str, object] = {}
    if allow_out is not None:
        network["allowOut"] = allow_out
    if deny_out is not None:
        network["denyOut"] = deny_out
    return EgressPolicy.from_request(allow_internet_access=allow_internet_access, network=network)


# -- defaults and precedence ----------------------------------------------------


def test_default_allows_public_internet() -> None:
    p = EgressPolicy.from_request(allow_internet_access=None, network=None)
    assert p == EgressPolicy()
    assert p.allow_internet
    assert p.allows("8.8.8.8")
    assert p.allows("198.51.100.1")


def test_no_internet_blocks_everything_but_allow_out() -> None:
    p = req(False, allow_out=["8.8.8.8", "1.1.0.0/16"])
    assert not p.allow_internet
    assert p.allows("8.8.8.8")
    assert p.allows("1.1.200.3")
    assert not p.allows("8.8.4.4")
    assert not p.allows("1.2.0.1")


def test_allow_out_beats_deny_out() -> None:
    p = req(allow_out=["1.2.3.4"], deny_out=["0.0.0.0/0"])
    assert p.allows("1.2.3.4")
    assert not p.allows("1.2.3.5")
    p = req(allow_out=["1.2.3.0/24"], deny_out=["1.2.3.4/32"])
    assert p.allows("1.2.3.4")


def test_deny_out_blocks_only_its_ranges() -> None:
    p = req(deny_out=["203.0.113.0/24"])
    assert not p.allows("203.0.113.77")
    assert p.allows("203.0.114.1")


def test_explicit_true_is_the_default() -> None:
    assert req(True) == EgressPolicy()


@pytest.mark.parametrize(
    "ip",
    [
        "10.0.0.1",
        "10.231.0.6",
        "172.16.0.1",
        "172.31.255.255",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "127.0.0.1",
        "0.1.2.3",
        "224.0.0.251",
        "239.255.255.250",
        "240.0.0.1",
        "255.255.255.255",
        "198.18.0.1",
    ],
)
def test_private_and_special_ranges_blocked_whatever_allow_out_says(ip: str) -> None:
    for p in (EgressPolicy(), req(allow_out=[ip]), req(allow_out=["0.0.0.0/0"]), req(False, [ip])):
        assert not p.allows(ip), (p, ip)


def test_caller_blocked_ranges_apply() -> None:
    p = req(allow_out=["198.51.100.0/24"])
    assert p.allows("198.51.100.9")
    assert not p.allows("198.51.100.9", blocked=["198.51.100.8/30"])


def test_ipv6_never_allowed() -> None:
    p = req(allow_out=["2001:db8::/32"])
    assert p.allow_out == ("2001:db8::/32",)
    assert not p.allows("2001:db8::1")
    assert not EgressPolicy().allows("2606:4700::1111")


# -- validation -----------------------------------------------------------------


def test_normalisation() -> None:
    p = req(allow_out=["1.2.3.4", "1.2.3.4/32", "10.1.2.3/8", "5.6.7.0/24"], deny_out=["9.9.9.9"])
    assert p.allow_out == ("1.2.3.4/32", "10.0.0.0/8", "5.6.7.0/24")
    assert p.deny_out == ("9.9.9.9/32",)
    assert EgressPolicy(allow_out=("1.2.3.4",)).allow_out == ("1.2.3.4/32",)


@pytest.mark.parametrize("entry", ["example.com", "*.Example.com.", "api.openai.com", "localhost"])
def test_host_names_are_host_rules_not_addresses(entry: str) -> None:
    p = req(allow_out=[entry, "1.2.3.4"], deny_out=[entry])
    pattern = entry.lower().rstrip(".")
    assert p.allow_hosts == (pattern,) and p.deny_hosts == (pattern,)
    assert p.allow_out == ("1.2.3.4/32",)
    assert p.has_hosts
    assert p.to_api()["allowOut"] == [entry, "1.2.3.4"]
    assert EgressPolicy.from_doc(p.to_doc()) == p


@pytest.mark.parametrize(
    ("allow_out", "deny_out", "match"),
    [
        (["1.2.3.4/33"], None, "invalid allowed address"),
        (["not a host!"], None, "invalid allowed address"),
        ([""], None, "invalid allowed address"),
        (["0.0.0.0"], None, "unspecified"),
        (["0.0.0.0/8"], None, "unspecified"),
        ([7], None, "strings"),
        (None, ["01.2.3.4"], "invalid denied CIDR"),
        (None, ["::"], "unspecified"),
        (None, [None], "strings"),
    ],
)
def test_invalid_entries(
    allow_out: list[object] | None, deny_out: list[object] | None, match: str
) -> None:
    with pytest.raises(PolicyError, match=match):
        req(allow_out=allow_out, deny_out=deny_out)


def test_all_traffic_spelling_is_accepted() -> None:
    assert req(deny_out=["0.0.0.0/0"]).deny_out == ("0.0.0.0/0",)


@pytest.mark.parametrize(
    ("aia", "network", "match"),
    [
        ("false", None, "allow_internet_access"),
        (None, ["1.2.3.4"], "network must be an object"),
        (None, {"allowOut": "1.2.3.4"}, "list"),
        (None, {"denyOut": {"a": 1}}, "list"),
        (None, {"allowOut": ["1.1.1.1"] * 5000}, "at most"),
    ],
)
def test_invalid_shapes(aia: object, network: object, match: str) -> None:
    with pytest.raises(PolicyError, match=match):
        EgressPolicy.from_request(allow_internet_access=aia, network=network)  # type: ignore[arg-type]


def test_policy_error_is_a_value_error() -> None:
    assert issubclass(PolicyError, ValueError)


def test_other_network_keys_are_ignored() -> None:
    p = EgressPolicy.from_request(
        allow_internet_access=None,
        network={"allowPublicTraffic": False, "allow_internet_access": False},
    )
    assert p == EgressPolicy()


# -- reporting ------------------------------------------------------------------


def test_to_api_reports_lists_as_given() -> None:
    p = req(False, allow_out=["1.1.1.1", "8.8.8.0/24"], deny_out=["9.9.9.9"])
    assert p.to_api() == {"allowOut": ["1.1.1.1", "8.8.8.0/24"], "denyOut": ["9.9.9.9"]}
    assert req(allow_out=[]).to_api() == {"allowOut": []}
    assert EgressPolicy().to_api() == {}
    assert EgressPolicy(deny_out=("1.2.3.4",)).to_api() == {"denyOut": ["1.2.3.4/32"]}


def test_to_api_is_a_fresh_dict() -> None:
    p = req(allow_out=["1.1.1.1"])
    p.to_api()["allowPublicTraffic"] = True
    assert p.to_api() == {"allowOut": ["1.1.1.1"]}


def test_equality_ignores_spelling() -> None:
    assert req(allow_out=["1.1.1.1"]) == req(allow_out=["1.1.1.1/32"])


# -- property: allows() agrees with the E2B rule ---------------------------------

public_octet = st.integers(1, 223).filter(lambda o: o not in (10, 100, 127, 169, 172, 192, 198))
ipv4 = st.builds(
    lambda a, b, c, d: f"{a}.{b}.{c}.{d}",
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, 255),
)
public_ipv4 = st.builds(
    lambda a, b, c, d: f"{a}.{b}.{c}.{d}",
    public_octet,
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(1, 254),
)
cidr = st.builds(
    lambda ip, plen: str(ipaddress.ip_network(f"{ip}/{plen}", strict=False)),
    public_ipv4,
    st.integers(8, 32),
)


def _model(p: EgressPolicy, ip: str) -> bool:
    a = ipaddress.IPv4Address(ip)
    if any(a in ipaddress.IPv4Network(b) for b in ALWAYS_BLOCKED):
        return False
    if any(a in ipaddress.ip_network(c) for c in p.allow_out):
        return True
    deny = ["0.0.0.0/0"] if not p.allow_internet else list(p.deny_out)
    return not any(a in ipaddress.ip_network(c) for c in deny)


@given(
    allow_internet=st.booleans(),
    allow_out=st.lists(cidr | public_ipv4, max_size=5),
    deny_out=st.lists(cidr | public_ipv4 | st.just("0.0.0.0/0"), max_size=5),
    ip=ipv4 | public_ipv4,
)
def test_allows_matches_e2b_rule(
    allow_internet: bool, allow_out: list[object], deny_out: list[object], ip: str
) -> None:
    p = req(allow_internet, allow_out, deny_out)
    assert p.allows(ip) == _model(p, ip)
    # Normalising again changes nothing.
    assert (
        EgressPolicy(allow_internet=allow_internet, allow_out=p.allow_out, deny_out=p.deny_out) == p
    )
    assert p.to_api() == {
        "allowOut": list(dict.fromkeys(allow_out)),
        "denyOut": list(dict.fromkeys(deny_out)),
    }


@given(st.lists(st.text(max_size=20) | st.integers() | st.none(), max_size=4))
def test_garbage_raises_only_policy_error(entries: list[object]) -> None:
    for key in ("allowOut", "denyOut"):
        with contextlib.suppress(PolicyError):
            EgressPolicy.from_request(allow_internet_access=None, network={key: entries})


# -- nftables text ---------------------------------------------------------------


def test_render_table() -> None:
    text = render_table(table="aenvtest", cidr="10.232.0.0/16")
    lines = text.splitlines()
    assert lines[:3] == [
        "add table inet aenvtest",
        "delete table inet aenvtest",
        "add table inet aenvtest",
    ]
    assert "ip saddr 10.232.0.0/16 ip daddr != 10.232.0.0/16 masquerade" in text
    assert (
        "add rule inet aenvtest input iifname @ifaces reject with icmpx type admin-prohibited"
        in lines
    )
    blocked = next(line for line in lines if "set inet aenvtest blocked" in line)
    assert "10.0.0.0/8" in blocked and "224.0.0.0/3" in blocked
    # A slot CIDR outside 10/8 is blocked too (other sandboxes).
    assert "100.127.0.0/16" not in render_table(table="t", cidr="10.1.0.0/16")
    assert "203.0.113.0/24" in render_table(table="t", cidr="203.0.113.0/24")


def test_render_slot_rules_order() -> None:
    p = req(
        allow_out=["1.2.3.4", "1.2.3.0/24", "2001:db8::/32"], deny_out=["9.9.9.9", "9.9.9.8/31"]
    )
    text = render_slot_rules(table="t", index=3, iface="aenvh3", sandbox_ip="10.231.0.14", policy=p)
    rules = [
        line.removeprefix("add rule inet t slot3 ")
        for line in text.splitlines()
        if line.startswith("add rule")
    ]
    assert rules == [
        "meta nfproto != ipv4 drop",
        "ip saddr != 10.231.0.14 drop",
        "ip daddr @blocked reject with icmpx type admin-prohibited",
        "ip daddr @slot3_allow accept",
        "ip daddr @slot3_deny reject with icmpx type admin-prohibited",
        "accept",
    ]
    assert "add element inet t slot3_allow { 1.2.3.0/24 }" in text  # merged, v6 left out
    assert "add element inet t slot3_deny { 9.9.9.8/31 }" in text
    assert 'add element inet t slots { "aenvh3" : jump slot3 }' in text
    assert 'add element inet t ifaces { "aenvh3" }' in text
    assert text.index("flush chain inet t slot3") < text.index("add rule")


def test_render_slot_rules_without_internet() -> None:
    p = req(False, allow_out=["1.2.3.4"], deny_out=["5.6.7.8"])
    text = render_slot_rules(table="t", index=0, iface="aenvh0", sandbox_ip="10.231.0.2", policy=p)
    rules = [line for line in text.splitlines() if line.startswith("add rule")]
    assert rules[-2:] == [
        "add rule inet t slot0 ip daddr @slot0_allow accept",
        "add rule inet t slot0 reject with icmpx type admin-prohibited",
    ]
    assert "add element inet t slot0_allow { 1.2.3.4/32 }" in text


def test_render_rejects_injection() -> None:
    with pytest.raises(ValueError):
        render_slot_rules(
            table="t; flush ruleset",
            index=0,
            iface="x",
            sandbox_ip="10.0.0.2",
            policy=EgressPolicy(),
        )
    with pytest.raises(ValueError):
        render_slot_delete(table="t", index=0, iface='x" }')
    with pytest.raises(ValueError):
        render_table(table="t t", cidr="10.0.0.0/16")
