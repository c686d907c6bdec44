"""The OIDC issuer's signing keys over time: when to add one, which signs, which
to drop, without IO (`aenv.node.identity` keeps the ring in a file or, in a
cluster, in the store).

A ring is a list of keys, oldest first, each with the time it was added and
the time it starts signing. The rules:

- a key is added when the newest one is `period_s` old (or there is none);
  it starts signing `lead_s` after it is added (the first key of a ring at
  once), so every node that re-reads the ring at least every `lead_s` lists
  it in its JWKS before any token it signs exists;
- the signing key is the newest one whose start has come;
- a key is dropped once a newer key has been signing for longer than a
  token lives plus `lead_s` (a node that had not yet seen the newer key
  still signed with it until then): no token it signed can still be valid.

Every key of the ring is published in the JWKS, including one not signing
yet. The ring also records the issuer URL its first writer used, so the
nodes of a cluster name one issuer. `material` is opaque here: the node
layer's serialised (in a cluster, encrypted) private key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

FORMAT: Final = 1


@dataclass(frozen=True, kw_only=True)
class RingKey:
    kid: str
    added: float
    signs_from: float
    material: str


@dataclass(frozen=True, kw_only=True)
class KeyRing:
    issuer: str | None = None
    keys: tuple[RingKey, ...] = ()

    def signing(self, now: float) -> RingKey | None:
        """The key tokens are signed with at `now` (None: none has started yet)."""
        started = [k for k in self.keys if k.signs_from <= now]
        return started[-1] if started else None

    def to_doc(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "issuer": self.issuer,
            "keys": [
                {"kid": k.kid, "added": k.added, "signsFrom": k.signs_from, "material": k.material}
                for k in self.keys
            ],
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> KeyRing:
        if doc.get("format") != FORMAT:
            raise ValueError(f"unknown key ring format {doc.get('format')!r}")
        return cls(
            issuer=doc.get("issuer"),
            keys=tuple(
                RingKey(
                    kid=str(k["kid"]),
                    added=float(k["added"]),
                    signs_from=float(k["signsFrom"]),
                    material=str(k["material"]),
                )
                for k in doc["keys"]
            ),
        )


@dataclass(frozen=True, kw_only=True)
class Rotation:
    period_s: float
    lead_s: float
    token_ttl_s: float

    def needs_key(self, ring: KeyRing, now: float) -> bool:
        return not ring.keys or ring.keys[-1].added + self.period_s <= now

    def add(self, ring: KeyRing, now: float, *, kid: str, material: str) -> KeyRing:
        """`ring` with a new key (signing at once if the ring had none)."""
        starts = now if not ring.keys else now + self.lead_s
        key = RingKey(kid=kid, added=now, signs_from=starts, material=material)
        return replace(ring, keys=(*ring.keys, key))

    def prune(self, ring: KeyRing, now: float) -> KeyRing:
        """`ring` without the keys no valid token can have been signed with."""
        keep = []
        for i, k in enumerate(ring.keys):
            later = ring.keys[i + 1 :]
            retired = min((n.signs_from for n in later), default=None)
            if retired is not None and retired + self.token_ttl_s + self.lead_s < now:
                continue
            keep.append(k)
        return replace(ring, keys=tuple(keep))
