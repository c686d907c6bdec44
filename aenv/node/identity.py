"""The node as an OIDC issuer for sandboxes' workload tokens (`aenv.proto.identity`).

RSA keys (2048 bits) sign RS256 JWTs; the JWKS (`/.well-known/jwks.json`)
lists every key of the ring, `kid` each key's RFC 7638 thumbprint. Keys are
rotated as `aenv.proto.keyring` says: a new one every `AENV_OIDC_ROTATE_S`
(default 7 days), published before it signs, the old one listed until the
tokens it signed have expired. The ring is a `aenv.storage.shareddoc`
document:

- on its own, the node's file `{home}/oidc/ring.json` (0600, private keys in
  PEM; a `key.pem` from before rotation becomes the ring's first key, so its
  tokens and `kid` stay valid);
- in a cluster with a store (`AENV_STORE_URL` and `AENV_CLUSTER_SECRET`),
  the store's `identity/oidc-ring.json`, private keys encrypted (AES-256-GCM)
  under a key derived from the cluster secret: every node signs with the
  same key and serves the same JWKS, so a token minted by one node verifies
  against any node's JWKS. The issuer URL is then the ring's (the first
  writer's `AENV_OIDC_ISSUER`, else its advertised URL) unless a node sets
  `AENV_OIDC_ISSUER` itself.

`refresh` re-reads the ring, adds and drops keys when due (conditional
writes: nodes refreshing at once add one key, not two) and installs it; the
node calls it every `lead_s / 2`. Blocking (files, store via the trio
loop, signing): call from a worker thread.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from aenv.config import Config
from aenv.proto.identity import (
    TOKEN_TTL_S,
    TokenSpec,
    b64url,
    b64url_int,
    claims,
    discovery,
    encode_jwt,
    rsa_jwk,
)
from aenv.proto.keyring import KeyRing, RingKey, Rotation
from aenv.storage.objstore import ObjectStore
from aenv.storage.shareddoc import FileDoc, Json, SharedDoc, StoreDoc, sealing_key, update_json

log = logging.getLogger("aenv.identity")

RING_KEY = "identity/oidc-ring.json"


class KeyRingError(Exception):
    """The ring cannot be used (its keys do not decrypt with this node's secret)."""


def rotation(period_s: float) -> Rotation:
    """The rotation of a `period_s` period: keys are published a tenth of it
    (at most 2 minutes) before they sign, and nodes re-read the ring twice as often."""
    return Rotation(period_s=period_s, lead_s=min(period_s / 10, 120.0), token_ttl_s=TOKEN_TTL_S)


def _kid(key: rsa.RSAPrivateKey) -> str:
    numbers = key.public_key().public_numbers()
    canonical = json.dumps(
        {"e": b64url_int(numbers.e), "kty": "RSA", "n": b64url_int(numbers.n)},
        separators=(",", ":"),
        sort_keys=True,
    )
    return b64url(hashlib.sha256(canonical.encode()).digest())


def _pem(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_pem(pem: bytes) -> rsa.RSAPrivateKey:
    key = serialization.load_pem_private_key(pem, password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    return key


class Issuer:
    """The ring in `doc`; `seal` (32 bytes) encrypts private keys in it (a
    cluster's store), None keeps them in PEM (the node's own 0600 file).
    `issuer` is this node's URL for the issuer; with `ring_issuer` the ring's
    own (its first writer's) is used instead."""

    def __init__(
        self,
        doc: SharedDoc,
        issuer: str,
        *,
        rotation: Rotation,
        seal: bytes | None = None,
        ring_issuer: bool = False,
        legacy_key: Path | None = None,
    ) -> None:
        self.issuer = issuer.rstrip("/")
        self.rotation = rotation
        self._doc = doc
        self._own_issuer = self.issuer
        self._ring_issuer = ring_issuer
        self._aead = None if seal is None else AESGCM(seal)
        self._legacy = legacy_key
        self._lock = threading.Lock()
        self._ring = KeyRing()
        self._keys: dict[str, rsa.RSAPrivateKey] = {}
        self._made: dict[str, rsa.RSAPrivateKey] = {}  # by this node, not yet installed
        self._jwks: dict[str, dict[str, str]] = {}
        self.refresh()

    # -- the ring ----------------------------------------------------------------

    def _material(self, kid: str, key: rsa.RSAPrivateKey) -> str:
        pem = _pem(key)
        if self._aead is None:
            return pem.decode()
        nonce = secrets.token_bytes(12)
        return base64.b64encode(nonce + self._aead.encrypt(nonce, pem, kid.encode())).decode()

    def _unseal(self, kid: str, material: str) -> rsa.RSAPrivateKey:
        if self._aead is None:
            return _load_pem(material.encode())
        raw = base64.b64decode(material)
        try:
            return _load_pem(self._aead.decrypt(raw[:12], raw[12:], kid.encode()))
        except InvalidTag:
            raise KeyRingError(
                f"OIDC key {kid} in the store does not decrypt: is AENV_CLUSTER_SECRET "
                "the one the other nodes use?"
            ) from None

    def _change(self, now: float, current: Json | None) -> Json | None:
        if current is None:
            ring = KeyRing(issuer=self._own_issuer)
            if self._legacy is not None and self._legacy.exists():
                # the key from before rotation: still what its tokens verify with
                old = _load_pem(self._legacy.read_bytes())
                first = RingKey(
                    kid=_kid(old),
                    added=self._legacy.stat().st_mtime,
                    signs_from=0.0,
                    material=self._material(_kid(old), old),
                )
                ring = KeyRing(issuer=ring.issuer, keys=(first,))
        else:
            ring = KeyRing.from_doc(current)
        changed = current is None
        if self.rotation.needs_key(ring, now):
            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            kid = _kid(key)
            self._made[kid] = key
            ring = self.rotation.add(ring, now, kid=kid, material=self._material(kid, key))
            changed = True
        pruned = self.rotation.prune(ring, now)
        if pruned != ring:
            ring, changed = pruned, True
        return ring.to_doc() if changed else None

    def refresh(self, now: float | None = None) -> None:
        """Re-read the ring, add or drop keys when due, and sign with it from now on."""
        t = time.time() if now is None else now
        doc = update_json(self._doc, lambda current: self._change(t, current))
        assert doc is not None
        ring = KeyRing.from_doc(doc)
        known = {**self._keys, **self._made}
        keys = {k.kid: known.get(k.kid) or self._unseal(k.kid, k.material) for k in ring.keys}
        self._made.clear()
        jwks = {}
        for kid, key in keys.items():
            numbers = key.public_key().public_numbers()
            jwks[kid] = self._jwks.get(kid) or rsa_jwk(numbers.n, numbers.e, kid)
        with self._lock:
            before = {k.kid for k in self._ring.keys}
            self._ring, self._keys, self._jwks = ring, keys, jwks
            if self._ring_issuer and ring.issuer:
                self.issuer = ring.issuer
        added = [k for k in keys if k not in before]
        if added and before:
            log.info("OIDC signing keys now %s (added %s)", ", ".join(keys), ", ".join(added))

    @property
    def kids(self) -> list[str]:
        with self._lock:
            return [k.kid for k in self._ring.keys]

    # -- what the API and the egress proxy use --------------------------------------

    def jwks(self) -> dict[str, Any]:
        with self._lock:
            return {"keys": list(self._jwks.values())}

    def discovery(self) -> dict[str, Any]:
        return discovery(self.issuer)

    def mint(
        self, spec: TokenSpec, *, sandbox_id: str, template_id: str, now: float | None = None
    ) -> str:
        """A fresh token for `spec` of the sandbox (valid `TOKEN_TTL_S`)."""
        t = time.time() if now is None else now
        with self._lock:
            current = self._ring.signing(t)
            if current is None:
                raise RuntimeError("no OIDC signing key has started yet")
            key, issuer = self._keys[current.kid], self.issuer
        payload = claims(
            issuer=issuer, spec=spec, sandbox_id=sandbox_id, template_id=template_id, now=t
        )
        return encode_jwt(
            current.kid, payload, lambda data: key.sign(data, padding.PKCS1v15(), hashes.SHA256())
        )


def open_issuer(config: Config, store: ObjectStore | None) -> Issuer:
    """The node's issuer: its ring in the cluster's store when the node has one
    and a cluster secret, else in `{home}/oidc`. Blocking."""
    directory = config.home / "oidc"
    own = config.oidc_issuer or config.effective_advertise_url
    rot = rotation(config.oidc_rotate_s)
    if store is not None and config.cluster_secret:
        return Issuer(
            StoreDoc(store, RING_KEY),
            own,
            rotation=rot,
            seal=sealing_key(config.cluster_secret, "oidc keys"),
            ring_issuer=config.oidc_issuer is None,
        )
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    return Issuer(
        FileDoc(directory / "ring.json"), own, rotation=rot, legacy_key=directory / "key.pem"
    )


async def keep_keys(issuer: Issuer, _stop: object = None) -> None:
    """Re-read (and rotate) the ring every half publication lead, for as long as the node runs."""
    every = issuer.rotation.lead_s / 2
    while True:
        await trio.sleep(every)
        try:
            await trio.to_thread.run_sync(issuer.refresh)
        except Exception as e:
            # the store may be down a while: keep signing with the ring already read
            log.warning("could not re-read the OIDC key ring (kept the current one): %r", e)
