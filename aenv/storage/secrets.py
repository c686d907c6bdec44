"""The secrets (`/secrets`): write-only values, encrypted at rest.

E2B's `Secret` API stores named values that sandboxes never see: the egress
proxy resolves `${e2b.secrets.NAME}` placeholders in the headers of requests
leaving a sandbox (`network.rules`). This store is what the API writes and
what the proxy reads:

- a value is accepted by `create` and `update` and never returned by any
  method the API uses; `reveal` is for the egress proxy only;
- values are encrypted with AES-256-GCM, each version with its own nonce,
  the secret's ID and version as associated data (a ciphertext moved to
  another secret or version does not decrypt);
- the records (ID, canonical name, versions, metadata, times, ciphertexts)
  are one `aenv.storage.shareddoc` document, changed with conditional
  writes. On a node of its own: `{dir}/secrets.json` (mode 0600) and the
  node's key `{dir}/key` (32 random bytes, 0600, made on first use). In a
  cluster with a store (`SecretStore.shared`): the store's
  `secrets/secrets.json`, under a key derived from the cluster secret, so
  every node's API and egress proxy see the same secrets (the proxy may use
  what it read up to `SHARED_REVEAL_TTL_S` earlier).

Names are lowercased; they cannot be empty, contain `{`, `}` or control
characters (they are interpolated into placeholders) or start with `sec_`
(IDs do). Metadata follows E2B's bounds (32 entries, keys 128 bytes, values
1024 bytes, 8192 bytes in all). Blocking: call it from a worker thread (in a
cluster, one the trio loop started: the store is reached through it).
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from aenv.storage.objstore import ObjectStore
from aenv.storage.shareddoc import FileDoc, SharedDoc, StoreDoc, sealing_key, update_json

MAX_NAME: Final = 256
MAX_VALUE: Final = 64 * 1024
MAX_SECRETS: Final = 10_000
MAX_VERSIONS: Final = 100  # older versions are dropped beyond this
MAX_META_ITEMS: Final = 32
MAX_META_KEY: Final = 128
MAX_META_VALUE: Final = 1024
MAX_META_TOTAL: Final = 8192
_BAD_NAME: Final = re.compile(r"[{}\x00-\x1f\x7f-\x9f]")
_ID_ALPHABET: Final = "abcdefghijklmnopqrstuvwxyz0123456789"
STORE_KEY: Final = "secrets/secrets.json"
# how long the egress proxy may use a cluster's secrets before reading them again
SHARED_REVEAL_TTL_S: Final = 2.0


class SecretError(ValueError):
    """A request the store refuses (the API answers 400)."""


class SecretNotFound(KeyError):
    pass


class SecretExists(SecretError):
    """A secret of that name exists already (the API answers 409)."""


@dataclass(frozen=True, kw_only=True)
class SecretInfo:
    """A secret as every read surface shows it: never its value."""

    secret_id: str
    name: str
    version: int
    metadata: Mapping[str, str]
    created_at: float
    updated_at: float


@dataclass(kw_only=True)
class _Record:
    secret_id: str
    name: str
    version: int
    metadata: dict[str, str]
    created_at: float
    updated_at: float
    # version -> nonce + ciphertext, base64
    sealed: dict[str, str] = field(default_factory=dict)

    def info(self) -> SecretInfo:
        return SecretInfo(
            secret_id=self.secret_id,
            name=self.name,
            version=self.version,
            metadata=dict(self.metadata),
            created_at=self.created_at,
            updated_at=self.updated_at,
        )


def canonical_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise SecretError("name must be a non-empty string")
    if len(name) > MAX_NAME or _BAD_NAME.search(name):
        raise SecretError(
            "a secret name cannot be longer than 256 characters or contain '{', '}' or "
            "control characters"
        )
    name = name.lower()
    if name.startswith("sec_"):
        raise SecretError("the sec_ prefix is reserved for secret identifiers")
    return name


def check_value(value: object) -> str:
    if not isinstance(value, str):
        raise SecretError("value must be a string")
    if len(value.encode()) > MAX_VALUE:
        raise SecretError(f"value must be at most {MAX_VALUE} bytes")
    return value


def check_metadata(raw: object) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise SecretError("metadata must be an object of strings")
    if len(raw) > MAX_META_ITEMS:
        raise SecretError(f"metadata has more than {MAX_META_ITEMS} entries")
    total = 0
    out: dict[str, str] = {}
    for k, v in raw.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise SecretError("metadata must be an object of strings")
        kb, vb = len(k.encode()), len(v.encode())
        if not k or kb > MAX_META_KEY or vb > MAX_META_VALUE:
            raise SecretError(
                f"metadata keys are 1-{MAX_META_KEY} bytes, values at most {MAX_META_VALUE}"
            )
        total += kb + vb
        out[k] = v
    if total > MAX_META_TOTAL:
        raise SecretError(f"metadata is more than {MAX_META_TOTAL} bytes")
    return out


class SecretStore:
    """The secrets in `doc` (see the module docstring): by default this node's
    files in `directory`; `SecretStore.shared` keeps them in a cluster's store."""

    def __init__(
        self,
        directory: Path,
        *,
        doc: SharedDoc | None = None,
        key: bytes | None = None,
        reveal_ttl_s: float = 0.0,
    ) -> None:
        self.dir = directory
        self._doc = doc if doc is not None else FileDoc(directory / "secrets.json")
        self._aead: AESGCM | None = None if key is None else AESGCM(key)
        self._lock = threading.Lock()
        self._reveal_ttl_s = reveal_ttl_s
        self._cached: tuple[float, dict[str, _Record]] | None = None

    @classmethod
    def shared(cls, store: ObjectStore, cluster_secret: str) -> SecretStore:
        """The cluster's secrets: one document in `store`, values sealed under a key
        derived from the cluster secret. The egress proxy's reads may lag another
        node's change by `SHARED_REVEAL_TTL_S`."""
        return cls(
            Path("/nonexistent"),
            doc=StoreDoc(store, STORE_KEY),
            key=sealing_key(cluster_secret, "secrets"),
            reveal_ttl_s=SHARED_REVEAL_TTL_S,
        )

    # -- the document -------------------------------------------------------------

    def _key(self) -> AESGCM:
        if self._aead is None:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = self.dir / "key"
            try:
                key = path.read_bytes()
            except FileNotFoundError:
                key = AESGCM.generate_key(bit_length=256)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(key)
                    f.flush()
                    os.fsync(f.fileno())
            if len(key) != 32:
                raise RuntimeError(f"{path} is not a 32-byte key")
            self._aead = AESGCM(key)
        return self._aead

    @staticmethod
    def _records(doc: Mapping[str, Any] | None) -> dict[str, _Record]:
        secrets_ = [] if doc is None else doc["secrets"]
        return {d["secret_id"]: _Record(**d) for d in secrets_}

    def _load(self) -> dict[str, _Record]:
        data, _ = self._doc.load()
        records = self._records(None if data is None else json.loads(data))
        self._cached = (time.monotonic(), records)
        return records

    def _change(self, mutate: Callable[[dict[str, _Record]], dict[str, _Record]]) -> None:
        """Apply `mutate` to the records as they are in the document, conditionally
        (again on a conflict: another node's change); it may raise to refuse."""

        def change(current: dict[str, Any] | None) -> dict[str, Any]:
            records = mutate(self._records(current))
            return {"secrets": [r.__dict__ for r in records.values()]}

        with self._lock:
            update_json(self._doc, change)
            self._cached = None

    def _seal(self, secret_id: str, version: int, value: str) -> str:
        nonce = secrets.token_bytes(12)
        ct = self._key().encrypt(nonce, value.encode(), f"{secret_id}:{version}".encode())
        return base64.b64encode(nonce + ct).decode()

    def _find(self, records: dict[str, _Record], ref: str) -> _Record:
        rec = records.get(ref)
        if rec is None:
            low = ref.lower()
            rec = next((r for r in records.values() if r.name == low), None)
        if rec is None:
            raise SecretNotFound(ref)
        return rec

    # -- the API's operations -------------------------------------------------

    def create(
        self, name: object, value: object, metadata: object = None, *, now: float | None = None
    ) -> SecretInfo:
        canon, text, meta = canonical_name(name), check_value(value), check_metadata(metadata)
        sid = "sec_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))
        t = time.time() if now is None else now
        rec = _Record(
            secret_id=sid, name=canon, version=1, metadata=meta, created_at=t, updated_at=t
        )
        rec.sealed["1"] = self._seal(sid, 1, text)

        def add(records: dict[str, _Record]) -> dict[str, _Record]:
            if any(r.name == canon for r in records.values()):
                raise SecretExists(f"a secret named {canon!r} exists already")
            if len(records) >= MAX_SECRETS:
                raise SecretError(f"at most {MAX_SECRETS} secrets")
            return {**records, sid: rec}

        self._change(add)
        return rec.info()

    def update(
        self, ref: str, value: object, metadata: object = None, *, now: float | None = None
    ) -> SecretInfo:
        text = check_value(value)
        meta = None if metadata is None else check_metadata(metadata)
        done: list[_Record] = []

        def bump(records: dict[str, _Record]) -> dict[str, _Record]:
            old = self._find(records, ref)
            rec = _Record(**{**old.__dict__, "sealed": dict(old.sealed)})
            rec.version += 1
            rec.sealed[str(rec.version)] = self._seal(rec.secret_id, rec.version, text)
            for v in sorted(rec.sealed, key=int)[:-MAX_VERSIONS]:
                del rec.sealed[v]
            if meta is not None:
                rec.metadata = meta
            rec.updated_at = time.time() if now is None else now
            done[:] = [rec]
            return {**records, rec.secret_id: rec}

        self._change(bump)
        return done[0].info()

    def get(self, ref: str) -> SecretInfo:
        return self._find(self._load(), ref).info()

    def list(self) -> list[SecretInfo]:
        """Every secret, oldest first (the API pages over it)."""
        recs = sorted(self._load().values(), key=lambda r: (r.created_at, r.secret_id))
        return [r.info() for r in recs]

    def delete(self, ref: str) -> bool:
        """Remove the secret and every version of its value; False if there is none."""
        found: list[bool] = []

        def remove(records: dict[str, _Record]) -> dict[str, _Record]:
            try:
                rec = self._find(records, ref)
            except SecretNotFound:
                found[:] = [False]
                return records
            found[:] = [True]
            return {k: v for k, v in records.items() if k != rec.secret_id}

        if not self._find_quietly(ref):
            return False
        self._change(remove)
        return found[0]

    def _find_quietly(self, ref: str) -> bool:
        try:
            self._find(self._load(), ref)
        except SecretNotFound:
            return False
        return True

    # -- the egress proxy's only read ------------------------------------------

    def reveal(self, ref: str, version: int | None = None) -> str:
        """The value of `ref` (its current version unless `version`): for the
        egress proxy to put in a request leaving a sandbox, never for the API."""
        cached = self._cached
        if cached is not None and time.monotonic() - cached[0] < self._reveal_ttl_s:
            records = cached[1]
        else:
            records = self._load()
        rec = self._find(records, ref)
        v = rec.version if version is None else version
        sealed = rec.sealed.get(str(v))
        if sealed is None:
            raise SecretNotFound(f"{ref} version {v}")
        raw = base64.b64decode(sealed)
        aad = f"{rec.secret_id}:{v}".encode()
        return self._key().decrypt(raw[:12], raw[12:], aad).decode()
