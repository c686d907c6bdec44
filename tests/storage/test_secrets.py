"""The node's secret store: write-only values, encrypted at rest, versioned.

Rules: a store in a temporary directory; a test reads the files it wrote to
check what an attacker with the disk (and not the key) would see.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag

from aenv.storage.secrets import SecretError, SecretExists, SecretNotFound, SecretStore

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
