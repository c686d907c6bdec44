"""Templates in the object store: their records by ID, and an index of their aliases.

    templates/<template id>.json   a template's record (its `template.json`)
    template-aliases/<alias>       {"templateID": ID}: the template with that alias
    template-aliases/.complete     present once the aliases of every template shared
                                   before the index existed are in it

A node asked for a name it does not know finds the template in at most three
reads (the ID's record; else the alias's pointer, then that record), however
many templates the store holds. A pointer is written after its record and
believed only if the record it leads to still lists the alias, so a share
interrupted between the two (it is resumed) or a deleted template (its
pointers stay behind) never leads to the wrong template. Stores written by
nodes from before the index are indexed once (`index_aliases`); until that
is done, a miss looks through every record as those nodes did.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from aenv.proto.ids import NAME_RE
from aenv.storage.objstore import ObjectNotFound, ObjectStore

log = logging.getLogger("aenv.durable")

TEMPLATE_PREFIX = "templates"
ALIAS_PREFIX = "template-aliases"
ALIASES_COMPLETE = f"{ALIAS_PREFIX}/.complete"

Found = tuple[bytes, dict[str, Any]]


def template_key(template_id: str) -> str:
    return f"{TEMPLATE_PREFIX}/{template_id}.json"


def alias_key(alias: str) -> str:
    return f"{ALIAS_PREFIX}/{alias}"


async def template_record(store: ObjectStore, key: str) -> Found | None:
    """A template record from the store, raw and parsed; None if absent or unreadable
    (StoreUnavailable is raised)."""
    try:
        raw = await store.get(key)
        doc = json.loads(raw)
    except ObjectNotFound:
        return None
    except ValueError as exc:
        log.warning("template record %s in the object store: %s", key, exc)
        return None
    return (raw, doc) if isinstance(doc, dict) else None


async def put_template(
    store: ObjectStore, template_id: str, body: bytes, aliases: Sequence[str]
) -> None:
    """Share a template's record, then point each of its aliases at it."""
    await store.put(template_key(template_id), body)
    pointer = json.dumps({"templateID": template_id}).encode()
    for alias in aliases:
        await store.put(alias_key(alias), pointer)


async def find_template(store: ObjectStore, name: str) -> Found | None:
    """The record of the template with ID or alias `name` (`name` checked by the caller)."""
    found = await template_record(store, template_key(name))
    if found is not None and found[1].get("templateID") == name:
        return found
    try:
        pointer = json.loads(await store.get(alias_key(name)))
    except ObjectNotFound:
        pointer = None
    except ValueError:
        pointer = {}
    if pointer is not None:
        target = str(pointer.get("templateID") or "") if isinstance(pointer, dict) else ""
        found = await template_record(store, template_key(target)) if target else None
        if found is not None and name in (found[1].get("aliases") or ()):
            return found
        return None  # a stale pointer: the alias is nobody's
    if await store.exists(ALIASES_COMPLETE):
        return None
    for info in await store.list(TEMPLATE_PREFIX + "/"):  # a store not indexed yet
        found = await template_record(store, info.key)
        if found is not None and name in (found[1].get("aliases") or ()):
            return found
    return None


async def index_aliases(store: ObjectStore) -> int:
    """Point the aliases of every shared template that has no pointer yet at it, then
    mark the index complete (once per store; idempotent). Returns pointers written."""
    if await store.exists(ALIASES_COMPLETE):
        return 0
    written = 0
    for info in await store.list(TEMPLATE_PREFIX + "/"):
        found = await template_record(store, info.key)
        if found is None or not isinstance(found[1].get("templateID"), str):
            continue
        pointer = json.dumps({"templateID": found[1]["templateID"]}).encode()
        for alias in found[1].get("aliases") or ():
            if (
                isinstance(alias, str)
                and NAME_RE.fullmatch(alias)
                and await store.put(alias_key(alias), pointer, if_absent=True)
            ):
                written += 1
    await store.put(ALIASES_COMPLETE, b"")
    log.info("indexed %d template aliases in the object store", written)
    return written


__all__ = [
    "ALIASES_COMPLETE",
    "alias_key",
    "find_template",
    "index_aliases",
    "put_template",
    "template_key",
    "template_record",
]
