"""Workload identity (`iam`): token definitions, claims and JWT/JWKS shapes, without IO.

A sandbox created with `iam: {"tokens": {NAME: {"audience", "tokenType"}}}`
gets, in requests its `network.rules` send, `${e2b.identity.tokens.NAME}`
replaced by a JWT the node signs as an OIDC issuer (`aenv.node.identity`):
short-lived, with the requested audience and the sandbox as its subject, so
a cloud provider that trusts the node's issuer (its discovery document and
JWKS, served without an API key) can federate to it. The token is minted on
the host side per request; the sandbox never holds it.

`JWT-SVID` (the only type the E2B API accepts) makes the subject a SPIFFE
ID, `spiffe://{trust domain}/sandbox/{id}`, the trust domain being the
issuer URL's host.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from aenv.proto.netpolicy import PolicyError

TOKEN_TYPES: Final = ("JWT-SVID",)
TOKEN_TTL_S: Final = 300
MAX_TOKENS: Final = 20
MAX_AUDIENCE: Final = 512
_BAD_NAME: Final = re.compile(r"[{}\x00-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class TokenSpec:
    name: str
    audience: str
    token_type: str = "JWT-SVID"


def parse_iam(raw: object) -> tuple[TokenSpec, ...]:
    """Validate a create body's `iam` (E2B wire shape)."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise PolicyError("iam must be an object")
    tokens = raw.get("tokens")
    if tokens is None:
        return ()
    if not isinstance(tokens, Mapping) or len(tokens) > MAX_TOKENS:
        raise PolicyError(f"iam.tokens must be an object of at most {MAX_TOKENS} tokens")
    out = []
    for name, spec in tokens.items():
        if not isinstance(name, str) or not name or _BAD_NAME.search(name) or len(name) > 128:
            raise PolicyError(f"iam.tokens: invalid token name {name!r}")
        if not isinstance(spec, Mapping):
            raise PolicyError(f"iam.tokens[{name!r}] must be an object")
        audience, kind = spec.get("audience"), spec.get("tokenType")
        if not isinstance(audience, str) or not audience or len(audience) > MAX_AUDIENCE:
            raise PolicyError(f"iam.tokens[{name!r}].audience must be a non-empty string")
        if kind not in TOKEN_TYPES:
            raise PolicyError(f"iam.tokens[{name!r}].tokenType must be one of {TOKEN_TYPES}")
        out.append(TokenSpec(name, audience, kind))
    return tuple(out)


def to_api(tokens: tuple[TokenSpec, ...]) -> dict[str, Any]:
    return {"tokens": {t.name: {"audience": t.audience, "tokenType": t.token_type} for t in tokens}}


def subject(issuer: str, sandbox_id: str) -> str:
    """The token's `sub`: a SPIFFE ID in the issuer host's trust domain."""
    domain = urlsplit(issuer).hostname or "aenv.local"
    return f"spiffe://{domain}/sandbox/{sandbox_id}"


def claims(
    *,
    issuer: str,
    spec: TokenSpec,
    sandbox_id: str,
    template_id: str,
    now: float,
    ttl_s: int = TOKEN_TTL_S,
) -> dict[str, Any]:
    t = int(now)
    return {
        "iss": issuer,
        "sub": subject(issuer, sandbox_id),
        "aud": spec.audience,
        "iat": t,
        "nbf": t - 5,
        "exp": t + ttl_s,
        "jti": secrets.token_hex(16),
        "sandbox_id": sandbox_id,
        "template_id": template_id,
        "token_name": spec.name,
    }


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64url_int(n: int) -> str:
    return b64url(n.to_bytes((n.bit_length() + 7) // 8, "big"))


def encode_jwt(kid: str, payload: Mapping[str, Any], sign: Callable[[bytes], bytes]) -> str:
    """A compact RS256 JWT of `payload`, signed by `sign` (PKCS#1 v1.5, SHA-256)."""
    header = {"alg": "RS256", "typ": "JWT", "kid": kid}
    signing_input = (
        b64url(json.dumps(header, separators=(",", ":")).encode())
        + "."
        + b64url(json.dumps(dict(payload), separators=(",", ":")).encode())
    )
    return signing_input + "." + b64url(sign(signing_input.encode()))


def rsa_jwk(n: int, e: int, kid: str) -> dict[str, str]:
    return {
        "kty": "RSA",
        "use": "sig",
        "alg": "RS256",
        "kid": kid,
        "n": b64url_int(n),
        "e": b64url_int(e),
    }


def discovery(issuer: str) -> dict[str, Any]:
    """The OIDC discovery document (`/.well-known/openid-configuration`)."""
    return {
        "issuer": issuer,
        "jwks_uri": f"{issuer}/.well-known/jwks.json",
        "response_types_supported": ["id_token"],
        "subject_types_supported": ["public"],
        "id_token_signing_alg_values_supported": ["RS256"],
        "claims_supported": ["iss", "sub", "aud", "iat", "nbf", "exp", "jti", "sandbox_id"],
    }
