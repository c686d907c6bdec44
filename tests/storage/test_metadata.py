"""The SQLite metadata store: round trips, filters, survival across reopen."""

from __future__ import annotations

import functools
import json
import sqlite3
from pathlib import Path

import trio

from aenv.storage.metadata import Metadata, MetadataStore, SandboxWrite


def test_sandbox_records_round_trip_and_survive_reopen(tmp_path: Path) -> None:
    db = tmp_path / "meta.db"
    s = MetadataStore(db)
    s.put_sandbox("a", "paused", {"id": "a", "n": 1}, now=1.0)
    s.put_sandbox("b", "running", {"id": "b"}, now=2.0)
    s.put_sandbox("a", "paused", {"id": "a", "n": 2}, now=3.0)
    assert s.get_sandbox("a") == {"id": "a", "n": 2}
    assert [d["id"] for d in s.list_sandboxes("paused")] == ["a"]
    s.close()
    s2 = MetadataStore(db)
    assert [d["id"] for d in s2.list_sandboxes()] == ["b", "a"]
    s2.delete_sandbox("a")
    assert s2.get_sandbox("a") is None


def test_snapshots_by_name_latest_build_wins(tmp_path: Path) -> None:
    s = MetadataStore(tmp_path / "m.db")
    s.put_snapshot("s1", "app", 10.0, {"id": "s1"})
    s.put_snapshot("s2", "app", 20.0, {"id": "s2"})
    s.put_snapshot("s3", None, 30.0, {"id": "s3"})
    assert s.latest_snapshot_named("app") == {"id": "s2"}
    assert [d["id"] for d in s.list_snapshots()] == ["s1", "s2", "s3"]
    s.delete_snapshot("s2")
    assert s.latest_snapshot_named("app") == {"id": "s1"}


async def test_async_wrapper(tmp_path: Path) -> None:
    m = Metadata(MetadataStore(tmp_path / "m.db"))
    await m.run(m.store.put_sandbox, "x", "paused", {"id": "x"}, 1.0)
    assert await m.run(m.store.get_sandbox, "x") == {"id": "x"}


def test_snapshots_by_template_and_source_in_a_file_from_before_those_columns(
    tmp_path: Path,
) -> None:
    db = tmp_path / "m.db"
    old = sqlite3.connect(db)  # the schema and rows of a node from before the index
    old.executescript(
        "CREATE TABLE snapshots (id TEXT PRIMARY KEY, name TEXT, "
        "created_at REAL NOT NULL, doc TEXT NOT NULL);"
    )
    for i, (template, source) in enumerate([("t1", "sb-a"), ("t2", "sb-a"), ("t1", "sb-b")]):
        doc = {"id": f"s{i}", "templateID": template, "sourceSandboxID": source}
        old.execute(
            "INSERT INTO snapshots VALUES (?, NULL, ?, ?)", (f"s{i}", float(i), json.dumps(doc))
        )
    old.commit()
    old.close()
    s = MetadataStore(db)
    assert [d["id"] for d in s.snapshots_of_template("t1")] == ["s0", "s2"]
    assert [d["id"] for d in s.snapshots_from("sb-a")] == ["s0", "s1"]
    s.put_snapshot("s3", None, 3.0, {"id": "s3", "templateID": "t2", "sourceSandboxID": "sb-b"})
    s.close()
    s = MetadataStore(db)  # opened again: nothing migrated twice, new rows indexed
    assert [d["id"] for d in s.snapshots_of_template("t2")] == ["s1", "s3"]
    assert [d["id"] for d in s.snapshots_from("sb-b")] == ["s2", "s3"]
    assert s.snapshots_of_template("t3") == []
    plan = s._db.execute(
        "EXPLAIN QUERY PLAN SELECT doc FROM snapshots WHERE template_id = ?", ("t1",)
    ).fetchall()
    assert "snapshots_template" in str(plan)  # a lookup, not a scan


def test_uploading_snapshots_and_layers_are_read_without_parsing_every_record(
    tmp_path: Path,
) -> None:
    s = MetadataStore(tmp_path / "m.db")
    for i, storage in enumerate(["local", "uploading", "durable", "uploading"]):
        doc = {"id": f"s{i}", "storage": storage, "layers": [f"l{i}", "l-shared"]}
        s.put_snapshot(f"s{i}", None, float(i), doc)
    assert [d["id"] for d in s.snapshots_uploading()] == ["s1", "s3"]
    s.put_snapshot("s1", None, 1.0, {"id": "s1", "storage": "durable", "layers": ["l1"]})
    assert [d["id"] for d in s.snapshots_uploading()] == ["s3"]
    assert s.snapshot_layer_ids() == {"l0", "l1", "l2", "l3", "l-shared"}
    plan = s._db.execute(
        "EXPLAIN QUERY PLAN SELECT doc FROM snapshots "
        "WHERE json_extract(doc, '$.storage') = 'uploading' ORDER BY created_at"
    ).fetchall()
    assert "snapshots_uploading" in str(plan)


def test_the_first_names_of_user_snapshots_come_from_indexes(tmp_path: Path) -> None:
    s = MetadataStore(tmp_path / "m.db")
    s.put_snapshot("snap-b", "zeta", 1.0, {"names": ["zeta"]})
    s.put_snapshot("snap-a", None, 2.0, {"names": []})
    s.put_snapshot("snap-c", "zeta", 3.0, {"names": ["zeta"]})  # a second build of zeta
    s.put_snapshot("snap-0", "~template/t@b", 4.0, {"names": ["~template/t@b"]})
    s.put_snapshot("snap-1", None, 5.0, {"names": ["~paused/sb"]})
    assert s.snapshot_names(10) == ["snap-a", "snap-b", "snap-c", "zeta"]
    assert s.snapshot_names(2) == ["snap-a", "snap-b"]


async def test_concurrent_sandbox_records_are_committed_together_in_order(
    tmp_path: Path,
) -> None:
    store = MetadataStore(tmp_path / "m.db")
    batches: list[int] = []
    write_many = store.write_sandboxes

    def counted(records: list[SandboxWrite], *, sync: bool = True) -> None:
        batches.append(len(records))
        write_many(records, sync=sync)

    store.write_sandboxes = counted  # type: ignore[method-assign]
    meta = Metadata(store)

    async def twice() -> None:  # one sandbox's records, one after the other: the later wins
        await meta.put_sandbox("s0", "running", {"n": 0}, 0.0)
        await meta.put_sandbox("s0", "frozen", {"n": 100}, 30.0)

    async def gone() -> None:  # a record deleted right after it was written
        await meta.put_sandbox("s20", "running", {"n": 20}, 0.0)
        await meta.delete_sandbox("s20")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(twice)
        nursery.start_soon(gone)
        for i in range(1, 20):
            nursery.start_soon(meta.put_sandbox, f"s{i}", "running", {"n": i}, float(i))
    assert sum(batches) == 23 and len(batches) < 23  # fewer syncs than records
    assert store.get_sandbox("s20") is None
    assert [store.get_sandbox(f"s{i}") for i in range(1, 20)] == [{"n": i} for i in range(1, 20)]
    assert store.get_sandbox("s0") == {"n": 100}
    store.close()
    # a failing commit fails every caller of its batch, not only the first
    broken = MetadataStore(tmp_path / "b.db")
    meta = Metadata(broken)
    broken.close()
    failures: list[Exception] = []

    async def put(i: int) -> None:
        try:
            await meta.put_sandbox(f"s{i}", "running", {}, 0.0)
        except Exception as exc:
            failures.append(exc)

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(put, i)
    assert len(failures) == 5


async def test_records_written_without_a_sync_are_there_after_a_reopen(tmp_path: Path) -> None:
    """`sync=False` skips only the wait for the disk: the record is committed (a
    node process that dies right after finds it), and later writes sync as before."""
    db = tmp_path / "m.db"
    store = MetadataStore(db)
    meta = Metadata(store)
    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(
                functools.partial(meta.put_sandbox, f"s{i}", "running", {"n": i}, 0.0, sync=False)
            )
        nursery.start_soon(meta.put_sandbox, "p", "paused", {"n": 9}, 0.0)
    await meta.delete_sandbox("s0", sync=False)
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL again
    reopened = sqlite3.connect(db)  # (as a restarted node would read it)
    ids = {r[0] for r in reopened.execute("SELECT id FROM sandboxes")}
    assert ids == {"s1", "s2", "s3", "s4", "p"}
    reopened.close()
    store.close()
