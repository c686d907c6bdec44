"""Routing of data-plane requests by headers and host."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv.proto.ids import new_sandbox_id, owner_tag
from aenv.proto.routing import Route, RoutingError, route

SID = new_sandbox_id("n1")


def test_header_routing() -> None:
    assert route({"e2b-sandbox-id": SID, "e2b-sandbox-port": "49983"}, None) == Route(SID, 49983)


def test_host_routing_needs_matching_domain() -> None:
    h = {"host": f"8080-{SID}.sbx.example.com"}
    assert route(h, "sbx.example.com") == Route(SID, 8080)
    assert route(h, "other.com") is None
    assert route(h, None) is None
    assert route({"host": "127.0.0.1:8000"}, "sbx.example.com") is None
    # a node on another port than the scheme's: the Host names it
    assert route({"host": f"8080-{SID}.sbx.example.com:8443"}, "sbx.example.com") == Route(
        SID, 8080
    )
    assert route({"host": f"8080-{SID}.sbx.example.com:x"}, "sbx.example.com") is None


@pytest.mark.parametrize(
    "headers",
    [
        {"e2b-sandbox-id": SID},
        {"e2b-sandbox-port": "1"},
        {"e2b-sandbox-id": SID, "e2b-sandbox-port": "0"},
        {"e2b-sandbox-id": SID, "e2b-sandbox-port": "65536"},
        {"e2b-sandbox-id": SID, "e2b-sandbox-port": "\uff18\uff10"},
        {"e2b-sandbox-id": "../etc", "e2b-sandbox-port": "80"},
        {"e2b-sandbox-id": SID.upper(), "e2b-sandbox-port": "80"},
    ],
)
def test_bad_headers(headers: dict[str, str]) -> None:
    with pytest.raises(RoutingError):
        route(headers, None)


def test_ids_carry_their_node() -> None:
    assert owner_tag(SID) == "n100"
    assert SID.isalnum() and SID.islower()


@given(st.dictionaries(st.sampled_from(["e2b-sandbox-id", "e2b-sandbox-port", "host"]), st.text()))
def test_routing_never_raises_anything_else(headers: dict[str, str]) -> None:
    try:
        r = route(headers, "d.example")
    except RoutingError:
        return
    if r is not None:
        assert 1 <= r.port <= 65535


@pytest.mark.parametrize(
    "host",
    ["a" * 5000, "49983-" + "a" * 5000 + ".sbx.example.com", "a..b", "x." + "a" * 64, ".x"],
)
def test_hosts_no_server_could_have_are_refused(host: str) -> None:
    with pytest.raises(RoutingError):
        route({"host": host}, "sbx.example.com")


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "[::1]:8000", "localhost", "", "é.example"])
def test_ordinary_hosts_pass(host: str) -> None:
    assert route({"host": host}, "sbx.example.com") is None
