"""Workload identity core: `iam` validation, claims, RS256 JWT and JWK shapes."""

from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from aenv.proto.identity import (
    TokenSpec,
    claims,
    discovery,
    encode_jwt,
    parse_iam,
    rsa_jwk,
    subject,
)
from aenv.proto.netpolicy import PolicyError


def unb64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def test_parse_iam() -> None:
    raw = {"tokens": {"aws": {"audience": "sts.amazonaws.com", "tokenType": "JWT-SVID"}}}
    assert parse_iam(raw) == (TokenSpec("aws", "sts.amazonaws.com", "JWT-SVID"),)
    assert parse_iam(None) == () and parse_iam({}) == ()


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {"tokens": []},
        {"tokens": {"a}b": {"audience": "x", "tokenType": "JWT-SVID"}}},
        {"tokens": {"a": {"audience": "", "tokenType": "JWT-SVID"}}},
        {"tokens": {"a": {"audience": "x", "tokenType": "opaque"}}},
        {"tokens": {"a": "x"}},
    ],
)
def test_parse_iam_refuses(raw: object) -> None:
    with pytest.raises(PolicyError):
        parse_iam(raw)


def test_jwt_verifies_with_its_jwk() -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    spec = TokenSpec("aws", "sts.amazonaws.com")
    payload = claims(
        issuer="https://node.example:3000",
        spec=spec,
        sandbox_id="sbx1",
        template_id="base",
        now=1_700_000_000.5,
    )
    assert payload["sub"] == "spiffe://node.example/sandbox/sbx1"
    assert payload["aud"] == "sts.amazonaws.com" and payload["exp"] - payload["iat"] == 300
    token = encode_jwt("k1", payload, lambda d: key.sign(d, padding.PKCS1v15(), hashes.SHA256()))
    head, body, sig = token.split(".")
    assert json.loads(unb64(head)) == {"alg": "RS256", "typ": "JWT", "kid": "k1"}
    assert json.loads(unb64(body)) == payload
    nums = key.public_key().public_numbers()
    jwk = rsa_jwk(nums.n, nums.e, "k1")
    n = int.from_bytes(unb64(jwk["n"]), "big")
    e = int.from_bytes(unb64(jwk["e"]), "big")
    pub = rsa.RSAPublicNumbers(e, n).public_key()
    pub.verify(unb64(sig), f"{head}.{body}".encode(), padding.PKCS1v15(), hashes.SHA256())


def test_discovery_and_subject() -> None:
    doc = discovery("https://n.example")
    assert doc["jwks_uri"] == "https://n.example/.well-known/jwks.json"
    assert subject("http://10.0.0.1:3000", "x") == "spiffe://10.0.0.1/sandbox/x"
