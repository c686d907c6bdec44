"""ImageCatalog: the records of pulled images, indexed, in one SQLite file.

A node may hold a million images; finding one by reference, by manifest
digest or by one of its layers must not read the others. The catalog keeps
each record (a JSON document) keyed by the image's key, with three indexes:
the manifest digest (newest pull first), the references (a tag names
exactly one image: recording an image under a reference takes it from any
other, so the last image recorded under a tag is the one it finds), and the
layers (which image a layer's blob can be fetched again through).

Every write is one transaction in WAL mode with `synchronous=FULL`, so a
crash leaves the record, its references and its layers all there or none
of them. Calls block (microseconds for a lookup): the image store makes
them from worker threads; a lock serialises them on the one connection.

Homes from before the catalog kept one JSON file per image under
`records/`: `import_legacy` takes them all in one transaction (a tag
claimed by several goes to the newest pull, as the old lookup answered)
and then moves the directory aside, so a crash during the import leaves the
files to be imported again at the next start.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.kit.faults import crash_point
from aenv.kit.files import fsync_dir

__all__ = ["CatalogEntry", "ImageCatalog"]

log = logging.getLogger("aenv.images")

SCHEMA = """
CREATE TABLE IF NOT EXISTS images (
    key TEXT PRIMARY KEY,
    digest TEXT NOT NULL,
    pulled_at REAL NOT NULL,
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS images_digest ON images(digest, pulled_at);
CREATE INDEX IF NOT EXISTS images_pulled ON images(pulled_at, key);
CREATE TABLE IF NOT EXISTS image_refs (
    ref TEXT PRIMARY KEY,
    key TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS image_refs_key ON image_refs(key);
CREATE TABLE IF NOT EXISTS image_layers (
    layer TEXT NOT NULL,
    pulled_at REAL NOT NULL,
    key TEXT NOT NULL,
    PRIMARY KEY (layer, pulled_at, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS image_layers_key ON image_layers(key);
"""

MIGRATED_SUFFIX = ".migrated"


@dataclass(frozen=True, kw_only=True)
class CatalogEntry:
    """One image as the catalog holds it: its document and the references it owns."""

    key: str
    doc: dict[str, Any]
    references: tuple[str, ...]


class ImageCatalog:
    """Image records by key, reference, digest and layer (blocking; thread-safe)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _one(self, sql: str, args: tuple[Any, ...]) -> CatalogEntry | None:
        with self._lock:
            row = self._db.execute(sql, args).fetchone()
            if row is None:
                return None
            refs = self._db.execute(
                "SELECT ref FROM image_refs WHERE key = ? ORDER BY ref", (row[0],)
            ).fetchall()
        return CatalogEntry(
            key=row[0], doc=json.loads(row[1]), references=tuple(r[0] for r in refs)
        )

    # -- writes --------------------------------------------------------------

    def put(
        self, *, key: str, digest: str, pulled_at: float, doc: dict[str, Any], claim: str
    ) -> None:
        """Record image `key` (replacing its document) and give it reference `claim`
        (taken from whichever image had it); the references it had stay its own."""
        layers = [str(x) for x in doc.get("layers") or ()]
        with self._transaction() as db:
            _put(db, key=key, digest=digest, pulled_at=pulled_at, doc=doc, layers=layers)
            crash_point("images.catalog.put")
            if claim:
                db.execute(
                    "INSERT INTO image_refs(ref, key) VALUES (?, ?) "
                    "ON CONFLICT(ref) DO UPDATE SET key = excluded.key",
                    (claim, key),
                )

    def import_legacy(self, records_dir: Path) -> int:
        """Take the JSON records of a home from before the catalog (`records/*.json`),
        all in one transaction, then move the directory aside; returns how many."""
        if not records_dir.is_dir():
            return 0
        docs = []
        for path in records_dir.glob("*.json"):
            try:
                doc = json.loads(path.read_bytes())
                docs.append((float(doc.get("pulledAt") or 0.0), str(doc["key"]), doc))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("skipping image record %s: %s", path.name, exc)
        docs.sort(key=lambda t: (t[0], t[1]))  # oldest first: the newest pull takes a tag last
        with self._transaction() as db:
            for n, (pulled_at, key, doc) in enumerate(docs):
                _put(
                    db,
                    key=key,
                    digest=str(doc.get("manifestDigest") or ""),
                    pulled_at=pulled_at,
                    doc=doc,
                    layers=[str(x) for x in doc.get("layers") or ()],
                )
                refs = doc.get("references")
                if refs is None:
                    refs = [doc.get("reference")]
                db.executemany(
                    "INSERT INTO image_refs(ref, key) VALUES (?, ?) "
                    "ON CONFLICT(ref) DO UPDATE SET key = excluded.key",
                    [(str(r), key) for r in refs if r],
                )
                if n == len(docs) // 2:
                    crash_point("images.catalog.import")
        aside = records_dir.with_name(records_dir.name + MIGRATED_SUFFIX)
        n = 0
        while aside.exists():
            n += 1
            aside = records_dir.with_name(f"{records_dir.name}{MIGRATED_SUFFIX}.{n}")
        os.rename(records_dir, aside)
        fsync_dir(records_dir.parent)
        log.info("imported %d image records into the catalog (files kept in %s)", len(docs), aside)
        return len(docs)

    # -- lookups -------------------------------------------------------------

    def get(self, key: str) -> CatalogEntry | None:
        return self._one("SELECT key, doc FROM images WHERE key = ?", (key,))

    def by_reference(self, ref: str) -> CatalogEntry | None:
        """The image that reference `ref` names (the last recorded under it)."""
        return self._one(
            "SELECT i.key, i.doc FROM image_refs r JOIN images i ON i.key = r.key WHERE r.ref = ?",
            (ref,),
        )

    def by_digest(self, digest: str) -> CatalogEntry | None:
        """The newest pull of the image with manifest digest `digest`."""
        return self._one(
            "SELECT key, doc FROM images WHERE digest = ? ORDER BY pulled_at DESC LIMIT 1",
            (digest,),
        )

    def by_layer(self, layer: str) -> CatalogEntry | None:
        """The newest pulled image that has layer blob `layer`."""
        return self._one(
            "SELECT i.key, i.doc FROM image_layers l JOIN images i ON i.key = l.key "
            "WHERE l.layer = ? ORDER BY l.pulled_at DESC LIMIT 1",
            (layer,),
        )

    def page(self, *, limit: int | None = None, offset: int = 0) -> list[CatalogEntry]:
        """Images newest first, `limit` of them from `offset` (None: all)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT key, doc FROM images ORDER BY pulled_at DESC, key LIMIT ? OFFSET ?",
                (-1 if limit is None else limit, offset),
            ).fetchall()
            refs: dict[str, list[str]] = {}
            for key, ref in self._refs_of([r[0] for r in rows]):
                refs.setdefault(key, []).append(ref)
        return [
            CatalogEntry(key=k, doc=json.loads(d), references=tuple(sorted(refs.get(k, ()))))
            for k, d in rows
        ]

    def _refs_of(self, keys: list[str]) -> Iterable[tuple[str, str]]:
        for i in range(0, len(keys), 500):
            part = keys[i : i + 500]
            marks = ",".join("?" * len(part))
            yield from self._db.execute(
                f"SELECT key, ref FROM image_refs WHERE key IN ({marks})",
                part,
            ).fetchall()

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM images").fetchone()[0])


def _put(
    db: sqlite3.Connection,
    *,
    key: str,
    digest: str,
    pulled_at: float,
    doc: dict[str, Any],
    layers: list[str],
) -> None:
    body = {k: v for k, v in doc.items() if k != "references"}  # the refs table owns those
    db.execute(
        "INSERT INTO images(key, digest, pulled_at, doc) VALUES (?, ?, ?, ?) "
        "ON CONFLICT(key) DO UPDATE SET digest = excluded.digest, "
        "pulled_at = excluded.pulled_at, doc = excluded.doc",
        (key, digest, pulled_at, json.dumps(body, sort_keys=True)),
    )
    # with the pull's time, so the newest image with a layer is the first index entry
    # (a base layer may be in a hundred thousand images)
    db.execute("DELETE FROM image_layers WHERE key = ?", (key,))
    db.executemany(
        "INSERT OR IGNORE INTO image_layers(layer, pulled_at, key) VALUES (?, ?, ?)",
        [(layer, pulled_at, key) for layer in layers],
    )
