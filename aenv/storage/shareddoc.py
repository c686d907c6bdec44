"""One small document read and replaced with conditional writes, from a worker thread.

The OIDC key ring and the secrets are each one JSON document: a node's own
file (`FileDoc`, replaced atomically, mode 0600) or, in a cluster, an object
in the store every node shares (`StoreDoc`, written with the store's
create-if-absent and compare-and-swap, as the ownership leases are). Both
answer `load() -> (data or None, version)` and `save(data, expect=version)
-> bool` (False: someone else wrote first; load again and redo the change),
so the code above them is the same on one node and in a cluster. Blocking:
call them from a worker thread; `StoreDoc` runs the store's calls on the
trio loop that started the thread (`trio.from_thread.run`).

`sealing_key(secret, purpose)` derives a 32-byte key from the cluster's
shared secret (HKDF-SHA256, one per purpose), for what the store must only
hold encrypted.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import trio
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from aenv.kit.files import write_atomic
from aenv.storage.objstore import ObjectStore, Version


class SharedDoc(Protocol):
    def load(self) -> tuple[bytes | None, object]: ...

    def save(self, data: bytes, *, expect: object) -> bool: ...


class FileDoc:
    """The document in a file of this node (one process writes it: a lock suffices)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def load(self) -> tuple[bytes | None, object]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None, None
        return data, hashlib.sha256(data).hexdigest()

    def save(self, data: bytes, *, expect: object) -> bool:
        with self._lock:
            if self.load()[1] != expect:
                return False
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomic(self.path, data)
            os.chmod(self.path, 0o600)
            return True


class StoreDoc:
    """The document at `key` in the cluster's store."""

    def __init__(self, store: ObjectStore, key: str) -> None:
        self.store = store
        self.key = key

    def load(self) -> tuple[bytes | None, object]:
        found = trio.from_thread.run(self.store.get_versioned, self.key)
        return (None, None) if found is None else (found.data, found.version)

    def save(self, data: bytes, *, expect: object) -> bool:
        if expect is None:
            return trio.from_thread.run(self.store.create, self.key, data) is not None
        assert isinstance(expect, Version)
        swapped = trio.from_thread.run(
            lambda: self.store.compare_and_swap(self.key, data, expect=expect)
        )
        return swapped is not None


class Contended(Exception):
    """Other writers kept changing the document: the change was not made."""


Json = dict[str, Any]


def update_json(
    doc: SharedDoc, change: Callable[[Json | None], Json | None], *, attempts: int = 20
) -> Json | None:
    """Apply `change` (the current document, None when there is none, to the new
    one, or None for no write) until a conditional write lands; the document
    as it is afterwards. `change` may run more than once and may raise.

    Each write carries a fresh `write` token: a write whose answer was lost
    (the store retried it) is recognised on the next read, never redone on
    top of itself.
    """
    for _ in range(attempts):
        data, version = doc.load()
        current = None if data is None else json.loads(data)
        new = change(current)
        if new is None:
            return current
        token = secrets.token_hex(8)
        new = {**new, "write": token}
        if doc.save(json.dumps(new).encode(), expect=version):
            return new
        again = doc.load()[0]
        if again is not None and json.loads(again).get("write") == token:
            return new
    raise Contended(f"gave up after {attempts} conflicting writes")


def sealing_key(secret: str, purpose: str) -> bytes:
    """32 bytes for `purpose`, derived from the cluster's shared secret."""
    return HKDF(
        algorithm=hashes.SHA256(), length=32, salt=None, info=f"aenv {purpose} v1".encode()
    ).derive(secret.encode())
