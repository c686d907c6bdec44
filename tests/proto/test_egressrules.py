"""The `network.rules` core: validation, host matching, placeholders, head rewriting."""

from __future__ import annotations

import pytest

from aenv.proto.egressrules import (
    HeadError,
    HostRules,
    Placeholder,
    head_end,
    parse_rules,
    rewrite_head,
    substitute,
)
from aenv.proto.netpolicy import PolicyError


def rule(**headers: str) -> dict[str, object]:
    return {"transform": {"headers": headers}}


def test_parse_and_match() -> None:
    rules = parse_rules(
        {
            "API.example.com.": [rule(Authorization="Bearer ${e2b.secrets.key}"), rule(X_A="2")],
            "*.example.com": [rule(X_Wild="1")],
            "*.b.example.com": [rule(X_Deeper="1")],
            "plain.test": [{}],
        }
    )
    assert rules.hosts == ("api.example.com", "*.example.com", "*.b.example.com", "plain.test")
    assert rules.headers_for("api.example.com") == (
        ("Authorization", "Bearer ${e2b.secrets.key}"),
        ("X_A", "2"),
    )
    assert rules.headers_for("x.example.com") == (("X_Wild", "1"),)
    assert rules.headers_for("a.b.example.com") == (("X_Deeper", "1"),)  # longest suffix
    assert rules.headers_for("example.com") is None
    assert rules.headers_for("plain.test") == ()  # a rule without headers still intercepts
    assert rules.headers_for(None) is None
    assert rules.placeholders() == {Placeholder("secret", "key")}
    assert HostRules.from_doc(rules.to_doc()) == rules
    assert rules.to_api()["api.example.com"][0]["transform"]["headers"]["X_A"] == "2"


def test_a_later_rule_overrides_a_header() -> None:
    rules = parse_rules({"a.test": [rule(X="1"), rule(x="2")]})
    assert rules.headers_for("a.test") == (("x", "2"),)


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {"10.0.0.0/8": [rule(X="1")]},
        {"1.2.3.4": [rule(X="1")]},
        {"a.test": rule(X="1")},
        {"a.test": [rule(**{"Bad Name": "1"})]},
        {"a.test": [rule(X="a\r\nInjected: 1")]},
        {"a.test": [rule(Host="evil.test")]},
        {"a.test": [rule(**{"Content-Length": "0"})]},
        {"a.test": [rule(X="${e2b.identity.tokens.aws}")]},
        {"a.test": [{"transform": {"headers": ["X"]}}]},
    ],
)
def test_refused(raw: object) -> None:
    with pytest.raises(PolicyError):
        parse_rules(raw)


def test_identity_token_needs_its_iam_entry() -> None:
    rules = parse_rules({"a.test": [rule(X="${e2b.identity.tokens.aws}")]}, iam_tokens=["aws"])
    assert rules.placeholders() == {Placeholder("token", "aws")}


def test_substitute() -> None:
    values = {Placeholder("secret", "k"): "s3cr3t", Placeholder("token", "t"): "jwt"}
    out = substitute("Bearer ${e2b.secrets.k} ${e2b.identity.tokens.t} $x {y}", values.__getitem__)
    assert out == "Bearer s3cr3t jwt $x {y}"
    with pytest.raises(HeadError):
        substitute("${e2b.secrets.k}", lambda _p: "a\r\nb")


def test_rewrite_head() -> None:
    head = (
        b"GET /x HTTP/1.1\r\nHost: a.test\r\nauthorization: mine\r\n"
        b"Connection: keep-alive\r\nAccept: */*\r\n\r\n"
    )
    assert head_end(head + b"body") == len(head)
    assert head_end(head[:-2]) == -1
    out = rewrite_head(head, [("Authorization", "Bearer s")])
    assert out == (
        b"GET /x HTTP/1.1\r\nHost: a.test\r\nAccept: */*\r\n"
        b"Authorization: Bearer s\r\nConnection: close\r\n\r\n"
    )


@pytest.mark.parametrize(
    "head",
    [
        b"PRI * HTTP/2.0\r\n\r\n",
        b"GET /\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n",
        b"GET / HTTP/1.1\r\nnocolon\r\n\r\n",
    ],
)
def test_rewrite_refuses(head: bytes) -> None:
    with pytest.raises(HeadError):
        rewrite_head(head, [])


def test_head_too_long() -> None:
    with pytest.raises(HeadError):
        head_end(b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 20000)


def test_token_names_unknown_on_update_pass() -> None:
    rules = parse_rules({"a.test": [rule(X="${e2b.identity.tokens.aws}")]}, iam_tokens=None)
    assert rules.placeholders() == {Placeholder("token", "aws")}


def test_rewrite_refuses_a_value_that_would_split_the_head() -> None:
    with pytest.raises(HeadError):
        rewrite_head(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", [("X", "a\r\n\r\nGET /evil")])
