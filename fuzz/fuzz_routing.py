"""Fuzz data-plane routing, `aenv.proto.routing.route` (sans-IO).

Inputs are arbitrary header dicts and hosts, and near-valid ones built from a
real sandbox ID and port with one part mangled (case, padding, length,
non-ASCII digits, out-of-range ports, a different domain). The rules: `route`
returns a `Route`, returns None, or raises `RoutingError`, nothing else; a
`Route` always carries a valid sandbox ID and a port in 1..65535; header
routing wins whenever either routing header is present and returns exactly
what the headers say; host routing happens only when a domain is configured
and the Host is `{port}-{id}.{domain}` for exactly that domain (ASCII
case-insensitive); a well-formed Host for the domain is always routed; a
Host no server could have (longer than a DNS name, a label over 63
characters or empty, not IDNA-encodable) is a `RoutingError` whatever else
the request says. Runs
under pytest (short: 200 examples; `AENV_FUZZ_LONG=1`: 50 000;
`AENV_FUZZ_EXAMPLES=N`: N) or standalone with `python fuzz/fuzz_routing.py`
(atheris if importable, else repeated hypothesis rounds).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
from _harness import FUZZ, main
from hypothesis import assume, event, given
from hypothesis import strategies as st

from aenv.proto.ids import RANDOM_LEN, SANDBOX_ID_RE, is_sandbox_id, new_sandbox_id
from aenv.proto.routing import Route, RoutingError, check_host, route

ID_HEADER = "e2b-sandbox-id"
PORT_HEADER = "e2b-sandbox-port"

# -- strategies -----------------------------------------------------------------

valid_ids = st.from_regex(SANDBOX_ID_RE, fullmatch=True) | st.builds(
    new_sandbox_id, st.text(max_size=6)
)
valid_ports = st.integers(1, 65535).map(str)


@st.composite
def mangled_ids(draw: st.DrawFn) -> str:
    sid = draw(valid_ids)
    how = draw(
        st.sampled_from(["upper", "short", "long", "pad", "unicode", "dot", "dash", "empty", "nl"])
    )
    if how == "upper":
        i = draw(st.integers(0, len(sid) - 1))
        return sid[:i] + sid[i].upper() + sid[i + 1 :]
    if how == "short":
        return sid[: draw(st.integers(0, len(sid) - 1))]
    if how == "long":
        return sid + draw(st.text("abc019", min_size=1, max_size=3))
    if how == "pad":
        return draw(st.sampled_from([" ", "\t", "\u00a0", "\u2003"])) + sid
    if how == "unicode":
        i = draw(st.integers(0, len(sid) - 1))
        return (
            sid[:i]
            + draw(st.sampled_from(["\u0661", "\uff11", "\u0131", "\u212a", "é"]))
            + sid[i + 1 :]
        )
    if how == "dot":
        return sid[:RANDOM_LEN] + "." + sid[RANDOM_LEN:]
    if how == "dash":
        return sid[:RANDOM_LEN] + "-" + sid[RANDOM_LEN + 1 :]
    if how == "nl":
        return sid + "\n"
    return ""


odd_ports = (
    st.sampled_from(
        [
            "",
            "0",
            "00000",
            "65536",
            "99999",
            "100000",
            "-1",
            "+80",
            "0x50",
            "80.0",
            "1e3",
            "\uff18\uff10",
            "\u0668\u0660",
            "²",
            " 80",
            "80 ",
            "\t80\n",
            "049983",
            "00001",
        ]
    )
    | st.integers(-10, 200_000).map(str)
    | st.text(max_size=8)
)

domains = st.sampled_from(
    ["sbx.example.com", "e2b.app", "localhost", "Example.COM", "a", "xn--bcher-kva.example"]
) | st.from_regex(r"[a-z0-9][a-z0-9-]{0,9}(\.[a-z0-9][a-z0-9-]{0,9}){0,3}", fullmatch=True)
maybe_domains = st.none() | domains | st.text(max_size=20)

header_keys = st.sampled_from(
    [ID_HEADER, PORT_HEADER, "host", "E2b-Sandbox-Id", "E2B-SANDBOX-PORT", "x-api-key", ""]
) | st.text(max_size=20)
arbitrary_headers = st.dictionaries(header_keys, st.text(max_size=40), max_size=6)


@st.composite
def near_valid_headers(draw: st.DrawFn) -> dict[str, str]:
    headers: dict[str, str] = draw(
        st.dictionaries(st.sampled_from(["x-api-key", "accept"]), st.text(max_size=8))
    )
    if draw(st.booleans()):
        headers[ID_HEADER] = draw(valid_ids | mangled_ids())
    if draw(st.booleans()):
        headers[PORT_HEADER] = draw(valid_ports | odd_ports)
    if draw(st.booleans()):
        headers["host"] = draw(hosts())
    return headers


@st.composite
def hosts(draw: st.DrawFn, domain: str | None = None) -> str:
    """`{port}-{id}.{domain}`, with up to three of its parts or its case mangled."""
    parts = ("sid", "port", "domain", "sep", "dot", "suffix", "upper")
    mangle = draw(st.sets(st.sampled_from(parts), max_size=3))
    sid = draw(mangled_ids() if "sid" in mangle else valid_ids)
    port = draw(odd_ports if "port" in mangle else valid_ports)
    dom = draw(domains | st.text(max_size=12)) if domain is None or "domain" in mangle else domain
    sep = draw(st.sampled_from(["_", "--", "", " ", "-0"])) if "sep" in mangle else "-"
    dot = draw(st.sampled_from(["..", "", ":", "-"])) if "dot" in mangle else "."
    host = f"{port}{sep}{sid}{dot}{dom}"
    if "upper" in mangle:
        host = host.upper()
    if "suffix" in mangle:
        host += draw(st.sampled_from([":443", ".", " ", ":8000", "\n", "\x00"]))
    return host


# -- invariants -----------------------------------------------------------------


def _route(headers: dict[str, str], domain: str | None) -> Route | None:
    try:
        r = route(headers, domain)
    except RoutingError as e:
        assert str(e), "RoutingError without a message"
        event("rejected")
        return None
    if r is None:
        event("control plane")
        return None
    event("routed")
    assert isinstance(r, Route)
    assert isinstance(r.sandbox_id, str) and is_sandbox_id(r.sandbox_id), r
    assert type(r.port) is int and 1 <= r.port <= 65535, r
    if ID_HEADER in headers or PORT_HEADER in headers:
        assert r.sandbox_id == headers[ID_HEADER].strip()
        assert r.port == int(headers[PORT_HEADER].strip())
    else:
        assert domain is not None, "host routing without a domain"
        port, _, rest = headers["host"].strip().lower().partition("-")
        assert port.isascii() and port.isdigit() and int(port) == r.port
        name, colon, listen_port = rest.rpartition(":")
        if colon and listen_port.isascii() and listen_port.isdigit():
            rest = name  # the port the client connected to is not part of the route
        assert rest == f"{r.sandbox_id}.{domain.lower()}", "host routed for another domain"
    return r


def _host_ok(headers: dict[str, str]) -> bool:
    try:
        check_host(headers.get("host", ""))
    except RoutingError:
        return False
    return True


def _check_any(headers: dict[str, str], domain: str | None) -> None:
    if not _host_ok(headers):  # refused, whatever else the request says
        with pytest.raises(RoutingError):
            route(headers, domain)
        event("hostile host")
        return
    r = _route(headers, domain)
    if domain is None and ID_HEADER not in headers and PORT_HEADER not in headers:
        # Without a domain and routing headers every request is control plane.
        assert r is None
        assert route(headers, domain) is None


# -- tests --------------------------------------------------------------------


@FUZZ
@given(headers=arbitrary_headers, domain=maybe_domains)
def test_route_arbitrary(headers: dict[str, str], domain: str | None) -> None:
    _check_any(headers, domain)


@FUZZ
@given(headers=near_valid_headers(), domain=maybe_domains)
def test_route_near_valid(headers: dict[str, str], domain: str | None) -> None:
    _check_any(headers, domain)


@FUZZ
@given(data=st.data(), domain=domains)
def test_host_route_near_valid(data: st.DataObject, domain: str) -> None:
    _check_any({"host": data.draw(hosts(domain))}, domain)


@FUZZ
@given(
    sid=valid_ids,
    port=st.integers(1, 65535),
    domain=domains,
    upper=st.booleans(),
    extra=arbitrary_headers,
)
def test_well_formed_host_is_routed(
    sid: str, port: int, domain: str, upper: bool, extra: dict[str, str]
) -> None:
    headers = {k: v for k, v in extra.items() if k not in (ID_HEADER, PORT_HEADER)}
    host = f"{port}-{sid}.{domain}"
    headers["host"] = host.upper() if upper else host
    assert _route(headers, domain) == Route(sid, port)
    assert route({"host": host}, None) is None


@FUZZ
@given(sid=valid_ids, port=st.integers(1, 65535), host=st.text(max_size=30), domain=maybe_domains)
def test_headers_win(sid: str, port: int, host: str, domain: str | None) -> None:
    headers = {ID_HEADER: f" {sid} ", PORT_HEADER: f"{port}\t", "host": host}
    assume(_host_ok(headers))
    assert _route(headers, domain) == Route(sid, port)


@FUZZ
@given(
    value=st.text(max_size=30) | valid_ids | mangled_ids(),
    which=st.sampled_from([ID_HEADER, PORT_HEADER]),
)
def test_one_routing_header_is_an_error(value: str, which: str) -> None:
    try:
        route({which: value}, None)
    except RoutingError:
        return
    raise AssertionError(f"only {which} given, no RoutingError")


hostile_hosts = st.one_of(
    st.integers(260, 20_000).map(lambda n: "a" * n),
    st.integers(64, 5_000).map(lambda n: f"49983-{'b' * n}.sbx.example.com"),
    st.lists(st.sampled_from(["a", "", "xn--", "é"]), min_size=2, max_size=6)
    .map(".".join)
    .filter(lambda h: ".." in h or h.startswith(".")),
)


@FUZZ
@given(host=hostile_hosts, domain=maybe_domains, sid=valid_ids, routed=st.booleans())
def test_hostile_host_is_a_routing_error(
    host: str, domain: str | None, sid: str, routed: bool
) -> None:
    """A Host no server could have (too long, a label over 63 or empty) is
    refused whatever else the request says: the app behind would fail on it."""
    headers = {"host": host}
    if routed:
        headers.update({ID_HEADER: sid, PORT_HEADER: "49983"})
    try:
        route(headers, domain)
    except RoutingError:
        event("rejected")
        return
    raise AssertionError(f"hostile Host {host[:40]!r}... routed")


TESTS: tuple[Callable[[], None], ...] = (
    test_hostile_host_is_a_routing_error,
    test_route_arbitrary,
    test_route_near_valid,
    test_host_route_near_valid,
    test_well_formed_host_is_routed,
    test_headers_win,
    test_one_routing_header_is_an_error,
)


if __name__ == "__main__":
    sys.exit(main(TESTS, __doc__ or ""))
