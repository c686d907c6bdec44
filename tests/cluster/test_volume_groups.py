"""Which sandboxes a drain moves together (`aenv.cluster.moves.volume_groups`).

Rules: pure grouping, no nodes: sandboxes that share a volume, directly or
through a third, form one group (they move to one node with the volume);
those with no volume move alone.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from aenv.cluster.moves import volume_groups
from aenv.proto.volumes import VolumeMount


def _sbx(name: str, *volumes: str) -> Any:
    mounts = tuple(VolumeMount(v, f"/mnt/{v}", v) for v in volumes)
    return SimpleNamespace(sandbox_id=name, volume_mounts=mounts)


def test_sharers_move_together_transitively() -> None:
    actors = [
        _sbx("plain"),
        _sbx("a", "v1"),
        _sbx("b", "v2"),
        _sbx("c", "v1", "v2"),  # joins a's and b's groups
        _sbx("d", "v3"),
        _sbx("e", "v3"),
    ]
    alone, groups = volume_groups(actors)
    assert [a.sandbox_id for a in alone] == ["plain"]
    assert sorted(sorted(a.sandbox_id for a in g) for g in groups) == [["a", "b", "c"], ["d", "e"]]
