"""The OIDC key ring's rotation rules, at exact times: added, signing, dropped."""

from __future__ import annotations

from aenv.proto.keyring import KeyRing, Rotation

R = Rotation(period_s=1000.0, lead_s=100.0, token_ttl_s=300.0)


def _add(ring: KeyRing, now: float, kid: str) -> KeyRing:
    assert R.needs_key(ring, now)
    return R.add(ring, now, kid=kid, material="m-" + kid)


def test_a_new_key_is_published_before_it_signs_and_the_old_kept_while_its_tokens_live() -> None:
    ring = _add(KeyRing(issuer="https://i"), 0.0, "a")
    assert ring.signing(0.0).kid == "a"  # type: ignore[union-attr]  # the first key signs at once
    assert not R.needs_key(ring, 999.0)
    ring = _add(ring, 1000.0, "b")
    # published at 1000, signing from 1100: "a" signs meanwhile
    assert [k.kid for k in ring.keys] == ["a", "b"]
    assert ring.signing(1099.0).kid == "a"  # type: ignore[union-attr]
    assert ring.signing(1100.0).kid == "b"  # type: ignore[union-attr]
    # "a" signed until 1100 (until 1200 on a node that had not re-read the
    # ring): its last tokens live 300 s more
    assert [k.kid for k in R.prune(ring, 1500.0).keys] == ["a", "b"]
    assert [k.kid for k in R.prune(ring, 1500.1).keys] == ["b"]


def test_round_trip_and_an_empty_ring() -> None:
    ring = _add(_add(KeyRing(issuer=None), 5.0, "a"), 2000.0, "b")
    assert KeyRing.from_doc(ring.to_doc()) == ring
    assert KeyRing().signing(0.0) is None
    assert R.prune(KeyRing(), 10.0) == KeyRing()
