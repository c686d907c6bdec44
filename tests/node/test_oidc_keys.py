"""The node's OIDC issuer: keys rotated and kept in the JWKS while their tokens
live, and, in a cluster, one ring in the store every node signs and verifies with.

Rules: real keys, real signatures, real stores (a node's file, a `file://`
object store with its conditional writes); times are passed to `refresh` and
`mint`, so rotation is exact without waiting.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import trio
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from aenv.config import Config
from aenv.node.identity import RING_KEY, Issuer, KeyRingError, rotation
from aenv.proto.identity import TokenSpec
from aenv.proto.keyring import Rotation
from aenv.storage.objstore import open_object_store
from aenv.storage.shareddoc import FileDoc, StoreDoc, sealing_key

ROT = Rotation(period_s=1000.0, lead_s=100.0, token_ttl_s=300.0)
SPEC = TokenSpec("aws", "sts.test")


def _unb64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def verify(token: str, jwks: dict[str, Any]) -> dict[str, Any]:
    """The token's claims if a key of `jwks` signed it (else an exception)."""
    head, body, sig = token.split(".")
    kid = json.loads(_unb64(head))["kid"]
    (jwk,) = [k for k in jwks["keys"] if k["kid"] == kid]
    pub = rsa.RSAPublicNumbers(
        int.from_bytes(_unb64(jwk["e"]), "big"), int.from_bytes(_unb64(jwk["n"]), "big")
    ).public_key()
    pub.verify(_unb64(sig), f"{head}.{body}".encode(), padding.PKCS1v15(), hashes.SHA256())
    claims: dict[str, Any] = json.loads(_unb64(body))
    return claims


def kid_of(token: str) -> str:
    return str(json.loads(_unb64(token.split(".")[0]))["kid"])


def test_rotation_on_one_node(tmp_path: Path) -> None:
    doc = FileDoc(tmp_path / "ring.json")
    issuer = Issuer(doc, "https://node.test/", rotation=ROT)
    t0 = json.loads((tmp_path / "ring.json").read_text())["keys"][0]["added"]
    old = issuer.mint(SPEC, sandbox_id="s", template_id="t", now=t0)
    assert verify(old, issuer.jwks())["iss"] == "https://node.test"
    issuer.refresh(now=t0 + 1000)  # a new key: published, not signing yet
    assert len(issuer.jwks()["keys"]) == 2
    assert kid_of(issuer.mint(SPEC, sandbox_id="s", template_id="t", now=t0 + 1050)) == kid_of(old)
    new = issuer.mint(SPEC, sandbox_id="s", template_id="t", now=t0 + 1100)
    assert kid_of(new) != kid_of(old)
    issuer.refresh(now=t0 + 1500)  # the old key's last tokens may still be valid
    verify(old, issuer.jwks())
    issuer.refresh(now=t0 + 1501)
    assert [k["kid"] for k in issuer.jwks()["keys"]] == [kid_of(new)]
    with pytest.raises(ValueError):
        verify(old, issuer.jwks())
    # a restarted node reads the same ring: same keys, no new one
    again = Issuer(doc, "https://node.test", rotation=ROT)
    assert again.kids == issuer.kids
    assert (tmp_path / "ring.json").stat().st_mode & 0o077 == 0


def test_the_key_from_before_rotation_stays_valid(tmp_path: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    legacy = tmp_path / "key.pem"
    legacy.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    issuer = Issuer(FileDoc(tmp_path / "ring.json"), "https://n", rotation=ROT, legacy_key=legacy)
    token = issuer.mint(SPEC, sandbox_id="s", template_id="t")
    n = key.public_key().public_numbers().n
    (jwk,) = issuer.jwks()["keys"]
    assert int.from_bytes(_unb64(jwk["n"]), "big") == n
    verify(token, issuer.jwks())


async def test_a_cluster_shares_one_ring_through_the_store(tmp_path: Path) -> None:
    store = open_object_store((tmp_path / "store").as_uri())
    seal = sealing_key("cluster-secret", "oidc keys")

    def node(url: str, own: str | None = None) -> Issuer:
        return Issuer(
            StoreDoc(store, RING_KEY),
            own or url,
            rotation=ROT,
            seal=seal,
            ring_issuer=own is None,
        )

    a = await trio.to_thread.run_sync(node, "https://a.test")
    b = await trio.to_thread.run_sync(node, "https://b.test")
    # one issuer URL (the first writer's), one key
    assert a.issuer == b.issuer == "https://a.test" and a.kids == b.kids
    token = a.mint(SPEC, sandbox_id="s", template_id="t")
    assert verify(token, b.jwks())["iss"] == "https://a.test"
    # the private key is in the store only encrypted
    raw = (await store.get(RING_KEY)).decode()
    assert "PRIVATE KEY" not in raw and "https://a.test" in raw
    # both nodes rotate at once: one new key, which both publish
    t = json.loads(raw)["keys"][0]["added"] + 1000
    async with trio.open_nursery() as nursery:
        for issuer in (a, b):
            nursery.start_soon(trio.to_thread.run_sync, lambda i=issuer: i.refresh(now=t))
    assert len(a.kids) == 2 and a.kids == b.kids
    later = b.mint(SPEC, sandbox_id="s", template_id="t", now=t + 100)
    assert kid_of(later) == a.kids[1]
    verify(later, a.jwks())
    # a node with its own AENV_OIDC_ISSUER keeps it; a wrong cluster secret cannot read the ring
    c = await trio.to_thread.run_sync(node, "https://c.test", "https://c.test")
    assert c.issuer == "https://c.test" and c.kids == a.kids
    with pytest.raises(KeyRingError, match="AENV_CLUSTER_SECRET"):
        await trio.to_thread.run_sync(
            lambda: Issuer(
                StoreDoc(store, RING_KEY),
                "https://d.test",
                rotation=ROT,
                seal=sealing_key("another-secret", "oidc keys"),
            )
        )


def test_rotation_period_from_the_environment(tmp_path: Path) -> None:
    home = {"AENV_HOME": str(tmp_path)}
    assert Config.from_env(home).oidc_rotate_s == 7 * 24 * 3600
    cfg = Config.from_env({**home, "AENV_OIDC_ROTATE_S": "3600"})
    assert rotation(cfg.oidc_rotate_s) == Rotation(period_s=3600, lead_s=120, token_ttl_s=300)
    assert rotation(60).lead_s == 6  # a tenth of short periods
    with pytest.raises(ValueError, match="AENV_OIDC_ROTATE_S"):
        Config.from_env({**home, "AENV_OIDC_ROTATE_S": "0"})
