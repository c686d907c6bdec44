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
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_K = 3
LOCALITY_BONUS = 0.15


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

    def to_json(self) -> dict[str, Any]:
        return {
            "memTotal": self.mem_total,
            "memFree": self.mem_free,
            "cpus": self.cpus,
            "cpuLoad": round(self.cpu_load, 2),
            "sandboxes": self.sandboxes,
            "maxSandboxes": self.max_sandboxes,
            "diskFree": self.disk_free,
            "templates": sorted(self.templates),
            "draining": self.draining,
        }

    @classmethod
    def from_json(cls, node: str, doc: Mapping[str, Any]) -> NodeLoad:
        """From a member's gossiped meta; missing or bad fields count as no room."""

        def num(key: str) -> float:
            v = doc.get(key)
            return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0

        templates = doc.get("templates")
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
        )

    @property
    def has_room(self) -> bool:
        return not self.draining and self.sandboxes < self.max_sandboxes and self.mem_free > 0


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
