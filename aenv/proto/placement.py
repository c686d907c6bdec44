"""Where a new sandbox goes: best-of-K sampling over the cluster's nodes, sans-IO.

Each node gossips its capacity and load (`NodeLoad`). `rank` draws K
candidates at random among the nodes that may take work (alive, not
draining, with room), scores them and returns them best first, so a caller
tries the best and falls back to the next when a create fails there. Sampling
K instead of scoring every node keeps the choice cheap with thousands of
nodes and spreads a burst of creates from many nodes (each with slightly stale
load figures) instead of sending them all to the one node that looked
emptiest ("the power of two choices").

Score: the share of memory and CPU that would be free, minus the share of
sandbox slots in use; a node that holds the template (or snapshot) in its
cache gets a bonus worth a tie-break, since it starts the sandbox without a
download.

Two corrections make the figures comparable before they are scored:

- `share_host`: nodes on one machine (the same `host`, its boot ID) share
  its memory and CPU, but each gossiped them at another moment, every few
  seconds. Scored as they are, the node measured last looks the fullest
  (everything started on the machine since the others' readings counts
  against it alone) and a burst of creates goes wherever the oldest reading
  is. They get one reading, the freshest there is, so only what differs
  between them (their sandboxes, templates) decides.
- `Pending`: creates this node placed on a node recently, which that node's
  gossiped load does not show yet (a load is measured every few seconds):
  without them every create of a burst goes to the same node until its
  next gossip.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

DEFAULT_K = 3
LOCALITY_BONUS = 0.15
# How long a create this node placed counts for its node before that node's
# gossip shows it: a load gossiped every 3 s, plus its dissemination.
PENDING_S = 10.0


@dataclass(frozen=True)
class NodeLoad:
    node: str
    mem_total: int  # bytes
    mem_free: int  # bytes
    cpus: int
    cpu_load: float  # runnable tasks (load average)
    sandboxes: int
    max_sandboxes: int
    disk_free: int  # bytes
    templates: frozenset[str]
    draining: bool = False
    host: str = ""  # the machine's boot ID: nodes sharing it share memory and CPU ("" unknown)
    # the IDs and names of the volumes on its disk (a sandbox mounting them goes there)
    volumes: frozenset[str] = frozenset()

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "memTotal": self.mem_total,
            "memFree": self.mem_free,
            "cpus": self.cpus,
            "cpuLoad": round(self.cpu_load, 2),
            "sandboxes": self.sandboxes,
            "maxSandboxes": self.max_sandboxes,
            "diskFree": self.disk_free,
            "templates": sorted(self.templates),
            "draining": self.draining,
            "volumes": sorted(self.volumes),
        }

    @classmethod
    def from_json(cls, node: str, doc: Mapping[str, Any]) -> NodeLoad:
        """From a member's gossiped meta; missing or bad fields count as no room."""

        def num(key: str) -> float:
            v = doc.get(key)
            return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0

        templates = doc.get("templates")
        volumes = doc.get("volumes")
        return cls(
            node=node,
            mem_total=int(num("memTotal")),
            mem_free=int(num("memFree")),
            cpus=max(1, int(num("cpus"))),
            cpu_load=num("cpuLoad"),
            sandboxes=int(num("sandboxes")),
            max_sandboxes=int(num("maxSandboxes")),
            disk_free=int(num("diskFree")),
            templates=frozenset(t for t in templates if isinstance(t, str))
            if isinstance(templates, list)
            else frozenset(),
            draining=bool(doc.get("draining")),
            host=str(doc.get("host") or "")[:64],
            volumes=frozenset(v for v in volumes if isinstance(v, str))
            if isinstance(volumes, list)
            else frozenset(),
        )

    @property
    def has_room(self) -> bool:
        return not self.draining and self.sandboxes < self.max_sandboxes and self.mem_free > 0


def room_to_resume(available: int, total: int, low_pct: float, memory_mb: int) -> bool:
    """Whether a host with `available` of `total` bytes of memory can resume a
    sandbox of `memory_mb` and stay above its low mark (`low_pct` of total, the
    mark below which paused sandboxes are hibernated to free memory)."""
    return available - memory_mb * 2**20 >= total * low_pct / 100


def score(n: NodeLoad, template: str | None, memory_mb: int = 512) -> float:
    mem = (n.mem_free - memory_mb * 2**20) / n.mem_total if n.mem_total else -1.0
    cpu = 1.0 - min(1.0, n.cpu_load / n.cpus)
    slots = n.sandboxes / n.max_sandboxes if n.max_sandboxes else 1.0
    s = mem + 0.5 * cpu - slots
    if template is not None and template in n.templates:
        s += LOCALITY_BONUS
    return s


def rank(
    nodes: Sequence[NodeLoad],
    *,
    template: str | None,
    memory_mb: int = 512,
    k: int = DEFAULT_K,
    rng: random.Random,
) -> list[NodeLoad]:
    """Up to `k` sampled nodes with room, best first; then the rest with room,
    best first, as fallbacks (a create that fails everywhere sampled goes on)."""
    able = [n for n in nodes if n.has_room]
    sampled = rng.sample(able, min(k, len(able)))
    rest = [n for n in able if n not in sampled]

    def key(n: NodeLoad) -> float:
        return -score(n, template, memory_mb)

    # a stable sort: equal scores keep the sample's random order
    return sorted(sampled, key=key) + sorted(rest, key=key)


def share_host(loads: Iterable[NodeLoad], here: NodeLoad) -> list[NodeLoad]:
    """`loads` with one memory and CPU reading per machine: this node's (measured
    now) for the nodes on its machine, the fullest gossiped one for the nodes
    sharing another."""
    loads = list(loads)
    freshest: dict[str, NodeLoad] = {}
    for n in loads:
        if n.host and n.host != here.host:
            best = freshest.get(n.host)
            if best is None or n.mem_free < best.mem_free:
                freshest[n.host] = n
    if here.host:
        freshest[here.host] = here
    out = []
    for n in loads:
        f = freshest.get(n.host) if n.host else None
        if f is not None and f is not n:
            n = replace(
                n, mem_total=f.mem_total, mem_free=f.mem_free, cpus=f.cpus, cpu_load=f.cpu_load
            )
        out.append(n)
    return out


@dataclass
class _Placed:
    base: int  # the node's gossiped sandboxes when the oldest of `at` was placed
    at: list[float] = field(default_factory=list)  # when each create was placed, oldest first


class Pending:
    """Creates this node placed on each node that the node's load does not show yet.

    A create placed on a node counts as one more sandbox there until the
    node's gossiped sandbox count rises past what it was when the create was
    placed, or `within` seconds passed (the create failed, or sandboxes went
    away there meanwhile). Time is an argument: sans-IO.
    """

    def __init__(self, *, within: float = PENDING_S) -> None:
        self.within = within
        self._by_node: dict[str, _Placed] = {}

    def placed(self, load: NodeLoad, now: float) -> None:
        """A create goes to `load.node`, whose load is `load` as this node knows it."""
        p = self._by_node.setdefault(load.node, _Placed(base=load.sandboxes))
        p.at.append(now)

    def apply(self, loads: Iterable[NodeLoad], now: float) -> list[NodeLoad]:
        """`loads` with what is pending on each node added to its sandboxes."""
        out = []
        for n in loads:
            p = self._by_node.get(n.node)
            if p is not None:
                self._settle(p, n.sandboxes, now)
                if p.at:
                    n = replace(n, sandboxes=n.sandboxes + len(p.at))
                else:
                    del self._by_node[n.node]
            out.append(n)
        return out

    def statistics(self) -> dict[str, int]:
        return {node: len(p.at) for node, p in self._by_node.items() if p.at}

    def _settle(self, p: _Placed, sandboxes: int, now: float) -> None:
        shown = max(0, sandboxes - p.base)
        expired = sum(1 for t in p.at if now - t >= self.within)
        done = min(len(p.at), max(shown, expired))
        del p.at[:done]
        p.base += done


def volume_holders(nodes: Iterable[NodeLoad], volumes: Iterable[str]) -> list[NodeLoad]:
    """The nodes that hold every one of `volumes` (by ID or name) on their disk:
    a sandbox that mounts them shares their files live only there."""
    wanted = frozenset(volumes)
    return [n for n in nodes if wanted and wanted <= n.volumes]
