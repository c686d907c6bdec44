"""Best-of-K placement (aenv.proto.placement).

Rules: never a draining or full node; the emptier node wins; a node holding
the template wins a near tie; every node with room is in the answer, sampled
ones first; a burst spreads over the nodes.
"""

from __future__ import annotations

import collections
import random

from aenv.proto.placement import NodeLoad, rank

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
