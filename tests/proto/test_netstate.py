"""What the node's watchdog and start-up make of the host's network state, without IO.

Rules: `data/nft_listing.json` is `nft -j list table inet aenvhfix` (handles
removed) after the node's own scripts built that table with slots 0 (the
internet allowed) and 3 (no internet, one allowOut address), as `SCRIPT`
below does; each test takes parts away from that listing, as a flushed
ruleset or another tool would, and checks what `diagnose` wants done.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from aenv.config import Config, derive_net_prefix
from aenv.proto.netpolicy import EgressPolicy, render_slot_rules, render_table
from aenv.proto.netstate import (
    AUTO_SLOT_CIDRS,
    PREFIX_RE,
    Claim,
    Diagnosis,
    Shape,
    SlotNames,
    claim_conflicts,
    diagnose,
    pick_range,
    range_users,
    shape_gaps,
    shape_of_listing,
    shape_of_script,
)

T = "aenvhfix"
LISTING: dict[str, Any] = json.loads(
    (Path(__file__).parent / "data" / "nft_listing.json").read_text()
)
TABLE = render_table(table=T, cidr="10.244.0.0/16", egress_cap=["198.51.100.0/24"])
POLICIES = {
    0: EgressPolicy(),
    3: EgressPolicy(allow_internet=False, allow_out=("198.51.100.1",)),
}


def slot_rules(i: int) -> str:
    return render_slot_rules(
        table=T, index=i, iface=f"{T}h{i}", sandbox_ip=f"10.244.0.{4 * i + 2}", policy=POLICIES[i]
    )


SLOTS = {
    i: SlotNames(netns=f"{T}-{i}", veth=f"{T}h{i}", rules=shape_of_script(slot_rules(i), table=T))
    for i in POLICIES
}
NETNS = {f"{T}-0", f"{T}-3", "someone-else"}
LINKS = {f"{T}h0", f"{T}h3", "lo", "eth0"}


def without(pred: Any) -> dict[str, Any]:
    """The listing without the objects `pred(kind, body)` is true for."""
    doc = copy.deepcopy(LISTING)
    doc["nftables"] = [o for o in doc["nftables"] if not pred(*next(iter(o.items())))]
    return doc


def edited(kind: str, name: str, **changes: Any) -> dict[str, Any]:
    doc = copy.deepcopy(LISTING)
    for o in doc["nftables"]:
        body = o.get(kind)
        if body is not None and body.get("name") == name:
            body.update(changes)
            for k, v in list(body.items()):
                if v is None:
                    del body[k]
    return doc


def check(listing: dict[str, Any] | None, **host: Any) -> Diagnosis:
    observed = None if listing is None else shape_of_listing(listing, table=T)
    return diagnose(
        table=shape_of_script(TABLE, table=T),
        slots=host.get("slots", SLOTS),
        observed=observed,
        netns=host.get("netns", NETNS),
        links=host.get("links", LINKS),
    )


def test_what_the_scripts_install_is_what_nft_lists() -> None:
    script = TABLE + "\n" + slot_rules(0) + "\n" + slot_rules(3)
    expected = shape_of_script(script, table=T)
    observed = shape_of_listing(json.dumps(LISTING), table=T)
    assert shape_gaps(expected, observed) == []
    assert observed.chains["forward"] == 5 and observed.chains["slot3"] == 5
    assert observed.ifaces == {f"{T}h0", f"{T}h3"}
    assert observed.dispatch == {f"{T}h0": "slot0", f"{T}h3": "slot3"}
    assert check(LISTING).healthy


def test_another_table_in_the_listing_is_not_ours() -> None:
    assert shape_of_listing(LISTING, table="aenvother") == Shape()


def test_a_flushed_ruleset_rewrites_the_table() -> None:
    found = check(None)
    assert found.table == "the table is gone" and found.rules == {}
    assert not found.netns_gone and not found.veth_gone


@pytest.mark.parametrize(
    ("listing", "why"),
    [
        (
            without(lambda k, b: k == "rule" and b["chain"] == "forward"),
            "chain forward has 0 of its 5 rules",
        ),
        (
            without(lambda k, b: "postrouting" in (b.get("name"), b.get("chain"))),
            "chain postrouting is missing",
        ),
        (edited("set", "blocked", elem=None), "set blocked is empty"),
        (without(lambda k, b: k == "map"), "set slots is missing"),
    ],
)
def test_a_damaged_base_rewrites_the_table(listing: dict[str, Any], why: str) -> None:
    found = check(listing)
    assert found.table is not None and why in found.table
    assert found.rules == {}  # the rewrite carries every slot's rules


def test_a_slot_missing_its_rules_gets_them_again() -> None:
    no_chain = without(
        lambda k, b: k in ("chain", "rule") and (b.get("chain") or b["name"]) == "slot3"
    )
    assert check(no_chain).rules == {3: "chain slot3 is missing"}
    no_rules = without(lambda k, b: k == "rule" and b["chain"] == "slot0")
    assert check(no_rules).rules == {0: "chain slot0 has 0 of its 6 rules"}
    out_of_ifaces = edited("set", "ifaces", elem=[f"{T}h0"])
    assert check(out_of_ifaces).rules == {3: f"{T}h3 is not in set ifaces"}
    no_jump = edited("map", "slots", elem=[[f"{T}h3", {"jump": {"target": "slot3"}}]])
    assert check(no_jump).rules == {0: f"{T}h0 does not jump to slot0"}
    found = check(no_chain)
    assert found.table is None and not found.healthy


def test_a_slot_not_open_is_not_checked() -> None:
    found = check(LISTING, slots={0: SLOTS[0]}, netns={f"{T}-0"}, links={f"{T}h0"})
    assert found.healthy  # slot 3's rules, netns and veth are not needed


def test_vanished_namespaces_and_veths_are_reported_per_slot() -> None:
    found = check(LISTING, netns={f"{T}-0"}, links={f"{T}h0"})
    assert found.netns_gone == (3,) and found.veth_gone == (3,)
    found = check(LISTING, netns={f"{T}-3"})
    assert found.netns_gone == (0,) and found.veth_gone == ()


# -- names and ranges at start --------------------------------------------------

OWN = re.compile(r"^aenvhh\d+$")


def test_range_users_are_other_programs_inside_the_range() -> None:
    addresses = [
        ("aenvhh3", "10.231.0.13/30"),  # this node's own slot
        ("docker0", "172.17.0.1/16"),
        ("eth0", "10.0.0.5/8"),  # a wide LAN around the range: not inside it
        ("wg0", "10.231.7.1/24"),
    ]
    routes = [
        ("aenvhh3", "10.231.0.12/30"),
        ("tun0", "10.0.0.0/8"),  # a VPN's wide route: slot routes are more specific
        ("tun0", "10.231.9.0/24"),
        ("eth0", "default"),
    ]
    found = range_users("10.231.0.0/16", addresses=addresses, routes=routes, own=OWN)
    assert found == ["address 10.231.7.1/24 on wg0", "route to 10.231.9.0/24 via tun0"]
    assert range_users("10.230.0.0/16", addresses=addresses, routes=routes, own=OWN) == []


def test_claims_conflict_on_home_prefix_or_overlapping_range() -> None:
    other = Claim(prefix="aenv1a2b3c", home="/var/lib/aenv", cidr="10.231.0.0/16", pid=42)
    ok = claim_conflicts(prefix="aenv9f8e7d", home="/srv/b", cidr="10.230.0.0/16", others=[other])
    assert ok == []
    found = claim_conflicts(
        prefix="aenv1a2b3c", home="/srv/b", cidr="10.231.128.0/17", others=[other]
    )
    assert len(found) == 2 and all("home /var/lib/aenv (pid 42)" in f for f in found)
    assert "names prefix 'aenv1a2b3c'" in found[0] and "10.231.0.0/16" in found[1]
    # a second node on the same home: that is what to say (its names follow from it)
    found = claim_conflicts(
        prefix="aenv1a2b3c", home="/var/lib/aenv", cidr="10.231.0.0/16", others=[other]
    )
    assert found == [
        "the aenv node with home /var/lib/aenv (pid 42) runs on this home already "
        "(each node needs its own AENV_HOME)"
    ]
    # the range is not chosen yet: only names and home count
    assert claim_conflicts(prefix="x", home="/srv/b", cidr=None, others=[other]) == []


def test_claim_round_trips_and_garbage_is_no_claim() -> None:
    c = Claim(prefix="aenvx", home="/h", cidr="10.231.0.0/16", pid=7)
    assert Claim.from_json(c.to_json()) == c
    assert Claim.from_json("") is None and Claim.from_json('{"prefix": 1}') is None


def test_a_range_is_picked_stable_and_free() -> None:
    def taken(*busy: str) -> Any:
        return lambda c: c in busy

    first = AUTO_SLOT_CIDRS[0]
    assert first == "10.231.0.0/16" and len(set(AUTO_SLOT_CIDRS)) == len(AUTO_SLOT_CIDRS)
    pick = pick_range
    assert pick(candidates=AUTO_SLOT_CIDRS, own_addresses=[], previous=None, taken=taken()) == first
    assert (
        pick(candidates=AUTO_SLOT_CIDRS, own_addresses=[], previous=None, taken=taken(first))
        == "10.230.0.0/16"
    )
    # sandboxes of this node still run in 10.229: that range again, whatever came before
    assert (
        pick(
            candidates=AUTO_SLOT_CIDRS,
            own_addresses=["10.229.0.1/30"],
            previous="10.228.0.0/16",
            taken=taken(),
        )
        == "10.229.0.0/16"
    )
    assert (
        pick(candidates=AUTO_SLOT_CIDRS, own_addresses=[], previous="10.228.0.0/16", taken=taken())
        == "10.228.0.0/16"
    )
    assert (
        pick(candidates=["10.231.0.0/16"], own_addresses=[], previous=None, taken=taken(first))
        is None
    )


def test_the_default_prefix_comes_from_the_node_identity(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    pa, pb = Config(home=a).effective_net_prefix, Config(home=b).effective_net_prefix
    assert pa != pb and PREFIX_RE.match(pa) and len(pa) == 10
    assert pa == derive_net_prefix(str(a.resolve())) == Config(home=a).effective_net_prefix
    (tmp_path / "link").symlink_to(a)
    assert Config(home=tmp_path / "link").effective_net_prefix == pa  # the resolved home
    env = {"AENV_HOME": str(a), "AENV_NET_PREFIX": "aenvt"}
    assert Config.from_env(env).effective_net_prefix == "aenvt"
    env["AENV_NET_PREFIX"] = ""  # set but empty: as unset
    assert Config.from_env(env).effective_net_prefix == pa
    env["AENV_NODE_ID"] = "node-7"
    assert Config.from_env(env).effective_net_prefix == derive_net_prefix("node-7")
    assert Config.from_env(env).slot_cidr is None
    assert Config.from_env({**env, "AENV_SLOT_CIDR": "10.9.0.0/16"}).slot_cidr == "10.9.0.0/16"
    with pytest.raises(ValueError, match="positive"):
        Config.from_env({**env, "AENV_NETWORK_CHECK_INTERVAL": "0"})
