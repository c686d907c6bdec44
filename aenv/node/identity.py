"""The node as an OIDC issuer for sandboxes' workload tokens (`aenv.proto.identity`).

An RSA key (`{home}/oidc/key.pem`, 0600, made on first use) signs RS256
JWTs; its public half is the JWKS (`/.well-known/jwks.json`), `kid` its
RFC 7638 thumbprint. The issuer URL is `AENV_OIDC_ISSUER`, else the node's
advertised URL: a relying party must reach it to fetch the JWKS. Keys are
the node's own (not rotated nor shared across a cluster yet). Blocking
(key file, signing): call from a worker thread.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from aenv.kit.files import write_atomic
from aenv.proto.identity import (
    TokenSpec,
    b64url,
    b64url_int,
    claims,
    discovery,
    encode_jwt,
    rsa_jwk,
)


class Issuer:
    def __init__(self, directory: Path, issuer: str) -> None:
        self.issuer = issuer.rstrip("/")
        self._lock = threading.Lock()
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = directory / "key.pem"
        if not path.exists():
            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            write_atomic(
                path,
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                ),
            )
            os.chmod(path, 0o600)
        loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
        assert isinstance(loaded, rsa.RSAPrivateKey)
        self._key = loaded
        numbers = loaded.public_key().public_numbers()
        canonical = json.dumps(
            {"e": b64url_int(numbers.e), "kty": "RSA", "n": b64url_int(numbers.n)},
            separators=(",", ":"),
            sort_keys=True,
        )
        self.kid = b64url(hashlib.sha256(canonical.encode()).digest())
        self._jwk = rsa_jwk(numbers.n, numbers.e, self.kid)

    def jwks(self) -> dict[str, Any]:
        return {"keys": [self._jwk]}

    def discovery(self) -> dict[str, Any]:
        return discovery(self.issuer)

    def mint(self, spec: TokenSpec, *, sandbox_id: str, template_id: str) -> str:
        """A fresh token for `spec` of the sandbox (valid `TOKEN_TTL_S`)."""
        payload = claims(
            issuer=self.issuer,
            spec=spec,
            sandbox_id=sandbox_id,
            template_id=template_id,
            now=time.time(),
        )
        with self._lock:
            return encode_jwt(
                self.kid,
                payload,
                lambda data: self._key.sign(data, padding.PKCS1v15(), hashes.SHA256()),
            )
