"""Templates in the object store: found by ID or alias in a few reads, an old
store's aliases indexed once, stale pointers never believed.

A real object store (a local directory through obstore) in `tmp_path`.
"""

from __future__ import annotations

import json
from pathlib import Path

from aenv.storage.objstore import ObjectStore, open_object_store
from aenv.storage.sharedtemplates import (
    ALIASES_COMPLETE,
    alias_key,
    find_template,
    index_aliases,
    put_template,
    template_key,
)


def record(template_id: str, *aliases: str) -> bytes:
    return json.dumps({"templateID": template_id, "aliases": list(aliases)}).encode()


def store_in(tmp_path: Path) -> ObjectStore:
    return open_object_store((tmp_path / "store").as_uri())


async def found_id(store: ObjectStore, name: str) -> str | None:
    found = await find_template(store, name)
    return None if found is None else str(found[1]["templateID"])


async def test_found_by_id_and_alias_and_a_stale_pointer_is_nobodys(tmp_path: Path) -> None:
    store = store_in(tmp_path)
    await store.put(ALIASES_COMPLETE, b"")
    await put_template(store, "tpl-a", record("tpl-a", "alpha", "first"), ["alpha", "first"])
    assert await found_id(store, "tpl-a") == "tpl-a"
    assert await found_id(store, "alpha") == "tpl-a"
    assert await found_id(store, "first") == "tpl-a"
    assert await found_id(store, "nobody") is None
    # tpl-a deleted (its pointers stay), then its alias taken by another template
    await store.delete(template_key("tpl-a"))
    assert await found_id(store, "alpha") is None
    await put_template(store, "tpl-b", record("tpl-b", "alpha"), ["alpha"])
    assert await found_id(store, "alpha") == "tpl-b"
    # a pointer whose template no longer lists the alias is not believed either
    await store.put(template_key("tpl-b"), record("tpl-b", "beta"))
    assert await found_id(store, "alpha") is None


async def test_a_store_from_before_the_index_is_searched_then_indexed_once(
    tmp_path: Path,
) -> None:
    store = store_in(tmp_path)
    # records as nodes from before the alias index shared them: no pointers
    await store.put(template_key("tpl-old"), record("tpl-old", "legacy"))
    await store.put(template_key("tpl-two"), record("tpl-two", "second"))
    assert await found_id(store, "legacy") == "tpl-old"  # looked through every record
    # a node of this version shared one meanwhile, with the same alias as an old one
    await put_template(store, "tpl-new", record("tpl-new", "fresh", "second"), ["fresh", "second"])
    assert await index_aliases(store) == 1  # "legacy"; "second" and "fresh" had pointers
    assert await store.exists(ALIASES_COMPLETE)
    assert json.loads(await store.get(alias_key("legacy"))) == {"templateID": "tpl-old"}
    assert await found_id(store, "second") == "tpl-new"  # the newer share's pointer kept
    assert await index_aliases(store) == 0
    # once indexed, a record without a pointer is not looked for: no scan on a miss
    await store.put(template_key("tpl-late"), record("tpl-late", "late"))
    assert await found_id(store, "late") is None
    assert await found_id(store, "tpl-late") == "tpl-late"
