"""The cluster lab with a shared `file://` store: two nodes, one directory.

Rules: as tests/cluster/test_lab.py; the store is a directory of the lab's
that every node's AENV_STORE_URL names, so it cannot be cut off by the
network (the lab says so rather than pretend).
"""

from __future__ import annotations

import pytest
from e2b import Sandbox

from tests.cluster.lab import Lab, LabError, requires_lab

pytestmark = [requires_lab, pytest.mark.runsc, pytest.mark.lab(nodes=2, store="file")]


def test_a_durable_snapshot_from_one_node_starts_on_the_other(lab: Lab) -> None:
    assert lab.store_dir is not None
    src = Sandbox.create("base", timeout=120, **lab.node(0).sdk())
    try:
        src.files.write("/tmp/kept.txt", "made on node 0")
        with lab.node(0).client(timeout=120) as api:
            r = api.post(f"/sandboxes/{src.sandbox_id}/snapshots", json={"durable": True})
        assert r.status_code == 201, r.text
        snapshot_id = r.json()["snapshotID"]
    finally:
        src.kill()
    assert (lab.store_dir / "snapshots" / f"{snapshot_id}.json").is_file()
    child = Sandbox.create(snapshot_id, timeout=120, **lab.node(1).sdk())
    try:
        assert child.files.read("/tmp/kept.txt") == "made on node 0"
    finally:
        child.kill()


def test_a_file_store_cannot_be_cut_off(lab: Lab) -> None:
    with pytest.raises(LabError, match="file:// store"):
        lab.cut_store(0)
