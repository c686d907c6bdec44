"""Fuzz the E2B request-body parsers in `aenv.proto.requests` (sans-IO).

Every parser is fed arbitrary JSON values and structured near-valid bodies
(a valid body with one field replaced by garbage or a boundary value). The
rules: a parser either returns or raises `BadRequest` with a message, nothing
else; what it accepts satisfies the invariants the node relies on (timeouts
are ints within the limits, metadata and env vars are str -> str within their
bounds, egress CIDRs are valid and normalised, the never-reachable ranges stay
blocked, and the nftables rules rendered from the policy are well formed);
and a valid body is never refused. Runs under pytest (short: 200 examples;
`AENV_FUZZ_LONG=1`: 50 000; `AENV_FUZZ_EXAMPLES=N`: N) or standalone with
`python fuzz/fuzz_requests.py` (atheris if importable, else repeated
hypothesis rounds).
"""

from __future__ import annotations

import ipaddress
import sys
from collections.abc import Callable, Mapping
from typing import Any

from _harness import FUZZ, main
from hypothesis import event, given
from hypothesis import strategies as st

from aenv.proto.ids import NAME_RE, InvalidName, check_name
from aenv.proto.imageref import InvalidReference, parse_reference
from aenv.proto.netpolicy import ALL_TRAFFIC, EgressPolicy, render_slot_rules
from aenv.proto.requests import (
    MAX_ENV_ITEMS,
    MAX_KEY,
    MAX_METADATA_ITEMS,
    MAX_VALUE,
    BadRequest,
    Limits,
    NewSandbox,
    parse_connect,
    parse_network_update,
    parse_new_sandbox,
    parse_refresh,
    parse_timeout_request,
)

# -- strategies -----------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=40)
)
json_values: st.SearchStrategy[Any] = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=25,
)

limits_st: st.SearchStrategy[Limits] = st.just(Limits()) | st.integers(0, 10**6).flatmap(
    lambda m: st.builds(Limits, max_timeout_s=st.just(m), default_timeout_s=st.integers(0, m))
)

valid_names = st.from_regex(NAME_RE, fullmatch=True).filter(lambda s: ".." not in s)
odd_names = st.sampled_from(
    ["", "..", "a..b", "A", "Base", "-a", ".a", "a/b", "../x", "a\0", "x" * 128, "x" * 129, " base"]
)


def _timeouts(limits: Limits) -> st.SearchStrategy[int]:
    return st.integers(0, limits.max_timeout_s)


odd_timeouts = st.sampled_from(
    [-1, -(2**63), 2**63, 2**31, 86_400, 86_401, 10**6 + 1, True, False, 1.0, 300.5, "300", [], {}]
)

_key = st.text(min_size=1, max_size=24).filter(lambda s: "\0" not in s)
_value = st.text(max_size=64).filter(lambda s: "\0" not in s)


def valid_str_map(max_items: int) -> st.SearchStrategy[dict[str, str]]:
    return st.dictionaries(_key, _value, max_size=min(max_items, 8)) | st.just(
        {f"k{i}": "v" for i in range(max_items)}
    )


odd_str_maps = st.sampled_from(
    [
        {"": "v"},
        {"k": None},
        {"k": 1},
        {"k": ["v"]},
        {"k\0": "v"},
        {"k": "v\0"},
        {"k" * MAX_KEY: "v"},
        {"k" * (MAX_KEY + 1): "v"},
        {"k": "v" * MAX_VALUE},
        {"k": "v" * (MAX_VALUE + 1)},
        {f"k{i}": "v" for i in range(MAX_METADATA_ITEMS + 1)},
        {f"k{i}": "v" for i in range(MAX_ENV_ITEMS + 1)},
        [],
        "k=v",
    ]
) | st.dictionaries(st.text(max_size=8), json_values, max_size=4)


def _specified(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """`addr`, or a fixed ordinary address in its place if it is 0.0.0.0 / ::."""
    if addr.is_unspecified:
        return "192.0.2.1" if addr.version == 4 else "2001:db8::1"
    return str(addr)


def _canonical_cidr(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, plen: int) -> str:
    """A network in canonical form (host bits clear) whose address is not unspecified."""
    net = ipaddress.ip_network(f"{addr}/{plen}", strict=False)
    if net.network_address.is_unspecified:
        net = ipaddress.ip_network(f"{_specified(addr)}/{net.max_prefixlen}")
    return str(net)


# Entries E2B accepts and aenv must too: an address, a network in canonical
# form that is not an unspecified address, or 0.0.0.0/0.
valid_cidrs = (
    st.ip_addresses().map(_specified)
    | st.builds(_canonical_cidr, st.ip_addresses(v=4), st.integers(0, 32))
    | st.builds(_canonical_cidr, st.ip_addresses(v=6), st.integers(0, 128))
    | st.just(ALL_TRAFFIC)
)
odd_cidrs = (
    st.sampled_from(
        [
            "0.0.0.0",
            "::",
            "::/0",
            "0.0.0.0/8",
            "1.2.3.4/33",
            "1.2.3.4/-1",
            "1.2.3.4/",
            "/24",
            "1.2.3.4/255.255.255.0",
            "1.2.3.4/0.0.0.255",
            "fe80::1%eth0",
            "fe80::1%eth0/64",
            " 1.2.3.4",
            "1.2.3.4\n",
            "1.2.3.4; drop",
            "1.2.3.4 } ; add rule inet x y accept",
            "example.com",
            "*.example.com",
            "a" * 300,
            "-" * 64 + ".com",
            "01.2.3.4",
            "1.2.3",
        ]
    )
    | st.builds(lambda ip, plen: f"{ip}/{plen}", st.ip_addresses(), st.integers(-3, 140))
    | st.text(max_size=40)
    | json_scalars
)


def _network(*, valid: bool) -> st.SearchStrategy[dict[str, Any]]:
    entries = valid_cidrs if valid else (valid_cidrs | odd_cidrs)
    lists = st.lists(entries, max_size=6)
    if valid:
        return st.fixed_dictionaries(
            {},
            optional={
                "allowOut": lists,
                "denyOut": lists,
                "allowPublicTraffic": st.booleans(),
                "egressProxy": st.none(),
                "httpsPorts": st.just([]),
                "rules": st.just({}),
            },
        )
    return st.fixed_dictionaries(
        {},
        optional={
            "allowOut": lists | json_values,
            "denyOut": lists | json_values,
            "allowPublicTraffic": st.booleans() | json_values,
            "allow_internet_access": st.booleans() | json_values,
            "egressProxy": json_values,
            "maskRequestHost": json_values,
            "httpsPorts": json_values,
            "rules": json_values,
            "extra": json_values,
        },
    )


def valid_new_sandbox(limits: Limits) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"templateID": valid_names},
        optional={
            "timeout": _timeouts(limits) | st.none(),
            "metadata": valid_str_map(MAX_METADATA_ITEMS) | st.none(),
            "envVars": valid_str_map(MAX_ENV_ITEMS) | st.none(),
            "allow_internet_access": st.booleans() | st.none(),
            "network": _network(valid=True) | st.none(),
            "secure": st.booleans(),
            "autoPause": st.booleans() | st.none(),
            "autoPauseMemory": st.booleans() | st.none(),
            "autoResume": st.fixed_dictionaries({}, optional={"enabled": st.just(False)}),
            "mcp": st.just({}) | st.none(),
            "volumeMounts": st.just([]) | st.none(),
            "iam": st.fixed_dictionaries({}, optional={"tokens": st.just({})}),
            "unknownField": json_values,
        },
    )


_field_garbage: dict[str, st.SearchStrategy[Any]] = {
    "templateID": odd_names | st.text(max_size=20) | json_values,
    "timeout": odd_timeouts | json_values,
    "metadata": odd_str_maps | json_values,
    "envVars": odd_str_maps | json_values,
    "allow_internet_access": json_values,
    "network": _network(valid=False) | json_values,
    "autoPause": json_values,
    "autoPauseMemory": json_values,
    "autoResume": st.just({"enabled": True}) | json_values,
    "mcp": json_values,
    "volumeMounts": json_values,
    "iam": st.just({"tokens": {"aws": {}}}) | json_values,
}


@st.composite
def near_valid_new_sandbox(draw: st.DrawFn, limits: Limits) -> dict[str, Any]:
    body = draw(valid_new_sandbox(limits))
    for key in draw(st.lists(st.sampled_from(sorted(_field_garbage)), min_size=1, max_size=2)):
        if draw(st.booleans()):
            body[key] = draw(_field_garbage[key])
        else:
            body.pop(key, None)
    return body


# -- invariants -----------------------------------------------------------------

_NEVER_REACHABLE = ("127.0.0.1", "10.1.2.3", "169.254.169.254", "192.168.0.1", "172.16.0.1")


def _check_timeout(value: int, given: object, limits: Limits) -> None:
    assert type(value) is int
    assert 0 <= value <= limits.max_timeout_s
    if given is None:
        assert value == limits.default_timeout_s
    else:
        assert value == given


def _check_str_map(value: Mapping[str, str], given: object, max_items: int) -> None:
    assert len(value) <= max_items
    for k, v in value.items():
        assert isinstance(k, str) and isinstance(v, str)
        assert k and "\0" not in k and "\0" not in v
        assert len(k) <= MAX_KEY and len(v) <= MAX_VALUE
    assert dict(value) == ({} if given is None else dict(given))  # type: ignore[call-overload]


def _check_policy(policy: EgressPolicy, allow_internet: object, net: object) -> None:
    assert isinstance(policy, EgressPolicy)
    assert policy.allow_internet is (allow_internet is not False)
    for cidrs in (policy.allow_out, policy.deny_out):
        assert len(set(cidrs)) == len(cidrs)
        for c in cidrs:
            parsed = ipaddress.ip_network(c)  # strict: host bits are clear
            assert str(parsed) == c
            assert not parsed.network_address.is_unspecified or c in (ALL_TRAFFIC,)
    if isinstance(net, Mapping):
        for key, normalised in (("allowOut", policy.allow_out), ("denyOut", policy.deny_out)):
            for entry in net.get(key) or ():
                assert str(ipaddress.ip_network(entry, strict=False)) in normalised
    for ip in _NEVER_REACHABLE:
        assert not policy.allows(ip), ip
    script = render_slot_rules(
        table="aenvfuzz", index=7, iface="aenvfuzzh7", sandbox_ip="10.9.0.2", policy=policy
    )
    for line in script.splitlines():
        assert line == "" or line.split(" ", 1)[0] in {"add", "flush"}, line
        assert all(ch.isascii() and ch.isprintable() for ch in line), line


def _check_new_sandbox(r: NewSandbox, body: Mapping[str, Any], limits: Limits) -> None:
    assert isinstance(r, NewSandbox)
    assert r.template == body["templateID"]
    try:
        check_name(r.template)
    except InvalidName as e:
        try:  # else it must be an OCI image reference (the node pulls it)
            parse_reference(r.template)
        except InvalidReference:  # pragma: no cover - a failure report
            raise AssertionError(f"accepted invalid template name: {e}") from None
    _check_timeout(r.timeout_s, body.get("timeout"), limits)
    _check_str_map(r.metadata, body.get("metadata"), MAX_METADATA_ITEMS)
    _check_str_map(r.env_vars, body.get("envVars"), MAX_ENV_ITEMS)
    net = body.get("network")
    _check_policy(r.policy, body.get("allow_internet_access"), net)
    assert r.allow_internet_access is body.get("allow_internet_access")
    public = net.get("allowPublicTraffic") if isinstance(net, Mapping) else None
    assert r.allow_public_traffic is (True if public is None else public)
    assert r.auto_pause is (body.get("autoPause") is True)
    assert r.auto_pause_memory is (body.get("autoPauseMemory") is not False)
    resume = body.get("autoResume")
    assert r.auto_resume is (isinstance(resume, Mapping) and resume.get("enabled") is True)
    if r.auto_resume:  # only a sandbox that pauses with its memory can wake on traffic
        assert r.auto_pause and r.auto_pause_memory


def _rejected(e: BadRequest) -> None:
    assert isinstance(str(e), str) and str(e), "BadRequest without a message"
    event("rejected")


def _new_sandbox(body: Any, limits: Limits) -> NewSandbox | None:
    try:
        r = parse_new_sandbox(body, limits)
    except BadRequest as e:
        _rejected(e)
        return None
    event("accepted")
    _check_new_sandbox(r, body, limits)
    return r


# -- tests --------------------------------------------------------------------


@FUZZ
@given(body=json_values, limits=limits_st)
def test_new_sandbox_arbitrary(body: Any, limits: Limits) -> None:
    _new_sandbox(body, limits)


@FUZZ
@given(data=st.data(), limits=limits_st)
def test_new_sandbox_near_valid(data: st.DataObject, limits: Limits) -> None:
    _new_sandbox(data.draw(near_valid_new_sandbox(limits)), limits)


@FUZZ
@given(data=st.data(), limits=limits_st)
def test_new_sandbox_valid_is_accepted(data: st.DataObject, limits: Limits) -> None:
    body = data.draw(valid_new_sandbox(limits))
    assert _new_sandbox(body, limits) is not None, f"valid body refused: {body!r}"


_timeout_bodies = json_values | st.fixed_dictionaries(
    {},
    optional={
        "timeout": st.integers(-5, 10**6 + 5) | odd_timeouts | json_values,
        "duration": st.integers(-5, 10**6 + 5) | odd_timeouts | json_values,
        "memory": st.booleans() | json_values,
        "extra": json_values,
    },
)


@FUZZ
@given(body=_timeout_bodies, limits=limits_st)
def test_timeout_request(body: Any, limits: Limits) -> None:
    try:
        value = parse_timeout_request(body, limits)
    except BadRequest as e:
        _rejected(e)
        return
    event("accepted")
    assert "timeout" in body
    _check_timeout(value, body["timeout"], limits)


@FUZZ
@given(body=_timeout_bodies, limits=limits_st)
def test_refresh(body: Any, limits: Limits) -> None:
    try:
        value = parse_refresh(body, limits)
    except BadRequest as e:
        _rejected(e)
        return
    event("accepted")
    _check_timeout(value, None if body is None else body.get("duration"), limits)


@FUZZ
@given(body=_timeout_bodies, limits=limits_st)
def test_connect(body: Any, limits: Limits) -> None:
    try:
        value = parse_connect(body, limits)
    except BadRequest as e:
        _rejected(e)
        return
    event("accepted")
    if body is not None:
        assert body.get("memory") is not False
    _check_timeout(value, None if body is None else body.get("timeout"), limits)


_network_update_bodies = (
    json_values
    | _network(valid=False)
    | _network(valid=True).flatmap(
        lambda n: st.fixed_dictionaries(
            {}, optional={"allow_internet_access": st.booleans() | st.none()}
        ).map(lambda extra: {**n, **extra})
    )
)


@FUZZ
@given(body=_network_update_bodies)
def test_network_update(body: Any) -> None:
    try:
        policy, allow_internet = parse_network_update(body)
    except BadRequest as e:
        _rejected(e)
        return
    event("accepted")
    assert allow_internet is body.get("allow_internet_access")
    _check_policy(policy, allow_internet, body)


@FUZZ
@given(data=st.data())
def test_network_update_valid_is_accepted(data: st.DataObject) -> None:
    body = data.draw(_network(valid=True))
    body.pop("httpsPorts", None)  # a create's field: an update that sets it is refused
    policy, allow_internet = parse_network_update(body)
    assert allow_internet is None
    _check_policy(policy, None, body)


TESTS: tuple[Callable[[], None], ...] = (
    test_new_sandbox_arbitrary,
    test_new_sandbox_near_valid,
    test_new_sandbox_valid_is_accepted,
    test_timeout_request,
    test_refresh,
    test_connect,
    test_network_update,
    test_network_update_valid_is_accepted,
)


if __name__ == "__main__":
    sys.exit(main(TESTS, __doc__ or ""))
