"""Nodes claiming names, homes and address ranges on one host.

Rules: no root and no network changes: every claim goes to a temp claims
directory, and the host's addresses and routes are given, not read. flock
locks belong to an open file, so claims held by this one process conflict
as claims of two node processes do. Every claim a test takes is released.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aenv.proto.netstate import Claim
from aenv.runtimes.hostclaim import HeldClaim, HostConflict, hold_claim


@pytest.fixture
def claims(tmp_path: Path) -> Iterator[Any]:
    held: list[HeldClaim] = []

    def claim(prefix: str, home: str, cidr: str | None = None, **host: Any) -> Claim:
        h = hold_claim(
            prefix=prefix,
            home=tmp_path / home,
            cidr=cidr,
            claims_dir=tmp_path / "run",
            addresses=host.get("addresses", []),
            routes=host.get("routes", []),
        )
        held.append(h)
        return h.claim

    claim.held = held
    try:
        yield claim
    finally:
        for h in held:
            if h.path.exists():
                h.release()


def test_nodes_get_ranges_of_their_own_and_say_who_holds_what(claims: Any, tmp_path: Path) -> None:
    a = claims("aenva", "a")
    assert (a.cidr, a.home) == ("10.231.0.0/16", str(tmp_path / "a"))
    assert json.loads((tmp_path / "run" / "aenva.json").read_text())["cidr"] == a.cidr
    b = claims("aenvb", "b")
    assert b.cidr == "10.230.0.0/16"
    with pytest.raises(HostConflict, match=r"uses the network names prefix 'aenva' \(give each"):
        claims("aenva", "c")
    with pytest.raises(HostConflict, match=r"runs on this home already \(each node needs"):
        claims("aenvc", "a")
    with pytest.raises(
        HostConflict, match=r"has its sandboxes in 10.230.0.0/16 \(set AENV_SLOT"
    ) as e:
        claims("aenvc", "c", "10.230.128.0/17")
    assert str(e.value).count("AENV_SLOT_CIDR") == 1  # what to change, said once
    # another program's addresses and routes in a range
    host = {"addresses": [("wg0", "10.229.1.1/24")], "routes": [("tun0", "10.228.0.0/16")]}
    with pytest.raises(HostConflict) as refused:
        claims("aenvc", "c", "10.229.0.0/16", **host)
    assert str(refused.value) == (
        "this node cannot start: its sandbox address range 10.229.0.0/16 (AENV_SLOT_CIDR) "
        "is in use on this host: address 10.229.1.1/24 on wg0; set AENV_SLOT_CIDR to a free "
        "range (such as 10.227.0.0/16), or unset it to have one picked"
    )
    assert claims("aenvc", "c", **host).cidr == "10.227.0.0/16"


def test_a_released_claim_frees_its_range_and_a_crashed_one_is_stale(
    claims: Any, tmp_path: Path
) -> None:
    first = claims("aenva", "a")
    claims.held[0].release()
    assert not (tmp_path / "run" / "aenva.json").exists()
    again = claims("aenvb", "b")
    assert again.cidr == first.cidr
    # a node that crashed leaves its file, unlocked: its names and range are free
    stale = Claim(prefix="aenvz", home=str(tmp_path / "z"), cidr="10.229.0.0/16", pid=1)
    (tmp_path / "run" / "aenvz.json").write_text(stale.to_json())
    c = claims("aenvc", "c", "10.229.0.0/16")
    assert c.cidr == "10.229.0.0/16"
    assert not (tmp_path / "run" / "aenvz.json").exists()  # cleared by the next claim


def test_a_restarted_node_keeps_its_range(claims: Any, tmp_path: Path) -> None:
    # its previous process (crashed: file left, lock gone) had 10.225.0.0/16
    old = Claim(prefix="aenva", home=str(tmp_path / "a"), cidr="10.225.0.0/16", pid=1)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "aenva.json").write_text(old.to_json())
    assert claims("aenva", "a").cidr == "10.225.0.0/16"
    claims.held[0].release()
    # its sandboxes still run in 10.226 (taken back at start): that range, whatever came before
    own = {"addresses": [("aenvah3", "10.226.0.13/30"), ("aenvx3", "10.231.0.1/30")]}
    assert claims("aenva", "a", **own).cidr == "10.226.0.0/16"


def test_every_range_taken_says_to_set_one(claims: Any) -> None:
    busy = [("eth9", f"10.{b}.0.1/16") for b in range(200, 232)]
    with pytest.raises(HostConflict, match=r"every range it picks .* set AENV_SLOT_CIDR"):
        claims("aenva", "a", addresses=busy)
