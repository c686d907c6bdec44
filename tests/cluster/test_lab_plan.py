"""The lab's plan, without a machine: addresses, ranges and fault scripts (no root needed)."""

from __future__ import annotations

import itertools
from ipaddress import ip_address, ip_network

import pytest

from tests.cluster.lab import MAX_NODES, SUBNET, node_ip, render_faults, slot_cidr


@pytest.mark.parametrize("nodes", [1, 3, 4, 5, MAX_NODES])
def test_every_node_gets_its_own_slot_range_and_address(nodes: int) -> None:
    ranges = [ip_network(slot_cidr(i, nodes)) for i in range(nodes)]
    assert all(r.num_addresses // 4 >= 1024 for r in ranges)  # a node's default max slots
    for a, b in itertools.combinations(ranges, 2):
        assert not a.overlaps(b)
    addresses = {ip_address(node_ip(i)) for i in range(nodes)}
    assert len(addresses) == nodes and all(a in SUBNET for a in addresses)


def test_fault_scripts_replace_the_table_and_drop_what_they_say() -> None:
    healthy = render_faults()
    assert "numgen" not in healthy and "elements" not in healthy
    faulty = render_faults(cut={"10.219.0.11", "10.219.0.2"}, loss_pct=12.5)
    assert "elements = { 10.219.0.11, 10.219.0.2 }" in faulty
    assert faulty.count("numgen random mod 10000 < 1250 drop") == 2  # both directions
    assert faulty.splitlines()[:3] == healthy.splitlines()[:3]  # add, delete, add: a swap
    with pytest.raises(ValueError):
        render_faults(loss_pct=101)
    with pytest.raises(ValueError):
        render_faults(cut={"not an address"})
