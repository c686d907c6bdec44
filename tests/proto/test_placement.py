"""Best-of-K placement (aenv.proto.placement).

Rules: never a draining or full node; the emptier node wins; a node holding
the template wins a near tie; every node with room is in the answer, sampled
ones first; a burst spreads over the nodes. Nodes on one machine are scored
with one reading of its memory and CPU; a create placed on a node counts
there until the node's gossip shows it (or for `PENDING_S`), so a burst of
creates from one node spreads evenly even though loads are gossiped only
every few seconds.
"""

from __future__ import annotations

import collections
import random

import pytest

from aenv.proto.placement import (
    PENDING_S,
    NodeLoad,
    Pending,
    rank,
    room_to_resume,
    share_host,
    volume_holders,
)

GiB = 2**30


def _node(name: str, *, free_gib: float = 8, sandboxes: int = 0, **kw: object) -> NodeLoad:
    base: dict[str, object] = dict(
        node=name,
        mem_total=16 * GiB,
        mem_free=int(free_gib * GiB),
        cpus=4,
        cpu_load=0.0,
        sandboxes=sandboxes,
        max_sandboxes=100,
        disk_free=100 * GiB,
        templates=frozenset(),
        host="",
    )
    base.update(kw)
    return NodeLoad(**base)  # type: ignore[arg-type]


def test_draining_and_full_nodes_are_never_chosen() -> None:
    nodes = [_node("a", draining=True), _node("b", sandboxes=100), _node("c", free_gib=1)]
    assert [n.node for n in rank(nodes, template=None, rng=random.Random(1))] == ["c"]


def test_the_emptier_node_wins() -> None:
    nodes = [_node("a", free_gib=2, sandboxes=40), _node("b", free_gib=12, sandboxes=2)]
    assert rank(nodes, template=None, rng=random.Random(1))[0].node == "b"


def test_a_node_with_the_template_wins_a_near_tie() -> None:
    nodes = [_node("a", free_gib=8.5), _node("b", free_gib=8, templates=frozenset({"base"}))]
    assert rank(nodes, template="base", rng=random.Random(1))[0].node == "b"
    assert rank(nodes, template="other", rng=random.Random(1))[0].node == "a"


def test_every_node_with_room_is_a_fallback() -> None:
    nodes = [_node(f"n{i}") for i in range(10)]
    ranked = rank(nodes, template=None, k=3, rng=random.Random(7))
    assert sorted(n.node for n in ranked) == sorted(n.node for n in nodes)


def test_a_burst_on_equal_nodes_spreads() -> None:
    rng = random.Random(3)
    nodes = [_node(f"n{i}") for i in range(3)]
    firsts = collections.Counter(
        rank(nodes, template=None, k=2, rng=rng)[0].node for _ in range(300)
    )
    assert len(firsts) == 3 and min(firsts.values()) > 50


def test_gossiped_meta_round_trips_and_garbage_means_no_room() -> None:
    n = _node("a", templates=frozenset({"base"}))
    assert NodeLoad.from_json("a", n.to_json()) == n
    junk = NodeLoad.from_json("x", {"memTotal": "lots", "templates": "base", "maxSandboxes": True})
    assert not junk.has_room


def test_nodes_on_one_machine_share_its_freshest_reading() -> None:
    here = _node("a", free_gib=6, cpu_load=2.0, host="m1")
    b = _node("b", free_gib=7, host="m1")  # gossiped earlier, before memory went
    c1, c2 = _node("c1", free_gib=9, host="m2"), _node("c2", free_gib=8, host="m2")
    alone = _node("d", free_gib=10)  # no machine known: its own figures
    out = {n.node: n for n in share_host([here, b, c1, c2, alone], here)}
    assert (out["b"].mem_free, out["b"].cpu_load) == (here.mem_free, 2.0)
    assert out["b"].sandboxes == b.sandboxes
    assert out["c1"].mem_free == out["c2"].mem_free == c2.mem_free  # the fullest
    assert out["d"] == alone and out["a"] == here


def test_a_create_counts_on_its_node_until_its_gossip_shows_it() -> None:
    pending = Pending()
    b = _node("b", sandboxes=4)
    pending.placed(b, now=0.0)
    pending.placed(b, now=1.0)
    assert pending.apply([b], now=1.0)[0].sandboxes == 6
    # the node's gossip shows one of them
    assert pending.apply([_node("b", sandboxes=5)], now=2.0)[0].sandboxes == 6
    # and then both (another node's create landing there counts the same)
    assert pending.apply([_node("b", sandboxes=7)], now=2.5)[0].sandboxes == 7
    assert pending.statistics() == {}
    # one whose node never shows it (the create failed) counts for PENDING_S
    pending.placed(b, now=10.0)
    assert pending.apply([b], now=10.0 + PENDING_S - 0.1)[0].sandboxes == 5
    assert pending.apply([b], now=10.0 + PENDING_S)[0].sandboxes == 4


def _burst(seed: int) -> collections.Counter[str]:
    """30 creates through node a, one every 0.4 s, as `bench/cluster.py` makes
    them: three nodes on one machine, each gossiping its load every 3 s
    (at its own phase); each sandbox takes 35 MiB of the machine's memory."""
    rng = random.Random(seed)
    total, used = 24 * GiB, 1 * GiB

    def load(name: str, sandboxes: int) -> NodeLoad:
        return _node(
            name,
            mem_total=total,
            mem_free=total - used,
            sandboxes=sandboxes,
            max_sandboxes=256,  # the default
            host="m",
        )

    count = dict.fromkeys("abc", 0)
    phase = {"b": rng.uniform(0, 3), "c": rng.uniform(0, 3)}
    gossiped = {n: load(n, 0) for n in "bc"}
    pending = Pending()
    placed: collections.Counter[str] = collections.Counter()
    for i in range(30):
        now = i * 0.4
        for n in "bc":  # a gossip since the last create
            if int((now - phase[n]) // 3) != int((now - 0.4 - phase[n]) // 3):
                gossiped[n] = load(n, count[n])
        here = load("a", count["a"])
        known = {here.node: here, **gossiped}
        loads = pending.apply(share_host(known.values(), here), now)
        best = rank(loads, template=None, memory_mb=512, rng=rng)[0]
        pending.placed(known[best.node], now)
        placed[best.node] += 1
        count[best.node] += 1
        used += 35 * 2**20
    return placed


@pytest.mark.parametrize("seed", range(20))
def test_a_burst_from_one_node_spreads_evenly_over_one_machine(seed: int) -> None:
    placed = _burst(seed)
    assert all(8 <= placed[n] <= 12 for n in "abc"), placed  # the mean +/- 20 %


def test_a_resume_needs_its_memory_above_the_low_mark() -> None:
    gib = 2**30
    # 16 GiB host, low mark 10 % (1.6 GiB): 2.2 GiB free takes 512 MiB, 2 GiB does not
    assert room_to_resume(int(2.2 * gib), 16 * gib, 10.0, 512)
    assert not room_to_resume(2 * gib, 16 * gib, 10.0, 512)
    assert not room_to_resume(20 * gib, 16 * gib, 10.0, 32 * 1024)
    assert room_to_resume(512 * 2**20, 16 * gib, 0.0, 512)  # no low mark: what is free


def test_volumes_are_gossiped_and_their_holders_found() -> None:
    a = _node("a", volumes=frozenset({"v1", "data"}))
    b = _node("b", volumes=frozenset({"data"}))
    again = NodeLoad.from_json("a", a.to_json())
    assert again.volumes == a.volumes
    assert NodeLoad.from_json("x", {"volumes": "data"}).volumes == frozenset()
    assert [n.node for n in volume_holders([a, b], ["data"])] == ["a", "b"]
    assert [n.node for n in volume_holders([a, b], ["data", "v1"])] == ["a"]
    assert volume_holders([a, b], []) == []
