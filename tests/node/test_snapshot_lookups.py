"""Snapshot lookups by name or ID (`Snapshots.resolve`) stay right across writes.

Rules: a real SQLite metadata store in `tmp_path`; snapshots recorded without
memory images (the record is what a lookup reads). `resolve` remembers its
answers until the next write, so each step below writes and then looks up.
"""

from __future__ import annotations

from pathlib import Path

import trio

from aenv.node.snapshots import Snapshots
from aenv.storage.metadata import Metadata, MetadataStore


def _snapshots(tmp_path: Path) -> Snapshots:
    return Snapshots(tmp_path / "snapshots", Metadata(MetadataStore(tmp_path / "meta.db")))


async def test_a_name_resolves_to_its_newest_snapshot_after_every_write(tmp_path: Path) -> None:
    snaps = _snapshots(tmp_path)
    assert await snaps.resolve("agent") is None  # a miss, remembered...
    first = await snaps.record(doc={"name": "agent", "templateID": "base"}, image=None)
    # ...until a snapshot of that name is recorded
    assert (await snaps.resolve("agent") or {}).get("snapshotID") == first["snapshotID"]
    assert (await snaps.resolve(first["snapshotID"]) or {}).get("name") == "agent"
    await trio.sleep(0.01)  # (a later createdAt)
    second = await snaps.record(doc={"name": "agent", "templateID": "base"}, image=None)
    assert (await snaps.resolve("agent") or {}).get("snapshotID") == second["snapshotID"]
    await snaps.update(second["snapshotID"], storage="durable")
    assert (await snaps.resolve("agent") or {}).get("storage") == "durable"
    await snaps.delete(second["snapshotID"], local_only=True)
    assert (await snaps.resolve("agent") or {}).get("snapshotID") == first["snapshotID"]
    assert await snaps.resolve(second["snapshotID"]) is None
    await snaps.delete(first["snapshotID"], local_only=True)
    assert await snaps.resolve("agent") is None


async def test_a_caller_changing_its_answer_changes_no_later_answer(tmp_path: Path) -> None:
    snaps = _snapshots(tmp_path)
    await snaps.record(doc={"name": "agent", "layers": ["a"]}, image=None)
    for _ in range(3):  # (the first answer read from SQLite, the others remembered)
        got = await snaps.resolve("agent")
        assert got is not None and got["layers"] == ["a"] and got["name"] == "agent"
        got["layers"].append("b")
        got["name"] = "other"
