"""Validation of REST bodies: what is refused, and with which message."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv.proto import ingress
from aenv.proto import requests as rq

L = rq.Limits(max_timeout_s=3600, default_timeout_s=300)


def test_minimal_create_defaults() -> None:
    r = rq.parse_new_sandbox({"templateID": "base"}, L)
    assert r.template == "base" and r.timeout_s == 300 and r.policy.allow_internet


def test_sdk_shaped_create() -> None:
    r = rq.parse_new_sandbox(
        {
            "templateID": "base",
            "timeout": 60,
            "metadata": {"a": "b"},
            "envVars": {"X": "1"},
            "allow_internet_access": False,
            "network": {"allowOut": ["1.1.1.1"], "allowPublicTraffic": False},
            "secure": True,
            "somethingNew": 1,
        },
        L,
    )
    assert r.timeout_s == 60 and r.metadata == {"a": "b"} and r.env_vars == {"X": "1"}
    assert not r.policy.allow_internet and r.allow_public_traffic is False


def test_ingress_settings_kept_and_reported() -> None:
    net = {"maskRequestHost": "${PORT}-app.example.com", "httpsPorts": [8443, 3000, 8443]}
    r = rq.parse_new_sandbox({"templateID": "base", "network": net}, L)
    p = r.policy
    assert p.mask_request_host == "${PORT}-app.example.com" and p.https_ports == (3000, 8443)
    assert type(p).from_doc(p.to_doc()) == p
    assert p.to_api()["maskRequestHost"] == "${PORT}-app.example.com"
    assert p.to_api()["httpsPorts"] == [3000, 8443]
    assert ingress.request_host(p.mask_request_host, 3000) == "3000-app.example.com"
    assert ingress.request_host(None, 3000) is None
    with pytest.raises(rq.BadRequest, match="not updated"):
        rq.parse_network_update({"maskRequestHost": "x"})


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({}, "templateID"),
        ({"templateID": "../x"}, "invalid templateID"),
        ({"templateID": "b", "timeout": -5}, "negative"),
        ({"templateID": "b", "timeout": 3601}, "at most"),
        ({"templateID": "b", "timeout": True}, "integer"),
        ({"templateID": "b", "autoPause": 1}, "autoPause must be a boolean"),
        ({"templateID": "b", "autoResume": {"enabled": True}}, "autoResume"),
        ({"templateID": "b", "mcp": {"x": {}}}, "mcp"),
        ({"templateID": "b", "network": {"httpsPorts": [49983]}}, "httpsPorts"),
        ({"templateID": "b", "network": {"httpsPorts": [0]}}, "httpsPorts"),
        ({"templateID": "b", "network": {"httpsPorts": "443"}}, "httpsPorts"),
        ({"templateID": "b", "network": {"maskRequestHost": "a b"}}, "maskRequestHost"),
        ({"templateID": "b", "network": {"maskRequestHost": "x\r\nEvil: 1"}}, "maskRequest"),
        ({"templateID": "b", "metadata": {"k": 1}}, "metadata"),
    ],
)
def test_refusals_name_the_field(body: dict[str, object], fragment: str) -> None:
    with pytest.raises(rq.BadRequest, match=fragment):
        rq.parse_new_sandbox(body, L)


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
    )
)
def test_garbage_only_raises_bad_request(body: object) -> None:
    with contextlib.suppress(rq.BadRequest):
        rq.parse_new_sandbox(body, L)
