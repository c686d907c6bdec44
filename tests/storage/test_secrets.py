"""The node's secret store: write-only values, encrypted at rest, versioned.

Rules: a store in a temporary directory (a cluster's: a `file://` object
store); a test reads the files it wrote to check what an attacker with the
disk (and not the key) would see.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import trio
from cryptography.exceptions import InvalidTag

from aenv.storage.objstore import open_object_store
from aenv.storage.secrets import (
    STORE_KEY,
    SecretError,
    SecretExists,
    SecretNotFound,
    SecretStore,
)

VALUE = "sk-live-" + "7" * 40


def test_values_are_write_only_and_encrypted(tmp_path: Path) -> None:
    store = SecretStore(tmp_path / "s")
    info = store.create("OpenAI-Key", VALUE, {"team": "a"})
    assert info.name == "openai-key" and info.version == 1 and info.secret_id.startswith("sec_")
    assert VALUE not in repr(info) and VALUE not in repr(store.list())
    on_disk = b"".join(p.read_bytes() for p in (tmp_path / "s").iterdir())
    assert VALUE.encode() not in on_disk
    for p in (tmp_path / "s").iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert store.reveal("openai-key") == VALUE
    # a fresh store over the same directory (a node restart) reads it back
    again = SecretStore(tmp_path / "s")
    assert again.get(info.secret_id) == info and again.reveal(info.secret_id) == VALUE


def test_versions_names_and_deletion(tmp_path: Path) -> None:
    store = SecretStore(tmp_path)
    info = store.create("k", "one")
    with pytest.raises(SecretExists):
        store.create("K", "two")
    updated = store.update("k", "two")
    assert updated.version == 2 and updated.metadata == {}
    assert store.reveal("k") == "two" and store.reveal("k", 1) == "one"
    assert store.update(info.secret_id, "three", {"x": "y"}).metadata == {"x": "y"}
    assert store.delete("k") and not store.delete("k")
    with pytest.raises(SecretNotFound):
        store.get(info.secret_id)


def test_a_ciphertext_moved_to_another_secret_does_not_decrypt(tmp_path: Path) -> None:
    store = SecretStore(tmp_path)
    a, b = store.create("a", "value-a"), store.create("b", "value-b")
    path = tmp_path / "secrets.json"
    doc = json.loads(path.read_text())
    by_id = {d["secret_id"]: d for d in doc["secrets"]}
    by_id[b.secret_id]["sealed"]["1"] = by_id[a.secret_id]["sealed"]["1"]
    path.write_text(json.dumps(doc))
    with pytest.raises(InvalidTag):
        SecretStore(tmp_path).reveal("b")


@pytest.mark.parametrize(
    ("name", "value", "metadata"),
    [
        ("", "v", None),
        ("a{b}", "v", None),
        ("a\nb", "v", None),
        ("sec_x", "v", None),
        ("ok", 5, None),
        ("ok", "v", {"k": 1}),
        ("ok", "v", {f"k{i}": "v" for i in range(33)}),
    ],
)
def test_refused(tmp_path: Path, name: str, value: object, metadata: object) -> None:
    with pytest.raises(SecretError):
        SecretStore(tmp_path).create(name, value, metadata)


async def test_a_cluster_shares_its_secrets_through_the_store(tmp_path: Path) -> None:
    """Two nodes' stores on one `file://` object store (its conditional writes):
    what one creates, the other reveals; the store holds no value in clear; a
    node with another cluster secret cannot decrypt."""
    objects = open_object_store((tmp_path / "store").as_uri())
    a = SecretStore.shared(objects, "cluster-secret")
    b = SecretStore.shared(objects, "cluster-secret")

    def run() -> None:
        info = a.create("Api-Key", "v1-secret-value")
        assert b.reveal("api-key") == "v1-secret-value"
        b.update(info.secret_id, "v2-secret-value")
        assert a.reveal(info.secret_id) == "v2-secret-value"
        assert [s.name for s in b.list()] == ["api-key"]
        with pytest.raises(SecretExists):
            b.create("api-key", "again")
        with pytest.raises(InvalidTag):
            SecretStore.shared(objects, "another-secret").reveal("api-key")

    await trio.to_thread.run_sync(run)
    # both nodes create at once: every create lands (conditional writes, retried)
    async with trio.open_nursery() as nursery:
        for i, s in enumerate((a, b, a, b)):
            nursery.start_soon(trio.to_thread.run_sync, s.create, f"n{i}", f"value-{i}")
    names = await trio.to_thread.run_sync(lambda: sorted(s.name for s in b.list()))
    assert names == ["api-key", "n0", "n1", "n2", "n3"]
    assert await trio.to_thread.run_sync(a.delete, "api-key")
    assert not await trio.to_thread.run_sync(b.delete, "api-key")
    raw = await objects.get(STORE_KEY)
    assert b"secret-value" not in raw and b"value-" not in raw
