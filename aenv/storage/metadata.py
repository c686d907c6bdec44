"""The node's embedded metadata store: SQLite, one file under $AENV_HOME.

Records are small JSON documents keyed by ID in a few tables (sandboxes that
must outlive the process, i.e. paused ones, and snapshots), with indexed
columns for what is looked up (a snapshot's name, template and source
sandbox), so no lookup reads every record. Every write is
one transaction in WAL mode with `synchronous=FULL`, so a crash leaves either
the old or the new record, never half of one. Sandbox records the caller
marks `sync=False` (a running sandbox's, which no host crash could leave
anything to take back from) are committed with `synchronous=NORMAL`: in the
WAL, so a crash of the node process keeps them, without waiting for the disk. SQLite calls block, so the
async `Metadata` wrapper runs them in a worker thread, one at a time, and
commits the sandbox records of concurrent callers in one transaction.
"""

from __future__ import annotations

import functools
import json
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    updated_at REAL NOT NULL,
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE TABLE IF NOT EXISTS snapshots (
    id TEXT PRIMARY KEY,
    name TEXT,
    created_at REAL NOT NULL,
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS snapshots_name ON snapshots(name, created_at);
"""
SNAPSHOT_INDEXES = """
CREATE INDEX IF NOT EXISTS snapshots_template ON snapshots(template_id, created_at);
CREATE INDEX IF NOT EXISTS snapshots_source ON snapshots(source);
CREATE INDEX IF NOT EXISTS snapshots_uploading ON snapshots(created_at)
    WHERE json_extract(doc, '$.storage') = 'uploading';
"""

Doc = dict[str, Any]
# a sandbox record to write: (id, state, doc, now); state None deletes it
SandboxWrite = tuple[str, str | None, Doc | None, float]


class MetadataStore:
    """Synchronous store; use `Metadata` from trio code."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        path.chmod(0o600)  # records may hold sandbox access tokens
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        self._add_snapshot_columns()

    def _add_snapshot_columns(self) -> None:
        """Index snapshots by template and by source sandbox (a file from before
        these columns gets them, filled from the records, in one transaction)."""
        with self._lock:
            cols = {row[1] for row in self._db.execute("PRAGMA table_info(snapshots)")}
            if "template_id" not in cols:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    self._db.execute("ALTER TABLE snapshots ADD COLUMN template_id TEXT")
                    self._db.execute("ALTER TABLE snapshots ADD COLUMN source TEXT")
                    self._db.execute(
                        "UPDATE snapshots SET template_id = json_extract(doc, '$.templateID'), "
                        "source = json_extract(doc, '$.sourceSandboxID')"
                    )
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            self._db.executescript(SNAPSHOT_INDEXES)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args: tuple[Any, ...]) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(sql, args)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[Doc]:
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [json.loads(r[0]) for r in rows]

    # -- sandboxes -----------------------------------------------------------

    def put_sandbox(self, sandbox_id: str, state: str, doc: Doc, now: float) -> None:
        self._write(
            "INSERT INTO sandboxes(id, state, updated_at, doc) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET state=excluded.state, "
            "updated_at=excluded.updated_at, doc=excluded.doc",
            (sandbox_id, state, now, json.dumps(doc, sort_keys=True)),
        )

    def write_sandboxes(self, records: list[SandboxWrite], *, sync: bool = True) -> None:
        """Each of `records` in order, in one transaction (one sync to disk for all;
        none without `sync`: then a host crash may lose it, a process crash not):
        (id, state, doc, now) is a `put_sandbox`, (id, None, None, 0) a `delete_sandbox`."""
        with self._lock:
            if not sync:
                self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                self._write_sandboxes(records)
            finally:
                if not sync:
                    self._db.execute("PRAGMA synchronous=FULL")

    def _write_sandboxes(self, records: list[SandboxWrite]) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for sandbox_id, state, doc, now in records:
                if state is None:
                    self._db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))
                    continue
                self._db.execute(
                    "INSERT INTO sandboxes(id, state, updated_at, doc) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(id) DO UPDATE SET state=excluded.state, "
                    "updated_at=excluded.updated_at, doc=excluded.doc",
                    (sandbox_id, state, now, json.dumps(doc, sort_keys=True)),
                )
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def get_sandbox(self, sandbox_id: str) -> Doc | None:
        rows = self._rows("SELECT doc FROM sandboxes WHERE id = ?", (sandbox_id,))
        return rows[0] if rows else None

    def delete_sandbox(self, sandbox_id: str) -> None:
        self._write("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    def list_sandboxes(self, state: str | None = None) -> list[Doc]:
        if state is None:
            return self._rows("SELECT doc FROM sandboxes ORDER BY updated_at, id")
        return self._rows(
            "SELECT doc FROM sandboxes WHERE state = ? ORDER BY updated_at, id", (state,)
        )

    # -- snapshots -----------------------------------------------------------

    def put_snapshot(self, snapshot_id: str, name: str | None, created_at: float, doc: Doc) -> None:
        template_id, source = doc.get("templateID"), doc.get("sourceSandboxID")
        self._write(
            "INSERT INTO snapshots(id, name, created_at, doc, template_id, source) "
            "VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET name=excluded.name, doc=excluded.doc, "
            "template_id=excluded.template_id, source=excluded.source",
            (
                snapshot_id,
                name,
                created_at,
                json.dumps(doc, sort_keys=True),
                None if template_id is None else str(template_id),
                None if source is None else str(source),
            ),
        )

    def get_snapshot(self, snapshot_id: str) -> Doc | None:
        rows = self._rows("SELECT doc FROM snapshots WHERE id = ?", (snapshot_id,))
        return rows[0] if rows else None

    def latest_snapshot_named(self, name: str) -> Doc | None:
        rows = self._rows(
            "SELECT doc FROM snapshots WHERE name = ? ORDER BY created_at DESC, id DESC LIMIT 1",
            (name,),
        )
        return rows[0] if rows else None

    def list_snapshots(self) -> list[Doc]:
        return self._rows("SELECT doc FROM snapshots ORDER BY created_at, id")

    def snapshots_of_template(self, template_id: str) -> list[Doc]:
        """The snapshots of sandboxes of `template_id`, oldest first (indexed)."""
        return self._rows(
            "SELECT doc FROM snapshots WHERE template_id = ? ORDER BY created_at, id",
            (template_id,),
        )

    def snapshots_uploading(self) -> list[Doc]:
        """The snapshots whose upload has not finished (a partial index: as many
        reads as there are of them)."""
        return self._rows(
            "SELECT doc FROM snapshots WHERE json_extract(doc, '$.storage') = 'uploading' "
            "ORDER BY created_at"
        )

    def snapshot_layer_ids(self) -> set[str]:
        """Every layer some snapshot stands on (for layer GC: read in SQLite, no
        record is parsed here)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT j.value FROM snapshots, json_each(snapshots.doc, '$.layers') j"
            ).fetchall()
        return {str(r[0]) for r in rows}

    def snapshot_names(self, limit: int) -> list[str]:
        """The first `limit` IDs and names, in sorted order, of the snapshots that are
        not the node's own (whose names start with "~"), read from indexes."""
        own = "coalesce(json_extract(doc, '$.names[0]'), name, '') LIKE '~%'"
        with self._lock:
            ids = self._db.execute(
                f"SELECT id FROM snapshots WHERE NOT {own} ORDER BY id LIMIT ?", (limit,)
            ).fetchall()
            names = self._db.execute(
                "SELECT DISTINCT name FROM snapshots WHERE name IS NOT NULL "
                "AND name NOT LIKE '~%' ORDER BY name LIMIT ?",
                (limit,),
            ).fetchall()
        return sorted({str(r[0]) for r in ids} | {str(r[0]) for r in names})[:limit]

    def snapshots_from(self, sandbox_id: str) -> list[Doc]:
        """The snapshots taken of sandbox `sandbox_id`, oldest first (indexed)."""
        return self._rows(
            "SELECT doc FROM snapshots WHERE source = ? ORDER BY created_at, id", (sandbox_id,)
        )

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._write("DELETE FROM snapshots WHERE id = ?", (snapshot_id,))


@dataclass
class _Put:
    record: SandboxWrite
    sync: bool = True
    done: bool = False
    error: Exception | None = None


class Metadata:
    """Async face of a MetadataStore: each call runs in a worker thread, serially."""

    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self._limiter = trio.CapacityLimiter(1)
        self._puts: list[_Put] = []
        self._put_lock = trio.Lock()  # (FIFO)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def put_sandbox(
        self, sandbox_id: str, state: str, doc: Doc, now: float, *, sync: bool = True
    ) -> None:
        """`MetadataStore.put_sandbox`, committed when this returns; the records of
        concurrent callers are committed together (group commit: 20 creates at once
        wait for one sync to disk, not for 20 in a row). `sync=False`: the record
        need not survive a host crash (`MetadataStore.write_sandboxes`); a batch
        is synced if any of its records asks."""
        await self._write_sandbox((sandbox_id, state, doc, now), sync)

    async def delete_sandbox(self, sandbox_id: str, *, sync: bool = True) -> None:
        """`MetadataStore.delete_sandbox`, committed with concurrent writes (`put_sandbox`)."""
        await self._write_sandbox((sandbox_id, None, None, 0.0), sync)

    async def _write_sandbox(self, record: SandboxWrite, sync: bool) -> None:
        put = _Put(record, sync)
        self._puts.append(put)
        async with self._put_lock:
            if not put.done:  # the first waiter writes what every waiter queued
                batch, self._puts = self._puts, []
                records = [p.record for p in batch]
                try:
                    await self.run(
                        functools.partial(
                            self.store.write_sandboxes, records, sync=any(p.sync for p in batch)
                        )
                    )
                except Exception as exc:
                    for p in batch:
                        p.error = exc
                for p in batch:
                    p.done = True
        if put.error is not None:
            raise put.error
